"""How an action's environment reaches the action: through bubblewrap, never as the environment
of a host process.

A process bgraph (or a remote worker) starts on the host for an action (the /bin/sh that joins
its cgroups, bwrap, the emulating worker's unshare) runs before any namespace exists, as bgraph's
user with all its capabilities: were it started with the action's environment, a target's
`LD_PRELOAD` (or GCONV_PATH, or any of glibc's many such variables) would run the action's code
there (red-team K14). So those processes get a fixed environment of bgraph's own, and bwrap,
once inside the sandbox, gives the action exactly its variables: `--clearenv` and one `--setenv`
each, in the options it reads from a memory file. bwrap takes at most 9,000 arguments in all;
an environment too large for that (a genrule with thousands of dependencies has thousands of
$IN_ variables) is handed over as a script of `export NAME='value'` lines on the sandbox's own
stdin, which the sandbox's /bin/sh sources before it execs the action's argv with stdin from
/dev/null: the action sees the same variables, argv and descriptors either way.

One environment gives one result on every path (red-team K16 hole 6), because which path an
action takes depends only on how many variables it has (one more dependency can move it):
- What no path can hand over as given is refused on all of them, before anything runs, with one
  line naming the variable (check_environment; the rules with a free `env` refuse it at load):
  an empty name, a name with '=' or NUL, a value with NUL (--setenv handed the value cut at the
  NUL, the shell without it), and the names a /bin/sh keeps for itself (SHELL_OWN: dash's
  `export OPTIND=abc` fails, bash's read-only UID, EUID, PPID, SHELLOPTS, BASHOPTS, its dynamic
  RANDOM, SECONDS, LINENO, ... and the SHLVL and _ it sets at exec). Refused on the --setenv
  paths too, where they would work: a target that builds must not start failing when its
  variables pass bwrap's limit. Setting them without the shell's `export` would need a program
  of bgraph's own inside every sandbox (a system root has only its own files).
- A program that cannot be run fails the same way: bwrap's execvp exits 1 with "bwrap: execvp
  PROG: No such file or directory" (or "Permission denied"); the shell's `exec` would exit 127
  (126) with a message of its own, so the shell checks first (EXEC_CHECK) and fails as bwrap
  does.
What remains: a sandbox whose /bin/sh is bash adds SHLVL (and _) to what the action sees on the
shell path, and with no PATH among its variables the shell searches its own default PATH where
bwrap's execvp searches glibc's (/bin:/usr/bin).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

# bwrap refuses more than 9,000 arguments (its own, --args' and the command's together): this
# many are left for --setenv (three per variable), the rest for mounts (MAX_MOUNTS) and argv.
MAX_SETENV_ARGS = 6000
# What a host process started for an action gets as its environment: nothing of the action's.
HOST_ENV: dict[str, str] = {"PATH": "/usr/bin:/bin"}
SHELL = "/bin/sh"
# The shell fails as bwrap's execvp does where the action's program cannot run (the shell's
# `exec` would exit 127 or 126 with a message of its own). It sets no variable: every name may
# be one of the action's, exported.
_NO_FILE = 'printf "bwrap: execvp %s: No such file or directory\\n" "$1" >&2; exit 1'
EXEC_CHECK = ('case $1 in */*) [ -e "$1" ] || { ' + _NO_FILE + '; }; [ -f "$1" ] && [ -x "$1" ] || '
              '{ printf "bwrap: execvp %s: Permission denied\\n" "$1" >&2; exit 1; };; '
              '*) command -v "$1" >/dev/null || { ' + _NO_FILE + '; };; esac')
# Run by the sandbox's shell: the exports (its stdin: a memory file), the check, then the
# action's argv, with the stdin every action has.
SOURCE_AND_EXEC = '. /proc/self/fd/0 || exit 127; ' + EXEC_CHECK + '; exec "$@" </dev/null'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The names a /bin/sh does not `export` as given (dash(1): OPTIND must be a number; bash(1),
# "Shell Variables": read-only, or assigned by bash itself, or arrays it will not export; checked
# with `export NAME=abc; exec env` under dash 0.5.12 and bash 5.2, plus bash 5.3's new ones).
SHELL_OWN = frozenset({
    "OPTIND", "UID", "EUID", "PPID", "SHELLOPTS", "BASHOPTS", "BASHPID", "RANDOM", "SRANDOM", "SECONDS",
    "LINENO", "HISTCMD", "EPOCHSECONDS", "EPOCHREALTIME", "BASH_MONOSECONDS", "BASH_TRAPSIG", "GROUPS",
    "FUNCNAME", "BASH_ALIASES", "BASH_ARGC", "BASH_ARGV", "BASH_CMDS", "BASH_COMMAND", "BASH_LINENO",
    "BASH_SOURCE", "BASH_SUBSHELL", "BASH_VERSINFO", "DIRSTACK", "SHLVL", "_"})
# What to do instead, by what is wrong.
SHELL_OWN_HINT = ("give it another name: a /bin/sh keeps OPTIND, UID, PPID, SHLVL, RANDOM, _ and the like for "
                  "itself (sandbox_env.SHELL_OWN lists them)")
BAD_TEXT_HINT = "an environment variable needs a non-empty name without '=' or NUL and a value without NUL"


class EnvironmentRefused(ValueError):
    """An environment that cannot be handed over (a variable no path hands as given, or too
    large and no shell or a bad name); `hint` says what would do, where it is the variable."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def variable_problem(name: str, value: str) -> str | None:
    """Why `name`=`value` cannot be an action's variable on every path alike, or None."""
    if not name:
        return "has an empty name"
    if "=" in name or "\0" in name:
        return "has " + ("'='" if "=" in name else "a NUL") + " in its name, which no environment can hold"
    if "\0" in value:
        return "has a NUL in its value, which no environment can hold"
    if name in SHELL_OWN:
        return "is one a /bin/sh keeps for itself, which the sandbox's shell could not hand on as given"
    return None


