"""Paged KV-cache bookkeeping: block pool, block tables, ref counts, prefix hashing.

No torch here: the scheduler, the runner and the planner's simulator all share it,
and its tests run on a CPU. The model's KV tensors are indexed by `block_id`;
this file only decides which request owns which block ids.

Automatic prefix caching (after vLLM v1's `block_pool.py` and the free queue in
`kv_cache_utils.py`): a block completely filled with computed tokens gets a hash
that chains its parent's hash and its token ids, so the hash names the whole
prefix up to that block. A later request whose prompt starts with the same tokens
reuses the block (ref_cnt += 1) instead of recomputing it. A freed block keeps its
hash and sits in an LRU free queue; it is evicted (hash dropped) only when it is
handed out again, least recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

BlockHash = bytes

_ROOT_HASH = bytes(32)  # parent of a request's first block


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 over the parent hash and the block's token ids (little-endian int64s).

    A chain, so a block's identity is its whole prefix, not only its own tokens.
    """
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered


class BlockPool:
    """Fixed pool of blocks with one LRU free queue and a hash -> block map.

    Free blocks (ref_cnt == 0) sit in `_free_queue`, head = evicted first. A free
    block may still hold a cached hash; it is evicted only when handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict gives O(1) removal from the middle (touch) and O(1) pop from the head.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0, including evictable cached ones."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the hash map, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref_cnt > 0."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (first = handed out next). For tests and stats."""
        return list(self._free_queue)

    @property
    def cached_blocks(self) -> Mapping[BlockHash, KVBlock]:
        """Read-only view of the hash -> block map."""
        return MappingProxyType(self._cached)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self._free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self._free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """ref_cnt -= 1; blocks reaching 0 join the queue tail in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block. If another block already holds this content
        (computed twice by concurrent requests), keep the first and leave this one
        uncached: it is freed and reused like any uncached block."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only allowed when no block is in use."""
        if len(self._free_queue) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True


class KVCacheManager:
    """Per-request block tables on top of a BlockPool.

    Block i of a request's table holds the KV of token positions
    [i * block_size, (i + 1) * block_size). Check-then-act: `allocate_slots`
    returns False and changes nothing when the pool cannot cover the request.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, pool: BlockPool | None = None):
        """pool: a BlockPool of num_blocks to use (the simulator's lazy one); None makes one."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching) if pool is None else pool
        self.prefix_cache_queries = 0  # prompt tokens looked up in find_cached_prefix
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self._tables: dict[str, list[KVBlock]] = {}
        # Hashes of the request's leading full blocks; len = blocks already cached.
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> list[KVBlock]:
        """Longest chain of cached full blocks matching the start of token_ids.

        Stops one token short: at most (len - 1) // block_size blocks, so the last
        prompt token is always computed (its logits are sampled). Takes no references.
        hashes: the chain's hashes of these tokens found so far (Request.block_hashes), reused and extended.
        """
        found = self._match(token_ids, hashes)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(found) * self.block_size
        return found

    def cached_prefix_len(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> int:
        """Tokens find_cached_prefix would find now, not counted as a lookup (the scheduler looking ahead)."""
        return len(self._match(token_ids, hashes)) * self.block_size

    def _match(self, token_ids: Sequence[int], hashes: list[bytes] | None) -> list[KVBlock]:
        if not self.enable_caching:
            return []
        bs = self.block_size
        found: list[KVBlock] = []
        parent = None
        memo = hashes if hashes is not None else []
        for i in range((len(token_ids) - 1) // bs):
            if i < len(memo):
                parent = memo[i]
            else:
                parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
                memo.append(parent)
            block = self.pool.get_cached_block(parent)
            if block is None:
                break
            found.append(block)
        return found

    def allocate_slots(self, request_id: str, num_total_tokens: int, cached_blocks: Sequence[KVBlock] = ()) -> bool:
        """Grow the table to cover num_total_tokens slots; False (and no change) if it cannot."""
        table = self._tables.get(request_id)
        if cached_blocks and table is not None:
            raise ValueError(f"cached_blocks given for {request_id!r}, which already has blocks")
        for i, block in enumerate(cached_blocks):
            # A stale prefix (evicted since find_cached_prefix) would alias other content.
            if block.block_hash is None or self.pool.get_cached_block(block.block_hash) is not block:
                raise ValueError(f"cached block {i} ({block.block_id}) is no longer cached")
        have = len(cached_blocks) if table is None else len(table)
        num_new = max(0, self.blocks_needed(num_total_tokens) - have)
        # Touching a free cached block takes it out of the free queue.
        free_after_touch = self.pool.num_free_blocks - sum(b.ref_cnt == 0 for b in cached_blocks)
        if num_new > free_after_touch:
            return False
        if table is None:
            self.pool.touch(cached_blocks)
            table = self._tables[request_id] = list(cached_blocks)
            self._hashes[request_id] = [b.block_hash for b in cached_blocks]
        table.extend(self.pool.get_new_blocks(num_new))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register every block now completely filled with computed tokens.

        Only pass tokens whose KV is final (never unverified speculative tokens).
        """
        if not self.enable_caching:
            return
        table = self._tables[request_id]
        hashes = self._hashes[request_id]
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full > len(table):
            raise ValueError(f"{request_id!r}: {num_full} full blocks but only {len(table)} allocated")
        for i in range(len(hashes), num_full):
            block_hash = hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs])
            hashes.append(block_hash)
            self.pool.cache_block(table[i], block_hash)

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail first, so its tail is evicted before a shared head."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table is not None:
            self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
