/* Linear layers over bf16 weights with float32 activations, for CPUs with AVX2 and FMA but no bf16 dot products.
 *
 * There a bf16 checkpoint computes in float32 (model/compute_dtype.py), and a decode step streams every weight
 * from memory: kept in float32 the weights cost four bytes each, in bf16 two. This kernel keeps them in bf16 and
 * widens them in registers (a bf16 is the top half of a float32: zero-extend, shift left 16), so a step reads half
 * the bytes and every product is the exact float32 product of the stored values:
 *
 *   y[m][n] = sum_k x[m][k] * float(w[n][k]) + bias[n]      (float32 sums; the order differs from a GEMM's)
 *
 * For the few rows of a decode step: a thread owns a run of output rows n; for each, every activation row is
 * swept over the weight row, four at a time with two accumulators each (eight independent FMA chains), so W is
 * read from memory once per call and x stays in cache. Many rows (prefill) are a GEMM's job: the caller widens
 * the weight and calls the BLAS instead (model/packed_linear.py).
 *
 * x [M, K] float32 (row stride ldx), w [N, K] bf16 row-major, bias [N] float32 or NULL, y [M, N] (row stride ldy).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "twospeed-unsupported: needs AVX2 and FMA (avx2, fma)"
#endif
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define MR 4  /* activation rows per sweep of a weight row */

static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* rows x[0..R) (R <= MR, a constant where inlined) against one weight row: out[r] = sum_k x[r][k] w[k] */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t ldx, const uint16_t *w, int K,
                                                           int R, float *out) {
    __m256 a[MR], b[MR];
    for (int r = 0; r < R; r++) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = widen8(w + k), w1 = widen8(w + k + 8);
        for (int r = 0; r < R; r++) {
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a[r]);
            b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), b[r]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 w0 = widen8(w + k);
        for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a[r]);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(_mm256_add_ps(a[r], b[r]));
        for (int kk = k; kk < K; kk++) s += x[r * ldx + kk] * bf16_to_f32(w[kk]);
        out[r] = s;
    }
}

void linear_widen(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint16_t *wn = w + (int64_t)n * K;
        const float add = bias ? bias[n] : 0.0f;
        float out[MR];
        int m = 0;
        for (; m + MR <= M; m += MR) {
            dot_rows(x + (int64_t)m * ldx, ldx, wn, K, MR, out);
            for (int r = 0; r < MR; r++) y[(int64_t)(m + r) * ldy + n] = out[r] + add;
        }
        for (; m < M; m++) {
            dot_rows(x + (int64_t)m * ldx, ldx, wn, K, 1, out);
            y[(int64_t)m * ldy + n] = out[0] + add;
        }
    }
}
