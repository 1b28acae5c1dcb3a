"""The copy circuit a task model starts with (builtin/task_model.py): a previous-token head in layer 0 and an
induction head (or a plain copier) in the copy layer, built into the weights before training.

Why: at a few million parameters and a few minutes of training, a model learns every lane's format but not to
copy an id or a passage number out of its prompt (each rare token is seen too seldom to learn its own copy). The
circuit copies any token by construction; training then only teaches where to look. `circuit_slices` names the
weights the recipe may hold fixed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from twospeed.builtin.circuit_scale import CircuitScale
from twospeed.builtin.flag_circuit import layout
from twospeed.builtin.train_llama import TrainLlama

if TYPE_CHECKING:
    from twospeed.builtin.task_model import TaskModelSpec


def init_copy_head(model: TrainLlama, seed: int, gain: float = 1.0, heads: int = 1, layer: int = -1) -> None:
    """Start the last layer's first `heads` heads (the ones the attention probe teaches where to look) as one
    copier: their values and outputs project the attended token's residual back into the stream through
    disjoint blocks of one orthonormal basis, so with tied embeddings it raises the attended token's logit
    from step one. Heads x head_dim = hidden makes the copy full rank: every token's identity survives it."""
    cfg = model.cfg
    if heads > cfg.num_kv_heads or heads * cfg.head_dim > cfg.hidden_size:
        raise ValueError(f"{heads} copy heads need as many kv heads and heads x head_dim <= hidden")
    attn = model.model.layers[layer].self_attn
    gen = torch.Generator().manual_seed(seed + 1)
    hd, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    basis = torch.linalg.qr(torch.randn(cfg.hidden_size, heads * hd, generator=gen))[0]  # [hidden, heads * hd]
    with torch.no_grad():
        for i in range(heads):
            block = basis[:, i * hd:(i + 1) * hd]
            head = i * group  # the first query head of kv head i
            attn.v_proj.weight[i * hd:(i + 1) * hd] = block.T * gain
            attn.o_proj.weight[:, head * hd:(head + 1) * hd] = block * gain


def _basis(gen: torch.Generator, hidden: int, n: int, keep_out: tuple[int, ...],
           outside: torch.Tensor | None = None) -> torch.Tensor:
    """An orthonormal [hidden, n] basis with no component along the `keep_out` coordinates (the reserved ones
    of builtin/flag_circuit.py, which nothing learnt or built here may write or read), nor, when given, along
    the orthonormal columns of `outside`."""
    room = hidden - len(keep_out) - (0 if outside is None else outside.shape[1])
    if room < n:  # QR would fill the missing directions with reserved coordinates
        raise ValueError(f"a {n}-dim basis needs {n} free coordinates; the residual leaves {room}")
    free = torch.randn(hidden, n, generator=gen)
    if outside is not None:
        free -= outside @ (outside.T @ free)
    free[list(keep_out)] = 0.0
    return torch.linalg.qr(free)[0]


