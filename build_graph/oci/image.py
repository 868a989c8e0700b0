"""The JSON documents of a single-platform OCI image, serialized one fixed way.

Every document is `json.dumps(sort_keys=True, separators=(",", ":"))` (ASCII, no spaces): the
config's sha256 is the image ID, the manifest's sha256 the manifest digest. Layers are
uncompressed tars, so each layer's digest is its diff_id. The archive holds the OCI image layout
(oci-layout, index.json, blobs/sha256/...) and Docker's manifest.json, naming the image
`localhost/bgraph/<name>:<tag>` in both (OCI.md: Docker 20.10 reads only manifest.json; podman
names from index.json's annotations).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_ARCH = {"x86_64": ("amd64", None), "aarch64": ("arm64", "v8")}
MAX_LAYERS = 127  # containerd's limit (OCI.md)
MAX_LAYER_BYTES = 10 << 30


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def timestamp(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain ID of each layer with all those below it: what a daemon keys layers by."""
    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else sha256(f"{out[-1]} {d}".encode()))
    return out


@dataclass(frozen=True)
class Layer:
    name: str
    digest: str  # sha256:<hex> of the uncompressed tar (= diff_id)
    size: int


@dataclass(frozen=True)
class Documents:
    """The blobs and files of one image archive (bytes as written)."""

    config: bytes
    manifest: bytes
    index: bytes
    docker_manifest: bytes
    layout: bytes
    ref: str

    @property
    def config_digest(self) -> str:
        return sha256(self.config)

    @property
    def manifest_digest(self) -> str:
        return sha256(self.manifest)


def documents(*, platform: str, layers: list[Layer], ref: str, created: int, created_by: str,
              env: list[str], entrypoint: list[str], cmd: list[str], workdir: str, user: str,
              labels: dict[str, str]) -> Documents:
    arch, variant = OCI_ARCH[platform]
    when = timestamp(created)
    run: dict[str, Any] = {"Env": env}
    if entrypoint:
        run["Entrypoint"] = entrypoint
    if cmd:
        run["Cmd"] = cmd
    if workdir:
        run["WorkingDir"] = workdir
    if user:
        run["User"] = user
    if labels:
        run["Labels"] = labels
    config: dict[str, Any] = {
        "architecture": arch, "os": "linux", "created": when, "config": run,
        "rootfs": {"type": "layers", "diff_ids": [l.digest for l in layers]},
        "history": [{"created": when, "created_by": f"{created_by} layer {l.name}"} for l in layers],
    }
    if variant:
        config["variant"] = variant
    config_bytes = canonical(config)
    annotations = {k: v for k, v in labels.items() if k.startswith("org.opencontainers.image.")}
    manifest: dict[str, Any] = {
        "schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": l.digest, "size": l.size} for l in layers],
    }
    if annotations:
        manifest["annotations"] = annotations
    manifest_bytes = canonical(manifest)
    platform_desc = {"architecture": arch, "os": "linux", **({"variant": variant} if variant else {})}
    index = {
        "schemaVersion": 2, "mediaType": MEDIA_INDEX,
        "manifests": [{"mediaType": MEDIA_MANIFEST, "digest": sha256(manifest_bytes), "size": len(manifest_bytes),
                       "platform": platform_desc,
                       "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref}}],
    }
    docker = [{"Config": blob_path(sha256(config_bytes)), "RepoTags": [ref],
               "Layers": [blob_path(l.digest) for l in layers]}]
    return Documents(config=config_bytes, manifest=manifest_bytes, index=canonical(index),
                     docker_manifest=canonical(docker), layout=canonical({"imageLayoutVersion": "1.0.0"}), ref=ref)


def blob_path(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"
