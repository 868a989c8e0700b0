#!/usr/bin/env python3
"""Load figures of a built oci_image (issue 35, BENCHMARKS.md "Images"): `bgraph load` cold, a run
of the image with no network, `bgraph load --full`, the docker CLI's `docker load` of the same tar,
and, after an edit of the top layer, `docker load` and `bgraph load` of the edited image.

Works on the image's output directory (an OCI layout, archive = false, or one holding image.tar)
with bgraph's own load (build_graph/oci/load.py, what `bgraph load` calls once the image is built),
so a large image can be measured from a cache whose other entries were collected. The edited image
is made as the rule would make it after an edit: the top layer written again by the rule's writer
(oci/tarball.py) from its own files plus one, the documents rewritten, the other blobs hard-linked.

Usage: DOCKER_HOST=unix:///... python3 bench/image_load.py IMAGE_DIR [--check 'python3 -c ...']
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from build_graph.oci import image, tarball  # noqa: E402
from build_graph.oci.load import _layout_members, _members, _stream, connect, load  # noqa: E402
from build_graph.rules.oci_image import EPOCH  # noqa: E402


def tar_stream(image_dir: Path):
    """The image's tar as bytes chunks (the layout's, or image.tar's)."""
    if (image_dir / "image.tar").exists():
        path = image_dir / "image.tar"
        return _stream(path, _members(path)[0])
    return _stream(image_dir, _layout_members(image_dir))


def docker_cli_load(image_dir: Path) -> float:
    """`docker load` reading the tar on its standard input; seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(["docker", "load"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for chunk in tar_stream(image_dir):
        proc.stdin.write(chunk)
    proc.stdin.close()
    out = proc.stdout.read().decode()
    if proc.wait() != 0:
        sys.exit(f"docker load failed: {out}")
    return time.monotonic() - start


def edited(image_dir: Path, meta: dict, work: Path) -> tuple[Path, dict]:
    """A copy of the image whose top layer holds one more file (a one-line edit of the app)."""
    out = work / "edited"
    (out / "blobs/sha256").mkdir(parents=True)
    top = meta["layers"][-1]
    tree = work / "top"
    tree.mkdir()
    with tarfile.open(image_dir / image.blob_path(top["digest"])) as t:
        t.extractall(tree, filter="tar")
    (tree / "etc").mkdir(exist_ok=True)
    (tree / "etc/bgraph-edit").write_text("one edit\n")
    with open(work / "layer.tar", "wb") as f:
        digest, size = tarball.write_layer(f, str(tree), EPOCH)
    shutil.rmtree(tree)
    os.replace(work / "layer.tar", out / image.blob_path(digest))
    for layer in meta["layers"][:-1]:
        os.link(image_dir / image.blob_path(layer["digest"]), out / image.blob_path(layer["digest"]))
    config = json.loads((image_dir / image.blob_path(meta["config"])).read_bytes())
    config["rootfs"]["diff_ids"][-1] = digest
    config_bytes = image.canonical(config)
    config_digest = image.sha256(config_bytes)
    manifest = json.loads((image_dir / image.blob_path(meta["manifest"])).read_bytes())
    manifest["config"].update(digest=config_digest, size=len(config_bytes))
    manifest["layers"][-1].update(digest=digest, size=size)
    manifest_bytes = image.canonical(manifest)
    manifest_digest = image.sha256(manifest_bytes)
    index = json.loads(_member(image_dir, "index.json"))
    index["manifests"][0].update(digest=manifest_digest, size=len(manifest_bytes))
    docker = json.loads(_member(image_dir, "manifest.json"))
    docker[0]["Config"] = image.blob_path(config_digest)
    docker[0]["Layers"][-1] = image.blob_path(digest)
    for path, data in ((image.blob_path(config_digest), config_bytes), (image.blob_path(manifest_digest), manifest_bytes),
                       ("index.json", image.canonical(index)), ("manifest.json", image.canonical(docker)),
                       ("oci-layout", _member(image_dir, "oci-layout"))):
        (out / path).write_bytes(data)
    new_meta = {**meta, "config": config_digest, "manifest": manifest_digest,
                "layers": [*meta["layers"][:-1], {**top, "digest": digest, "size": size}]}
    return out, new_meta


def _member(image_dir: Path, name: str) -> bytes:
    if (image_dir / name).exists():
        return (image_dir / name).read_bytes()
    with tarfile.open(image_dir / "image.tar") as t:
        return t.extractfile(name).read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("image_dir", type=Path)
    p.add_argument("--check", default="python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__)'",
                   help="the command the image runs with no network (split as a shell would; the image has no shell)")
    p.add_argument("--loaded", action="store_true", help="the image is in the daemon already: skip the cold load")
    args = p.parse_args()
    meta = json.loads((args.image_dir / "image.json").read_text())
    client, daemon = connect(30)
    client.api.timeout = 600  # removing a GB image on a busy disk took over 30 s
    ref = meta["ref"]
    print(f"{ref}: {len(meta['layers'])} layers, "
          + ", ".join(f"{l['name']} {l['size'] / 2**20:.1f} MiB" for l in meta["layers"]) + f"; daemon {daemon}")

    def gone():
        for r in (ref, meta["config"]):
            try:
                client.images.remove(r, force=True)
            except Exception:  # noqa: BLE001 - not there
                pass

    if not args.loaded:
        gone()
    cold = load(args.image_dir, meta, timeout=3600)
    print("bgraph load" + (" (already there)" if args.loaded else ", cold") + ":", cold.line())
    container = client.containers.run(ref, shlex.split(args.check), entrypoint=[], network_mode="none",
                                      detach=True, mem_limit="4g")
    start = time.monotonic()
    status = container.wait(timeout=600)
    logs = container.logs().decode()
    container.remove(force=True)
    print(f"run (network none), {time.monotonic() - start:.1f}s, exit {status['StatusCode']}: {logs.strip()}")
    full = load(args.image_dir, meta, timeout=3600, full=True)
    print("bgraph load --full, every layer there:", full.line())
    secs = docker_cli_load(args.image_dir)
    print(f"docker load (the CLI, the same tar on stdin), every layer there: {secs:.2f} s")
    with tempfile.TemporaryDirectory(prefix="bgraph-edit-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        edit_dir, edit_meta = edited(args.image_dir, meta, Path(tmp))
        secs = docker_cli_load(edit_dir)  # the base image there: the daemon still takes the whole tar
        print(f"docker load of the edited image (the base there): {secs:.2f} s")
        client.images.remove(edit_meta["config"], force=True)
        thin = load(edit_dir, edit_meta, timeout=3600)
        print("bgraph load after an edit of the top layer:", thin.line())
    print(json.dumps({"cold": cold.to_json(), "full": full.to_json(), "edit": thin.to_json()}, sort_keys=True))


if __name__ == "__main__":
    main()
