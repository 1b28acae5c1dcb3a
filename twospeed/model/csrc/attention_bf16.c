/* Attention over the paged KV cache in bf16 with AVX-512 BF16 (CPU, OpenMP): prefill chunks and decodes.
 *
 * Decode (decode_attention_bf16): one task per (sequence, KV head) walks the block table; for each key the G
 * query heads' scores are vdpbf16ps dot products against the key row read in place; 16 keys at a time the
 * online softmax (running max m, sum l) takes one vector exp, then the value rows, widened to float32, are
 * added with each head's probability. Same contract as csrc/paged_attention.c's paged_decode_bf16, which
 * stays the path for CPUs without AVX-512 BF16.
 *
 * Prefill (prefill_attention_bf16): causal attention of prefill chunks.
 * torch's CPU flash attention ran a 512-token, 12-head prefill at about 60 GFLOP/s here, a quarter of the
 * prompt's time; this kernel reads K and V in place from the cache blocks (the chunk's own K/V are already
 * written there), so a chunk that continues earlier ones or a prefix-cache hit needs no gather either.
 *
 * One task is 16 query rows of one KV head (row r = query token r / G, query head r % G of the G sharing that
 * KV head), with the rows in the 16 lanes of a vector. Scores for one key are one vdpbf16ps chain over the
 * head dim: the rows' queries packed as k pairs, the key's pairs broadcast from the cache. So the online
 * softmax (running max m, sum l) runs lane-wise over keys, 16 keys at a time. P times V is the same trick the
 * other way: the 16 rows' probabilities of two keys interleaved in one vector, V's pairs of those two keys
 * broadcast. Those pairs are built a tile of 16 keys at a time, the first time a thread needs that tile of
 * that (sequence, KV head), into a scratch buffer the thread keeps between calls (vtile below): a chunk
 * continuing a long prompt no longer re-transposes the whole context's V up front, and no buffer is allocated
 * per call. Scores, softmax and output accumulate in float32; P is rounded to bf16 for the second product, as
 * torch's flash attention does.
 *
 * q, out: [T, H, D] rows of the flat batch; k_cache, v_cache: [num_blocks, BS, KVH, row]; per sequence s:
 * tables[s] (max_blocks block ids), its queries are rows q_start[s] .. + q_len[s] at positions
 * ctx_len[s] - q_len[s] .. ctx_len[s] - 1. window > 0 keeps the last `window` keys. D even, D <= 256.
 *
 * Every kernel takes the cache's format (model/kv_format.py), `kv`: KV_PLAIN (bf16 rows of D), KV_INT8 (D int8
 * values, then the row's bf16 scale: D + 2 bytes) or KV_FP8 (D e4m3 bytes). An 8-bit element widens to exactly
 * one bf16 value, so scores are the same vdpbf16ps chains, times the key row's scale; the value row's scale
 * goes into the probability that weights it (decode: in float32; prefill: before P is rounded to bf16), while
 * the softmax's sum stays unscaled. rope_write quantizes K and V as Int8KV / Fp8KV encode them, bit for bit.
 */
/* Unsupported here unless -march=native enables these (model/cbuild.py skips on this mark, fails otherwise). */
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "twospeed-unsupported: needs AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAXD 256
#define MAXG 16

#define KV_PLAIN 0
#define KV_INT8 1
#define KV_FP8 2

/* bytes of one (token, KV head) row of the cache */
static inline int row_bytes(int D, int kv) { return kv == KV_PLAIN ? 2 * D : kv == KV_INT8 ? D + 2 : D; }

static inline const uint8_t *slot(const uint8_t *cache, const int64_t *table, int j, int BS, int KVH, int h, int RB) {
    return cache + (((int64_t)table[j / BS] * BS + j % BS) * KVH + h) * RB;
}

int attention_bf16_limits(int *max_g, int *max_d) { *max_g = MAXG; *max_d = MAXD; return 0; }

