"""What an engine reports about itself: each step's StepStats and its EngineMemory.

Plain dataclasses, no torch: the server process, which never loads a model when the engine steps in a process
of its own, reads them from the engine's messages, and the metrics, history and dashboard are built on them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepStats:
    """What one step did; the server turns these into Prometheus metrics."""

    time: float  # monotonic time at the end of the step
    step_time: float  # seconds: schedule + forward + sample + update
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cached_blocks: int
    predicted_time: float | None = None  # seconds the cost model predicted for the step
    target_time: float | None = None  # seconds the prompt share was sized to (None: not sized by time)
    prefill_budget: int = 0  # prompt tokens the step allowed (scheduler.SchedulerOutput.prefill_budget)
    time_bound: bool = False  # the target, not the token budget, set the prompt share
    num_threads: int = 1  # CPU threads the step ran with (engine/threads.py)
    num_draft_tokens: int = 0  # speculation: draft tokens verified in the step (beside num_decode_tokens)
    num_accepted_tokens: int = 0  # of those, kept as output tokens
    propose_time: float = 0.0  # seconds the proposer took (part of step_time)


@dataclass(slots=True)
class EngineMemory:
    """What the engine's memory holds, in its formats (the server reports it; the lab bills KV memory by it)."""

    dtype: str  # what it computes in, by name ("bfloat16"): activations, and the KV cache under kv_cache_dtype "auto"
    checkpoint_dtype: str  # how the checkpoint stores its weights (model/compute_dtype.py: what `auto` makes of it)
    quantization: str | None  # the weight format (None: unquantized)
    weight_bytes: int  # bytes a decode step reads for the weights (schema/formats.py)
    kv_cache_dtype: str  # "auto" (the model's dtype), "bf16", "int8", "fp8": what the cache holds, auto resolved
    kv_bytes_per_token: int  # K and V of one token, every layer, scales included
    block_size: int  # tokens per KV block
    block_bytes: int  # bytes of one KV block (block_size * kv_bytes_per_token)
    num_blocks: int  # blocks in the pool
    max_tokens: int  # tokens the pool holds (num_blocks * block_size)
    # How the checkpoint's file stores each kind of tensor, by the file format's own names: {"attention": "Q4_1",
    # "mlp": "Q4_1", "embedding": "Q8_0", "norm": "F32"} for a GGUF, {"attention": "BF16", ...} for safetensors;
    # several formats in one kind joined by "+", the most common first (model/loader.py: Checkpoint.formats)
    checkpoint_formats: dict[str, str] | None = None
