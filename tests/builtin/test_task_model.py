"""The built-in task model (`demo-task`): trained here on the lab's lane formats, it must pass the lab's own
gate functions on held-out prompts (bf16, greedy, no grammar), reach 100% valid JSON with the grammar on,
give HF transformers' greedy tokens, and be built deterministically. The model is built once per cache
folder (the session fixture `task_model_path`; CI points TWOSPEED_CACHE at a fresh folder, so once a run).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from twospeed import LLM, SamplingParams
from twospeed.builtin import copy_circuit, flag_circuit, task_corpus, task_data, task_model
from twospeed.lab import task_prompts
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planner
from twospeed.lab.workload import BUILTIN, load_workload
from twospeed.model.llama import apply_rope

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = {"agent": 64, "rag": 64, "nightly": 32, "refusal": 48, "chat": 160}
PER_LANE = {"agent": 40, "rag": 40, "nightly": 40, "refusal": 40, "chat": 20}
# The bars on held-out prompts, unconstrained: (lane, gate) -> least pass rate
BARS = {("agent", "json"): 0.95, ("rag", "citation"): 0.90, ("nightly", "allowed_codes"): 0.95,
        ("refusal", "refusal"): 0.90, ("chat", "refusal"): 0.90}


def heldout(seed: str = "test-heldout") -> list[task_corpus.TaskExample]:
    rng = random.Random(seed)  # a string seed the training never used (it draws from "task-train-<n>")
    return [task_corpus.sample(lane, rng) for lane, n in PER_LANE.items() for _ in range(n)]


# -- the corpus and the lab's task prompts (no model) ---------------------------------------------------
def test_corpus_answers_pass_every_gate():
    """The generator's own answers are what a perfect model says: every gate passes and the content checks."""
    for ex in heldout("corpus-answers"):
        verdicts = task_prompts.judge(ex, ex.answer)
        assert all(verdicts.values()), (ex.lane, verdicts, ex.answer)


def test_refusals_name_the_forbidden_topic_and_chats_do_not():
    """The refuse-or-answer signal is lexical: the forbidden topic's word is in the rule and in the request."""
    rng = random.Random("topics")
    for lane in ("refusal", "chat") * 40:
        ex = task_corpus.sample(lane, rng)
        topic = task_corpus._forbidden(ex.prompt)
        request = ex.prompt.split("USER: ", 1)[1]
        assert (topic in request) == (lane == "refusal"), (topic, request)


def test_wrong_answers_fail():
    rng = random.Random(3)
    rag = task_corpus.sample("rag", rng)
    other = next(p for p in rag.meta["passage_ids"] if p != rag.meta["expected_id"])
    assert not task_prompts.judge(rag, rag.answer.replace(rag.meta["expected_id"], other))["correct"]
    assert not task_prompts.judge(rag, " See [P1000].")["citation"]
    agent = task_corpus.sample("agent", rng)
    assert not task_prompts.judge(agent, agent.answer[:-1])["json"]
    refusal = task_corpus.sample("refusal", rng)
    assert not task_prompts.judge(refusal, " Here is a note about the plan.")["refusal"]
    assert not task_prompts.judge(task_corpus.sample("chat", rng), refusal.answer)["refusal"]


def test_schemas_are_the_builtin_workloads():
    """The task answers follow the schemas the built-in agent and nightly lanes judge with."""
    for name, lane, schema in (("agent", "agent", task_prompts.TOOL_CALL_SCHEMA),
                               ("nightly", "nightly", task_prompts.MAPPING_SCHEMA)):
        doc = yaml.safe_load((REPO / "twospeed" / "lab" / "workloads" / f"{name}.yaml").read_text())
        assert next(x for x in doc["lanes"] if x["name"] == lane)["gate"]["schema"] == schema


def test_sessions_share_their_prefix_and_are_seeded():
    for lane in task_corpus.LANES:
        a = task_corpus.session(lane, random.Random(7), rounds=3)
        b = task_corpus.session(lane, random.Random(7), rounds=3)
        assert [e.prompt for e in a.examples] == [e.prompt for e in b.examples]
        assert all(e.prompt.startswith(a.prefix) and len(e.prompt) > len(a.prefix) for e in a.examples)


@pytest.mark.parametrize("workload", BUILTIN)
def test_every_builtin_workload_plans_task_prompts(workload):
    wl = load_workload(workload)
    planner = Planner(wl, PlanConfig(seed=1, salt="s1", prompts="task"), TokenCounter())
    plan = planner.open_loop(24, None)
    assert len(plan) == 24
    for p in plan:
        lane = wl.lane(p.lane)
        if lane.kind == "job":  # a job's calls are written by its script, not by a prompt source
            continue
        assert p.prompt.startswith("[run s1]\n") and p.meta["task_lane"] in task_corpus.LANES
        assert task_prompts.lane_gates(p.meta["task_lane"])  # the gates can judge it
        if lane.kind == "chat":
            assert "help desk. Policy:" in p.prompt and "expect_refusal" in p.meta
    # a lane's shared prefix stays byte-stable across its requests (the prefix cache needs it)
    for lane in (x for x in wl.lanes if x.kind != "job"):
        prompts = [p.prompt for p in plan if p.lane == lane.name]
        if lane.prefix_tokens and lane.prefix_reuse == 1.0 and len(prompts) > 1:
            assert all(p.startswith(planner.prefixes[lane.name]) for p in prompts)


