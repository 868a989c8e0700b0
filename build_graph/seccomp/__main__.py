"""`python3 -m build_graph.seccomp`: make the seccomp programs again with libseccomp."""

from build_graph.seccomp import write_programs

for path in write_programs():
    print(f"wrote {path} ({path.stat().st_size} bytes)")
