"""The gate's fixed probe set: next-token distributions of the baseline and the candidate at the same inputs.

A probe is a workload prompt (as token ids, exactly what the server prefills) followed by the first j tokens of
the baseline's own answer to it, j = 0 and a few points inside the answer: the positions where the answer is
decided, teacher-forced so both servers see identical inputs. Each server is asked for one greedy token with
its top-k logprobs (the completions endpoint's `logprobs`, from the raw distribution: no grammar). Compared:

- top-1 agreement: both put the same token first (rate, Wilson interval);
- KL(baseline || candidate) estimated on the baseline's top-k plus one bucket for the rest. A token missing
  from the candidate's top-k gets at most its k-th probability (it ranked lower), so the estimate never
  reads a token the candidate dropped as free. Tokens are keyed by their text, as the API returns them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from twospeed.lab import stats

POSITIONS = (0.0, 1 / 3, 2 / 3)  # where in the baseline's answer a probe cuts it (fraction of its tokens)


@dataclass(slots=True)
class Probe:
    lane: str
    index: int  # the workload request it comes from
    position: int  # answer tokens forced before the probed one
    ids: list[int]  # prompt + forced answer tokens


def build(plans: list, answers: dict[int, str], counter, per_lane: int) -> list[Probe]:
    """Probes from the first `per_lane` answered requests of each lane (plans: the run's Planned requests in
    order, with `endpoint` attached by the caller as (planned, endpoint); answers: index -> baseline text)."""
    taken: dict[str, int] = {}
    probes = []
    for planned, endpoint in plans:
        text = answers.get(planned.index)
        if text is None or taken.get(planned.lane, 0) >= per_lane:
            continue
        taken[planned.lane] = taken.get(planned.lane, 0) + 1
        prompt = counter.prompt_ids(planned.prompt, endpoint, planned.messages)
        answer = counter.ids(text)
        for j in sorted({int(f * len(answer)) for f in POSITIONS}):
            probes.append(Probe(planned.lane, planned.index, j, prompt + answer[:j]))
    return probes


def query(url: str, model: str, probes: list[Probe], top_k: int, api_key: str | None = None,
          timeout: float = 120.0) -> list[dict[str, float] | None]:
    """Each probe's next-token top-k (token text -> logprob) from the server; None where it failed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for p in probes:
            body = {"model": model, "prompt": p.ids, "max_tokens": 1, "temperature": 0, "logprobs": top_k,
                    "lane": "gate-probe"}
            try:
                r = client.post(url + "/completions", json=body)
                out.append(r.json()["choices"][0]["logprobs"]["top_logprobs"][0] if r.status_code == 200 else None)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                out.append(None)
    return out


def kl_topk(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(p || q) in nats over p's top-k and a rest bucket (logprob dicts)."""
    q_floor = math.exp(min(q_top.values())) if q_top else 1e-12
    p = {t: math.exp(v) for t, v in p_top.items()}
    q = {t: math.exp(q_top[t]) if t in q_top else q_floor for t in p}
    kl = sum(pt * math.log(pt / max(q[t], 1e-12)) for t, pt in p.items() if pt > 0)
    p_rest, q_rest = max(0.0, 1 - sum(p.values())), max(1e-12, 1 - sum(q.values()))
    return max(0.0, kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 1e-12 else 0.0))


def top1(top: dict[str, float]) -> str:
    return max(top, key=top.get)


def compare(base: list[dict | None], cand: list[dict | None]) -> dict:
    """Top-1 agreement and KL over the probes both servers answered."""
    pairs = [(b, c) for b, c in zip(base, cand) if b and c]
    agree = sum(top1(b) == top1(c) for b, c in pairs)
    kls = [kl_topk(b, c) for b, c in pairs]
    n = len(pairs)
    return {"probes": n, "failed": len(base) - n, "top1_agreement": agree / n if n else None,
            "top1_agreement_ci": stats.proportion_ci(agree, n),
            "kl_mean": float(np.mean(kls)) if kls else None, "kl_p50": float(np.median(kls)) if kls else None,
            "kl_p99": float(np.percentile(kls, 99)) if kls else None, "kl_max": max(kls) if kls else None}


def by_lane(probes: list[Probe], base: list, cand: list) -> dict[str, dict]:
    lanes: dict[str, list[int]] = {}
    for i, p in enumerate(probes):
        lanes.setdefault(p.lane, []).append(i)
    return {lane: compare([base[i] for i in idx], [cand[i] for i in idx]) for lane, idx in lanes.items()}


def to_json(probes: list[Probe], tops: list) -> dict:
    return {"probes": [asdict(p) for p in probes], "top": tops}


def from_json(doc: dict) -> tuple[list[Probe], list]:
    return [Probe(**p) for p in doc["probes"]], doc["top"]