static inline __mmask32 tail32(int left) { return left >= 32 ? (__mmask32)0xffffffffu : (((__mmask32)1 << left) - 1); }
static inline __mmask16 tail16(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* 16 cache elements as float32: int8 exactly, e4m3 exactly (sign-extended, shifted by 7 and bit 14 cleared it
 * is the fp16 pattern of value / 2^8) */
static inline __m512 i8x16_f32(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
static inline __m512 f8x16_f32(__m128i b) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBFFF));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

/* elements 32c .. 32c + 31 of a row as bf16 (the tail past D is 0) */
static inline __attribute__((always_inline)) __m512bh row_bf16x32(const uint8_t *row, int c, int D, const int kv) {
    const __mmask32 mk = tail32(D - 32 * c);
    if (kv == KV_PLAIN) return (__m512bh)_mm512_maskz_loadu_epi16(mk, (const uint16_t *)row + 32 * c);
    const __m256i raw = _mm256_maskz_loadu_epi8(mk, row + 32 * c);
    const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
    if (kv == KV_INT8) return _mm512_cvtne2ps_pbh(i8x16_f32(hi), i8x16_f32(lo));
    return _mm512_cvtne2ps_pbh(f8x16_f32(hi), f8x16_f32(lo));
}

/* elements 16c .. 16c + 15 of a row as float32 (the tail past D is 0) */
static inline __attribute__((always_inline)) __m512 row_f32x16(const uint8_t *row, int c, int D, const int kv) {
    const __mmask16 mk = tail16(D - 16 * c);
    if (kv == KV_PLAIN)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)row + 16 * c)), 16));
    const __m128i raw = _mm_maskz_loadu_epi8(mk, row + 16 * c);
    return kv == KV_INT8 ? i8x16_f32(raw) : f8x16_f32(raw);
}

static inline float row_scale(const uint8_t *row, int D, int kv) {
    return kv == KV_INT8 ? kv_row_scale((const int8_t *)row, D) : 1.f;
}

/* element d of a row as bf16 bits (exact) */
static inline uint16_t row_elem_bf16(const uint8_t *row, int d, int kv) {
    if (kv == KV_PLAIN) { uint16_t h; memcpy(&h, row + 2 * d, 2); return h; }
    return f32_to_bf16(kv == KV_INT8 ? (float)(int8_t)row[d] : fp8_to_f32(row[d]));
}

/* Two vectors' adjacent lanes summed: lanes 0-7 from a's pairs, 8-15 from b's. */
static inline __m512 pair_sums(__m512 a, __m512 b) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

/* Lane j = the sum of d[j]'s lanes: 15 pair_sums, where 16 horizontal reductions are a long serial chain each. */
static inline __attribute__((always_inline)) __m512 hsum16(__m512 d[16]) {
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) d[i] = pair_sums(d[2 * i], d[2 * i + 1]);
    return d[0];
}

/* q, out: [n, H, D]; tables [n, max_blocks]; lens [n]: the query of sequence s sits at position lens[s] - 1.
 * A task is one sequence and a run of its KV heads: all of them when there are enough sequences to keep the
 * threads busy, so each key's row (every KV head, contiguous in the cache) streams from memory in order.
 * 16 keys at a time: each query row's 16 scores are 16 vdpbf16ps chains summed into one vector (hsum16); P is
 * rounded to bf16 (as the prefill kernel and torch's flash attention round it) so that P x V is vdpbf16ps too, two
 * keys a step: the two value rows interleaved (unpack lo/hi, which permutes the dims within 128-bit lanes; the
 * output undoes it) against the row's probability pair broadcast. A KV head's G rows accumulate in registers over
 * the 16 keys. GK, DK: G and D as compile-time constants for the common shapes (then those loops unroll), 0 = read
 * at run time. On this machine's AVX-512 the kernel is bound by vector instructions, not by memory. */
