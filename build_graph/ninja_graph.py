"""The edges of a configured Ninja build, from Ninja's own tools (pure text processing).

The configure action runs `ninja -t compdb -x` (every edge's command, response files
expanded, keyed by its first output) and `ninja -t query` over every output that `ninja -t
targets all` lists (each output's producing rule and its explicit, implicit `|` and
order-only `||` inputs). build.ninja itself is never read. Paths inside the build directory become
relative to it; every other path stays absolute.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

SKIP_RULES = ("phony", "RERUN_CMAKE")


class NinjaGraphError(ValueError):
    pass


@dataclass
class Edge:
    rule: str
    command: str
    outputs: list[str]
    explicit: list[str] = field(default_factory=list)
    implicit: list[str] = field(default_factory=list)
    order_only: list[str] = field(default_factory=list)

    def inputs(self) -> list[str]:
        return self.explicit + self.implicit + self.order_only


@dataclass
class NinjaGraph:
    edges: list[Edge]
    producer: dict[str, Edge]  # output path -> the edge writing it
    phony: dict[str, list[str]]  # phony output -> its inputs

    def resolve(self, path: str) -> list[str]:
        """A path with phony aliases followed to real files (a phony may name other phonies)."""
        out, todo, seen = [], [path], set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            if p in self.phony:
                todo.extend(self.phony[p])
            else:
                out.append(p)
        return out

    def needed(self, wanted: list[str]) -> list[Edge]:
        """The edges that `wanted` needs, dependencies first."""
        order: list[Edge] = []
        state: dict[int, int] = {}  # id(edge) -> 1 visiting, 2 done

        def visit(edge: Edge) -> None:
            mark = state.get(id(edge))
            if mark == 2:
                return
            if mark == 1:
                raise NinjaGraphError(f"dependency cycle through {edge.outputs[0]}")
            state[id(edge)] = 1
            for dep in self.deps(edge):
                visit(dep)
            state[id(edge)] = 2
            order.append(edge)

        for w in wanted:
            files = self.resolve(w)
            for f in files:
                if f not in self.producer:
                    raise NinjaGraphError(f"no build edge produces {w!r}")
                visit(self.producer[f])
        return order

    def deps(self, edge: Edge) -> list[Edge]:
        """The edges producing this edge's inputs."""
        seen: dict[int, Edge] = {}
        for i in edge.inputs():
            for f in self.resolve(i):
                if f in self.producer:
                    seen.setdefault(id(self.producer[f]), self.producer[f])
        return list(seen.values())


def relative(path: str, build_dir: str) -> str:
    """A path as the graph names it: relative to the build directory inside it, else absolute."""
    path = posixpath.normpath(posixpath.join(build_dir, path)) if not path.startswith("/") else posixpath.normpath(path)
    return path[len(build_dir) + 1:] if path.startswith(build_dir + "/") else path


def parse_query(text: str, build_dir: str) -> dict[str, tuple[str, list[str], list[str], list[str]]]:
    """`ninja -t query` output -> node -> (rule, explicit, implicit, order-only inputs)."""
    nodes: dict[str, tuple[str, list[str], list[str], list[str]]] = {}
    node, section, rule = None, None, ""
    lists: tuple[list[str], list[str], list[str]] = ([], [], [])
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        if indent == 0:
            if not body.endswith(":"):
                raise NinjaGraphError(f"unexpected `ninja -t query` line: {line!r}")
            node, section = relative(body[:-1], build_dir), None
            continue
        if node is None:
            raise NinjaGraphError(f"unexpected `ninja -t query` line: {line!r}")
        if indent == 2:
            section = body.split(":", 1)[0]
            if section == "input":
                rule = body.split(":", 1)[1].strip()
                lists = ([], [], [])
                nodes[node] = (rule, *lists)
            continue
        if section != "input":
            continue  # "outputs:" lists dependents; "validations:" are not inputs
        if body.startswith("|| "):
            lists[2].append(relative(body[3:], build_dir))
        elif body.startswith("| "):
            lists[1].append(relative(body[2:], build_dir))
        else:
            lists[0].append(relative(body, build_dir))
    return nodes


def load_graph(compdb: str, query: str, build_dir: str) -> NinjaGraph:
    """Edges from the three tools' outputs (see the module docstring)."""
    try:
        entries = json.loads(compdb)
    except ValueError as e:
        raise NinjaGraphError(f"`ninja -t compdb` printed no JSON: {e}") from None
    nodes = parse_query(query, build_dir)
    phony = {n: list(v[1] + v[2] + v[3]) for n, v in nodes.items() if v[0] == "phony"}
    edges: list[Edge] = []
    by_signature: dict[tuple, list[Edge]] = {}
    for e in entries:
        out = relative(e["output"], build_dir)
        if out not in nodes or nodes[out][0] in SKIP_RULES or not e.get("command"):
            continue
        rule, explicit, implicit, order_only = nodes[out]
        edge = Edge(rule, e["command"], [out], explicit, implicit, order_only)
        edges.append(edge)
        by_signature.setdefault((rule, tuple(explicit), tuple(implicit), tuple(order_only)), []).append(edge)
    firsts = {e.outputs[0] for e in edges}
    # compdb names each edge by its first output only; an edge's other outputs are the nodes
    # with the same rule and the same inputs.
    for node, (rule, explicit, implicit, order_only) in sorted(nodes.items()):
        if node in firsts or rule in SKIP_RULES:
            continue
        candidates = by_signature.get((rule, tuple(explicit), tuple(implicit), tuple(order_only)), [])
        if len(candidates) != 1:
            if not candidates:
                continue  # an edge compdb does not list (no command): nothing to run
            raise NinjaGraphError(f"cannot tell which of {len(candidates)} edges writes {node!r}")
        if node not in candidates[0].outputs:
            candidates[0].outputs.append(node)
    producer = {o: e for e in edges for o in e.outputs}
    return NinjaGraph(edges, producer, phony)
