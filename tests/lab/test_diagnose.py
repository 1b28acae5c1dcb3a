"""The diagnosis, rule by rule, on hand-built runs: each rule's lever fires on the run built for it (and the
levers that do not apply stay quiet), levers come ranked by the share of the problem time their part holds,
and a run where nothing is wrong says so."""

import io

import pytest
from rich.console import Console

from twospeed.lab.diagnose import RULES, diagnose, diagnosis_lines, print_diagnosis
from twospeed.lab.lane_facts import lane_facts

SLO = {"ttft_p99_ms": 1000, "itl_p99_ms": 100}


def req(lane="a", ttft=0.2, queue=0.01, call=1.0, prompt=300, cached=0, out=40, finish="stop", max_tokens=64,
        needed=None, gaps=None, interfered=0, steps=39, repeat=0.1, missed="", job=None, turn=None, observations=(),
        prefill=None, kind=None):
    """One request record as results.record writes it (the fields the diagnosis reads)."""
    return {"lane": lane, "error": None, "ttft_s": ttft, "server_queue_s": queue, "call_s": call, "ttlt_s": call,
            "server_ttft_s": ttft, "server_prefill_s": prefill, "slo_missed": missed, "prompt_tokens": prompt,
            "cached_tokens": cached, "prefilled_tokens": prompt - cached, "output_tokens": out, "finish_reason": finish,
            "max_tokens": max_tokens, "needed_tokens": needed, "itl_s": gaps if gaps is not None else [0.02] * (out - 1),
            "server_interfered_steps": interfered, "server_decode_steps": steps, "repeat_share": repeat, "job": job,
            "turn": turn, "call_kind": kind or ("step" if job is not None else None), "observations": list(observations)}


def job(index, lane="j", queue=0.1, prefill=1.0, decode=0.5, tool=0.3, gate=0.05, window_met=True):
    return {"index": index, "lane": lane, "error": None, "queue_s": queue, "prefill_s": prefill, "decode_s": decode,
            "tool_s": tool, "gate_s": gate, "other_s": 0.0, "window_met": window_met}


def run(requests, jobs=(), slo=None, prefix=None, prefix_tokens=0, gate_rate=1.0, ignore_eos=False,
        server_kind="twospeed", window=None, policy=None):
    lanes = {}
    for r in requests:
        lanes.setdefault(r["lane"], {"slo": dict(slo or {}), "gate": {"rate": gate_rate}, "prefix": prefix,
                                     "prefix_tokens": prefix_tokens, "policy": policy})
    for j in jobs:
        lanes[j["lane"]]["jobs"] = {"window": {"window_s": window}}
    return {"run": {"ignore_eos": ignore_eos, "server_kind": server_kind}, "lanes": lanes, "requests": list(requests),
            "jobs": list(jobs)}


def levers(doc, lane=None):
    d = next(x for x in diagnose(doc) if lane is None or x.lane == lane)
    return [lv.key for lv in d.levers], d


def test_every_rule_has_a_test_here():
    tested = {"cut_prompt", "summarize_dumps", "stabilize_prefix", "keep_prefix_cached", "stop_on_schema",
              "chunk_budget", "quantize_or_capacity", "add_capacity", "speculation", "speed_up_tools", "speed_up_gate"}
    assert {r.key for r in RULES} == tested


def test_nothing_wrong_says_so():
    prefix = {"declared_prefix_prompts": 20, "unstable_prompts": 0, "predicted_hit_rate": 0.5, "first_unstable": None}
    doc = run([req(cached=150) for _ in range(20)], slo=SLO, prefix=prefix, prefix_tokens=150)
    keys, d = levers(doc)
    assert keys == [] and d.problem == "none" and d.missed == 0
    assert d.verdict.startswith("nothing to fix: all 20 requests met TTFT ≤ 1,000 ms, ITL p99 ≤ 100 ms and no lever")
    assert "decode" in d.verdict and d.notes == []


def test_cut_prompt_when_prefill_dominates_with_a_big_prompt():
    slow = [req(ttft=3.0, queue=0.05, call=3.4, prompt=6000, prefill=2.9, missed="ttft_p99") for _ in range(8)]
    keys, d = levers(run(slow + [req() for _ in range(4)], slo=SLO))
    assert keys == ["cut_prompt"] and d.dominant == "prefill" and d.missed == 8
    assert "their prompts average 6,000 tokens" in d.levers[0].evidence and "Halving the new part" in d.levers[0].evidence
    small = [req(ttft=3.0, queue=0.05, call=3.4, prompt=200, missed="ttft_p99") for _ in range(8)]
    assert "cut_prompt" not in levers(run(small, slo=SLO))[0]  # prefill slow, but the prompt is not what is big