def check_environment(env) -> None:
    """EnvironmentRefused with one line naming the first variable (of mapping or pairs `env`)
    that no path hands to the action as given."""
    for name, value in (env.items() if hasattr(env, "items") else env):
        why = variable_problem(name, value)
        if why is not None:
            raise EnvironmentRefused(f"environment variable {name!r} {why}",
                                     hint=SHELL_OWN_HINT if name in SHELL_OWN else BAD_TEXT_HINT)


@dataclass
class Handover:
    """How bwrap gives the action its environment: `options` (before `--`), `prefix` (before the
    action's argv, run inside the sandbox) and `script` (bwrap's stdin, or None for /dev/null)."""

    options: list[str]
    prefix: list[str]
    script: bytes | None


def setenv_options(env: dict[str, str]) -> list[str] | None:
    """bwrap options that give the action exactly `env`, or None where there are too many."""
    if 3 * len(env) > MAX_SETENV_ARGS:
        return None
    options = ["--clearenv"]
    for name, value in env.items():
        options += ["--setenv", name, value]
    return options


def checked_attribute(env: dict[str, str]) -> dict[str, str]:
    """`env`, a rule's environment attribute, once check_environment passes it; else its
    validator's ValueError (the one line and its hint), so the target is refused at load."""
    # Imported here: workspace imports the rules, which import this.
    from build_graph.workspace import HINT
    try:
        check_environment(env)
    except EnvironmentRefused as e:
        raise ValueError(f"{e}{HINT}{e.hint}") from None
    return env


def handover(env: dict[str, str], has_shell: bool | Callable[[], bool]) -> Handover:
    """The handover of `env` (`has_shell`: whether the sandbox has /bin/sh, or what tells, asked
    only for a large environment); EnvironmentRefused with one line where a variable cannot be
    handed over as given (check_environment), or where it is too large for bwrap's arguments and
    cannot go through the shell."""
    check_environment(env)
    options = setenv_options(env)
    if options is not None:
        return Handover(options, [], None)
    bad = next((name for name in env if not _NAME.match(name)), None)
    if bad is not None:
        raise EnvironmentRefused(f"{len(env)} environment variables are more than bwrap's arguments hold, "
                                 f"and {bad!r} is not a shell variable name, which the sandbox's shell "
                                 "would need to set them")
    if not (has_shell() if callable(has_shell) else has_shell):
        raise EnvironmentRefused(f"{len(env)} environment variables are more than bwrap's arguments hold, "
                                 f"and the sandbox has no {SHELL} to set them")
    # PWD is bwrap's (the working directory, set after --setenv's: the action never sees its
    # own); the shell keeps the one it is started with.
    script = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items() if name != "PWD")
    return Handover(["--clearenv"], [SHELL, "-c", SOURCE_AND_EXEC, "sh"], script.encode())


def stdin_fd(script: bytes | None) -> int:
    """bwrap's stdin: a memory file holding `script`, at its start, or /dev/null opened for
    reading, as the spare's and the shell's `</dev/null` open it (Popen's DEVNULL opens it for
    writing too, which the action would see)."""
    if script is None:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    fd = os.memfd_create("bgraph-env", os.MFD_CLOEXEC)
    view, offset = memoryview(script), 0
    while offset < len(view):
        offset += os.write(fd, view[offset:])
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def resolves(path: str, binds: list[tuple[str, object]], links: dict[str, str], lookup) -> bool:
    """Whether absolute `path` names a file in a sandbox made of `binds` (mount point -> what
    `lookup(what, rel)` reads: None when absent, ("file",) or ("link", target)), later binds
    over earlier ones, and `links` (a symlink bwrap makes -> its target). Links are followed,
    a few at most."""
    for _ in range(16):
        parts = [p for p in path.split("/") if p]
        resolved = False
        for i in range(1, len(parts) + 1):
            here = "/" + "/".join(parts[:i])
            if here in links:
                target = links[here]
                base = target if target.startswith("/") else os.path.join(os.path.dirname(here), target)
                path = os.path.normpath("/".join([base, *parts[i:]]))
                resolved = True
                break
        if resolved:
            continue
        for mount, what in reversed(binds):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                found = lookup(what, path[len(mount):].strip("/"))
                if found is None:
                    return False
                if found[0] == "file":
                    return True
                target = found[1]
                path = target if target.startswith("/") else os.path.normpath(
                    os.path.join(os.path.dirname(path), target))
                break
        else:
            return False
    return False


def host_lookup(host: object, rel: str):
    """resolves()'s lookup for a host path bound into the sandbox."""
    full = os.path.join(str(host), rel) if rel else str(host)
    if os.path.islink(full):
        return ("link", os.readlink(full))
    return ("file",) if os.path.isfile(full) else None
