"""`twospeed compare`'s trade table on hand-built runs: which lane is the long-prompt one, which lanes stream,
and the numbers each run puts in its row."""

from __future__ import annotations

import io

from rich.console import Console

from twospeed.lab import compare


def lane(prompt_tokens: int, requests: int, ttft_p99: float, itl: tuple[float, float] | None) -> dict:
    stats = {"ttft": {"p99": ttft_p99}, "itl": {"n": 10 if itl else 0, "p99": itl and itl[0], "max": itl and itl[1]}}
    return {"requests": requests, "bill": {"prompt_tokens": prompt_tokens * requests}, "stats": stats}


def run(label: str, chat_itl, rag_ttft: float, tok_s: float) -> dict:
    return {"run": {"label": label},
            "lanes": {"chat": lane(40, 6, 0.5, chat_itl), "rag": lane(1600, 4, rag_ttft, (0.05, 0.08)),
                      "nightly": lane(300, 2, 0.4, None)},  # answered in one chunk: no ITL, not a decode lane
            "total": {"throughput": {"output_tokens_per_s": tok_s}}}


def test_the_trade_per_run():
    docs = [run("fixed-2048", (0.09, 1.4), 1.7, 120.0), run("time-80ms", (0.06, 0.2), 2.1, 117.0)]
    long, decode, rows = compare.trade(docs)
    assert long == "rag" and decode == ["chat"]
    assert rows == [{"chat": (0.09, 1.4), "rag": 1.7, "output_tok_s": 120.0},
                    {"chat": (0.06, 0.2), "rag": 2.1, "output_tok_s": 117.0}]
    out = io.StringIO()
    Console(file=out, width=200).print(compare.trade_table(docs, ["fixed-2048", "time-80ms"]))
    text = out.getvalue()
    assert "rag TTFT p99" in text and "chat ITL" in text
    assert "90 / 1,400" in text and "60 / 200" in text and "2,100" in text and "117" in text
