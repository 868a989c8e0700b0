"""Signed action-cache entries: ed25519 over the entry's canonical bytes and its key, so a
machine without the private key can neither forge a result nor move one to another key."""

from __future__ import annotations

from pathlib import Path

from build_graph.errors import LoadError
from build_graph.model import canonical_json


def signed_message(key: str, kind: str, body) -> bytes:
    return canonical_json({"v": 1, "key": key, "kind": kind, "body": body})


class Signer:
    """Signs with a private key read from a file (raw 32 bytes in hex, or PEM)."""

    def __init__(self, path: Path):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise LoadError(f"signing key {path}: {e.strerror}") from None
        try:
            if raw.lstrip().startswith(b"-----BEGIN"):
                key = serialization.load_pem_private_key(raw, password=None)
            else:
                key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(raw.decode().strip()))
        except ValueError as e:
            raise LoadError(f"signing key {path}: not an ed25519 private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise LoadError(f"signing key {path}: not an ed25519 key")
        self._key = key
        self.public_hex = key.public_key().public_bytes(serialization.Encoding.Raw,
                                                        serialization.PublicFormat.Raw).hex()

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()


UNSIGNED = "unsigned"  # who signed an entry that carries no valid signature


class Trust:
    """Which signatures count. With trusted keys, only entries one of them signed. With none,
    nothing, unless `allow_unsigned` says that any entry will do (a cache only the user's own
    machines can write): then every entry is accepted, whoever wrote it. Keys win over
    allow_unsigned."""

    def __init__(self, public_keys_hex: list[str], allow_unsigned: bool = False):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        self.keys = {}
        for h in public_keys_hex:
            try:
                self.keys[h.lower()] = Ed25519PublicKey.from_public_bytes(bytes.fromhex(h))
            except ValueError:
                raise LoadError(f"trusted key {h[:16]}…: not a 32-byte ed25519 public key in hex") from None
        self.allow_unsigned = allow_unsigned and not self.keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, message: bytes, signature: str | None, public_hex: str | None) -> str | None:
        """None if acceptable, else why not."""
        if not self.required:
            return None if self.allow_unsigned else "no trusted keys (and unsigned results not allowed)"
        if not signature or not public_hex:
            return "unsigned"
        if not isinstance(signature, str) or not isinstance(public_hex, str):
            return "malformed signature fields (not strings)"  # a hostile or broken writer
        key = self.keys.get(public_hex.lower())
        if key is None:
            return "signed by an untrusted key"
        from cryptography.exceptions import InvalidSignature
        try:
            key.verify(bytes.fromhex(signature), message)
        except (InvalidSignature, ValueError):
            return "wrong signature"
        return None

    def signer(self, message: bytes, signature, public_hex) -> str:
        """Who signed `message`: the public key (hex, lower case) whose signature verifies,
        whether trusted or not, else UNSIGNED. Recorded with a pulled result, so that a later
        build that trusts other keys can tell whether it still counts (see `accepts`)."""
        if not isinstance(signature, str) or not isinstance(public_hex, str) or not signature or not public_hex:
            return UNSIGNED
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        try:
            key = self.keys.get(public_hex.lower()) or Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
            key.verify(bytes.fromhex(signature), message)
        except (InvalidSignature, ValueError):
            return UNSIGNED
        return public_hex.lower()

    def accepts(self, signer: str) -> bool:
        """Whether a result that `signer` signed (or UNSIGNED) is usable under this trust."""
        return signer in self.keys if self.keys else self.allow_unsigned


def generate_key(path: Path) -> str:
    """Write a new private key (hex, mode 0600) to `path`; returns its public key in hex."""
    import os

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(raw.hex() + "\n")
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
