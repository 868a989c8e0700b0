"""The closure of root packages under Depends and Pre-Depends, over one architecture's index.

Like apt without a solver's backtracking: each package has one version, the highest that the
first relation asking for it accepts; an alternative group (`a | b`) is satisfied by a package
already chosen, else by its first alternative that the index can satisfy; a virtual package by
a provider (sorted by name; a versioned relation needs a versioned Provides). Recommends,
Suggests and the implicit dependency on Essential packages are left out, as are excluded names.
"""

from __future__ import annotations

import difflib
import operator
from collections import deque
from dataclasses import dataclass, field

from debian.deb822 import PkgRelation
from debian.debian_support import Version

from build_graph.debian import LockError
from build_graph.debian.index import Candidate, Index

OPS = {"<<": operator.lt, "<=": operator.le, "=": operator.eq, ">=": operator.ge, ">>": operator.gt}


def satisfies(version: str, constraint: tuple[str, str] | None) -> bool:
    """Whether `version` meets a relation's (operator, version), e.g. ('>=', '2.36')."""
    if constraint is None:
        return True
    op, wanted = constraint
    return OPS[op](Version(version), Version(wanted))


def relations(text: str, owner: Candidate) -> list[list[dict]]:
    """A Depends-style field as groups of alternatives; a malformed one is an error naming its package."""
    if not text.strip():
        return []
    groups = PkgRelation.parse_relations(text)
    for group in groups:
        for alt in group:
            if not alt["name"] or any(ch in alt["name"] for ch in " ()<>="):
                raise LockError(f"cannot read the relation {text!r} of {owner.package} {owner.version}",
                                where=owner.filename)
    return groups


def relation_text(alt: dict) -> str:
    return f"{alt['name']} ({alt['version'][0]} {alt['version'][1]})" if alt["version"] else alt["name"]


@dataclass
class Resolution:
    packages: list[Candidate]
    # package -> (the package whose relation pulled it in, that relation); roots are absent
    required_by: dict[str, tuple[str, str]] = field(default_factory=dict)


class _Resolver:
    def __init__(self, index: Index, exclude: set[str], where: str):
        self.index = index
        self.exclude = exclude
        self.where = where
        self.chosen: dict[str, Candidate] = {}
        self.required_by: dict[str, tuple[str, str]] = {}
        self.queue: deque[Candidate] = deque()
        self._providers: dict[str, list[tuple[Candidate, str | None]]] | None = None

    def providers(self, name: str) -> list[tuple[Candidate, str | None]]:
        """(provider, provided version or None) for a virtual name, from each package's highest version."""
        if self._providers is None:
            table: dict[str, list[tuple[Candidate, str | None]]] = {}
            for cands in self.index.versions.values():
                best = cands[0]
                for group in relations(best.provides, best):
                    for alt in group:
                        if alt["version"] is not None and alt["version"][0] != "=":
                            continue  # Provides only allows '='
                        table.setdefault(alt["name"], []).append((best, alt["version"][1] if alt["version"] else None))
            for entries in table.values():
                entries.sort(key=lambda e: e[0].package)
            self._providers = table
        return self._providers.get(name, [])

    def chain(self, name: str) -> str:
        """root -> … -> name, each step with the relation that pulled it in."""
        steps = []
        while name in self.required_by:
            parent, rel = self.required_by[name]
            steps.append(rel)
            name = parent
        return " -> ".join([name, *reversed(steps)])

    def add(self, cand: Candidate, why: tuple[str, str] | None) -> None:
        self.chosen[cand.package] = cand
        if why is not None:
            self.required_by[cand.package] = why
        self.queue.append(cand)

    def satisfied(self, alt: dict) -> bool:
        have = self.chosen.get(alt["name"])
        if have is not None and satisfies(have.version, alt["version"]):
            return True
        return any(p.package in self.chosen and self.chosen[p.package] == p
                   and (alt["version"] is None or (v is not None and satisfies(v, alt["version"])))
                   for p, v in self.providers(alt["name"]))

    def candidate(self, alt: dict) -> Candidate | None:
        """The package version that would satisfy `alt` (None: none can, given what is chosen)."""
        name, constraint = alt["name"], alt["version"]
        if name not in self.chosen:
            for cand in self.index.versions.get(name, []):
                if satisfies(cand.version, constraint):
                    return cand
        for prov, provided in self.providers(name):
            if prov.package in self.exclude or (prov.package in self.chosen and self.chosen[prov.package] != prov):
                continue
            if constraint is None or (provided is not None and satisfies(provided, constraint)):
                return prov
        return None

    def why_not(self, alt: dict) -> str:
        name = alt["name"]
        if name in self.chosen:
            have = self.chosen[name]
            return f"{name} {have.version} is already chosen (for {self.chain(name)})"
        versions = self.index.versions.get(name)
        if versions:
            return f"{self.index.describe()} has {name} {', '.join(c.version for c in versions[:3])} only"
        if self.providers(name):
            return f"no provider of {name} fits ({', '.join(p.package for p, _ in self.providers(name))})"
        return f"{self.index.describe()} has no package or provider named {name}"

    def root(self, name: str) -> Candidate:
        if name in self.exclude:
            raise LockError(f"package {name!r} is both a root package and excluded", where=self.where)
        versions = self.index.versions.get(name)
        if versions:
            return versions[0]
        provs = [p for p, _ in self.providers(name) if p.package not in self.exclude]
        if len(provs) == 1:
            return provs[0]
        if provs:
            raise LockError(f"package {name!r} is virtual, provided by {', '.join(p.package for p in provs)}",
                            where=self.where, hint="name one of them")
        close = difflib.get_close_matches(name, self.index.versions, n=3)
        raise LockError(f"package {name!r} is not in {self.index.describe()}", where=self.where,
                        hint=f"did you mean {', '.join(close)}?" if close else
                        f"mirrors read: {', '.join(self.index.mirrors) or 'none'}")

    def run(self, roots: list[str]) -> Resolution:
        for name in roots:
            if name not in self.chosen:
                self.add(self.root(name), None)
        while self.queue:
            cand = self.queue.popleft()
            for text in (cand.pre_depends, cand.depends):
                for group in relations(text, cand):
                    self.need(cand, group)
        return Resolution(sorted(self.chosen.values(), key=lambda c: c.package), self.required_by)

    def need(self, owner: Candidate, group: list[dict]) -> None:
        if any(self.satisfied(alt) for alt in group):
            return
        live = [alt for alt in group if alt["name"] not in self.exclude]
        if not live:
            return  # every alternative is excluded: the user's choice
        text = " | ".join(relation_text(alt) for alt in group)
        for alt in live:
            cand = self.candidate(alt)
            if cand is not None:
                self.add(cand, (owner.package, text))
                return
        reasons = "; ".join(self.why_not(alt) for alt in live)
        raise LockError(f"unsatisfiable dependency {self.chain(owner.package)} -> {text}: {reasons}",
                        where=self.where, hint="exclude it (exclude = [...]) if the tree does not need it, "
                                               "or add a suite or mirror that has it")


def resolve(index: Index, roots: list[str], exclude: list[str], where: str) -> Resolution:
    """The packages `roots` need on `index`'s architecture (sorted by name), or a LockError naming
    the package, the chain that asked for it, and `where` (the target's file)."""
    return _Resolver(index, set(exclude), where).run(sorted(set(roots)))
