"""The KV block pools one scheduler allocates from: the main pool, and for a model with windowed
and full layers (GPT-OSS) the windowed layers' own pool (kv_cache.py), released behind the
window. A step's blocks come from both pools or from neither. Pure Python: no tensors, no
scheduling policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.runtime.kv_cache import BlockHash, BlockPool

if TYPE_CHECKING:
    from tandem.runtime.request import Request


@dataclass(frozen=True)
class CachedPrefix:
    """What a starting request reuses: the main pool's blocks of its cached prefix, and with a
    window pool the blocks its first new query reads there (NULL_BLOCK_ID before them) and the
    prefix's keys."""

    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] | None = None


class KVPools:
    def __init__(self, main: BlockPool, window_pool: BlockPool | None = None, window: int = 0):
        """`window_pool`: the windowed layers' pool (`table="window_block_ids"`), whose
        blocks a request drops once its `window` has passed them."""
        self.main = main
        self.window_pool = window_pool
        self.window = window

    def window_pool_fits(self, max_num_batched_tokens: int) -> bool:
        """Whether the window pool holds one chunk and the window behind it (True: no pool)."""
        wp = self.window_pool
        if wp is None:
            return True
        return (
            wp.blocks_needed(self.window - 1 + max_num_batched_tokens) + 1 <= wp.num_usable_blocks
        )

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest prefix of a starting request both pools still hold: the main pool's
        cached prefix, shortened block by block until the window pool holds what its first
        query reads."""
        pool, wp = self.main, self.window_pool
        blocks = pool.get_computed_blocks(request.token_ids, request.num_tokens - 1)
        if wp is None or not blocks:
            return CachedPrefix(blocks)
        hashes = pool.prefix_hashes(request.token_ids, len(blocks))
        bs = pool.block_size
        for n in range(len(blocks), 0, -1):
            window_blocks = wp.get_window_blocks(hashes[:n], max(0, n * bs - self.window + 1) // bs)
            if window_blocks is not None:
                return CachedPrefix(blocks[:n], window_blocks, hashes[:n])
        return CachedPrefix()

    def allocate(self, request: Request, num_new: int, prefix: CachedPrefix | None = None) -> bool:
        """Blocks for `num_new` more tokens in every pool (a starting request first takes
        `prefix`), or, returning False, in none."""
        prefix = prefix or CachedPrefix()
        wp = self.window_pool
        if wp is not None:
            wp.release_before(request, request.num_computed_tokens - self.window + 1)
            if not wp.can_allocate(request, num_new, prefix.window_blocks):
                return False
        if not self.main.allocate_for(request, num_new, prefix.blocks):
            return False
        if wp is not None:
            ok = wp.allocate_for(request, num_new, prefix.window_blocks, prefix.hashes)
            assert ok, "can_allocate said it fits"
        return True

    def free(self, request: Request) -> None:
        self.main.free(request)
        if self.window_pool is not None:
            self.window_pool.free(request)

    def cache_full_blocks(self, request: Request) -> None:
        self.main.cache_full_blocks(request)
        if self.window_pool is not None:
            self.window_pool.cache_full_blocks(request)
