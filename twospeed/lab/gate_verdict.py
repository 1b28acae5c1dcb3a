"""The quantization gate's judgement: per lane, did the candidate keep the baseline's contracts and its speed?

Pure functions over two bench runs of the same workload (results.json documents, requests paired by index)
and the probe comparison (probes.py); `twospeed gate` (gate.py) runs them. Per lane:

- gate pass: the paired exact McNemar test on the requests both runs sent. Of the pairs that disagree, `lost`
  passed on the baseline and failed on the candidate, `gained` the other way; under "no difference" each
  disagreement is a coin flip, so P(X >= lost | X ~ Binomial(lost + gained, 1/2)) is the chance of losing this
  many by noise alone. Below `alpha` the pass rate dropped beyond the noise: no-ship. (Wilson intervals of
  both rates are reported too; the paired test is the sharper one, since both runs answered the same prompts.)
- latency: TTFT and ITL p50/p99. Worse when three things hold: the candidate's value exceeds the baseline's
  by more than `latency_tolerance` (relative); their 95% bootstrap intervals do not overlap; and, pairing the
  requests (same prompt, same send time), significantly many of them are slower by more than the tolerance
  (a one-sided sign test: P(X >= slower | X ~ Binomial(pairs, 1/2)) < alpha). The sign test is what keeps a
  handful of requests on a busy machine from reading as a regression: with under 5 pairs it cannot fire.
- the model's next tokens: the mean KL (nats) of the candidate's next-token distributions from the baseline's on
  the lane's probes (the baseline's own answer positions, teacher-forced). Above `max_probe_kl` the model itself
  changed, whatever the lane's gate says: a lane whose answers a grammar shapes, or whose contract a broken model
  keeps by chance (it never refuses, say), passes its gate on any weights. The bar sits between what a sound
  4-bit format and a destroyed one move the probes (BENCHMARKS.md, the gate on SmolLM2).
- reported, not judged: output tok/s, token agreement of greedy outputs (exact-match rate, where the first
  divergence falls), top-1 agreement on the probe set, KV capacity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from twospeed.lab import stats

# (label, lane-summary metric, quantile, the per-request value the pairs compare)
LATENCY = (("TTFT p50", "ttft", "p50", "ttft_s"), ("TTFT p99", "ttft", "p99", "ttft_s"),
           ("ITL p50", "itl", "p50", "itl_p50_s"), ("ITL p99", "itl", "p99", "itl_p99_s"))


@dataclass(slots=True)
class Judgement:
    """A lane's verdict: ship, or no-ship with every reason."""

    lane: str
    ship: bool
    reasons: list[str] = field(default_factory=list)  # why not (empty when it ships)
    notes: list[str] = field(default_factory=list)  # what was checked and held

    def as_dict(self) -> dict:
        return asdict(self)


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): the chance of k or more of n coin flips coming up one way."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n if k else 1.0


def mcnemar_drop(base: list[bool], cand: list[bool]) -> dict:
    """Paired pass/fail of the same requests: how many were lost and gained, and the one-sided exact p-value of
    losing at least that many by chance (1.0 when nothing was lost)."""
    lost = sum(b and not c for b, c in zip(base, cand))
    gained = sum(c and not b for b, c in zip(base, cand))
    return {"pairs": len(base), "lost": lost, "gained": gained, "p_value": binomial_tail(lost, lost + gained)}


