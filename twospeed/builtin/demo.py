"""The built-in demo checkpoint: a deterministic random-weight Llama in the real HF folder layout.

Why: every test, benchmark and `twospeed serve` without a model needs a checkpoint that
goes through the same loader, tokenizer and forward pass as a downloaded one, with no
network. The weights are random (the text is nonsense) but the shapes, names, files,
tokenizer and chat template are real, so HF transformers loads the same folder and
serves as the reference.

Outputs: `write_demo_checkpoint(path)` writes config.json, generation_config.json,
model.safetensors, tokenizer.json and tokenizer_config.json; `demo_checkpoint_path()`
builds it once into a cache folder and returns that folder.

`demo-draft` (`draft_checkpoint_path()`) is speculative decoding's draft for the demo: the
same tokenizer, the embeddings, the first DRAFT_LAYERS decoder layers and the final norm of
the demo itself (an early-exit draft, as in self-speculative decoding), in the same layout.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from twospeed.builtin.publish import publish_checkpoint, write_json
from twospeed.config import cache_root

# Bump when anything that changes the written files changes (corpus, seeds, template),
# so an old cache folder is never served as the new checkpoint.
DEMO_VERSION = "demo-v1"
DEMO_VOCAB_SIZE = 8192
DIGIT_RUNS_SEEN = 40  # times each two- and three-digit run is shown to the BPE trainer (digit_group=3)
DEMO_SEED = 1234

BOS, EOS, IM_START, IM_END, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # the trainer gives them ids 0..4 in this order

DEMO_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": DEMO_VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
}

# ChatML with optional tools (rendered with tojson, as Qwen-style templates do).
# No bos: like HF, the engine encodes a rendered chat with add_special_tokens=False.
DEMO_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- 'You may call these tools:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}\n"
    "{{- '\\n</tools>\\nTo call one, reply with ' }}\n"
    "{{- '<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' and loop.first %}\n"
    "{%- elif message.role == 'assistant' and message.tool_calls is defined %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}\n"
    "{%- for call in message.tool_calls %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    "{%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson %}\n"
    "{{- '<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' + args + '}</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

_COMMON_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or have an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three model token cache request server latency prefill decode batch"
).split()
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "sh",
           "th", "st", "tr", "pl", "gr", "qu", "sp")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt")


def _synthetic_corpus() -> list[str]:
    """English-like prose, numbers, JSON and code from a fixed seed: enough distinct words for 8k merges."""
    rng = random.Random(0)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    coined = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(20000)})
    lexicon = _COMMON_WORDS * 20 + coined

    def sentence() -> str:
        words = rng.choices(lexicon, k=rng.randint(4, 16))
        return " ".join(words).capitalize() + rng.choice(".....?!;:")

    lines = []
    for i in range(8000):
        kind = i % 6
        if kind <= 2:
            lines.append(" ".join(sentence() for _ in range(rng.randint(1, 3))))
        elif kind == 3:
            lines.append(f"{rng.randint(0, 10 ** rng.randint(1, 9))} {rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f} "
                         f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
                         f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {rng.randint(0, 100)}%")
        elif kind == 4:
            record = {rng.choice(lexicon): rng.choice([rng.randint(0, 9999), rng.choice(lexicon), True, None,
                                                      [rng.randint(0, 99) for _ in range(3)]])
                      for _ in range(rng.randint(1, 5))}
            lines.append(json.dumps(record, indent=rng.choice([None, 2])))
        else:
            fn, a, b = rng.choice(coined), rng.choice(coined), rng.choice(coined)
            lines.append(f"def {fn}_{a}({a}, {b}=None):\n    if {b} is None:\n        return [{a}]\n"
                         f"    {b}[\"{a}\"] += {rng.randint(0, 99)}  # {sentence()}\n    return {{{a}: {b}}}\n")
    return lines


def train_bpe_tokenizer(texts: list[str], vocab_size: int, digit_group: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer (Llama-3 / GPT-2 style) trained on `texts`, with the special tokens at ids
    0..4 and bos put first by the post-processor. `digit_group`: 0, numbers merge as BPE finds them; 1, every
    digit its own token (Llama 2, Mistral); 3, numbers cut into runs of up to three digits left to right,
    every run of one to three digits one token (Llama 3): an id's digits are then one or two tokens that
    mean the same everywhere, instead of a spelling whose digits recur all over the prompt."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digit_group not in (0, 1, 3):
        raise ValueError(f"digit_group must be 0, 1 or 3, not {digit_group}")
    if digit_group:
        split = (pre_tokenizers.Digits(individual_digits=True) if digit_group == 1 else
                 pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, tokenizer.pre_tokenizer])
    if digit_group == 3:  # every run a token: each spelling often enough that BPE merges it before rare words
        texts = list(texts) + [" ".join(f"{n:0{w}d}" for n in range(10 ** w)) for w in (2, 3)] * DIGIT_RUNS_SEEN
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: emoji never hit an unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"BPE tokenizer has {tokenizer.get_vocab_size()} tokens, want {vocab_size}")
    if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("BPE special tokens did not get ids 0..4")
    return tokenizer


def build_demo_tokenizer() -> Tokenizer:
    """Train the demo byte-level BPE tokenizer on the synthetic corpus."""
    return train_bpe_tokenizer(_synthetic_corpus(), DEMO_VOCAB_SIZE)


def write_demo_tokenizer(path: str | Path) -> Path:
    """Write only tokenizer.json and tokenizer_config.json (tests of the tokenizer need no weights)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_demo_tokenizer().save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    write_json(path / "tokenizer_config.json", tokenizer_config)
    return path


