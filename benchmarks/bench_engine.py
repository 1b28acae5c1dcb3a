"""twospeed against HF transformers `generate`, side by side, and against this machine's bandwidth floor.

Run:  .venv/bin/python benchmarks/bench_engine.py [--dtype bfloat16|float32] [--quick] [--out BENCHMARKS.md]
          [--parts abc] [--hf-batch-sizes 32,16,8] [--wait-quiet SECONDS] [--threads 2] [--profile]

The model is a ~100M-parameter Llama written by transformers into a temp dir
(random weights, fixed seed, tied embeddings; hidden 768, 12 layers, 12 heads,
4 KV heads, intermediate 2048, vocab 32000). Both engines load that folder in
the same process, each with torch.set_num_threads(--threads), each warmed up
once before anything is timed (time.perf_counter). Prompts are random token
ids, so there is no tokenizer and no prefix-cache hit.

  (a) one request: prompt 512, 128 greedy tokens, EOS ignored. twospeed: the
      engine's own clock (ttft, tpot) and wall time. HF: TTFT = a generate with
      max_new_tokens=1; decode tok/s = 127 / (t_128 - t_1).
  (b) 32 requests arriving together, prompt 64-2048 and output 16-256 tokens
      (seeded draw). twospeed: LLM.generate under several engine settings. HF:
      left-padded static batches in arrival order, max_new_tokens = the batch's
      longest output, batch sizes 32, 16, 8, ... until one is slower than the
      best (the fastest is the one compared); only each request's own n_i
      tokens count. Output tok/s = useful output tokens / wall.
  (c) decode step time against the floor = weight bytes a step reads / copy
      bandwidth (torch copy_ of a large buffer, read+write bytes, as STREAM
      copy counts them; a read-only sum is shown too). This VM's bandwidth
      drifts by up to 2x (other tenants), so each measurement is bracketed by
      bandwidth samples ("alongside") and the run's best bandwidth is shown too.

A thread samples the load other processes put on the machine while each part
runs and the report prints it: with two threads on two cores, any other load
stalls the OpenMP barriers and the numbers mean nothing (--wait-quiet helps).
--quick shrinks every part (smoke test) and writes nothing unless --out is
given. --profile prints, instead, where twospeed's steps spend their time
(torch.profiler and cProfile): batch-1 decode, a prefill chunk, and decode at
(b)'s full batch.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import gc
import io
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twospeed import LLM, SamplingParams  # noqa: E402
from twospeed.config import DTYPES  # noqa: E402

MiB = 1 << 20

# The checkpoint: Llama-shaped, tied embeddings (so the vocab matrix is read once per step, as lm_head).
SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True)
FIRST_ID = 3  # prompts draw ids from [3, vocab): 0 pad, 1 bos, 2 eos never appear


@dataclass(slots=True)
class Sizes:
    """Every knob --quick shrinks."""

    a_prompt: int = 512
    a_new: int = 128
    a_repeats: int = 3
    b_requests: int = 32
    b_prompt: tuple[int, int] = (64, 2048)
    b_output: tuple[int, int] = (16, 256)
    hf_batch_sizes: tuple[int, ...] = (32, 16, 8, 4, 2, 1)
    ts_settings: list[dict] = field(default_factory=lambda: [
        {}, dict(max_num_batched_tokens=2048), dict(max_num_seqs=32),
        dict(max_num_batched_tokens=2048, max_num_seqs=32)])
    c_prompt: int = 32
    c_new: int = 64
    c_repeats: int = 3
    bw_mib: int = 512
    bw_repeats: int = 7


QUICK = Sizes(a_prompt=64, a_new=16, a_repeats=1, b_requests=8, b_prompt=(16, 128), b_output=(4, 16),
              hf_batch_sizes=(8, 4), ts_settings=[{}, dict(max_num_batched_tokens=2048)], c_prompt=16, c_new=16,
              c_repeats=1, bw_mib=128, bw_repeats=3)


# -- the checkpoint ---------------------------------------------------------------------------------
def write_checkpoint(path: Path, dtype: torch.dtype, seed: int) -> int:
    """Save a random LlamaForCausalLM in the HF layout; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# -- the machine -----------------------------------------------------------------------------------
def cpu_model() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {os.cpu_count()} logical CPUs; {' '.join(isa)})")


