"""`twospeed plan calibrate`: time the live engine over a sweep of step shapes and fit a step profile.

The engine runs as it serves (the same LLMEngine, flags and steps): the sweep is requests given to it, and every
step it takes is observed through its own cost model (a recorder wrapped around it, so the scheduler and the
online fit go on unchanged). Three phases:

  prefill   for each context C: a prefix of C tokens is computed and cached, then for each chunk size L a fresh
            request C + L is admitted at its cache hit, so one step computes exactly L prompt tokens after C
            (repeated `repeats` times; C = 0 is a plain prompt). Needs the prefix cache for C > 0.
  decode    for each batch B and context C: B requests of C distinct tokens, each decoding `decode_steps` tokens
            together (steps of B decode rows reading B x C context).
  mixed     eight streams decoding while a long prompt arrives and is chunked beside them (the time-sized share),
            the steps that stretch a stream's gap.

Shapes that do not fit (the budget, max_model_len, the pool, max_num_seqs) are left out. The profile is fitted on
the median time of each distinct shape (one disturbed step counts once at most) and its residuals are reported on
every step timed, by kind. On a shared machine, run it quietly: every number is a measurement.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from twospeed.engine.cost_model import StepShape
from twospeed.engine.sampling_params import SamplingParams
from twospeed.plan.precision import kv_bytes_per_token, weight_bytes
from twospeed.plan.profile import Profile, median_by_shape
from twospeed.plan.roofline import dtype_name


@dataclass(slots=True)
class Sweep:
    """The shapes a calibration times (tokens)."""

    chunks: tuple[int, ...] = (16, 64, 256, 1024)  # prompt chunk sizes
    contexts: tuple[int, ...] = (0, 512, 1536)  # tokens cached before a chunk; a decoding stream's context
    batches: tuple[int, ...] = (1, 4, 16)  # streams decoding together
    decode_steps: int = 12  # decode steps per (batch, context)
    repeats: int = 3  # times each prefill shape is timed
    mixed: bool = True  # a long prompt chunked beside eight decoding streams

    def __post_init__(self) -> None:
        if min(self.chunks, default=0) < 1 or min(self.batches, default=0) < 1 or min(self.contexts, default=0) < 0:
            raise ValueError("chunk sizes and batches must be >= 1, contexts >= 0")
        if self.decode_steps < 2 or self.repeats < 1:
            raise ValueError("decode_steps must be >= 2 and repeats >= 1")


class _Recorder:
    """The engine's cost model, unchanged for the scheduler and the online fit; every observed step is kept."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def predict(self, shape: StepShape) -> float:
        return self.inner.predict(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.seen.append((shape, seconds))
        self.inner.observe(shape, seconds)


def calibrate(engine, sweep: Sweep = Sweep(), seed: int = 0, say: Callable[[str], None] = lambda s: None) -> Profile:
    """Run the sweep on `engine` (an LLMEngine) and fit its profile."""
    prior = list(engine.cost_model.coefficients.values())
    recorder = _Recorder(engine.cost_model)
    engine.cost_model = engine.scheduler.cost_model = recorder
    try:
        runner = _Sweeper(engine, sweep, seed, say)
        runner.prefill()
        runner.decode()
        if sweep.mixed:
            runner.mixed()
    finally:
        engine.cost_model = engine.scheduler.cost_model = recorder.inner
    observed = [(s, t) for s, t in recorder.seen if s.num_tokens and t > 0]
    if len(observed) < 6:
        raise ValueError(f"the sweep timed only {len(observed)} steps; widen it (the model's limits cut it down)")
    return Profile.fitted(median_by_shape(observed), prior, engine.cost_model.key, check=observed,
                          engine=engine_facts(engine), sweep={**asdict(runner.sweep), "steps": len(observed),
                                                              "skipped": runner.skipped},
                          model=str(engine.config.model),
                          created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def engine_facts(engine) -> dict:
    """What the simulator needs of the calibrated engine: its pool, its formats, its limits."""
    cfg, cache = engine.model_config, engine.config.cache
    dtype = dtype_name(engine.dtype)
    quantization = getattr(engine.config, "quantization", None)
    kv_dtype = getattr(cache, "kv_cache_dtype", "auto")
    import torch

    return {"dtype": dtype, "device": str(engine.device), "threads": torch.get_num_threads(),
            "quantization": quantization, "kv_cache_dtype": kv_dtype, "block_size": cache.block_size,
            "num_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
            "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype, kv_dtype),
            "weight_bytes": weight_bytes(cfg, dtype, quantization), "vocab_size": cfg.vocab_size,
            "architecture": cfg.architecture, "num_params": cfg.num_params,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "scheduler": {k: v for k, v in asdict(engine.scheduler_config).items()}}


class _Sweeper:
    def __init__(self, engine, sweep: Sweep, seed: int, say: Callable[[str], None]):
        self.engine, self.say = engine, say
        self.rng = np.random.default_rng(seed)
        self.bs = engine.config.cache.block_size
        self.max_len = engine.max_model_len
        self.budget = engine.scheduler_config.token_budget
        self.pool_tokens = engine.num_blocks * self.bs
        self.skipped: list[str] = []
        contexts = tuple(sorted({c // self.bs * self.bs for c in sweep.contexts}))
        self.sweep = Sweep(sweep.chunks, contexts, sweep.batches, sweep.decode_steps, sweep.repeats, sweep.mixed)

    def fresh(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(3, self.engine.model_config.vocab_size, n)]

    def run(self, prompts: list[list[int]], max_tokens: int, late: list[int] | None = None, after: int = 2) -> None:
        """Serve the prompts to completion; `late` joins after `after` steps."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            self.engine.add_request(None, p, params)
        steps = 0
        while self.engine.has_unfinished_requests():
            if late is not None and steps == after:
                self.engine.add_request(None, late, SamplingParams(max_tokens=1, ignore_eos=True))
            self.engine.step()
            steps += 1

    def prefill(self) -> None:
        caching = self.engine.config.cache.enable_prefix_caching
        for ctx in self.sweep.contexts:
            if ctx and not caching:
                self.skipped.append(f"prefill after {ctx} cached tokens: the prefix cache is off")
                continue
            prefix = self.fresh(ctx)
            if ctx:
                self.run([prefix + self.fresh(1)], 1)  # computes and caches the prefix
            for n in self.sweep.chunks:
                if n > self.budget or ctx + n + 1 > self.max_len:
                    self.skipped.append(f"prefill chunk {n} after {ctx}: over the budget or max_model_len")
                    continue
                self.say(f"prefill: {n} tokens after {ctx} cached")
                for _ in range(self.sweep.repeats):
                    self.run([prefix + self.fresh(n)], 1)

    def decode(self) -> None:
        seqs = self.engine.scheduler_config.max_num_seqs
        for batch in self.sweep.batches:
            for ctx in self.sweep.contexts:
                ctx = max(ctx, self.bs)
                need = batch * (ctx + self.sweep.decode_steps + 1)
                if batch > seqs or ctx + self.sweep.decode_steps > self.max_len or need > 0.9 * self.pool_tokens:
                    self.skipped.append(f"decode batch {batch} at {ctx}: over max_num_seqs, max_model_len or the pool")
                    continue
                self.say(f"decode: {batch} streams at {ctx} tokens")
                self.run([self.fresh(ctx) for _ in range(batch)], self.sweep.decode_steps)

    def mixed(self) -> None:
        streams, ctx = min(8, self.engine.scheduler_config.max_num_seqs - 1), 256
        long = min(2048, self.max_len - 2, self.pool_tokens // 2 - streams * (ctx + 64))
        if streams < 1 or long < 2 * self.bs:
            self.skipped.append("mixed: too small a pool or max_num_seqs")
            return
        for size in sorted({long // 2, long}):
            self.say(f"mixed: a {size}-token prompt beside {streams} streams")
            self.run([self.fresh(ctx) for _ in range(streams)], 48, late=self.fresh(size))
