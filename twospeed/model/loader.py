"""Load a checkpoint into `LlamaForCausalLM`, whatever its files: the `Checkpoint` interface and its loaders.

A checkpoint is a Hugging Face folder (config.json + model.safetensors or the shards named by
model.safetensors.index.json, memory-mapped: `SafetensorsCheckpoint`) or a GGUF file (model/gguf.py:
`GGUFCheckpoint`); `open_checkpoint` picks the class from what the path holds. Either gives the same
ModelConfig and hands out tensors under HF names, so the rest of the engine never asks which it was.
The loader only maps names: each parameter loads its own tensor (`weight_loader`), so a weight format
(int8, fp8) quantizes on arrival, and a block-quantized one takes a GGUF file's packed bytes as they are. Every failure names the file and the tensor: an unsupported
architecture, a missing file, a missing, unexpected or misshapen tensor.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open

from twospeed.config import DTYPES, ModelConfig
from twospeed.model.block_kinds import BlockTensor
from twospeed.model.checkpoint_files import CheckpointError, find_gguf
from twospeed.model.kv_format import make_kv_format
from twospeed.model.llama import LlamaForCausalLM
from twospeed.model.weight_format import ShapeMismatch, default_weight_loader, make_weight_format

__all__ = ["Checkpoint", "CheckpointError", "SafetensorsCheckpoint", "load_model", "load_model_config",
           "load_weights", "open_checkpoint", "tensor_kind"]

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Checkpoint(ABC):
    """One checkpoint on disk as the loader sees it: its ModelConfig, its tensors under HF names, the format each
    kind of tensor is stored in. A new file format is a new subclass; nothing else in the engine changes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def model_config(self) -> ModelConfig:
        """The decoder's shape and special ids."""

    @abstractmethod
    def tensor_names(self) -> list[tuple[str, str]]:
        """(HF tensor name, the file holding it: for messages) of every tensor in the checkpoint."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` (an HF name from tensor_names) in HF's layout: in its stored dtype, or in float32 where the
        file's format is decoded (exactly); its parameter's weight_loader casts it to the compute dtype, or
        quantizes it from these exact values."""

    def read_blocks(self, name: str) -> BlockTensor | None:
        """Tensor `name` as the packed bytes of a GGUF block layout where the file stores it so (model/gguf.py), for
        parameters that take blocks (model/block_quant.py); None where it holds floats."""
        return None

    def file_name(self, hf_name: str) -> str:
        """What the file calls tensor `hf_name` (for messages)."""
        return hf_name

    @abstractmethod
    def formats(self) -> dict[str, str]:
        """How the file stores each kind of tensor (`tensor_kind`): {"attention": "Q4_1", "norm": "F32", ...}; a kind
        stored in several formats names them all, the most common first ("Q4_K+Q6_K")."""

    def close(self) -> None:
        """Drop open files and maps once the weights are loaded."""


def tensor_kind(hf_name: str) -> str:
    """The kind of an HF tensor name, as checkpoint formats are reported: embedding, output, attention, mlp, norm."""
    if "norm" in hf_name:
        return "norm"
    if "embed_tokens" in hf_name:
        return "embedding"
    if hf_name.startswith("lm_head"):
        return "output"
    if ".self_attn." in hf_name:
        return "attention"
    if ".mlp." in hf_name:
        return "mlp"
    return "other"


def summarize_formats(kinds: list[tuple[str, str]]) -> dict[str, str]:
    """[(kind, format)] of every weight -> {kind: formats, the most common first, joined by "+"}."""
    counts: dict[str, dict[str, int]] = {}
    for kind, fmt in kinds:
        per = counts.setdefault(kind, {})
        per[fmt] = per.get(fmt, 0) + 1
    return {kind: "+".join(sorted(per, key=lambda f: (-per[f], f))) for kind, per in counts.items()}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face folder: config.json and safetensors (one file, or shards named by the index)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._files: dict[str, Path] | None = None
        self._open: dict[Path, object] = {}

    def model_config(self) -> ModelConfig:
        """Parse config.json into a ModelConfig (both the transformers 4 and 5 rope layouts)."""
        cfg_file = self.path / "config.json"
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

    def _weight_files(self) -> dict[str, Path]:
        """tensor name -> file holding it."""
        if self._files is not None:
            return self._files
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.path / fname for name, fname in weight_map.items()}
            for f in set(files.values()):
                if not f.is_file():
                    raise CheckpointError(f"{f}: missing (named by {index.name})")
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise CheckpointError(f"{single}: missing (no model.safetensors or model.safetensors.index.json in "
                                      f"{self.path})")
            files = dict.fromkeys(self._handle(single).keys(), single)
        self._files = files
        return files

    def _handle(self, f: Path):
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f]

    def tensor_names(self) -> list[tuple[str, str]]:
        return [(name, f.name) for name, f in self._weight_files().items()]

    def read(self, name: str) -> torch.Tensor:
        return self._handle(self._weight_files()[name]).get_tensor(name)

    def formats(self) -> dict[str, str]:
        kinds = []
        for name, f in self._weight_files().items():
            if not name.endswith(IGNORED_SUFFIXES):
                kinds.append((tensor_kind(name), self._handle(f).get_slice(name).get_dtype()))
        return summarize_formats(kinds)

    def close(self) -> None:
        self._open.clear()


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The loader for what `path` holds: a folder with config.json (safetensors), else a .gguf file or a folder
    holding exactly one (model/gguf.py)."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return SafetensorsCheckpoint(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from twospeed.model.gguf import GGUFCheckpoint

        return GGUFCheckpoint(gguf_file)
    return SafetensorsCheckpoint(path)  # its model_config names what is missing


