"""pypi_archive, http_archive and extract: pinned downloads and their unpacking."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from build_graph.model import TargetOutput
from build_graph.rules.base import Attrs, PlanGen, RuleContext, fetch, labels_in


class PypiArchiveAttrs(Attrs):
    pin: str = Field(description="name of a kind = \"pypi\" pin in WORKSPACE.toml")


def plan_pypi_archive(ctx: RuleContext) -> PlanGen:
    """Download the pinned sdist or wheel through pip's configured index; verify its sha256."""
    pin = ctx.pins(ctx.attrs.pin, ctx.where("pin"))
    if pin.kind != "pypi":
        raise ctx.fail(f"pin {ctx.attrs.pin!r} is a {pin.kind} pin; pypi_archive needs a pypi pin", "pin")
    [fetched] = yield [ctx.fetch_action(ctx.attrs.pin, "pin")]
    return TargetOutput(fetched.tree, {"pin": ctx.attrs.pin, "version": pin.version})


class HttpArchiveAttrs(Attrs):
    pin: str | None = Field(None, description="name of a kind = \"url\" pin in WORKSPACE.toml")
    url: str | None = Field(None, description="download address (with sha256, instead of pin)")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="sha256 of the file")

    @model_validator(mode="after")
    def _one(self) -> "HttpArchiveAttrs":
        if (self.pin is None) == (self.url is None):
            raise ValueError("give either pin, or url + sha256")
        if self.url is not None and self.sha256 is None:
            raise ValueError("url needs sha256")
        return self


def plan_http_archive(ctx: RuleContext) -> PlanGen:
    """Download url + sha256; served from the CAS when the digest is already there."""
    if ctx.attrs.pin:
        pin = ctx.pins(ctx.attrs.pin, ctx.where("pin"))
        if pin.kind != "url":
            raise ctx.fail(f"pin {ctx.attrs.pin!r} is a {pin.kind} pin; http_archive needs a url pin", "pin")
        action = ctx.fetch_action(ctx.attrs.pin, "pin")
    else:
        filename = re.sub(r"[?#].*$", "", ctx.attrs.url).rsplit("/", 1)[-1]
        if filename in ("", ".", ".."):  # no file name ('…/', '…/..'): a name that stays in the tree
            filename = "download"
        action = fetch(f"fetch {filename}", filename, ctx.attrs.sha256, "url", url=ctx.attrs.url)
    [fetched] = yield [action]
    return TargetOutput(fetched.tree, {})


class ExtractAttrs(Attrs):
    src: str = Field(description="label of a target whose output is one archive file")
    strip_prefix: str = Field("", description="leading directory to remove from every entry")


def plan_extract(ctx: RuleContext) -> PlanGen:
    """Unpack a tar or zip archive into a tree, keeping exec bits."""
    src = ctx.dep(ctx.attrs.src, "src")
    files = src.tree.files()
    if len(files) != 1:
        raise ctx.fail(f"src must provide exactly one archive file, got {len(files)}", "src")
    [(name, _)] = files.items()
    [out] = yield [ctx.extract_action(src.tree, name, ctx.attrs.strip_prefix)]
    return TargetOutput(out.tree, dict(src.info))


def extract_deps(attrs: ExtractAttrs):
    return labels_in(attrs, "src")
