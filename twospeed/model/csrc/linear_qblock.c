/* Linear layers over GGUF block-quantized weights kept packed (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), for AVX2 + FMA + F16C.
 *
 * A decode step streams every weight once, so the bytes a weight costs set the step's floor: 1.06 bytes in Q8_0,
 * 0.56 in Q4_0 and Q4_K, 0.63 in Q4_1, 0.82 in Q6_K (bf16: 2, float32: 4). The weights stay in GGUF's own layout
 * (model/block_kinds.py): rows of blocks along k, each block its fp16 scale (and min) beside its 8- or 4-bit values;
 * every kind may come with its rows grouped by 8 (KIND_X8, below), the same bytes in the kernel's order.
 *
 * Decode steps and the prompt chunks beside them (linear_qblock, any number of rows; model/block_quant.py's
 * QBLOCK_MAX_ROWS says how many go here) run as llama.cpp's CPU path does: each activation
 * row is quantized to int8 per block of 32 (a float32 scale dx = max|x| / 127 per block, q = nearest(x / dx)),
 * and every weight block, read once, is multiplied by the activation blocks of QB_PASS rows at a time in integers
 * (vpmaddubsw + vpmaddwd, or one vpdpbusd where the CPU has VNNI: exact int32 sums of 32 products), scaled in
 * float32:
 *
 *   y[m][n] = sum_b dw[b] dx[m][b] sum_i q_w[i] q_x[m][i]  -  sum_b mw[b] sx[m][b]  +  bias[n]
 *
 * where the min term (Q4_1: -m, Q4_K: dmin m_j) multiplies sx = dx sum_i q_x[i], the sum of the quantized
 * activations. So the kernel computes exactly the product of the dequantized weights with the quantized
 * activations x~ (float32 summation aside); |x - x~| <= dx / 2 per element, hence
 *
 *   |y - x.w| <= sum_b dx[b] / 2 * sum_{i in b} |w_i|  (+ float32 summation error)
 *
 * the bound tests/test_block_quant.py holds the kernel to against a float64 reference. Each output row's sums
 * run in the same order whatever the other rows of the step, so a row's result does not depend on its batch.
 *
 * Past QB_PASS rows each thread keeps its groups of weight rows in cache while every QB_PASS activation rows of a
 * tile pass by: the weights come from memory once per call, and a prompt chunk costs its integer products (about
 * twice the float32 FMAs' rate on AVX2; no float32 copy of the weights).
 *
 * w [N][row_bytes] (row_bytes = K / block * block_bytes), x [M, K] float32 or bf16 (row stride ldx), bias [N]
 * float32 or NULL, y [M, N] float32 or bf16 (row stride ldy; bf16 rounded to nearest even once, after the bias).
 * K is a multiple of 32 (256 for Q4_K and Q6_K); the caller checks.
 */
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "twospeed-unsupported: needs AVX2, FMA and F16C (avx2, fma, f16c)"
#endif
/* Sums in the order written, products rounded where written (FMA only where an intrinsic says so): so a row's
 * result is the same whichever (rows x columns) instantiation computes it. */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "graph.h"

#define KIND_Q8_0 0
#define KIND_Q4_0 1
#define KIND_Q4_1 2
#define KIND_Q4_K 3
#define KIND_Q6_K 4
#define KIND_X8 8  /* or'ed into a kind: the rows stored in groups of 8 interleaved (below) */
#define QB_PASS 8  /* activation rows a kernel instantiation keeps in registers */
#define QB_TILE_BYTES 24576  /* int8 activations a tile of rows holds (L1: 32-48 KiB) */

static const int BLOCK[5] = {32, 32, 32, 256, 256}, BLOCK_BYTES[5] = {34, 18, 20, 144, 210};

int64_t qblock_row_bytes(int kind, int K) { return (int64_t)(K / BLOCK[kind]) * BLOCK_BYTES[kind]; }

static inline float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- activations: int8 per block of 32, a float32 scale, the block's sum (dx * sum q) and its halves' ---------- */