def test_summarize_dumps_names_the_dump_and_predicts_the_ttft_drop():
    reqs, jobs = [], []
    for i in range(6):
        jobs.append(job(i, prefill=6.0, decode=0.5, tool=0.5, window_met=False))
        reqs += [req("j", ttft=0.8, prompt=1600, cached=0, prefill=0.75, job=i, turn=1),
                 req("j", ttft=5.2, prompt=7000, cached=1500, prefill=5.1, job=i, turn=2, observations=[5000, 400]),
                 req("j", ttft=0.3, prompt=7100, cached=6980, prefill=0.2, job=i, turn=3)]
    keys, d = levers(run(reqs, jobs, slo={"ttft_p99_ms": 10000}, window=5.0))
    assert keys[0] == "summarize_dumps" and "cut_prompt" not in keys and d.unit == "jobs" and d.missed == 6
    ev = d.levers[0].evidence
    assert "--summarize-dumps 512" in ev and "5,000 tokens on average" in ev and "4,488 fewer tokens per dump" in ev
    spt = (0.75 + 5.1 + 0.2) / (1600 + 5500 + 120)  # measured prefill s per prefilled token
    assert f"~{4488 * spt * 1e3:,.0f} ms less TTFT" in ev
    lone = [req("j", ttft=5.2, prompt=7000, prefill=5.1, job=0, turn=1, observations=[100])]
    assert "summarize_dumps" not in levers(run(lone, [job(0, prefill=6, window_met=False)], window=5.0))[0]


def test_stabilize_prefix_names_the_first_unstable_span():
    span = {"prompt": 1, "char_offset": 36, "context": "Current time: 2026-12-01 09:0",
            "before": "0:01.500", "after": "1:02.250"}
    prefix = {"declared_prefix_prompts": 20, "unstable_prompts": 19, "predicted_hit_rate": 0.02, "first_unstable": span}
    keys, d = levers(run([req(cached=0, prompt=2300) for _ in range(20)], slo=SLO, prefix=prefix, prefix_tokens=2000))
    assert keys == ["stabilize_prefix"] and d.problem == "none"  # a waste lever: it fires with every SLO met
    ev = d.levers[0].evidence
    assert "19 of 20 prompts" in ev and "2,000-token prefix" in ev and "char 36 of prompt 1" in ev
    assert "[0:01.500] → [1:02.250]" in ev
    assert d.verdict.startswith("all 20 requests met") and "tokens are spent for nothing" in d.verdict


def test_keep_prefix_cached_when_the_prompts_are_stable_but_not_served():
    prefix = {"declared_prefix_prompts": 20, "unstable_prompts": 0, "predicted_hit_rate": 0.8, "first_unstable": None}
    doc = run([req(cached=10, prompt=2000) for _ in range(20)], slo=SLO, prefix=prefix, prefix_tokens=1600)
    keys, d = levers(doc)
    assert keys == ["keep_prefix_cached"] and "predicts 80%" in d.levers[0].evidence
    silent = run([req(cached=0, prompt=2000) for _ in range(20)], slo=SLO, prefix=prefix, server_kind="other")
    assert levers(silent)[0] == []  # a server that reports no cached tokens is not accused


def test_stop_on_schema_from_length_or_from_what_the_gate_needed():
    long = [req(out=96, max_tokens=96, finish="length", needed=30) for _ in range(10)]
    keys, d = levers(run(long, slo=SLO))
    assert keys == ["stop_on_schema"] and "100% of answers ran to max_tokens (96)" in d.levers[0].evidence
    assert "complete after 30 of 96 tokens" in d.levers[0].evidence
    forced = run([req(out=96, max_tokens=96, finish="length", needed=30) for _ in range(10)], slo=SLO, ignore_eos=True)
    keys, d = levers(forced)
    assert keys == ["stop_on_schema"] and "ran to max_tokens" not in d.levers[0].evidence  # forced: only the gate's need
    assert levers(run([req(out=96, max_tokens=96, finish="length") for _ in range(10)], slo=SLO,
                      ignore_eos=True))[0] == []


def test_chunk_budget_when_itl_misses_are_stalls():
    gaps = [0.02] * 30 + [0.4] * 3
    slow = [req(gaps=gaps, out=34, interfered=5, steps=33, missed="itl_p99") for _ in range(6)]
    keys, d = levers(run(slow, slo=SLO))
    assert keys == ["chunk_budget"] and d.dominant == "decode"
    ev = d.levers[0].evidence
    assert "6 of 6 ITL misses are other work in their steps: 6 are stalls" in ev
    assert "typical gap 20 ms" in ev and "gaps up to 400 ms" in ev and "6 came with at least as many interfered" in ev
    # prefills that ran whole (chunking off): no interfered step counted, still a stall, and the lever says why
    alone = [req(gaps=[0.0] * 10 + gaps, out=44, interfered=0, steps=33, missed="itl_p99") for _ in range(6)]
    keys, d = levers(run(alone, slo=SLO))
    assert keys == ["chunk_budget"] and "chunked prefill off?" in d.levers[0].evidence
    assert "typical gap 20 ms" in d.levers[0].evidence  # jump-forward's zero gaps left out
    # slow throughout, but every slow step carried a prefill chunk: still interference, not bandwidth
    busy = [req(gaps=[0.3] * 33, out=34, call=10.0, interfered=33, steps=33, missed="itl_p99") for _ in range(6)]
    keys, d = levers(run(busy, slo=SLO))
    assert keys == ["chunk_budget"] and "0 are stalls" in d.levers[0].evidence