def test_task_prompt_lengths_follow_the_lane():
    counter = TokenCounter()
    rng = __import__("numpy").random.default_rng(0)
    short = [counter.count(task_prompts.rag(rng, counter, "", 200, 1).text) for _ in range(5)]
    long = [counter.count(task_prompts.rag(rng, counter, "", 800, 1).text) for _ in range(5)]
    assert max(short) < min(long)
    prefix = task_prompts.shared_prefix("agent", rng, counter, 600)
    assert 450 <= counter.count(prefix) <= 750 and "TOOLS:\n" in prefix


# -- the trained model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_llm(task_model_path):
    return LLM(str(task_model_path), kv_cache_memory_gb=0.5)


def generate(llm: LLM, examples, structured: bool = False) -> list[str]:
    schema = {"agent": task_prompts.TOOL_CALL_SCHEMA, "nightly": task_prompts.MAPPING_SCHEMA}
    params = [SamplingParams(max_tokens=MAX_TOKENS[e.lane], temperature=0,
                             structured=schema[e.lane] if structured else None) for e in examples]
    return [o.text for o in llm.generate([e.prompt for e in examples], params)]


def pass_rates(examples, texts) -> dict[tuple[str, str], float]:
    totals: dict[tuple[str, str], list[bool]] = {}
    for e, text in zip(examples, texts):
        for gate, ok in task_prompts.judge(e, text).items():
            totals.setdefault((e.lane, gate), []).append(ok)
    return {k: sum(v) / len(v) for k, v in totals.items()}


# The bars: each lane's gate, held out, bf16, greedy, no grammar. Recipe task-v17 copies from the
# prompt with built induction heads on a five-token code match (taught to copy nothing where the answer's next
# token comes from nowhere) and refuses by a built flag circuit (builtin/flag_circuit.py).
@pytest.fixture(scope="module")
def unconstrained(task_llm) -> tuple[dict, dict]:
    """Every gate's pass rate on the held-out prompts (greedy, no grammar), and the same as a readable report."""
    examples = heldout()
    rates = pass_rates(examples, generate(task_llm, examples))
    return rates, {f"{lane}/{gate}": round(r, 3) for (lane, gate), r in sorted(rates.items())}


def test_lanes_pass_their_gates_unconstrained(unconstrained):
    """The bars hold for demo-task's build and, as measured, for the recipe: seeds 0-3 built in bf16 and in
    float32 all held them (issue 14; BENCHMARKS.md). A CPU whose kernels round differently builds other weights,
    so a miss here names a build that the recipe's margins did not cover: its numbers are the report."""
    rates, report = unconstrained
    missed = {f"{lane}/{gate}": rates[(lane, gate)] for (lane, gate), bar in BARS.items() if rates[(lane, gate)] < bar}
    assert not missed, (missed, report)


# Not met yet (issue 14): the decisions that pick content (which tool, which code) are not learnt; agent and
# nightly answers are well formed but mostly name the wrong tool or code (benchmarks/bench_task_model.py).
# strict: when a recipe learns them this XPASSes and fails, so the marker comes off.
NOT_YET = pytest.mark.xfail(strict=True, reason="demo-task's content decisions (tool, code) are not learnt (issue 14)")


@NOT_YET
def test_lanes_pick_the_right_content(unconstrained):
    """The content, not only the form: the right tool and id, the passage that holds the answer, the code."""
    rates, report = unconstrained
    for lane in ("agent", "rag", "nightly"):
        assert rates[(lane, "correct")] >= 0.8, (lane, report)


def test_grammar_makes_the_json_valid(task_llm):
    examples = [e for lane in ("agent", "nightly") for e in heldout("test-grammar") if e.lane == lane][:80]
    rates = pass_rates(examples, generate(task_llm, examples, structured=True))
    assert rates[("agent", "json_schema")] == 1.0 and rates[("nightly", "json_schema")] == 1.0


@NOT_YET
def test_chat_template_prompts_are_answered_too(task_llm):
    """Through the chat template, as the lab's chat endpoint sends a lane's prompt (one user message)."""
    rng = random.Random("test-chat-template")
    examples = [task_corpus.sample(lane, rng) for lane in ("agent", "rag", "nightly", "refusal") for _ in range(8)]
    tok = task_llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": e.prompt}]), add_special_tokens=False)
               for e in examples]
    outs = task_llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS[e.lane], temperature=0) for e in examples])
    rates = pass_rates(examples, [o.text for o in outs])
    assert min(rates[(lane, "correct")] for lane in ("agent", "rag", "nightly", "refusal")) >= 0.75, rates
    assert all(o.finish_reason == "stop" for o in outs)  # ends with <|im_end|>, an eos of this checkpoint


def test_greedy_tokens_match_transformers(task_model_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(task_model_path, dtype=torch.float32).eval()
    llm = LLM(str(task_model_path), dtype="float32", kv_cache_memory_gb=0.1)
    rng = random.Random("test-hf")
    prompts = [llm.tokenizer.encode(task_corpus.sample(lane, rng).prompt) for lane in task_corpus.LANES]
    ours = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=task_model.PAD_ID)
        assert out.token_ids == ref[0, len(ids):].tolist()


# -- the build ------------------------------------------------------------------------------------------
TINY = task_model.TaskModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=32, steps=6, batch_tokens=512, warmup_steps=2, copy_heads=1,
                                flag=None, scale_circuit=False)