#define MAXROWS 64
static inline __attribute__((always_inline)) void decode_task(
        int task, int per_task, int chunks, const uint16_t *q, const uint8_t *k_cache, const uint8_t *v_cache,
        const int64_t *tables, const int64_t *lens, uint16_t *out, int H, int KVH, int D_, int BS, int max_blocks,
        int window, float scale, const int kv, const int GK, const int DK) {
    const int D = DK ? DK : D_, G = GK ? GK : H / KVH;
    const int DC = (D + 31) / 32, NA = 2 * DC, RB = row_bytes(D, kv);  /* NA accumulators a row (dims permuted) */
    const int64_t row_stride = (int64_t)KVH * RB;
    {
        const int s = task / chunks, h0 = (task % chunks) * per_task;
        const int h1 = h0 + per_task < KVH ? h0 + per_task : KVH, R = (h1 - h0) * G, len = (int)lens[s];
        const int start = (window > 0 && len > window) ? len - window : 0;
        const int64_t *table = tables + (int64_t)s * max_blocks;
        __m512bh qv[MAXROWS][MAXD / 32];
        __m512 acc[MAXROWS][MAXD / 16];
        float m[MAXROWS], l[MAXROWS], sc[MAXROWS][16];
        __m512 vscale[MAXROWS];  /* an int8 cache's value row scales of the tile's keys, per KV head */
        uint16_t pb[MAXROWS][16];  /* the tile's probabilities in bf16, read as pairs */
        for (int r = 0; r < R; r++) {  /* row r: query head h0 * G + r */
            const uint16_t *qr = q + ((int64_t)s * H + (int64_t)h0 * G + r) * D;
            for (int c = 0; c < DC; c++) qv[r][c] = (__m512bh)_mm512_maskz_loadu_epi16(tail32(D - 32 * c), qr + 32 * c);
            for (int c = 0; c < NA; c++) acc[r][c] = _mm512_setzero_ps();
            m[r] = -INFINITY; l[r] = 0.f;
        }
        int blk = start / BS, off = start % BS;  /* key j's block and offset, walked without divisions */
        /* the same walk 16 keys ahead, prefetching the next tile's rows: blocks are scattered, so the hardware
         * prefetcher stops at every block's end (5-15% at 32 decodes on 1-2k contexts, within noise below) */
        int pblk = (start + 16) / BS, poff = (start + 16) % BS;
        const int span = (h1 - h0) * RB;
        for (int j0 = start; j0 < len; j0 += 16) {
            const int nk = len - j0 < 16 ? len - j0 : 16;
            for (int jj = 0; jj < 16 && j0 + 16 + jj < len; jj++) {
                const int64_t at = ((int64_t)table[pblk] * BS + poff) * row_stride + (int64_t)h0 * RB;
                if (++poff == BS) { poff = 0; pblk++; }
                for (int b = 0; b < span; b += 64) {
                    _mm_prefetch((const char *)k_cache + at + b, _MM_HINT_T0);
                    _mm_prefetch((const char *)v_cache + at + b, _MM_HINT_T0);
                }
            }
            const uint8_t *krow[16], *vrow[16];  /* key jj's rows at KV head h0; past nk the last key's (masked) */
            for (int jj = 0; jj < 16; jj++) {
                if (jj < nk) {
                    const int64_t at = ((int64_t)table[blk] * BS + off) * row_stride + (int64_t)h0 * RB;
                    if (++off == BS) { off = 0; blk++; }
                    krow[jj] = k_cache + at; vrow[jj] = v_cache + at;
                } else {
                    krow[jj] = krow[nk - 1]; vrow[jj] = vrow[nk - 1];
                }
            }
            for (int hh = 0; hh < h1 - h0; hh++) {
                __m512 kscale = _mm512_set1_ps(scale);  /* 1 for unscaled rows: scale exactly */
                if (kv == KV_INT8) {
                    float ks[16], vs[16];
                    for (int jj = 0; jj < 16; jj++) {
                        ks[jj] = scale * row_scale(krow[jj] + (int64_t)hh * RB, D, kv);
                        vs[jj] = row_scale(vrow[jj] + (int64_t)hh * RB, D, kv);
                    }
                    kscale = _mm512_loadu_ps(ks);
                    vscale[hh] = _mm512_loadu_ps(vs);
                }
                for (int g = 0; g < G; g++) {
                    const int r = hh * G + g;
                    __m512 d[16];
                    for (int jj = 0; jj < 16; jj++) {
                        const uint8_t *kr = krow[jj] + (int64_t)hh * RB;
                        __m512 a = _mm512_setzero_ps();
                        for (int c = 0; c < DC; c++) a = _mm512_dpbf16_ps(a, qv[r][c], row_bf16x32(kr, c, D, kv));
                        d[jj] = a;
                    }
                    _mm512_storeu_ps(sc[r], _mm512_mul_ps(hsum16(d), kscale));
                }
            }
            const __mmask16 live = (__mmask16)((1u << nk) - 1);
            for (int r = 0; r < R; r++) {
                const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc[r]);
                const float mx = _mm512_reduce_max_ps(v), mnew = mx > m[r] ? mx : m[r];
                const float corr = expf(m[r] - mnew);  /* m = -inf at the first group: 0 */
                __m512 p = exp512(_mm512_sub_ps(v, _mm512_set1_ps(mnew)));
                l[r] = l[r] * corr + _mm512_reduce_add_ps(p);
                m[r] = mnew;
                if (corr != 1.f)
                    for (int c = 0; c < NA; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(corr));
                if (kv == KV_INT8) p = _mm512_mul_ps(p, vscale[r / G]);  /* the value row's scale weights its p */
                _mm256_storeu_si256((__m256i *)pb[r], (__m256i)_mm512_cvtneps_pbh(p));
            }
            for (int hh = 0; hh < h1 - h0; hh++) {
                __m512 a[MAXG][MAXD / 16];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < NA; c++) a[g][c] = acc[hh * G + g][c];
                for (int jj = 0; jj < nk; jj += 2) {  /* past nk: the last key's row, with p = 0 */
                    const uint8_t *v0 = vrow[jj] + (int64_t)hh * RB, *v1 = vrow[jj + 1] + (int64_t)hh * RB;
                    for (int c = 0; c < DC; c++) {
                        const __m512i x0 = (__m512i)row_bf16x32(v0, c, D, kv), x1 = (__m512i)row_bf16x32(v1, c, D, kv);
                        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                        for (int g = 0; g < G; g++) {
                            uint32_t pair;
                            memcpy(&pair, &pb[hh * G + g][jj], 4);
                            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)pair);
                            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], pw, lo);
                            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], pw, hi);
                        }
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < NA; c++) acc[hh * G + g][c] = a[g][c];
            }
        }
        for (int r = 0; r < R; r++) {  /* accumulator e = 2c + half, lane i: dim 32c + 8 (i / 4) + 4 half + i % 4 */
            uint16_t *op = out + ((int64_t)s * H + (int64_t)h0 * G + r) * D;
            const float inv = 1.f / l[r];
            for (int e = 0; e < NA; e++) {
                float lanes[16];
                _mm512_storeu_ps(lanes, acc[r][e]);
                for (int i = 0; i < 16; i++) {
                    const int dim = 32 * (e / 2) + 8 * (i / 4) + 4 * (e % 2) + i % 4;
                    if (dim < D) op[dim] = f32_to_bf16(lanes[i] * inv);
                }
            }
        }
    }
}