def busy_processes(min_cpu: float = 20.0) -> list[str]:
    """Other processes burning CPU right now (a sample over 0.5 s), to warn that numbers are not clean."""
    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                stat = (d / "stat").read_text()
                name = stat[stat.index("(") + 1: stat.rindex(")")]
                parts = stat[stat.rindex(")") + 2:].split()
                out[int(d.name)] = (name, int(parts[11]) + int(parts[12]))
            except (OSError, ValueError):
                continue
        return out
    try:
        before = ticks()
        time.sleep(0.5)
        after = ticks()
    except OSError:
        return []
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (name, t) in after.items():
        if pid in before:
            pct = (t - before[pid][1]) / hz / 0.5 * 100
            if pct >= min_cpu:
                busy.append(f"{name}[{pid}] {pct:.0f}%")
    return busy


class LoadMonitor:
    """Samples in a thread how many cores everything else keeps busy: machine busy time (/proc/stat, steal
    included) minus this process's own CPU time. Two threads on two cores stall whenever another process takes
    a core (an OpenMP barrier waits a scheduler slice), so any other load makes the numbers worthless."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter time, other cores busy)
        self.parts: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._hz = os.sysconf("SC_CLK_TCK")

    def _read(self) -> tuple[float, float]:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return (user + nice + system + irq + softirq + steal) / self._hz, (int(own[11]) + int(own[12])) / self._hz

    def _run(self) -> None:
        busy, own, t = *self._read(), time.perf_counter()
        while not self._stop.wait(self.interval):
            busy2, own2, t2 = *self._read(), time.perf_counter()
            self.samples.append((t2, max(0.0, (busy2 - busy) - (own2 - own)) / (t2 - t)))
            busy, own, t = busy2, own2, t2

    def start(self) -> "LoadMonitor":
        try:
            self._read()
        except (OSError, ValueError, IndexError):
            return self  # no /proc: nothing to watch
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def part(self, name: str):
        monitor = self

        class _Part:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                monitor.parts[name] = (self.t0, time.perf_counter())
        return _Part()

    def load(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(mean, max) other cores busy between t0 and t1."""
        xs = [x for t, x in self.samples if t0 <= t <= t1 + self.interval]
        return (statistics.fmean(xs), max(xs)) if xs else None

    def report(self) -> list[tuple[str, float, float]]:
        out = []
        for name, (t0, t1) in self.parts.items():
            m = self.load(t0, t1)
            if m is not None:
                out.append((name, *m))
        return out

    def wait_quiet(self, seconds: float, max_wait: float, threshold: float = 0.1) -> bool:
        """Block until other load stayed under `threshold` cores for `seconds`; False after max_wait."""
        t_end = time.perf_counter() + max_wait
        while time.perf_counter() < t_end:
            time.sleep(self.interval)
            now = time.perf_counter()
            recent = [x for t, x in self.samples if t >= now - seconds]
            if len(recent) >= seconds / self.interval - 1 and max(recent) < threshold:
                return True
        return False


def copy_bandwidth(mib: int, repeats: int, allocations: int = 3) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: the best over `allocations` fresh buffers x `repeats` passes each.

    copy: dst.copy_(src) of `mib` MiB, counting bytes read + bytes written (STREAM's copy convention; the
    write-allocate read the hardware also does is not counted). read: a float32 sum over the same buffer.
    Fresh buffers because on this VM one allocation can run at 2/3 the speed of the next (page placement)."""
    n = mib * MiB // 4
    best_copy = best_read = float("inf")
    for _ in range(allocations):
        src = torch.rand(n)
        dst = torch.empty_like(src)
        dst.copy_(src)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best_copy = min(best_copy, time.perf_counter() - t0)
            t0 = time.perf_counter()
            src.sum()
            best_read = min(best_read, time.perf_counter() - t0)
        del src, dst
    size = n * 4
    return 2 * size / best_copy, size / best_read


def git_state() -> str:
    """The commit measured and whether the engine's files differ from it (read-only git calls)."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "twospeed"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    files = [line[3:] for line in dirty if line.strip()]
    return f"{head}" + (f" with uncommitted changes in {', '.join(files)}" if files else " (clean twospeed/)")


# -- workloads -------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, SHAPE["vocab_size"]) for _ in range(n)]


def draw_workload(sizes: Sizes, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(*sizes.b_prompt) for _ in range(sizes.b_requests)]
    outs = [rng.randint(*sizes.b_output) for _ in range(sizes.b_requests)]
    return [random_prompt(rng, n) for n in lens], outs


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