def _induction_hits(spec: task_model.TaskModelSpec,
                    alphabet: int = task_model.TASK_VOCAB_SIZE - len(task_model.SPECIAL_TOKENS),
                    context: int = 1, strings: int = 1) -> float:
    """How often the copy heads, at init (at the residual's scale, as in training), look exactly where an
    induction head must: on random token strings (from `alphabet` tokens) each repeated once, from each token of
    the repeat at the token after the one earlier position whose `context` tokens before it match the query's
    last `context` tokens (the brute-force answer; positions without one such match are not counted)."""
    model, _ = task_model.new_model(spec)
    layer = model.model.layers[copy_circuit.copy_layer(spec)].self_attn
    seen = {}
    layer.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0], cos=args[1], sin=args[2]))
    scale = task_model.circuit_scale(spec, model)
    gen = torch.Generator().manual_seed(0)
    hits = []
    for n in range(strings):
        first = torch.randint(len(task_model.SPECIAL_TOKENS), len(task_model.SPECIAL_TOKENS) + alphabet, (60,),
                              generator=gen)
        ids = torch.cat((torch.tensor([task_model.BOS_ID]), first, first))[None]  # position i + 60 repeats i
        with torch.no_grad():
            model(ids)
            if scale is not None and n == 0:  # the built gains at the residual's scale, as in training
                scale.apply()
                scale.remove()
                model(ids)
            x, hd = seen["x"], spec.head_dim
            qkv = torch.nn.functional.linear(x, torch.cat((layer.q_proj.weight, layer.k_proj.weight)))
            qkv = apply_rope(qkv.view(1, ids.shape[1], -1, hd), seen["cos"], seen["sin"])
        hits += _hits(spec, qkv, ids[0].tolist(), context)
    return sum(hits) / len(hits)


def _hits(spec: task_model.TaskModelSpec, qkv: torch.Tensor, seq: list[int], context: int) -> list[bool]:
    """For each copy head and each position of the repeat with one earlier match: does its top score land there?"""
    hits = []
    for h in copy_circuit.copy_heads(spec):
        kv = spec.num_heads + h // (spec.num_heads // spec.num_kv_heads)
        scores = (qkv[0, :, h] @ qkv[0, :, kv].T).tril() + torch.full((121, 121), -1e9).triu(1)
        for i in range(61, 121):
            match = [j for j in range(context, i + 1) if seq[j - context:j] == seq[i - context + 1:i + 1]]
            if match == [i - 59]:
                hits.append(int(scores[i].argmax()) == i - 59)
    return hits


def test_built_induction_heads_find_the_earlier_copy():
    """The circuit demo-task starts from copies by content at any distance: far above chance (1/60) and above
    the same heads with random weights, before any training."""
    spec = task_model.TASK_SPECS["demo-task"]
    built = _induction_hits(spec)
    assert built >= 0.3, built
    import dataclasses

    assert _induction_hits(dataclasses.replace(spec, probe_weight=0.0)) < 0.1


def test_code_induction_matches_five_tokens():
    """The copy heads match this token and the four before it, on the flag circuit's fixed token codes: on
    strings of 4 distinct tokens (most four-token runs recur, five-token ones seldom) they find the one earlier
    position that continues this run, where a three-token match is split between the run's several
    continuations ("is owned by" in every passage of that kind)."""
    import dataclasses

    spec = task_model.TASK_SPECS["demo-task"]
    assert spec.code_context == 5 and len(spec.flag.far_heads) == 2
    assert _induction_hits(spec, alphabet=4, context=5, strings=8) >= 0.85
    assert _induction_hits(dataclasses.replace(spec, code_context=3), alphabet=4, context=5, strings=8) < 0.7


def test_copied_code_names_the_copied_token():
    """With code_gain the copy heads also write the attended token's fixed code, which the tied embeddings read:
    at init, on four rag sessions, where the answer copies a span whose two-token context is unique in the
    sequence, that output raises the copied token's logit above every other token's (the brute-force source
    from copy_sources is the reference)."""
    from twospeed.builtin.flag_circuit import layout

    tokenizer = task_model.build_task_tokenizer()
    spec = task_model.TASK_SPECS["demo-task"]
    assert spec.code_match > 0 and spec.code_gain > 0
    model, _ = task_model.new_model(spec, tokenizer)
    scale = task_model.circuit_scale(spec, model)
    o = model.model.layers[-1].self_attn.o_proj.weight
    codes = layout(spec.hidden_size)["code"]
    wins = []
    for n in range(4):
        seq = task_data.render(task_corpus.session("rag", random.Random(f"copied-code-{n}")), tokenizer, False)
        ids = torch.tensor([seq.ids])
        with torch.no_grad():
            model(ids)
            if n == 0:  # the built gains at the residual's scale, as in training
                scale.apply()
                scale.remove()
                built = o[codes].clone()
            o[codes] = built
            with_codes = model.logits(model(ids))[0]
            o[codes] = 0.0
            boost = with_codes - model.logits(model(ids))[0]
        unique = [q for q, j in seq.sources.items()
                  if [k for k in range(2, q) if seq.ids[k - 2:k] == seq.ids[q - 2:q]] == [j]]
        wins += [int(boost[q - 1].argmax()) == seq.ids[q] for q in unique]  # the prediction at q - 1 is token q
    assert len(wins) >= 20, len(wins)
    assert sum(wins) / len(wins) >= 0.9, (sum(wins), len(wins))


