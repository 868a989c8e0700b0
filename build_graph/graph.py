"""The target DAG and its queries: deps, rdeps, somepath, allpaths, kind.

A build needs only the dependency map and an order (stdlib graphlib); the path queries use
networkx, imported when a query asks for it (it is a tenth of a no-op build's start-up).
"""

from __future__ import annotations

import dataclasses
import re
from graphlib import CycleError, TopologicalSorter
from typing import TYPE_CHECKING, Hashable, Iterable, Mapping, TypeVar

from build_graph.errors import BgraphError, GraphError, QueryError
from build_graph.labels import Label, expand, parse_label
from build_graph.workspace import Workspace

if TYPE_CHECKING:
    import networkx as nx

DependencyMap = dict[Label, list[Label]]
Node = TypeVar("Node", bound=Hashable)


def static_order(deps: Mapping[Node, Iterable[Node]]) -> list[Node] | None:
    """`list(graphlib.TopologicalSorter(deps).static_order())`, the same order, or None where
    `deps` (node -> the nodes it needs) has a cycle. graphlib keeps an object per node and
    walks the graph twice (a cycle search, then the order); at 100,000 targets that was a
    tenth of planning. Kahn's walk in first-in first-out order is graphlib's order: its
    batches of ready nodes, each taken in the order the one before made them ready."""
    waiting: dict[Node, int] = {}  # node -> needs not yet ordered (in graphlib's insertion order)
    users: dict[Node, list[Node]] = {}
    for node, needs in deps.items():
        needs = tuple(needs)
        if node in waiting:
            waiting[node] += len(needs)
        else:
            waiting[node], users[node] = len(needs), []
        for need in needs:
            if need in users:
                users[need].append(node)
            else:
                waiting[need], users[need] = 0, [node]
    order = [node for node, n in waiting.items() if not n]
    for node in order:  # grows while it is walked
        for user in users[node]:
            left = waiting[user] - 1
            waiting[user] = left
            if not left:
                order.append(user)
    return order if len(order) == len(waiting) else None


def dependency_map(ws: Workspace) -> DependencyMap:
    """Each target's direct dependencies; a cycle is reported as the full cycle."""
    from build_graph.rules.registry import RULES

    deps: DependencyMap = {}
    for label, target in ws.targets.items():
        deps[label] = list(dict.fromkeys(parse_label(text, package=label.package)
                                         for _key, text in RULES[target.kind].deps(target.attrs)))
    if static_order(deps) is None:
        try:  # graphlib finds the cycle to name
            TopologicalSorter(deps).prepare()
        except CycleError as err:
            raise _cycle_error(ws, err.args[1]) from None
    return deps


def checked(ws: Workspace) -> Workspace:
    """`ws`, marked acyclic where its static dependency graph has no cycle and names only good
    labels. Done as part of the parse, and kept with it: a build whose target files did not
    change skips the check (a twentieth of planning 100,000 targets). Where it fails the mark
    is left off, and the build checks again and reports what it finds."""
    try:
        dependency_map(ws)
    except BgraphError:
        return ws
    return dataclasses.replace(ws, acyclic=True)


def _cycle_error(ws: Workspace, found: list[Label]) -> GraphError:
    # graphlib lists each node before the one that depends on it; say it the other way
    # round (a -> b: a depends on b), starting from the cycle's first target in the workspace.
    cycle = list(reversed(found[1:]))
    order = {label: i for i, label in enumerate(ws.targets)}
    start = min(range(len(cycle)), key=lambda i: order.get(cycle[i], len(order)))
    cycle = cycle[start:] + cycle[:start]
    first = ws.targets[cycle[0]]
    return GraphError("dependency cycle: " + " -> ".join(str(c) for c in cycle + cycle[:1]),
                      where=f"{first.file} [{first.table}]")


def build_graph(ws: Workspace) -> "nx.DiGraph":
    """The networkx graph for queries: edges point from a target to each dependency."""
    import networkx as nx

    g = nx.DiGraph()
    for label, ds in dependency_map(ws).items():
        g.add_node(label, kind=ws.targets[label].kind)
        for d in ds:
            g.add_edge(label, d)
    return g


def deps_in_order(dep_map: DependencyMap, roots: Iterable[Label]) -> list[Label]:
    """Roots and everything they depend on, dependencies first."""
    closure: DependencyMap = {}
    todo = list(roots)
    while todo:
        label = todo.pop()
        if label not in closure:
            closure[label] = dep_map.get(label, [])
            todo += closure[label]
    return list(TopologicalSorter(closure).static_order())


def deps(g: "nx.DiGraph", roots: Iterable[Label]) -> list[Label]:
    """Roots and everything they depend on, dependencies first (over a query graph)."""
    return deps_in_order({n: list(g.successors(n)) for n in g.nodes}, roots)


