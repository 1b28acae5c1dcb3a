/* bf16 helpers shared by the kernels in this folder (model/cbuild.py keys each build on the headers too). */
#ifndef TWOSPEED_BF16_H
#define TWOSPEED_BF16_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) { union { uint32_t u; float f; } v; v.u = (uint32_t)h << 16; return v.f; }

/* float32 -> bf16, rounded to nearest even as torch rounds; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* fp8 e4m3 (finite, no NaN produced here) <-> float32, as torch's float8_e4m3fn converts: round to nearest even,
 * subnormals kept. The caller clamps to +-448 before encoding. */
static inline float fp8_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    union { uint32_t u; float f; } v;
    if (e == 0) { v.f = (float)m * (1.f / 512.f); }
    else v.u = ((uint32_t)(e + 120) << 23) | ((uint32_t)m << 20);
    return (b & 0x80) ? -v.f : v.f;
}

static inline uint8_t f32_to_fp8(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80);
    v.u &= 0x7fffffffu;
    uint32_t code;
    if (v.f < 0.015625f) {  /* below 2^-6: subnormal steps of 2^-9 (8 steps is the first normal, the same code) */
        code = (uint32_t)nearbyintf(v.f * 512.f);
    } else {
        const uint32_t r = v.u + 0x7ffffu + ((v.u >> 20) & 1u);  /* round the mantissa to 3 bits, ties to even */
        code = (r >> 20) - (120u << 3);
        if (code > 0x7e) code = 0x7e;  /* 448 */
    }
    return (uint8_t)(sign | code);
}

/* an int8 KV row's bf16 scale, in the two bytes after its head_dim values */
static inline float kv_row_scale(const int8_t *row, int D) {
    uint16_t h; memcpy(&h, row + D, 2); return bf16_to_f32(h);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* exp(x) for float32 lanes, about 2 ulp (Cephes' expf polynomial); -inf and anything below -87.3 give 0. */
static inline __m512 exp512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#endif
#endif
