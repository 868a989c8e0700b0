"""The seccomp program bwrap installs in every action's sandbox (`--seccomp FD`).

Two things a sandboxed action could otherwise do with plain syscalls (red-team R2):
- the kernel's keyrings: bwrap gives a new user keyring, but the session keyring is inherited
  through fork/exec/setsid/unshare, with full rights. An action could read the login's secrets
  (request_key + KEYCTL_READ) and leave keys a later action (another build, target or workspace)
  reads: an input no action key covers. add_key, request_key and keyctl fail with ENOSYS (as in
  Docker's and Flatpak's profiles: "no keyrings here", which programs already handle).
- tracing: the sandbox's PID 1 (bwrap's init) runs as the action's uid, so an action could
  ptrace it and clear its parent-death signal, outliving Ctrl-C and bgraph's own death.
  ptrace, process_vm_readv and process_vm_writev fail with EPERM (no build tool traces).
  So does pidfd_getfd (red-team R10): the same access to another process, through which an action
  took the eventfd on which bwrap's init reports the command's exit status, and wrote a forged 0:
  bwrap ended "successfully" while the command was still running or had failed.

Every other syscall is allowed. The program checks the ABI first: on x86_64 the 64-bit, i386
(int 0x80) and x32 ABIs each get the same rules (a 32-bit program still runs, and cannot reach
keyctl through its own syscall numbers either); on aarch64 the 64-bit and 32-bit Arm ABIs. Any
other ABI kills the process (libseccomp's "bad arch").

The programs are made with libseccomp (generate(), `python3 -m build_graph.seccomp` rewrites the
files) and kept as data here, one file per machine: bgraph itself needs only Python and
bubblewrap, not libseccomp. tests/test_seccomp.py makes them again with libseccomp where it is
installed and compares the bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import platform
import threading
from pathlib import Path

from build_graph.errors import SandboxError

ENOSYS_CALLS = ("add_key", "request_key", "keyctl")
EPERM_CALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd")

# Per machine (uname -m): the ABIs the program filters, each by libseccomp's name for it; the
# first is the native one.
ABIS = {"x86_64": ("x86_64", "x86", "x32"), "aarch64": ("aarch64", "arm")}
DIRECTORY = Path(__file__).resolve().parent


def machine() -> str:
    """This kernel's machine name, as ABIS knows it."""
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def program_path(for_machine: str | None = None) -> Path:
    """The program file for `for_machine` (this one's by default); a SandboxError where bgraph has none."""
    m = for_machine or machine()
    path = DIRECTORY / f"{m}.bpf"
    if m not in ABIS or not path.is_file():
        raise SandboxError(f"no seccomp program for this machine ({m}): bgraph sandboxes actions on "
                           f"{' and '.join(ABIS)} only", hint="run bgraph on one of those machines")
    return path


_FD: int | None = None
_FD_LOCK = threading.Lock()


def memory_file() -> int:
    """This process's sealed memory file holding the program (made once)."""
    global _FD
    with _FD_LOCK:
        if _FD is None:
            data = program_path().read_bytes()
            if not data or len(data) % 8:
                raise SandboxError(f"{program_path()} is not a seccomp program (its size is {len(data)} bytes)",
                                   hint="reinstall bgraph")
            fd = os.memfd_create("bgraph-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            offset = 0
            while offset < len(data):
                offset += os.write(fd, data[offset:])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_WRITE)
            _FD = fd
        return _FD


def open_program() -> int:
    """A new descriptor (close-on-exec: pass it on) of the program, read from its start: bwrap
    reads `--seccomp FD` to its end and closes it, so each bwrap needs its own open file (one
    shared by two would leave the second at the end). Opened anew from this process's memory
    file: one open, no file read, per action."""
    return os.open(f"/proc/self/fd/{memory_file()}", os.O_RDONLY | os.O_CLOEXEC)


def options(fd: int) -> list[str]:
    """bwrap's options that install the program read from descriptor `fd`."""
    return ["--seccomp", str(fd)]


# libseccomp (seccomp.h): actions and attributes.
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_PROCESS = 0x80000000


def SCMP_ACT_ERRNO(e: int) -> int:
    return 0x00050000 | (e & 0xFFFF)


SCMP_FLTATR_ACT_BADARCH = 2
SCMP_FLTATR_CTL_NNP = 3  # bwrap sets no_new_privs itself: the program does not depend on the attribute


def generate(for_machine: str) -> bytes:
    """The program for `for_machine`, made by libseccomp (libseccomp.so.2, through ctypes);
    OSError where libseccomp is missing or refuses."""
    lib_name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(lib_name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_arch_add.argtypes = lib.seccomp_arch_remove.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]

    def check(rc: int, what: str) -> None:
        if rc < 0:
            raise OSError(-rc, f"libseccomp: {what}: {os.strerror(-rc)}")

    abis = ABIS[for_machine]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "libseccomp: seccomp_init failed")
    try:
        check(lib.seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS), "bad arch action")
        arches = []
        for abi in abis:
            arch = lib.seccomp_arch_resolve_name(abi.encode())
            if not arch:
                raise OSError(errno.EINVAL, f"libseccomp does not know the ABI {abi}")
            arches.append(arch)
        # Exactly these ABIs, whatever machine runs this (a new filter holds its native one).
        native = lib.seccomp_arch_native()
        for abi, arch in zip(abis, arches):
            if arch != native:
                check(lib.seccomp_arch_add(ctx, arch), f"add {abi}")
        if native not in arches:
            check(lib.seccomp_arch_remove(ctx, native), "remove the native ABI")
        for names, action in ((ENOSYS_CALLS, SCMP_ACT_ERRNO(errno.ENOSYS)), (EPERM_CALLS, SCMP_ACT_ERRNO(errno.EPERM))):
            for name in names:
                # In the numbering of the machine running this, which libseccomp translates (by
                # name) for each ABI of the filter.
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr < 0:
                    raise OSError(errno.EINVAL, f"libseccomp does not know {name}")
                check(lib.seccomp_rule_add(ctx, action, nr, 0), f"rule for {name}")
        read, write = os.pipe()
        try:
            check(lib.seccomp_export_bpf(ctx, write), "export")
            os.close(write)
            write = -1
            chunks = []
            while chunk := os.read(read, 65536):
                chunks.append(chunk)
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)


def write_programs() -> list[Path]:
    """Make every machine's program again (generate()) and write it here."""
    written = []
    for m in ABIS:
        path = DIRECTORY / f"{m}.bpf"
        path.write_bytes(generate(m))
        written.append(path)
    return written
