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
 * activation rows sweeps the tile while it sits in L2, so W is read from memory once per call. Prefill-sized
 * steps are a tuned GEMM's job: past WIDEN_MAX_ROWS the caller widens the weight for the BLAS
 * (model/packed_linear.py).
 *
 * x [M, K] float32 (row stride ldx), w [N, K] bf16 row-major, bias [N] float32 or NULL, y [M, N] (row stride ldy).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "twospeed-unsupported: needs AVX2 and FMA (avx2, fma)"
#endif
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define MB 4    /* activation rows per register block */
#define NB 3    /* weight rows per register block: MB x NB accumulators + NB widened weights + one x vector = 16 */
#define TILE 48 /* weight rows a thread takes at a time (a multiple of NB): its bf16 rows stay in L2 while every
                   block of activation rows sweeps them, so W is read from memory once per call */

static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r][c] = sum_k x[r][k] w[c][k] + bias[c] for r < R, c < C (constants where inlined: R <= MB, C <= NB). */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const uint16_t *w, int K,
                                                        const float *bias, float *y, int64_t ldy, int R, int C) {
    __m256 acc[MB][NB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NB];
        for (int c = 0; c < C; c++) wv[c] = widen8(w + (int64_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int kk = k; kk < K; kk++) s += x[r * ldx + kk] * bf16_to_f32(w[(int64_t)c * K + kk]);
            y[r * ldy + c] = s + (bias ? bias[c] : 0.0f);
        }
}

/* One instantiation per (R, C) shape, so every loop above unrolls over registers. */
#define BLOCK(R, C) block(x, ldx, w, K, bias, y, ldy, R, C)
static void any_block(const float *x, int64_t ldx, const uint16_t *w, int K, const float *bias, float *y, int64_t ldy,
                      int R, int C) {
    switch (R * 4 + C) {
        case 4 * 4 + 3: BLOCK(4, 3); break;  case 4 * 4 + 2: BLOCK(4, 2); break;  case 4 * 4 + 1: BLOCK(4, 1); break;
        case 3 * 4 + 3: BLOCK(3, 3); break;  case 3 * 4 + 2: BLOCK(3, 2); break;  case 3 * 4 + 1: BLOCK(3, 1); break;
        case 2 * 4 + 3: BLOCK(2, 3); break;  case 2 * 4 + 2: BLOCK(2, 2); break;  case 2 * 4 + 1: BLOCK(2, 1); break;
        case 1 * 4 + 3: BLOCK(1, 3); break;  case 1 * 4 + 2: BLOCK(1, 2); break;  default: BLOCK(1, 1); break;
    }
}

void linear_widen(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int threads) {
    const int tiles = (N + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int n_end = (t + 1) * TILE < N ? (t + 1) * TILE : N;
        for (int m = 0; m < M; m += MB) {
            const int R = M - m < MB ? M - m : MB;
            for (int n = t * TILE; n < n_end; n += NB) {
                const int C = n_end - n < NB ? n_end - n : NB;
                any_block(x + (int64_t)m * ldx, ldx, w + (int64_t)n * K, K, bias ? bias + n : NULL,
                          y + (int64_t)m * ldy + n, ldy, R, C);
            }
        }
    }
}
