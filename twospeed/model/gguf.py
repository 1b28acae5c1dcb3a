"""A GGUF file as a checkpoint: the model's shape from its metadata, its tensors under HF names, dequantized.

GGUF (llama.cpp's format) keeps the config, the tokenizer (model/gguf_tokenizer.py) and the weights in one file,
read here with the `gguf` package, memory-mapped. The Llama family loads, as GGUF names it: `llama` (Mistral's
files say `llama` too), `mistral`, `qwen2` (q/k/v biases), `qwen3` (q/k RMSNorm). Which optional parts a layer
has (biases, q/k norms) is read from the tensors present, so the ModelConfig is the one config.json would give,
and a part llama.py has no place for is an error that names it, never a tensor silently dropped.

Two things differ from a safetensors checkpoint:

- Weights are stored in llama.cpp's block formats (Q4_0 ... Q6_K) or as floats; each is dequantized at load,
  with the package's own `gguf.quants.dequantize`, to float32 (exact), then stored by its parameter in the
  dtype the model computes in (or quantized to int8 / fp8 from those exact values). A linear of a block format
  (quantization q8_0, q4_0, q4_1, q4_k or gguf: model/block_quant.py) instead takes a tensor stored in Q8_0,
  Q4_0, Q4_1 or Q4_K as its packed bytes (`read_blocks`), never dequantized. The file's format per kind of
  tensor is kept (`formats`), for /v1/models to report.
- llama.cpp's converter reorders the rows of Q and K in llama-architecture files so that its rotary embedding
  (which rotates adjacent pairs) computes what HF's (which rotates the two halves of a head) does; the reorder
  is undone here exactly (`unpermute_rotary`), so the weights are HF's. Qwen files are stored unpermuted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from twospeed.config import ModelConfig
from twospeed.model.block_kinds import KINDS, BlockTensor
from twospeed.model.checkpoint_files import CheckpointError, gguf_reader, release_gguf_reader
from twospeed.model.loader import Checkpoint, summarize_formats, tensor_kind

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
ROTARY_PERMUTED = {"llama", "mistral"}  # llama.cpp's converter reorders Q and K rows of these (see the module)
LOADABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
QUANTIZED_TYPES = tuple(t for t in LOADABLE_TYPES if t not in ("F32", "F16", "BF16"))  # fewer bits than any float

_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_MODEL_PARTS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: the llama3 rope scaling, as a factor per frequency
_LARGE_KEYS = ("tokenizer.ggml.",)  # vocabularies: read by the tokenizer, not needed for the config


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> the HF name the loader maps (None: no such tensor in the Llama family)."""
    base, _, leaf = gguf_name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    if base.startswith("blk."):
        _, layer, part = (base.split(".", 2) + [""])[:3]
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{leaf}" if part in _LAYER_PARTS else None
    return f"{_MODEL_PARTS[base]}.{leaf}" if base in _MODEL_PARTS else None