typedef struct {
    int8_t *q;     /* [M][K] */
    float *d;      /* [M][K / 32] */
    float *s;      /* [M][K / 32] */
    int16_t *c16;  /* [M][K / 16]: sum q over each 16 (Q6_K's offset 32 meets a scale per 16) */
    int64_t nb;    /* blocks of 32 per row */
} Acts;

static inline __m256 load8(const void *x, int64_t at, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline int hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

static void quantize_row(const void *x, int bf16, int K, int8_t *q, float *d, float *s, int16_t *c16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K / 32; b++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = load8(x, (int64_t)32 * b + 8 * j, bf16);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float top = _mm_cvtss_f32(m);
        const float dx = top / 127.f, id = top > 0 ? 127.f / top : 0.f;
        __m256i i[4];
        for (int j = 0; j < 4; j++)
            i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const int c0 = hsum_epi32(_mm256_add_epi32(i[0], i[1])), c1 = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
        d[b] = dx;
        s[b] = dx * (float)(c0 + c1);
        c16[2 * b] = (int16_t)c0;
        c16[2 * b + 1] = (int16_t)c1;
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p, order));
    }
}

static int quantize_acts(const void *x, int64_t ldx, int bf16, int M, int K, Acts *a, int threads) {
    a->nb = K / 32;
    a->q = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
    a->d = malloc(sizeof(float) * (size_t)M * a->nb);
    a->s = malloc(sizeof(float) * (size_t)M * a->nb);
    a->c16 = malloc(sizeof(int16_t) * 2 * (size_t)M * a->nb);
    if (!a->q || !a->d || !a->s || !a->c16) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M > QB_PASS)
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + (bf16 ? 2 : 4) * (int64_t)m * ldx, bf16, K, a->q + (int64_t)m * K,
                     a->d + m * a->nb, a->s + m * a->nb, a->c16 + 2 * m * a->nb);
    return 0;
}

/* rows [r0, r0 + QB_PASS) of a's as their own Acts */
static inline Acts acts_from(const Acts *a, int r0) {
    const int64_t at = (int64_t)r0 * a->nb;
    const Acts sub = {a->q + at * 32, a->d + at, a->s + at, a->c16 + 2 * at, a->nb};
    return sub;
}

static void free_acts(Acts *a) { free(a->q); free(a->d); free(a->s); free(a->c16); }

/* ---- weight rows x activation rows ----------------------------------------------------------------------------- */

/* One 32-block of weights as 32 int8 in element order (Q8_0, and Q4_0 less its offset 8: signed; Q4_1: unsigned
 * 0..15), with its scale and min. */
