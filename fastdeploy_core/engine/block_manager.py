"""Paged KV cache accounting in pure Python (no tensors).

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A request owns a list of
block ids (its *block table*); block ``i`` of the table holds its tokens
``i * block_size ... (i + 1) * block_size - 1``.

Prefix caching: once a block is full and computed it is registered under a hash chained on
its parent block's hash (``hash((parent_hash, tokens))``), so a hit on block ``i`` implies the
whole prefix matched. Blocks are reference counted; a block whose count drops to zero goes to
the free queue but keeps its contents and hash until it is reused, so a later request with the
same prefix can revive it. The free queue is LRU: blocks without a hash are reused first, then
cached blocks from the least recently freed one.

Order of reuse, and what it does to memory. The queue holds, front to back: freed blocks
without a hash (used, nothing worth keeping), never-used blocks, then cached blocks, least
recently freed first. So a block is touched for the first time only when no used block is free
without a cache entry, and a cached prefix is evicted only when no never-used block is left.
Evicting cached blocks before touching new ones would keep the committed memory lower while
the cache is filling, but it would throw away prefix hits to save memory the budget already
allows; the bound on memory is the budget (``num_blocks``, chosen by the device's rule or the
user), which the cache reaches and then stops at: ``num_touched_blocks`` never exceeds it, and
on devices whose cache pages are committed on first write (the cpu) that is the KV memory the
process holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fastdeploy_core.engine.request import Request


@dataclass(slots=True)
class Block:
    """One KV block: who uses it and, once full, which tokens it holds."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    touched: bool = False  # handed out at least once (its memory is committed on lazy devices)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block (Python's tuple hash is deterministic for ints)."""
    return hash((parent_hash, token_ids))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates, shares and frees KV blocks; keeps the prefix cache and its hit counters."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        #: ref_count == 0 blocks; the first one is reused next.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already registered
        #: Distinct blocks ever handed out: the high-water mark of the cache's committed memory.
        self.num_touched_blocks = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- questions -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        tokens = req.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    def find_cached_blocks(self, req: Request) -> list[int]:
        """Block ids caching the longest prefix of ``req`` (at least one token is left to compute)."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        num_full = (req.num_tokens - 1) // bs
        self._extend_hashes(req, num_full)
        hits: list[int] = []
        tokens = req.all_token_ids
        for i in range(num_full):
            block_id = self._cached.get(req.block_hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break  # hash collision: treat as a miss
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks of ``req`` that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_table))
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(req, num_full)
        for i in range(start, num_full):
            block = self.blocks[req.block_table[i]]
            if block.block_hash is not None:
                continue  # a prefix hit: already registered
            h = req.block_hashes[i]
            if h in self._cached:
                continue  # the same content sits in another block; keep that one
            block.block_hash = h
            block.token_ids = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            self._cached[h] = block.block_id
        self._num_registered[req.request_id] = num_full

    # ---- allocation ------------------------------------------------------------------------
    def _num_new_blocks(self, req: Request, num_tokens: int, cached_blocks: list[int]) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(req.block_table) - len(cached_blocks))

    def can_allocate(self, req: Request, num_tokens: int, cached_blocks: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Whether ``req`` (plus ``cached_blocks`` it would adopt) can hold ``num_tokens`` tokens."""
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return self._num_new_blocks(req, num_tokens, list(cached_blocks)) <= len(self._free) - revived

    def allocate(self, req: Request, num_tokens: int, cached_blocks: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Admit ``req``: adopt ``cached_blocks`` (a prefix hit) and add blocks for ``num_tokens``.

        All or nothing: returns False and changes nothing when the blocks are not there.
        Counts the prefix-cache query and its hit tokens.
        """
        cached_blocks = list(cached_blocks)
        if not self.can_allocate(req, num_tokens, cached_blocks):
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        req.block_table.extend(cached_blocks)
        if cached_blocks:
            self._num_registered[req.request_id] = len(cached_blocks)
        if self.enable_prefix_caching:
            self.prefix_queries += 1
            self.prefix_query_tokens += req.num_tokens
            self.prefix_hit_tokens += len(cached_blocks) * self.block_size
            self.prefix_hits += bool(cached_blocks)
        self._take_new(req, num_tokens)
        return True

    def append(self, req: Request, num_tokens: int) -> bool:
        """Grow a running request's table to hold ``num_tokens`` tokens; False if out of blocks."""
        if self._num_new_blocks(req, num_tokens, []) > len(self._free):
            return False
        self._take_new(req, num_tokens)
        return True

    def _take_new(self, req: Request, num_tokens: int) -> None:
        for _ in range(self._num_new_blocks(req, num_tokens, [])):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            if not block.touched:
                block.touched = True
                self.num_touched_blocks += 1
            block.ref_count = 1
            req.block_table.append(block_id)

    def free(self, req: Request) -> None:
        """Release every block of ``req`` (tail first, so prefixes stay cached longest)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice (request {req.request_id})")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # nothing worth keeping
        req.block_table = []
        self._num_registered.pop(req.request_id, None)

    # ---- checking --------------------------------------------------------------------------
    def check_invariants(self, live_requests: list[Request]) -> None:
        """Assert the books balance against ``live_requests`` (used by the property tests)."""
        expected = [0] * self.num_blocks
        for req in live_requests:
            assert len(set(req.block_table)) == len(req.block_table), f"{req.request_id} holds a block twice"
            for block_id in req.block_table:
                expected[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == expected[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held {expected[block.block_id]} times"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id} free-list mismatch"
            )
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h, f"cache map points to block {block_id} with another hash"
