"""What one replica is, as the planner sees it: its step cost model, its KV pool, its scheduler, its formats.

Two sources behind one result (`Deployment`):
  a calibrated profile (`--profile`, plan/profile.py): the engine's cost model fitted on the live engine, and that
      engine's pool (blocks, block size, KV bytes per token) and limits; engine flags may resize the pool.
  a hardware profile (`--hardware`, plan/hardware.py) and the model's config: the roofline cost model
      (plan/step_cost.py) with the weights and KV in their formats (plan/precision.py), and a pool of what the
      device's memory holds after the weights: memory x gpu_memory_utilization - weights - an activation reserve,
      unless --num-gpu-blocks or --kv-cache-memory-gb say otherwise. "local" measures this machine.
Either way the scheduler is the engine's SchedulerConfig from the same flags `twospeed serve` takes, its
max_model_len resolved as LLMEngine resolves it (the model's limit, clipped to the pool).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from twospeed.config import EngineConfig, SchedulerConfig
from twospeed.engine.cost_model import StepCostModel
from twospeed.plan.sim import SimConfig

GiB = 1 << 30


@dataclass(slots=True)
class Deployment:
    """One replica: how to make its cost model, its pool, its scheduler; and what it is, for the report."""

    cost_model: Callable[[], StepCostModel]  # a fresh one per simulated replica
    scheduler: SchedulerConfig  # max_model_len resolved
    num_blocks: int  # KV blocks in the pool
    block_size: int  # tokens per block
    enable_prefix_caching: bool
    kv_bytes_per_token: int  # K and V of one token, every layer, in the KV format
    weight_bytes: int  # bytes of the weights as stored
    vocab_size: int
    describe: dict = field(default_factory=dict)  # cost model, hardware, formats, memory: run.simulated, plan's report

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def sim_config(self, **topology) -> SimConfig:
        """The simulator's config for this replica type; topology: replicas, or prefill/decode replicas + link."""
        return SimConfig(self.scheduler, self.num_blocks, self.block_size, self.enable_prefix_caching,
                         kv_bytes_per_token=self.kv_bytes_per_token, vocab_size=self.vocab_size, **topology)

    def with_scheduler(self, **changes) -> Deployment:
        """The same replica under other scheduler settings (e.g. another max_num_batched_tokens)."""
        sched = dataclasses.replace(self.scheduler, **changes)
        return dataclasses.replace(self, scheduler=sched)


def from_profile(path: str, engine: EngineConfig) -> Deployment:
    from twospeed.plan.profile import Profile

    profile = Profile.load(path)
    facts = profile.engine
    kv_per_token = int(facts.get("kv_bytes_per_token") or 0)
    block_size = engine.cache.block_size if _set(engine, "block_size") else int(facts.get("block_size", 16))
    num_blocks = _pool_blocks(engine, block_size, kv_per_token) or int(facts["num_blocks"])
    limit = engine.scheduler.max_model_len or int(facts.get("max_model_len") or num_blocks * block_size)
    return Deployment(profile.cost_model, _resolved(engine.scheduler, limit, num_blocks * block_size), num_blocks,
                      block_size, engine.cache.enable_prefix_caching, kv_per_token, int(facts.get("weight_bytes", 0)),
                      int(facts.get("vocab_size", 32000)),
                      {"cost_model": "calibrated", "profile": str(path), "key": profile.key,
                       "residuals": profile.residuals.get("all"), "engine": {k: facts.get(k) for k in (
                           "dtype", "device", "threads", "quantization", "kv_cache_dtype")},
                       **_memory(num_blocks, block_size, kv_per_token, int(facts.get("weight_bytes", 0)), None)})


def from_hardware(name: str, model: str, engine: EngineConfig, quantization: str | None = None,
                  kv_cache_dtype: str = "auto", efficiency=None, gpu_memory_utilization: float = 0.9,
                  activation_reserve_gb: float = 1.0) -> Deployment:
    from twospeed.plan.hardware import get_profile
    from twospeed.plan.precision import kv_bytes_per_token, weight_bytes
    from twospeed.plan.roofline import dtype_name, load_config
    from twospeed.plan.step_cost import Efficiency, RooflineCost

    cfg = load_config(model)
    hw = get_profile(name, device=engine.device if name == "local" else None)
    dtype = engine.dtype if engine.dtype != "auto" else dtype_name(cfg.dtype)
    efficiency = efficiency or Efficiency()
    weights = weight_bytes(cfg, dtype, quantization)
    per_token = kv_bytes_per_token(cfg, dtype, kv_cache_dtype)
    bs = engine.cache.block_size
    num_blocks = _pool_blocks(engine, bs, per_token)
    if num_blocks is None:
        if hw.memory_bytes is None:
            num_blocks = int(engine.cache.kv_cache_memory_gb * GiB) // (bs * per_token)
        else:
            free = hw.memory_bytes * gpu_memory_utilization - weights - activation_reserve_gb * GiB
            if free < bs * per_token:
                raise ValueError(f"{model} in {dtype} ({weights / 1e9:.1f} GB of weights) leaves no room for a KV "
                                 f"cache on {hw.description} ({hw.memory_bytes / 1e9:.0f} GB); quantize or pick a "
                                 f"bigger device")
            num_blocks = int(free // (bs * per_token))
    limit = engine.scheduler.max_model_len or cfg.max_position_embeddings

    def make() -> RooflineCost:
        return RooflineCost(cfg, hw, dtype, quantization, kv_cache_dtype, efficiency)

    return Deployment(make, _resolved(engine.scheduler, limit, num_blocks * bs), num_blocks, bs,
                      engine.cache.enable_prefix_caching, per_token, weights, cfg.vocab_size,
                      {"cost_model": "roofline", "hardware": hw.name, "hardware_description": hw.description,
                       "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                       "efficiency": dataclasses.asdict(efficiency), "peak_flops": hw.flops_for(dtype),
                       "memory_bandwidth": hw.memory_bandwidth,
                       **_memory(num_blocks, bs, per_token, weights, hw.memory_bytes)})


def _set(engine: EngineConfig, name: str) -> bool:
    return getattr(engine.cache, name) != getattr(type(engine.cache)(), name)


def _pool_blocks(engine: EngineConfig, block_size: int, per_token: int) -> int | None:
    """Blocks the engine flags ask for (--num-gpu-blocks, or --kv-cache-memory-gb when set); None: not asked."""
    cache = engine.cache
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    if _set(engine, "kv_cache_memory_gb") and per_token:
        return max(1, int(cache.kv_cache_memory_gb * GiB) // (block_size * per_token))
    return None


def _resolved(sched: SchedulerConfig, limit: int, pool_tokens: int) -> SchedulerConfig:
    """As LLMEngine resolves it: max_model_len is the model's (or the flag's), clipped to the pool."""
    return dataclasses.replace(sched, max_model_len=min(limit, pool_tokens))


def _memory(num_blocks: int, block_size: int, per_token: int, weights: int, device_bytes: float | None) -> dict:
    return {"memory": {"kv_blocks": num_blocks, "block_size": block_size, "kv_bytes_per_token": per_token,
                       "kv_pool_bytes": num_blocks * block_size * per_token,
                       "kv_capacity_tokens": num_blocks * block_size,
                       "weight_bytes": weights, "device_bytes": device_bytes}}


def model_config_json(model: str | None) -> dict:
    """The checkpoint's config.json as a dict ({} when there is none), for the lab's KV bill."""
    if not model:
        return {}
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin

    if is_builtin(model):
        model = str(builtin_checkpoint_path(model))
    path = Path(model)
    file = path if path.is_file() else path / "config.json"
    try:
        return json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}
