/* Residual add + RMSNorm, and SiLU-and-multiply, one pass per row in float32 (CPU, OpenMP; plain C that -O3
 * -march=native vectorizes).
 *
 * Where a bf16 checkpoint computes in float32 (a CPU without bf16 kernels, model/compute_dtype.py) F.rms_norm
 * runs as five dispatches (pow, mean, add, rsqrt, mul) plus the residual add and the weight's multiply: ~45 us
 * a call on a 768-wide row on two Zen 3 cores, 25 calls a decode step of the ~100M Llama, 6-7% of the step.
 * Here it is one call, the math of LlamaRMSNorm in float32 (the sum of squares in another order):
 *
 * add_rms_norm_f32: s = x + residual (when residual is given; s written back to residual),
 *                   out = w * (s * rsqrt(mean(s^2) + eps))
 * silu_mul_f32:     out = silu(gate) * up = gate / (1 + exp(-gate)) * up, gate_up = [gate | up] per row; exp by
 *                   Cephes' expf polynomial (about 2 ulp, as csrc/bf16.h's exp512): F.silu's up to that
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* x, out: [T, N] (row strides ldx, ldo); residual: [T, N] contiguous or NULL; w: [N]. */
void add_rms_norm_f32(const float *x, int64_t ldx, float *residual, const float *w, float *out, int64_t ldo, int T,
                      int N, float eps, int threads) {
    #pragma omp parallel for num_threads(T >= 8 ? threads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *rr = residual ? residual + (int64_t)t * N : NULL;
        float ss = 0.0f;
        if (rr) {
            for (int i = 0; i < N; i++) {
                const float s = xr[i] + rr[i];
                rr[i] = s;
                ss += s * s;
            }
        } else {
            for (int i = 0; i < N; i++) ss += xr[i] * xr[i];
        }
        const float scale = 1.0f / sqrtf(ss / (float)N + eps);
        const float *src = rr ? rr : xr;
        float *o = out + t * ldo;
        for (int i = 0; i < N; i++) o[i] = w[i] * (src[i] * scale);
    }
}

/* exp(x), about 2 ulp; below -87.3 gives 0, above 88.7 saturates. Branch-free, so the loop around it vectorizes. */
static inline float exp_f32(float x) {
    const float live = x > -87.3f ? 1.0f : 0.0f;
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n: n is in [-126, 128] here */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n * live;
}

/* gate_up: [T, 2I] (row stride ldg), out: [T, I] contiguous. */
void silu_mul_f32(const float *gate_up, int64_t ldg, float *out, int T, int I, int threads) {
    #pragma omp parallel for num_threads(T >= 8 ? threads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + t * ldg, *u = g + I;
        float *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}