# -- twospeed --------------------------------------------------------------------------------------
def make_llm(path: Path, dtype: str, **options) -> LLM:
    return LLM(str(path), dtype=dtype, skip_tokenizer_init=True, **options)


def warm_llm(llm: LLM, rng: random.Random) -> None:
    """One short generate (a prefill and a few decodes) so that lazy inits and allocator growth are paid."""
    llm.generate([random_prompt(rng, 64), random_prompt(rng, 32)], greedy(8))


def engine_options(llm: LLM) -> dict:
    e = llm.engine
    s = e.scheduler_config
    return dict(max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
                max_model_len=s.max_model_len, enable_chunked_prefill=s.enable_chunked_prefill,
                block_size=e.config.cache.block_size, kv_blocks=e.num_blocks,
                enable_prefix_caching=e.config.cache.enable_prefix_caching)


def ts_single(llm: LLM, prompt: list[int], n: int) -> dict:
    wall, outs = timed(llm.generate, [prompt], greedy(n))
    o = outs[0]
    assert len(o.token_ids) == n, (len(o.token_ids), n)
    c = o.clock
    return dict(ttft=c.ttft, tpot=c.tpot, wall=wall, decode_tps=1 / c.tpot,
                decode_tps_wall=(n - 1) / (wall - c.ttft), tokens=list(o.token_ids))


def ts_decode_steps(llm: LLM, prompt: list[int], n: int) -> tuple[float, float]:
    """Drive the engine step by step: (median step_time of the decode-only steps, tpot) for one request."""
    engine = llm.engine
    req = engine.add_request(None, prompt, greedy(n))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.last_stats
        if st.num_prefill_tokens == 0 and st.num_decode_tokens == 1:
            steps.append(st.step_time)
    return statistics.median(steps), req.clock.tpot


def ts_batch(path: Path, dtype: str, options: dict, prompts, outs, rng) -> dict:
    llm = make_llm(path, dtype, **options)
    warm_llm(llm, rng)
    settings = engine_options(llm)
    wall, results = timed(llm.generate, prompts, [greedy(n) for n in outs])
    got = [len(r.token_ids) for r in results]
    assert got == list(outs), "twospeed did not produce the requested output lengths"
    ttfts = sorted(r.clock.ttft for r in results)
    tpots = sorted(r.clock.tpot for r in results if r.clock.tpot is not None)
    preempt = sum(r.num_preemptions for r in results)
    del llm
    gc.collect()
    return dict(settings=settings, wall=wall, tokens=sum(got), ttft_p50=statistics.median(ttfts),
                ttft_max=ttfts[-1], tpot_p50=statistics.median(tpots), preemptions=preempt)


# -- HF transformers -------------------------------------------------------------------------------
def hf_single(model, prompt: list[int], n: int) -> dict:
    ids = torch.tensor([prompt])
    t1, _ = timed(hf_generate, model, ids, None, 1)
    tn, out = timed(hf_generate, model, ids, None, n)
    assert out.shape[1] == len(prompt) + n
    return dict(ttft=t1, wall=tn, decode_tps=(n - 1) / (tn - t1), tpot=(tn - t1) / (n - 1),
                tokens=out[0, len(prompt):].tolist())


def hf_batch(model, prompts, outs, batch_size: int) -> dict:
    """Left-padded static batches in arrival order; each batch runs to its longest output."""
    t0 = time.perf_counter()
    useful = 0
    computed = 0
    for i in range(0, len(prompts), batch_size):
        ps, ns = prompts[i:i + batch_size], outs[i:i + batch_size]
        width, n = max(map(len, ps)), max(ns)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = hf_generate(model, ids, mask, n)
        assert out.shape == (len(ps), width + n)
        useful += sum(ns)
        computed += len(ps) * n
    return dict(wall=time.perf_counter() - t0, tokens=useful, computed=computed)


# -- report ----------------------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1000:,.1f}"


