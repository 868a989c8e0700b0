"""An image's SBOM: CycloneDX 1.6 JSON, written with cyclonedx-python-lib, of what its layers hold.

Components, each with the layer it is in (`bgraph:layer`) and the target that placed it
(`bgraph:target`): every Debian package of the system (purl `pkg:deb/debian/<name>@<version>?arch=`),
every wheel of a `python_lock` target (purl `pkg:pypi/...`, the wheel's sha256 and file name, the
lock file), every wheel bgraph built (`py_wheel`: its sha256), and any other tree placed in a layer
(a `file` component named by its target). Deterministic: the serial number is derived from the
image's config digest and the timestamp is SOURCE_DATE_EPOCH, so one image has one SBOM.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone


@dataclass(frozen=True)
class Item:
    """One thing an image's layer was made from."""

    kind: str  # "deb" | "pypi" | "wheel" | "tree"
    name: str
    version: str | None
    layer: str
    target: str
    sha256: str | None = None
    arch: str | None = None
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # more bgraph:* properties


def render(*, ref: str, tag: str, config: str, manifest: str, epoch: int, items: list[Item]) -> str:
    """The SBOM's JSON text (CycloneDX 1.6)."""
    from cyclonedx.model import HashAlgorithm, HashType, Property
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    components = []
    for i in sorted(items, key=lambda i: (i.layer, i.kind, i.name, i.version or "")):
        if i.kind == "deb":
            purl = PackageURL("deb", "debian", i.name, i.version, {"arch": i.arch} if i.arch else None)
        elif i.kind in ("pypi", "wheel"):
            purl = PackageURL("pypi", None, i.name, i.version)
        else:
            purl = None
        props = [Property(name="bgraph:layer", value=i.layer), Property(name="bgraph:target", value=i.target),
                 *(Property(name=f"bgraph:{k}", value=v) for k, v in i.extra)]
        components.append(Component(
            name=i.name, version=i.version, purl=purl, bom_ref=f"{i.layer}/{i.kind}/{i.name}",
            type=ComponentType.FILE if i.kind == "tree" else ComponentType.LIBRARY,
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=i.sha256)] if i.sha256 else None, properties=props))
    image = Component(name=ref.rpartition(":")[0], version=tag, type=ComponentType.CONTAINER, bom_ref=ref,
                      properties=[Property(name="bgraph:config", value=config),
                                  Property(name="bgraph:manifest", value=manifest)])
    bom = Bom(components=components, serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"bgraph-image:{config}"),
              metadata=BomMetaData(component=image, timestamp=datetime.fromtimestamp(epoch, timezone.utc)))
    bom.register_dependency(image, components)  # the image holds every component
    return JsonV1Dot6(bom).output_as_string(indent=1) + "\n"
