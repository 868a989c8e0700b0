"""What a rule sees while planning, and the helpers that build its actions.

A rule's plan is a generator: it yields lists of actions and receives their Outcomes
(a continuation), and finally returns a TargetOutput. It never touches the disk or runs
a process; reading a blob it was handed goes through `ctx.read`, which is content-addressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Generator, Iterable

from pydantic import AfterValidator, BaseModel, ConfigDict

from build_graph.errors import PlanError, where
from build_graph.incremental.discovery import Discovery
from build_graph.labels import Label, parse_label
from build_graph.model import Action, Digester, FileEntry, HostTool, TargetOutput, Tree
from build_graph.sandbox_env import checked_attribute

PlanGen = Generator[Any, Any, TargetOutput]
# A rule's free environment attribute, and the name of a variable it sets: refused at load, not
# when the action runs (sandbox_env.py: what no handover path can give the action alike).
def _checked_name(name: str) -> str:
    checked_attribute({name: ""})
    return name


ActionEnv = Annotated[dict[str, str], AfterValidator(checked_attribute)]
EnvName = Annotated[str, AfterValidator(_checked_name)]


@dataclass(frozen=True)
class Parallel:
    """Yielded by a plan: run these sub-plans (generators) side by side; resume with their
    return values, in order. Each sub-plan yields actions or Parallels of its own."""

    plans: tuple[Any, ...]

    def __init__(self, plans: Iterable[Any]):
        object.__setattr__(self, "plans", tuple(plans))


@dataclass(frozen=True)
class Dataflow:
    """Yielded by a plan: a graph of actions, each made (by a pure function of the Outcomes of
    the steps it needs) and run as soon as those steps are done, as Ninja and Bazel run a graph.
    `steps`: name -> (names it needs, make(outcomes by name) -> Action). Resumed with every
    step's Outcome by name once all are done."""

    steps: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], Action]]]

# Every sandboxed action starts from this environment; rules add to it. It is part of the key.
BASE_ENV = {
    "PATH": "/bgraph/toolchain/bin:/usr/bin:/bin",
    "LC_ALL": "C",
    "TZ": "UTC",
    "SOURCE_DATE_EPOCH": "315532800",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
}
SRC = "/bgraph/src"
# A TargetOutput info key: the usr/ Tree of a pinned system (deb_packages), which an action sees
# as /usr (with the merged-/usr links /bin, /lib, /lib64, /sbin) instead of the host's. One Tree
# object per system, shared by every action: its digest and nodes are computed once (a subtree
# made per action cost ~1 GiB and seconds over the vLLM build).
SYSTEM_ROOT = "system_root"
SYSTEM_USR = "/usr"
OUT = "/bgraph/out"
TOOLCHAIN = "/bgraph/toolchain"


