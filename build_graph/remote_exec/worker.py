"""`bgraph worker`: runs REAPI actions leased from a Remote Workers API server (BuildGrid's Bots
service) in bgraph's bubblewrap sandbox.

THE CONTRACT WITH THE CLIENT (remote_exec/client.py builds input roots to it):

- The input root is the action's whole filesystem view. Each top-level entry of the input root
  is shown read-only at `/<name>`: an input root holding `usr/`, `bgraph/src/...` and
  `bgraph/in/...` gives `/usr`, `/bgraph/src`, `/bgraph/in/...`. A top-level symlink is made as
  that symlink (`bin -> usr/bin`: merged-/usr links work); a top-level file is bound read-only.
  The names `proc`, `dev` and `tmp` are the sandbox's own and refused at the top level
  (INVALID_ARGUMENT).
- Besides the input root: a fresh tmpfs `/tmp`, a read-only `/proc` (as sandbox.py's local
  actions), a minimal `/dev`, no network, its own PID (and IPC, UTS) namespace, `--cap-drop ALL`
  (no capability as root either), no nested user namespace where bwrap allows refusing it,
  `--die-with-parent`, `--new-session`, and exactly `Command.environment_variables` as the
  environment (nothing of the worker's).
- The process runs `Command.arguments` in `/<working_directory>`. Output paths are relative to the
  working directory (REAPI); `output_paths` is used, else `output_files` + `output_directories`.
  Each output's parent directory exists before the run and is writable: the worker binds a
  writable per-lease directory at the parent of every output (only the outermost of nested
  parents: outputs `bgraph/out/a` and `bgraph/out/d/b` make `/bgraph/out` writable). What the
  input root holds below a writable directory (e.g. `bgraph/out`'s staged symlinks and output
  parents) is copied there first; files there are copies, never links into the worker's cache.
  An output directly at the input root's top level has no parent to bind (INVALID_ARGUMENT).
- Outputs are collected after the run: a regular file as an OutputFile (executable bit kept), a
  symlink as an OutputSymlink, a directory as an OutputDirectory whose Tree is uploaded. A
  declared output the action did not make is simply absent (REAPI).
- Platform properties the worker offers: `OSFamily=Linux`, `ISA=x86-64` or `aarch64` (the
  host's), and `bgraph-sandbox=SANDBOX_VERSION`, which the client sends too: a change of this
  contract changes the version, so old clients' actions wait for matching workers instead of
  running in a sandbox they were not built for.
- Statuses: inputs missing from the server's CAS -> FAILED_PRECONDITION with a PreconditionFailure
  of MISSING violations `blobs/<hash>/<size>`; Action.timeout hit -> DEADLINE_EXCEEDED (the process
  tree is killed); a bad Command or input root -> INVALID_ARGUMENT; the worker's own trouble ->
  INTERNAL or UNAVAILABLE (BuildGrid retries those); else OK with an ActionResult (exit_code,
  outputs, stdout/stderr digests, execution_metadata with this bot's id). A non-zero exit is OK.
- Digests are the server's digest function (sha256 by default; `--digest-function blake3` where
  the server offers it).
"""

from __future__ import annotations

SANDBOX_VERSION = "bwrap-v1"  # the `bgraph-sandbox` platform property: this contract's version
