"""KV block pool: reference-counted fixed-size blocks and a prefix cache over full blocks.

Owns block bookkeeping only (which block ids a request holds, which are free or cached); it
holds no tensors and knows nothing of scheduling policy. Block 0 is reserved as the null
block the runner pads block tables with: it is never handed out, so the usable blocks are
1 .. num_blocks - 1.

Every usable block is in exactly one state:
- referenced: held by one or more requests (ref count = number of holders);
- free-uncached: ref 0, no hash, handed out first;
- free-cached (evictable): ref 0 but its full-block hash is registered, so a later request
  with the same prefix can take it back; evicted least-recently-freed first when no
  uncached block is left, losing its hash.

The prefix cache is a hash chain: block i of a sequence is keyed by
blake2b(key of block i-1, token ids of block i), so a key names the whole prefix.

A model whose every layer has a sliding window never reads a block again once every window
has passed it: `release_before` drops the request's reference to such blocks and puts the null
block in their place in its block table, so a long sequence holds a bounded number of blocks.
A model with windowed and full layers (GPT-OSS) gives its windowed layers a pool of their own
(`table="window_block_ids"`: a second block table per request, its own block ids) released
the same way, so only the full layers' cache grows with the context.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.runtime.request import Request

NULL_BLOCK_ID = 0

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Stable (process-independent) key of a full block given the key of its prefix."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Allocates KV blocks to requests; shares and caches full blocks by prefix hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        table: str = "block_ids",
    ):
        """`table`: the request attribute holding this pool's block ids (its block table)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.table = table
        self._ref_count = [0] * num_blocks
        self._free_uncached: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._block_hash: dict[int, BlockHash] = {}
        self._hash_to_block: dict[BlockHash, int] = {}
        self._holders: dict[str, Request] = {}  # request_id -> request holding blocks
        self._req_hashes: dict[str, list[BlockHash]] = {}  # hash chain of its full blocks
        self._released: dict[str, int] = {}  # request_id -> blocks before this one released
        self.prefix_cache_queries = 0  # tokens of requests that looked up the cache
        self.prefix_cache_hits = 0  # of which served from the cache

    # ---------------------------------------------------------------- queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free-uncached plus evictable cached ones."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ids(self, request: Request) -> list[int]:
        """The request's block table in this pool."""
        return getattr(request, self.table)

    def prefix_hashes(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """Keys of the first `num_blocks` full blocks of `token_ids` (the hash chain)."""
        bs = self.block_size
        hashes: list[BlockHash] = []
        for i in range(num_blocks):
            hashes.append(
                hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs])
            )
        return hashes

    def get_window_blocks(self, hashes: Sequence[BlockHash], first: int) -> list[int] | None:
        """A block table for a prefix of `len(hashes)` full blocks of which only blocks
        `first ..` are read again (a window): NULL_BLOCK_ID before `first`, then the cached
        blocks; None when one of those is not cached. Pure lookup, as `get_computed_blocks`."""
        if not self.enable_prefix_caching:
            return None if hashes else []
        blocks = [NULL_BLOCK_ID] * min(first, len(hashes))
        for h in hashes[first:]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                return None
            blocks.append(block_id)
        return blocks

    def get_computed_blocks(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix made of full blocks within token_ids[:max_tokens].

        Pure lookup: takes no references and updates no counters (see `allocate_for`).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        parent: BlockHash | None = None
        for i in range(min(max_tokens, len(token_ids)) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    # ------------------------------------------------------------- mutations
    def allocate_for(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        computed_hashes: Sequence[BlockHash] | None = None,
    ) -> bool:
        """Make the request's block table cover its computed tokens plus `num_new_tokens` slots.

        If the request holds no blocks yet (it starts, or restarts after preemption), it first
        takes `computed_blocks` (from `get_computed_blocks`) as shared blocks, and its computed
        tokens count as len(computed_blocks) * block_size; the caller sets
        request.num_computed_tokens to that on success. Otherwise the base is
        request.num_computed_tokens and `computed_blocks` must be empty.
        `computed_blocks` must come from `get_computed_blocks` (or `get_window_blocks`, whose
        leading NULL_BLOCK_ID entries are blocks no query reads again; then `computed_hashes`
        gives the keys of all of them) with no pool change in between.
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        num_new_blocks = self._new_blocks(request, num_new_tokens, computed_blocks)
        if num_new_blocks is None:
            return False
        if not self.ids(request):
            for block_id in computed_blocks:
                if block_id == NULL_BLOCK_ID:
                    continue
                if self._ref_count[block_id] == 0:
                    del self._evictable[block_id]
                self._ref_count[block_id] += 1
            setattr(request, self.table, list(computed_blocks))
            self._holders[request.request_id] = request
            self._req_hashes[request.request_id] = (
                list(computed_hashes)
                if computed_hashes is not None
                else [self._block_hash[b] for b in computed_blocks]
            )
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * self.block_size
        ids = self.ids(request)
        for _ in range(num_new_blocks):
            block_id = self._take_free_block()
            self._ref_count[block_id] = 1
            ids.append(block_id)
        return True

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether `allocate_for` with the same arguments would succeed (changes nothing)."""
        return self._new_blocks(request, num_new_tokens, computed_blocks) is not None

    def _new_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]
    ) -> int | None:
        """Blocks `allocate_for` takes from the free list, or None when they do not fit."""
        held_ids = self.ids(request)
        starting = not held_ids
        cached = [b for b in computed_blocks if b != NULL_BLOCK_ID]
        if starting:
            assert all(b in self._block_hash for b in cached), "stale computed_blocks"
            base = len(computed_blocks) * self.block_size
        else:
            assert not computed_blocks, "computed_blocks only apply when a request starts"
            base = request.num_computed_tokens
        held = len(computed_blocks) if starting else len(held_ids)
        num_new_blocks = max(0, self.blocks_needed(base + num_new_tokens) - held)
        # Shared blocks that are free right now stop being available once taken.
        reclaimed = sum(1 for b in cached if self._ref_count[b] == 0) if starting else 0
        if num_new_blocks > self.num_free_blocks - reclaimed:
            return None
        return num_new_blocks

    def _take_free_block(self) -> int:
        if self._free_uncached:
            return self._free_uncached.popleft()
        block_id, _ = self._evictable.popitem(last=False)  # least recently freed
        del self._hash_to_block[self._block_hash.pop(block_id)]
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens in the cache.

        A block whose hash is already cached (another request computed the same prefix
        concurrently) stays uncached; the chain continues through the hash either way.
        """
        if not self.enable_prefix_caching or request.request_id not in self._holders:
            return
        hashes = self._req_hashes[request.request_id]
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        ids = self.ids(request)
        num_full = min(num_full, len(ids))
        for i in range(len(hashes), num_full):
            h = hash_block(hashes[-1] if hashes else None, request.token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            block_id = ids[i]
            if block_id == NULL_BLOCK_ID:  # released before it was registered
                continue
            if h not in self._hash_to_block and block_id not in self._block_hash:
                self._hash_to_block[h] = block_id
                self._block_hash[block_id] = h

    def free(self, request: Request) -> None:
        """Drop the request's references, once; a second call is a no-op.

        Blocks are released tail first, so a request's last blocks (least likely shared)
        are the first cached blocks to be evicted.
        """
        if self._holders.pop(request.request_id, None) is None:
            return
        self._req_hashes.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        for block_id in reversed(self.ids(request)):
            if block_id != NULL_BLOCK_ID:  # released already (`release_before`)
                self._unref(block_id)
        setattr(request, self.table, [])

    def release_before(self, request: Request, num_tokens: int) -> int:
        """Drop the request's references to its blocks wholly before token `num_tokens` (no
        later query reads them: every layer's window has passed); their block-table entries
        become NULL_BLOCK_ID. Returns how many blocks were released."""
        rid = request.request_id
        if rid not in self._holders:
            return 0
        start = self._released.get(rid, 0)
        ids = self.ids(request)
        end = min(max(num_tokens, 0) // self.block_size, len(ids))
        for i in range(start, end):
            block_id = ids[i]
            if block_id != NULL_BLOCK_ID:
                self._unref(block_id)
                ids[i] = NULL_BLOCK_ID
        self._released[rid] = max(start, end)
        return max(0, end - start)

    def _unref(self, block_id: int) -> None:
        self._ref_count[block_id] -= 1
        if self._ref_count[block_id] == 0:
            if block_id in self._block_hash:
                self._evictable[block_id] = None
            else:
                self._free_uncached.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change); free cached blocks stay free."""
        for block_id in self._evictable:
            self._free_uncached.append(block_id)
        self._evictable.clear()
        self._block_hash.clear()
        self._hash_to_block.clear()
        for hashes in self._req_hashes.values():
            hashes.clear()

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Assert the block-state partition, ref counts and hash maps are consistent."""
        expected = [0] * self.num_blocks
        for request_id, request in self._holders.items():
            assert request.request_id == request_id
            held = [b for b in self.ids(request) if b != NULL_BLOCK_ID]  # NULL: released
            assert len(set(held)) == len(held), self.ids(request)
            for block_id in held:
                assert 0 < block_id < self.num_blocks, block_id
                expected[block_id] += 1
        assert expected == self._ref_count, "ref counts differ from holders"
        free_uncached = set(self._free_uncached)
        assert len(free_uncached) == len(self._free_uncached), "duplicate free block"
        assert NULL_BLOCK_ID not in free_uncached and NULL_BLOCK_ID not in self._evictable
        for block_id in range(1, self.num_blocks):
            states = (
                self._ref_count[block_id] > 0,
                block_id in free_uncached,
                block_id in self._evictable,
            )
            assert sum(states) == 1, (block_id, states)
            if states[1]:
                assert block_id not in self._block_hash, block_id
            if states[2]:
                assert block_id in self._block_hash, block_id
        assert len(self._hash_to_block) == len(self._block_hash)
        for h, block_id in self._hash_to_block.items():
            assert self._block_hash[block_id] == h
