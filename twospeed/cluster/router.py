"""Routers: which engine replica serves a request. Prefix-aware (cache affinity), least-loaded, round-robin.

The prefix router keeps, per replica, the block hashes of the prompts (and answers) it sent there, hashed with
the engine's own chain (engine/kv_cache.py hash_block_tokens: same tokenizer, same block size), so a hash names
a whole prefix exactly as the replica's prefix cache names it. A request goes to the replica where the least
prefill stands before its first token: the prompt tokens it would not find cached there, plus the prompt
tokens already routed there and not yet through prefill (`pending_prefill`, which the ingress counts). So a
session stays with the replica holding its history until that replica's queue of prompts outweighs the
history (then `prefill_queue`), and a prefix every request shares (one system prompt) spreads over the replicas
once one of them queues, instead of piling on the first that saw it. Replicas that are overloaded are passed
over: queue or KV use above a threshold, or more sequences in flight than the least-loaded replica by more than
the imbalance threshold. Ties go to the least loaded.
A replica's table holds at most as many blocks as its KV pool (the most it can have cached), evicting the least
recently sent, leaves before roots (the cache's own order: a chain's tail is freed first), and is forgotten
when the replica restarts (a new instance has an empty cache).

Least loaded = fewest sequences in flight there (the ingress counts them exactly), then the lowest KV use; ties
rotate. Every decision carries its reason, which the metrics count by replica.

Pure bookkeeping: no Ray, no torch, no clock. Inputs: prompt token ids and a ReplicaLoad per replica. Output: a
Decision (replica index, reason, tokens the replica is expected to have cached).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from twospeed.engine.kv_cache import BlockHash, hash_block_tokens

REASONS = ("prefix", "prefill_queue", "overloaded", "least_loaded", "round_robin", "failover")


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows of one replica when it decides."""

    up: bool = True  # answering (a replica that died is down until a probe finds its successor)
    in_flight: int = 0  # sequences the ingress has sent there and not seen finish
    waiting: int = 0  # of those, waiting to be scheduled (the replica's own last report)
    kv_usage: float = 0.0  # share of its KV blocks in use (its last report)
    pending_prefill: int = 0  # prompt tokens routed there, less their expected cache hits, not yet through prefill


@dataclass(slots=True, frozen=True)
class Decision:
    replica: int  # index into the replicas
    reason: str  # one of REASONS
    matched_tokens: int = 0  # prompt tokens the replica is expected to serve from its prefix cache


