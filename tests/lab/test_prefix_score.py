"""prefix-score: hand-made prompt sequences, brute-force prefixes, the real block manager, the real engine."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed import LLM, SamplingParams
from twospeed.cli import main
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.lab.prefix_score import (
    RenderedPrompt, common_prefix_len, load_tokenizer, read_prompts, render, score_prompts,
)
from twospeed.builtin.demo import demo_checkpoint_path

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} things",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for name in ("search", "calc", "fetch")]
RULES = "Answer with one tool call. Cite passage ids. Never guess. " * 6


def chat(system: str, user: str, tools=TOOLS, history=()) -> dict:
    return {"messages": [{"role": "system", "content": system}, *history, {"role": "user", "content": user}],
            "tools": tools}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def kv_manager_hits(prompts: list[list[int]], block_size: int) -> list[int]:
    """What twospeed's block manager bills: each prompt admitted, prefilled, freed, in turn (no eviction)."""
    kv = KVCacheManager(sum(len(p) // block_size + 1 for p in prompts), block_size)
    hits = []
    for i, ids in enumerate(prompts):
        blocks = kv.find_cached_prefix(ids)
        assert kv.allocate_slots(f"r{i}", len(ids), blocks)
        kv.cache_full_blocks(f"r{i}", ids, len(ids))
        kv.free(f"r{i}")
        hits.append(len(blocks) * block_size)
    return hits


def brute_lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_against_brute_force(prompts: list[RenderedPrompt], block_size: int):
    report = score_prompts(prompts, block_size)
    for i, s in enumerate(report.prompts):
        data = prompts[i].text.encode()
        earlier = prompts[:i]
        assert s.byte_stable == max((brute_lcp(data, p.text.encode()) for p in earlier), default=0)
        assert s.token_stable == max((brute_lcp(prompts[i].token_ids, p.token_ids) for p in earlier), default=0)
        if s.closest is not None:
            assert brute_lcp(data, prompts[s.closest].text.encode()) == s.byte_stable
        # the block-aligned hit can never exceed the token-stable prefix, nor reach the last token
        assert s.cached_tokens <= min(s.token_stable, s.prompt_tokens - 1) and s.cached_tokens % block_size == 0
    assert [s.cached_tokens for s in report.prompts] == kv_manager_hits([p.token_ids for p in prompts], block_size)
    return report


# -- hand-made sequences -------------------------------------------------------------------------------
def test_append_only_conversation(tok):
    history, records = [], []
    for turn in range(4):
        records.append(chat(RULES, f"question {turn}: what is in passage {turn * 7}?", history=list(history)))
        history += [records[-1]["messages"][-1], {"role": "assistant", "content": f"passage {turn * 7} says yes"}]
    prompts = [render(r, tok) for r in records]
    report = check_against_brute_force(prompts, 16)
    for i, s in enumerate(report.prompts[1:], 1):
        assert s.closest == i - 1 and s.extends_closest and s.divergence is None
        assert s.byte_stable == len(prompts[i - 1].text.encode())
    assert report.prompts[-1].hit_rate > 0.8


def test_timestamp_in_the_system_prompt(tok):
    stamps = ["2026-11-30 10:31:05", "2026-11-30 10:32:17", "2026-11-30 10:40:59"]
    first = [render(chat(f"Now: {t}. {RULES}", f"question {i}"), tok) for i, t in enumerate(stamps)]
    last = [render(chat(RULES, f"question {i} (now: {t})"), tok) for i, t in enumerate(stamps)]
    bad, good = check_against_brute_force(first, 16), check_against_brute_force(last, 16)
    d = bad.prompts[1].divergence
    assert d is not None and d.context.endswith("10:3") and d.before.startswith("1") and d.after.startswith("2")
    assert bad.prompts[1].byte_stable == first[0].text.index("10:31") + 4
    assert bad.prompts[2].divergence.before.startswith("32:17") and bad.prompts[2].divergence.after.startswith("40:59")
    assert bad.hit_rate < 0.1 < 0.5 < good.hit_rate  # moving the timestamp last keeps the whole prefix
    assert good.prompts[1].divergence.context.endswith("question ")


def test_reordered_tools(tok):
    prompts = [render(chat(RULES, "q1", TOOLS), tok), render(chat(RULES, "q1", [TOOLS[1], TOOLS[0], TOOLS[2]]), tok)]
    report = check_against_brute_force(prompts, 16)
    d = report.prompts[1].divergence
    assert d.context.endswith('"name": "') and d.before.startswith("search") and d.after.startswith("calc")
    assert report.prompts[1].cached_tokens < report.prompts[1].prompt_tokens / 2


def test_block_alignment_edge_cases():
    def p(ids):
        return RenderedPrompt(" ".join(map(str, ids)), list(ids))

    a = list(range(100, 108))  # 8 tokens = exactly 2 blocks of 4
    cases = [
        (a, 0),                         # first
        (a, 4),                         # identical: the last token is always computed, so 1 block, not 2
        (a + [1], 8),                   # one more token: both blocks
        (a[:7] + [2, 3], 4),            # shares 7 tokens: 1 whole block
        (a[:3] + [4] * 6, 0),           # shares 3: no whole block
        (a[:6], 4),                     # a prefix of an earlier prompt: its first block
        ([5] * 4, 0),                   # one block, never a hit for itself (len - 1 tokens at most)
        ([5] * 4, 0),
        ([5] * 5, 4),
        (a[:4] + [5] * 5, 4),           # block 2 of this differs from every earlier block 2 (chained hash)
    ]
    prompts = [p(ids) for ids, _ in cases]
    report = check_against_brute_force(prompts, 4)
    assert [s.cached_tokens for s in report.prompts] == [hit for _, hit in cases]
    one = check_against_brute_force([p([1, 2, 3]), p([1, 2, 3]), p([1, 2, 9])], 1)
    assert [s.cached_tokens for s in one.prompts] == [0, 2, 2]
    with pytest.raises(ValueError, match="block_size"):
        score_prompts(prompts, 0)


def test_multibyte_divergence():
    prompts = [RenderedPrompt("café au lait", [1]), RenderedPrompt("cafè au lait", [1])]
    s = score_prompts(prompts, 16).prompts[1]
    assert s.byte_stable == 4  # "caf" + the lead byte both accents share
    assert (s.divergence.char_offset, s.divergence.before, s.divergence.after) == (3, "é", "è")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 3), max_size=12)), min_size=1, max_size=8),
       st.sampled_from([1, 2, 3, 4]))
