"""`twospeed bench`: replay a workload against an OpenAI-compatible endpoint and report both speeds per lane.

Before any traffic the server is probed (server_kind.py: twospeed, vLLM, llama.cpp or another OpenAI-compatible
server, and the context length it states) and the workload fitted to that context (fit.py). Open loop (requests
go out on the workload's arrival schedule, whatever the server does) unless
`concurrency` is set (closed loop: that many users, each sending when its last answer is done). An arrival
of a job lane is a whole agent job, whose calls go out one after another (job_runner.py). Every request is
streamed and timed token by token (client.py), judged by its lane's gate and SLO, and billed (results.py);
jobs get their own clock and bill (job_results.py); the server's /metrics is scraped before, during and
after (a peer's clock is read from it, or from each response, by its kind); the lane's prompts are scored for prefix stability; every lane is diagnosed (diagnose.py). Output:
results.json, requests.csv, jobs.csv and report.html in `out`, and a console summary.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from twospeed.lab import bill as billing
from twospeed.lab import diagnose, gates, job_results, prefix_score, provenance, results, scrape
from twospeed.lab.client import Response, stream_request
from twospeed.lab.fit import Fit, fit_workload
from twospeed.lab.lane_facts import queue_share
from twospeed.lab.server_kind import GENERIC, ServerInfo, probe
from twospeed.lab.job_runner import JobRun, run_job
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planned, Planner
from twospeed.lab.workload import Price, Workload, load_workload


@dataclass(slots=True)
class BenchConfig:
    url: str  # API root, e.g. http://127.0.0.1:8000/v1
    model: str  # the model id the server expects
    workload: str  # built-in name, YAML file or JSONL trace
    requests: int | None = None  # stop after this many requests (default 40 when no duration)
    duration: float | None = None  # or send for this many seconds
    rate: float | None = None  # total requests/s (open loop), split over lanes by share
    concurrency: int | None = None  # closed loop: this many users
    seed: int = 0
    out: str | None = None  # folder for results.json, requests.csv, report.html
    tokenizer: str | None = None  # tokenizer.json (or its folder, or 'demo') for token counts
    price: str | None = None  # INPUT,CACHED,OUTPUT dollars per 1M tokens (overrides the workload's)
    api_key: str | None = None
    scale: float = 1.0  # multiplies prompt lengths
    max_prompt_tokens: int | None = None  # cap on each prompt
    max_output_tokens: int | None = None  # cap on each request's max_tokens
    salt: str | None = None  # None = a fresh random salt (no earlier run's prefix cache can be hit)
    ignore_eos: bool = False  # ask for exactly max_tokens (vLLM/twospeed extension)
    summarize_dumps: int | None = None  # job lanes: tool dumps enter the history as this many tokens (0 = off)
    unstable_prefix: bool = False  # stamp the send time into every shared prefix (a harness bug, on purpose)
    label: str | None = None  # a name for this run in comparisons (e.g. "chunked on")
    timeout: float = 600.0  # seconds per request
    kv_block_size: int = 16  # tokens per KV block on the server, for the KV memory of cached prefixes
    late_threshold: float = 0.05  # a request sent this many seconds late counts as late
    # seconds between the timeline's /metrics scrapes. Not faster by default: rendering ~2.6k lines of exposition
    # takes CPU the server's engine wants on a 2-core machine, so frequent scrapes slow what the lab measures
    metrics_period: float = 2.0
    prompts: str | None = None  # every lane's prompts: "synthetic" | "task" (the task corpus); None = the lanes'
    endpoint: str | None = None  # every lane's endpoint: "completions" | "chat" (an instruct model); None = the lanes'
    max_model_len: int | None = None  # the server's context where it states none (lowers what it states)
    strict_lengths: bool = False  # refuse a workload that does not fit the context instead of fitting it
    progress: bool = True

    def __post_init__(self) -> None:
        if self.requests is not None and self.duration is not None:
            raise ValueError("give --requests or --duration, not both")
        if self.requests is None and self.duration is None:
            self.requests = 40
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give --rate (open loop) or --concurrency (closed loop), not both")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_model_len is not None and self.max_model_len < 64:
            raise ValueError(f"--max-model-len must be >= 64, got {self.max_model_len}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be http(s)://HOST:PORT/v1, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.salt is None:
            self.salt = secrets.token_hex(4)


def _tokenizer_path(cfg: BenchConfig) -> str | Path | None:
    """--tokenizer, a built-in model's name for its tokenizer, or (without one) --model's when it is built in."""
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin

    name = cfg.tokenizer if cfg.tokenizer is not None else cfg.model
    return builtin_checkpoint_path(name) if is_builtin(name) else cfg.tokenizer


def _model_config(path) -> dict:
    try:
        file = Path(path) / "config.json" if path and Path(path).is_dir() else None
        return json.loads(file.read_text()) if file and file.is_file() else {}
    except (OSError, ValueError):
        return {}


def probe_server(cfg: BenchConfig) -> ServerInfo:
    """The server's kind and context length (raises ConnectionError when it cannot be reached)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), headers=headers) as client:
        return probe(cfg.url, client, cfg.max_model_len)


