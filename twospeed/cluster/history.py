"""The cluster's /dashboard/data: every replica's history (server/history.py) merged into one document.

The page reads one document of the shape History.since returns, so the merge keeps it: steps, gaps and ended
sequences of all replicas in time order (each record and step tagged with its replica), totals and SLO counts
summed per lane, the load summed. A step's running, waiting and KV columns become the cluster's at that moment
(each replica's last value before it, carried forward), so the load and KV charts show the whole cluster; the
tokens and step time stay the step's own.

The cursor stays exact: replicas answer at slightly different moments, so everything stamped after the earliest
replica's `now` is held back for the next poll (which asks from that `now`); nothing is sent twice or missed.
"""

from __future__ import annotations

from collections import Counter

# Step columns that describe a replica's state (summed over replicas, carried forward), not the step's own work.
STATE_COLUMNS = ("num_running", "num_waiting", "kv_blocks_used", "kv_cached_blocks")


def merge_histories(parts: list[tuple[str, dict]], pool_blocks: list[int]) -> dict:
    """parts: (replica name, History.since() document) per replica that answered; pool_blocks: each one's KV pool."""
    if not parts:
        return {"now": 0.0, "window_s": 0.0, "lanes": [], "steps": {"t": []}, "gaps": {"t": [], "lane": [], "gap": []},
                "requests": [], "totals": {}, "slo": {}, "load": _load([], [])}
    cut = min(doc["now"] for _, doc in parts)
    lanes: list[str] = []
    for _, doc in parts:
        lanes += [lane for lane in doc["lanes"] if lane not in lanes]
    requests = sorted((dict(r, replica=name) for name, doc in parts for r in doc["requests"] if r["t"] <= cut),
                      key=lambda r: r["t"])
    gaps = sorted((t, lane, g) for _, doc in parts
                  for t, lane, g in zip(doc["gaps"]["t"], doc["gaps"]["lane"], doc["gaps"]["gap"]) if t <= cut)
    return {"now": cut, "window_s": parts[0][1]["window_s"], "lanes": lanes, "steps": _steps(parts, cut, pool_blocks),
            "gaps": {"t": [g[0] for g in gaps], "lane": [g[1] for g in gaps], "gap": [g[2] for g in gaps]},
            "requests": requests, "totals": _sum_lanes(doc["totals"] for _, doc in parts),
            "slo": _sum_lanes(doc["slo"] for _, doc in parts),
            "load": _load([doc["load"] for _, doc in parts], pool_blocks)}


def _steps(parts: list[tuple[str, dict]], cut: float, pool_blocks: list[int]) -> dict:
    rows = []  # (t, replica index, {column: value})
    columns: list[str] = []
    for k, (_, doc) in enumerate(parts):
        steps = doc["steps"]
        names = [c for c in steps if c != "t"]
        columns += [c for c in names if c not in columns]
        rows += [(t, k, {c: steps[c][i] for c in names}) for i, t in enumerate(steps["t"]) if t <= cut]
    rows.sort(key=lambda row: (row[0], row[1]))
    # Each replica's state before its first step here: that first step's (the closest known), or, for one with no
    # step here, its load now.
    state = [_state(doc["load"], n) for (_, doc), n in zip(parts, pool_blocks)]
    for _, k, values in reversed(rows):
        state[k] = {c: values.get(c) for c in STATE_COLUMNS}
    out: dict[str, list] = {"t": [], "replica": [], **{c: [] for c in columns}}
    for t, k, values in rows:
        state[k] = {c: values.get(c) for c in STATE_COLUMNS}
        out["t"].append(t)
        out["replica"].append(k)
        for c in columns:
            if c in STATE_COLUMNS:
                out[c].append(sum(s.get(c) or 0 for s in state))
            else:
                out[c].append(values.get(c))
    return out


def _state(load: dict, pool_blocks: int) -> dict:
    return {"num_running": sum(load["running"].values()), "num_waiting": sum(load["waiting"].values()),
            "kv_blocks_used": round(load["kv_usage"] * pool_blocks), "kv_cached_blocks": load["cached_blocks"]}


def _sum_lanes(docs) -> dict[str, dict]:
    out: dict[str, Counter] = {}
    for doc in docs:
        for lane, counts in doc.items():
            out.setdefault(lane, Counter()).update(counts)
    return {lane: dict(c) for lane, c in out.items()}


def _load(loads: list[dict], pool_blocks: list[int]) -> dict:
    running, waiting = Counter(), Counter()
    for load in loads:
        running.update(load["running"])
        waiting.update(load["waiting"])
    blocks = sum(pool_blocks) or 1
    used = sum(load["kv_usage"] * n for load, n in zip(loads, pool_blocks))
    return {"running": dict(running), "waiting": dict(waiting), "kv_usage": used / blocks,
            "cached_blocks": sum(load["cached_blocks"] for load in loads)}
