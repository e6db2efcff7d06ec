"""API keys: `sg_<prefix>_<secret>`. The prefix is public (listings, usage, logs); the key is
stored only as its SHA-256. A salted slow hash is for low-entropy passwords; these keys carry
256 random bits, so a fast hash is safe and keeps verification off the CPU budget."""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX_CHARS = 8
SECRET_BYTES = 32
SECRET_CHARS = 43  # token_urlsafe(32): 32 bytes in unpadded base64


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(the key, its public prefix)."""
    prefix = secrets.token_hex(PREFIX_CHARS // 2)
    return f"sg_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}", prefix


def is_servegate_key(key: str) -> bool:
    """Shaped like a key `new_key` makes (worth a database lookup when it is not in memory)."""
    parts = key.split("_", 2)
    return (len(parts) == 3 and parts[0] == "sg" and len(parts[1]) == PREFIX_CHARS
            and all(c in "0123456789abcdef" for c in parts[1]) and len(parts[2]) == SECRET_CHARS)


def key_prefix(key: str) -> str | None:
    """The public part of a servegate key; None for a key an operator chose (`SERVEGATE_ADMIN_KEY`),
    which is looked up by its whole hash and listed under a random prefix (the start of an unsalted
    hash would let anyone who reads the listing test guesses of a chosen key offline)."""
    parts = key.split("_", 2)
    if len(parts) == 3 and parts[0] == "sg" and len(parts[1]) == PREFIX_CHARS:
        return parts[1]
    return None


def chosen_key_prefix() -> str:
    return secrets.token_hex(PREFIX_CHARS // 2)


def verify(key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(key), stored_hash)