def prepare(cfg: BenchConfig, info: ServerInfo | None = None,
            fit: Fit | None = None) -> tuple[Workload, Planner, TokenCounter, Path | str | None]:
    """Load and check everything that can be wrong before any traffic is sent; with the server's `info`, fit the
    workload to its context (or pass a saved run's `fit` to rebuild its very prompts). The fit is the planner's
    (planner.config.fit)."""
    workload = load_workload(cfg.workload)
    if cfg.endpoint is not None and cfg.endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be completions or chat, got {cfg.endpoint!r}")
    for lane in workload.lanes:
        if cfg.endpoint is not None:
            lane.endpoint = cfg.endpoint
        for gate in lane.gates():
            gates.check_config(gate)
    if cfg.price:
        workload.price = Price.parse(cfg.price)
    tok = _tokenizer_path(cfg)
    counter = TokenCounter(tok)
    plan = PlanConfig(seed=cfg.seed, salt=cfg.salt, scale=cfg.scale, max_prompt_tokens=cfg.max_prompt_tokens,
                      rate=cfg.rate, max_output_tokens=cfg.max_output_tokens, summarize_dumps=cfg.summarize_dumps,
                      unstable_prefix=cfg.unstable_prefix, prompts=cfg.prompts)
    if fit is None and info is not None:
        probe_planner = Planner(workload, plan, counter)  # only for the lanes' dump policy
        fit = fit_workload(workload, info.context_length, info.context_source, cfg.scale, counter.exact,
                           cfg.strict_lengths, probe_planner.summarize, cfg.max_prompt_tokens, cfg.max_output_tokens,
                           lambda: [(counter.billed(t.prompt, workload.lane(t.lane).endpoint), t.max_tokens)
                                    for t in workload.trace or [] if t.calls is None])
    plan.fit = fit
    planner = Planner(workload, plan, counter)
    return workload, planner, counter, tok