def load_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint at `path` (config.json, or a GGUF file's metadata)."""
    return open_checkpoint(path).model_config()


def load_weights(model: LlamaForCausalLM, checkpoint: Checkpoint | str | Path) -> None:
    """Hand every tensor of the checkpoint to the parameter it loads into (its `weight_loader`: a format owns its
    tensors, model/weight_format.py), checking names, shapes and that nothing is missing."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | None]] = {}
    for name, fname in ckpt.tensor_names():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        targets = model.checkpoint_targets(name)
        forms: dict[str, torch.Tensor | BlockTensor | None] = {}
        for target, shard in targets:
            if target not in params:
                raise CheckpointError(f"{fname}: unexpected tensor {ckpt.file_name(name)!r} for "
                                      f"{model.cfg.architecture}")
            param = params[target]
            tensor = _read_for(ckpt, name, param, forms)
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            except ShapeMismatch as e:
                raise CheckpointError(f"{fname}: tensor {ckpt.file_name(name)!r} has shape {tuple(tensor.shape)}, "
                                      f"expected {e.expected} from the checkpoint's config") from None
            loaded.setdefault(target, set()).add(shard)
    for target, param in params.items():
        shards = getattr(param, "num_shards", None)
        want = set(range(shards)) if shards else {None}
        for shard in sorted(want - loaded.get(target, set()), key=lambda x: -1 if x is None else x):
            raise CheckpointError(f"{ckpt.path}: tensor {ckpt.file_name(_hf_name(target, shard, model))!r} is "
                                  "missing from the checkpoint")


def _read_for(ckpt: Checkpoint, name: str, param: torch.nn.Parameter, forms: dict) -> torch.Tensor | BlockTensor:
    """Tensor `name` as `param` takes it, each form read once: the file's packed blocks where the parameter takes
    blocks and the file has them, else floats (a tied embedding and its output head may take one each)."""
    if getattr(param, "takes_blocks", False):
        if "blocks" not in forms:
            forms["blocks"] = ckpt.read_blocks(name)
        if forms["blocks"] is not None:
            return forms["blocks"]
    if "floats" not in forms:
        forms["floats"] = ckpt.read(name)
    return forms["floats"]


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
    """Build the model for the checkpoint at `path` on `device` in `dtype` (default: the checkpoint's) and load
    its weights; `model.checkpoint_formats` keeps how the file stored each kind of tensor (Checkpoint.formats).

    quantization: None (the checkpoint's weights in `dtype`), "int8" or "fp8" (quantized at load, model/quant.py),
    "q8_0", "q4_0", "q4_1", "q4_k" or "gguf" (GGUF block layouts kept packed: a GGUF file's tensors in them taken
    as stored, others quantized at load; model/block_quant.py).
    linear_backend: "auto" (on CPU in bf16 the C kernels: weights packed once; else oneDNN or the portable path;
    model/packed_linear.py), "cpu", "onednn" (unquantized only) or "torch" (portable).
    attention_backend: "auto" (the CPU decode kernel where it builds, else portable), "torch" or "cpu".
    kv_cache_dtype: how the attention layers store K and V: "auto" (the model's dtype), "bf16", "int8" or "fp8"
    (model/kv_format.py); the runner allocates the cache to match (model.kv_format)."""
    ckpt = open_checkpoint(path)
    cfg = ckpt.model_config()
    dtype = dtype or cfg.dtype
    fmt = make_weight_format(quantization, linear_backend, device, dtype, stored=cfg.dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_positions, attention_backend, fmt, make_kv_format(kv_cache_dtype, dtype))
            model.requires_grad_(False)
            load_weights(model, ckpt)
            model.finish_loading()
        model.checkpoint_formats = ckpt.formats()
    finally:
        torch.set_default_dtype(prev)
        ckpt.close()
    return model.eval()