/* One parallel loop per (format, shape), each its own OpenMP region: GCC outlines a region before it inlines, so
 * constants passed into a function that holds the pragma would arrive in the region as run-time values. */
#define DECODE_LOOP(KV, GK, DK)                                                                                   \
    {                                                                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                     \
        for (int task = 0; task < n * chunks; task++)                                                             \
            decode_task(task, per_task, chunks, q, k, v, tables, lens, out, H, KVH, D, BS, max_blocks, window,    \
                        scale, KV, GK, DK);                                                                       \
    }
/* G and D fixed for the shapes Llama-family checkpoints use, read at run time otherwise */
#define DECODE_SHAPES(KV)                                                                                         \
    if (D == 64 && G == 1) DECODE_LOOP(KV, 1, 64)                                                                 \
    else if (D == 64 && G == 2) DECODE_LOOP(KV, 2, 64)                                                            \
    else if (D == 64 && G == 3) DECODE_LOOP(KV, 3, 64)                                                            \
    else if (D == 64 && G == 4) DECODE_LOOP(KV, 4, 64)                                                            \
    else if (D == 128 && G == 1) DECODE_LOOP(KV, 1, 128)                                                          \
    else if (D == 128 && G == 2) DECODE_LOOP(KV, 2, 128)                                                          \
    else if (D == 128 && G == 4) DECODE_LOOP(KV, 4, 128)                                                          \
    else DECODE_LOOP(KV, 0, 0)