async def _drive(cfg: BenchConfig, workload: Workload, planner: Planner, counter: TokenCounter, progress,
                 info: ServerInfo) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    kind = info.kind
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=10.0), limits=limits,
                                 headers=headers) as client:
        before = await scrape.scrape(client, cfg.url, kind.metric_buckets)
        responses: list[Response] = []
        jobs: list[JobRun] = []
        start = time.perf_counter()
        stop, timeline = asyncio.Event(), []
        sampler = asyncio.create_task(scrape.sample_timeline(client, cfg.url, start, timeline, stop,
                                                             cfg.metrics_period))

        async def send(p: Planned) -> Response:
            resp = await stream_request(client, cfg.url, workload.lane(p.lane), p, cfg.model, counter, start,
                                        cfg.ignore_eos, kind)
            responses.append(resp)
            return resp

        async def one(p: Planned) -> None:
            """One arrival: a request, or a job (its calls strictly one after another)."""
            if p.job is None:
                progress((await send(p)).error is not None)
                return
            run = await run_job(p, send, start)
            jobs.append(run)
            progress(run.error is not None)

        if cfg.concurrency is None:
            plan = planner.open_loop(cfg.requests, cfg.duration)
            tasks = []
            for p in plan:
                delay = start + p.offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(p)))
            await asyncio.gather(*tasks)
        else:
            stream = planner.closed_loop()
            sent = 0

            async def user() -> None:
                nonlocal sent
                while True:
                    if cfg.requests is not None and sent >= cfg.requests:
                        return
                    if cfg.duration is not None and time.perf_counter() - start >= cfg.duration:
                        return
                    p = next(stream, None)
                    if p is None:
                        return
                    sent += 1
                    await one(p)

            await asyncio.gather(*(user() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - start
        stop.set()
        await sampler
        after = await _settled_scrape(client, cfg.url, kind, before, sum(r.status == 200 for r in responses))
    return {"responses": responses, "jobs": jobs, "wall": wall, "before": before, "after": after,
            "timeline": timeline, "memory": info.memory}


async def _settled_scrape(client: httpx.AsyncClient, url: str, kind, before: dict | None, accepted: int,
                          wait_s: float = 5.0) -> dict | None:
    """/metrics after the run, scraped again (for at most `wait_s`) until the server counts every request it
    accepted as finished: a peer records a request's histograms just after its last chunk goes out."""
    deadline = time.perf_counter() + wait_s
    while True:
        after = await scrape.scrape(client, url, kind.metric_buckets)
        done = kind.finished(before, after)
        if done is None or done >= accepted or time.perf_counter() > deadline:
            return after
        await asyncio.sleep(0.25)


def run_bench(cfg: BenchConfig, console=None) -> dict:
    """Run, judge, summarise, write the files; returns the results.json document."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    info = probe_server(cfg)
    workload, planner, counter, tok = prepare(cfg, info)
    for line in planner.config.fit.lines():
        console.print(line, highlight=False, markup=False)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    total = cfg.requests if cfg.requests is not None else None
    with Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(), console=console,
                  disable=not cfg.progress, transient=True) as bar:
        task = bar.add_task(workload.name, total=total, errors=0)
        errors = 0

        def progress(failed: bool) -> None:
            nonlocal errors
            errors += failed
            bar.update(task, advance=1, errors=errors)

        raw = asyncio.run(_drive(cfg, workload, planner, counter, progress, info))
    doc = assemble(cfg, workload, counter, raw, started, _model_config(tok), planner, info)
    doc["diagnosis"] = [d.as_dict() for d in diagnose.diagnose(doc)]
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        results.write_json(doc, out / "results.json")
        results.write_csv(doc["requests"], out / "requests.csv")
        results.write_csv(doc["jobs"], out / "jobs.csv", job_results.JOB_CSV_FIELDS)
        from twospeed.lab.report import write_html

        write_html(doc, out)
    return doc


def client_lag(lags: list[float], threshold: float) -> dict:
    """How far behind its schedule the client sent (open loop). It fell behind when more than 1% of requests
    went out over `threshold` seconds late: then the server saw a lighter load than the workload asked for."""
    late = sum(lag > threshold for lag in lags)
    return {"lag_p50_s": float(np.percentile(lags, 50)) if lags else None,
            "lag_p99_s": float(np.percentile(lags, 99)) if lags else None,
            "lag_max_s": max(lags) if lags else None, "late_requests": int(late), "late_threshold_s": threshold,
            "fell_behind": bool(lags) and late > 0.01 * len(lags)}


def _prefix_check(responses: list[Response], lane, counter: TokenCounter, block_size: int) -> dict | None:
    """prefix-score over the lane's prompts as sent (None without the target's tokenizer)."""
    tok = counter.model_tokenizer
    if tok is None or not responses:
        return None
    rendered, prefixes = [], []
    for resp in sorted(responses, key=lambda r: r.sent):
        p = resp.planned
        chat = lane.endpoint == "chat" and (tok.chat_template is not None)
        item = {"messages": p.messages or [{"role": "user", "content": p.prompt}]} if chat else {"prompt": p.prompt}
        rendered.append(prefix_score.render(item, tok))
        prefixes.append(p.meta.get("prefix", ""))
    return prefix_score.lane_check(rendered, prefixes, block_size)


def _lane_summary(cfg: BenchConfig, workload: Workload, lane, records: list[dict], jobs: list[dict],
                  responses: list[Response], planner: Planner | None, counter: TokenCounter, wall: float,
                  block_size: int) -> dict:
    summary = results.lane_summary(records, lane.slo, workload.price, cfg.seed, wall)
    if jobs:
        window = lane.job.window_s if lane.job else None
        summary["jobs"] = job_results.jobs_summary(jobs, window, wall, cfg.seed)
    summary["policy"] = planner.policy(lane) if planner else None
    summary["prefix"] = _prefix_check(responses, lane, counter, block_size)
    summary["prefix_tokens"] = round(lane.prefix_tokens * (planner.scale(lane) if planner else cfg.scale))
    return summary


def assemble(cfg: BenchConfig, workload: Workload, counter: TokenCounter, raw: dict, started: str,
             model_config: dict, planner: Planner | None = None, info: ServerInfo | None = None) -> dict:
    kind = info.kind if info is not None else GENERIC
    judged = {id(r): results.record(r, workload, counter) for r in raw["responses"]}
    records = sorted(judged.values(), key=lambda r: (r["index"], r["turn"] or 0))
    run_clock = kind.run_clock(raw["before"], raw["after"])
    clock = run_clock.as_dict() if run_clock else None
    active = {r["lane"] for r in records}
    lane_clock = clock if clock is not None and len(active) == 1 else None  # the run's clock is the lane's
    share = queue_share(lane_clock)
    jobs = sorted((job_results.job_record(run, [judged[id(c)] for c in run.calls],
                                          _window(workload, run.planned.lane), workload.price, share)
                   for run in raw.get("jobs", [])), key=lambda j: j["index"])
    by_lane = {lane.name: [r for r in raw["responses"] if r.planned.lane == lane.name] for lane in workload.lanes}
    memory = raw.get("memory") or {}
    # the server's own block size and KV bytes per token (its cache format) where it says them
    block_size = memory.get("block_size") or cfg.kv_block_size
    per_token = memory.get("kv_bytes_per_token") or billing.kv_bytes_per_token(model_config)
    lanes = {lane.name: _lane_summary(cfg, workload, lane, [r for r in records if r["lane"] == lane.name],
                                      [j for j in jobs if j["lane"] == lane.name], by_lane[lane.name],
                                      planner, counter, raw["wall"], block_size)
             for lane in workload.lanes if lane.name in active}
    for summary in lanes.values():
        summary["server_clock"] = lane_clock
    lags = [r["lag_s"] for r in records if r["lag_s"] is not None]
    sources = {r["token_source"] for r in records if r["token_source"]}
    after = raw["after"]
    cached_blocks = (after or {}).get(scrape.CACHED_BLOCKS)
    twospeed = scrape.is_twospeed(after) or any(r.get("clock_source") == "twospeed" for r in records)
    kind_name = kind.name if kind is not GENERIC else ("twospeed" if twospeed else "other")
    fit = planner.config.fit if planner is not None else None
    return {
        "schema_version": results.SCHEMA_VERSION,
        "run": {"workload": workload.name, "workload_digest": workload.digest, "seed": cfg.seed, "salt": cfg.salt,
                "url": cfg.url, "model": cfg.model, "label": cfg.label,
                "mode": {"requests": cfg.requests, "duration_s": cfg.duration, "rate": cfg.rate,
                         "concurrency": cfg.concurrency},
                "started_at": started, "wall_s": raw["wall"], "scale": cfg.scale,
                "max_prompt_tokens": cfg.max_prompt_tokens, "max_output_tokens": cfg.max_output_tokens,
                "ignore_eos": cfg.ignore_eos,
                "policy": {"summarize_dumps": cfg.summarize_dumps, "unstable_prefix": cfg.unstable_prefix},
                "token_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else "none"),
                "server_kind": kind_name, "max_model_len": getattr(cfg, "max_model_len", None),
                "strict_lengths": getattr(cfg, "strict_lengths", False),
                "fit": fit.as_dict() if fit is not None else None,
                "clock_sources": provenance.clock_sources(records, clock, len(active), kind.label)},
        "workload": workload.source,
        "lanes": lanes,
        "total": results.lane_summary(records, None, workload.price, cfg.seed, raw["wall"]),
        "client": client_lag(lags, cfg.late_threshold),
        "server": {"metrics_delta": scrape.delta(raw["before"], after), "clock": clock,
                   "kv_memory": billing.kv_memory(cached_blocks, block_size, per_token),
                   "memory": raw.get("memory"),
                   "timeline": raw["timeline"]},
        "requests": records,
        "jobs": jobs,
    }


def _window(workload: Workload, lane_name: str) -> float | None:
    lane = workload.lane(lane_name)
    return lane.job.window_s if lane.job else None
