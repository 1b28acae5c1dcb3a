"""The built-in task checkpoint (`demo-task`): a small Llama trained here, on first use,
on the lab's lane formats (builtin/task_corpus.py).

Why: random weights make the lab's gates fail by construction, a quantization gate cannot tell a broken
quantization from a good one, and speculative acceptance measured on noise says nothing. Nothing can be
downloaded, so twospeed trains its own: a byte-level BPE tokenizer fitted to the corpus, then a Llama
(builtin/train_llama.py, HF parameter names) trained on answers only, AdamW with warmup and cosine decay,
bf16 autocast where this CPU runs it clearly faster than float32 (measured once: builtin/train_dtype.py), float32
elsewhere.

Copying from the prompt (an id from the evidence, the passage id after a fact) is what minutes of training
do not learn by themselves: measured, heads taught where to look still wrote the memorised, frequent ids,
because the values that would copy a rare token never formed. So the copy is built, not learnt: layer 0's
head 0 is a previous-token head, and the last layer's first heads an induction head on it (they find the
earlier occurrence of the current token by content, in RoPE's slow planes, and copy the token after it).
Their keys, values and outputs stay as built; their queries learn when to copy, taught by an attention probe
(where each copied answer token sits) and a copy loss on those heads' own output.

Deterministic under the spec's seed on one machine: the data order is a function of the seed, the thread
count is fixed for the build, and the tokenizer is trained single-threaded. Every task model shares the
tokenizer (a draft model for speculation must), so `TASK_SPECS` can grow another size (a draft) without a
new vocabulary. Output: the real HF folder layout, bf16 at rest, in the cache folder (`TWOSPEED_CACHE`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from twospeed.builtin import task_corpus
from twospeed.builtin.circuit_scale import CircuitScale, level_embeddings
from twospeed.builtin.copy_circuit import (circuit_slices, copy_heads, copy_layer, copy_scales, init_code_induction,
                                           init_copy_head, init_induction_head, init_previous_token_head)
from twospeed.builtin.demo import BOS, DEMO_CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, train_bpe_tokenizer
from twospeed.builtin.flag_circuit import (FlagShape, FlagTokens, flag_scales, flag_slices, init_flag_circuit, layout,
                                           reserved)
from twospeed.builtin.publish import build_lock, publish_checkpoint, write_json
from twospeed.builtin.registry import TASK_NAMES
from twospeed.builtin.task_data import (BOS_ID, EOS_ID, IM_END_ID, PAD_ID, ROWS_MULTIPLE, Sequence,  # noqa: F401
                                        batches, collate)
from twospeed.builtin.train_dtype import train_in_bf16
from twospeed.builtin.train_llama import AttentionProbe, TrainLlama
from twospeed.config import ModelConfig, cache_root

# Bump when the corpus, the tokenizer or the recipe changes what gets written: old cache folders are not reused.
TASK_VERSION = "task-v17"
TASK_VOCAB_SIZE = 5120  # ~1,100 of them the digit runs
DIGIT_GROUP = 3  # numbers in runs of up to three digits, each run one token (as Llama 3; builtin/demo.py)
TRAIN_THREADS = int(os.environ.get("TWOSPEED_TRAIN_THREADS", "2"))  # fixed: the weights must not depend on the load


@dataclass(frozen=True, slots=True)
class TaskModelSpec:
    """One built-in task model: its shape and its training recipe."""

    hidden_size: int = 492  # 257 learnt + 235 reserved for the built circuits' codes (builtin/flag_circuit.py)
    intermediate_size: int = 1024
    num_layers: int = 3
    num_heads: int = 6  # layer 0's six are all built (builtin/flag_circuit.py); later layers' beyond the circuits learn
    num_kv_heads: int = 6
    head_dim: int = 64
    max_position_embeddings: int = 2048  # tokens; the corpus' longest prompt + answer stays well below it
    rope_theta: float = 1e8  # RoPE base: a large one leaves many slow planes, where the induction heads match
    #                          tokens by content at any distance in the context
    steps: int = 1000  # optimizer steps
    batch_tokens: int = 1536  # tokens per step, padding included (examples of similar length share a step)
    lr: float = 1e-3  # peak learning rate, after `warmup_steps`; cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.05  # on matrices only
    first_weight: float = 5.0  # loss weight of each answer's first token (where refuse-or-answer is decided)
    last_weight: float = 3.0  # ... and of its last, the stop token (where a copy of the answer's start competes)
    # The copy circuit (builtin/copy_circuit.py; builtin/train_llama.py's AttentionProbe):
    copy_layer: int = -1  # the layer whose heads copy (negative: from the end)
    copy_heads: int = 3  # its heads that copy (heads x head_dim <= hidden - head_dim)
    induction_init: bool = True  # they start as a built induction head; else as a plain copier (init_copy_head)
    induction_sharpness: float = 4.0  # scale of the induction heads' queries
    prev_gain: float = 0.1  # scale of what layer 0's previous-token head writes (small: the token's own identity
    #                         stays the larger part of the residual, which the copy reads)
    copy_gain: float = 1.0  # scale of the copy heads' values and outputs
    freeze_circuit: bool = True  # hold the built heads fixed (Adam's steps wash a built circuit out in ~100 steps)
    learn_queries: bool = True  # ... but the induction heads' queries learn: when to copy (held too, the heads
    #                             copy wherever the current token occurred before, and answers loop)
    probe_weight: float = 1.0  # weight of the attention probe's loss (the copy heads taught where each copied
    #                            answer token sits in the prompt); 0 = off, and no circuit is built
    abstain_weight: float = 1.0  # the probe also teaches the copy heads to copy nothing (to look at the first
    #                              token) where the answer's next token is copied from nowhere: the stop token,
    #                              the JSON's punctuation (else a copy of the answer's start outvotes them)
    copy_weight: float = 1.0  # weight of the copy loss: what the copy heads alone write must name the copied token
    scale_circuit: bool = True  # the built heads follow the residual's scale as it grows (builtin/circuit_scale.py)
    flag: FlagShape | None = FlagShape(back3_head=0, far_heads=(4, 5))  # the built refusal circuit
    #                                                                     (builtin/flag_circuit.py); None: none
    code_match: float = 3.9  # > 0 (with `flag`): the copy heads match `code_context` tokens on the circuit's token
    #                          codes, at this sharpness (copy_circuit.init_code_induction); 0: one, on embeddings
    code_gain: float = 10.0  # > 0 (with code_match): the copy heads also write the copied token's code, at this gain
    code_context: int = 5  # tokens the code match compares (3 needs flag.back3_head, 5 flag.far_heads)
    chat_share: float = 0.25  # share of examples rendered through the chat template (the rest as completions)
    start_length: float = 0.1  # curriculum: filler lengths start at this fraction of the corpus' ranges ...
    full_length_at: float = 0.6  # ... and grow linearly to the full ranges by this fraction of the steps
    lane_weights: tuple[tuple[str, float], ...] = (("agent", 0.3), ("rag", 0.3), ("nightly", 0.1),
                                                   ("refusal", 0.05), ("chat", 0.25))
    seed: int = 0

    def model_config(self) -> ModelConfig:
        return ModelConfig("LlamaForCausalLM", TASK_VOCAB_SIZE, self.hidden_size, self.intermediate_size,
                           self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, rms_norm_eps=1e-6,
                           rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=True)

    def hf_config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "vocab_size": TASK_VOCAB_SIZE,
                "max_position_embeddings": self.max_position_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}, "rms_norm_eps": 1e-6,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
                "dtype": "bfloat16", "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}


TASK_SPECS: dict[str, TaskModelSpec] = {
    # Seed 0: task-v17's seeds 0-3 on an AMX Xeon, built in bf16 and in float32, all held every bar (task-v16:
    # 3 of 4 in bf16; BENCHMARKS.md, issue 14).
    "demo-task": TaskModelSpec(seed=0),
}
assert set(TASK_SPECS) == set(TASK_NAMES), "builtin/registry.py names every task model"


# -- tokenizer ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def build_task_tokenizer():
    """The byte-level BPE tokenizer every task model shares, fitted to a fixed sample of the corpus (once per
    process: it is only read after)."""
    rng = random.Random("task-tokenizer")
    texts = []
    for i in range(2000):
        session = task_corpus.session(task_corpus.LANES[i % len(task_corpus.LANES)], rng)
        texts += [session.prefix] + [e.prompt[len(session.prefix):] + e.answer for e in session.examples]
        texts += [e.answer.lstrip(" ") for e in session.examples[:1]]  # as the chat template starts an answer
    return train_bpe_tokenizer(texts, TASK_VOCAB_SIZE, DIGIT_GROUP)


def tokenizer_config(spec: TaskModelSpec) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "clean_up_tokenization_spaces": False, "model_max_length": spec.max_position_embeddings,
            "chat_template": DEMO_CHAT_TEMPLATE}


# -- training ----------------------------------------------------------------------------------------------
def bf16_matmuls() -> bool:
    """Whether this machine trains in bf16 autocast: where it is measured clearly faster than float32
    (builtin/train_dtype.py; recorded in the cache folder, so a machine decides once)."""
    return train_in_bf16(TRAIN_THREADS)


def init_weights(model: TrainLlama, seed: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers), norms one."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(2 * model.cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 * (scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0),
                          generator=gen)


def lr_at(spec: TaskModelSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    done = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


def flag_tokens(tokenizer) -> FlagTokens:
    return FlagTokens.from_tokenizer(tokenizer, task_corpus.REFUSAL_WORD, task_corpus.ANSWER_WORD, len(SPECIAL_TOKENS),
                                     task_corpus.ANSWER_CUES, task_corpus.REFUSAL_NEXT, task_corpus.ANSWER_NEXT)


def new_model(spec: TaskModelSpec, tokenizer=None) -> tuple[TrainLlama, torch.optim.Optimizer]:
    """The initialised model and its AdamW (weight decay on matrices only). The flag circuit needs `tokenizer`."""
    torch.manual_seed(spec.seed)
    model = TrainLlama(spec.model_config())
    init_weights(model, spec.seed)
    keep_out = reserved(spec.hidden_size) if spec.flag is not None else ()
    if spec.probe_weight > 0:  # the copy heads start as a circuit: an induction head on a previous-token head
        read, write = init_previous_token_head(model, spec.seed, gain=spec.prev_gain, keep_out=keep_out)
        if spec.induction_init:
            init_induction_head(model, read, write, spec.seed, spec.copy_heads, spec.induction_sharpness,
                                spec.copy_gain, copy_layer(spec), keep_out)
        else:
            init_copy_head(model, spec.seed, gain=spec.copy_gain, heads=spec.copy_heads, layer=copy_layer(spec))
        if spec.flag is not None:
            tokens = flag_tokens(tokenizer or build_task_tokenizer())
            init_flag_circuit(model, tokens, spec.flag, spec.seed)
            if spec.code_match > 0:
                init_code_induction(model, layout(spec.hidden_size), spec.copy_heads, spec.code_match,
                                    copy_layer(spec), spec.seed, spec.code_gain, spec.code_context, tokens.sinks)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": spec.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.99), eps=1e-8,
                            fused=True)  # one kernel over all tensors: a fifth of foreach's time
    return model, opt


def train_step(spec: TaskModelSpec, model: TrainLlama, opt: torch.optim.Optimizer, seqs: list[Sequence],
               bf16: bool) -> float:
    """One optimizer step on one batch of sequences; returns the loss."""
    ids, rows, targets, weights, copies, abstains = collate(seqs, spec.first_weight, spec.last_weight,
                                                            ROWS_MULTIPLE if bf16 else 1)
    probe = None
    if copies and (spec.probe_weight > 0 or spec.copy_weight > 0):
        probe = copy_probe(spec, copies, abstains)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = model(ids, probe, rows)  # only the answer positions pay for the last layer and the vocab
        logits = model.logits(hidden)
    loss = (F.cross_entropy(logits.float(), targets, reduction="none") * weights).sum()
    if probe is not None:
        loss = loss + spec.probe_weight * probe.loss
        if spec.copy_weight > 0:
            n = probe.copied
            copied = model.logits(probe.output[:n].float())
            loss = loss + spec.copy_weight * F.cross_entropy(copied, ids[probe.batch[:n], probe.query[:n] + 1])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def copy_probe(spec: TaskModelSpec, copies: tuple, abstains: tuple) -> AttentionProbe:
    """The copy heads' attention probe: each copied answer token's source, the copies' mean weighing 1, then
    (with `abstain_weight`) the first token for each answer token copied from nowhere, their mean weighing that."""
    if not (abstains and spec.abstain_weight > 0):
        abstains = ((), (), ())
    n, m = len(copies[0]), len(abstains[0])
    share = [1.0 / n] * n + [spec.abstain_weight / max(m, 1)] * m
    batch, query, key = (torch.tensor(c + a) for c, a in zip(copies, abstains))
    return AttentionProbe(copy_layer(spec), copy_heads(spec), batch, query, key, torch.tensor(share), n)


def circuit_scale(spec: TaskModelSpec, model: TrainLlama) -> CircuitScale | None:
    """The built weights that follow the residual's scale while training (builtin/circuit_scale.py)."""
    if not (spec.freeze_circuit and spec.probe_weight > 0 and spec.scale_circuit):
        return None
    scale = CircuitScale(model, spec.hidden_size - (len(reserved(spec.hidden_size)) if spec.flag else 0))
    copy_scales(spec, model, scale)
    if spec.flag is not None:
        flag_scales(model, spec.flag, scale)
    return scale