void decode_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                           const int64_t *lens, uint16_t *out, int n, int H, int KVH, int D, int BS, int max_blocks,
                           int window, float scale, int kv, int threads) {
    const uint8_t *k = k_cache, *v = v_cache;
    const int G = H / KVH;
    int per_task = KVH;  /* KV heads per task: all of them unless the threads would run out of tasks */
    while (per_task > 1 && (per_task * G > MAXROWS || (int64_t)n * ((KVH + per_task - 1) / per_task) < 2 * threads))
        per_task = (per_task + 1) / 2;
    const int chunks = (KVH + per_task - 1) / per_task;
    if (kv == KV_INT8) { DECODE_SHAPES(KV_INT8) }
    else if (kv == KV_FP8) { DECODE_SHAPES(KV_FP8) }
    else { DECODE_SHAPES(KV_PLAIN) }
}

/* A thread's V scratch: for one (call, sequence, KV head) at a time, 16-key tiles of V as key pairs, tile t at
 * v + t * 8 * D laid out [pair p][dim d] = (v[16t + 2p][d], v[16t + 2p + 1][d]) (keys at or past the context are
 * 0, as padding must be for P x V), filled on first use: stamp[t] == epoch marks tile t as holding the current
 * (call, sequence, KV head). OpenMP's pooled threads keep it between calls, so steady state allocates nothing. */
typedef struct { uint32_t *v; uint64_t *stamp; int64_t cap, tiles; uint64_t epoch, call; int sh; } vscratch_t;
static __thread vscratch_t vscratch;
static uint64_t prefill_calls;  /* a fresh tag per call: a tile filled by an earlier call is never reused */

