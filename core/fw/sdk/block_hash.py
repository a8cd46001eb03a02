"""The prefix cache's block hash: a chained, process-independent 64-bit hash of each block of tokens.

KV connectors and the data-parallel router key prompt blocks by it, between processes and hosts, so it is
computed from a fixed encoding (blake2b) rather than Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def _encode(obj: object, out: list[bytes]) -> None:
    """Append a self-delimiting, type-tagged encoding of `obj` to `out`.

    Tags and length prefixes keep distinct values from colliding, e.g.
    ("ab",) vs ("a", "b"), 1 vs "1", None vs 0.
    """
    if obj is None:
        out.append(b"N")
    elif isinstance(obj, bool):  # before int: bool is an int subclass
        out.append(b"B1" if obj else b"B0")
    elif isinstance(obj, int):
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"I" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out.append(b"S" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, (bytes, bytearray)):
        out.append(b"Y" + struct.pack("<I", len(obj)) + bytes(obj))
    elif isinstance(obj, float):
        out.append(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, (tuple, list)):
        out.append(b"T" + struct.pack("<I", len(obj)))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"cannot hash extra key of type {type(obj).__name__}")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """64-bit hash of a full block, chained on its parent block's hash.

    Uses blake2b over a fixed little-endian encoding rather than Python's
    hash(), so the value is identical across processes and machines (KV
    connectors compare these hashes between hosts).
    """
    parts: list[bytes] = []
    _encode(parent_hash, parts)
    parts.append(b"K" + struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    _encode(tuple(extra_keys), parts)
    digest = hashlib.blake2b(b"".join(parts), digest_size=8, person=b"fw-kv-block")
    return int.from_bytes(digest.digest(), "little")


def block_hash_chain(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[int]:
    """The chained hash of each block of ``token_ids`` (the last one may be partial), as the prefix cache chains
    its blocks: what KV connectors and the data-parallel router key prompt blocks by."""
    parent, out = None, []
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        out.append(parent)
    return out
