"""The one block-hash function of Strata, shared by the engine (to name cached KV blocks) and
the router (to look a prompt up in its index of what each replica holds).

A block's hash is a chain over full blocks: ``h_i = H(h_{i-1}, tokens of block i, cache salt)``,
so equal hashes mean equal whole prefixes, and prompts of different salts (`cache_salt`, say a
tenant) never share a block; no salt hashes as before salts existed. ``h_{-1}`` is derived from a seed given through
configuration (``--prefix-cache-hash-seed``), never from per-process state, so every replica and
the router agree. Hashes are 64-bit unsigned integers (they travel in ``events.proto``).
"""

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_HASH_SEED = 0


def root_hash(seed: int = DEFAULT_HASH_SEED) -> int:
    """The parent hash of a prompt's first block."""
    return _digest(b"strata-block-hash-root" + struct.pack("<Q", seed & 0xFFFFFFFFFFFFFFFF))


def hash_block(parent_hash: int, token_ids: Sequence[int], cache_salt: str = "") -> int:
    """Hash of one full block given the hash of the block before it."""
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    if cache_salt:
        payload += b"\x00" + cache_salt.encode("utf-8")
    return _digest(payload)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    seed: int = DEFAULT_HASH_SEED,
    cache_salt: str = "",
    start_hashes: Sequence[int] = (),
) -> list[int]:
    """Chained hashes of every full block of token_ids (a trailing partial block has none).

    start_hashes: hashes already computed for the first blocks; they are kept and the chain
    continues after them, so a growing sequence hashes each block once.
    """
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else root_hash(seed)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], cache_salt)
        hashes.append(parent)
    return hashes


def _digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