static void fill_vtile(uint32_t *dst, const uint8_t *v_cache, const int64_t *table, int t, int ctx, int BS, int KVH,
                       int h, int D, int kv) {
    const int RB = row_bytes(D, kv);
    for (int p = 0; p < 8; p++) {
        const int j = 16 * t + 2 * p;
        const uint8_t *a = j < ctx ? slot(v_cache, table, j, BS, KVH, h, RB) : NULL;
        const uint8_t *b = j + 1 < ctx ? slot(v_cache, table, j + 1, BS, KVH, h, RB) : NULL;
        if (kv != KV_PLAIN) {  /* 8-bit values widened to bf16 (exactly); their scale goes into P */
            for (int d = 0; d < D; d++)
                dst[p * D + d] = (a ? row_elem_bf16(a, d, kv) : 0u) | (uint32_t)(b ? row_elem_bf16(b, d, kv) : 0u) << 16;
            continue;
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
            const __mmask16 mk = tail16(D - d0);
            const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)a + d0))
                                 : _mm512_setzero_si512();
            const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)b + d0))
                                 : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(dst + p * D + d0, mk, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* Tile t of V's pairs for (call, sh = sequence * KVH + h), from the thread's scratch (filled if it is not yet),
 * or built into `spare` (8 * D values) where the scratch cannot grow to `tiles` tiles. */
static const uint32_t *vtile(const uint8_t *v_cache, const int64_t *table, int t, int ctx, int BS, int KVH, int h,
                             int D, int kv, uint64_t call, int sh, int64_t tiles, uint32_t *spare) {
    vscratch_t *sc = &vscratch;
    if (sc->tiles < tiles || sc->cap < 8 * D * tiles) {  /* grow (or first use): start empty */
        free(sc->v); free(sc->stamp);
        sc->v = malloc(sizeof(uint32_t) * 8 * D * tiles);
        sc->stamp = calloc(tiles, sizeof(uint64_t));
        const int ok = sc->v && sc->stamp;
        sc->cap = ok ? 8 * D * tiles : 0; sc->tiles = ok ? tiles : 0; sc->epoch = 0; sc->call = 0;
    }
    if (!sc->tiles) {
        fill_vtile(spare, v_cache, table, t, ctx, BS, KVH, h, D, kv);
        return spare;
    }
    if (sc->call != call || sc->sh != sh) { sc->call = call; sc->sh = sh; sc->epoch++; }
    uint32_t *dst = sc->v + (int64_t)t * 8 * D;
    if (sc->stamp[t] != sc->epoch) {
        fill_vtile(dst, v_cache, table, t, ctx, BS, KVH, h, D, kv);
        sc->stamp[t] = sc->epoch;
    }
    return dst;
}

void prefill_attention_bf16(const uint16_t *q, const void *k_cache_, const void *v_cache_,
                            const int64_t *tables, const int64_t *q_start, const int64_t *q_len,
                            const int64_t *ctx_len, uint16_t *out, int n, int H, int KVH, int D, int BS,
                            int max_blocks, int window, float scale, int kv, int threads) {
    const int G = H / KVH, D2 = D / 2, RB = row_bytes(D, kv);
    const uint8_t *k_cache = k_cache_, *v_cache = v_cache_;
    int64_t *task_off = malloc(sizeof(int64_t) * (n + 1));
    int64_t max_tiles = 1;
    task_off[0] = 0;
    for (int s = 0; s < n; s++) {
        task_off[s + 1] = task_off[s] + (int64_t)KVH * ((q_len[s] * G + 15) / 16);
        max_tiles = (ctx_len[s] + 15) / 16 > max_tiles ? (ctx_len[s] + 15) / 16 : max_tiles;
    }
    const uint64_t call = __atomic_add_fetch(&prefill_calls, 1, __ATOMIC_RELAXED);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < task_off[n]; task++) {
            int s = 0;
            while (task_off[s + 1] <= task) s++;
            const int64_t local = task - task_off[s], groups = (q_len[s] * G + 15) / 16;
            const int h = (int)(local / groups), rows = (int)(q_len[s] * G), r0 = (int)(local % groups) * 16;
            const int ctx = (int)ctx_len[s], first_pos = ctx - (int)q_len[s];
            const int64_t *table = tables + (int64_t)s * max_blocks;
            /* the rows' queries as k pairs: qp[c] lane r = (q[2c], q[2c+1]) of row r0 + r */
            __m512i qp[MAXD / 2];
            uint32_t lanes[16];
            int pos[16], lo = ctx, hi = 0;
            for (int c = 0; c < D2; c++) {
                for (int r = 0; r < 16; r++) {
                    const int row = r0 + r;
                    lanes[r] = 0;
                    if (row < rows) {
                        const uint16_t *qr = q + ((q_start[s] + row / G) * H + (int64_t)h * G + row % G) * D;
                        memcpy(&lanes[r], qr + 2 * c, 4);
                    }
                }
                qp[c] = _mm512_loadu_si512(lanes);
            }
            for (int r = 0; r < 16; r++) {
                const int row = r0 + r;
                pos[r] = row < rows ? first_pos + row / G : -1;  /* -1: an empty lane sees no key */
                if (row < rows) {
                    const int from = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
                    lo = from < lo ? from : lo;
                    hi = pos[r] + 1 > hi ? pos[r] + 1 : hi;
                }
            }
            const __m512i vpos = _mm512_loadu_si512(pos);
            const __m512i vfrom = window > 0 ? _mm512_sub_epi32(vpos, _mm512_set1_epi32(window - 1))
                                             : _mm512_set1_epi32(0);
            __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
            __m512 o[MAXD];
            uint32_t spare[8 * MAXD];  /* V's pairs of one tile, where the thread's scratch cannot grow */
            uint16_t kwide[16][MAXD] __attribute__((aligned(64)));  /* an 8-bit cache's keys of the tile, as bf16 */
            for (int d = 0; d < D; d++) o[d] = _mm512_setzero_ps();
            const __m512 vscale = _mm512_set1_ps(scale);
            const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int j0 = lo & ~15; j0 < hi; j0 += 16) {
                __m512 sc[16];
                float ks[16], vsc[16];  /* an 8-bit cache's K and V row scales of the tile's keys (1 for fp8) */
                for (int jj = 0; jj < 16 && kv != KV_PLAIN; jj++) {  /* its keys widened to bf16 once per tile */
                    const uint8_t *kr = slot(k_cache, table, j0 + jj < hi ? j0 + jj : hi - 1, BS, KVH, h, RB);
                    ks[jj] = row_scale(kr, D, kv);
                    vsc[jj] = row_scale(slot(v_cache, table, j0 + jj < hi ? j0 + jj : hi - 1, BS, KVH, h, RB), D, kv);
                    for (int d = 0; d < D; d++) kwide[jj][d] = row_elem_bf16(kr, d, kv);
                }
                for (int jj = 0; jj < 16; jj += 8) {
                    /* eight independent chains: one chain is a dependent vdpbf16ps per k pair, so fewer would
                     * leave the FMA units waiting on its latency */
                    const uint32_t *kr[8];
                    __m512 a[8];
                    for (int u = 0; u < 8; u++) {
                        /* keys past hi get a real key's address (masked below) so the loop stays branch-free */
                        const int j = j0 + jj + u;
                        kr[u] = kv == KV_PLAIN ? (const uint32_t *)slot(k_cache, table, j < hi ? j : hi - 1, BS, KVH, h, RB)
                                               : (const uint32_t *)kwide[jj + u];
                        a[u] = _mm512_setzero_ps();
                    }
                    for (int c = 0; c < D2; c++) {
                        const __m512bh qc = (__m512bh)qp[c];
                        for (int u = 0; u < 8; u++)
                            a[u] = _mm512_dpbf16_ps(a[u], qc, (__m512bh)_mm512_set1_epi32((int)kr[u][c]));
                    }
                    for (int u = 0; u < 8; u++) sc[jj + u] = a[u];
                }
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int jj = 0; jj < 16; jj++) {
                    const __m512i key = _mm512_set1_epi32(j0 + jj);
                    const __mmask16 seen = _mm512_cmp_epi32_mask(key, vpos, _MM_CMPINT_LE)
                                         & _mm512_cmp_epi32_mask(key, vfrom, _MM_CMPINT_NLT);
                    sc[jj] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen, sc[jj],
                                                kv == KV_INT8 ? _mm512_set1_ps(scale * ks[jj]) : vscale);
                    mx = _mm512_max_ps(mx, sc[jj]);
                }
                const __m512 mnew = _mm512_max_ps(m, mx);
                /* lanes that have seen no key yet keep m = -inf; use 0 there so exp gives 0, not NaN */
                const __mmask16 has = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __m512 muse = _mm512_maskz_mov_ps(has, mnew);
                const __m512 corr = exp512(_mm512_sub_ps(m, muse));
                __m512 sum = _mm512_setzero_ps();
                for (int jj = 0; jj < 16; jj++) {
                    sc[jj] = exp512(_mm512_sub_ps(sc[jj], muse));
                    sum = _mm512_add_ps(sum, sc[jj]);
                }
                l = _mm512_fmadd_ps(l, corr, sum);
                m = mnew;
                if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ))
                    for (int d = 0; d < D; d++) o[d] = _mm512_mul_ps(o[d], corr);
                if (kv == KV_INT8)  /* the sum above is unscaled; each value row's scale weights its probability */
                    for (int jj = 0; jj < 16; jj++) sc[jj] = _mm512_mul_ps(sc[jj], _mm512_set1_ps(vsc[jj]));
                __m512bh pp[8];
                for (int p = 0; p < 8; p++)
                    pp[p] = (__m512bh)_mm512_permutexvar_epi16(
                        interleave, (__m512i)_mm512_cvtne2ps_pbh(sc[2 * p + 1], sc[2 * p]));
                const uint32_t *vt = vtile(v_cache, table, j0 / 16, ctx, BS, KVH, h, D, kv, call, s * KVH + h,
                                           max_tiles, spare);
                for (int d = 0; d < D; d++) {
                    __m512 acc = o[d];
                    for (int p = 0; p < 8; p++)
                        acc = _mm512_dpbf16_ps(acc, pp[p], (__m512bh)_mm512_set1_epi32((int)vt[p * D + d]));
                    o[d] = acc;
                }
            }
            float ob[MAXD][16], lb[16];
            _mm512_storeu_ps(lb, l);
            for (int d = 0; d < D; d++) _mm512_storeu_ps(ob[d], o[d]);
            for (int r = 0; r < 16 && r0 + r < rows; r++) {
                const int row = r0 + r;
                uint16_t *dst = out + ((q_start[s] + row / G) * H + (int64_t)h * G + row % G) * D;
                const float inv = 1.0f / lb[r];
                for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(ob[d][r] * inv);
            }
        }
    }
    free(task_off);
}