static inline __m256i nibbles32(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256i block32(const int kind, const uint8_t *p, float *d, float *mn) {
    *d = f16(p);
    if (kind == KIND_Q8_0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    if (kind == KIND_Q4_0) return _mm256_sub_epi8(nibbles32(p + 2), _mm256_set1_epi8(8));
    *mn = f16(p + 2);
    return nibbles32(p + 4);
}

/* sum of 32 products of int8 weights (signed or, Q4_1/Q4_K, unsigned 4-bit) and int8 activations, as 8 int32.
 * Unsigned times signed bytes: |w| times x with w's sign. With VNNI (AVX-512 VNNI + VL, or AVX-VNNI) one vpdpbusd
 * sums each 4 products straight into int32; without it vpmaddubsw + vpmaddwd do, through int16 pairs that cannot
 * saturate here (|w| <= 127, |x| <= 127: a pair <= 32258). The sums are exact either way: the same results. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define HAVE_VNNI 0
#endif

static inline __m256i dot32(const int is_signed, const __m256i w, const __m256i w_abs, const __m256i x) {
    const __m256i a = is_signed ? w_abs : w, b = is_signed ? _mm256_sign_epi8(x, w) : x;
#if HAVE_VNNI
    return dpbusd(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* R activation rows x C consecutive weight rows (compile-time constants where inlined), 32-blocks */
static inline __attribute__((always_inline)) void rows32(const int kind, const int R, const int C, const uint8_t *w,
                                                         int64_t wstride, const Acts *a, float out[QB_PASS][2]) {
    const int is_signed = kind != KIND_Q4_1, bb = BLOCK_BYTES[kind];
    __m256 acc[QB_PASS][2];
    float macc[QB_PASS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) { acc[r][c] = _mm256_setzero_ps(); macc[r][c] = 0.f; }
    for (int64_t b = 0; b < a->nb; b++) {
        __m256i wq[2], wabs[2];
        float dw[2], mw[2] = {0.f, 0.f};
        for (int c = 0; c < C; c++) {
            wq[c] = block32(kind, w + c * wstride + b * bb, &dw[c], &mw[c]);
            wabs[c] = is_signed ? _mm256_sign_epi8(wq[c], wq[c]) : wq[c];
        }
        for (int r = 0; r < R; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + (r * a->nb + b) * 32));
            const float dx = a->d[r * a->nb + b];
            for (int c = 0; c < C; c++) {
                const __m256 p = _mm256_cvtepi32_ps(dot32(is_signed, wq[c], wabs[c], xq));
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw[c] * dx), p, acc[r][c]);
                if (kind == KIND_Q4_1) macc[r][c] += mw[c] * a->s[r * a->nb + b];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = hsum(acc[r][c]) + macc[r][c];
}

/* Q4_K's 12 bytes -> 8 six-bit scales (bytes 0-7 of the result) and 8 mins (bytes 8-15), llama.cpp's unpacking */
static inline void scales_k(const uint8_t *s, uint8_t out[16]) {
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    uint32_t u[4];
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
    memcpy(out, u, 16);
}

/* 8 bytes as 8 int32 lanes (unsigned), or as float32 */
static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 u8x8_ps(const uint8_t *p) { return _mm256_cvtepi32_ps(u8x8(p)); }

/* R activation rows x C weight rows, Q4_K super-blocks: 8 sub-blocks of 32, each w = (d sc_j) q - (dmin m_j) */
static inline __attribute__((always_inline)) void rows_k(const int R, const int C, const uint8_t *w, int64_t wstride,
                                                         const Acts *a, float out[QB_PASS][2]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QB_PASS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t nsb = a->nb / 8;
    for (int64_t sb = 0; sb < nsb; sb++) {
        float coef[QB_PASS][2][8] __attribute__((aligned(32)));  /* d sc_j dx_j per row and weight row */
        const uint8_t *qs[2];
        for (int c = 0; c < C; c++) {
            const uint8_t *p = w + c * wstride + sb * 144;
            uint8_t sm[16];
            scales_k(p + 4, sm);
            const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(f16(p)), u8x8_ps(sm));
            const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(f16(p + 2)), u8x8_ps(sm + 8));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * a->nb + sb * 8;
                _mm256_store_ps(coef[r][c], _mm256_mul_ps(dsc, _mm256_loadu_ps(a->d + at)));
                /* the min term: any lanes of acc may carry it, they are all summed at the end */
                acc[r][c] = _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(a->s + at), acc[r][c]);
            }
            qs[c] = p + 16;
        }
        for (int j = 0; j < 4; j++) {  /* 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high */
            __m256i lo[2], hi[2];
            for (int c = 0; c < C; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs[c] + 32 * j));
                lo[c] = _mm256_and_si256(v, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xr = a->q + (r * a->nb + sb * 8 + 2 * j) * 32;
                const __m256i xlo = _mm256_loadu_si256((const __m256i *)xr);
                const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xr + 32));
                for (int c = 0; c < C; c++) {
                    acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&coef[r][c][2 * j]),
                                                _mm256_cvtepi32_ps(dot32(0, lo[c], lo[c], xlo)), acc[r][c]);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&coef[r][c][2 * j + 1]),
                                                _mm256_cvtepi32_ps(dot32(0, hi[c], hi[c], xhi)), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = hsum(acc[r][c]);
}

