"""An engine built in another process, seen from this one: its facts, with a tokenizer of its own.

The server prepares and validates every request before the engine sees it (server/prepare.py, and the admission
table, engine/admission.py), so a bad request gets its 400 without a round trip. That needs what a local
LLMEngine offers read-only: the model's limits, the scheduler's config and the tokenizer.
EngineView offers exactly that surface, for an engine in a process of its own (engine_process.py) or for the
replicas of a cluster (twospeed/cluster/: their facts checked to agree): the limits come from the engine that
was built, the tokenizer is loaded here from the same checkpoint folder (on a multi-node cluster, the folder must
be at the same path on every node, as the replicas need it too).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from pathlib import Path

from typing import TYPE_CHECKING

from twospeed.config import EngineConfig, SchedulerConfig
from twospeed.engine.admission import ModelLimits
from twospeed.engine.cost_model import LinearCostModel
from twospeed.engine.engine_stats import EngineMemory
from twospeed.builtin.registry import resolve_model_path

if TYPE_CHECKING:
    from twospeed.engine.engine import LLMEngine


@dataclass(slots=True)
class EngineFacts:
    """What an engine says about itself once built (a replica's EngineReplica.describe, the engine process's ready)."""

    name: str  # the deployment: engine-0, engine-1, ... ("engine" for `twospeed serve`'s engine process)
    instance: str  # changes when the engine restarts (a new process, an empty cache)
    actor: str  # its Ray actor's name (namespace "serve"); its process id for an engine process
    node: str  # the host it runs on
    config: EngineConfig
    model_path: str  # the checkpoint folder it loaded (a built-in's in its cache)
    vocab_size: int  # the model's logits rows (what a grammar's token masks cover)
    dtype: str  # the dtype its weights and KV cache use, by name: no torch object crosses, so the server
    #             process needs no torch to read these facts
    limits: ModelLimits
    scheduler_config: SchedulerConfig  # with max_model_len as the engine resolved it
    num_blocks: int  # its KV pool, in blocks
    eos_token_ids: frozenset[int]
    kv_bytes_per_block: int
    memory: EngineMemory  # its weight and KV formats and pool, in bytes (LLMEngine.memory)
    cost_profile: dict | None = None  # its step cost model as plain data (LinearCostModel.profile), when built

    @classmethod
    def of(cls, engine: "LLMEngine | EngineView", name: str, instance: str, actor: str) -> "EngineFacts":
        """The facts of an engine built in this process, or of one in a process of its own (its view's facts)."""
        if isinstance(engine, EngineView):
            return replace(engine.replicas[0], name=name, instance=instance, actor=actor, node=socket.gethostname(),
                           cost_profile=cost_profile(engine))  # the fit as its engine last reported it
        memory = engine.memory()
        return cls(name, instance, actor, socket.gethostname(), engine.config, str(engine.model_path),
                   engine.model_config.vocab_size, str(engine.dtype).removeprefix("torch."), engine.limits,
                   engine.scheduler_config, engine.num_blocks, engine.eos_token_ids, memory.block_bytes, memory,
                   cost_profile(engine))

    def mismatch(self, other: "EngineFacts") -> str | None:
        """How this replica's engine differs from another's in what the ingress relies on, or None."""
        for what, a, b in (("model", self.config.model, other.config.model),
                           ("block_size", self.config.cache.block_size, other.config.cache.block_size),
                           ("limits", self.limits, other.limits),
                           ("eos_token_ids", self.eos_token_ids, other.eos_token_ids),
                           ("skip_tokenizer_init", self.config.skip_tokenizer_init, other.config.skip_tokenizer_init)):
            if a != b:
                return f"{self.name} has {what} {a!r} but {other.name} has {b!r}"
        return None


class EngineView:
    """LLMEngine's read-only surface (config, limits, tokenizer, ...) for the engine every replica runs."""

    def __init__(self, facts: list[EngineFacts], tokenizer):
        first = facts[0]
        for other in facts[1:]:
            if (problem := first.mismatch(other)) is not None:
                raise RuntimeError(f"the replicas do not run the same engine: {problem}")
        self.replicas = facts
        self.config = first.config
        self.vocab_size = first.vocab_size
        self.dtype = first.dtype
        self.tokenizer = tokenizer
        self.limits = first.limits
        self.max_model_len = first.limits.max_model_len
        self.scheduler_config = first.scheduler_config
        self.eos_token_ids = first.eos_token_ids
        self.num_blocks = sum(f.num_blocks for f in facts)  # the cluster's pool (the dashboard's share of blocks)
        self.cost_model: LinearCostModel | None = None  # the first replica's, as it last reported it
        self.update_costs(first.cost_profile)

    def update_costs(self, profile: dict | None) -> None:
        """Take the engine's latest cost-model snapshot (a fixed copy: the fitting happens in the engine)."""
        if profile is not None:
            self.cost_model = LinearCostModel.from_profile(profile)

    def memory(self) -> EngineMemory:
        """One replica's formats and bytes, with the pool the cluster's (every replica's blocks)."""
        return replace(self.replicas[0].memory, num_blocks=self.num_blocks,
                                   max_tokens=sum(f.memory.max_tokens for f in self.replicas))


def cost_profile(engine) -> dict | None:
    """An engine's step cost model as plain data, or None where it has none."""
    model = getattr(engine, "cost_model", None)
    return model.profile() if model is not None else None


def load_tokenizer(facts: EngineFacts):
    """The checkpoint's tokenizer, as the engine loaded it (None with skip_tokenizer_init): from the folder the
    engine loaded where this machine has it, else from the model the config names (built here if built in)."""
    if facts.config.skip_tokenizer_init:
        return None
    from twospeed.model.tokenizer import Tokenizer

    if facts.config.tokenizer:  # --tokenizer: the engine loaded that one
        return Tokenizer.from_pretrained(facts.config.tokenizer)
    path = Path(facts.model_path)
    if not path.exists():
        path = resolve_model_path(facts.config.model)
    return Tokenizer.from_pretrained(path)