class Attrs(BaseModel):
    """Base of every kind's attribute model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


@dataclass
class RuleContext:
    label: Label
    attrs: Any
    file: str
    table: str
    platform: str
    digester: Digester
    deps: dict[Label, TargetOutput]
    sources: Tree
    pins: Any
    arch_sets: Callable[[Any, str], list[str]]
    read: Callable[[FileEntry], bytes]
    probe_host: Callable[[tuple[str, ...]], tuple[HostTool, ...]]
    rule_version: str = "1"
    extra: dict[str, Any] = field(default_factory=dict)
    # The platform actions run on; `platform` is the one outputs are for (they differ in a
    # cross build: configs.py). None: the same.
    exec_platform: str | None = None

    def __post_init__(self) -> None:
        if self.exec_platform is None:
            self.exec_platform = self.platform

    def where(self, key: str | None = None) -> str:
        return where(self.file, self.table, key)

    def dep(self, text: str, key: str) -> TargetOutput:
        """The output of a dependency named in attribute `key` (in that edge's configuration: one
        label may be built for the target and for the exec machine, configs.py)."""
        label = parse_label(text, package=self.label.package, where=self.where(key))
        return self.deps[(key, label)] if (key, label) in self.deps else self.deps[label]

    def fail(self, message: str, key: str | None = None, hint: str | None = None) -> PlanError:
        return PlanError(message, where=f"{self.label} ({self.where(key)})", hint=hint)

    def exec_action(
        self,
        name: str,
        mnemonic: str,
        argv: Iterable[str],
        *,
        inputs: dict[str, Tree],
        outputs: Iterable[str],
        env: dict[str, str] | None = None,
        toolchain: TargetOutput | None = None,
        host: TargetOutput | None = None,
        memory_mb: int = 512,
        cwd: str = OUT,
        staged: str | None = None,
        discovery: Discovery | None = None,
    ) -> Action:
        """A sandboxed action with the base environment, this platform and rule version;
        `discovery`: how it is matched where keyed on less than all it reads (incremental/discovery.py)."""
        full_env = dict(BASE_ENV)
        full_env.update(env or {})
        argv = list(argv)
        if any("\0" in a for a in argv) or any("\0" in k or "\0" in v for k, v in full_env.items()):
            # no process can be given one: exec would fail with "embedded null byte"
            raise self.fail(f"{name}: the command or its environment holds a NUL byte",
                            hint="remove the \\0 (\\u0000 in TOML) from the command")
        mounts = dict(inputs)
        toolchain_digest = None
        if toolchain is not None:
            mounts[TOOLCHAIN] = toolchain.tree
            toolchain_digest = toolchain.tree.digest(self.digester)
        host_paths: tuple[str, ...] = ()
        host_tools: tuple[HostTool, ...] = ()
        for h in (host, (toolchain.info.get("host") if toolchain else None)):
            if h is None:
                continue
            info = h.info if isinstance(h, TargetOutput) else h
            if info.get("sysroot"):
                raise self.fail("a sysroot (the target platform's packages) cannot be the system an action runs on",
                                hint="name a deb_packages target without sysroot = true as tools/host")
            usr = info.get(SYSTEM_ROOT)
            if usr is not None:  # a pinned system (deb_packages): its usr/ is the sandbox's /usr
                known = mounts.setdefault(SYSTEM_USR, usr)
                if known is not usr and known != usr:  # one shared Tree object: no 100,000-entry comparison
                    raise self.fail("two different system roots for one action (its tools and its "
                                    "toolchain's host)", hint="give the toolchain and the target the same root")
                continue
            if "host_paths" not in info:
                raise self.fail("tools/host names a target that is no system to run on (neither deb_packages "
                                "nor host_tools)", "tools",
                                hint="name a deb_packages or host_tools target, e.g. tools = \"//toolchains:host\"")
            host_paths = tuple(sorted(set(host_paths) | set(info["host_paths"])))
            host_tools = tuple(sorted(set(host_tools) | {HostTool(*t) for t in info["host_tools"]},
                                      key=lambda t: t.path))
        if SYSTEM_USR in mounts and host_paths:
            raise self.fail(f"an action cannot use both a pinned system root and host paths {list(host_paths)}",
                            hint="use the pinned root's tools (a deb_packages target), or host_tools alone")
        return Action(
            name=name,
            mnemonic=mnemonic,
            kind="exec",
            argv=tuple(argv),
            env=tuple(sorted(full_env.items())),
            inputs=tuple(sorted(mounts.items())),
            outputs=tuple(outputs),
            platform=self.platform,
            exec_platform=self.exec_platform if self.exec_platform != self.platform else "",
            toolchain=toolchain_digest,
            host_paths=host_paths,
            host_tools=host_tools,
            cwd=cwd,
            memory_mb=memory_mb,
            rule_version=self.rule_version,
            staged=staged,
            discovery=discovery,
        )

    def fetch_action(self, pin_name: str, key: str, platform: str | None = None) -> Action:
        """A fixed-output download of a pinned file (its key is the pinned sha256 alone): the
        file for the target platform, or for `platform` (a tool run on the exec machine)."""
        pin = self.pins(pin_name, self.where(key))
        platform = platform or self.platform
        try:
            f = pin.for_platform(platform)
        except KeyError:
            raise self.fail(f"pin {pin_name!r} has no file for platform {platform}", key,
                            hint=f"add [pins.{pin_name}.platforms.{platform}] to WORKSPACE.toml") from None
        filename = f.filename or (f.url.rsplit("/", 1)[-1] if f.url else pin_name)
        where_from = {"project": pin.project} if pin.kind == "pypi" else {"url": f.url}
        return fetch(f"fetch {pin_name}", filename, f.sha256, pin.kind, pin=pin_name, **where_from)

    def extract_action(self, archive: Tree, filename: str, strip_prefix: str = "") -> Action:
        """Unpack an archive file into a tree, in-process, refusing entries that escape the root."""
        return Action(name=f"extract {filename}", mnemonic="Extract", kind="extract",
                      inputs=(("archive", archive),), outputs=(".",),
                      spec=(("filename", filename), ("strip_prefix", strip_prefix)),
                      rule_version=self.rule_version, memory_mb=256)


def fetch(name: str, filename: str, sha256: str, source: str, **where_from: str) -> Action:
    """A fixed-output download. Only sha256 and filename reach the key (see Action.description):
    where the bytes come from (index, URL, pin name) never causes a refetch."""
    spec = {"sha256": sha256, "filename": filename, "source": source, **where_from}
    return Action(name=name, mnemonic="Fetch", kind="fetch", outputs=(filename,),
                  spec=tuple(sorted(spec.items())), memory_mb=64)


def labels_in(attrs: BaseModel, *keys: str) -> list[tuple[str, str]]:
    """(key, label) pairs for attributes holding a label or a list/dict of labels."""
    out: list[tuple[str, str]] = []
    for key in keys:
        value = getattr(attrs, key)
        if value is None:
            continue
        if isinstance(value, str):
            out.append((key, value))
        elif isinstance(value, dict):
            out.extend((key, v) for v in value.values())
        else:
            out.extend((key, v) for v in value)
    return out