def block_chain(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[BlockHash]:
    """The hashes of the first `num_blocks` full blocks of token_ids, chained as the engine's prefix cache does."""
    hashes: list[BlockHash] = []
    parent = None
    for b in range(min(num_blocks, len(token_ids) // block_size)):
        parent = hash_block_tokens(parent, token_ids[b * block_size:(b + 1) * block_size])
        hashes.append(parent)
    return hashes


class Router(ABC):
    """Picks a replica for each request; told what each replica was sent so it can model their caches."""

    name: str

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._next = 0  # where ties start (rotates)

    @abstractmethod
    def choose(self, prompt: Sequence[int], loads: Sequence[ReplicaLoad],
               exclude: Collection[int] = ()) -> Decision | None:
        """The replica for a request with this prompt, among those up and not excluded; None if there is none."""

    def record(self, replica: int, token_ids: Sequence[int]) -> None:
        """The replica now holds the KV of these tokens (a prompt it admitted, or a prompt and its answer)."""

    def forget(self, replica: int) -> None:
        """The replica restarted: its cache is empty."""

    def _least_loaded(self, candidates: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        n = self.num_replicas
        pick = min(candidates, key=lambda i: (loads[i].in_flight, loads[i].waiting, loads[i].kv_usage,
                                              (i - self._next) % n))
        self._next = (pick + 1) % n
        return pick

    @staticmethod
    def _live(loads: Sequence[ReplicaLoad], exclude: Collection[int]) -> list[int]:
        return [i for i, load in enumerate(loads) if load.up and i not in exclude]


class RoundRobinRouter(Router):
    name = "round-robin"

    def choose(self, prompt, loads, exclude=()):
        live = self._live(loads, exclude)
        if not live:
            return None
        n = self.num_replicas
        pick = min(live, key=lambda i: (i - self._next) % n)
        self._next = (pick + 1) % n
        return Decision(pick, "round_robin")


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def choose(self, prompt, loads, exclude=()):
        live = self._live(loads, exclude)
        return Decision(self._least_loaded(live, loads), "least_loaded") if live else None


class PrefixRouter(Router):
    name = "prefix"

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: Sequence[int], *,
                 max_prefix_blocks: int = 512, queue_threshold: int = 4, kv_threshold: float = 0.9,
                 imbalance_threshold: int = 4):
        super().__init__(num_replicas)
        if len(capacity_blocks) != num_replicas or block_size < 1:
            raise ValueError("one capacity per replica and a block size >= 1")
        self.block_size = block_size
        self.capacity = list(capacity_blocks)  # each replica's KV pool, in blocks
        self.max_prefix_blocks = max_prefix_blocks
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.imbalance_threshold = imbalance_threshold
        self._tables: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_replicas)]

    def choose(self, prompt, loads, exclude=()):
        live = self._live(loads, exclude)
        if not live:
            return None
        # The last prompt token is always computed, so at most (len - 1) // block_size blocks can be hits.
        chain = block_chain(prompt, self.block_size, min(self.max_prefix_blocks, (len(prompt) - 1) // self.block_size))
        matched = {i: self.matched_blocks(i, chain) * self.block_size for i in live}
        least = min(loads[i].in_flight for i in live)
        fresh = [i for i in live if not self.overloaded(loads[i], least)] or live
        cost = {i: loads[i].pending_prefill + len(prompt) - matched[i] for i in fresh}  # prefill before its first token
        lowest = min(cost.values())
        pick = self._least_loaded([i for i in fresh if cost[i] == lowest], loads)
        best = max(matched.values())
        if best == 0:
            reason = "least_loaded"
        elif matched[pick] == best:
            reason = "prefix"
        elif any(matched[i] == best for i in fresh):
            reason = "prefill_queue"  # a holder of the prefix is free, but its queued prompts outweigh the hit
        else:
            reason = "overloaded"
        return Decision(pick, reason, matched[pick])

    def overloaded(self, load: ReplicaLoad, least_in_flight: int = 0) -> bool:
        return (load.waiting >= self.queue_threshold or load.kv_usage >= self.kv_threshold
                or load.in_flight - least_in_flight > self.imbalance_threshold)

    def matched_blocks(self, replica: int, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of the chain the replica's table holds."""
        table = self._tables[replica]
        for k, h in enumerate(chain):
            if h not in table:
                return k
        return len(chain)

    def record(self, replica: int, token_ids: Sequence[int]) -> None:
        table, cap = self._tables[replica], self.capacity[replica]
        # Leaf first, root last: the root ends most recent, so eviction takes a chain's tail before its head.
        for h in reversed(block_chain(token_ids, self.block_size, self.max_prefix_blocks)):
            table[h] = None
            table.move_to_end(h)
        while len(table) > cap:
            table.popitem(last=False)

    def forget(self, replica: int) -> None:
        self._tables[replica].clear()

    def table_size(self, replica: int) -> int:
        return len(self._tables[replica])


def make_router(name: str, num_replicas: int, block_size: int, capacity_blocks: Sequence[int],
                **prefix_options) -> Router:
    """The router named by ClusterConfig.router."""
    if name == "prefix":
        return PrefixRouter(num_replicas, block_size, capacity_blocks, **prefix_options)
    if name == "least-loaded":
        return LeastLoadedRouter(num_replicas)
    if name == "round-robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"unknown router {name!r}")
