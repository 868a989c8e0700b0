"""`bgraph load LABEL`: put a built image into the Docker daemon named by DOCKER_HOST (docker SDK).

Incremental where the daemon allows it. The Docker API has no call that takes some layers of an
image: `POST /images/load` takes a whole `docker save` tar. But Docker looks a layer up by its
chain ID (the layer and every one below it) before it opens the layer's blob, and podman reuses
blobs by digest (OCI.md, measured on Docker 20.10 and podman 4.3): so the tar sent here holds
every document but leaves out the blobs of the longest bottom run of layers whose chain some
image in the daemon already has (read from each image's RootFS.Layers), and is streamed straight
from the image's own tar (no copy on disk). Neither daemon documents that a tar may lack blobs:
if the thin load fails, the whole tar is sent, and the report says so. An image already there
under this config digest is only tagged (nothing sent).
"""

from __future__ import annotations

import os
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from build_graph.errors import BgraphError
from build_graph.oci.image import blob_path, chain_ids

# What a layout directory holds beside the image that image.tar does not (the rule's summary and SBOM).
OUTSIDE_THE_TAR = frozenset({"image.json", "sbom.cdx.json"})
MIN_API = (1, 41)  # Docker 20.10: the oldest daemon this load was measured against (OCI.md)
BLOCK = 512
CHUNK = 1 << 20
DAEMON_HINT = ("start a Docker daemon (dockerd), or point DOCKER_HOST at one "
               "(e.g. DOCKER_HOST=unix:///run/docker.sock)")


class ImageLoadError(BgraphError):
    layer = "docker"


@dataclass
class LoadReport:
    ref: str
    image_id: str
    daemon: str  # "Docker 20.10.24 (API 1.41) at unix:///..."
    layers: int
    layers_sent: int
    bytes_total: int  # the image's layers, in bytes
    bytes_sent: int  # the tar sent (documents, headers and the layers sent)
    seconds: float
    status: str  # "loaded" | "tagged" | "present"
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        head = f"{self.ref} ({self.image_id[:19]}…) into {self.daemon}"
        if self.status == "present":
            return f"{head}: already there, nothing sent"
        if self.status == "tagged":
            return f"{head}: the image was there under another name; tagged, nothing sent"
        kept = self.layers - self.layers_sent
        text = (f"loaded {head}: sent {self.layers_sent} of {self.layers} layer(s), {_human(self.bytes_sent)} "
                f"(the layers hold {_human(self.bytes_total)}) in {self.seconds:.2f} s"
                + (f"; {kept} layer(s) the daemon had were left out" if kept else ""))
        return text + (f" ({self.note})" if self.note else "")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _cause(e: BaseException) -> str:
    """What went wrong below the SDK's wrapping, in a few words."""
    seen: set[int] = set()
    stack: list[BaseException] = [e]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, FileNotFoundError):
            return "no socket there"
        if isinstance(x, ConnectionRefusedError):
            return "nothing listens there"
        if isinstance(x, PermissionError):
            return "permission denied on its socket"
        stack += [c for c in (x.__cause__, x.__context__) if c is not None]
        stack += [a for a in getattr(x, "args", ()) if isinstance(a, BaseException)]
    text = " ".join(str(e).split())
    if "FileNotFoundError" in text or "No such file" in text:
        return "no socket there"
    if "Connection refused" in text:
        return "nothing listens there"
    return text[:200]


def _is_timeout(e: BaseException) -> bool:
    import requests

    x: BaseException | None = e
    while x is not None:
        if isinstance(x, (requests.exceptions.Timeout, TimeoutError)) or "timed out" in str(x).lower():
            return True
        x = x.__cause__ or x.__context__
    return False


