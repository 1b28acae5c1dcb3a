"""Configuration, composed per area and passed down explicitly.

Each field says its unit. `EngineConfig` is what `LLM(...)` and the CLI build (`add_engine_args`: one flag per field);
every other module receives only the part it needs. No torch at import: the
bookkeeping (scheduler, KV cache, requests) and the planner's simulator read
these dataclasses without loading it; `DTYPES` (names -> torch dtypes) is built
on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args, get_type_hints

from twospeed.schema.formats import kv_format, weight_format

if TYPE_CHECKING:
    import torch


def cache_root() -> Path:
    """Where twospeed keeps what it builds on first use (the demo checkpoint, compiled kernels):
    $TWOSPEED_CACHE, else ~/.cache/twospeed."""
    return Path(os.environ.get("TWOSPEED_CACHE") or Path.home() / ".cache" / "twospeed")


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes `dtype` may name
_dtypes: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """DTYPES, {name: torch dtype} for DTYPE_NAMES: torch is imported on first use, not with this module."""
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _dtypes:
        import torch

        _dtypes.update((n, getattr(torch, n)) for n in DTYPE_NAMES)
    return _dtypes


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@dataclass(slots=True)
class ModelConfig:
    """The decoder's shape, read from a checkpoint's config.json by model/loader.py."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters when rope_type != "default"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # tokens a query may look back (Mistral); None = full
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = field(default_factory=_float32)  # the checkpoint's own dtype
    # weights stored in fewer bits than `dtype` (a block-quantized GGUF, which float32 holds exactly): what
    # `kv_cache_dtype: auto` reads as a half-precision checkpoint (model/compute_dtype.py)
    quantized_weights: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int | None = None  # blocks in the pool; None = derive from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0  # GiB for the pool when num_gpu_blocks is None
    enable_prefix_caching: bool = True  # share full blocks between requests by hash chain
    # How K and V are stored: "auto" (the model's dtype), "int8" (a bf16 scale per token and KV head) or "fp8"
    # (e4m3); one byte an element holds about twice the tokens in the same kv_cache_memory_gb. model/kv_format.py
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        kv_format(self.kv_cache_dtype)  # a known name (torch-free check)