def first_divergence(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first differs at token {i} of {len(a)}"
    return f"identical ({len(a)} tokens)"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


BENCHMARKS_TOP = """# Benchmarks

Measured by scripts in `benchmarks/` (never by timed tests), each as a ratio against a peer run side by
side in the same process and against the machine's roofline. Every run appends a dated section below with
its command, machine, versions, model, engine settings and results.

`benchmarks/bench_engine.py` (a ~100M-parameter random-weight Llama, tied embeddings, written by
transformers; twospeed vs HF transformers `generate`, same threads, both warmed up):

- **(a) single stream**: batch 1, prompt 512, 128 greedy tokens ignoring EOS. TTFT and decode tokens/s.
  twospeed from its own clock (ttft, tpot) and wall time; HF TTFT = `generate(max_new_tokens=1)`, decode
  tok/s = 127 / (t_128 - t_1).
- **(b) 32 requests at once**: prompts 64-2048, outputs 16-256 tokens (seeded draw). twospeed
  `LLM.generate` under several scheduler settings; HF left-padded static batches in arrival order, batch
  sizes 32, 16, 8, ... until one gets slower (the fastest is the one compared). Output tok/s = useful
  output tokens / wall. Target: twospeed >= 3x HF.
- **(c) decode vs bandwidth floor**: floor = bytes of weights one decode step reads (linears, lm_head,
  norms) / copy bandwidth (torch `copy_` of a large buffer, read + written bytes, as STREAM copy counts
  them; a read-only sum is shown as the other view). Fraction = floor / measured batch-1 step time at a
  short context, against the bandwidth measured right around the step ("alongside": this VM's bandwidth
  drifts by up to 2x with other tenants) and against the best bandwidth of the run. Target: >= 40% in bf16.

A run is only worth reading when the "other load" line shows no NOISY part: two threads on two cores stall
whenever anything else takes a core.
"""


def render(ctx: dict) -> str:
    sizes: Sizes = ctx["sizes"]
    parts = ctx["parts"]
    out = [f"## {ctx['date']} — bench_engine, {ctx['dtype']}{' (quick)' if ctx['quick'] else ''}"
           f"{'' if parts == 'abc' else f', parts {parts}'}", ""]
    out += [f"- command: `{ctx['command']}`",
            f"- twospeed at {ctx['git']}",
            f"- torch {torch.__version__}, transformers {ctx['transformers']}, Python {platform.python_version()}",
            f"- CPU: {ctx['cpu']}; torch threads: {ctx['threads']}",
            f"- model: Llama, {ctx['params'] / 1e6:.1f}M parameters, tied embeddings, hidden {SHAPE['hidden_size']}, "
            f"{SHAPE['num_hidden_layers']} layers, {SHAPE['num_attention_heads']} heads / "
            f"{SHAPE['num_key_value_heads']} KV heads, intermediate {SHAPE['intermediate_size']}, vocab "
            f"{SHAPE['vocab_size']}; {ctx['dtype']}; random weights, seed {ctx['seed']}",
            f"- HF: `generate`, default attention ({ctx['hf_attn']}), DynamicCache, greedy, eos_token_id=None",
            f"- twospeed defaults: {fmt_settings(ctx['ts_default'])}",
            f"- other processes busy at start: {', '.join(ctx['busy_start']) or 'none'}",
            "- other load while measuring (cores busy outside this process, mean / max): "
            + "; ".join(f"{n} {m:.2f} / {x:.2f}{' NOISY' if m > 0.1 else ''}" for n, m, x in ctx["load"]), ""]

    if "a" in parts:
        a_ts, a_hf = ctx["a_ts"], ctx["a_hf"]
        out += [f"### (a) single stream: prompt {sizes.a_prompt}, {sizes.a_new} new tokens, batch 1 "
                f"(median of {sizes.a_repeats})", ""]
        rows = [["TTFT (ms)", ms(a_ts["ttft"]), ms(a_hf["ttft"]), f"{a_hf['ttft'] / a_ts['ttft']:.2f}x"],
                ["decode tok/s (twospeed: 1/tpot)", f"{a_ts['decode_tps']:.1f}", f"{a_hf['decode_tps']:.1f}",
                 f"{a_ts['decode_tps'] / a_hf['decode_tps']:.2f}x"],
                ["decode tok/s from wall ((n-1)/(wall-ttft))", f"{a_ts['decode_tps_wall']:.1f}", "-", ""],
                ["wall for the request (ms)", ms(a_ts["wall"]), ms(a_hf["wall"]),
                 f"{a_hf['wall'] / a_ts['wall']:.2f}x"]]
        out += [table(["metric", "twospeed", "HF", "twospeed vs HF (> 1: twospeed better)"], rows), "",
                f"Greedy tokens twospeed vs HF: {ctx['agree']}.", ""]

    if "b" in parts:
        b_hf = ctx["b_hf"]
        best_hf = min(b_hf, key=lambda r: r["wall"])
        hf_tps = best_hf["tokens"] / best_hf["wall"]
        out += [f"### (b) {sizes.b_requests} requests at once: prompts {sizes.b_prompt[0]}-{sizes.b_prompt[1]} "
                f"({ctx['b_prompt_tokens']:,} prompt tokens), outputs {sizes.b_output[0]}-{sizes.b_output[1]} "
                f"({ctx['b_output_tokens']:,} output tokens)", ""]
        rows = []
        for r in b_hf:
            tps = r["tokens"] / r["wall"]
            rows.append([f"HF static batches of {r['batch_size']}{' (fastest HF)' if r is best_hf else ''}",
                         f"{r['wall']:.2f}", f"{tps:.1f}", "1.00x" if r is best_hf else f"{tps / hf_tps:.2f}x",
                         f"{r['computed']:,} tokens decoded for {r['tokens']:,} useful"])
        for r in ctx["b_ts"]:
            tps = r["tokens"] / r["wall"]
            st = r["settings"]
            rows.append([f"twospeed max_num_batched_tokens={st['max_num_batched_tokens']}, "
                         f"max_num_seqs={st['max_num_seqs']}", f"{r['wall']:.2f}", f"{tps:.1f}",
                         f"**{tps / hf_tps:.2f}x**",
                         f"TTFT p50 {ms(r['ttft_p50'])} / max {ms(r['ttft_max'])} ms, TPOT p50 {ms(r['tpot_p50'])} ms, "
                         f"preemptions {r['preemptions']}"])
        out += [table(["engine", "wall (s)", "output tok/s", "vs fastest HF", "notes"], rows), ""]

    if "c" in parts:
        c = ctx["c"]
        bws = ", ".join(f"{name} {bw[0] / 1e9:.1f}/{bw[1] / 1e9:.1f}" for name, bw in c["bw_samples"])
        out += ["### (c) batch-1 decode step vs the bandwidth floor", "",
                f"Weight bytes per decode step: {c['weight_bytes'] / 1e6:.1f} MB. Bandwidth, copy/read-only GB/s "
                f"(copy_ of {sizes.bw_mib} MiB counting read + write bytes / float32 sum; best of fresh buffers x "
                f"{sizes.bw_repeats} passes): {bws}. Best of the run: copy {c['bw_best'][0] / 1e9:.1f}, read-only "
                f"{c['bw_best'][1] / 1e9:.1f} GB/s, so the floor is {ms(c['weight_bytes'] / c['bw_best'][0])} ms "
                f"(copy) / {ms(c['weight_bytes'] / c['bw_best'][1])} ms (read-only). This VM's bandwidth drifts "
                f"(other tenants), so each step time is also set against the bandwidth measured right around it "
                f"(\"alongside\"). Short context: prompt {sizes.c_prompt}, {sizes.c_new} new tokens, median of "
                f"{sizes.c_repeats} prompts.", ""]
        rows = []
        for name, t, bw_near in c["steps"]:
            w = c["weight_bytes"]
            rows.append([name, ms(t), f"{w / bw_near[0] / t:.0%}", f"{w / c['bw_best'][0] / t:.0%}",
                         f"{w / c['bw_best'][1] / t:.0%}"])
        out += [table(["decode step", "ms", "of copy floor, alongside", "of copy floor, best",
                       "of read-only floor, best"], rows), ""]

    out += ["### Targets", ""]
    for line in ctx["targets"]:
        out.append(f"- {line}")
    out.append("")
    return "\n".join(out)


def fmt_settings(s: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.items())


def targets(ctx: dict) -> list[str]:
    lines = []
    if "b" in ctx["parts"]:
        best_hf = min(ctx["b_hf"], key=lambda r: r["wall"])
        hf_tps = best_hf["tokens"] / best_hf["wall"]
        for r in ctx["b_ts"]:
            ratio = r["tokens"] / r["wall"] / hf_tps
            st = r["settings"]
            lines.append(f"(b) >= 3x HF output tok/s, max_num_batched_tokens={st['max_num_batched_tokens']} "
                         f"max_num_seqs={st['max_num_seqs']}: {ratio:.2f}x — {'met' if ratio >= 3 else 'MISSED'}")
    if "c" in ctx["parts"]:
        c = ctx["c"]
        near = c["ts_fraction_alongside"]
        best = c["weight_bytes"] / c["bw_best"][0] / c["ts_step"]
        verdict = "met" if min(near, best) >= 0.4 else ("met alongside only" if near >= 0.4 else "MISSED")
        tag = "" if ctx["dtype"] == "bfloat16" else " (the target is stated for bf16)"
        lines.append(f"(c) >= 40% of the copy-bandwidth floor in a batch-1 decode step{tag}: {near:.0%} against the "
                     f"bandwidth alongside, {best:.0%} against the run's best — {verdict}")
    return lines


def append_report(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else BENCHMARKS_TOP
    if not text.endswith("\n"):
        text += "\n"
    path.write_text(text + "\n" + section)


# -- profile ---------------------------------------------------------------------------------------
def op_table(prof, steps: int, rows: int = 18) -> str:
    """torch.profiler ops by self CPU time, as ms and calls per step."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1000 / steps
    lines = [f"  {'op':<52} {'ms/step':>8} {'calls/step':>10} {'share':>6}"]
    for e in events[:rows]:
        t = e.self_cpu_time_total / 1000 / steps
        lines.append(f"  {e.key[:52]:<52} {t:8.2f} {e.count / steps:10.1f} {t / total:6.1%}")
    lines.append(f"  {'all ops (self CPU)':<52} {total:8.2f}")
    return "\n".join(lines)


def profile(path: Path, dtype: str, sizes: Sizes, seed: int) -> None:
    """Where twospeed's steps spend their time: batch-1 decode, a prefill chunk, and decode at (b)'s batch."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    rng = random.Random(seed + 7)
    llm = make_llm(path, dtype)
    warm_llm(llm, rng)
    engine = llm.engine

    def run_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            engine.step()
            times.append(engine.last_stats.step_time)
        return times

    # 1. batch-1 decode at a short context
    engine.add_request(None, random_prompt(rng, sizes.c_prompt), greedy(200))
    run_steps(10)
    n = 20
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        times = run_steps(n)
    print(f"\n== batch-1 decode, context ~{sizes.c_prompt + 10}: median step {ms(statistics.median(times))} ms "
          f"(under the profiler) ==")
    print(op_table(prof, n))
    pr = cProfile.Profile()
    pr.enable()
    times = run_steps(n)
    pr.disable()
    st = io.StringIO()
    pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(15)
    print(f"\n== cProfile, {n} batch-1 decode steps (median {ms(statistics.median(times))} ms), by own time ==")
    print(st.getvalue())
    times = run_steps(n)
    print(f"batch-1 decode without any profiler: median step {ms(statistics.median(times))} ms")
    while engine.has_unfinished_requests():
        engine.step()

    # 2. (b)'s workload: the prefill steps, then decode-only steps at its full batch
    prompts, outs = draw_workload(sizes, seed + 2)
    for prompt, m in zip(prompts, outs):
        engine.add_request(None, prompt, greedy(m))
    prefill, first = [], True
    while True:
        if first:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            first = False
        else:
            engine.step()
        s = engine.last_stats
        if s.num_prefill_tokens == 0:
            break
        prefill.append((s.num_prefill_tokens, s.num_decode_tokens, s.step_time))
    print(f"\n== (b) workload: the first step, a {prefill[0][0]}-token prefill chunk ({ms(prefill[0][2])} ms) ==")
    print(op_table(prof, 1))
    tok = sum(p[0] for p in prefill)
    secs = sum(p[2] for p in prefill)
    print(f"(b) prefill phase: {len(prefill)} steps, {tok:,} prefill tokens + {sum(p[1] for p in prefill):,} decode "
          f"tokens in {secs:.1f} s = {tok / secs:,.0f} prefill tok/s")
    batch = engine.last_stats.num_decode_tokens
    n = 5
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        times = run_steps(n)
    print(f"\n== (b) decode-only steps at batch {batch}: median {ms(statistics.median(times))} ms ==")
    print(op_table(prof, n))
    rest, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        rest += 1
    print(f"(b) remaining {rest} steps: {time.perf_counter() - t0:.1f} s")


# -- main ------------------------------------------------------------------------------------------
def measure_c(llm: LLM, hf, sizes: Sizes, rng: random.Random, weight_bytes: int) -> dict:
    """Batch-1 decode at a short context, each prompt bracketed by bandwidth measurements (one fresh buffer)."""
    steps_ts, tpots_ts, tpots_hf, bws, fractions = [], [], [], [], []
    for _ in range(sizes.c_repeats):
        prompt = random_prompt(rng, sizes.c_prompt)
        before = copy_bandwidth(sizes.bw_mib, sizes.bw_repeats, allocations=1)
        step, tpot = ts_decode_steps(llm, prompt, sizes.c_new)
        hf_tpot = hf_single(hf, prompt, sizes.c_new)["tpot"]
        after = copy_bandwidth(sizes.bw_mib, sizes.bw_repeats, allocations=1)
        bw = (max(before[0], after[0]), max(before[1], after[1]))
        steps_ts.append(step)
        tpots_ts.append(tpot)
        tpots_hf.append(hf_tpot)
        bws.append(bw)
        fractions.append((weight_bytes / bw[0] / step, weight_bytes / bw[0] / hf_tpot))
    bw_near = (statistics.median(b[0] for b in bws), statistics.median(b[1] for b in bws))
    return dict(weight_bytes=weight_bytes, ts_step=statistics.median(steps_ts), ts_tpot=statistics.median(tpots_ts),
                hf_tpot=statistics.median(tpots_hf), bw_near=bw_near, bw_pairs=bws,
                ts_fraction_alongside=statistics.median(f[0] for f in fractions),
                hf_fraction_alongside=statistics.median(f[1] for f in fractions))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="shrink every part (smoke test); writes nothing unless --out")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to append to (default: BENCHMARKS.md, "
                    "or nothing with --quick)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--parts", default="abc", help="which parts to run, e.g. ac (default abc)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-sizes", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="HF static batch sizes to try, largest first, e.g. 32,8 (stops once one is slower than "
                         "the best so far)")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                    help="first wait up to SECONDS for 10 s without other load")
    ap.add_argument("--profile", action="store_true", help="profile twospeed's steps instead (prints only)")
    args = ap.parse_args(argv)
    parts = "".join(x for x in "abc" if x in args.parts)
    if not parts or set(args.parts) - set("abc"):
        ap.error("--parts takes letters from abc")

    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    if args.hf_batch_sizes:
        sizes = dataclasses.replace(sizes, hf_batch_sizes=args.hf_batch_sizes)
    dtype = DTYPES[args.dtype]
    out_path = None if args.no_write else (args.out or (None if args.quick else ROOT / "BENCHMARKS.md"))
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    import transformers

    monitor = LoadMonitor().start()
    ctx: dict = dict(parts=parts)
    with tempfile.TemporaryDirectory(prefix="twospeed-bench-") as tmp:
        path = Path(tmp)
        params = write_checkpoint(path, dtype, args.seed)
        gc.collect()
        if args.wait_quiet and not monitor.wait_quiet(10, args.wait_quiet):
            log(f"the machine did not go quiet within {args.wait_quiet:.0f} s; running anyway")
        if args.profile:
            profile(path, args.dtype, sizes, args.seed)
            return 0
        busy_start = busy_processes()
        if busy_start:
            log(f"warning: other processes are busy, numbers will be noisy: {', '.join(busy_start)}")
        rng = random.Random(args.seed + 1)  # warm-up and single-stream prompts, never shared with (b)'s

        bw_samples = []
        if "c" in parts:
            with monitor.part("bandwidth"):
                bw_samples.append(("start", copy_bandwidth(sizes.bw_mib, sizes.bw_repeats)))
            log(f"bandwidth: copy {bw_samples[0][1][0] / 1e9:.1f} GB/s, read {bw_samples[0][1][1] / 1e9:.1f} GB/s")
            gc.collect()

        hf = load_hf(path, dtype)
        ctx["hf_attn"] = hf.config._attn_implementation
        hf_generate(hf, torch.tensor([random_prompt(rng, 64)]), None, 8)  # warm-up
        llm = make_llm(path, args.dtype)
        warm_llm(llm, rng)
        ctx["ts_default"] = engine_options(llm)

        if "a" in parts:
            with monitor.part("(a)"):
                a_prompts = [random_prompt(rng, sizes.a_prompt) for _ in range(sizes.a_repeats)]
                runs_ts = [ts_single(llm, p, sizes.a_new) for p in a_prompts]
                runs_hf = [hf_single(hf, p, sizes.a_new) for p in a_prompts]
            a_ts = {k: statistics.median(r[k] for r in runs_ts)
                    for k in ("ttft", "tpot", "wall", "decode_tps", "decode_tps_wall")}
            a_hf = {k: statistics.median(r[k] for r in runs_hf) for k in ("ttft", "tpot", "wall", "decode_tps")}
            agree = first_divergence(runs_ts[0]["tokens"], runs_hf[0]["tokens"])
            ctx.update(a_ts=a_ts, a_hf=a_hf, agree=agree)
            log(f"(a) twospeed ttft {ms(a_ts['ttft'])} ms, {a_ts['decode_tps']:.1f} tok/s; "
                f"HF ttft {ms(a_hf['ttft'])} ms, {a_hf['decode_tps']:.1f} tok/s; tokens {agree}")

        if "c" in parts:
            with monitor.part("(c)"):
                c = measure_c(llm, hf, sizes, rng, llm.engine.model.weight_bytes())
            bw_samples += [(f"around (c) #{i + 1}", bw) for i, bw in enumerate(c["bw_pairs"])]
            ctx["c"] = c
            log(f"(c) twospeed step {ms(c['ts_step'])} ms ({c['ts_fraction_alongside']:.0%} of the copy floor "
                f"alongside); HF step {ms(c['hf_tpot'])} ms")
        del llm
        gc.collect()

        if "b" in parts:
            prompts, outs = draw_workload(sizes, args.seed + 2)
            b_hf = []
            for bs in sizes.hf_batch_sizes:
                with monitor.part(f"(b) HF batch {bs}"):
                    r = hf_batch(hf, prompts, outs, bs)
                r["batch_size"] = bs
                b_hf.append(r)
                log(f"(b) HF batches of {bs}: {r['wall']:.2f} s, {r['tokens'] / r['wall']:.1f} tok/s")
                gc.collect()
                if r["wall"] > 1.05 * min(x["wall"] for x in b_hf):
                    break  # past the bottom of the U: smaller batches only get slower
            b_ts = []
            for options in sizes.ts_settings:
                with monitor.part(f"(b) twospeed {fmt_settings(options) or 'defaults'}"):
                    r = ts_batch(path, args.dtype, options, prompts, outs, rng)
                b_ts.append(r)
                log(f"(b) twospeed {fmt_settings(options) or 'defaults'}: {r['wall']:.2f} s, "
                    f"{r['tokens'] / r['wall']:.1f} tok/s")
            ctx.update(b_hf=b_hf, b_ts=b_ts, b_prompt_tokens=sum(map(len, prompts)), b_output_tokens=sum(outs))
        del hf
        gc.collect()

        if "c" in parts:
            with monitor.part("bandwidth again"):
                bw_samples.append(("end", copy_bandwidth(sizes.bw_mib, sizes.bw_repeats)))
            c = ctx["c"]
            c["bw_samples"] = bw_samples
            c["bw_best"] = (max(b[0] for _, b in bw_samples), max(b[1] for _, b in bw_samples))
            c["steps"] = [(f"twospeed, median engine step_time of decode steps, context {sizes.c_prompt}-"
                           f"{sizes.c_prompt + sizes.c_new}", c["ts_step"], c["bw_near"]),
                          ("twospeed, tpot, same requests", c["ts_tpot"], c["bw_near"]),
                          ("HF, (t_n - t_1) / (n - 1), same prompts", c["hf_tpot"], c["bw_near"])]
            if "a" in parts:
                span = f"context {sizes.a_prompt}-{sizes.a_prompt + sizes.a_new}, from (a)"
                c["steps"] += [(f"twospeed, tpot, {span}", ctx["a_ts"]["tpot"], bw_samples[0][1]),
                               (f"HF, (t_n - t_1) / (n - 1), {span}", ctx["a_hf"]["tpot"], bw_samples[0][1])]
            log(f"bandwidth again: copy {bw_samples[-1][1][0] / 1e9:.1f} GB/s; best floor "
                f"{ms(c['weight_bytes'] / c['bw_best'][0])} ms")
    monitor.stop()

    cmd = " ".join([".venv/bin/python", "benchmarks/bench_engine.py", *(argv if argv is not None else sys.argv[1:])])
    ctx.update(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), dtype=args.dtype, quick=args.quick,
               command=cmd, git=git_state(), transformers=transformers.__version__, cpu=cpu_model(),
               threads=torch.get_num_threads(), params=params, seed=args.seed, busy_start=busy_start,
               load=monitor.report(), sizes=sizes)
    ctx["targets"] = targets(ctx)
    section = render(ctx)
    print(section)
    if out_path is not None:
        append_report(out_path, section)
        print(f"appended to {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
