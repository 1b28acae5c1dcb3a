"""A decode step's decoder stack as one C call (csrc/decode_graph.c), where every piece of it has a C kernel.

A batch-1 decode step of a small model is a few hundred kernel calls of tens of microseconds each; made from
Python each also pays the interpreter, ctypes and torch's dispatch, about half the step on two cores. The graph
describes the model once (each layer's norm weights, its linears' kernel calls from `FormatLinear.graph_calls`,
its KV cache) and runs a step as one call: the same kernels in the same order as `LlamaForCausalLM.forward`, so
the hidden states are the Python path's bit for bit (tests/model/test_decode_graph.py).

It runs where all of these hold, else `build` returns None and the model keeps its Python path: CPU, float32
activations (a bf16 checkpoint computed in float32, or a quantized one), a float32 or bf16 KV cache read by
csrc/paged_attention.c, csrc/fused_f32.c built, no q/k norms, and every layer's linear in a format with a
float32 C kernel (bf16 widened, int8 widened, the GGUF block formats). A step takes it when every row is a
decode (no prefill chunk), the rows fit every kernel, and the model is not batch-invariant.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from twospeed.model.attention import AttentionMetadata
from twospeed.model.cbuild import load_library
from twospeed.model.cpu_attention import CpuPagedAttention, load_kernel
from twospeed.model.fused_ops import fused_f32_kernel
from twospeed.model.kv_format import Bf16KV
from twospeed.model.weight_format import GraphCall

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):  # csrc/graph.h's GraphLinear
    _fields_ = [("run", _P), ("w", _P), ("scale", _P), ("bias", _P), ("col", _L), ("kind", _I), ("N", _I),
                ("K", _I)]


class _Calls(ctypes.Structure):
    _fields_ = [("calls", ctypes.POINTER(_Linear)), ("n", _L)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Calls), ("o", _Calls), ("gate_up", _Calls),
                ("down", _Calls), ("k_cache", _P), ("v_cache", _P)]


class _Graph(ctypes.Structure):
    _fields_ = [(name, _L) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                        "block_size", "window", "kv_bf16")] + [
        ("eps", _F), ("scale", _F), ("layer", ctypes.POINTER(_Layer)), ("final_norm", _P), ("cos", _P),
        ("sin_signed", _P), ("norm", _P), ("silu_mul", _P), ("attend", _P)]


class _Group(ctypes.Structure):  # one DecodeGroup
    _fields_ = [("start", _L), ("n", _L), ("max_blocks", _L), ("tables", _P), ("lens", _P)]


@lru_cache(maxsize=1)
def graph_kernel() -> ctypes.CDLL | None:
    lib = load_library("decode_graph", {})
    if lib is not None:
        lib.decode_graph_run.argtypes = [ctypes.POINTER(_Graph), _P, _P, _P, ctypes.POINTER(_Group), _I, _P, _I, _I]
        lib.decode_graph_run.restype = _I
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, _P).value


def _calls(calls: list[GraphCall]) -> _Calls:
    arr = (_Linear * len(calls))(*(_Linear(c.run, c.weight, c.scale, c.bias, c.col, c.kind, c.out_features,
                                           c.in_features) for c in calls))
    return _Calls(arr, len(calls))


class DecodeGraph:
    """The model's decoder stack for decode-only steps, as one C call. Built once from a loaded model (`build`);
    the KV cache's addresses are taken on the first step and again whenever the runner's cache changes."""

    def __init__(self, model, layers: list[dict[str, list[GraphCall]]], max_rows: int):
        self.model, self.max_rows = model, max_rows
        cfg, first = model.cfg, model.layers[0].self_attn
        self.lib = graph_kernel()
        self._calls = [{name: _calls(c) for name, c in layer.items()} for layer in layers]  # kept alive
        self._layers = (_Layer * len(layers))()
        for out, lin, mod in zip(self._layers, self._calls, model.layers):
            out.input_norm = mod.input_layernorm.weight.data_ptr()
            out.post_norm = mod.post_attention_layernorm.weight.data_ptr()
            out.qkv, out.o, out.gate_up, out.down = lin["qkv"], lin["o"], lin["gate_up"], lin["down"]
        bf16_cache = model.kv_format.code == Bf16KV.code
        attend = load_kernel().paged_decode_f32_b16 if bf16_cache else load_kernel().paged_decode_f32
        self.graph = _Graph(
            layers=len(layers), hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, inter=cfg.intermediate_size, block_size=0, window=first.attn.window,
            kv_bf16=int(bf16_cache),
            eps=cfg.rms_norm_eps, scale=first.attn.scale, layer=self._layers, final_norm=model.norm.weight.data_ptr(),
            cos=model.rotary.cos.data_ptr(), sin_signed=model.rotary.sin_signed.data_ptr(),
            norm=_address(fused_f32_kernel().add_rms_norm_f32), silu_mul=_address(fused_f32_kernel().silu_mul_f32),
            attend=_address(attend))
        self._cache_key: int | None = None  # the KV cache bound into the layers (its first tensor's address)
        self._cache_fits = False

    @classmethod
    def build(cls, model) -> DecodeGraph | None:
        """The graph for a loaded LlamaForCausalLM, or None where a piece has no float32 C kernel here."""
        cfg = model.cfg
        if (cfg.qk_norm or model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu"
                or model.rotary.cos.dtype != torch.float32 or model.kv_format.code not in (0, Bf16KV.code)
                or graph_kernel() is None or fused_f32_kernel() is None or load_kernel() is None):
            return None
        layers, max_rows = [], 1 << 30
        for layer in model.layers:
            attn = layer.self_attn.attn
            if type(attn) is not CpuPagedAttention or not layer.input_layernorm.use_kernel or not layer.mlp.use_kernel:
                return None
            calls = {"qkv": layer.self_attn.qkv_proj.graph_calls(), "o": layer.self_attn.o_proj.graph_calls(),
                     "gate_up": layer.mlp.gate_up_proj.graph_calls(), "down": layer.mlp.down_proj.graph_calls()}
            if any(c is None for c in calls.values()):
                return None
            max_rows = min([max_rows, *(c.max_rows for cs in calls.values() for c in cs)])
            layers.append(calls)
        return cls(model, layers, max_rows)

    def takes(self, num_tokens: int, meta: AttentionMetadata,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step runs here: every row a decode, within every kernel's rows, not batch-invariant, and a
        cache whose blocks the attention kernel takes."""
        if meta.prefills or not 0 < num_tokens <= self.max_rows or self.model.batch_invariant:
            return False
        key = kv_caches[0][0].data_ptr()
        if key != self._cache_key:  # the runner's cache, first seen or replaced: bind its addresses
            block_size = kv_caches[0][0].shape[1]
            for out, (k, v) in zip(self._layers, kv_caches):
                out.k_cache, out.v_cache = k.data_ptr(), v.data_ptr()
            self.graph.block_size, self._cache_key = block_size, key
            self._cache_fits = block_size <= load_kernel().limits[2]
        return self._cache_fits

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the step's embeddings [T, hidden] -> the final norm's output [T, hidden]; writes K and V into the cache
        `takes` bound."""
        groups = (_Group * len(meta.decodes))(*(_Group(g.start, g.num_tokens, g.block_tables.shape[1],
                                                       g.block_tables.data_ptr(), g.seq_lens.data_ptr())
                                                for g in meta.decodes))
        x = x.contiguous()
        out = torch.empty_like(x)
        if self.lib.decode_graph_run(ctypes.byref(self.graph), x.data_ptr(), positions.data_ptr(),
                                     meta.slot_mapping.data_ptr(), groups, len(groups), out.data_ptr(), x.shape[0],
                                     torch.get_num_threads()):
            raise MemoryError(f"decode graph: no memory for a step of {x.shape[0]} rows")
        return out