def demo_state_dict(config: dict = DEMO_CONFIG, seed: int = DEMO_SEED) -> dict[str, torch.Tensor]:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers), norms one."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    residual_scale = 1.0 / math.sqrt(2 * layers)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        # Drawn in float32 in a fixed order, then rounded: the bytes depend only on the seed.
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * (0.02 * scale)).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)  # [out, in], as nn.Linear stores it
        weights[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim, scale=residual_scale)
        weights[p + "post_attention_layernorm.weight"] = ones(hidden)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter, scale=residual_scale)
    weights["model.norm.weight"] = ones(hidden)
    return weights  # no lm_head.weight: tie_word_embeddings


def _write_checkpoint(path: str | Path, config: dict, weights) -> Path:
    """Write config, tokenizer and weights() to `path` atomically (builtin/publish.py) and return `path`. If
    `path` already holds a checkpoint (another builder won the race) that one is kept."""

    def write(tmp: Path) -> None:
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json",
                   {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
        write_demo_tokenizer(tmp)
        save_file(weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return publish_checkpoint(path, write)


DRAFT_LAYERS = 2  # of the demo's 8: the draft's step costs about a third of the demo's (the lm_head is shared size)


def draft_config(config: dict = DEMO_CONFIG, layers: int = DRAFT_LAYERS) -> dict:
    return {**config, "num_hidden_layers": layers}


def draft_state_dict(layers: int = DRAFT_LAYERS) -> dict[str, torch.Tensor]:
    """The demo's weights without its layers from `layers` on."""
    keep = tuple(f"model.layers.{i}." for i in range(layers))
    return {k: v for k, v in demo_state_dict().items() if not k.startswith("model.layers.") or k.startswith(keep)}


def write_demo_checkpoint(path: str | Path) -> Path:
    """Write the demo checkpoint to `path` atomically (see _write_checkpoint) and return `path`."""
    return _write_checkpoint(path, DEMO_CONFIG, demo_state_dict)


def demo_checkpoint_path() -> Path:
    """The cached demo checkpoint folder ($TWOSPEED_CACHE or ~/.cache/twospeed), built on first use."""
    root = cache_root()
    key = hashlib.sha256((json.dumps(DEMO_CONFIG, sort_keys=True) + DEMO_VERSION).encode()).hexdigest()[:12]
    path = root / f"demo-{key}"
    if not (path / "config.json").is_file():
        write_demo_checkpoint(path)
    return path


def draft_checkpoint_path() -> Path:
    """The cached demo-draft checkpoint folder, built on first use."""
    config = draft_config()
    key = hashlib.sha256((json.dumps(config, sort_keys=True) + DEMO_VERSION + "-draft").encode()).hexdigest()[:12]
    path = cache_root() / f"demo-draft-{key}"
    if not (path / "config.json").is_file():
        _write_checkpoint(path, config, draft_state_dict)
    return path


if __name__ == "__main__":
    print(demo_checkpoint_path())
