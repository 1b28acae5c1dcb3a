/* Linear layers over bf16 weights with float32 activations, for CPUs with AVX2 and FMA but no bf16 dot products.
 *
 * There a bf16 checkpoint computes in float32 (model/compute_dtype.py), and a decode step streams every weight
 * from memory: kept in float32 the weights cost four bytes each, in bf16 two. This kernel keeps them in bf16 and
 * widens them in registers (a bf16 is the top half of a float32: zero-extend, shift left 16), so a step reads half
 * the bytes and every product is the exact float32 product of the stored values:
 *
 *   y[m][n] = sum_k x[m][k] * float(w[n][k]) + bias[n]      (float32 sums; the order differs from a GEMM's)
 *
 * A thread takes a tile of 48 weight rows at a time; blocks of 4 activation rows x 3 weight rows run as 12
 * register accumulators over k (each x load feeds three FMAs, each widened weight four), and every block of
 * activation rows sweeps the tile while it sits in L2, so W is read from memory once per call; the first sweep
 * prefetches the rows a few blocks ahead. Prefill-sized
 * steps are a tuned GEMM's job: past WIDEN_MAX_ROWS the caller widens the weight for the BLAS
 * (model/packed_linear.py).
 *
 * The same blocks serve int8 weights (model/quant.py's format: one byte a weight, a float32 scale per row,
 * y = scale[n] * (x . q[n]) + bias[n]; an int8 is exact in float32): a quarter of float32's bytes.
 *
 * x [M, K] float32 (row stride ldx), w [N, K] row-major, bias [N] float32 or NULL, y [M, N] (row stride ldy).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "twospeed-unsupported: needs AVX2 and FMA (avx2, fma)"
#endif
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "graph.h"

#define MB 4    /* activation rows per register block */
#define NB 3    /* weight rows per register block: MB x NB accumulators + NB widened weights + one x vector = 16 */
#define TILE 48 /* weight rows a thread takes at a time (a multiple of NB): its bf16 rows stay in L2 while every
                   block of activation rows sweeps them, so W is read from memory once per call */

#define PF_BLOCKS 2 /* how far ahead the first sweep prefetches: each block reads NB rows of K at once, streams too
                       short for the hardware prefetcher to run ahead (1-8 rows on a Zen 3: +15-25% bandwidth) */

#define FMT_BF16 0
#define FMT_INT8 1  /* one byte a weight and a float32 scale per weight row (model/quant.py's int8) */

static inline __m256 widen8(const void *w, int64_t at, int fmt) {
    if (fmt == FMT_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + at))));
}

static inline float widen1(const void *w, int64_t at, int fmt) {
    return fmt == FMT_BF16 ? bf16_to_f32(((const uint16_t *)w)[at]) : (float)((const int8_t *)w)[at];
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r][c] = scale[c] * sum_k x[r][k] w[c][k] + bias[c] for r < R, c < C (constants where inlined: R <= MB,
   C <= NB; fmt too). w points at weight row 0 of the block; scale and bias at its first row, or NULL. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const void *w, int K,
                                                        const float *scale, const float *bias, float *y,
                                                        int64_t ldy, int R, int C, int fmt, int pf) {
    __m256 acc[MB][NB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf && (k & 31) == 0)  /* a cache line of each row PF_BLOCKS blocks ahead: the streams are short */
            for (int c = 0; c < C; c++)
                _mm_prefetch((const char *)w + ((int64_t)(c + PF_BLOCKS * NB) * K + k) * (fmt == FMT_BF16 ? 2 : 1),
                             _MM_HINT_T0);
        __m256 wv[NB];
        for (int c = 0; c < C; c++) wv[c] = widen8(w, (int64_t)c * K + k, fmt);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int kk = k; kk < K; kk++) s += x[r * ldx + kk] * widen1(w, (int64_t)c * K + kk, fmt);
            y[r * ldy + c] = (scale ? s * scale[c] : s) + (bias ? bias[c] : 0.0f);
        }
}

