"""Load a Hugging Face checkpoint folder into `LlamaForCausalLM`.

Reads config.json, then model.safetensors or the shards named by
model.safetensors.index.json, memory-mapped. The loader only maps names: each
parameter loads its own tensor (`weight_loader`), so a weight format (int8, fp8)
quantizes on arrival. Every failure names the file and the tensor: an
unsupported architecture, a missing file, a missing, unexpected or misshapen tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from twospeed.config import DTYPES, ModelConfig
from twospeed.model.kv_format import make_kv_format
from twospeed.model.llama import LlamaForCausalLM
from twospeed.model.weight_format import ShapeMismatch, default_weight_loader, make_weight_format

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and tensor."""


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse config.json into a ModelConfig (both the transformers 4 and 5 rope layouts)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (a checkpoint folder needs config.json)")
    hf = json.loads(cfg_file.read_text())
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise CheckpointError(f"{cfg_file}: architecture {arch!r} is not supported; supported: {sorted(SUPPORTED)}")
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5
    if hf.get("rope_scaling"):  # transformers 4
        rope.update(hf["rope_scaling"])
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    heads = hf["num_attention_heads"]
    window = hf.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
        window = None
    dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    eos = _ids(hf.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
        o_bias=arch != "Qwen2ForCausalLM" and hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
        eos_token_ids=eos,
        dtype=DTYPES.get(dtype_name, torch.float32),
    )


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (named by {index.name})")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{single}: missing (no model.safetensors or model.safetensors.index.json in {path})")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Hand every tensor of the checkpoint to the parameter it loads into (its `weight_loader`: a format owns its
    tensors, model/weight_format.py), checking names, shapes and that nothing is missing."""
    path = Path(path)
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | None]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in _weight_files(path).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as st:
            for name in names:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                targets = model.checkpoint_targets(name)
                tensor = st.get_tensor(name) if targets else None
                for target, shard in targets:
                    if target not in params:
                        raise CheckpointError(f"{f.name}: unexpected tensor {name!r} for {model.cfg.architecture}")
                    param = params[target]
                    try:
                        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
                    except ShapeMismatch as e:
                        raise CheckpointError(f"{f.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                              f"expected {e.expected} from config.json") from None
                    loaded.setdefault(target, set()).add(shard)
    for target, param in params.items():
        shards = getattr(param, "num_shards", None)
        want = set(range(shards)) if shards else {None}
        for shard in sorted(want - loaded.get(target, set()), key=lambda x: -1 if x is None else x):
            raise CheckpointError(f"{path}: tensor {_hf_name(target, shard, model)!r} is missing from the checkpoint")


def _hf_name(target: str, shard: int | None, model: LlamaForCausalLM) -> str:
    """Our parameter name -> the HF tensor name it is loaded from (inverse of checkpoint_targets)."""
    if target == "lm_head.weight":
        return "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else target
    for part, key in model.STACKED_PARAMS.items():
        if key == (target.split(".")[-2], shard):
            target = target.replace(key[0], part)
    return f"model.{target}"


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               max_positions: int | None = None, linear_backend: str = "auto",
               attention_backend: str = "auto", quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> LlamaForCausalLM:
    """Build the model for config.json on `device` in `dtype` (default: the checkpoint's) and load its weights.

    quantization: None (the checkpoint's weights in `dtype`), "int8" or "fp8" (quantized at load, model/quant.py).
    linear_backend: "auto" (on CPU in bf16 the C kernels: weights packed once; else oneDNN or the portable path;
    model/packed_linear.py), "cpu", "onednn" (unquantized only) or "torch" (portable).
    attention_backend: "auto" (the CPU decode kernel where it builds, else portable), "torch" or "cpu".
    kv_cache_dtype: how the attention layers store K and V: "auto" (the model's dtype), "int8" or "fp8"
    (model/kv_format.py); the runner allocates the cache to match (model.kv_format)."""
    cfg = load_model_config(path)
    dtype = dtype or cfg.dtype
    fmt = make_weight_format(quantization, linear_backend, device, dtype, stored=cfg.dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_positions, attention_backend, fmt, make_kv_format(kv_cache_dtype))
            model.requires_grad_(False)
            load_weights(model, path)
            model.finish_loading()
    finally:
        torch.set_default_dtype(prev)
    return model.eval()