def train(spec: TaskModelSpec, tokenizer, on_step: Callable[[int, float], None] | None = None,
          bf16: bool | None = None) -> dict[str, torch.Tensor]:
    """Train a task model; returns its HF state dict in bf16. `on_step(step, loss)` after every step."""
    bf16 = bf16_matmuls() if bf16 is None else bf16
    model, opt = new_model(spec, tokenizer)
    held = circuit_slices(spec, model) if spec.freeze_circuit and spec.probe_weight > 0 else []
    if spec.flag is not None and spec.probe_weight > 0:
        held += flag_slices(model, spec.flag)
    kept = [(w, idx, w.detach()[idx].clone()) for w, idx in held]
    scale = circuit_scale(spec, model)
    # The built heads' sharp softmaxes leave probabilities and gradients below float32's normal range, which
    # x86 multiplies many times slower (a fifth of a float32 step went to them); flushed to zero, they cost nothing.
    flush = torch.set_flush_denormal(True)
    try:
        _train_loop(spec, tokenizer, model, opt, kept, scale, on_step, bf16)
    finally:
        if flush:
            torch.set_flush_denormal(False)
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.hf_state_dict().items()}


def _train_loop(spec: TaskModelSpec, tokenizer, model: TrainLlama, opt: torch.optim.Optimizer, kept: list,
                scale: CircuitScale | None, on_step: Callable[[int, float], None] | None, bf16: bool) -> None:
    for step, seqs in zip(range(spec.steps), batches(spec, tokenizer)):
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, step)
        loss = train_step(spec, model, opt, seqs, bf16)
        if scale is not None:
            level_embeddings(model.model.embed_tokens.weight, slice(1, scale.free))
        with torch.no_grad():
            for w, idx, value in kept:  # the built circuit stays as built; the rest learns to use it
                w[idx] = value
        if scale is not None:
            scale.apply()
        if on_step is not None:
            on_step(step, loss)