/* One instantiation per (R, C, format), so every loop above unrolls over registers. */
#define BLOCK(R, C) block(x, ldx, w, K, scale, bias, y, ldy, R, C, FMT, pf)
#define DISPATCH(name, FMT_VALUE)                                                                                 \
    static void name(const float *x, int64_t ldx, const void *w, int K, const float *scale, const float *bias,  \
                     float *y, int64_t ldy, int R, int C, int pf) {                                             \
        enum { FMT = FMT_VALUE };                                                                               \
        switch (R * 4 + C) {                                                                                    \
            case 4 * 4 + 3: BLOCK(4, 3); break;  case 4 * 4 + 2: BLOCK(4, 2); break;                            \
            case 4 * 4 + 1: BLOCK(4, 1); break;  case 3 * 4 + 3: BLOCK(3, 3); break;                            \
            case 3 * 4 + 2: BLOCK(3, 2); break;  case 3 * 4 + 1: BLOCK(3, 1); break;                            \
            case 2 * 4 + 3: BLOCK(2, 3); break;  case 2 * 4 + 2: BLOCK(2, 2); break;                            \
            case 2 * 4 + 1: BLOCK(2, 1); break;  case 1 * 4 + 3: BLOCK(1, 3); break;                            \
            case 1 * 4 + 2: BLOCK(1, 2); break;  default: BLOCK(1, 1); break;                                   \
        }                                                                                                       \
    }
DISPATCH(block_bf16, FMT_BF16)
DISPATCH(block_int8, FMT_INT8)

static void linear(const float *x, int64_t ldx, const void *w, int fmt, const float *scale, const float *bias,
                   float *y, int64_t ldy, int M, int N, int K, int threads) {
    const int tiles = (N + TILE - 1) / TILE;
    const int64_t row_bytes = (int64_t)K * (fmt == FMT_BF16 ? 2 : 1);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int n_end = (t + 1) * TILE < N ? (t + 1) * TILE : N;
        for (int m = 0; m < M; m += MB) {
            const int R = M - m < MB ? M - m : MB;
            for (int n = t * TILE; n < n_end; n += NB) {
                const int C = n_end - n < NB ? n_end - n : NB;
                const void *wn = (const char *)w + n * row_bytes;
                const float *sn = scale ? scale + n : NULL, *bn = bias ? bias + n : NULL;
                float *yn = y + (int64_t)m * ldy + n;
                const int pf = m == 0 && n + NB < n_end;  /* the first sweep streams the tile from memory */
                if (fmt == FMT_BF16) block_bf16(x + (int64_t)m * ldx, ldx, wn, K, sn, bn, yn, ldy, R, C, pf);
                else block_int8(x + (int64_t)m * ldx, ldx, wn, K, sn, bn, yn, ldy, R, C, pf);
            }
        }
    }
}

/* bf16 weights w [N, K] */
void linear_widen(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int threads) {
    linear(x, ldx, w, FMT_BF16, NULL, bias, y, ldy, M, N, K, threads);
}

/* int8 weights w [N, K] with a float32 scale per row: y = scale[n] * (x . w[n]) + bias[n] */
void linear_widen_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale, const float *bias, float *y,
                     int64_t ldy, int M, int N, int K, int threads) {
    linear(x, ldx, w, FMT_INT8, scale, bias, y, ldy, M, N, K, threads);
}

/* the decode graph's entry (graph.h): int8 where the call carries scales, else bf16 */
int widen_graph_linear(const GraphLinear *op, const float *x, int64_t ldx, float *y, int64_t ldy, int M,
                       int threads) {
    linear(x, ldx, op->w, op->scale ? FMT_INT8 : FMT_BF16, op->scale, op->bias, y, ldy, M, op->N, op->K, threads);
    return 0;
}
