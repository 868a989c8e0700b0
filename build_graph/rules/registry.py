"""kind -> rule. One explicit entry per kind; no import-time magic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from build_graph.rules import (archives, cc_shared_library, cmake_project, cuda_library, cuda_toolchain,
                               deb_packages, genrule, host_tools, ninja_generator, oci_image, patched_tree,
                               py_wheel, python_env, python_lock)


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


RULES: dict[str, Rule] = {
    "pypi_archive": Rule("pypi_archive", archives.PypiArchiveAttrs, archives.plan_pypi_archive),
    "http_archive": Rule("http_archive", archives.HttpArchiveAttrs, archives.plan_http_archive),
    "extract": Rule("extract", archives.ExtractAttrs, archives.plan_extract, archives.extract_deps),
    "host_tools": Rule("host_tools", host_tools.HostToolsAttrs, host_tools.plan_host_tools),
    "cuda_toolchain": Rule("cuda_toolchain", cuda_toolchain.CudaToolchainAttrs,
                           cuda_toolchain.plan_cuda_toolchain, cuda_toolchain.cuda_toolchain_deps,
                           transition=cuda_toolchain.cuda_toolchain_transition),
    "patched_tree": Rule("patched_tree", patched_tree.PatchedTreeAttrs, patched_tree.plan_patched_tree,
                         patched_tree.patched_tree_deps, patched_tree.patched_tree_sources),
    "genrule": Rule("genrule", genrule.GenruleAttrs, genrule.plan_genrule, genrule.genrule_deps,
                    genrule.genrule_sources),
    "cuda_library": Rule("cuda_library", cuda_library.CudaLibraryAttrs, cuda_library.plan_cuda_library,
                         cuda_library.cuda_library_deps, cuda_library.cuda_library_sources),
    "cc_shared_library": Rule("cc_shared_library", cc_shared_library.CcSharedLibraryAttrs,
                              cc_shared_library.plan_cc_shared_library, cc_shared_library.cc_shared_library_deps),
    "cmake_project": Rule("cmake_project", cmake_project.CmakeProjectAttrs, cmake_project.plan_cmake_project,
                          cmake_project.cmake_project_deps, cmake_project.cmake_project_sources,
                          transition=cmake_project.cmake_project_transition),
    "ninja_generator": Rule("ninja_generator", ninja_generator.NinjaGeneratorAttrs,
                            ninja_generator.plan_ninja_generator, ninja_generator.ninja_generator_deps,
                            ninja_generator.ninja_generator_sources,
                            transition=ninja_generator.ninja_generator_transition),
    "python_env": Rule("python_env", python_env.PythonEnvAttrs, python_env.plan_python_env),
    "python_lock": Rule("python_lock", python_lock.PythonLockAttrs, python_lock.plan_python_lock,
                        sources=python_lock.python_lock_sources),
    "py_wheel": Rule("py_wheel", py_wheel.PyWheelAttrs, py_wheel.plan_py_wheel, py_wheel.py_wheel_deps,
                     py_wheel.py_wheel_sources, transition=py_wheel.py_wheel_transition),
    "deb_packages": Rule("deb_packages", deb_packages.DebPackagesAttrs, deb_packages.plan_deb_packages,
                         deb_packages.deb_packages_deps, deb_packages.deb_packages_sources,
                         transition=deb_packages.deb_packages_transition, configure=deb_packages.deb_packages_configure),
    "oci_image": Rule("oci_image", oci_image.OciImageAttrs, oci_image.plan_oci_image, oci_image.oci_image_deps),
}
