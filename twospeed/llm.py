"""`LLM`: the offline Python API, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence

from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.engine.outputs import SequenceOutput
from twospeed.engine.request import RequestOutput
from twospeed.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """LLM(model, **engine_options).generate(prompts, params) -> outputs with .text, .token_ids, .clock, .bill.

    model is a Hugging Face checkpoint folder, a GGUF file (or a folder holding one: dequantized at load,
    model/gguf.py) or a built-in ("demo": random weights; "demo-task": trained on the lab's lane formats, built on
    first use); options are the fields of CacheConfig, SchedulerConfig and EngineConfig (dtype, device, tokenizer,
    block_size, num_gpu_blocks, max_num_batched_tokens, ...).
    """

    def __init__(self, model: str = "demo", **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priorities: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                requests.append(self.engine.add_request(None, prompt, p, priority=priorities[i] if priorities else 0))
        except Exception:
            for req in requests:
                self.engine.abort_request(req.request_id)
            raise
        # Each step's deltas added up per request: nothing is copied per step, the whole output once at the end.
        seqs = {r.request_id: SequenceOutput(r.request_id, r.prompt_token_ids, r.params.logprobs is not None)
                for r in requests}
        left = len(seqs)
        while left:
            for delta in self.engine.step_deltas():
                seqs[delta.request_id].add(delta)
                left -= delta.finished
        return [seqs[r.request_id].output(r.prompt) for r in requests]
