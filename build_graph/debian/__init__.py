"""Debian packages as pinned inputs (the `deb_packages` kind and `bgraph deb lock`).

    sources.py   where packages come from: apt's own configuration, or WORKSPACE.toml [debian]
    index.py     a mirror's Packages indexes: download (with retries) and parse
    resolve.py   Depends + Pre-Depends closure of root packages over one architecture's index
    lockfile.py  the lock file: read, write (deterministic, one line per package), diff
    locking.py   the lock command's work: indexes -> resolution -> lock files
    rootfs.py    per-package trees -> one root-layout tree (usrmerge, links, conflicts)

Only locking.py and index.py touch the network; the rest are pure functions. No registry host
is named anywhere: mirrors come from configuration, and a lock stores pool paths, not URLs.
"""

# bgraph platforms and the Debian architectures their packages are built for.
DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


from build_graph.errors import BgraphError  # noqa: E402


class LockError(BgraphError):
    """A lock that cannot be made (unknown package, unsatisfiable dependency) or read."""

    layer = "lock"