def connect(timeout: float = 60):
    """A client of the daemon at DOCKER_HOST, checked to speak API 1.41 or newer."""
    import docker

    host = _host()
    try:
        client = docker.from_env(timeout=timeout)  # asks /version (API negotiation)
        version = client.version()
    except docker.errors.DockerException as e:
        if _is_timeout(e):
            raise ImageLoadError(f"the Docker daemon at {host} did not answer within {timeout:g} s",
                            hint="is it starting or overloaded? try again, or check `docker info`") from None
        raise ImageLoadError(f"cannot reach a Docker daemon at {host}: {_cause(e)}", hint=DAEMON_HINT) from None
    except ValueError as e:  # the SDK parses DOCKER_HOST as a URL outside its own errors ('http://[::1')
        where = f"DOCKER_HOST={host!r}" if os.environ.get("DOCKER_HOST") else host
        raise ImageLoadError(f"{where} is not a Docker daemon address: {e}",
                             hint="fix DOCKER_HOST (e.g. unix:///run/docker.sock, tcp://[::1]:2375), or unset it") from None
    api = version.get("ApiVersion", "0")
    try:
        api_tuple = tuple(int(x) for x in api.split(".")[:2])
    except ValueError:
        api_tuple = (0, 0)
    podman = any("podman" in str(c.get("Name", "")).lower() for c in version.get("Components") or [])
    daemon = f"{'podman' if podman else 'Docker'} {version.get('Version', '?')} (API {api}) at {host}"
    if api_tuple < MIN_API:
        client.close()
        raise ImageLoadError(f"the daemon at {host} is too old: {daemon.split(' at ')[0]}; loading needs API "
                        f"{MIN_API[0]}.{MIN_API[1]} (Docker 20.10) or newer",
                        hint="upgrade Docker (Debian 12's docker.io is 20.10), or point DOCKER_HOST at a newer daemon")
    return client, daemon


def daemon_chains(client) -> set[str]:
    """Every layer chain ID the daemon's images hold (each image's RootFS.Layers, as chains)."""
    import docker

    chains: set[str] = set()
    for summary in client.api.images(all=True):
        try:
            layers = (client.api.inspect_image(summary["Id"]).get("RootFS") or {}).get("Layers") or []
        except docker.errors.NotFound:  # removed meanwhile
            continue
        chains.update(chain_ids(layers))
    return chains


@dataclass(frozen=True)
class _Member:
    name: str
    start: int
    end: int  # the header, the data and its padding: [start, end) of the image tar
    head: bytes = b""  # a layout directory's member: its header, written here
    file: str | None = None  # and the file whose bytes follow it
    size: int = 0

    @property
    def length(self) -> int:
        return len(self.head) + self.size + (-self.size % BLOCK) if self.head else self.end - self.start


def _layout_members(root: Path) -> list[_Member]:
    """The members of the tar the image's layout directory stands for: the same entries, order and
    headers as the archive action writes (tarball.write_archive), so the bytes sent are image.tar's."""
    from build_graph.oci import tarball
    from build_graph.rules.oci_image import EPOCH

    entries: dict[bytes, str | None] = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in OUTSIDE_THE_TAR:
                entries[os.fsencode(rel)] = os.path.join(dirpath, n)
    for name in list(entries):
        parent = name.rpartition(b"/")[0]
        while parent and parent not in entries:
            entries[parent] = None
            parent = parent.rpartition(b"/")[0]
    out = []
    for name in sorted(entries):
        file = entries[name]
        if file is None:
            out.append(_Member(name.decode(), 0, 0, tarball.header(name + b"/", b"5", 0, tarball.DIR_MODE, EPOCH)))
        else:
            size = os.stat(file).st_size
            out.append(_Member(name.decode(), 0, 0, tarball.header(name, b"0", size, tarball.FILE_MODE, EPOCH),
                               file, size))
    return out


def _members(path: Path) -> tuple[list[_Member], int]:
    """The members of the image tar as byte ranges (its writer puts no PAX header there)."""
    with tarfile.open(path) as t:
        found = t.getmembers()
        end = t.offset  # where the end-of-archive blocks start
    out = []
    for i, m in enumerate(found):
        if m.pax_headers:
            raise ImageLoadError(f"{path}: member {m.name} has a PAX header; not an image tar bgraph wrote")
        out.append(_Member(m.name.rstrip("/"), m.offset, found[i + 1].offset if i + 1 < len(found) else end))
    return out, end


def _stream(path: Path, members: list[_Member]) -> Iterator[bytes]:
    if path.is_dir():  # a layout directory: each member's header, then its file
        for m in members:
            yield m.head
            if m.file is not None:
                with open(m.file, "rb") as f:
                    left = m.size
                    while left:
                        chunk = f.read(min(CHUNK, left))
                        if not chunk:
                            raise ImageLoadError(f"{m.file} is shorter than it was")
                        left -= len(chunk)
                        yield chunk
                yield b"\0" * (-m.size % BLOCK)
        yield b"\0" * (2 * BLOCK)
        return
    with open(path, "rb") as f:
        for m in members:
            f.seek(m.start)
            left = m.end - m.start
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise ImageLoadError(f"{path} is shorter than its members say")
                left -= len(chunk)
                yield chunk
    yield b"\0" * (2 * BLOCK)