def test_copy_heads_looking_at_the_sink_write_nothing():
    """Where the answer's next token is no copy the probe teaches the copy heads to look at the sequence's first
    token, a special one: what they copy from there must raise no token's logit. With the sinks' random codes
    they raised the stop token's wherever those codes happened to align (a seed-1 build stopped at `"code": "`
    on most nightly rows; zeroing the copy heads' output took the stop token there from 0.14-0.20 to 0.00)."""
    from twospeed.builtin.flag_circuit import layout

    spec = task_model.TASK_SPECS["demo-task"]
    model, _ = task_model.new_model(spec, task_model.build_task_tokenizer())
    scale = task_model.circuit_scale(spec, model)
    o = model.model.layers[-1].self_attn.o_proj.weight
    codes = layout(spec.hidden_size)["code"]
    with torch.no_grad():
        model(torch.tensor([[task_data.BOS_ID]]))
        scale.apply()  # the built gains at the residual's scale, as in training
        scale.remove()
        for sink in range(len(task_data.SPECIAL_TOKENS)):
            ids = torch.tensor([[sink]])  # one token: every head can only look at the sink
            built = o[codes].clone()
            with_codes = model.logits(model(ids))[0, 0]
            o[codes] = 0.0
            boost = with_codes - model.logits(model(ids))[0, 0]
            o[codes] = built
            assert boost.abs().max() < 1e-4 * with_codes.abs().max(), (sink, boost.abs().max())


def test_probe_output_is_what_the_copy_heads_write():
    """AttentionProbe.output (the copy loss' input) is the copy heads' share of the attention output: the output
    minus the output with those heads' o_proj columns zeroed."""
    import dataclasses

    spec = dataclasses.replace(TINY, num_kv_heads=2)
    model, _ = task_model.new_model(spec)
    attn = model.model.layers[copy_circuit.copy_layer(spec)].self_attn
    outs = []
    attn.register_forward_hook(lambda mod, args, out: outs.append(out))
    ids = torch.randint(5, task_model.TASK_VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(1))
    probe = task_model.AttentionProbe(copy_circuit.copy_layer(spec), copy_circuit.copy_heads(spec),
                                      torch.tensor([0, 1, 1]), torch.tensor([5, 9, 23]), torch.tensor([2, 3, 4]))
    with torch.no_grad():
        model(ids, probe)
        for h in probe.heads:
            attn.o_proj.weight[:, h * spec.head_dim:(h + 1) * spec.head_dim] = 0
        model(ids)
    share = (outs[0] - outs[1])[probe.batch, probe.query]
    torch.testing.assert_close(probe.output, share, atol=1e-5, rtol=1e-4)


def test_probe_loss_weighs_each_target_by_its_share():
    """probe_loss against a spelled-out softmax: -sum(share x log attention at the target), over the causal
    prefix, averaged over the probed heads; equal shares give the plain mean."""
    from twospeed.builtin.train_llama import probe_loss

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
    batch, query, target = torch.tensor([0, 1, 1, 0]), torch.tensor([4, 9, 2, 7]), torch.tensor([1, 0, 2, 7])
    share = torch.tensor([0.1, 0.2, 0.3, 0.4])
    ref = 0.0
    for head in (0, 1):
        for b, i, j, w in zip(batch, query, target, share):
            scores = q[b, head, i] @ k[b, head, :i + 1].T / 8 ** 0.5
            ref -= w * scores.log_softmax(-1)[j] / 2
    probe = task_model.AttentionProbe(0, (0, 1), batch, query, target, share)
    torch.testing.assert_close(probe_loss(q, k, probe), ref)
    alike = task_model.AttentionProbe(0, (0, 1), batch, query, target)
    even = task_model.AttentionProbe(0, (0, 1), batch, query, target, torch.full((4,), 0.25))
    torch.testing.assert_close(probe_loss(q, k, alike), probe_loss(q, k, even))