def test_random_sequences_against_brute_force_and_the_block_manager(specs, block_size):
    """Prompts built by cutting an earlier prompt and appending: many shared prefixes of every length."""
    seqs: list[list[int]] = []
    for parent, tail in specs:
        base = seqs[parent % len(seqs)] if seqs else []
        cut = len(base) * (parent + 1) // 5
        seqs.append(base[:cut] + tail or [7])
    prompts = [RenderedPrompt("".join(chr(0x61 + t) if t < 3 else "é" for t in ids), ids) for ids in seqs]
    check_against_brute_force(prompts, block_size)


def test_common_prefix_len():
    for a, b in [("", ""), ("a", ""), ("abc", "abd"), ("abc", "abc"), ("abc", "abcde"), ((1, 2), (1, 3))]:
        assert common_prefix_len(a, b) == brute_lcp(a, b)


# -- the real engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 8])
def test_agrees_with_the_engines_cached_tokens(tok, block_size):
    """Each prompt sent in turn to the demo model: the engine's bill has exactly the predicted cached tokens."""
    history = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    records = [chat(RULES, "q0"), chat(RULES, "q1", history=history), chat("Now: 10:31. " + RULES, "q2"),
               chat("Now: 10:32. " + RULES, "q2"), chat(RULES, "q1", TOOLS[::-1], history),
               {"prompt": RULES + "plain completion"}, {"prompt": RULES + "plain completion, longer"},
               {"prompt": RULES[:40]}]
    prompts = [render(r, tok) for r in records]
    report = score_prompts(prompts, block_size)
    assert report.cached_tokens > 0
    llm = LLM("demo", block_size=block_size, num_gpu_blocks=256)
    billed = []
    for r, p in zip(records, prompts):
        # completion prompts go in as text (the engine encodes them), chats as the rendered ids (as the server does)
        out, = llm.generate([r["prompt"] if "prompt" in r else p.token_ids], SamplingParams(max_tokens=1))
        assert out.prompt_token_ids == p.token_ids
        billed.append(out.bill.cached_tokens)
    assert billed == [s.cached_tokens for s in report.prompts]


# -- input and CLI ---------------------------------------------------------------------------------------
def _write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_cli(tmp_path, capsys, tok):
    records = [chat("Now: 10:31. " + RULES, "q"), chat("Now: 10:32. " + RULES, "q"), {"prompt": "hi"}]
    path = _write(tmp_path / "p.jsonl", records[:1] + [""] + records[1:])  # a blank line is skipped
    assert main(["prefix-score", path, "--json", "--block-size", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = score_prompts([render(r, tok) for r in records], 8)
    assert data == json.loads(json.dumps(expected.to_dict()))
    assert data["summary"]["hit_rate"] == expected.hit_rate and len(data["prompts"]) == 3
    assert main(["prefix-score", path]) == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "10:3" in out and "first prompt" in out


def test_bare_tokenizer_json(tmp_path, capsys, tok):
    path = _write(tmp_path / "p.jsonl", [{"prompt": RULES}, {"prompt": RULES + "more"}])
    tok_file = str(demo_checkpoint_path() / "tokenizer.json")
    assert main(["prefix-score", path, "--tokenizer", tok_file, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["prompt_tokens"] for p in data["prompts"]] == [len(tok.encode(RULES)), len(tok.encode(RULES + "more"))]
    chat_path = _write(tmp_path / "c.jsonl", [chat(RULES, "q")])
    assert main(["prefix-score", chat_path, "--tokenizer", tok_file]) == 2
    assert "c.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"}', "{not json"], "p.jsonl:2: not valid JSON"),
    (['{"text": "a"}'], "p.jsonl:1: expected 'prompt'"),
    (['{"prompt": 5}'], "'prompt' must be a string"),
    (['[1, 2]'], "expected a JSON object"),
    (['{"messages": []}'], "empty conversation"),
    (['{"messages": [{"role": "user", "content": "x"}], "tools": {}}'], "'tools' must be a list"),
    ([], "no prompts"),
])
def test_bad_input(tmp_path, capsys, lines, message):
    path = _write(tmp_path / "p.jsonl", lines)
    assert main(["prefix-score", path]) == 2
    assert message in capsys.readouterr().err


def test_missing_files(tmp_path, capsys):
    assert main(["prefix-score", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    assert main(["prefix-score", path, "--tokenizer", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["prefix-score", path, "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_read_prompts_renders_like_the_server(tmp_path, tok):
    path = _write(tmp_path / "p.jsonl", [chat(RULES, "q"), {"prompt": "hello"}])
    rendered = read_prompts(path, tok)
    text = tok.apply_chat_template(chat(RULES, "q")["messages"], add_generation_prompt=True, tools=TOOLS)
    assert rendered[0].text == text and rendered[0].token_ids == tok.encode(text, add_special_tokens=False)
    assert rendered[1].token_ids == tok.encode("hello") and rendered[1].token_ids[0] == tok.bos_token_id
