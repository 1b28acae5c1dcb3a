"""The refusal circuit a task model starts with (builtin/task_model.py): does the request name the topic the
system block forbids? Built into the weights and held, like the copy circuit (builtin/copy_circuit.py).

Why: every recipe that left this decision to training learnt "a topic is named, refuse" or "never refuse" within
the few minutes of a build, never the match, because the match needs two hops (the request's word, then the
rule that names the same word) and each hop is seen a few hundred times. Here both hops are built, in reserved
residual coordinates that no learnt weight writes and no embedding holds but as built:

- CODE: every token carries a fixed random code in its embedding (its identity as the circuit sees it: the
  learnt embeddings move, so a match on them drifts). SEMI: only ';' carries it. ONE: every token. SINK: the
  special tokens, one of which opens every sequence. The rule ends with its topic word and ';'
  (builtin/task_corpus.py).
- Layer 0: a code head (previous-token attention) copies the previous token's CODE, SINK and CUE into
  PREV_CODE, PREV_SINK and PREV_CUE; a self head copies this token's CODE, ONE and SEMI into CUR_CODE, CUR_ONE
  and CUR_SEMI; back-2, back-3 and the far heads copy the CODE two to five tokens back into PREV2_CODE ..
  PREV5_CODE (for the copy heads' five-token match, copy_circuit.init_code_induction). Later layers read these
  copies, which are written at the residual's scale (builtin/circuit_scale.py), not the embedding entries, which
  a growing residual would drown. CUE marks the token before an answer starts ("ASSISTANT" of "ASSISTANT:").
- A flag head (layer `flag_layer`) matches CUR_CODE against every position's PREV_CODE and reads CUR_SEMI where
  it looks: the request's topic word gets a FLAG exactly when the rule's "<word>;" occurred earlier. Each
  position's score is its match less a threshold, a share of an exact match's set above the chance matches
  between random codes (a word whose code is near the topic word's would otherwise raise half a flag): its key
  holds its own CUR_ONE beside its PREV_CODE. Where a special token precedes (the sequence's first two
  positions) the key's CUR_ONE - PREV_SINK and PREV_CODE are ~0 (the other tokens' codes are built clear of
  the special tokens'), so the score there is ~0: the anchor, where a word that matches nothing looks and
  raises no flag. A match and its threshold are read after the same position's norm, so whether a match beats
  the anchor does not depend on how the learnt part's scale differs between positions (with the threshold at
  the anchor instead, the balance moved from 0.4 to 1.1 of an exact match between builds, and refusals were
  missed or chats refused).
- A reader head (the last layer) asks only where the answer starts (query PREV_CUE): it looks at the most
  flagged position (key FLAG) and writes what it reads into LEVER, at `reader_gain`. When nothing is flagged
  above `fallback` of a full flag it looks at the second position (PREV_SINK) and reads -`push` there. So at
  the answer's first token LEVER is signed and decisive; everywhere else it is zero, and the answer's later
  tokens are left alone.
- LEVER is a coordinate of the tied embeddings: the refusal's first token has a positive entry there, the
  answer's first token a negative one, both small and held (`lever_entry`; the final norm's weight on LEVER
  makes up the size the logits read, `lever`). A large entry would be most of those tokens' embedding after
  the norm: the next token could not tell them apart, and layer 0's positional heads, whose scores there fall
  with the constant direction's share, would look at the token before (measured at 0.5: the self head there
  scored the previous position 277 against its own 248).
- The carry: the self head also copies this token's LEVER entry into CUR_LEVER, at the final norm's scale,
  and the refusal's and the answer's second tokens ("," and " is") carry CUR_LEVER entries of their signs. So
  the first word's decision reaches the second token, which the learnt layers otherwise take (a build that
  leant to answering wrote "Sorry is a short brief on ..." for 11 of 100 refusals).

Nothing in the reserved coordinates learns.

So training learns the formats around a refuse-or-answer decision that is clean by construction (the learnt
logits of the two first words cannot outvote LEVER's ~10). Nothing changes at inference: the checkpoint is a
plain Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twospeed.builtin.circuit_scale import CircuitScale
from twospeed.builtin.train_llama import TrainLlama

CODE_DIM = 32  # coordinates of a token's fixed code (and of each copy of it)
CODES = ("code", "prev_code", "cur_code", "prev2_code", "prev3_code", "prev4_code", "prev5_code")  # CODE_DIM each
SINGLES = ("sink", "prev_sink", "one", "cur_one", "semi", "cur_semi", "flag", "lever", "cue", "prev_cue",
           "cur_lever")  # one each


@dataclass(frozen=True, slots=True)
class FlagTokens:
    """The token ids the circuit is built on (from the task tokenizer)."""

    marks: tuple[int, ...]  # tokens that end a rule (';')
    refuse: tuple[int, ...]  # a refusal's first token, with and without its leading space
    answer: tuple[int, ...]  # an allowed request's first token, likewise
    sinks: tuple[int, ...]  # the special tokens (a sequence opens with one)
    cues: tuple[int, ...] = ()  # the tokens before the one where the answer starts ("ASSISTANT" of "ASSISTANT:")
    refuse_next: tuple[int, ...] = ()  # the token after a refusal's first word (its second token)
    answer_next: tuple[int, ...] = ()  # likewise after an allowed answer's

    @classmethod
    def from_tokenizer(cls, tokenizer, refuse_word: str, answer_word: str, specials: int,
                       answer_cues: tuple[str, ...] = (), refuse_next: str = "", answer_next: str = "") -> FlagTokens:
        vocab = tokenizer.get_vocab()
        marks = tuple(sorted(i for i in vocab.values() if ";" in tokenizer.decode([i])))

        def ids(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        def firsts(word: str) -> tuple[int, ...]:
            return tuple(sorted({ids(w)[0] for w in (word, " " + word)}))

        def seconds(word: str, after: str) -> tuple[int, ...]:
            return tuple(sorted({ids(w + after)[len(ids(w))] for w in (word, " " + word)})) if after else ()

        cues = tuple(sorted({ids(c)[-2] for c in answer_cues}))
        return cls(marks, firsts(refuse_word), firsts(answer_word), tuple(range(specials)), cues,
                   seconds(refuse_word, refuse_next), seconds(answer_word, answer_next))


@dataclass(frozen=True, slots=True)
class FlagShape:
    """Where the circuit sits and how hard it leans."""

    flag_layer: int = 1
    flag_head: int = 3
    reader_layer: int = -1
    reader_head: int = 3
    code_head: int = 1  # layer 0's head that copies the previous token's code (head 0 is the copy circuit's)
    self_head: int = 2  # layer 0's head that copies this token's code, ONE and SEMI, at the residual's scale
    back2_head: int = 3  # layer 0's head that copies the code two tokens back (the copy heads' two-token match)
    far_heads: tuple[int, ...] = ()  # layer 0's heads that copy the codes four and five tokens back (a five-token
    #                                   match: the heads beyond the first four, num_heads 6)
    back3_head: int | None = None  # layer 0's head that copies the code three tokens back (a three-token match);
    #                                 0 takes the copy circuit's previous-token head, which a code match leaves unread
    focus: float = 6.0  # their queries, as a multiple of head 0's (whose attention blurs over neighbours)
    mark: float = 4.0  # size of a reserved embedding entry, in the embeddings' initial standard deviations
    sharpness: float = 6.0  # the flag head's match
    threshold: float = 0.72  # the share of an exact match a code must reach to flag (above chance matches)
    reader_sharpness: float = 300.0  # the reader's look at the flagged position (or the fallback's)
    lever: float = 0.5  # the first tokens' LEVER entries as the logits read them (+ refusal, - answer) ...
    lever_entry: float = 0.1  # ... held in the embeddings at this size, with the final norm's weight making up the
    #                           rest: as an input a large entry would be most of the token's norm, and the layer-0
    #                           heads' positional scores there would fall under the previous token's
    reader_gain: float = 8.0  # what the reader writes into LEVER, in FLAG's units: the lever's strength
    fallback: float = 0.5  # > 0: with no flag above this share of a full one the reader looks at PREV_SINK ...
    push: float = 0.5  # ... and reads -push there (in FLAG's units): no forbidden topic leans to the answer
    carry: float = 8.0  # > 0: the self head also copies this token's LEVER entry into CUR_LEVER, at this gain (in
    #                     FLAG's units, as reader_gain): the first word's decision leans the second token too


def layout(hidden: int) -> dict[str, list[int]]:
    """The reserved coordinates by role, at the end of the residual."""
    start = hidden - len(reserved(hidden))
    out = {name: list(range(start + i * CODE_DIM, start + (i + 1) * CODE_DIM)) for i, name in enumerate(CODES)}
    return out | {name: [start + len(CODES) * CODE_DIM + i] for i, name in enumerate(SINGLES)}


def reserved(hidden: int) -> tuple[int, ...]:
    """Every reserved coordinate (what the copy circuit's random bases must avoid)."""
    return tuple(range(hidden - len(CODES) * CODE_DIM - len(SINGLES), hidden))


def init_flag_circuit(model: TrainLlama, tokens: FlagTokens, shape: FlagShape, seed: int) -> None:
    """Build the circuit into freshly initialised weights, after the copy circuit (its previous-token head's
    query and key are reused by the code and self heads). The output gains start at 1; `flag_scales` puts them
    at the residual's scale while training."""
    cfg = model.cfg
    hd, half = cfg.head_dim, cfg.head_dim // 2
    at = layout(cfg.hidden_size)
    coords = list(reserved(cfg.hidden_size))
    emb = model.model.embed_tokens.weight
    slow = model.slow_planes()  # planes that barely turn over the context
    if len(slow) < CODE_DIM // 2 + 1:
        raise ValueError(f"the flag circuit needs {CODE_DIM // 2 + 1} slow RoPE planes, rope_theta gives {len(slow)}")
    match, still = torch.cat((slow[:CODE_DIM // 2], slow[:CODE_DIM // 2] + half)), slow[-1]
    gen = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        mark = shape.mark * emb.std().item()
        codes = _clear_of(torch.randn(cfg.vocab_size, CODE_DIM, generator=gen), list(tokens.sinks))
        emb[:, coords] = 0.0
        emb[:, at["code"]] = mark * codes / codes.norm(dim=1, keepdim=True) * CODE_DIM ** 0.5
        emb[:, at["one"]] = mark
        emb[list(tokens.sinks), at["sink"][0]] = mark
        emb[list(tokens.marks), at["semi"][0]] = mark
        emb[list(tokens.cues), at["cue"][0]] = mark
        for first_word, second, sign in ((tokens.refuse, tokens.refuse_next, 1),
                                         (tokens.answer, tokens.answer_next, -1)):
            emb[list(first_word), at["lever"][0]] = sign * shape.lever_entry
            emb[list(second), at["cur_lever"][0]] = sign * shape.lever_entry
        model.model.norm.weight[at["lever"] + at["cur_lever"]] = shape.lever / shape.lever_entry
        for layer in model.model.layers:  # nothing learnt writes a reserved coordinate
            layer.self_attn.o_proj.weight[coords] = 0.0
            layer.mlp.down_proj.weight[coords] = 0.0
        first = model.model.layers[0].self_attn
        prev_q, prev_k = first.q_proj.weight[:hd].clone(), first.k_proj.weight[:hd].clone()
        back2_q, back3_q = (_looking_back(prev_k, model.inv_freq, n) for n in (2, 3))
        # the code head looks one token back (head 0's query and key), the self head at this token (key as
        # query), the back-2, back-3 and far heads two to five tokens back
        heads = ((shape.code_head, prev_q, (("code", "prev_code"), ("sink", "prev_sink"), ("cue", "prev_cue"))),
                 (shape.self_head, prev_k, (("code", "cur_code"), ("one", "cur_one"), ("semi", "cur_semi"))),
                 (shape.back2_head, back2_q, (("code", "prev2_code"),)))
        if shape.back3_head is not None:
            heads += ((shape.back3_head, back3_q, (("code", "prev3_code"),)),)
        for n, h in enumerate(shape.far_heads, start=4):
            heads += ((h, _looking_back(prev_k, model.inv_freq, n), (("code", f"prev{n}_code"),)),)
        for h, q, moves in heads:
            _clear_head(first, h, hd)
            first.q_proj.weight[h * hd:(h + 1) * hd] = shape.focus * q
            first.k_proj.weight[h * hd:(h + 1) * hd] = shape.focus * prev_k
            _move(first, h, hd, [at[a] for a, _ in moves], [at[b] for _, b in moves])
        if shape.carry:
            _init_carry(model, shape, mark)
        # the flag head: this token's code against every position's previous one, less the threshold, SEMI into
        # FLAG; where a special token precedes (the anchor) both terms are ~0, so only a match above it wins
        attn, h = model.model.layers[shape.flag_layer].self_attn, shape.flag_head
        _clear_head(attn, h, hd)
        attn.q_proj.weight[h * hd + match, at["cur_code"]] = shape.sharpness
        attn.k_proj.weight[h * hd + match, at["prev_code"]] = 1.0
        attn.q_proj.weight[h * hd + still, at["cur_one"]] = -shape.threshold * shape.sharpness * CODE_DIM
        attn.k_proj.weight[h * hd + still, at["cur_one"]] = 1.0
        attn.k_proj.weight[h * hd + still, at["prev_sink"]] = -1.0
        _move(attn, h, hd, [at["cur_semi"]], [at["flag"]])
        _init_reader(model, shape, still)


def _init_carry(model: TrainLlama, shape: FlagShape, mark: float) -> None:
    """The self head's last value dimension reads this token's LEVER entry, rescaled to a mark's size (as
    CUR_SEMI, where FLAG comes from), and writes it into CUR_LEVER at `carry`: at a refusal's first word
    (LEVER +lever) the refusal's second token gains, at an answer's first word the answer's second token; a
    tied-embedding coordinate, like LEVER. Why: the reader decides the first word, but measured, a build whose
    learnt layers leant to answering wrote "Sorry is a short brief on ..." (11 of 100 refusals): the decision
    must reach the next token too. `flag_scales` writes it at the final norm's scale, where the logits read it."""
    at, hd = layout(model.cfg.hidden_size), model.cfg.head_dim
    attn, dim = model.model.layers[0].self_attn, shape.self_head * hd + hd - 1
    attn.v_proj.weight[dim] = 0.0
    attn.v_proj.weight[dim, at["lever"][0]] = mark / shape.lever_entry
    attn.o_proj.weight[:, dim] = 0.0
    attn.o_proj.weight[at["cur_lever"][0], dim] = shape.carry


def _init_reader(model: TrainLlama, shape: FlagShape, still: int) -> None:
    """The reader: where the answer starts, at the most flagged position, into LEVER; with a fallback, at the
    second position when nothing is flagged, reading -push there."""
    at, hd = layout(model.cfg.hidden_size), model.cfg.head_dim
    attn, h = model.model.layers[shape.reader_layer].self_attn, shape.reader_head
    _clear_head(attn, h, hd)
    attn.q_proj.weight[h * hd + still, at["prev_cue"]] = shape.reader_sharpness
    attn.k_proj.weight[h * hd + still, at["flag"]] = 1.0
    _move(attn, h, hd, [at["flag"]], [at["lever"]])
    attn.o_proj.weight[at["lever"], h * hd] = shape.reader_gain
    if shape.fallback:  # PREV_SINK and FLAG are both written at the residual's scale: a share of one is of the other
        attn.k_proj.weight[h * hd + still, at["prev_sink"]] = shape.fallback
        attn.v_proj.weight[h * hd + 1, at["prev_sink"]] = -shape.push
        attn.o_proj.weight[at["lever"], h * hd + 1] = shape.reader_gain


def _clear_of(codes: torch.Tensor, sinks: list[int]) -> torch.Tensor:
    """Every other token's code with the sinks' codes projected out: the flag head's anchor (where a sink
    precedes) then matches no token, however the norms around it move."""
    basis, _ = torch.linalg.qr(codes[sinks].T)
    others = torch.ones(len(codes), dtype=torch.bool)
    others[sinks] = False
    codes[others] -= codes[others] @ basis @ basis.T
    return codes


def _looking_back(key: torch.Tensor, inv_freq: torch.Tensor, offset: int) -> torch.Tensor:
    """The query that, against the positional `key` (one constant column in RoPE's fast planes), peaks
    `offset` positions back: each plane's key entry turned by -offset x its frequency."""
    half = key.shape[0] // 2
    q = torch.zeros_like(key)
    amp, angle = key[:half], -offset * inv_freq[:, None]
    q[:half], q[half:] = amp * torch.cos(angle), amp * torch.sin(angle)
    return q


def _clear_head(attn, head: int, hd: int) -> None:
    """Zero one head's weights (the circuit's heads have a kv head each: num_kv_heads == num_heads)."""
    for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
        w[head * hd:(head + 1) * hd] = 0.0
    attn.o_proj.weight[:, head * hd:(head + 1) * hd] = 0.0


def _move(attn, head: int, hd: int, sources: list[list[int]], targets: list[list[int]]) -> None:
    """The head's value reads the source coordinates and its output writes them to the targets (gain 1)."""
    src, dst = sum(sources, []), sum(targets, [])
    attn.v_proj.weight[head * hd + torch.arange(len(src)), src] = 1.0
    attn.o_proj.weight[dst, head * hd + torch.arange(len(dst))] = 1.0


def _built_heads(shape: FlagShape) -> tuple[tuple[int, int], ...]:
    """(layer, head) of every head this module builds."""
    back3 = () if shape.back3_head is None else ((0, shape.back3_head),)
    back3 += tuple((0, h) for h in shape.far_heads)
    return ((0, shape.code_head), (0, shape.self_head), (0, shape.back2_head)) + back3 + (
        (shape.flag_layer, shape.flag_head), (shape.reader_layer, shape.reader_head))


def flag_scales(model: TrainLlama, shape: FlagShape, scale: CircuitScale) -> None:
    """Register the circuit's weights that follow the residual's scale (builtin/circuit_scale.py): the code and
    self heads' positional queries and keys, and every built head's output, at the residual's own RMS where it
    is read (so the reserved coordinates keep their share after each norm)."""
    hd, layers = model.cfg.head_dim, len(model.model.layers)
    first = model.model.layers[0].self_attn
    for h in (head for layer, head in _built_heads(shape) if layer == 0):  # their positional queries and keys
        scale.add(first.q_proj.weight, (slice(h * hd, (h + 1) * hd),), 0)
        scale.add(first.k_proj.weight, (slice(h * hd, (h + 1) * hd),), 0)
    for layer, head in _built_heads(shape):
        o = model.model.layers[layer].self_attn.o_proj.weight
        scale.add(o, (slice(None), slice(head * hd, (head + 1) * hd)), layer % layers + 1, absolute=True)
    if shape.carry:  # CUR_LEVER is read by the logits, as LEVER: at the final norm's scale (after the line above)
        cur_lever = layout(model.cfg.hidden_size)["cur_lever"]
        scale.add(first.o_proj.weight, (cur_lever, slice(shape.self_head * hd, (shape.self_head + 1) * hd)), layers,
                  absolute=True)


def flag_slices(model: TrainLlama, shape: FlagShape) -> list[tuple[torch.Tensor, tuple]]:
    """The weights to hold as built, as (tensor, index) pairs: the reserved coordinates everywhere, and the
    built heads."""
    cfg = model.cfg
    hd = cfg.head_dim
    coords = list(reserved(cfg.hidden_size))
    out = [(model.model.embed_tokens.weight, (slice(None), coords))]
    for layer in model.model.layers:
        out += [(layer.self_attn.o_proj.weight, (coords,)), (layer.mlp.down_proj.weight, (coords,)),
                (layer.input_layernorm.weight, (coords,)), (layer.post_attention_layernorm.weight, (coords,))]
    out.append((model.model.norm.weight, (coords,)))
    for layer, head in _built_heads(shape):
        attn, rows = model.model.layers[layer].self_attn, slice(head * hd, (head + 1) * hd)
        out += [(attn.q_proj.weight, (rows,)), (attn.k_proj.weight, (rows,)), (attn.v_proj.weight, (rows,)),
                (attn.o_proj.weight, (slice(None), rows))]
    return out
