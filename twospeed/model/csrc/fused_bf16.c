/* The small ops of a bf16 decoder layer fused, one pass over each row (CPU, AVX-512, OpenMP).
 *
 * In a decode step the residual add, RMSNorm and SiLU-and-multiply touch a few kilobytes per token, but as
 * torch ops they are a dozen dispatches per layer (F.rms_norm alone runs as pow, mean, add, rsqrt, mul on
 * CPU), a quarter of a batch-1 step on two cores. Each function here is one call and rounds where HF's
 * bf16 modules round, so the results are HF's up to float32 summation order:
 *
 * add_rms_norm_bf16: s = bf16(x + residual) (when residual is given; s written back to residual),
 *                    out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))   -- LlamaRMSNorm in float32, then * weight
 * silu_mul_bf16:     out = bf16(bf16(silu(gate)) * up), gate_up = [gate | up] per row   -- F.silu(g) * u
 */
/* Unsupported here unless -march=native enables these (model/cbuild.py skips on this mark, fails otherwise). */
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "twospeed-unsupported: needs AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 round16(__m512 x) {  /* float32 -> nearest bf16 -> float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
static inline void store16(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}
static inline __mmask16 tail16(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* x, out: [T, N] (row strides ldx, ldo); residual: [T, N] contiguous or NULL; w: [N]. */
void add_rms_norm_bf16(const uint16_t *x, int64_t ldx, uint16_t *residual, const uint16_t *w, uint16_t *out,
                       int64_t ldo, int T, int N, float eps, int threads) {
    #pragma omp parallel for num_threads(T >= 8 ? threads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + t * ldx;
        uint16_t *rr = residual ? residual + (int64_t)t * N : NULL;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < N; i += 16) {
            const __mmask16 m = tail16(N - i);
            __m512 s = load16(xr + i, m);
            if (rr) {
                s = round16(_mm512_add_ps(s, load16(rr + i, m)));
                store16(rr + i, s, m);
            }
            ss = _mm512_fmadd_ps(s, s, ss);
        }
        const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps);
        const __m512 vs = _mm512_set1_ps(scale);
        const uint16_t *src = rr ? rr : xr;
        for (int i = 0; i < N; i += 16) {
            const __mmask16 m = tail16(N - i);
            const __m512 h = round16(_mm512_mul_ps(load16(src + i, m), vs));
            store16(out + t * ldo + i, _mm512_mul_ps(load16(w + i, m), h), m);
        }
    }
}

/* gate_up: [T, 2I] (row stride ldg), out: [T, I] contiguous. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t ldg, uint16_t *out, int T, int I, int threads) {
    #pragma omp parallel for num_threads(T >= 8 ? threads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * ldg, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i += 16) {
            const __mmask16 m = tail16(I - i);
            const __m512 gv = load16(g + i, m);
            const __m512 silu = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                         exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
            store16(o + i, _mm512_mul_ps(silu, load16(u + i, m)), m);
        }
    }
}