/* ---- groups of 8 weight rows interleaved (KIND_X8) ------------------------------------------------------------
 *
 * The same bytes as GGUF's rows, permuted so that one 32-byte load holds 4 consecutive weights of each of 8 rows:
 * multiplied (vpmaddubsw) by the same 4 activations broadcast to every lane, its 8 int32 lanes are 8 output
 * columns' partial sums, so no horizontal sum, no per-block scalar scale and no per-row nibble shuffle remain. Per
 * group of 8 rows n0..n0+7 and 32-block b (8 x BLOCK_BYTES bytes), in order:
 *   the 8 rows' fp16 d (16 bytes); Q4_1: their 8 fp16 m (16 bytes);
 *   Q4_0/Q4_1: for t = 0..3, for row j = 0..7: bytes 4t..4t+3 of row j's 16 nibble bytes (128 bytes);
 *   Q8_0: for t = 0..7, for row j = 0..7: bytes 4t..4t+3 of row j's 32 int8 (256 bytes).
 * A part's first N / 8 * 8 rows are grouped; its last N % 8 rows follow in GGUF's layout (model/block_kinds.py's
 * BlockKind.group_rows writes this). Q4_0's q - 8 is folded into the min term (m = -8 d), so all three 4-bit sums
 * are of unsigned nibbles: 16 products of a lane stay within int16 (16 x 15 x 127 < 2^15) and are widened once a
 * block. Each row's sums still run in one order whatever the rows beside it, and the products with the quantized
 * activations are exact: the bound above holds unchanged. */
/* bytes of scales (and mins) before the quants, per group and block */
static const int X8_HEAD[4] = {16, 16, 32, 128};
/* A batch-1 step streams the weights from memory at the rate its loads are in flight: asking for the group-blocks
 * this far ahead (6-10 of them) brings the kernel near a plain read loop's rate (BENCHMARKS.md, block formats).
 * Past the end of the weights a prefetch is dropped, not a fault. */
#define X8_PREFETCH 1536

static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* 8 weight rows' 32 unsigned 4-bit values (w[t]: weights 4t..4t+3 of each row) times one activation row's 32 int8:
 * the 8 rows' sums, exact, as float32 */
static inline __m256 dot_u4_rows8(const __m256i w[8], const int8_t *x) {
#if HAVE_VNNI
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) s = dpbusd(s, w[t], bcast4(x + 4 * t));
    return _mm256_cvtepi32_ps(s);
#else
    __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(x));
    for (int t = 1; t < 8; t++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[t], bcast4(x + 4 * t)));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void group8(const int kind, const int R, const uint8_t *g,
                                                         const Acts *a, __m256 out[QB_PASS]) {
    const int gb = 8 * BLOCK_BYTES[kind], head = X8_HEAD[kind];
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QB_PASS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *p = g + b * gb, *q = p + head;
        for (int l = 0; l < gb; l += 64) _mm_prefetch((const char *)p + X8_PREFETCH + l, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        if (kind == KIND_Q8_0) {
            for (int r = 0; r < R; r++) {
                const int8_t *x = a->q + (r * a->nb + b) * 32;
                __m256i s = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * t));
                    s = _mm256_add_epi32(s, dot32(1, w, _mm256_sign_epi8(w, w), bcast4(x + 4 * t)));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d[r * a->nb + b])),
                                         _mm256_cvtepi32_ps(s), acc[r]);
            }
            continue;
        }
        const __m256 mn = kind == KIND_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
                                            : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        __m256i w[8];  /* w[t]: weights 4t..4t+3 of each row (low nibbles 0-15, high 16-31) */
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * t));
            w[t] = _mm256_and_si256(v, m4);
            w[4 + t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int r = 0; r < R; r++) {
            const __m256 sum = dot_u4_rows8(w, a->q + (r * a->nb + b) * 32);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d[r * a->nb + b])), sum, acc[r]);
            acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->s[r * a->nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q4_K grouped: per super-block, the 8 rows' d, then dmin, then their 12 scale bytes one byte of each row at a time
 * (96 bytes), then the quants as the 32-blocks' (4 bytes of each row at a time), so sub-blocks 2i and 2i + 1 are the
 * low and high nibbles of the same 8 loads. A sub-block's 6-bit scale and min (llama.cpp's get_scale_min_k4) come
 * out for all 8 rows at once from two or three of those 8-byte runs. */
