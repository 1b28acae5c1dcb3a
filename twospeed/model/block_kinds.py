"""GGUF's block layouts: the bytes of Q8_0, Q4_0, Q4_1, Q4_K and Q6_K, quantized and dequantized.

A block-quantized weight is stored row by row, each row a run of blocks along the input dimension, exactly as a
GGUF file (llama.cpp's ggml-common.h) lays it out, so a tensor read from a file is used byte for byte:

  Q8_0  32 weights in 34 bytes: fp16 d, 32 x int8 q                        w = d q
  Q4_0  32 weights in 18 bytes: fp16 d, 16 bytes of nibbles                w = d (q - 8)
  Q4_1  32 weights in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles        w = d q + m
  Q4_K  256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scale and min per 32, 128 bytes of
        nibbles                                                            w = (d sc_j) q - (dmin m_j)
  Q6_K  256 weights in 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, an int8 scale per 16, fp16 d
                                                                           w = (d sc_j) (q - 32)

In the 32-blocks, byte i holds weight i (low nibble) and weight i + 16 (high); in Q4_K, 32 bytes hold two
sub-blocks of 32 (low nibbles the first, high the second). `dequantize` computes what gguf's own
`gguf.quants.dequantize` does, in the same float32 operations (so the two agree bit for bit: the portable path
multiplies by exactly the weights the file means). `quantize` for Q8_0, Q4_0 and Q4_1 is gguf's quantizer (the
reference implementation's arithmetic), equal to it byte for byte; gguf has no Q4_K quantizer, so Q4_K's is
llama.cpp's `quantize_row_q4_K_ref` (the weighted scale-and-min search, 6-bit scales relative to the
super-block's largest). On a CPU with a C compiler it runs as csrc/linear_qblock_quant.c (a few ns a weight; its
Q4_K sums in llama.cpp's order, so its bytes are llama.cpp's), elsewhere as torch ops here (`quantize_portable`;
Q4_K's sums in another order: a few super-blocks in a hundred differ by a level). tests/model/test_block_quant.py
holds all of this against the gguf package (and llama.cpp's library where one is built).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from twospeed.model.cbuild import load_library
from twospeed.schema.formats import BLOCK_LAYOUTS

QK = 32  # weights per block (per sub-block in Q4_K)
QK_K = 256  # weights per Q4_K super-block
_CHUNK = 1 << 22  # weights quantized at once (bounds the temporaries of a large tensor)


@lru_cache(maxsize=1)
def quantize_kernel() -> ctypes.CDLL | None:
    """csrc/linear_qblock_quant.c, built on first use; None without a C compiler."""
    p, i, l64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    return load_library("linear_qblock_quant", {"qblock_quantize": [p, l64, i, i, i, p, i]})


@dataclass(frozen=True, slots=True)
class BlockTensor:
    """A weight as a GGUF file stores it in a block format: `data` uint8 [rows, row_bytes], `shape` its logical
    [rows, columns] (what a ShapeMismatch names). The loader hands these to linears that take blocks."""

    kind: BlockKind
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return self.kind.dequantize(self.data, self.shape[1])


class BlockKind:
    """One block layout: its sizes, and its bytes from and to float32 weights [rows, K]."""

    name: str  # GGUF's type name
    block: int  # weights per block (the input width must be a multiple): schema/formats.py's BLOCK_LAYOUTS
    block_bytes: int
    code: int  # csrc/linear_qblock.c's KIND_*
    # csrc/linear_qblock.c's grouped layout (KIND_X8), where the kind has one: the block's fields as (first byte,
    # bytes, run), each field of 8 rows stored one after the other, `run` bytes of each row at a time
    x8_fields: tuple[tuple[int, int, int], ...] = ()

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.block_bytes

    def fits(self, k: int) -> bool:
        return k > 0 and k % self.block == 0

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """w [rows, K] (any float dtype; K a multiple of the block) -> uint8 [rows, row_bytes]: in C on a CPU that
        builds it, else in torch."""
        lib = quantize_kernel() if w.device.type == "cpu" else None
        return self.quantize_portable(w) if lib is None else self._chunks(w, lambda x, out: lib.qblock_quantize(
            x.data_ptr(), x.stride(0), self.code, x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()))

    def quantize_portable(self, w: torch.Tensor) -> torch.Tensor:
        """`quantize` in torch ops (any device)."""
        return self._chunks(w, lambda x, out: out.copy_(self._quantize_blocks(x.reshape(-1, self.block))
                                                        .reshape(out.shape)))

    def _chunks(self, w: torch.Tensor, fill) -> torch.Tensor:
        """Quantize w [rows, K] a chunk of rows at a time (bounds the float32 copies of a large tensor)."""
        rows, k = w.shape
        if not self.fits(k):
            raise ValueError(f"{self.name} takes rows of a multiple of {self.block} weights, got {k}")
        out = torch.empty(rows, self.row_bytes(k), dtype=torch.uint8, device=w.device)
        step = max(1, _CHUNK // k)
        for r in range(0, rows, step):
            fill(w[r:r + step].float().contiguous(), out[r:r + step])
        return out

    def dequantize(self, data: torch.Tensor, k: int) -> torch.Tensor:
        """uint8 [rows, row_bytes] -> float32 [rows, K], as gguf.quants.dequantize computes it."""
        blocks = data.reshape(-1, self.block_bytes)
        return self._dequantize_blocks(blocks).reshape(data.shape[0], k)

    def group_rows(self, data: torch.Tensor) -> torch.Tensor:
        """GGUF rows uint8 [rows, row_bytes] -> the same bytes in csrc/linear_qblock.c's grouped layout (KIND_X8):
        per group of 8 rows and block, each of `x8_fields` in turn, `run` bytes of each of the 8 rows at a time (the
        rows' scales side by side, then their quants 4 bytes of each row at a time); the last rows % 8 rows stay as
        they are."""
        g, nb = data.shape[0] // 8, data.shape[1] // self.block_bytes
        full = data[:8 * g].reshape(g, 8, nb, self.block_bytes)
        fields = [full[..., at:at + n].reshape(g, 8, nb, n // run, run).permute(0, 2, 3, 1, 4).reshape(g, nb, 8 * n)
                  for at, n, run in self.x8_fields]
        return torch.cat((torch.cat(fields, dim=2).reshape(8 * g, data.shape[1]), data[8 * g:]))

    def ungroup_rows(self, data: torch.Tensor) -> torch.Tensor:
        """The inverse of group_rows: GGUF's rows again."""
        g, nb = data.shape[0] // 8, data.shape[1] // self.block_bytes
        full = data[:8 * g].reshape(g, nb, 8 * self.block_bytes)
        rows = torch.empty(g, 8, nb, self.block_bytes, dtype=data.dtype, device=data.device)
        start = 0
        for at, n, run in self.x8_fields:
            field = full[..., start:start + 8 * n].reshape(g, nb, n // run, 8, run)
            rows[..., at:at + n] = field.permute(0, 3, 1, 2, 4).reshape(g, 8, nb, n)
            start += 8 * n
        return torch.cat((rows.reshape(8 * g, data.shape[1]), data[8 * g:]))

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> their fp16 value as float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 (round to nearest even, as numpy's astype) as bytes [n, 2]."""
    return v.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (gguf's `np.where(d == 0, 0, 1 / d)`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _over(num: float, t: torch.Tensor) -> torch.Tensor:
    """num / t rounded once, as C divides (torch computes `num / t` as num * (1 / t): two roundings)."""
    return torch.full_like(t, num) / t


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] values 0..15 -> [n, 16] bytes: byte i = q[i] | q[i + 16] << 4."""
    return q[:, :16] | (q[:, 16:] << 4)


def _unnibble(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values 0..15 (the inverse of _nibbles)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _round_away(n: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as gguf's np_roundf (floor of the magnitude plus its doubled fraction)."""
    a = n.abs()
    f = a.floor()
    return n.sign() * (f + (2 * (a - f)).floor())


class Q8_0(BlockKind):
    name, code = "Q8_0", 0
    block, block_bytes = BLOCK_LAYOUTS[name]
    x8_fields = ((0, 2, 2), (2, 32, 4))

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat((_f16_bytes(d), q), dim=1)

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


class Q4_0(BlockKind):
    name, code = "Q4_0", 1
    block, block_bytes = BLOCK_LAYOUTS[name]
    x8_fields = ((0, 2, 2), (2, 16, 4))

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # the signed value of largest magnitude
        d = peak / -8
        q = torch.trunc(x * _inverse(d) + 8.5).clamp_(0, 15).to(torch.uint8)
        return torch.cat((_f16_bytes(d), _nibbles(q)), dim=1)

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        return _f16(b[:, :2]) * (_unnibble(b[:, 2:]).to(torch.int8) - 8).float()


class Q4_1(BlockKind):
    name, code = "Q4_1", 2
    block, block_bytes = BLOCK_LAYOUTS[name]
    x8_fields = ((0, 4, 2), (4, 16, 4))

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp_(0, 15).to(torch.uint8)
        return torch.cat((_f16_bytes(d), _f16_bytes(lo), _nibbles(q)), dim=1)

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        return _f16(b[:, :2]) * _unnibble(b[:, 4:]).float() + _f16(b[:, 2:4])


class Q4_K(BlockKind):
    name, code = "Q4_K", 3
    block, block_bytes = BLOCK_LAYOUTS[name]
    x8_fields = ((0, 4, 2), (4, 12, 1), (16, 128, 4))  # d and dmin; the 12 scale bytes; the nibbles

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        sub = x.reshape(n * 8, QK)
        scale, mins, best = _scale_min_search(sub)
        scale, mins = scale.reshape(n, 8), mins.reshape(n, 8)
        max_scale, max_min = _positive(scale.amax(dim=1)), _positive(mins.amax(dim=1))
        ls = torch.round(_per_step(max_scale)[:, None] * scale).clamp_(0, 63).to(torch.uint8)
        lm = torch.round(_per_step(max_min)[:, None] * mins).clamp_(0, 63).to(torch.uint8)
        d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
        d = d16.float()[:, None] * ls.float()  # [n, 8]: each sub-block's step, as the dequantizer will see it
        dm = dmin16.float()[:, None] * lm.float()
        q = torch.round((x.reshape(n, 8, QK) + dm[..., None]) / d[..., None]).clamp_(0, 15)
        q = torch.where((d == 0)[..., None], best.reshape(n, 8, QK), q).to(torch.uint8)  # llama.cpp keeps the search's
        qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # 32 bytes: sub-block 2i low, 2i + 1 high
        return torch.cat((d16[:, None].view(torch.uint8), dmin16[:, None].view(torch.uint8), _pack_scales(ls, lm), qs),
                         dim=1)

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        n = b.shape[0]
        sc, m = _unpack_scales(b[:, 4:16])
        d = (_f16(b[:, :2]) * sc.float()).reshape(n, 8, 1)
        dm = (_f16(b[:, 2:4]) * m.float()).reshape(n, 8, 1)
        qs = b[:, 16:].reshape(n, 4, 1, 32)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, QK).float()
        return (d * q - dm).reshape(n, QK_K)


class Q6_K(BlockKind):
    """Read from GGUF files as stored (llama.cpp's Q4_K_M and Q5_K_M keep some tensors in it); no quantizer here:
    a format that stores every linear in one kind never picks it."""

    name, code = "Q6_K", 4
    block, block_bytes = BLOCK_LAYOUTS[name]
    x8_fields = ((208, 2, 2), (192, 16, 1), (0, 128, 4), (128, 64, 4))  # d; the 16 scales; low nibbles; high bits

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        raise ValueError("Q6_K is kept as a GGUF file stores it: twospeed does not quantize into it")

    def _quantize_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(x)

    def _dequantize_blocks(self, b: torch.Tensor) -> torch.Tensor:
        """gguf's order: per half of 128, 32-weight runs from the low nibbles of ql[0:32], ql[32:64], then their
        high nibbles, each with 2 bits of qh[0:32] (bits 0-1, 2-3, 4-5, 6-7) on top; minus 32; times d * scale
        per 16 (int8 scales)."""
        n = b.shape[0]
        ql = b[:, :128].reshape(n, 2, 1, 64)
        ql = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 8, 32)
        qh = b[:, 128:192].reshape(n, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
        return (d * q).reshape(n, QK_K)


def _scale_min_search(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants(32, 15, x, weights, ..., rmin=-1, rdelta=0.1, nstep=20) with q4_K's weights
    (the sub-block's RMS plus |x|), for every sub-block x [n, 32]: (scale, -min, the levels it chose)."""
    w = (x * x).mean(dim=1, keepdim=True).sqrt() + x.abs()
    lo, hi = x.amin(dim=1, keepdim=True).clamp_max(0), x.amax(dim=1, keepdim=True)
    span = hi - lo
    flat = span == 0
    span = torch.where(flat, torch.ones_like(span), span)
    sum_w, sum_x = w.sum(dim=1, keepdim=True), (w * x).sum(dim=1, keepdim=True)
    iscale = _over(15, span)
    level = torch.round(iscale * (x - lo)).clamp_(0, 15)
    scale, mn = 1 / iscale, lo
    best_err = (w * (scale * level + mn - x) ** 2).sum(dim=1, keepdim=True)
    for step in range(21):  # as in llama.cpp, each step measures from the best min found so far
        iscale = (torch.tensor(-1.0) + torch.tensor(0.1) * step + 15) / (hi - mn)
        la = torch.round(iscale * (x - mn)).clamp_(0, 15)
        sum_l, sum_l2, sum_xl = ((w * la * t).sum(dim=1, keepdim=True) for t in (1, la, x))
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale, this_min = (sum_w * sum_xl - sum_x * sum_l) / safe, (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = (w * (this_scale * la + this_min - x) ** 2).sum(dim=1, keepdim=True)
        better = ok & (err < best_err)
        level, best_err = torch.where(better, la, level), torch.where(better, err, best_err)
        scale, mn = torch.where(better, this_scale, scale), torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    level = torch.where(flat, torch.zeros_like(level), level)
    return scale[:, 0], -mn[:, 0], level


def _positive(v: torch.Tensor) -> torch.Tensor:
    """v where it is above 0, else +0 (llama.cpp's running maximum from 0: never -0, which fp16 would keep)."""
    return torch.where(v > 0, v, torch.zeros_like(v))


def _per_step(top: torch.Tensor) -> torch.Tensor:
    """63 / top, and 0 where top is 0: what scales the 6-bit levels of a super-block."""
    return torch.where(top > 0, _over(63, torch.where(top > 0, top, torch.ones_like(top))), torch.zeros_like(top))


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [n, 8] -> Q4_K's 12 bytes (sub-blocks 0-3 whole in bytes 0-7, 4-7 split)."""
    out = torch.empty(ls.shape[0], 12, dtype=torch.uint8, device=ls.device)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def _unpack_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes [n, 12] -> (scales, mins) [n, 8] (llama.cpp's get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


KINDS: dict[str, BlockKind] = {k.name: k for k in (Q8_0(), Q4_0(), Q4_1(), Q4_K(), Q6_K())}