def gguf_tensor_name(hf_name: str) -> str:
    """The HF name -> llama.cpp's (the inverse of hf_tensor_name, for messages about a tensor the file lacks)."""
    base, _, leaf = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        names = {v: k for k, v in _LAYER_PARTS.items()}
        return f"blk.{layer}.{names.get(part, part)}.{leaf}"
    return f"{ {v: k for k, v in _MODEL_PARTS.items()}.get(base, base)}.{leaf}"


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reorder of a Q or K weight (or bias) with `num_heads` heads: within each head it stores
    row pairs (i, i + half) next to each other; HF's layout has the halves apart."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp converter's reorder (the inverse of unpermute_rotary): what a llama GGUF stores for HF's Q or K."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """A reader tensor's values as float32 [rows, columns] (HF's order), through gguf's own dequantize."""
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(tensor.data, tensor.tensor_type)  # F32: a view of the read-only map, copied below
    out = np.array(out, dtype=np.float32, copy=not out.flags.writeable)
    return out.reshape(tuple(reversed(tensor.shape.tolist())))


class GGUFCheckpoint(Checkpoint):
    """One .gguf file (model/checkpoint_files.py finds it in a folder)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        from gguf import GGUFValueType

        self.reader = gguf_reader(path)
        self.metadata = {name: field.contents() for name, field in self.reader.fields.items()
                         if not (name.startswith(_LARGE_KEYS) and field.types[:1] == [GGUFValueType.ARRAY])}
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._by_hf = {hf: n for n in self.tensors if (hf := hf_tensor_name(n)) is not None}
        self.arch = self.metadata.get("general.architecture")
        self._config: ModelConfig | None = None

    def _key(self, name: str, default: Any = None, *, required: bool = False) -> Any:
        key = f"{self.arch}.{name}"
        if key not in self.metadata:
            if required:
                raise CheckpointError(f"{self.path.name}: metadata {key!r} is missing")
            return default
        return self.metadata[key]

    def _shape(self, gguf_name: str) -> tuple[int, ...]:
        return tuple(reversed(self.tensors[gguf_name].shape.tolist()))

    def _has(self, part: str) -> bool:
        return any(n.startswith("blk.") and n.endswith(f".{part}") for n in self.tensors)

    def model_config(self) -> ModelConfig:
        if self._config is None:
            self._config = self._read_config()
        return self._config

    def _read_config(self) -> ModelConfig:
        name = self.path.name
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"{name}: architecture {self.arch!r} is not supported; supported GGUF "
                                  f"architectures: {sorted(ARCHITECTURES)}")
        self._check_types()
        if self._key("expert_count", 0):
            raise CheckpointError(f"{name}: a mixture of experts ({self._key('expert_count')} experts): twospeed's "
                                  "Llama has dense MLPs only")
        unknown = sorted(n for n in self.tensors if n != _ROPE_FREQS and hf_tensor_name(n) is None)
        if unknown:
            raise CheckpointError(f"{name}: tensor {unknown[0]!r} has no place in twospeed's {self.arch} model "
                                  f"({len(unknown)} such tensors)")
        if "token_embd.weight" not in self.tensors:
            raise CheckpointError(f"{name}: tensor 'token_embd.weight' is missing")
        hidden = self._key("embedding_length", required=True)
        heads = self._key("attention.head_count", required=True)
        kv_heads = self._uniform("attention.head_count_kv", heads)
        head_dim = self._key("attention.key_length", hidden // heads)
        if self._key("attention.value_length", head_dim) != head_dim:
            raise CheckpointError(f"{name}: value heads of {self._key('attention.value_length')} dimensions beside "
                                  f"key heads of {head_dim}: twospeed's attention needs them equal")
        rotary = self._key("rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise CheckpointError(f"{name}: rotary embedding over {rotary} of {head_dim} head dimensions (partial "
                                  "rotary) is not supported")
        architecture = ARCHITECTURES[self.arch]
        if self.arch == "llama" and "mistral" in str(self.metadata.get("general.name", "")).lower():
            architecture = ARCHITECTURES["mistral"]  # llama.cpp writes Mistral as llama
        return ModelConfig(
            architecture=architecture,
            vocab_size=self._shape("token_embd.weight")[0],
            hidden_size=hidden,
            intermediate_size=self._key("feed_forward_length", required=True),
            num_layers=self._key("block_count", required=True),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._key("context_length", 4096),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias=self._has("attn_q.bias"),
            o_bias=self._has("attn_output.bias"),
            mlp_bias=self._has("ffn_up.bias"),
            qk_norm=self._has("attn_q_norm.weight"),
            sliding_window=self._key("attention.sliding_window") or None,
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                                if (i := self.metadata.get(f"tokenizer.ggml.{key}")) is not None),
            dtype=self._stored_dtype(),
            quantized_weights=any(t.tensor_type.name in QUANTIZED_TYPES for t in self.tensors.values()),
        )

    def _uniform(self, key: str, default: int) -> int:
        value = self._key(key, default)
        if isinstance(value, list):  # one count per layer
            if len(set(value)) != 1:
                raise CheckpointError(f"{self.path.name}: {self.arch}.{key} differs between layers ({value}): "
                                      "twospeed's layers share one shape")
            value = value[0]
        return int(value)

    def _rope_scaling(self) -> dict | None:
        kind = self._key("rope.scaling.type", "none")
        if _ROPE_FREQS in self.tensors:
            if kind not in ("none", None):
                raise CheckpointError(f"{self.path.name}: both {_ROPE_FREQS!r} and rope scaling {kind!r}")
            factors = dequantize(self.tensors[_ROPE_FREQS]).reshape(-1)
            return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
        if kind in ("none", None):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._key("rope.scaling.factor", 1.0))}
        raise CheckpointError(f"{self.path.name}: rope scaling {kind!r} is not supported (none, linear, and the "
                              "llama3 frequency factors)")

    def _check_types(self) -> None:
        for t in self.tensors.values():
            if t.tensor_type.name not in LOADABLE_TYPES:
                raise CheckpointError(f"{self.path.name}: tensor {t.name!r} is stored as {t.tensor_type.name}, which "
                                      f"twospeed cannot load (loadable: {', '.join(LOADABLE_TYPES)})")

    def _stored_dtype(self) -> torch.dtype:
        """The dtype that holds the file's weights exactly: a quantized or float32 matrix needs float32; all in
        bf16 (or all in f16) keep theirs. `dtype: auto` computes from this (model/compute_dtype.py)."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) > 1}
        if kinds == {"BF16"}:
            return torch.bfloat16
        if kinds == {"F16"}:
            return torch.float16
        return torch.float32

    def tensor_names(self) -> list[tuple[str, str]]:
        return [(hf, self.path.name) for n in self.tensors if (hf := hf_tensor_name(n)) is not None]

    def file_name(self, hf_name: str) -> str:
        return self._by_hf.get(hf_name) or gguf_tensor_name(hf_name)

    def read(self, name: str) -> torch.Tensor:
        gguf_name = self._by_hf[name]
        return self._hf_rows(gguf_name, torch.from_numpy(dequantize(self.tensors[gguf_name])))

    def read_blocks(self, name: str) -> BlockTensor | None:
        """A matrix stored in Q8_0, Q4_0, Q4_1 or Q4_K as its bytes [rows, row_bytes], rows in HF's order."""
        gguf_name = self._by_hf[name]
        t = self.tensors[gguf_name]
        kind = KINDS.get(t.tensor_type.name)
        if kind is None or len(t.shape) != 2:
            return None
        rows, cols = reversed(t.shape.tolist())
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, kind.row_bytes(cols))  # a copy
        return BlockTensor(kind, self._hf_rows(gguf_name, data), (rows, cols))

    def _hf_rows(self, gguf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Rows of a tensor (floats or packed blocks, one row per output) in HF's order: llama.cpp's Q/K reorder
        undone."""
        if self.arch in ROTARY_PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight",
                                                                "attn_k.bias")):
            cfg = self.model_config()
            tensor = unpermute_rotary(tensor, cfg.num_heads if ".attn_q." in gguf_name else cfg.num_kv_heads)
        return tensor

    def formats(self) -> dict[str, str]:
        return summarize_formats([(tensor_kind(hf), t.tensor_type.name) for n, t in self.tensors.items()
                                  if (hf := hf_tensor_name(n)) is not None and hf.endswith(".weight")])

    def close(self) -> None:
        self.tensors.clear()
        self.reader = None
        release_gguf_reader(self.path)