/* One K or V row (D bf16 values in float) into the cache in its format, as model/kv_format.py encodes it: int8
 * scale = bf16(max |x| / 127), q = round-half-even(x / scale) clamped to 127; fp8 = e4m3(clamp(x, 448)). */
static void write_row(uint8_t *dst, const float *x, int D, int kv) {
    if (kv == KV_PLAIN) {
        for (int d = 0; d < D; d++) { const uint16_t h = f32_to_bf16(x[d]); memcpy(dst + 2 * d, &h, 2); }
    } else if (kv == KV_INT8) {
        float amax = 0.f;
        for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const uint16_t sb = f32_to_bf16(amax / 127.f);
        const float sf = bf16_to_f32(sb), safe = sf > 0.f ? sf : 1.f;
        for (int d = 0; d < D; d++) {
            float v = nearbyintf(x[d] / safe);
            v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
            dst[d] = (uint8_t)(int8_t)v;
        }
        memcpy(dst + D, &sb, 2);
    } else {
        for (int d = 0; d < D; d++) dst[d] = f32_to_fp8(x[d] > 448.f ? 448.f : x[d] < -448.f ? -448.f : x[d]);
    }
}

/* RoPE on q and k and the cache write, one pass (decode steps paid ~10 small torch ops per layer for it).
 * qkv: [T, (H + 2 KVH) D] rows (stride ldqkv); cos, sin_signed: [T, D] (this step's positions, model dtype);
 * q_out: [T, H, D]; k and v go to cache slot slots[t], in the cache's format. As HF in bf16: x * cos and
 * roll(x, D/2) * sin are each rounded, then their sum. */