def test_quantize_or_capacity_when_the_steps_themselves_are_slow():
    slow = [req(gaps=[0.15] * 33, out=34, call=5.2, interfered=0, steps=33, missed="itl_p99") for _ in range(6)]
    keys, d = levers(run(slow, slo=SLO))
    assert keys == ["quantize_or_capacity"] and "6 of 6 ITL misses are slow steps with no prefill" in d.levers[0].evidence
    assert "typical gap 150 ms" in d.levers[0].evidence
    blind = [dict(r, server_interfered_steps=None) for r in slow]  # no server clock: cannot tell, no accusation
    assert levers(run(blind, slo=SLO))[0] == []


def test_add_capacity_when_the_queue_dominates():
    waiting = [req(ttft=2.5, queue=2.3, call=2.8, missed="ttft_p99") for _ in range(5)]
    keys, d = levers(run(waiting, slo=SLO))
    assert keys == ["add_capacity"] and d.dominant == "queue" and "p90 2,300 ms" in d.levers[0].evidence


def test_speculation_on_decode_dominated_templated_output():
    slow = [req(ttft=0.1, call=30.0, out=300, repeat=0.7, missed="ttlt") for _ in range(5)]
    keys, d = levers(run(slow, slo={"completion_window_s": 20}))
    assert keys == ["speculation"] and "70% of output words" in d.levers[0].evidence
    plain = [req(ttft=0.1, call=30.0, out=300, repeat=0.1, missed="ttlt") for _ in range(5)]
    assert levers(run(plain, slo={"completion_window_s": 20}))[0] == []


def test_tools_and_gates_are_not_the_model():
    reqs = [req("j", ttft=0.1, call=0.3, job=i, turn=1) for i in range(4)]
    jobs = [job(i, prefill=0.1, decode=0.2, tool=8.0, gate=3.0, window_met=False) for i in range(4)]
    keys, d = levers(run(reqs, jobs, window=5.0))
    assert keys == ["speed_up_tools", "speed_up_gate"] and d.dominant == "tool"
    assert "the model is not the bottleneck" in d.levers[0].evidence and "not a slow decode" in d.levers[1].evidence


def test_levers_ranked_by_the_share_of_their_part():
    slow = [req(ttft=3.0, queue=1.6, call=3.2, prompt=6000, prefill=1.3, missed="ttft_p99") for _ in range(5)]
    keys, d = levers(run(slow, slo=SLO))
    assert keys == ["add_capacity", "cut_prompt"]  # queue 1.6 s > prefill 1.4 s of each miss
    assert d.levers[0].share > d.levers[1].share
    assert d.split["queue"] == pytest.approx(1.6 / 3.0) and d.split["prefill"] == pytest.approx(1.4 / 3.0)


def test_a_lane_without_objectives_is_ranked_by_user_visible_time():
    doc = run([req(ttft=3.0, queue=0.05, call=3.3, prompt=6000) for _ in range(5)])
    keys, d = levers(doc)
    assert d.problem == "all" and keys == ["cut_prompt"] and d.verdict.startswith("no objective set; prefill dominates")


def test_facts_blame_each_miss_on_the_parts_its_objective_measures():
    f = lane_facts(run([req(ttft=2.0, queue=0.5, call=3.0, missed="ttft_p99,itl_p99")], slo=SLO), "a")
    assert f.time == {"queue": 0.5, "prefill": 1.5, "decode": 1.0} and f.misses_by == {"ttft_p99": 1, "itl_p99": 1}
    assert f.visible == f.time and f.server_clock


def test_printing_is_plain_text_with_brackets_intact():
    span = {"prompt": 1, "char_offset": 3, "context": "x", "before": "[a]", "after": "[b]"}
    prefix = {"declared_prefix_prompts": 4, "unstable_prompts": 4, "predicted_hit_rate": 0.0, "first_unstable": span}
    doc = run([req() for _ in range(4)], slo=SLO, prefix=prefix, prefix_tokens=100, gate_rate=0.2)
    buf = io.StringIO()
    print_diagnosis(doc, Console(file=buf, width=300), "run [1]")
    out = buf.getvalue()
    assert "diagnosis of run [1]" in out and "[[a]] → [[b]]" in out and "1. stabilize the prefix [prefill" in out
    assert "note: only 20% of answers passed the gate" in out
    assert diagnosis_lines(diagnose(doc))[1].startswith("  1. stabilize the prefix")