def paired_slower(base: list[float | None], cand: list[float | None], tolerance: float) -> dict:
    """Of the requests both timed, how many the candidate served more than `tolerance` slower, and the sign test's
    one-sided p-value of that many by chance."""
    pairs = [(b, c) for b, c in zip(base, cand) if b is not None and c is not None]
    slower = sum(c > b * (1 + tolerance) for b, c in pairs)
    return {"pairs": len(pairs), "slower": slower, "p_value": binomial_tail(slower, len(pairs))}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Over (baseline, candidate) greedy outputs of the same prompts: the exact-match rate (with a Wilson
    interval) and where the first divergence falls among those that differ (token index)."""
    where = [first_divergence(a, b) for a, b in pairs]
    diverged = [w for w in where if w is not None]
    n, same = len(pairs), len(pairs) - len(diverged)
    return {"pairs": n, "exact_match": same / n if n else None, "exact_match_ci": stats.proportion_ci(same, n),
            "first_divergence_p50": float(np.median(diverged)) if diverged else None,
            "first_divergence_min": min(diverged) if diverged else None}


def _value(lane: dict, metric: str, q: str) -> tuple[float | None, list | None]:
    s = lane["stats"][metric]
    return s[q], s[f"{q}_ci"]


def judge_lane(name: str, base: dict, cand: dict, drop: dict, slower: dict[str, dict], alpha: float = 0.05,
               latency_tolerance: float = 0.10, probe: dict | None = None, max_probe_kl: float = 1.0) -> Judgement:
    """base, cand: the lane's summaries in the two runs; drop: mcnemar_drop over its paired gate results;
    slower: paired_slower per LATENCY label over its paired requests; probe: probes.compare over the lane's probes."""
    j = Judgement(name, True)
    rb, rc = base["gate"]["rate"], cand["gate"]["rate"]
    rates = f"{_pct(rb)} -> {_pct(rc)}"
    if drop["lost"] and drop["p_value"] < alpha:
        j.reasons.append(f"gate pass dropped beyond the noise: {rates} ({drop['lost']} answers lost, "
                         f"{drop['gained']} gained; paired p = {drop['p_value']:.3g} < {alpha})")
    else:
        j.notes.append(f"gate pass within the noise: {rates} ({drop['lost']} lost, {drop['gained']} gained; "
                       f"paired p = {drop['p_value']:.3g})")
    for label, metric, q, _ in LATENCY:
        (vb, cb), (vc, cc) = _value(base, metric, q), _value(cand, metric, q)
        if vb is None or vc is None or not vc > vb * (1 + latency_tolerance):
            continue
        pairs = slower.get(label) or {"pairs": 0, "slower": 0, "p_value": 1.0}
        change = (f"{label} {vb * 1e3:,.1f} -> {vc * 1e3:,.1f} ms ({(vc / vb - 1) * 100 if vb else 0:+.0f}%; "
                  f"{pairs['slower']} of {pairs['pairs']} requests slower by over {latency_tolerance:.0%}, "
                  f"p = {pairs['p_value']:.2g})")
        if stats.overlaps(cb, cc) is False and pairs["p_value"] < alpha:
            j.reasons.append(f"latency got worse: {change}, beyond the noise")
        else:
            j.notes.append(f"{change}: within the noise")
    if probe and probe.get("kl_mean") is not None:
        moved = (f"probe KL mean {probe['kl_mean']:.3g} nats over {probe['probes']} probes (top-1 agreement "
                 f"{_pct(probe['top1_agreement'])})")
        if probe["kl_mean"] > max_probe_kl:
            j.reasons.append(f"next-token distributions moved: {moved} > {max_probe_kl:g}")
        else:
            j.notes.append(f"next-token distributions held: {moved} <= {max_probe_kl:g}")
    if cand.get("errors", 0) > base.get("errors", 0):
        j.reasons.append(f"{cand['errors']} requests failed on the candidate ({base.get('errors', 0)} on the baseline)")
    j.ship = not j.reasons
    return j


def kv_capacity(memory: dict | None, lane_tokens: float | None) -> dict | None:
    """Tokens the server's pool holds, and how many sequences of the lane's typical length (prompt + output
    tokens, p50) fit at once."""
    if not memory or not memory.get("num_blocks"):
        return None
    bs, blocks = memory["block_size"], memory["num_blocks"]
    per_seq = math.ceil(lane_tokens / bs) if lane_tokens else None
    return {"max_tokens": blocks * bs, "kv_bytes_per_token": memory.get("kv_bytes_per_token"),
            "kv_cache_dtype": memory.get("kv_cache_dtype"), "lane_tokens_p50": lane_tokens,
            "max_sequences": blocks // per_seq if per_seq else None}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"
