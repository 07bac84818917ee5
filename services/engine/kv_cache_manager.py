"""The scheduler's narrow view of the KV cache: which blocks a request already has in the prefix
cache, give it slots for new tokens, cache what it computed, free it.

Each request holds a block table (a list of blocks, in token order). Only full blocks are ever
cached, named by the chained hash of ``services.common.block_hash``, and only after their tokens
were computed (``cache_blocks``), so a prefix-cache hit always points at KV that exists.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.block_hash import DEFAULT_HASH_SEED, hash_prompt_blocks
from services.engine.block_pool import BlockPool, KVBlock
from services.engine.kv_events import KvEventSink
from services.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per request when it is first admitted (not again after preemption)."""

    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # of them, tokens found in the cache


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_seed: int = DEFAULT_HASH_SEED,
        event_sink: KvEventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.block_pool = BlockPool(num_blocks, event_sink)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of each table already cached

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count above zero), 0.0 to 1.0."""
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of the request's leading full blocks found in the prefix cache, and the
        number of tokens they hold. Never the whole sequence: at least its last token is left to
        compute, so the step that computes it yields logits to sample from. Takes no reference;
        pass the blocks to ``allocate_slots`` before anything else touches the pool. None for a request
        gathering prompt logprobs: a cached position yields no logits."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for i, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            start = i * self.block_size
            block = self.block_pool.get_cached_block(block_hash, request.all_token_ids[start:start + self.block_size])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        ``computed_blocks`` (only when the request has no blocks yet) are its prefix-cache hits
        from ``get_computed_blocks``; they count as computed, so the caller then sets
        ``request.num_computed_tokens`` to their token count. Returns the ids of the newly
        allocated blocks, or None, changing nothing, when there are not enough free blocks.
        """
        blocks = self._req_to_blocks.get(request.request_id)
        if blocks is not None and not computed_blocks:  # a running request, most often one more token
            num_to_allocate = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
            if num_to_allocate <= 0:  # its last block has room: nothing to take (as below, without the rest)
                return []
        if computed_blocks and blocks:
            raise ValueError(f"request {request.request_id} already has blocks; computed_blocks are for admission")
        num_held = len(blocks or ()) + len(computed_blocks)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_to_allocate = max(num_required - num_held, 0)
        # A hit on a free cached block takes it out of the free queue, so it costs a free block too.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_to_allocate + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self._req_to_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
            if self.enable_prefix_caching and request.num_preemptions == 0:
                self.prefix_cache_stats.num_queries += request.num_tokens
                self.prefix_cache_stats.num_hits += len(computed_blocks) * self.block_size
        self.block_pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request) -> None:
        """Cache the request's blocks that its computed tokens (prompt or output) have filled
        since the last call. Call after advancing ``request.num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        self._update_block_hashes(request)
        size = self.block_size
        self.block_pool.cache_full_blocks(
            self._req_to_blocks[request.request_id][num_cached:num_full],
            request.block_hashes[num_cached:num_full],
            [tuple(request.all_token_ids[i * size:(i + 1) * size]) for i in range(num_cached, num_full)],
            request.block_hashes[num_cached - 1] if num_cached else None,
        )
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, last block first so it is evicted first.
        Cached blocks stay findable until evicted. A request without blocks is a no-op."""
        blocks = self._req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table (block ids in token order)."""
        return [block.block_id for block in self._req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_prompt_blocks(
                request.all_token_ids, self.block_size, self.hash_seed, request.cache_salt,
                start_hashes=request.block_hashes)