@pytest.mark.parametrize("name", ["demo-task", "tiny"])
def test_last_layer_at_the_loss_rows_is_the_full_model_there(name):
    """forward(ids, probe, rows) runs the last layer at `rows` only: its hidden states, probe loss, probe output
    and every gradient equal the full forward's read at those rows (the reference), for demo-task's shape and a
    tiny one with grouped kv heads; a probed query outside the rows is refused."""
    spec = task_model.TASK_SPECS["demo-task"] if name == "demo-task" else TINY
    tokenizer = task_model.build_task_tokenizer()
    # the first step of the stream whose answer rows are under half its tokens (the trimmed path must skip some)
    for step in itertools.islice(task_data.batches(spec, tokenizer), 64):  # bounded: the stream never ends
        ids, rows, targets, weights, copies, abstains = task_data.collate(step, spec.first_weight, spec.last_weight)
        if len(rows) < ids.numel() / 2 and len(step) > 1:
            break
    else:
        pytest.fail("no step in the first 64 has answer rows under half its tokens")
    model, _ = task_model.new_model(spec, tokenizer)
    results = []
    for trimmed in (False, True):
        probe = task_model.copy_probe(spec, copies, abstains)
        model.zero_grad()
        hidden = model(ids, probe, rows) if trimmed else model(ids, probe).flatten(0, 1)[rows]
        loss = (torch.nn.functional.cross_entropy(model.logits(hidden), targets, reduction="none") * weights).sum()
        (loss + probe.loss + probe.output.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((hidden.detach(), probe.loss.detach(), probe.output.detach(), grads))
    (full, full_probe, full_out, full_grads), (ours, our_probe, our_out, our_grads) = results
    torch.testing.assert_close(ours, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_probe, full_probe, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_out, full_out, atol=1e-4, rtol=1e-4)
    total = torch.cat([g.flatten() for g in full_grads.values()]).norm()
    for name, grad in full_grads.items():  # each within 0.1% of its norm, or of 1e-5 of the whole gradient's
        #                                    (layer 0's built q and k get ~1e-6 of it: rounding noise)
        assert (our_grads[name] - grad).norm() <= 1e-3 * grad.norm() + 1e-5 * total, name
    stray = task_model.AttentionProbe(copy_circuit.copy_layer(spec), (0,), torch.tensor([0]), torch.tensor([0]),
                                      torch.tensor([0]))
    with pytest.raises(ValueError, match="rows"):
        model(ids, stray, rows)


def test_answer_rows_are_padded_to_few_shapes():
    """collate pads the answer rows to a multiple of `rows_multiple` (bf16 training: a product's kernel is built
    per shape) with copies of the last row that weigh 0: the rows before them are every answer token's, in
    order (the reference: each answer's positions recomputed here), and the loss they weigh still sums to 1.
    With 1 (float32 training) nothing is padded."""
    spec = task_model.TASK_SPECS["demo-task"]
    stream = task_data.batches(spec, task_model.build_task_tokenizer())
    for _ in range(5):
        step = next(stream)
        ids, rows, targets, weights, *_ = task_data.collate(step, spec.first_weight, spec.last_weight,
                                                            task_data.ROWS_MULTIPLE)
        t = ids.shape[1]
        real = [i * t + p - 1 for i, s in enumerate(step) for start, end in s.answers for p in range(start, end)]
        n = len(real)
        assert len(rows) % task_data.ROWS_MULTIPLE == 0 and 0 <= len(rows) - n < task_data.ROWS_MULTIPLE
        assert rows[:n].tolist() == real and (rows[n:] == rows[n - 1]).all()
        assert targets[:n].tolist() == [ids.flatten()[r + 1].item() for r in real]
        assert (weights[n:] == 0).all() and (weights[:n] > 0).all()
        torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
        assert len(task_data.collate(step, spec.first_weight, spec.last_weight)[1]) == n
    model, _ = task_model.new_model(spec)
    grads = []
    for multiple in (1, task_data.ROWS_MULTIPLE):  # the copies change neither the loss nor its gradient
        ids, rows, targets, weights, *_ = task_data.collate(step, spec.first_weight, spec.last_weight, multiple)
        model.zero_grad()
        logits = model.logits(model(ids, None, rows))
        (torch.nn.functional.cross_entropy(logits, targets, reduction="none") * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-7, rtol=1e-4)


def test_a_copy_is_at_least_two_tokens_and_the_longest_latest():
    """copy_sources against hand-worked sequences: a lone shared token (" the", "." in a note) is no copy, the
    longest match wins, a tie goes to the latest occurrence, and a copy runs on while its source does."""
    prompt = [0, 7, 8, 9, 3, 7, 8, 5, 6, 2]
    # answer [7, 8, 5, 6, 4]: "7 8 5 6" is at 5..8 (4 tokens), "7 8" alone at 1; 4 is nowhere
    ids = prompt + [7, 8, 5, 6, 4]
    assert task_data.copy_sources(ids, [(10, 15)]) == {10: 5, 11: 6, 12: 7, 13: 8}
    # answer [9, 2]: each occurs once, but never followed by the other: no copy
    assert task_data.copy_sources(prompt + [9, 2], [(10, 12)]) == {}
    # answer [7, 8, 1]: "7 8" twice, equally long: the latest
    assert task_data.copy_sources(prompt + [7, 8, 1], [(10, 13)]) == {10: 5, 11: 6}


def test_every_answer_token_is_copied_or_abstains():
    """collate splits the answer tokens: each copied one probes its source, each other one the sequence's first
    token (a special token, where the copy heads copy nothing); copy_probe weighs the two groups' means as
    1 : abstain_weight and marks how many lead as copies (the copy loss reads only those)."""
    spec = task_model.TASK_SPECS["demo-task"]
    step = next(task_data.batches(spec, task_model.build_task_tokenizer()))
    ids, *_, copies, abstains = task_data.collate(step)
    copied, away = set(zip(*copies)), set(zip(*abstains))
    assert not copied & away
    for i, s in enumerate(step):
        answer = {q - 1 for start, end in s.answers for q in range(start, end)}
        assert {p for b, p, _ in copied | away if b == i} == answer
        assert all(s.sources[p + 1] == j for b, p, j in copied if b == i)
    assert all(j == 0 for _, _, j in away) and all(ids[:, 0] < len(task_data.SPECIAL_TOKENS))
    probe = task_model.copy_probe(spec, copies, abstains)
    n = probe.copied
    assert n == len(copies[0]) and len(probe.target) == n + len(abstains[0])
    torch.testing.assert_close(probe.weight[:n].sum(), torch.tensor(1.0))
    torch.testing.assert_close(probe.weight[n:].sum(), torch.tensor(spec.abstain_weight))


@pytest.mark.parametrize("chat", [False, True])
def test_agent_ids_are_copied_whole_from_the_request(chat):
    """The call's id is a copy of the request's id, prefix included: the evidence writes it after '#', so its
    tokens are the ones the JSON string holds ('ORD', not ' ORD'), and copy_sources points every one of them
    at the request's id, never at the distractor's (task-v14 wrote the prefix from the picked tool). A session's
    first call only: in a later one the prefix may continue a copy of an earlier call with the same prefix.
    Nor does the tool tell the prefix: each tool's ids come in several schemes (task-v16 learnt the picked
    tool's one and wrote it over the copy)."""
    tokenizer = task_model.build_task_tokenizer()
    rng = random.Random("test-agent-ids")
    prefixes = collections.defaultdict(set)
    for _ in range(120):
        s = task_corpus.session("agent", rng, rounds=1)
        seq = task_data.render(s, tokenizer, chat)
        for ex, (start, end) in zip(s.examples, seq.answers):
            ident = ex.meta["expected"]["arguments"]["id"]
            id_ids = tokenizer.encode(ident, add_special_tokens=False).ids
            answer = seq.ids[start:end]
            at = next(i for i in range(len(answer)) if answer[i:i + len(id_ids)] == id_ids)
            sources = [seq.sources.get(start + at + k) for k in range(len(id_ids))]
            assert None not in sources, (ident, sources)
            copied = tokenizer.decode(seq.ids[sources[0] - 1:sources[-1] + 1])
            assert copied.lstrip() == "#" + ident  # the request's id (the distractor's digits differ)
            assert sources == list(range(sources[0], sources[0] + len(id_ids)))  # one span
            prefixes[ex.meta["expected"]["tool"]].add(ident.split("-")[0])
    assert len(prefixes) == len(task_corpus.TOOLS) and all(len(p) >= 2 for p in prefixes.values()), prefixes


@pytest.mark.task_model  # trains a tiny spec
def test_frozen_circuit_stays_as_built():
    """With freeze_circuit the built heads leave training as they went in; the weights around them learn.
    Denormal floats flush to zero while it trains, and the setting is restored after."""
    model, _ = task_model.new_model(TINY)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    denormal = lambda: float(torch.tensor([1e-20]) * torch.tensor([1e-20]))  # noqa: E731  1e-40, a denormal
    flushes = torch.set_flush_denormal(False)  # whether this CPU can flush (x86 can); off, as a process starts
    during = []
    after = task_model.train(TINY, task_model.build_task_tokenizer(), lambda step, loss: during.append(denormal()),
                             bf16=False)
    assert set(during) == ({0.0} if flushes else {denormal()}) and denormal() > 0  # flushed while training only
    names = {id(p): n for n, p in model.named_parameters()}
    for weight, index in copy_circuit.circuit_slices(TINY, model):
        name = names[id(weight)]
        torch.testing.assert_close(after[name][index], before[name][index].to(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(after["model.layers.0.mlp.down_proj.weight"],
                           before["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16))


def _hash(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.task_model  # trains a tiny spec three times
def test_build_is_deterministic(tmp_path):
    """Same spec and seed -> the same bytes, in this process and in a fresh one (new hash seeds, new thread
    pools); another seed -> other weights. A tiny spec: the recipe is the same code path as demo-task's."""
    a = task_model.write_task_checkpoint(tmp_path / "a", TINY, progress=False)
    code = ("import sys; from twospeed.builtin import task_model as tm; from tests.test_task_model import TINY; "
            "tm.write_task_checkpoint(sys.argv[1], TINY, progress=False)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], env=env, check=True, timeout=300, cwd=REPO)
    assert _hash(a) == _hash(tmp_path / "b")
    import dataclasses

    c = task_model.write_task_checkpoint(tmp_path / "c", dataclasses.replace(TINY, seed=1), progress=False)
    assert _hash(c)["model.safetensors"] != _hash(a)["model.safetensors"]
    assert _hash(c)["tokenizer.json"] == _hash(a)["tokenizer.json"]  # one tokenizer for every task model


def test_checkpoint_is_a_real_hf_folder(task_model_path):
    cfg = json.loads((task_model_path / "config.json").read_text())
    assert cfg == task_model.TASK_SPECS["demo-task"].hf_config()
    from safetensors import safe_open

    with safe_open(task_model_path / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in f.keys()  # tied
    params = task_model.TASK_SPECS["demo-task"].model_config().num_params
    assert 3e6 <= params <= 30e6
    assert (task_model_path / "tokenizer.json").read_text() == task_model.build_task_tokenizer().to_str(pretty=True)


def test_training_model_is_hf_llama():
    """The training-mode Llama (builtin/train_llama.py) computes what HF's LlamaForCausalLM computes with the same
    tensors (so what it learns is what the serving model runs), and its state dict is the HF one."""
    transformers = pytest.importorskip("transformers")
    model = task_model.TrainLlama(TINY.model_config())
    task_model.init_weights(model, seed=3)
    read, write = copy_circuit.init_previous_token_head(model, seed=3)
    copy_circuit.init_induction_head(model, read, write, seed=3, heads=1, sharpness=4.0)  # and TINY's rope_theta
    cfg = transformers.LlamaConfig(**{k: v for k, v in TINY.hf_config().items() if k not in ("architectures", "dtype")})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied
    ids = torch.randint(0, task_model.TASK_VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(model(ids))
        ref = hf(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# -- the refusal circuit (builtin/flag_circuit.py) -------------------------------------------------------------
# Small enough to train in seconds, large enough for the circuits: 235 reserved coordinates beside 128 learnt (the
# copy heads' bases need two head_dims of them), 19 slow RoPE planes.
TINY_FLAG = task_model.TaskModelSpec(hidden_size=363, intermediate_size=128, num_layers=2, num_heads=6,
                                     num_kv_heads=6, head_dim=64, steps=6, batch_tokens=512, warmup_steps=2,
                                     copy_heads=1, scale_circuit=False)


def _lever(model, tokenizer, prompt: str) -> float:
    """LEVER after the final norm at the prompt's last position: what leans the first token to a refusal."""
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        hidden = model(ids)
    return hidden[0, -1, flag_circuit.layout(model.cfg.hidden_size)["lever"][0]].item()


def test_flag_circuit_finds_the_forbidden_topic_before_training():
    """Built, untrained: where the answer starts the lever is up on requests for the forbidden topic and down on
    every other request to the same kind of desk (notes, other topics), the corpus' own labels being the
    reference; before that token (no cue yet) a request that names no forbidden topic leaves it at zero."""
    tokenizer = task_model.build_task_tokenizer()
    spec = task_model.TASK_SPECS["demo-task"]
    model, _ = task_model.new_model(spec, tokenizer)
    rng = random.Random("flag-circuit")
    scale = task_model.circuit_scale(spec, model)  # the built gains at the residual's scale, as in training
    _lever(model, tokenizer, task_corpus.sample("refusal", rng).prompt)
    scale.apply()
    scale.remove()
    refused = [_lever(model, tokenizer, task_corpus.sample("refusal", rng).prompt) for _ in range(30)]
    chats = [task_corpus.sample("chat", rng).prompt for _ in range(30)]
    answered = [_lever(model, tokenizer, p) for p in chats]
    assert min(refused) > 0.02, sorted(refused)
    assert sorted(answered)[-2] < -0.02, (sorted(refused), sorted(answered))  # a chance match may flag a word
    before_cue = [_lever(model, tokenizer, p[:-len("ASSISTANT:")]) for p in chats]
    assert sorted(abs(x) for x in before_cue)[-2] < 0.5 * min(refused), (min(refused), sorted(before_cue)[-4:])


def _second_token_leans(model, tokenizer, prompts: list[str], first: str) -> list[float]:
    """logit(refusal's second token) - logit(answer's second token) after each prompt + `first`."""
    tokens = task_model.flag_tokens(tokenizer)
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt + first).ids])
        with torch.no_grad():
            logits = model.logits(model(ids)[0, -1])
        out.append((logits[tokens.refuse_next[0]] - logits[tokens.answer_next[0]]).item())
    return out


def test_the_first_words_decision_carries_to_the_second_token():
    """Built, untrained: after a refusal's first word the refusal's second token (",") gains on the answer's
    (" is") by several logits, and after an answer's first word it loses as much, against the same model without
    the carry; at every other position the carry changes nothing (the tokens' own LEVER entry is zero there).
    A build whose learnt layers leant to answering wrote "Sorry is a short brief ..." without it."""
    import dataclasses

    tokenizer = task_model.build_task_tokenizer()
    spec = task_model.TASK_SPECS["demo-task"]
    rng = random.Random("carry")
    refusals = [task_corpus.sample("refusal", rng).prompt for _ in range(6)]
    chats = [task_corpus.sample("chat", rng).prompt for _ in range(6)]
    models = []
    for carry in (spec.flag.carry, 0.0):
        variant = dataclasses.replace(spec, flag=dataclasses.replace(spec.flag, carry=carry))
        model, _ = task_model.new_model(variant, tokenizer)
        scale = task_model.circuit_scale(variant, model)
        model(torch.tensor([tokenizer.encode(refusals[0]).ids]))
        scale.apply()
        scale.remove()
        models.append(model)
    lean = {first: [a - b for a, b in zip(*(_second_token_leans(m, tokenizer, prompts, first) for m in models))]
            for first, prompts in ((" Sorry", refusals), (" Here", chats))}
    assert min(lean[" Sorry"]) > 3.0, lean
    assert max(lean[" Here"]) < -3.0, lean
    ids = torch.tensor([tokenizer.encode(chats[0]).ids])  # no first word in it: the same logits everywhere
    with torch.no_grad():
        torch.testing.assert_close(models[0].logits(models[0](ids)), models[1].logits(models[1](ids)))


def _flag_shares(model, spec, ids: torch.Tensor, at: int, stretch: dict[int, float]) -> torch.Tensor:
    """The flag head's attention from position `at`, with the learnt part of the residual at the positions in
    `stretch` scaled by their factors where the flag layer reads it (as a build's learnt part differs there)."""
    layer = model.model.layers[spec.flag.flag_layer]
    free = spec.hidden_size - len(flag_circuit.reserved(spec.hidden_size))
    seen = {}

    def hook(module, args):
        x = args[0].clone()
        for pos, factor in stretch.items():
            x[:, pos, :free] *= factor
        seen.update(x=module.input_layernorm(x), cos=args[1], sin=args[2])

    handle = layer.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(ids)
    handle.remove()
    hd, h = spec.head_dim, spec.flag.flag_head
    attn = layer.self_attn
    q = torch.nn.functional.linear(seen["x"], attn.q_proj.weight[h * hd:(h + 1) * hd])
    k = torch.nn.functional.linear(seen["x"], attn.k_proj.weight[h * hd:(h + 1) * hd])
    q, k = (apply_rope(t.view(1, ids.shape[1], 1, hd), seen["cos"], seen["sin"])[0, :, 0] for t in (q, k))
    return torch.softmax(q[at] @ k[:at + 1].T / hd ** 0.5, dim=-1)


def test_the_flag_holds_whatever_the_learnt_scale_at_the_rule_and_the_anchor():
    """Built, untrained: from the request's topic word the flag head looks at the rule's ';' and from a chat's
    words at no ';', with the learnt part of the residual at the ';', at the anchor (position 1) or at the
    word halved or doubled, as it differs between positions in a trained build (0.9-1.5x measured). The
    threshold and the match are read after the same position's norm, and the anchor scores ~0 at any norm."""
    tokenizer = task_model.build_task_tokenizer()
    spec = task_model.TASK_SPECS["demo-task"]
    model, _ = task_model.new_model(spec, tokenizer)
    rng = random.Random("flag-stretch")
    scale = task_model.circuit_scale(spec, model)
    model(torch.tensor([tokenizer.encode(task_corpus.sample("refusal", rng).prompt).ids]))
    scale.apply()
    scale.remove()
    semi = tokenizer.token_to_id(";")
    for _ in range(4):
        ids = tokenizer.encode(task_corpus.sample("refusal", rng).prompt).ids
        rule = ids.index(semi)
        word = max(i for i, t in enumerate(ids) if t == ids[rule - 1] and i > rule)  # the request names it
        for stretch in ({}, {rule: 0.5, 1: 2.0}, {rule: 2.0, 1: 0.5}, {word: 2.0}):
            shares = _flag_shares(model, spec, torch.tensor([ids]), word, stretch)
            assert shares[rule] > 0.9, (stretch, shares[rule].item(), shares[:2].sum().item())
        chat = tokenizer.encode(task_corpus.sample("chat", rng).prompt).ids
        marks = [i for i, t in enumerate(chat) if t == semi]
        for stretch in ({}, {1: 0.5, **{m: 2.0 for m in marks}}):
            for at in range(len(chat) - 12, len(chat)):  # the request's words
                assert _flag_shares(model, spec, torch.tensor([chat]), at, stretch)[marks].sum() < 0.1


def test_flag_tokens_are_whole_words():
    """The lever's first tokens are the refusal's and the note's own words, with and without the space (a
    completion's answer starts with one, a chat answer without), and ';' is the one rule mark."""
    tokenizer = task_model.build_task_tokenizer()
    tokens = task_model.flag_tokens(tokenizer)
    assert [tokenizer.decode([i]).strip() for i in tokens.refuse] == [task_corpus.REFUSAL_WORD] * 2
    assert [tokenizer.decode([i]).strip() for i in tokens.answer] == [task_corpus.ANSWER_WORD] * 2
    assert [tokenizer.decode([i]) for i in tokens.marks] == [";"]
    assert sorted(tokenizer.decode([i]) for i in tokens.cues) == ["ASSISTANT", "ant"]  # "assistant" is as+sist+ant
    assert [tokenizer.decode([i]) for i in tokens.refuse_next + tokens.answer_next] == [
        task_corpus.REFUSAL_NEXT, task_corpus.ANSWER_NEXT]


def test_a_residual_too_narrow_for_the_copy_bases_is_refused():
    """One learnt coordinate short of the copy heads' bases: a clear error, not a basis that spills into the
    reserved coordinates (QR would fill the missing direction from them)."""
    import dataclasses

    narrow = dataclasses.replace(TINY_FLAG, hidden_size=TINY_FLAG.hidden_size - 1)
    with pytest.raises(ValueError, match="free coordinates"):
        task_model.new_model(narrow, task_model.build_task_tokenizer())


@pytest.mark.task_model  # trains a tiny spec
def test_flag_circuit_stays_as_built():
    """Training moves the weights around the refusal circuit, not the circuit: its heads and every reserved
    coordinate leave as they went in."""
    tokenizer = task_model.build_task_tokenizer()
    model, _ = task_model.new_model(TINY_FLAG, tokenizer)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    after = task_model.train(TINY_FLAG, tokenizer, bf16=False)
    names = {id(p): n for n, p in model.named_parameters()}
    slices = flag_circuit.flag_slices(model, TINY_FLAG.flag)
    for weight, index in slices:
        name = names[id(weight)]
        torch.testing.assert_close(after[name][index], before[name][index].to(torch.bfloat16), atol=0, rtol=0)
    reserved = list(flag_circuit.reserved(TINY_FLAG.hidden_size))
    for layer in range(TINY_FLAG.num_layers):  # what learns still writes nothing there
        assert not after[f"model.layers.{layer}.mlp.down_proj.weight"][reserved].any()
    assert not torch.equal(after["model.layers.1.mlp.down_proj.weight"],
                           before["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16))


def test_circuit_scale_follows_the_residual():
    """CircuitScale: a relative entry moves by the measured RMS ratio since the first step, an absolute one to
    the RMS itself; the reference is the RMS computed here from the same forward pass."""
    from twospeed.builtin.circuit_scale import CircuitScale

    model = task_model.TrainLlama(TINY.model_config())
    task_model.init_weights(model, seed=3)
    seen = {}
    model.model.layers[1].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach()))
    scale = CircuitScale(model, free=TINY.hidden_size)
    o = model.model.layers[0].self_attn.o_proj.weight
    base = o.detach().clone()
    scale.add(o, (slice(None), slice(0, 8)), 1)
    scale.add(o, (0, 9), 1, absolute=True)
    ids = torch.randint(5, task_model.TASK_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        first = seen["x"].pow(2).mean().sqrt()
        model.model.embed_tokens.weight.mul_(3.0)  # the residual grows
        model(ids)
        now = seen["x"].pow(2).mean().sqrt()
    scale.apply()
    torch.testing.assert_close(o[:, :8], base[:, :8] * (now / first))
    torch.testing.assert_close(o[0, 9], base[0, 9] * now)
    torch.testing.assert_close(o[:, 8], base[:, 8])  # nothing else moves


def test_circuit_scale_sees_every_layer_in_a_train_step():
    """train_step runs the last layer at the loss rows only; the scale's hooks still measure every layer's input
    over all positions and the final norm's at the loss rows (where the logits read it), so `apply` moves the
    held weights. The reference: the RMS recomputed here from the same inputs."""
    import dataclasses

    spec = dataclasses.replace(TINY, scale_circuit=True)
    tokenizer = task_model.build_task_tokenizer()
    model, opt = task_model.new_model(spec, tokenizer)
    scale = task_model.circuit_scale(spec, model)
    seen = {}
    for i, module in enumerate([*model.model.layers, model.model.norm]):
        module.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach()))
    step = next(task_data.batches(spec, tokenizer))
    task_model.train_step(spec, model, opt, step, bf16=False)
    ids, rows, *_ = task_data.collate(step)
    assert len(scale.first) == len(scale.rms) == len(model.model.layers) + 1
    for i, x in seen.items():
        assert x.shape[:-1] == (ids.shape if i < len(model.model.layers) else rows.shape)
        assert scale.rms[i] == pytest.approx(float(x[..., :scale.free].pow(2).mean().sqrt()), rel=1e-5)
