"""Step time from the roofline: a cost model for a machine the planner has no measurements of.

The same interface as the engine's own cost model (engine/cost_model.py's `StepCostModel`: `predict(shape)`,
`observe(shape, seconds)`), so the simulator's scheduler and its step timer take either: a profile fitted on the
live engine (`LinearCostModel.from_profile`, plan/profile.py) or this. A step's time is

    overhead + max(FLOPs / (peak FLOP/s x compute efficiency), bytes / (bandwidth x bandwidth efficiency))

with FLOPs counted as plan/roofline.py counts them (2 a multiply-add over every row's linears, 4 x heads x
head_dim per attended (query, key) pair per layer, the vocabulary matmul for each sampled row) and bytes as a
step moves them: every weight once (in its format, plan/precision.py), the K and V of every position a decode
row attends, prefill chunks' context KV once per 128-row query tile (a flash-attention kernel's re-reads), and
one new K and V per token written. The max makes a prefill-heavy step compute-bound and a decode step
bandwidth-bound, so both speeds come out of one formula. The efficiencies and the per-step overhead are
assumptions, not measurements (flags of `twospeed plan`): modern engines reach roughly half the dense peak on
long prefills and most of the memory bandwidth on large decode batches; a per-step overhead stands for the
host's scheduling, sampling and launch time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twospeed.engine.cost_model import StepShape
from twospeed.plan.hardware import HardwareProfile
from twospeed.plan.precision import kv_bytes_per_token, weight_bytes
from twospeed.plan.roofline import layer_linear_params

if TYPE_CHECKING:
    from twospeed.config import ModelConfig

PREFILL_TILE = 128  # query rows a flash-attention kernel processes per pass over the context's KV


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What share of the datasheet a step reaches, and the host's time per step (assumed; see the module docs)."""

    compute: float = 0.5  # share of peak dense FLOP/s a prefill-heavy step reaches
    bandwidth: float = 0.8  # share of peak memory bandwidth a decode step reaches
    step_overhead_s: float = 0.002  # seconds per step outside the kernels (scheduling, sampling, launches)

    def __post_init__(self) -> None:
        if not 0 < self.compute <= 1 or not 0 < self.bandwidth <= 1 or self.step_overhead_s < 0:
            raise ValueError("efficiencies must be in (0, 1] and the step overhead >= 0")


class RooflineCost:
    """seconds of a step on `hardware` for `cfg` in `dtype`, with weights and KV in their formats."""

    def __init__(self, cfg: ModelConfig, hardware: HardwareProfile, dtype: str = "bfloat16",
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 efficiency: Efficiency = Efficiency()):
        self.cfg, self.hardware, self.efficiency = cfg, hardware, efficiency
        self.key = f"roofline/{hardware.name}/{dtype}/{quantization or 'none'}/{kv_cache_dtype}"
        self.flops_per_s = hardware.flops_for(dtype) * efficiency.compute
        self.bytes_per_s = hardware.memory_bandwidth * efficiency.bandwidth
        self.weight_bytes = weight_bytes(cfg, dtype, quantization)
        self.kv_per_token = kv_bytes_per_token(cfg, dtype, kv_cache_dtype)
        self._linear = 2 * cfg.num_layers * layer_linear_params(cfg)  # FLOPs per row through the linears
        self._pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per attended pair
        self._logits = 2 * cfg.hidden_size * cfg.vocab_size  # FLOPs per sampled row

    def flops(self, shape: StepShape) -> float:
        return (self._linear * shape.num_tokens + self._pair * (shape.prefill_attention + shape.decode_context)
                + self._logits * shape.sampled)

    def bytes(self, shape: StepShape) -> float:
        kv_read = shape.decode_context + shape.prefill_attention / PREFILL_TILE
        return self.weight_bytes + self.kv_per_token * (kv_read + shape.num_tokens)

    def predict(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        return self.efficiency.step_overhead_s + max(self.flops(shape) / self.flops_per_s,
                                                     self.bytes(shape) / self.bytes_per_s)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A roofline is not fitted: nothing to learn."""

    def bound(self, shape: StepShape) -> str:
        """Which roof the step sits under: "compute" or "bandwidth"."""
        compute, memory = self.flops(shape) / self.flops_per_s, self.bytes(shape) / self.bytes_per_s
        return "compute" if compute >= memory else "bandwidth"