def init_previous_token_head(model: TrainLlama, seed: int, sharpness: float = 24.0, gain: float = 1.0,
                             keep_out: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Start layer 0's head 0 as a previous-token head: a constant direction in every embedding gives it the
    same query and key everywhere, whose RoPE phases peak at one position back; its values copy the previous
    token's embedding into a subspace of its own. Copying a span then only has to match "the token before
    this one" against what was just written, the induction step."""
    cfg = model.cfg
    attn = model.model.layers[0].self_attn
    hd, half = cfg.head_dim, cfg.head_dim // 2
    inv_freq = model.inv_freq  # [hd/2], RoPE pairs dim i with i + hd/2
    planes = torch.arange(half)[inv_freq > 0.1]  # the fast planes tell one position from the next
    gen = torch.Generator().manual_seed(seed + 2)
    read, write = (_basis(gen, cfg.hidden_size, hd, keep_out) for _ in range(2))
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 5 * emb[:, 1:].std()  # the constant direction: after RMSNorm about 5 at every position
        amp = (sharpness * hd ** 0.5 / len(planes)) ** 0.5 / 5
        for w in (attn.q_proj.weight, attn.k_proj.weight):
            w[:hd] = 0.0
        attn.q_proj.weight[planes, 0] = amp * torch.cos(-inv_freq[planes])
        attn.q_proj.weight[planes + half, 0] = amp * torch.sin(-inv_freq[planes])
        attn.k_proj.weight[planes, 0] = amp
        attn.v_proj.weight[:hd] = read.T
        attn.o_proj.weight[:, :hd] = write * gain
    return read, write


def init_induction_head(model: TrainLlama, read: torch.Tensor, write: torch.Tensor, seed: int, heads: int,
                        sharpness: float, gain: float = 1.0, layer: int = -1, keep_out: tuple[int, ...] = ()) -> None:
    """Start the last layer's first `heads` heads as one induction head: at position i they look at every j
    whose previous token is token i, and copy token j. Queries read the current token through the previous-
    token head's read basis; keys read what that head wrote (the token before j); both only in RoPE's slow
    planes, which barely turn over the context, so the match is by content at any distance. Values and outputs
    copy the attended position's residual outside the previous-token subspace (full rank there), so the copy
    names token j, not the one before it. The probe and the copy loss then refine what this starts."""
    cfg = model.cfg
    hd, half, group = cfg.head_dim, cfg.head_dim // 2, cfg.num_heads // cfg.num_kv_heads
    if heads > cfg.num_kv_heads or heads * hd > cfg.hidden_size - hd:
        raise ValueError(f"{heads} induction heads need as many kv heads and heads x head_dim <= hidden - head_dim")
    slow = model.slow_planes()
    dims = torch.cat((slow, slow + half))
    attn = model.model.layers[layer].self_attn
    gen = torch.Generator().manual_seed(seed + 3)
    # not along what the previous-token head writes
    basis = _basis(gen, cfg.hidden_size, heads * hd, keep_out, outside=write)
    with torch.no_grad():
        for i in range(heads):
            head = i * group
            q = attn.q_proj.weight[head * hd:(head + 1) * hd]
            k = attn.k_proj.weight[i * hd:(i + 1) * hd]
            q.zero_()
            k.zero_()
            cols = torch.arange(hd).roll(-i * hd // heads)[:len(dims)]  # each head matches its own share
            q[dims] = sharpness * read[:, cols].T
            k[dims] = write[:, cols].T
            block = basis[:, i * hd:(i + 1) * hd]
            attn.v_proj.weight[i * hd:(i + 1) * hd] = block.T * gain
            attn.o_proj.weight[:, head * hd:(head + 1) * hd] = block * gain


def init_code_induction(model: TrainLlama, at: dict[str, list[int]], heads: int, sharpness: float,
                        layer: int, seed: int, code_gain: float = 0.0, context: int = 2,
                        sinks: tuple[int, ...] = ()) -> None:
    """Turn the induction heads' match from one token to `context` tokens, on the fixed token codes of the
    reserved coordinates (builtin/flag_circuit.py): at i the query reads the codes of this token and the
    `context` - 1 before it, at j the key reads those of the `context` tokens before j, each pair in its own
    share of RoPE's slow planes (`_pair_planes`). So "[P" followed by "2" finds the "2" after the same "[P" in the
    passage being copied, not the first "2" anywhere: a copy that entered a passage stays there; and with five
    tokens the value after "is owned by" is the one in the passage whose noun and subject came before it, not
    a sibling passage's of the same kind. Each head projects the 32-dim codes through its own random
    orthonormal rows, so the heads' chance matches differ and their copies average them out. The slowest plane
    keys the sink (the special token that opens the sequence), and the queries' entries there start at zero and
    learn (taught by the probe's abstain targets, builtin/task_model.py): the one way a query can copy nothing
    when its codes match (a copied span has ended, or the answer's next token is no copy at all).

    With `code_gain` each head also copies the attended token's code (CUR_CODE) into the CODE coordinates, in
    the last `CODE_DIM` of its value dimensions: the tied embeddings hold every token's code there, so this
    raises the copied token's logit by its identity, which the learnt residual a head copies otherwise carries
    too faintly for a rare token (a subject's name: the heads attended to it, the logits named a frequent one).
    What they write is the code off the `sinks`' codes (`_off_sinks`): looking at the sink is how they copy
    nothing, so from there they must write nothing."""
    cfg = model.cfg
    hd, half, group = cfg.head_dim, cfg.head_dim // 2, cfg.num_heads // cfg.num_kv_heads
    slow = model.slow_planes()
    match, still = slow[:-1], slow[-1]
    codes = ("cur_code", "prev_code", "prev2_code", "prev3_code", "prev4_code", "prev5_code")[:context + 1]
    pairs = tuple((planes, codes[n], codes[n + 1]) for n, planes in enumerate(_pair_planes(match, context)))
    attn = model.model.layers[layer].self_attn
    gen = torch.Generator().manual_seed(seed + 5)
    off_sinks = _off_sinks(model, at, sinks)
    with torch.no_grad():
        for i in range(heads):
            q = attn.q_proj.weight[i * group * hd:(i * group + 1) * hd]
            k = attn.k_proj.weight[i * hd:(i + 1) * hd]
            q.zero_()
            k.zero_()
            for planes, here, there in pairs:
                dims = torch.cat((planes, planes + half))
                rows = torch.linalg.qr(torch.randn(len(at[here]), len(dims), generator=gen))[0].T  # [dims, 32]
                q[dims[:, None], torch.tensor(at[here])] = sharpness * rows
                k[dims[:, None], torch.tensor(at[there])] = rows
            k[still, at["sink"][0]] = 1.0  # the sequence's first token: where a query that copies nothing looks
            if code_gain > 0:
                code = len(at["code"])
                v_rows = torch.arange((i + 1) * hd - code, (i + 1) * hd)
                o_cols = _code_columns(i, group, hd, code)
                attn.v_proj.weight[v_rows] = 0.0
                attn.o_proj.weight[:, o_cols] = 0.0
                attn.v_proj.weight[v_rows, torch.tensor(at["cur_code"])] = 1.0
                attn.o_proj.weight[torch.tensor(at["code"])[:, None], o_cols] = code_gain / heads * off_sinks


def _off_sinks(model: TrainLlama, at: dict[str, list[int]], sinks: tuple[int, ...]) -> torch.Tensor:
    """The projection of the code coordinates off the special tokens' codes, [CODE_DIM, CODE_DIM].

    Every other token's code is built clear of theirs (flag_circuit._clear_of), so a copy of it passes unchanged;
    a copy of the sink's (the probe's "copy nothing") comes out zero. Written as the identity, it raised the
    sink's own logit by ~5 and the stop token's by the chance alignment of two random codes: a build whose codes
    aligned stopped at `"code": "` on most nightly rows (zeroing the copy heads' output there took the stop token
    from 0.14-0.20 to 0.00). Zeroing the sinks' codes in the embeddings instead shrank their norm, and the flag
    circuit's anchor, read after it, moved: every refusal was answered."""
    code = torch.eye(len(at["code"]))
    if not sinks:
        return code
    basis = torch.linalg.qr(model.model.embed_tokens.weight.detach()[list(sinks)][:, at["code"]].T.float())[0]
    return code - basis @ basis.T


def _pair_planes(match: torch.Tensor, context: int) -> list[torch.Tensor]:
    """Each compared pair's share of the match planes. Up to three tokens, alike (interleaved); beyond, the
    three nearest keep most and the farther ones get two planes each: a pair's weight in the score is its share
    of the planes, so the far tokens break the ties between equal three-token matches ("is owned by" in every
    passage of that kind) without outvoting a nearer mismatch."""
    if context <= 3:
        return [match[n::context] for n in range(context)]
    far = 2 * (context - 3)
    near, rest = match[:len(match) - far], match[len(match) - far:]
    return [near[n::3] for n in range(3)] + [rest[2 * n:2 * n + 2] for n in range(context - 3)]


def _code_columns(head: int, group: int, hd: int, code: int) -> torch.Tensor:
    """The o_proj columns where copy head `head` writes the copied token's code: its last `code` dimensions."""
    return torch.arange((head * group + 1) * hd - code, (head * group + 1) * hd)


def circuit_slices(spec: TaskModelSpec, model: TrainLlama) -> list[tuple[torch.Tensor, tuple]]:
    """The weights of the built circuit (the previous-token head, the induction heads, the embeddings' constant
    direction) as (tensor, index) pairs."""
    hd, group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    first, last = model.model.layers[0].self_attn, model.model.layers[copy_layer(spec)].self_attn
    out = [(model.model.embed_tokens.weight, (slice(None), 0))]
    out += [(w, (slice(0, hd),)) for w in (first.q_proj.weight, first.k_proj.weight, first.v_proj.weight)]
    out.append((first.o_proj.weight, (slice(None), slice(0, hd))))
    for i in range(spec.copy_heads):
        head = i * group
        if not spec.learn_queries:
            out.append((last.q_proj.weight, (slice(head * hd, (head + 1) * hd),)))
        out += [(w, (slice(i * hd, (i + 1) * hd),)) for w in (last.k_proj.weight, last.v_proj.weight)]
        out.append((last.o_proj.weight, (slice(None), slice(head * hd, (head + 1) * hd))))
    return out


def copy_layer(spec: TaskModelSpec) -> int:
    """The layer whose heads copy (the probe's): `spec.copy_layer`, counted from the end when negative."""
    return spec.copy_layer % spec.num_layers


def copy_heads(spec: TaskModelSpec) -> tuple[int, ...]:
    """The last layer's heads the probe teaches: the first query head of each of the first `copy_heads` kv heads."""
    return tuple(i * (spec.num_heads // spec.num_kv_heads) for i in range(spec.copy_heads))


def copy_scales(spec: TaskModelSpec, model: TrainLlama, scale: CircuitScale) -> None:
    """Register the circuit's weights that follow the residual's scale (builtin/circuit_scale.py): the previous-
    token head's positional query and key, which read the embeddings' constant direction after layer 0's norm
    (the learnt embeddings grow, the constant does not, and the head would blur over its neighbours). What the
    heads write is not scaled: it is part of the residual it would be scaled by, and the loop diverges."""
    hd = spec.head_dim
    first = model.model.layers[0].self_attn
    scale.add(first.q_proj.weight, (slice(0, hd),), 0)
    scale.add(first.k_proj.weight, (slice(0, hd),), 0)
    if spec.flag is not None and spec.code_match > 0 and spec.code_gain > 0:  # the copied codes, at the final
        at, group = layout(spec.hidden_size), spec.num_heads // spec.num_kv_heads  # norm's scale
        o = model.model.layers[copy_layer(spec)].self_attn.o_proj.weight
        for i in range(spec.copy_heads):
            cols = _code_columns(i, group, hd, len(at["code"]))
            scale.add(o, (torch.tensor(at["code"])[:, None], cols), spec.num_layers, absolute=True)
