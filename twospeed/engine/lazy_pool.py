"""A BlockPool whose never-used blocks exist only when first handed out: the engine's and the simulator's pool.

A KV pool can hold millions of blocks (156k for a small model on an L4; 1.4M for a test's tiny checkpoint in the
default 2 GiB): building every KVBlock up front cost the engine's start ~4 s and the simulator seconds per
replica. The engine's BlockPool hands out never-used blocks
first, in id order (its free queue starts as every block in order, used blocks leave its head and freed ones
join its tail), and only then evicts the least recently freed cached block. So a pool that makes block k when
it is first handed out, and keeps only the freed blocks in its queue, hands out and evicts exactly the same
block ids in the same order; tests/plan/test_sim.py holds the two side by side under random operations, and
BlockPool stays the reference.
"""

from __future__ import annotations

from collections import OrderedDict

from twospeed.engine.kv_cache import BlockPool, KVBlock


class LazyBlockPool(BlockPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True):  # noqa: D107 - no super(): no blocks made
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = []  # the blocks made so far: block_id == index
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict()  # freed blocks only, oldest first
        self._cached = {}

    @property
    def _unused(self) -> int:
        return self.num_blocks - len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue) + self._unused

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def free_block_ids(self) -> list[int]:
        return list(range(len(self.blocks), self.num_blocks)) + list(self._free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._unused:
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                _, block = self._free_queue.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True