# -- the checkpoint ----------------------------------------------------------------------------------------
def spec_key(spec: TaskModelSpec) -> str:
    """The cache folder's suffix: everything the written bytes depend on (the thread count too: reductions
    split across threads round differently)."""
    blob = json.dumps({"spec": dataclasses.asdict(spec), "version": TASK_VERSION, "bf16": bf16_matmuls(),
                       "threads": TRAIN_THREADS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def write_task_checkpoint(path: str | Path, spec: TaskModelSpec, name: str = "task model",
                          progress: bool = True) -> Path:
    """Train `spec` and publish the checkpoint folder at `path` atomically (as the demo's)."""

    def write(tmp: Path) -> None:
        tokenizer = build_task_tokenizer()
        tokenizer.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tokenizer_config(spec))
        write_json(tmp / "config.json", spec.hf_config())
        write_json(tmp / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
        state = _train_with_progress(spec, tokenizer, name, progress)
        from safetensors.torch import save_file

        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return publish_checkpoint(path, write)


def _train_with_progress(spec: TaskModelSpec, tokenizer, name: str, progress: bool) -> dict[str, torch.Tensor]:
    """Train with a progress bar on a terminal, a line every tenth of the steps elsewhere (CI logs)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    console = Console(stderr=True)
    title = f"training {name} ({spec.model_config().num_params / 1e6:.1f}M params)"
    start = time.monotonic()
    try:
        with Progress(TextColumn(f"[bold]{title}[/bold]"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=console,
                      disable=not (progress and console.is_terminal)) as bar:
            task = bar.add_task("train", total=spec.steps, loss=float("nan"))

            def on_step(step: int, loss: float) -> None:
                bar.update(task, completed=step + 1, loss=loss)
                if progress and not console.is_terminal and (step + 1) % max(1, spec.steps // 10) == 0:
                    print(f"twospeed: {title}: step {step + 1}/{spec.steps}, loss {loss:.3f}, "
                          f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

            return train(spec, tokenizer, on_step)
    finally:
        torch.set_num_threads(threads)


def task_checkpoint_path(name: str = "demo-task", progress: bool = True) -> Path:
    """The cached checkpoint folder of built-in task model `name`, trained on first use."""
    if name not in TASK_SPECS:
        raise ValueError(f"unknown task model {name!r}; built in: {', '.join(TASK_SPECS)}")
    spec = TASK_SPECS[name]
    path = cache_root() / f"{name}-{spec_key(spec)}"
    if (path / "config.json").is_file():
        return path
    with build_lock(path):  # a second process waits for this build instead of training again
        if not (path / "config.json").is_file():
            print(f"twospeed: training the built-in model {name!r} on first use (a few minutes on 2 cores) ...",
                  file=sys.stderr, flush=True)
            start = time.monotonic()
            write_task_checkpoint(path, spec, name, progress)
            print(f"twospeed: {name!r} written to {path} ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    return path


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["demo-task"]:
        print(task_checkpoint_path(arg))
