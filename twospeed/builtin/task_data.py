"""What the task model (builtin/task_model.py) trains on: the lab's corpus (builtin/task_corpus.py) rendered into
token sequences, the source of every copied answer token, and the seeded stream of steps.

Why its own module: the sequences are the contract between the corpus and the trainer (the loss covers the
answers only; the attention probe teaches each copied token's source), and a test or a benchmark can draw the
same stream without building a model.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from twospeed.builtin import task_corpus
from twospeed.builtin.demo import BOS, EOS, IM_END, PAD, SPECIAL_TOKENS

if TYPE_CHECKING:
    from twospeed.builtin.task_model import TaskModelSpec

BOS_ID, EOS_ID, IM_END_ID, PAD_ID = (SPECIAL_TOKENS.index(t) for t in (BOS, EOS, IM_END, PAD))


@dataclass(slots=True)
class Sequence:
    ids: list[int]
    answers: list[tuple[int, int]]  # [start, end) of every answer (with its stop token): what the loss covers
    sources: dict[int, int] = dataclasses.field(default_factory=dict)  # answer token -> where it was copied from

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = copy_sources(self.ids, self.answers)


MIN_COPY = 2  # tokens a copied span must match for its source to count (shorter ones are template words)
MAX_CANDIDATES = 24  # a token seen more often than this before the answer is a template token, not copied


def copy_sources(ids: list[int], answers: list[tuple[int, int]]) -> dict[int, int]:
    """For each answer token copied from earlier in the sequence, the position it was copied from.

    Walking an answer: a token that continues the current copy takes the next source position; otherwise
    it starts a copy at the earlier occurrence that matches the longest stretch of the answer from here
    (at least MIN_COPY tokens; on a tie the latest). The answer's id copied from the evidence, a passage's
    sentence, the subject of a note: each gets its source, which the attention probe then teaches."""
    index: dict[int, list[int]] = {}
    seen = 0
    sources: dict[int, int] = {}
    for start, end in answers:
        for p in range(seen, start):
            index.setdefault(ids[p], []).append(p)
        seen = start
        j = -1
        for q in range(start, end):
            if j >= 0 and j + 1 < start and ids[j + 1] == ids[q]:
                j += 1
            else:
                j, best = -1, MIN_COPY
                candidates = index.get(ids[q], ())
                for c in candidates if len(candidates) <= MAX_CANDIDATES else ():
                    m = 1
                    while q + m < end and c + m < start and ids[q + m] == ids[c + m]:
                        m += 1
                    if m >= best:
                        j, best = c, m
            if j >= 0:
                sources[q] = j
    return sources


def render(session: task_corpus.TaskSession, tokenizer, chat: bool) -> Sequence:
    """The tokens the engine sees for the first prompt, then each answer with its stop token and the next
    round's own part.

    As completions: bos + prompt (what /v1/completions encodes), the answer, <|end_of_text|>. As a chat: the
    template around one user message per round (what the lab's chat endpoint sends), the answer, <|im_end|>."""
    ids: list[int] = []
    answers = []
    for k, ex in enumerate(session.examples):
        part = ex.prompt if k == 0 else ex.prompt[len(session.prefix):]
        if chat:
            text = f"{'' if k == 0 else chr(10)}<|im_start|>user\n{part}<|im_end|>\n<|im_start|>assistant\n"
            ids += tokenizer.encode(text, add_special_tokens=False).ids
            answer = tokenizer.encode(ex.answer.lstrip(" "), add_special_tokens=False).ids + [IM_END_ID]
        else:
            ids += tokenizer.encode(part, add_special_tokens=k == 0).ids  # the post-processor puts bos first
            answer = tokenizer.encode(ex.answer, add_special_tokens=False).ids + [EOS_ID]
        answers.append((len(ids), len(ids) + len(answer)))
        ids += answer
    return Sequence(ids, answers)


def length_at(spec: TaskModelSpec, step: int) -> float:
    """The curriculum: the fraction of the corpus' filler ranges that training draws from at `step`."""
    grown = step / max(1.0, spec.full_length_at * spec.steps)
    return min(1.0, spec.start_length + (1 - spec.start_length) * grown)


def batches(spec: TaskModelSpec, tokenizer, pool: int = 128) -> Iterator[list[Sequence]]:
    """An endless, seeded stream of steps: pools of sessions (lengths from the curriculum at the pool's first
    step) rendered, sorted by length and cut into `batch_tokens` steps, in a shuffled order."""
    rng = random.Random(f"task-train-{spec.seed}")
    lanes, weights = zip(*spec.lane_weights)
    step = 0
    while True:
        length = length_at(spec, step)
        seqs = [render(task_corpus.session(rng.choices(lanes, weights)[0], rng, length=length), tokenizer,
                       rng.random() < spec.chat_share) for _ in range(pool)]
        seqs.sort(key=lambda s: len(s.ids))
        steps, cur = [], []
        for s in seqs:
            if cur and (len(cur) + 1) * len(s.ids) > spec.batch_tokens:
                steps.append(cur)
                cur = []
            cur.append(s)
        steps.append(cur)
        rng.shuffle(steps)
        step += len(steps)
        yield from steps


def collate(step: list[Sequence], first_weight: float = 1.0, last_weight: float = 1.0, rows_multiple: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple, tuple]:
    """input ids [B, T] (right-padded); for every answer token its flat row in [B*T], target and weight (the
    first and last, the stop token, weighed apart), the rows padded to a multiple of `rows_multiple`; and the
    copy heads' probe targets as (row, query, key) columns: each copied token's source, then the first token for
    each token copied from nowhere.

    Otherwise every answer token weighs the same. (Weighing every answer the same instead starves the first
    token of a long note, which is where the refuse-or-answer decision is made.)"""
    t = -(-max(len(s.ids) for s in step) // 32) * 32  # few distinct shapes: oneDNN and the allocator reuse them
    ids = torch.full((len(step), t), PAD_ID, dtype=torch.long)
    rows, targets, weights = [], [], []
    for i, s in enumerate(step):
        ids[i, :len(s.ids)] = torch.tensor(s.ids)
        for start, end in s.answers:
            rows.append(torch.arange(start - 1, end - 1) + i * t)  # position p predicts token p + 1
            targets.append(ids[i, start:end])
            w = torch.ones(end - start)
            w[-1] = last_weight
            w[0] = first_weight
            weights.append(w)
    rows, targets, weights = _padded(torch.cat(rows), torch.cat(targets), torch.cat(weights), rows_multiple)
    copies = [(i, q - 1, j) for i, s in enumerate(step) for q, j in s.sources.items()]  # (row, query, key)
    # the answer tokens copied from nowhere (format, prose, the stop token): there the copy heads should look at
    # the sequence's first token, a special one, and copy nothing
    abstains = [(i, q - 1, 0) for i, s in enumerate(step) for start, end in s.answers
                for q in range(start, end) if q not in s.sources]
    return ids, rows, targets, weights / weights.sum(), tuple(zip(*copies)), tuple(zip(*abstains))


ROWS_MULTIPLE = 64  # what bf16 training pads the answer rows to a multiple of (task_model.train_step)


def _padded(rows: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, multiple: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The answer rows padded with copies of the last one, weighing 0, to a multiple of `multiple`.

    Why: the last layer and the vocabulary run at these rows only, and their count differs from step to step.
    oneDNN builds a bf16 product's kernel for each new shape (with AMX, 20-130 ms for the first
    [349 x 5120] x [5120 x 492], 1.5-2 ms after): unpadded, a bf16 build spent ~30% of its time building
    kernels (367 s against 259 s padded). float32's products build none (6 ms from the first call), so float32
    training passes 1 and its weights stay as they were. Repeating the last row keeps the rows ascending; the
    copies add nothing to the loss or its gradient (the final norm's measured scale sees them: at most 63 of a
    step's several hundred rows)."""
    pad = -len(rows) % multiple
    return (torch.cat([rows, rows[-1:].expand(pad)]), torch.cat([targets, targets[-1:].expand(pad)]),
            torch.cat([weights, weights.new_zeros(pad)]))
