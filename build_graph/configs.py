"""Configurations: which platform each target is built for (Bazel's configured targets).

A build executes its actions on one exec platform (this machine; another one only to plan, with
--dry-run) and builds each target for a target platform. A configured target is (label, config);
one build may hold a label in two configurations (a wheel for aarch64 and, beside it, the same
toolchain target for x86_64), and their outputs never mix.

Where a target's configuration comes from, in order:
1. a requested target: `--platform`, else its own `platform` attribute (a transition: the Spark's
   wheel is aarch64 from any host), else the exec platform;
2. a dependency: its parent's configuration, changed by the parent rule's edge transition
   (`Rule.transition`: e.g. cmake_project's `cmake` and `ninja` run on the exec machine, so they
   are configured for it) and then by the dependency's own `platform` attribute (unless
   `--platform` was given: it fixes every target below the requested ones);
3. the dependency's rule may trim it (`Rule.configure`): a pinned system to run actions on is
   the exec machine's, whatever the target, unless it names a cross stand-in for that target.

The engine only walks the configured graph this module builds; it knows nothing of platforms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from graphlib import TopologicalSorter

from build_graph.graph import static_order
from build_graph.labels import Label, hashed_once, parse_label
from build_graph.workspace import Workspace, host_platform


@dataclass(frozen=True, order=True)
@hashed_once("exec", "target")  # configs and configured targets key the build's tables, as labels do
class Config:
    exec: str  # the platform actions run on
    target: str  # the platform the outputs are for

    @property
    def cross(self) -> bool:
        return self.exec != self.target

    def exec_config(self) -> "Config":
        """The configuration of tools that run on the exec machine."""
        return Config(self.exec, self.exec)

    def tag(self, machine: str) -> str:
        """How the configuration is written beside a label: nothing for this machine's own,
        the target platform for a cross build from here, both where the exec platform is
        another machine (a plan for it)."""
        if self.exec == machine:
            return "" if self.target == machine else self.target
        return f"{self.target} on {self.exec}"


@dataclass(frozen=True, order=True)
@hashed_once("label", "config")
class Configured:
    """A label in a configuration: the engine's unit of planning."""

    label: Label
    config: Config
    tag: str = field(default="", compare=False)  # written in parentheses, like Bazel's configurations

    @property
    def package(self) -> str:
        return self.label.package

    @property
    def name(self) -> str:
        return self.label.name

    def __str__(self) -> str:
        return f"{self.label} ({self.tag})" if self.tag else str(self.label)

    def out_path(self) -> str:
        """Where bgraph-out/ links the output: <package>/<name> for this machine's own platform,
        <target platform>/<package>/<name> for another one, so two platforms never overwrite."""
        rel = f"{self.label.package}/{self.label.name}" if self.label.package else self.label.name
        return f"{self.tag}/{rel}" if self.tag else rel


class Outputs(dict):
    """Configured target -> output; a plain Label finds the one configuration built for it."""

    def __missing__(self, key):
        if isinstance(key, Label):
            found = [v for k, v in self.items() if k.label == key]
            if len(found) == 1:
                return found[0]
        raise KeyError(key)


def own_config(ws: Workspace, label: Label, config: Config, forced: str | None) -> Config:
    """`config` as `label`'s target sees it: its `platform` attribute (unless --platform forced
    one) and its rule's trimming."""
    from build_graph.rules.registry import RULES

    target = ws.targets[label]
    fixed = getattr(target.attrs, "platform", None) if _has_platform(type(target.attrs)) else None
    if fixed and not forced:
        config = Config(config.exec, fixed)
    return RULES[target.kind].configure(target.attrs, config)


_PLATFORM_ATTR: dict[type, bool] = {}


def _has_platform(cls: type) -> bool:
    """Whether a kind's attributes can have a `platform` (a field, or anything else by that
    name): most cannot, and asking a pydantic model for a missing attribute raises and catches
    an AttributeError inside pydantic (a fifth of configuring 100,000 genrules)."""
    known = _PLATFORM_ATTR.get(cls)
    if known is None:
        known = _PLATFORM_ATTR[cls] = "platform" in getattr(cls, "model_fields", {}) or hasattr(cls, "platform")
    return known


def requested(ws: Workspace, labels: list[Label], exec_platform: str | None = None,
              forced: str | None = None) -> list[Configured]:
    """The configured targets a build of `labels` starts from."""
    exec_platform = exec_platform or host_platform()
    start = Config(exec_platform, forced or exec_platform)
    return [_configured(label, own_config(ws, label, start, forced)) for label in labels]


def _configured(label: Label, config: Config, machine: str | None = None) -> Configured:
    return Configured(label, config, config.tag(machine or host_platform()))


@dataclass
class ConfiguredGraph:
    """The configured targets below some roots, in dependency order, with each one's edges."""

    order: list[Configured]
    deps: dict[Configured, list[Configured]]
    # For planning: each configured target's (attribute key, dependency label) -> configured target.
    dep_labels: dict[Configured, dict[tuple[str, Label], Configured]]

    def inputs(self, node: Configured, outputs: Outputs) -> dict:
        """What `node`'s rule sees of its dependencies (RuleContext.dep): (key, label) -> the
        output of that edge's configuration, and label -> it where the label has one only."""
        edges = self.dep_labels[node]
        seen: dict[Label, set[Configured]] = {}
        for (_key, label), dep in edges.items():
            seen.setdefault(label, set()).add(dep)
        return {**{edge: outputs[dep] for edge, dep in edges.items()},
                **{label: outputs[next(iter(deps))] for label, deps in seen.items() if len(deps) == 1}}


def configure(ws: Workspace, roots: list[Configured], forced: str | None = None) -> ConfiguredGraph:
    """Walk the dependencies of `roots`, configuring each edge (see the module docstring)."""
    from build_graph.rules.registry import RULES

    machine = host_platform()
    deps: dict[Configured, list[Configured]] = {}
    dep_labels: dict[Configured, dict[tuple[str, Label], Configured]] = {}
    # (label, parent's config after the transition) -> configured target, worked out once:
    # 100,000 genrules name one toolchain in one configuration.
    ends: dict[tuple[Label, Config], Configured] = {}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node in deps:
            continue
        target = ws.targets[node.label]
        rule = RULES[target.kind]
        package = node.label.package
        edges: dict[tuple[str, Label], Configured] = {}
        for key, text in rule.deps(target.attrs):
            config = rule.transition(target.attrs, key, text, node.config)
            if config is None:  # an edge this configuration does not follow
                continue
            label = parse_label(text, package=package)
            dep = ends.get((label, config))
            if dep is None:
                dep = ends[(label, config)] = _configured(label, own_config(ws, label, config, forced), machine)
            edges[(key, label)] = dep
            todo.append(dep)
        dep_labels[node] = edges
        deps[node] = list(dict.fromkeys(edges.values()))
    order = static_order(deps)
    if order is None:  # the static graph was checked for cycles; graphlib says it as before
        order = list(TopologicalSorter(deps).static_order())
    return ConfiguredGraph(order, deps, dep_labels)