def _send(client, path: Path, members: list[_Member]) -> list[str]:
    """POST /images/load with these members; returns the daemon's lines, raises on its error."""
    out: list[str] = []
    for chunk in client.api.load_image(_stream(path, members)):
        if "errorDetail" in chunk or ("error" in chunk and "stream" not in chunk):
            raise _Refused((chunk.get("errorDetail") or {}).get("message") or chunk.get("error") or str(chunk))
        if "message" in chunk and "stream" not in chunk:
            raise _Refused(chunk["message"])
        if chunk.get("stream"):
            out.append(chunk["stream"].strip())
    return out


class _Refused(Exception):
    pass


def _explain(e: BaseException) -> str:
    """The daemon's own words for an API error, on one line."""
    text = getattr(e, "explanation", None) or str(e)
    return " ".join(str(text).split())[:300]


def _present(client, ref: str, config: str, full: bool) -> str | None:
    """"present" where `ref` is the image already, "tagged" where the image was there under
    another name (now tagged `ref`), None where it must be sent."""
    import docker

    try:
        there = client.api.inspect_image(ref).get("Id")
    except docker.errors.NotFound:
        there = None
    if full:
        return None
    if there == config:
        return "present"
    try:
        client.api.inspect_image(config)
    except docker.errors.NotFound:
        return None
    repository, _, tag = ref.rpartition(":")
    client.api.tag(config, repository, tag, force=True)
    return "tagged"


def load(image_dir: Path, meta: dict[str, Any], timeout: float = 600, full: bool = False,
         progress=lambda line: None) -> LoadReport:
    """Load the image whose output (image.tar or the layout directory, and image.json) is `image_dir`
    into the daemon."""
    import docker

    ref, config = meta["ref"], meta["config"]
    layers = meta["layers"]
    total = sum(l["size"] for l in layers)
    client, daemon = connect(30)  # --timeout is the load's: asking the version and the layers is quick
    try:
        start = time.monotonic()
        try:
            found = _present(client, ref, config, full)
        except docker.errors.APIError as e:  # NotFound is handled there: this is a refusal (a bad name, ...)
            raise ImageLoadError(f"the daemon at {_host()} refused {ref}: {_explain(e)}",
                                 hint="rebuild the image with a valid repository/tag, or check `docker info`") from None
        if found:
            return LoadReport(ref, config, daemon, len(layers), 0, total, 0, round(time.monotonic() - start, 3),
                              found)
        path = image_dir / "image.tar"
        if not path.exists() and (image_dir / "oci-layout").is_file():  # archive = false: the tar is made here
            path = image_dir
            members = _layout_members(path)
        else:
            members, _end = _members(path)
        keep = 0
        if not full:
            have = daemon_chains(client)
            for chain in chain_ids([l["digest"] for l in layers]):
                if chain not in have:
                    break
                keep += 1
        left_out = {blob_path(l["digest"]) for l in layers[:keep]} - {blob_path(l["digest"]) for l in layers[keep:]}
        thin = [m for m in members if m.name not in left_out]
        client.api.timeout = timeout
        note = ""
        try:
            try:
                _send(client, path, thin)
                sent_members = thin
            except (_Refused, docker.errors.APIError) as e:
                if not left_out:
                    raise
                note = ("the daemon refused the tar without the layers it has "
                        f"({' '.join(str(e).split())[:120]}); sent it whole")
                progress(note)
                keep = 0
                _send(client, path, members)
                sent_members = members
        except (_Refused, docker.errors.APIError) as e:
            raise ImageLoadError(f"the daemon at {_host()} refused {ref}: {' '.join(str(e).split())[:300]}") from None
        except Exception as e:
            if _is_timeout(e):
                raise ImageLoadError(f"loading {ref} timed out after {timeout:g} s without an answer from the daemon; "
                                "it may still finish the load on its own",
                                hint="look with `docker images`; a longer --timeout waits for it") from None
            raise
        seconds = time.monotonic() - start
        try:
            loaded = client.api.inspect_image(ref).get("Id")
        except docker.errors.NotFound:
            loaded = None
        if loaded != config:
            raise ImageLoadError(f"the daemon took the tar, but {ref} is {loaded or 'not there'}, not {config}")
        sent = sum(m.length for m in sent_members) + 2 * BLOCK
        return LoadReport(ref, config, daemon, len(layers), len(layers) - keep, total, sent, round(seconds, 3),
                          "loaded", note)
    except docker.errors.APIError as e:  # listing the daemon's images, or reading the loaded one back
        raise ImageLoadError(f"the daemon at {_host()} answered an error while loading {ref}: {_explain(e)}",
                             hint="check the daemon (`docker info`, its log) and load again") from None
    finally:
        client.close()