void rope_write_bf16(const uint16_t *qkv, int64_t ldqkv, const uint16_t *cos, const uint16_t *sin_signed,
                     const int64_t *slots, uint16_t *q_out, void *k_cache_, void *v_cache_, int T, int H,
                     int KVH, int D, int kv, int threads) {
    const int half = D / 2, RB = row_bytes(D, kv);
    uint8_t *k_cache = k_cache_, *v_cache = v_cache_;
    #pragma omp parallel for num_threads(T >= 16 ? threads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * ldqkv, *c = cos + (int64_t)t * D, *s = sin_signed + (int64_t)t * D;
        float x[MAXD];
        for (int h = 0; h < H + KVH; h++) {
            const uint16_t *in = row + (int64_t)h * D;
            for (int d = 0; d < D; d++) {
                const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(in[d]) * bf16_to_f32(c[d])));
                const float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(in[(d + half) % D]) * bf16_to_f32(s[d])));
                x[d] = bf16_to_f32(f32_to_bf16(a + b));
            }
            if (h < H)
                for (int d = 0; d < D; d++) q_out[((int64_t)t * H + h) * D + d] = f32_to_bf16(x[d]);
            else
                write_row(k_cache + (slots[t] * KVH + (h - H)) * RB, x, D, kv);
        }
        if (kv == KV_PLAIN) {
            memcpy(v_cache + slots[t] * KVH * RB, row + (int64_t)(H + KVH) * D, sizeof(uint16_t) * KVH * D);
            continue;
        }
        for (int h = 0; h < KVH; h++) {
            const uint16_t *in = row + (int64_t)(H + KVH + h) * D;
            for (int d = 0; d < D; d++) x[d] = bf16_to_f32(in[d]);
            write_row(v_cache + (slots[t] * KVH + h) * RB, x, D, kv);
        }
    }
}