static inline __attribute__((always_inline)) void group8_k(const int R, const uint8_t *g, const Acts *a,
                                                           __m256 out[QB_PASS]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi32(0x3F), m4w = _mm256_set1_epi32(0x0F);
    __m256 acc[QB_PASS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t nsb = a->nb / 8;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = g + sb * 8 * 144, *scales = p + 32, *q = p + 128;
        for (int l = 0; l < 8 * 144; l += 64) _mm_prefetch((const char *)p + 8 * 144 + l, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        for (int sub = 0; sub < 8; sub++) {  /* scale byte i of the 8 rows: u8x8(scales + 8 i) */
            __m256i sc, mn;
            if (sub < 4) {
                sc = _mm256_and_si256(u8x8(scales + 8 * sub), m6);
                mn = _mm256_and_si256(u8x8(scales + 8 * (sub + 4)), m6);
            } else {
                const __m256i low = u8x8(scales + 8 * (sub + 4));
                sc = _mm256_or_si256(_mm256_and_si256(low, m4w),
                                     _mm256_slli_epi32(_mm256_srli_epi32(u8x8(scales + 8 * (sub - 4)), 6), 4));
                mn = _mm256_or_si256(_mm256_srli_epi32(low, 4),
                                     _mm256_slli_epi32(_mm256_srli_epi32(u8x8(scales + 8 * sub), 6), 4));
            }
            const uint8_t *qi = q + 256 * (sub / 2);
            __m256i w[8];
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qi + 32 * t));
                w[t] = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
            }
            const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            const __m256 dmn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * a->nb + sb * 8 + sub;
                const __m256 sum = dot_u4_rows8(w, a->q + at * 32);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_set1_ps(a->d[at])), sum, acc[r]);
                acc[r] = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(a->s[at]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q6_K grouped: per super-block, the 8 rows' d (16 bytes), their 16 int8 scales (per scale, 8 rows' bytes), the
 * low nibbles (ql: 128 bytes a row) and the high bits (qh: 64) each 4 bytes of each row at a time. In GGUF's order
 * (model/block_kinds.py's Q6_K) ql word t of a half carries weights 4t.. (low nibbles) and 64 + 4t.. (high), word
 * 8 + t weights 32 + 4t.. and 96 + 4t.., and qh word t the top 2 bits of all four at bits 0-1, 2-3, 4-5, 6-7; each
 * 32-block's 8 loads are rebuilt as 6-bit q (0..63) in place. Two vpmaddubsw of q x stay within int16 (2 x 2 x 63 x
 * 127 < 2^15), and the offset is taken off as 32 times the 16 activations' sum (Acts.c16), so each scale's 16
 * products are summed exactly in int32. */
static inline __attribute__((always_inline)) void group8_q6k(const int R, const uint8_t *g, const Acts *a,
                                                             __m256 out[QB_PASS]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[QB_PASS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t nsb = a->nb / 8;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = g + sb * 8 * 210, *scales = p + 16, *ql = p + 144, *qh = p + 1168;
        for (int l = 0; l < 8 * 210; l += 64) _mm_prefetch((const char *)p + 8 * 210 + l, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        for (int k = 0; k < 8; k++) {  /* the super-block's 32-blocks: half k / 4, run k % 4 of it */
            const int h = k / 4, run = k % 4;
            const uint8_t *lw = ql + 512 * h + 256 * (run & 1), *hw = qh + 256 * h;
            __m256i w[8];
            for (int t = 0; t < 8; t++) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(lw + 32 * t));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(hw + 32 * t));
                const __m256i lo = _mm256_and_si256(run < 2 ? l : _mm256_srli_epi16(l, 4), m4);
                const __m256i top = _mm256_and_si256(run == 0 ? _mm256_slli_epi16(hb, 4)
                                                     : run == 1 ? _mm256_slli_epi16(hb, 2)
                                                     : run == 2 ? hb : _mm256_srli_epi16(hb, 2), m30);
                w[t] = _mm256_or_si256(lo, top);
            }
            const __m256 dsc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                     _mm_loadl_epi64((const __m128i *)(scales + 16 * k)))));
            const __m256 dsc1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                     _mm_loadl_epi64((const __m128i *)(scales + 16 * k + 8)))));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * a->nb + sb * 8 + k;
                const int8_t *x = a->q + at * 32;
                __m256i s[2];
                for (int half = 0; half < 2; half++) {  /* weights 16 half .. 16 half + 15: one scale */
                    const int t = 4 * half;
#if HAVE_VNNI
                    __m256i q = _mm256_setzero_si256();
                    for (int u = t; u < t + 4; u++) q = dpbusd(q, w[u], bcast4(x + 4 * u));
#else
                    const __m256i ones = _mm256_set1_epi16(1);
                    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[t], bcast4(x + 4 * t)),
                                                        _mm256_maddubs_epi16(w[t + 1], bcast4(x + 4 * t + 4)));
                    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[t + 2], bcast4(x + 4 * t + 8)),
                                                        _mm256_maddubs_epi16(w[t + 3], bcast4(x + 4 * t + 12)));
                    const __m256i q = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
