"""LLMEngine: add requests, step, read outputs.

One step is: schedule (which tokens of which requests, on which blocks), run
(one forward pass over the flat batch), sample, then update each request's
tokens, clock and bill and check its stop conditions. The engine core is
synchronous; the server drives `step()` from its own loop. After every step
`last_stats` holds a `StepStats` for metrics.

No request can fail another: admission.py refuses a bad field before anything is
allocated, and if running or sampling a step raises anyway, isolation.py finds the
request(s) that caused it; only those finish with status "error" (their `error`
names the exception), the others get their tokens as if nothing happened.

The step cost model (`cost_model`, seeded at start-up by engine/cost_probe.py)
learns each step's measured time, so the scheduler's time-sized prompt share
follows this machine; each thread count the governor steps with has its own.

Speculative decoding (EngineConfig.spec, engine/spec.py) adds one thing before
the schedule: each decoding request the policy lets speculate gets draft tokens,
which its decode chunk carries as verify rows. The sampler returns every
request's emitted tokens (the drafts it kept, then one more); they are appended
one at a time through the same stop checks, the kept drafts' KV is committed
by counter, and the verify step is booked in the request's trace and bill.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from twospeed.config import DTYPES, EngineConfig
from twospeed.engine.admission import ModelLimits, check_params, check_prompt
from twospeed.engine.isolation import execute_isolating, sample_isolating
from twospeed.engine.cost_model import LinearCostModel
from twospeed.engine.cost_probe import probe, roofline_prior
from twospeed.engine.engine_stats import EngineMemory, StepStats
from twospeed.engine.heap_trim import HeapTrimmer
from twospeed.engine.threads import ThreadGovernor
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.lazy_pool import LazyBlockPool
from twospeed.engine.outputs import Finish, RequestDelta
from twospeed.engine.request import Request, RequestOutput, RequestStatus
from twospeed.engine.runner import ModelRunner, kv_bytes_per_token, num_blocks_for
from twospeed.engine.sampler import Sampler
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.scheduler import Scheduler, SchedulerOutput
from twospeed.engine.spec import make_speculator
from twospeed.engine.stop import Stop, check_stop
from twospeed.model.batch_invariant import make_batch_invariant
from twospeed.builtin.registry import resolve_model_path
from twospeed.model.compute_dtype import auto_dtype, auto_kv_cache_dtype
from twospeed.model.loader import load_model, load_model_config

log = logging.getLogger(__name__)
T = TypeVar("T")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "bfloat16": what the server reads (it never imports torch)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = load_model_config(self.model_path)
        self.device = torch.device(config.device)
        self.dtype = auto_dtype(self.model_config.dtype, self.device) if config.dtype == "auto" else DTYPES[config.dtype]
        stored, computed = _name(self.model_config.dtype), _name(self.dtype)
        if stored != computed and config.dtype == "auto":
            if stored == "float32":  # less precision than stored: a warning, as the engine process shows no info
                log.warning("checkpoint stored in float32; computing in %s (dtype auto; --dtype float32 to keep "
                            "float32)", computed)
            else:
                log.info("this CPU has no fast %s kernels: computing in %s (set dtype to override)", stored, computed)
        if config.cache.kv_cache_dtype == "auto":
            kv = auto_kv_cache_dtype(self.model_config.dtype, self.dtype, config.dtype == "auto",
                                     self.model_config.quantized_weights)
            if kv != "auto":
                log.info("KV cache in %s, the checkpoint's dtype (kv_cache_dtype auto)", kv)
                config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=kv))
                self.config = config
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        # Fewer threads while other processes take cores (engine/threads.py); the count set here is the ceiling.
        # Deterministic: the thread count stays put, as a kernel's split of its work may follow it.
        self.threads = (ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
                        if config.adapt_threads and not config.deterministic and self.device.type == "cpu" else None)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from twospeed.model.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_path)
        cache = config.cache
        self.num_blocks = num_blocks_for(self.model_config, cache, self.dtype)
        sched = config.scheduler
        max_len = sched.max_model_len or self.model_config.max_position_embeddings
        pool_len = self.num_blocks * cache.block_size
        self._len_limit = "max_model_len"
        if max_len > pool_len:
            log.warning("max_model_len %d exceeds the KV pool (%d blocks x %d tokens); using %d",
                        max_len, self.num_blocks, cache.block_size, pool_len)
            max_len = pool_len
            self._len_limit = f"max_model_len (limited by the KV pool: {self.num_blocks} blocks of {cache.block_size} tokens)"
        self.scheduler_config = dataclasses.replace(sched, max_model_len=max_len)
        self.max_model_len = max_len
        self.limits = ModelLimits(self.model_config.vocab_size, max_len, self._len_limit)

        self.model = load_model(self.model_path, self.dtype, self.device, max_positions=max_len,
                                linear_backend=config.linear_backend, attention_backend=config.attention_backend,
                                quantization=config.quantization, kv_cache_dtype=cache.kv_cache_dtype)
        if config.deterministic:
            make_batch_invariant(self.model)
        self.kv = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 pool=LazyBlockPool(self.num_blocks, cache.enable_prefix_caching))
        self.runner = ModelRunner(self.model, self.num_blocks, cache.block_size, self.device, self.dtype)
        self.sampler = Sampler(self.device, config.seed)
        # Step time from the step's shape, per device and dtype; the probe times a few real steps to seed it.
        self.cost_model = LinearCostModel(roofline_prior(self.model_config, self.dtype, self.device),
                                          key=f"{self.device.type}/{str(self.dtype).removeprefix('torch.')}")
        if config.cost_probe:
            probe(self.runner, self.kv, self.sampler, self.cost_model, max_len, sched.max_num_batched_tokens)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, cost_model=self.cost_model)
        top = self.threads.max_threads if self.threads is not None else 0
        self._cost_models = {top: self.cost_model}  # one fit per thread count the governor steps with
        self._cost_threads = top
        self.speculator = make_speculator(
            config.spec, target_vocab=self.model_config.vocab_size, max_model_len=max_len, dtype=self.dtype,
            device=self.device, num_blocks=self.num_blocks, block_size=cache.block_size,
            linear_backend=config.linear_backend, attention_backend=config.attention_backend)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(t for t in eos if 0 <= t < self.model_config.vocab_size)
        self._grammars = None  # structured.GrammarCompiler, made on the first constrained request
        self._grammars_lock = threading.Lock()  # the server compiles grammars in worker threads too
        self.last_stats: StepStats | None = None
        self.num_step_failures = 0  # steps that raised and were isolated to the request(s) that caused it
        self.heap = HeapTrimmer(config.heap_trim_interval_s if self.device.type == "cpu" else None)
        self._counter = 0

    def memory(self) -> EngineMemory:
        cache = self.config.cache
        per_token = kv_bytes_per_token(self.model_config, self.dtype, cache.kv_cache_dtype)
        return EngineMemory(_name(self.dtype), _name(self.model_config.dtype), self.config.quantization,
                            self.model.weight_bytes(), cache.kv_cache_dtype, per_token,
                            cache.block_size, per_token * cache.block_size, self.num_blocks,
                            self.num_blocks * cache.block_size,
                            dict(getattr(self.model, "checkpoint_formats", None) or {}) or None)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0, itl_target: float | None = None,
                    lane: str = "default", speculate: bool | None = None) -> Request:
        """Validate and queue a request; raises ValueError before anything is allocated if it can never run.
        itl_target: seconds, the tightest ITL objective of its lane (Request.itl_target; the server sets it).
        lane: the server's lane (speculation's per-lane estimates); speculate: the lane's policy (False: off)."""
        if itl_target is not None and not itl_target > 0:
            raise ValueError(f"itl_target must be a positive number of seconds (or None), got {itl_target}")
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the engine was started with skip_tokenizer_init)")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, prompt
        ids = check_prompt(ids, self.limits)
        check_params(params, self.limits, priority, len(ids))
        room = self.max_model_len - len(ids)
        grammar = self._grammar_state(params) if params.structured is not None else None
        req = Request(request_id, ids, params, prompt=text, arrival_time=arrival_time, priority=priority,
                      eos_token_ids=self.eos_token_ids,
                      max_output_tokens=min(params.max_tokens or room, room), lane=lane)
        req.grammar = grammar
        req.itl_target = itl_target
        if self.speculator is not None:
            self.speculator.start(req, "opted_out" if params.speculate is False else
                                  "lane_policy" if speculate is False else None)
        if params.seed is not None:
            req.generator = self.sampler.make_generator(params.seed)
        if self.tokenizer is not None:
            from twospeed.model.tokenizer import IncrementalDetokenizer
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.scheduler.add_request(req)
        return req

    @property
    def grammars(self):
        """The engine's GrammarCompiler (llguidance tokenizer + compiled-grammar cache), made on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                from twospeed.engine.structured import grammar_compiler
                self._grammars = grammar_compiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            return self._grammars

    def _grammar_state(self, params: SamplingParams):
        return self.grammars.new_state(params.structured)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and return its KV blocks; False if it is unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; each request it touched as a whole RequestOutput (`LLM.generate`, tests)."""
        return self._step(self._output)

    def step_deltas(self) -> list[RequestDelta]:
        """One step; each request it touched as a RequestDelta: only what changed (the serving path)."""
        return self._step(self._delta)

    def _step(self, emit: Callable[[Request], T]) -> list[T]:
        start = time.monotonic()
        if self.threads is not None:
            self.threads.tick()
            self._follow_threads()
        propose_time = 0.0
        if self.speculator is not None:
            propose_time = self.speculator.propose(self.scheduler.running, self.scheduler.requests.get)
        out = self.scheduler.schedule()
        touched: list[Request] = []
        errored: list[Request] = []
        accepted = 0
        if out.chunks:
            logits, sampling, prompt, failed = execute_isolating(
                lambda chunks: self.runner.execute(chunks, self.kv), out.chunks)
            errored += self._fail_all(failed, "running the model")
            for p in prompt:  # raw logits, before any processor: vLLM's prompt logprobs
                if not p.request.is_finished:
                    ids = p.request.prompt_token_ids[p.first:p.first + len(p.logits)]
                    p.request.prompt_logprobs += self.sampler.score(p.logits, ids, p.request.params.prompt_logprobs)
            touched += errored
            out.chunks = [c for c in out.chunks if not c.request.is_finished]
            self.scheduler.update_after_step(out, time.monotonic())
            requests = [c.request for c in sampling]
            drafts = [c.request.spec_token_ids[:c.num_draft] for c in sampling]
            tokens, logprobs = [], []
            if requests:
                tokens, logprobs, failed = sample_isolating(self._sample, self.sampler.generator, logits, requests,
                                                            drafts)
                errored += self._fail_all(failed, "sampling")
            extra = (self.speculator.cost_ratio(out.shape, self.cost_model)
                     if self.speculator is not None and out.num_draft_tokens else 0.0)
            now = time.monotonic()
            for req, draft, emitted, lps in zip(requests, drafts, tokens, logprobs):
                touched.append(req)
                if req.is_finished:  # failed while sampling
                    continue
                try:
                    kept = self._update(req, emitted, lps, now, len(draft))
                except Exception as e:  # a detokenizer or grammar bug: this request's alone
                    errored += self._fail_all({req: e}, "updating it")
                    continue
                if draft:
                    accepted += kept
                    self.speculator.record(req, len(draft), len(emitted) - 1, kept, extra)
        for req in self.scheduler.running:
            req.spec_token_ids = []  # drafts live for one step
        outputs = []
        for req in touched:
            try:
                outputs.append(emit(req))
            except Exception as e:
                errored += self._fail_all({req: e}, "detokenizing it")
                outputs.append(emit(req))
        self.num_step_failures += bool(errored)
        end = time.monotonic()
        if not errored:  # a failed step's time went into isolating the failure: it says nothing of the shape
            self._learn_step(out, end - start - propose_time)
        self.last_stats = StepStats(
            time=end, step_time=end - start, num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_preempted=len(out.preempted),
            kv_blocks_used=self.num_blocks - self.kv.num_free_blocks, kv_blocks_total=self.num_blocks,
            kv_cached_blocks=self.kv.num_cached_blocks, predicted_time=out.predicted_time,
            target_time=out.target_time, prefill_budget=out.prefill_budget, time_bound=out.time_bound,
            num_threads=self.threads.threads if self.threads is not None else 1,
            num_draft_tokens=out.num_draft_tokens, num_accepted_tokens=accepted, propose_time=propose_time)
        self.heap.maybe_trim()  # after the step's clock: a trim delays the next step, it is not this step's work
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]):
        """The sampler's tokens for each request: a plain row each, or verify rows where drafts were scheduled."""
        if any(drafts):
            return self.sampler.verify(logits, requests, drafts)
        tokens, logprobs = self.sampler(logits, requests)
        return [[t] for t in tokens], [[lp] for lp in logprobs]

    def _update(self, req: Request, tokens: list[int], lps: list, now: float, num_draft: int = 0) -> int:
        """Append a step's emitted tokens (the drafts the sampler kept, then one of its own) one at a time through the
        stop checks, commit the kept drafts' KV (computed this step), then stop or jump-forward. Returns the drafts
        kept (a stop can cut some of the accepted ones)."""
        appended, ended = 0, None
        for token, lp in zip(tokens, lps):
            req.append_token(token, now)
            appended += 1
            if lp is not None:
                req.logprobs.append(lp)
            if req.grammar is not None and not req.grammar.accept(token):
                ended = "grammar"
                break
            ended = check_stop(req, [token])  # one token at a time: a stop inside the drafts ends the step there
            if ended is not None:
                break
        # The step yields `appended` tokens: one of its own and appended - 1 kept drafts (a stop inside the drafts
        # ends the step there, its last token then counting as the step's own).
        kept = max(0, min(appended - 1, num_draft))
        if ended is None:
            self.scheduler.commit_drafts(req, kept)
        if ended == "grammar":
            self._grammar_failed(req)
        elif ended is not None:
            self._finish(req, ended)
        elif req.grammar is not None:
            self._jump_forward(req, now)
        return kept

    def _fail_all(self, failed: dict[Request, Exception], doing: str) -> list[Request]:
        """End the requests a step failed on, each with the error named; the step's others go on."""
        for req, e in failed.items():
            log.error("request %s failed the step (%s): %s: %s", req.request_id, doing, type(e).__name__, e,
                      exc_info=e)
            req.error = f"the engine failed this request while {doing}: {type(e).__name__}: {e}"
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
        return list(failed)

    def _follow_threads(self) -> None:
        """Step cost by thread count: one of two threads takes ~1.5-2x the time, so a fit fed steps of both would
        mispredict every step, and the prompt share it sizes (and stretches beside slow decodes) would miss its
        target both ways. Each count the governor picks gets its own fit; a count first seen starts from the top
        count's, scaled by the thread ratio, and learns from there."""
        count = self.threads.threads
        if count == self._cost_threads or self.cost_model is not self._cost_models.get(self._cost_threads):
            return  # unchanged, or something stands in for the fit (plan/calibrate.py's recorder)
        top = self._cost_models[self.threads.max_threads]
        if count not in self._cost_models:
            ratio = self.threads.max_threads / count
            self._cost_models[count] = LinearCostModel([c * ratio for c in top.coefficients.values()], key=top.key)
        self.cost_model = self.scheduler.cost_model = self._cost_models[count]
        self._cost_threads = count

    def _learn_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The cost model learns the step's time; each stream that shared it with a prompt chunk notes its length."""
        if not out.chunks:
            return
        self.cost_model.observe(out.shape, seconds)
        if self.speculator is not None:
            self.speculator.observe_step(out.shape, seconds)
        if out.num_prefill_tokens:
            for c in out.chunks:
                if c.is_decode:
                    c.request.clock.longest_interfered_step = max(c.request.clock.longest_interfered_step, seconds)

    def _jump_forward(self, req: Request, now: float) -> None:
        """Append the tokens the grammar forces (its mask allows one token only): no forward pass picks
        them; their KV is computed in the next step with the next sample. Off when logprobs are asked
        for, since a forced token has no model distribution to report."""
        if req.params.logprobs is not None:
            return
        while not req.is_finished and (token := req.grammar.forced_token()) is not None:
            req.append_token(token, now)
            req.bill.forced_tokens += 1
            if not req.grammar.accept(token):
                self._grammar_failed(req)
                return
            if (ended := check_stop(req, [token])) is not None:
                self._finish(req, ended)

    def _grammar_failed(self, req: Request) -> None:
        """The grammar library gave up on this request (a parser limit mid-document): end it alone, say why."""
        log.warning("request %s: structured output failed: %s", req.request_id, req.grammar.error)
        if req.detokenizer is not None:
            req.detokenizer.add_tokens(req.output_token_ids[-1:])
        req.stop_reason = f"structured output failed: {req.grammar.error}"
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, stop: Stop) -> None:
        """The stop policy's answer applied (engine/stop.py, shared with the planner's simulator)."""
        req.stop_reason = stop.reason
        self.scheduler.finish_request(req, stop.status)

    @staticmethod
    def _new_text(req: Request) -> str:
        """The text req's detokenizer releases since the last call (all it held back once req has ended); "" for a
        failed request, which keeps the text it had."""
        if req.detokenizer is None or req.error is not None:
            return ""
        if req.is_finished:
            req.detokenizer.finish()
        return req.detokenizer.take_delta()

    def _delta(self, req: Request) -> RequestDelta:
        """What changed for req since its last delta; its Finish once it has ended. Nothing here grows with the
        request's length (the whole text is read once, at the end)."""
        start = req.num_emitted
        new_text = self._new_text(req)
        req.num_emitted = len(req.output_token_ids)
        delta = RequestDelta(req.request_id, req.output_token_ids[start:], new_text, req.clock.token_times[start:])
        if req.params.logprobs is not None:
            delta.new_logprobs = req.logprobs[req.num_logprobs_emitted:]
            req.num_logprobs_emitted = len(req.logprobs)
        if req.is_finished:
            if req.detokenizer is not None:
                req.text = req.detokenizer.output_text
            delta.finish = Finish(req.finish_reason, req.stop_reason, req.text, req.clock, req.bill,
                                  req.spec if self.speculator is not None else None, req.num_preemptions, req.error,
                                  req.prompt_logprobs)
        return delta

    def _output(self, req: Request) -> RequestOutput:
        new_ids = req.output_token_ids[req.num_emitted:]
        new_text = self._new_text(req)
        if req.detokenizer is not None and req.error is None:
            req.text = req.detokenizer.output_text
        req.num_emitted = len(req.output_token_ids)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=req.text, new_token_ids=new_ids, new_text=new_text,
            finished=req.is_finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            clock=req.clock, bill=req.bill, num_preemptions=req.num_preemptions, error=req.error,
            spec=req.spec if self.speculator is not None else None, prompt_logprobs=req.prompt_logprobs)