@dataclass(slots=True)
class SchedulerConfig:
    """How each step's token budget is filled."""

    # Tokens (prefill + decode) one step may compute. 2048 as vLLM's online-serving default: on the mixed
    # workload it cut per-token ITL p99 from ~420 to ~60-90 ms against 512 (fewer decode steps share the batch
    # with a prefill chunk), at the price of longer single stalls (ITL max); see BENCHMARKS.md.
    max_num_batched_tokens: int = 2048
    # Prompt tokens (prefill chunks) a step may carry beside decodes, with chunked prefill; None = whatever the
    # budget leaves. A step's time grows with its prefill tokens, and every running stream waits for the step.
    max_prefill_tokens_while_decoding: int | None = None
    # Seconds a step may take (predicted by the engine's cost model, engine/cost_model.py), in milliseconds, while
    # streams are decoding: prompt chunks beside decodes get the most tokens that fit, so a long prompt stretches
    # no stream's token gap past it; with nothing decoding a prompt gets the whole token budget. 50 ms keeps a
    # decode lane near 50 ms per token under load on a 2-core CPU. None or 0: steps sized by tokens only.
    target_step_ms: float | None = 50.0
    # Share of a lane's ITL objective (Request.itl_target, set by the server from --slo) a step may take in its
    # place; the rest absorbs prediction error and the time around the step (sampling, streaming). 0: ignore them.
    itl_objective_share: float = 0.8
    # Share of a step's time prompt chunks keep even where decodes alone use the target up (many streams, a slow
    # machine): the step may then take (decodes' predicted time) / (1 - share), so prompts still advance at a
    # fair rate and their TTFT does not explode under load. 0: the target strictly (then one block a step).
    min_prompt_share: float = 0.5
    # Time to first token the scheduler aims at for every prompt, in milliseconds: when the prompts queued (waiting
    # or part-computed) cannot each finish by its arrival + this at the step target's prompt share, the share grows:
    # the step takes as many prompt tokens as the queue needs to keep that pace, up to what the decoding streams'
    # ITL objectives allow (x itl_objective_share) and, for streams without one, up to `max_step_ms`. vLLM fills
    # every step with prompt tokens to the budget; this grows them only where TTFT is at risk. None or 0: off.
    ttft_target_ms: float | None = 1000.0
    # The longest a step may grow to for queued prompts beside streams whose lane has no ITL objective (ms). 100 keeps
    # such a stream's gaps within a chat lane's usual 100 ms objective; at 250 the mixed workload's chat ITL p99 rose
    # from 0.09 to 0.27 s for TTFT p99s 1.0-1.2x lower (BENCHMARKS.md).
    max_step_ms: float = 100.0
    # Where a stream's lane has an ITL objective, a waiting request starts only while the predicted decode step of the
    # running requests and it leaves `min_prompt_share` of the tightest objective (x itl_objective_share) to prompt
    # chunks (engine/stream_room.py): where a decode step is compute-bound, one more stream lengthens every stream's
    # gap and adds no throughput, so the queue waits instead. Without objectives, up to `max_num_seqs`. False: up to
    # `max_num_seqs` always, as vLLM admits.
    itl_admission: bool = True
    # A waiting prompt whose whole (uncached) rest fits a step goes before a long prompt being chunked and before
    # earlier long ones waiting (of its priority or lower): its TTFT is a step, not the long prompt's whole prefill.
    # False: strictly in policy order, as vLLM and SGLang admit.
    short_prompts_first: bool = True
    max_num_seqs: int = 64  # requests running at once
    max_model_len: int | None = None  # tokens (prompt + output) one request may hold; None = the model's limit
    enable_chunked_prefill: bool = True  # split long prompts so decodes keep flowing
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # priority: lower value first

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if (self.max_num_batched_tokens < 1 or self.max_num_seqs < 1
                or (self.max_model_len is not None and self.max_model_len < 1)):
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_model_len must be >= 1")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1 (or None)")
        if self.target_step_ms is not None and not self.target_step_ms >= 0:
            raise ValueError(f"target_step_ms must be >= 0 (or None), got {self.target_step_ms}")
        if not 0 <= self.itl_objective_share <= 1:
            raise ValueError(f"itl_objective_share must be in [0, 1], got {self.itl_objective_share}")
        if not 0 <= self.min_prompt_share < 1:
            raise ValueError(f"min_prompt_share must be in [0, 1), got {self.min_prompt_share}")
        if self.ttft_target_ms is not None and not self.ttft_target_ms >= 0:
            raise ValueError(f"ttft_target_ms must be >= 0 (or None), got {self.ttft_target_ms}")
        if not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0, got {self.max_step_ms}")

    @property
    def target_step_time(self) -> float | None:
        """target_step_ms in seconds; None when off."""
        return self.target_step_ms / 1e3 if self.target_step_ms else None

    @property
    def token_budget(self) -> int:
        """Tokens per step. Without chunking a whole prompt must fit one step, so the budget covers max_model_len."""
        if self.enable_chunked_prefill or self.max_model_len is None:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding: a proposer guesses the next tokens, the target checks them in one pass (engine/spec.py).

    Greedy output is the target's: token-identical with and without it in float32, and in bf16 with `deterministic`
    (by default a verify chunk sums in another order than a lone decode, and a bf16 near-tie can flip); sampled
    output keeps the target's distribution. What changes is how many tokens a decode step yields. With
    `auto_fallback` each request (and each lane) stops proposing where its measured acceptance does not pay for the
    verify rows.
    """

    # Flat names (LLM keyword arguments, CLI flags) of the fields whose own name would be ambiguous there.
    FLAT: ClassVar[dict[str, str]] = {"method": "spec_method", "auto_fallback": "spec_auto_fallback",
                                      "reprobe_steps": "spec_reprobe_steps"}

    method: Literal["none", "ngram", "draft"] = "none"  # none | ngram (prompt lookup) | draft (a smaller model)
    num_speculative_tokens: int = 4  # draft tokens per request per step at most (gamma); fallback may use fewer
    prompt_lookup_max: int = 4  # ngram: the longest suffix (tokens) matched against the prompt and output so far
    prompt_lookup_min: int = 2  # ngram: the shortest suffix tried before proposing nothing
    draft_model: str | None = None  # draft: checkpoint folder (same tokenizer as the target) or "demo-draft"
    # Per request and per lane: stop proposing where the expected gain E(alpha, gamma) / (gamma c + 1) of the
    # measured acceptance alpha and cost ratio c falls below 1, and re-probe later; gamma adapts. False: always
    # propose num_speculative_tokens.
    auto_fallback: bool = True
    reprobe_steps: int = 32  # decode steps a request waits after a fallback before it probes again (x2 per repeat)
    draft_prefill_tokens: int = 512  # draft: tokens per step the draft model may catch up on (prompts), all requests

    def __post_init__(self) -> None:
        if self.method not in ("none", "ngram", "draft"):
            raise ValueError(f"spec method must be 'none', 'ngram' or 'draft', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("spec method 'draft' needs draft_model (a checkpoint folder or 'demo-draft')")
        if self.reprobe_steps < 1 or self.draft_prefill_tokens < 1:
            raise ValueError("reprobe_steps and draft_prefill_tokens must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def flat_fields(klass: type) -> dict[str, str]:
    """{flat keyword: field name} of a config area (CLI flags and LLM keyword arguments use the flat names)."""
    alias = getattr(klass, "FLAT", {})
    return {alias.get(f.name, f.name): f.name for f in dataclasses.fields(klass)}


@dataclass(slots=True)
class EngineConfig:
    """Everything `LLMEngine` needs; `LLM(model, **kwargs)` fills it from keyword arguments."""

    model: str  # checkpoint folder, a GGUF file (or a folder holding one), or a built-in (builtin/registry.py)
    # A tokenizer folder (tokenizer.json and the files beside it) in place of the checkpoint's own: a GGUF whose
    # vocabulary kind twospeed cannot rebuild, or a checkpoint shipped without one. None: the checkpoint's.
    tokenizer: str | None = None
    # "auto": a float32 checkpoint in bf16 where the device has bf16 kernels (a GPU without them: fp16), any other in
    # its own dtype, or in float32 on a CPU without its kernels (model/compute_dtype.py); or "float32", "bfloat16", ...
    dtype: str = "auto"
    device: str = "cpu"  # torch device string: "cpu", "cuda", "cuda:1"
    seed: int = 0  # seeds unseeded sampling
    skip_tokenizer_init: bool = False  # token ids in and out only
    # Weight-only quantization at load: None (the checkpoint's weights); "int8" or "fp8" (a float32 scale per output
    # row; model/quant.py); GGUF's block layouts "q8_0", "q4_0", "q4_1", "q4_k" (kept packed; model/block_quant.py);
    # "gguf": a GGUF file's tensors as stored. schema/formats.py counts each one's bytes.
    quantization: str | None = None
    linear_backend: str = "auto"  # "auto" (CPU bf16: C kernels, else oneDNN; AVX2: widening), "cpu", "onednn", "torch"
    attention_backend: str = "auto"  # "auto" (CPU: the in-place decode kernel if it builds), "torch", "cpu"
    # Time a few real steps at start-up to seed the step cost model (engine/cost_probe.py; ~290 prompt tokens);
    # False starts from a roofline guess, which the engine's own steps then correct.
    cost_probe: bool = True
    # Batch-invariant steps (model/batch_invariant.py): a greedy request's tokens do not depend on the batch around
    # it, on how its prompt was chunked, or on whether speculation verified them; at a cost in speed.
    deterministic: bool = False
    # Return the C heap's free pages to the OS at most this often, at the end of a step (engine/heap_trim.py):
    # activations of ever-new sizes fragment glibc's heap, and RSS would climb across distinct prompts. 0: never.
    heap_trim_interval_s: float = 10.0
    num_threads: int | None = None  # CPU threads per step; None = torch's setting (the cores this process may use)
    # While other processes take cores, step with fewer threads so none waits at a barrier for a descheduled
    # peer (engine/threads.py; Linux /proc/stat); back to num_threads when they go.
    adapt_threads: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (or None), got {self.num_threads}")
        if self.quantization in ("none", ""):
            self.quantization = None
        weight_format(self.quantization)  # a known name (torch-free check)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Route flat keyword arguments (as vLLM's LLM takes them) to the per-area configs; speculative_config (a
        dict of SpecConfig fields, vLLM's form) is accepted beside the flat spec_method, num_speculative_tokens..."""
        areas = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}
        parts: dict[str, dict] = {area: {} for area in (*areas, "engine")}
        spec = kwargs.pop("speculative_config", None)
        if isinstance(spec, SpecConfig):
            spec = {f.name: getattr(spec, f.name) for f in dataclasses.fields(SpecConfig)}
        if spec is not None:
            if not isinstance(spec, dict) or set(spec) - {f.name for f in dataclasses.fields(SpecConfig)}:
                raise TypeError(f"speculative_config takes SpecConfig's fields, got {spec!r}")
            parts["spec"].update(spec)
        for key, value in kwargs.items():
            for area, klass in areas.items():
                names = flat_fields(klass)
                if key in names:
                    parts[area][names[key]] = value
                    break
            else:
                if key not in {f.name for f in dataclasses.fields(cls)} or key in areas:
                    raise TypeError(f"unknown engine option {key!r}")
                parts["engine"][key] = value
        return cls(model=model, cache=CacheConfig(**parts["cache"]), scheduler=SchedulerConfig(**parts["scheduler"]),
                   spec=SpecConfig(**parts["spec"]), **parts["engine"])