#endif
                    s[half] = _mm256_sub_epi32(q, _mm256_set1_epi32(32 * a->c16[2 * at + half]));
                }
                const __m256 dx = _mm256_set1_ps(a->d[at]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc0, dx), _mm256_cvtepi32_ps(s[0]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc1, dx), _mm256_cvtepi32_ps(s[1]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define DEFINE_GROUP8(NAME, KIND, R)                                                                          \
    static void NAME(const uint8_t *g, const Acts *a, __m256 out[QB_PASS]) {                                  \
        if (KIND == KIND_Q4_K) group8_k(R, g, a, out);                                                        \
        else if (KIND == KIND_Q6_K) group8_q6k(R, g, a, out);                                                 \
        else group8(KIND, R, g, a, out);                                                                      \
    }
#define DEFINE_KIND8(K, KIND)                                                                                     \
    DEFINE_GROUP8(x8_##K##_1, KIND, 1) DEFINE_GROUP8(x8_##K##_2, KIND, 2) DEFINE_GROUP8(x8_##K##_3, KIND, 3)      \
    DEFINE_GROUP8(x8_##K##_4, KIND, 4) DEFINE_GROUP8(x8_##K##_5, KIND, 5) DEFINE_GROUP8(x8_##K##_6, KIND, 6)      \
    DEFINE_GROUP8(x8_##K##_7, KIND, 7) DEFINE_GROUP8(x8_##K##_8, KIND, 8)
DEFINE_KIND8(q8_0, KIND_Q8_0)
DEFINE_KIND8(q4_0, KIND_Q4_0)
DEFINE_KIND8(q4_1, KIND_Q4_1)
DEFINE_KIND8(q4_k, KIND_Q4_K)
DEFINE_KIND8(q6_k, KIND_Q6_K)

typedef void (*Group8)(const uint8_t *, const Acts *, __m256[QB_PASS]);
#define KIND8_TABLE(K) {NULL, x8_##K##_1, x8_##K##_2, x8_##K##_3, x8_##K##_4, x8_##K##_5, x8_##K##_6, x8_##K##_7, \
                        x8_##K##_8}
static const Group8 GROUPS8[5][QB_PASS + 1] = {KIND8_TABLE(q8_0), KIND8_TABLE(q4_0), KIND8_TABLE(q4_1),
                                               KIND8_TABLE(q4_k), KIND8_TABLE(q6_k)};

/* R activation rows x C weight rows, Q6_K super-blocks: per half of 128 weights, ql[0:32] and ql[32:64]'s low nibbles
 * then their high ones, each 32 with 2 bits of qh[0:32] on top (bits 0-1, 2-3, 4-5, 6-7), are weights 0-127 in order;
 * w = d sc_j (q - 32), an int8 scale per 16. q (0..63) times x in vpmaddubsw, less 32 x in the same int16 pairs
 * (|q - 32| x <= 32 x 127 a product: no saturation), widened to 8 int32 sums of 4: lanes 0-3 the first 16 weights,
 * 4-7 the second, so one float32 vector of the two scales (4 lanes each) scales them. */
static inline __attribute__((always_inline)) void rows_q6k(const int R, const int C, const uint8_t *w, int64_t wstride,
                                                           const Acts *a, float out[QB_PASS][2]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), c32 = _mm256_set1_epi8(32);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[QB_PASS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t nsb = a->nb / 8;
    for (int64_t sb = 0; sb < nsb; sb++)
        for (int h = 0; h < 2; h++) {
            __m256i q[2][4];
            __m256 sc[2][4];
            for (int c = 0; c < C; c++) {
                const uint8_t *p = w + c * wstride + sb * 210, *ql = p + 64 * h, *qh = p + 128 + 32 * h;
                const int8_t *s = (const int8_t *)(p + 192) + 8 * h;
                const float d = f16(p + 208);
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
                const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                       _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
                for (int k = 0; k < 4; k++) {
                    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), m2);
                    q[c][k] = _mm256_or_si256(lo[k], _mm256_slli_epi16(top, 4));
                    sc[c][k] = _mm256_set_m128(_mm_set1_ps(d * (float)s[2 * k + 1]), _mm_set1_ps(d * (float)s[2 * k]));
                }
            }
            for (int r = 0; r < R; r++)
                for (int k = 0; k < 4; k++) {
                    const int64_t at = r * a->nb + sb * 8 + 4 * h + k;  /* the activations' 32-block */
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + at * 32));
                    const __m256i x32 = _mm256_maddubs_epi16(c32, xq);
                    const __m256 dx = _mm256_set1_ps(a->d[at]);
                    for (int c = 0; c < C; c++) {
                        const __m256i s16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q[c][k], xq), x32);
                        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(sc[c][k], dx), sum, acc[r][c]);
                    }
                }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = hsum(acc[r][c]);
}

