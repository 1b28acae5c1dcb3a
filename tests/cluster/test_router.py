"""The cluster's routers, pure bookkeeping (no Ray): the prefix router's matched tokens against the engine's own
prefix cache (KVCacheManager fed the same prompts), agent sessions sticking to their replica, the least prefill
before a first token (queued prompts against cached ones), the overload fallback, restarts forgetting a cache,
eviction order, round-robin and least-loaded, and a hypothesis run that every decision names a live replica and,
with room to spare, predicts exactly the cache's hit.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.cluster.config import ClusterConfig
from twospeed.cluster.router import (REASONS, LeastLoadedRouter, PrefixRouter, ReplicaLoad, RoundRobinRouter,
                                     block_chain, make_router)
from twospeed.engine.kv_cache import KVCacheManager

BS = 4


class Replica:
    """A replica's prefix cache as the engine keeps it: admit a prompt, compute it, free it (blocks stay cached)."""

    def __init__(self, num_blocks: int = 4096):
        self.kv = KVCacheManager(num_blocks, BS)
        self.n = 0

    def serve(self, tokens: list[int]) -> int:
        """Cached tokens the engine bills for this prompt."""
        rid = f"r{self.n}"
        self.n += 1
        cached = self.kv.find_cached_prefix(tokens)
        assert self.kv.allocate_slots(rid, len(tokens), cached)
        self.kv.cache_full_blocks(rid, tokens, len(tokens))
        self.kv.free(rid)
        return len(cached) * BS


def route(router, replicas, loads, prompt):
    decision = router.choose(prompt, loads)
    hit = replicas[decision.replica].serve(prompt)
    router.record(decision.replica, prompt)
    return decision, hit


def test_block_chain_is_the_engines_hash_chain():
    tokens = list(range(11))
    kv = KVCacheManager(16, BS)
    assert kv.allocate_slots("a", len(tokens))
    kv.cache_full_blocks("a", tokens, len(tokens))
    assert block_chain(tokens, BS, 99) == kv._hashes["a"]  # the same two full blocks, the same hashes
    assert len(block_chain(tokens, BS, 1)) == 1


def test_agent_sessions_stick_to_their_replica_and_matched_tokens_equal_the_cache_hit():
    rng = random.Random(0)
    replicas = [Replica(), Replica()]
    router = PrefixRouter(2, BS, [4096, 4096], imbalance_threshold=1)
    loads = [ReplicaLoad(), ReplicaLoad()]
    system = [rng.randrange(100) for _ in range(40)]
    sessions = {s: system + [1000 + s] * 3 for s in range(6)}
    homes: dict[int, set] = {s: set() for s in sessions}
    sent = {s: 0 for s in sessions}  # tokens of the session's last prompt
    for turn in range(5):
        for s, history in sessions.items():
            for r, load in enumerate(loads):  # every other session has a call open on its home replica
                load.in_flight = sum(1 for o, h in homes.items() if o != s and r in h)
            decision, hit = route(router, replicas, loads, history)
            assert decision.matched_tokens == hit  # the router's model of the cache is the cache
            if turn:  # the whole previous prompt's full blocks were waiting on this replica
                assert decision.reason == "prefix" and hit == sent[s] // BS * BS
            sent[s] = len(history)
            homes[s].add(decision.replica)
            history += [rng.randrange(100) for _ in range(rng.randint(3, 9))]  # the answer and the next message
    assert all(len(h) == 1 for h in homes.values())  # every turn of a session on one replica
    assert {next(iter(h)) for h in homes.values()} == {0, 1}  # and the sessions spread over both


