"""kind -> rule. One explicit entry per kind; no import-time magic. A rule's module is imported
the first time its kind is asked for: a build of CUDA kernels never loads the image or CMake
rules (all of them took 40 ms of each command's start)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


def _none(attrs) -> list:
    return []


def _same(attrs, key: str, label: str, config):
    """A dependency is built in its parent's configuration."""
    return config


def _as_is(attrs, config):
    return config


@dataclass(frozen=True)
class Rule:
    kind: str
    attrs: type[BaseModel]
    plan: Callable
    deps: Callable = _none  # attrs -> [(key, label)]
    sources: Callable = _none  # attrs -> [(key, workspace path or glob)]
    version: str = "1"  # bump when the rule's actions change meaning
    # (attrs, key, label, parent's Config) -> the dependency's Config, or None: not followed there
    transition: Callable = _same
    configure: Callable = _as_is  # (attrs, Config) -> the Config this target really needs (trimming)


# kind -> (module under build_graph.rules, the Rule made from that module)
_KINDS: dict[str, tuple[str, Callable[[Any], Rule]]] = {
    "pypi_archive": ("archives", lambda m: Rule("pypi_archive", m.PypiArchiveAttrs, m.plan_pypi_archive)),
    "http_archive": ("archives", lambda m: Rule("http_archive", m.HttpArchiveAttrs, m.plan_http_archive)),
    "extract": ("archives", lambda m: Rule("extract", m.ExtractAttrs, m.plan_extract, m.extract_deps)),
    "host_tools": ("host_tools", lambda m: Rule("host_tools", m.HostToolsAttrs, m.plan_host_tools)),
    "cuda_toolchain": ("cuda_toolchain", lambda m: Rule(
        "cuda_toolchain", m.CudaToolchainAttrs, m.plan_cuda_toolchain, m.cuda_toolchain_deps,
        transition=m.cuda_toolchain_transition)),
    "patched_tree": ("patched_tree", lambda m: Rule(
        "patched_tree", m.PatchedTreeAttrs, m.plan_patched_tree, m.patched_tree_deps, m.patched_tree_sources)),
    "genrule": ("genrule", lambda m: Rule("genrule", m.GenruleAttrs, m.plan_genrule, m.genrule_deps,
                                          m.genrule_sources)),
    "cuda_library": ("cuda_library", lambda m: Rule(
        "cuda_library", m.CudaLibraryAttrs, m.plan_cuda_library, m.cuda_library_deps, m.cuda_library_sources)),
    "cc_shared_library": ("cc_shared_library", lambda m: Rule(
        "cc_shared_library", m.CcSharedLibraryAttrs, m.plan_cc_shared_library, m.cc_shared_library_deps)),
    "cmake_project": ("cmake_project", lambda m: Rule(
        "cmake_project", m.CmakeProjectAttrs, m.plan_cmake_project, m.cmake_project_deps,
        m.cmake_project_sources, transition=m.cmake_project_transition)),
    "ninja_generator": ("ninja_generator", lambda m: Rule(
        "ninja_generator", m.NinjaGeneratorAttrs, m.plan_ninja_generator, m.ninja_generator_deps,
        m.ninja_generator_sources, transition=m.ninja_generator_transition)),
    "python_env": ("python_env", lambda m: Rule("python_env", m.PythonEnvAttrs, m.plan_python_env)),
    "python_lock": ("python_lock", lambda m: Rule("python_lock", m.PythonLockAttrs, m.plan_python_lock,
                                                  sources=m.python_lock_sources)),
    "py_wheel": ("py_wheel", lambda m: Rule("py_wheel", m.PyWheelAttrs, m.plan_py_wheel, m.py_wheel_deps,
                                            m.py_wheel_sources, transition=m.py_wheel_transition)),
    "deb_packages": ("deb_packages", lambda m: Rule(
        "deb_packages", m.DebPackagesAttrs, m.plan_deb_packages, m.deb_packages_deps, m.deb_packages_sources,
        transition=m.deb_packages_transition, configure=m.deb_packages_configure)),
    "oci_image": ("oci_image", lambda m: Rule("oci_image", m.OciImageAttrs, m.plan_oci_image,
                                              m.oci_image_deps)),
}


class _Rules(MutableMapping[str, Rule]):
    """The kinds, each Rule made (and its module imported) on first use. Setting one replaces
    its Rule (tests swap a kind's planner)."""

    def __init__(self) -> None:
        self._made: dict[str, Rule] = {}

    def __getitem__(self, kind: str) -> Rule:
        rule = self._made.get(kind)
        if rule is None:
            module, make = _KINDS[kind]
            rule = self._made[kind] = make(importlib.import_module(f"build_graph.rules.{module}"))
        return rule

    def __setitem__(self, kind: str, rule: Rule) -> None:
        if kind not in _KINDS:
            raise KeyError(kind)  # a kind is one of the table's; there is no adding one at run time
        self._made[kind] = rule

    def __delitem__(self, kind: str) -> None:
        self._made.pop(kind, None)  # made again from its module on next use

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str) and kind in _KINDS  # a list or table written as `kind` is unknown

    def __iter__(self) -> Iterator[str]:
        return iter(_KINDS)

    def __len__(self) -> int:
        return len(_KINDS)


RULES: MutableMapping[str, Rule] = _Rules()