def rdeps(g: "nx.DiGraph", universe: Iterable[Label], targets: Iterable[Label]) -> list[Label]:
    """Members of the universe that depend on (or are) one of the targets."""
    import networkx as nx

    uni = set(universe)
    out: set[Label] = set()
    for t in targets:
        out |= ({t} | nx.ancestors(g, t)) & uni
    return sorted(out)


def allpaths(g: "nx.DiGraph", src: Label, dst: Label) -> list[list[Label]]:
    import networkx as nx

    return [list(p) for p in nx.all_simple_paths(g, src, dst)] if src != dst else [[src]]


def somepath(g: "nx.DiGraph", src: Label, dst: Label) -> list[Label]:
    import networkx as nx

    try:
        return list(nx.shortest_path(g, src, dst))
    except nx.NetworkXNoPath:
        return []


# -- query expressions --------------------------------------------------------------
MAX_QUERY_DEPTH = 100  # far beyond a written query, far below Python's recursion limit
_TOKEN = re.compile(r"\s*(?:(?P<word>[A-Za-z_]+)\s*\(|(?P<close>\))|(?P<comma>,)|(?P<atom>[^\s(),]+))")


class Query:
    """deps(X) | rdeps(U, X) | somepath(A, B) | allpaths(A, B) | kind(NAME, X) | a label or pattern.

    The result is a set of labels, plus (for path queries) the edges that make the paths.
    """

    def __init__(self, ws: Workspace, g: nx.DiGraph):
        self.ws, self.g = ws, g

    def run(self, text: str) -> tuple[list[Label], list[tuple[Label, Label]]]:
        tokens = self._tokens(text)
        labels, edges = self._expr(tokens)
        if tokens:
            raise QueryError(f"unexpected {tokens[0][1]!r} after a complete expression", where=text)
        return sorted(set(labels)), edges

    def _tokens(self, text: str) -> list[tuple[str, str]]:
        out, pos = [], 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise QueryError(f"cannot parse query at {text[pos:]!r}", where=text)
            kind = m.lastgroup
            out.append((kind, m.group(kind)))
            pos = m.end()
        return out

    def _expect(self, tokens, kind: str) -> str:
        if not tokens or tokens[0][0] != kind:
            got = tokens[0][1] if tokens else "end of query"
            raise QueryError(f"expected {'a ' + kind if kind != 'close' else ')'} but got {got!r}")
        return tokens.pop(0)[1]

    def _expr(self, tokens, depth: int = 0) -> tuple[list[Label], list[tuple[Label, Label]]]:
        if not tokens:
            raise QueryError("empty query")
        if depth > MAX_QUERY_DEPTH:  # the parser recurses per level: 2,000 ended in RecursionError
            raise QueryError(f"query nested more than {MAX_QUERY_DEPTH} functions deep",
                             hint="no query needs that depth: deps() of a set already follows every edge")
        kind, value = tokens.pop(0)
        if kind == "atom":
            return expand([value], self.ws.targets), []
        if kind != "word":
            raise QueryError(f"unexpected {value!r}")
        fn = value
        if fn == "kind":
            name = self._expect(tokens, "atom")
            try:
                pat = re.compile(name)
            except re.error as e:
                raise QueryError(f"kind({name}, …): {name!r} is not a regular expression: {e.msg}",
                                 hint="kind's first argument is a regex over rule kinds, e.g. kind(genrule, //...) "
                                      "or kind(extract|genrule, //...)") from None
            self._expect(tokens, "comma")
            inner, _ = self._expr(tokens, depth + 1)
            self._expect(tokens, "close")
            return [lab for lab in inner if pat.fullmatch(self.g.nodes[lab]["kind"])], []
        args = [self._expr(tokens, depth + 1)[0]]
        while tokens and tokens[0][0] == "comma":
            tokens.pop(0)
            args.append(self._expr(tokens, depth + 1)[0])
        self._expect(tokens, "close")
        arity = {"deps": 1, "rdeps": 2, "somepath": 2, "allpaths": 2}
        if fn not in arity:
            raise QueryError(f"unknown function {fn!r}", hint="use deps, rdeps, somepath, allpaths or kind")
        if len(args) != arity[fn]:
            raise QueryError(f"{fn} takes {arity[fn]} argument(s), got {len(args)}")
        if fn == "deps":
            found = deps(self.g, args[0])
            return found, [(a, b) for a, b in self.g.subgraph(found).edges]
        if fn == "rdeps":
            found = rdeps(self.g, args[0], args[1])
            return found, [(a, b) for a, b in self.g.subgraph(found).edges]
        paths = []
        for a in args[0]:
            for b in args[1]:
                if fn == "somepath":
                    p = somepath(self.g, a, b)
                    paths += [p] if p else []
                    if p:
                        break
                else:
                    paths += allpaths(self.g, a, b)
        nodes = [n for p in paths for n in p]
        edges = sorted({(p[i], p[i + 1]) for p in paths for i in range(len(p) - 1)})
        return nodes, edges