# -- the engine's options as command-line flags (`twospeed serve`, `simulate`, `plan`, ...) -------------------------
_ENGINE_AREAS = (EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
_SKIP = {"model", "cache", "scheduler", "spec"}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model plus one --flag per config field (--block-size, --max-num-batched-tokens, --spec-method, ...)."""
    parser.add_argument("--model", default="demo",
                        help="checkpoint folder (HF layout), a .gguf file (or a folder holding one), or a built-in: "
                             "demo (random weights), demo-draft (its draft), smollm2 (SmolLM2-135M-Instruct, a real "
                             "instruct model fetched on first use), demo-task (trained on the lab's formats, "
                             "built on first use); --tokenizer FOLDER overrides the checkpoint's tokenizer")
    for klass in _ENGINE_AREAS:
        hints = get_type_hints(klass)
        for flat, name in flat_fields(klass).items():
            if name in _SKIP:
                continue
            hint = hints[name]
            base = next((a for a in get_args(hint) if a is not type(None)), hint)
            kind = _bool if base is bool else base if base in (int, float) else str
            flag = {"nargs": "?", "const": True} if base is bool else {}  # a bare --deterministic means true
            parser.add_argument(f"--{flat.replace('_', '-')}", dest=flat, type=kind, default=None,
                                help=f"{klass.__name__}.{name}", **flag)
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help='SpecConfig as JSON, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the command line set, by their flat names (what `EngineConfig.from_kwargs` takes)."""
    names = {flat for k in _ENGINE_AREAS for flat, name in flat_fields(k).items() if name not in _SKIP}
    names.add("speculative_config")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
