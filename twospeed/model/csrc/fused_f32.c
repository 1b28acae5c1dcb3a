/* Residual add + RMSNorm in one pass per row, float32 (CPU, OpenMP; plain C that -O3 -march=native vectorizes).
 *
 * Where a bf16 checkpoint computes in float32 (a CPU without bf16 kernels, model/compute_dtype.py) F.rms_norm
 * runs as five dispatches (pow, mean, add, rsqrt, mul) plus the residual add and the weight's multiply: ~45 us
 * a call on a 768-wide row on two Zen 3 cores, 25 calls a decode step of the ~100M Llama, 6-7% of the step.
 * Here it is one call, the math of LlamaRMSNorm in float32 (the sum of squares in another order):
 *
 * add_rms_norm_f32: s = x + residual (when residual is given; s written back to residual),
 *                   out = w * (s * rsqrt(mean(s^2) + eps))
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