static inline void store(void *y, int64_t at, int bf16, float v) {
    if (bf16) ((uint16_t *)y)[at] = f32_to_bf16(v);
    else ((float *)y)[at] = v;
}

/* One instantiation per (kind, R, C): every loop above unrolls over registers. Two weight rows at a time for up to
 * 4 activation rows (more independent FMA chains for a lone decode row), one beyond. */
#define DEFINE_GROUP(NAME, KIND, R, C)                                                                           \
    static void NAME(const uint8_t *w, int64_t wstride, const Acts *a, float out[QB_PASS][2]) {          \
        if (KIND == KIND_Q4_K) rows_k(R, C, w, wstride, a, out);                                              \
        else if (KIND == KIND_Q6_K) rows_q6k(R, C, w, wstride, a, out);                                       \
        else rows32(KIND, R, C, w, wstride, a, out);                                                          \
    }
#define DEFINE_KIND(K, KIND)                                                                                     \
    DEFINE_GROUP(g_##K##_1_2, KIND, 1, 2) DEFINE_GROUP(g_##K##_2_2, KIND, 2, 2) DEFINE_GROUP(g_##K##_3_2, KIND, 3, 2) \
    DEFINE_GROUP(g_##K##_4_2, KIND, 4, 2) DEFINE_GROUP(g_##K##_1_1, KIND, 1, 1) DEFINE_GROUP(g_##K##_2_1, KIND, 2, 1) \
    DEFINE_GROUP(g_##K##_3_1, KIND, 3, 1) DEFINE_GROUP(g_##K##_4_1, KIND, 4, 1) DEFINE_GROUP(g_##K##_5_1, KIND, 5, 1) \
    DEFINE_GROUP(g_##K##_6_1, KIND, 6, 1) DEFINE_GROUP(g_##K##_7_1, KIND, 7, 1) DEFINE_GROUP(g_##K##_8_1, KIND, 8, 1)
DEFINE_KIND(q8_0, KIND_Q8_0)
DEFINE_KIND(q4_0, KIND_Q4_0)
DEFINE_KIND(q4_1, KIND_Q4_1)
DEFINE_KIND(q4_k, KIND_Q4_K)
DEFINE_KIND(q6_k, KIND_Q6_K)

typedef void (*Group)(const uint8_t *, int64_t, const Acts *, float[QB_PASS][2]);
#define KIND_TABLE(K)                                                                                            \
    {{NULL, NULL}, {g_##K##_1_1, g_##K##_1_2}, {g_##K##_2_1, g_##K##_2_2}, {g_##K##_3_1, g_##K##_3_2},            \
     {g_##K##_4_1, g_##K##_4_2}, {g_##K##_5_1, NULL}, {g_##K##_6_1, NULL}, {g_##K##_7_1, NULL}, {g_##K##_8_1, NULL}}
static const Group GROUPS[5][QB_PASS + 1][2] = {KIND_TABLE(q8_0), KIND_TABLE(q4_0), KIND_TABLE(q4_1),
                                                 KIND_TABLE(q4_k), KIND_TABLE(q6_k)};

/* y = x W^T + bias for M >= 1 rows. Each thread takes groups of weight rows and runs every QB_PASS activation
 * rows past them in turn, so a group's bytes come from memory once per call and from cache after: past 8 rows a
 * call costs its integer products, not M / 8 passes over the weights. Returns 0, or -1 if M < 1 or memory ran out. */
int linear_qblock(const void *x, int64_t ldx, int x_bf16, const uint8_t *w, int kind, const float *bias, void *y,
                  int64_t ldy, int M, int N, int K, int threads) {
    if (M < 1) return -1;
    Acts a;
    if (quantize_acts(x, ldx, x_bf16, M, K, &a, threads) != 0) { free_acts(&a); return -1; }
    const int grouped = (kind & KIND_X8) ? N / 8 : 0;  /* groups of 8 interleaved rows, then rows in GGUF's layout */
    kind &= ~KIND_X8;
    const int64_t wstride = qblock_row_bytes(kind, K);
    const int rest = 8 * grouped, C = M <= 4 ? 2 : 1, groups = (N - rest + C - 1) / C;
    /* rows a tile: their int8 activations fit in L1 beside a group's weights */
    const int tile = K * QB_PASS > QB_TILE_BYTES ? QB_PASS : QB_TILE_BYTES / K / QB_PASS * QB_PASS;
    #pragma omp parallel num_threads(threads)
    for (int t0 = 0; t0 < M; t0 += tile) {  /* static schedules: a thread keeps its groups (in its cache) each tile */
        const int t1 = M - t0 < tile ? M : t0 + tile;
        #pragma omp for schedule(static) nowait
        for (int g = 0; g < grouped; g++) {
            const int n0 = 8 * g;
            for (int r0 = t0; r0 < t1; r0 += QB_PASS) {
                const int R = t1 - r0 < QB_PASS ? t1 - r0 : QB_PASS;
                const Acts sub = acts_from(&a, r0);
                __m256 out[QB_PASS];
                GROUPS8[kind][R](w + n0 * wstride, &sub, out);
                for (int r = 0; r < R; r++) {
                    float v[8];
                    _mm256_storeu_ps(v, bias ? _mm256_add_ps(out[r], _mm256_loadu_ps(bias + n0)) : out[r]);
                    for (int c = 0; c < 8; c++) store(y, (r0 + r) * ldy + n0 + c, x_bf16, v[c]);
                }
            }
        }
        #pragma omp for schedule(static) nowait
        for (int g = 0; g < groups; g++) {
            const int n0 = rest + g * C, cols = N - n0 < C ? N - n0 : C;
            for (int r0 = t0; r0 < t1; r0 += QB_PASS) {
                const int R = t1 - r0 < QB_PASS ? t1 - r0 : QB_PASS;
                const Acts sub = acts_from(&a, r0);
                float out[QB_PASS][2];
                GROUPS[kind][R][cols - 1](w + n0 * wstride, wstride, &sub, out);
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < cols; c++)
                        store(y, (r0 + r) * ldy + n0 + c, x_bf16, out[r][c] + (bias ? bias[n0 + c] : 0.f));
            }
        }
    }
    free_acts(&a);
    return 0;
}

/* the decode graph's entry (graph.h): float32 activations, one part of a linear */
int qblock_graph_linear(const GraphLinear *op, const float *x, int64_t ldx, float *y, int64_t ldy, int M,
                        int threads) {
    return linear_qblock(x, ldx, 0, op->w, op->kind, op->bias, y, ldy, M, op->N, op->K, threads);
}