def test_round_robin_scatters_a_session_and_misses_the_cache():
    """One session, turn after turn: prefix routing hits the whole previous prompt; round-robin on two replicas
    lands each turn where the turn before the last went, so it hits only that one."""
    loads = [ReplicaLoad(), ReplicaLoad()]
    rr, rr_replicas = RoundRobinRouter(2), [Replica(), Replica()]
    prefix, prefix_replicas = PrefixRouter(2, BS, [4096, 4096]), [Replica(), Replica()]
    history, lengths = list(range(50)), []
    for turn in range(6):
        rr_hit = route(rr, rr_replicas, loads, history)[1]
        prefix_hit = route(prefix, prefix_replicas, loads, history)[1]
        assert prefix_hit == (lengths[-1] // BS * BS if lengths else 0)
        assert rr_hit == (lengths[-2] // BS * BS if len(lengths) > 1 else 0)
        lengths.append(len(history))
        history = history + [200 + turn] * 7


def test_overloaded_replica_sends_the_request_to_the_least_loaded():
    router = PrefixRouter(3, BS, [64, 64, 64], queue_threshold=2, kv_threshold=0.8)
    prompt = list(range(20))
    router.record(1, prompt)
    loads = [ReplicaLoad(in_flight=3), ReplicaLoad(in_flight=1), ReplicaLoad(in_flight=2)]
    assert router.choose(prompt, loads).replica == 1
    assert router.choose(prompt, loads).reason == "prefix"
    loads[1].waiting = 2
    d = router.choose(prompt, loads)
    assert (d.replica, d.reason) == (2, "overloaded")
    loads[1].waiting, loads[1].kv_usage = 0, 0.85
    assert router.choose(prompt, loads).reason == "overloaded"
    loads[1].kv_usage = 0.0
    loads[0].in_flight, loads[1].in_flight = 0, 5  # 5 more than the least loaded: past the imbalance threshold
    assert router.choose(prompt, loads).reason == "overloaded"
    loads[1].in_flight = 4
    assert router.choose(prompt, loads).reason == "prefix"
    loads[1].up = False
    d = router.choose(prompt, loads)
    assert d.replica == 0 and d.reason == "least_loaded"  # the holder is down: nobody has the prefix


def test_a_shared_prefix_spreads_once_its_holder_queues_and_a_session_stays_until_the_queue_outweighs_it():
    router = PrefixRouter(2, BS, [4096, 4096])
    system = list(range(100, 140))  # 40 tokens every request shares
    router.record(0, system + [1, 2, 3])
    loads = [ReplicaLoad(), ReplicaLoad()]
    d = router.choose(system + [7, 8, 9], loads)
    assert (d.replica, d.reason, d.matched_tokens) == (0, "prefix", 40)
    loads[0].pending_prefill = 39  # queued prompts cost less than the 40 cached tokens: still worth waiting for
    assert router.choose(system + [7, 8, 9], loads).replica == 0
    loads[0].pending_prefill = 41  # ... now the other replica starts sooner, prefix and all
    d = router.choose(system + [7, 8, 9], loads)
    assert (d.replica, d.reason, d.matched_tokens) == (1, "prefill_queue", 0)
    loads[0].pending_prefill = 0
    loads[0].waiting = 9  # an overloaded holder is passed over whatever it caches
    d = router.choose(system + [7, 8, 9], loads)
    assert (d.replica, d.reason) == (1, "overloaded")


def test_a_restarted_replica_is_forgotten_and_tables_evict_tails_first():
    router = PrefixRouter(2, BS, [3, 64])
    prompt = list(range(21))  # 5 full blocks; a table of 3 keeps the first 3 (the tail is evicted first)
    router.record(0, prompt)
    assert router.table_size(0) == 3
    assert router.matched_blocks(0, block_chain(prompt, BS, 5)) == 3
    router.forget(0)
    assert router.table_size(0) == 0
    assert router.choose(prompt, [ReplicaLoad(in_flight=1), ReplicaLoad(in_flight=0)]).replica == 1


def test_round_robin_and_least_loaded_skip_replicas_that_are_down():
    rr = RoundRobinRouter(3)
    loads = [ReplicaLoad(), ReplicaLoad(up=False), ReplicaLoad()]
    assert [rr.choose([1], loads).replica for _ in range(4)] == [0, 2, 0, 2]
    assert rr.choose([1], loads, exclude={0, 2}) is None
    ll = LeastLoadedRouter(3)
    loads = [ReplicaLoad(in_flight=2), ReplicaLoad(in_flight=0, up=False), ReplicaLoad(in_flight=1)]
    assert ll.choose([1], loads).replica == 2
    loads[2].in_flight = 2
    assert {ll.choose([1], loads).replica for _ in range(4)} == {0, 2}  # ties rotate
    for name in ("prefix", "least-loaded", "round-robin"):
        ClusterConfig(router=name)
        assert make_router(name, 2, BS, [8, 8]).name == name


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_decision_is_a_live_replica_and_predicts_the_cache(data):
    n = data.draw(st.integers(1, 4))
    replicas = [Replica() for _ in range(n)]
    router = PrefixRouter(n, BS, [4096] * n, queue_threshold=3)
    stems = [[data.draw(st.integers(0, 5)) for _ in range(data.draw(st.integers(0, 12)))] for _ in range(3)]
    for _ in range(data.draw(st.integers(1, 25))):
        loads = [ReplicaLoad(up=data.draw(st.booleans()) or i == 0, in_flight=data.draw(st.integers(0, 5)),
                             waiting=data.draw(st.integers(0, 4)), pending_prefill=data.draw(st.integers(0, 40)))
                 for i in range(n)]
        tail = [data.draw(st.integers(0, 5)) for _ in range(data.draw(st.integers(1, 10)))]
        prompt = data.draw(st.sampled_from(stems)) + tail
        decision = router.choose(prompt, loads)
        assert loads[decision.replica].up and decision.reason in REASONS
        hits = {i: len(replicas[i].kv.find_cached_prefix(prompt)) * BS for i in range(n) if loads[i].up}
        assert decision.matched_tokens == hits[decision.replica]
        if decision.reason == "prefix":  # no live replica holds more of it
            assert hits[decision.replica] == max(hits.values()) > 0
        elif decision.reason == "least_loaded":
            assert max(hits.values()) == 0
        elif decision.reason == "prefill_queue":  # a holder was there, but its queue made it the slower start
            assert hits[decision.replica] < max(hits.values())
        least = min(loads[i].in_flight for i in hits)
        fresh = [i for i in hits if not router.overloaded(loads[i], least)] or list(hits)
        cost = {i: loads[i].pending_prefill + len(prompt) - hits[i] for i in fresh}
        assert cost[decision.replica] == min(cost.values())  # the least prefill before its first token
        replicas[decision.replica].serve(prompt)
        router.record(decision.replica, prompt)


def test_serve_refuses_a_bad_cluster_flag_before_starting_anything(capsys):
    from twospeed.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--router", "random"]) == 2
    assert "router must be one of prefix, least-loaded, round-robin" in capsys.readouterr().err
    assert main(["serve", "--attach-to", "twospeed", "--router", "round-robin"]) == 2
    assert "--attach-to needs --ray-address" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--engine-nice", "20"]) == 2
    assert "engine_nice must be in 0..19" in capsys.readouterr().err
