"""The pool of KV-cache blocks: ref counts, the prefix-cache hash table and the LRU of free blocks.

Block ids are 0..num_blocks-1 and every one is usable (none is reserved). A block is *used* while
its ref count is above zero and *free* otherwise. A free block may still be *cached*: it keeps its
hash and tokens, stays findable by hash, and is only evicted when the allocator takes it, so a
later request can hit it. Free blocks form one queue in LRU order; the allocator takes from the
head, freed blocks go to the tail.

Every block that becomes cached or is evicted is reported to the event sink.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.kv_events import KvEventSink, NullKvEventSink


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is full and cached
    token_ids: tuple[int, ...] = ()  # the tokens it holds while cached, re-checked on a hit


class BlockPool:
    """Owns all blocks. Callers hold blocks by reference and give each one back with ``free_blocks``."""

    def __init__(self, num_blocks: int, event_sink: KvEventSink | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._event_sink = event_sink or NullKvEventSink()
        # block_id -> block, head first: the head is the next block the allocator takes.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> the one block cached under it

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (the next one the allocator takes first)."""
        return list(self._free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref count 1.
        A taken block that was still cached is evicted first. Raises if there are not enough."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"cannot take {num_blocks} blocks, only {len(self._free_queue)} are free")
        blocks = [self._free_queue.popitem(last=False)[1] for _ in range(num_blocks)]
        evicted = [block.block_hash for block in blocks if block.block_hash is not None]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        if evicted:
            self._event_sink.blocks_removed(evicted)
        return blocks

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The block cached under ``block_hash`` if it holds exactly ``token_ids``; a hash hit
        whose tokens differ is a miss."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; a block whose count reaches zero
        goes to the tail of the free queue (still cached, if it was). Callers pass a request's
        blocks last-first, so its last blocks are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[int],
        block_token_ids: Sequence[tuple[int, ...]],
        parent_hash: int | None,
    ) -> None:
        """Cache consecutive full blocks of one sequence under their chained hashes.

        ``parent_hash`` is the hash of the block before ``blocks[0]`` (None for a sequence's first
        block). A hash already cached in another block is left there and this block stays
        uncached (two requests computed the same prefix at once); the events still form chains.
        """
        run: list[int] = []
        run_parent = parent_hash
        for block, block_hash, token_ids in zip(blocks, block_hashes, block_token_ids, strict=True):
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            if block_hash in self._cached:
                if run:
                    self._event_sink.blocks_stored(run_parent, run)
                run, run_parent = [], block_hash
                continue
            block.block_hash = block_hash
            block.token_ids = token_ids
            self._cached[block_hash] = block
            run.append(block_hash)
        if run:
            self._event_sink.blocks_stored(run_parent, run)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (returns False) while any block is in use, since a
        running request's blocks must keep their hashes."""
        if self.num_used_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        self._event_sink.all_cleared()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
