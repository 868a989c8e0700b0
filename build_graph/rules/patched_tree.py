"""patched_tree: apply patches from patches/ to a source tree, in the sandbox, with GNU patch."""

from __future__ import annotations

from pydantic import Field

from build_graph.model import FileEntry, TargetOutput
from build_graph.patches import decode, inert, non_utf8_name
from build_graph.rules.base import SRC, Attrs, PlanGen, RuleContext, labels_in

# Each patch is applied alone so a failure names the patch file; patch itself names file and hunk.
# The copy keeps the store's read-only modes, and an action (root too) holds no capability to
# write past them: it is made writable first (an output tree records only exec bits).
APPLY = r"""set -eu
mkdir -p /bgraph/out/tree
cp -a /bgraph/in/src/. /bgraph/out/tree/
chmod -R u+w /bgraph/out/tree
cd /bgraph/out/tree
for p in "$@"; do
  if ! patch -p"$STRIP" --batch --forward --no-backup-if-mismatch -r - -i "/bgraph/src/$p" >/tmp/patch.log 2>&1; then
    cat /tmp/patch.log >&2
    echo "bgraph: patch $p does not apply (see the hunk above)" >&2
    exit 1
  fi
  echo "applied $p"
done
"""


class PatchedTreeAttrs(Attrs):
    src: str = Field(description="label of the tree to patch")
    patches: list[str] = Field(description="workspace paths or globs of patch files, applied in order; "
                                           "none: the source tree as it is")
    strip: int = Field(1, ge=0, description="leading path components patch strips (-p)")
    tools: str = Field("//toolchains:host", description="host_tools target providing sh, cp and patch")
    add: dict[str, str] = Field(default_factory=dict,
                                description="directory in the tree ('' for its root) -> label of a tree added "
                                            "there before patching (files the patches refer to, e.g. a header shim)")


def patched_tree_deps(attrs: PatchedTreeAttrs):
    return labels_in(attrs, "src", "tools", "add")


def patched_tree_sources(attrs: PatchedTreeAttrs):
    return [("patches", p) for p in attrs.patches]


def plan_patched_tree(ctx: RuleContext) -> PlanGen:
    """One sandboxed action: copy the tree, apply each patch in order. Without patches the
    tree is the source tree itself (with `add`'s trees), and nothing runs."""
    src = ctx.dep(ctx.attrs.src, "src")
    tree = src.tree
    for prefix, label in sorted(ctx.attrs.add.items()):
        try:
            tree = tree.merged(ctx.dep(label, "add").tree.prefixed(prefix))
        except ValueError as e:
            raise ctx.fail(f"{label} does not fit under {prefix or 'the root'!r}: {e}", "add") from None
    patches = ctx.extra["expanded"].get("patches", [])
    if not patches:
        return TargetOutput(tree, {"patches": [], **dict(src.info)})
    for p in patches:
        entry = ctx.sources.get(p)
        text = decode(ctx.read(entry)) if isinstance(entry, FileEntry) else None
        name = non_utf8_name(text) if text is not None else None
        if name is not None:
            raise ctx.fail(f"patch {p} names a file that is not UTF-8: '{name}'", "patches",
                           hint="a tree holds only UTF-8 file names: rename the file in the patch")
        why = inert(text) if text is not None else None
        if why:
            raise ctx.fail(f"patch {p} would be applied as a no-op: {why}", "patches",
                           hint="regenerate the patch (git diff --binary for binary files) or drop it from patches")
    [out] = yield [ctx.exec_action(
        "apply patches", "Patch", ["/bin/sh", "-c", APPLY, "apply", *patches],
        inputs={"/bgraph/in/src": tree, SRC: ctx.sources.select(patches)},
        outputs=["tree"], env={"STRIP": str(ctx.attrs.strip)},
        host=ctx.dep(ctx.attrs.tools, "tools"), memory_mb=1024)]
    return TargetOutput(out.tree.subtree("tree"), {"patches": patches, **dict(src.info)})
