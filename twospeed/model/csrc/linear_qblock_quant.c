/* Quantize float32 rows into GGUF's block layouts (Q8_0, Q4_0, Q4_1, Q4_K): what model/block_kinds.py does in
 * torch, in plain C at a few ns a weight (the torch ops are memory-bound passes over [n, 32] views, and Q4_K's
 * scale search is 21 of them), so a bf16/fp32 checkpoint quantizes at load in seconds.
 *
 * The arithmetic is the reference's, operation for operation: Q8_0, Q4_0 and Q4_1 as gguf's Python quantizer
 * (itself llama.cpp's quantize_row_*_ref), Q4_K as llama.cpp's quantize_row_q4_K_ref (make_qkx2_quants: sums
 * taken in order). So the file is compiled without FMA contraction or reassociation (the pragma below): with
 * them the sums, and so the chosen levels, would differ. fp16 is rounded to nearest even in software (numpy's
 * and ggml's conversion), so no F16C is needed: this file builds for any CPU.
 *
 * w [rows, K] float32 (row stride ldw), out [rows][row_bytes]; K a multiple of the block (the caller checks).
 */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KIND_Q8_0 0
#define KIND_Q4_0 1
#define KIND_Q4_1 2
#define KIND_Q4_K 3

static const int BLOCK[4] = {32, 32, 32, 256}, BLOCK_BYTES[4] = {34, 18, 20, 144};

static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> fp16 bits, round to nearest even, overflow to inf (ggml's GGML_FP32_TO_FP16 in software) */
static uint16_t to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits(f), shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits(base), nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

static float from_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    if (exp == 31) return from_bits(sign | 0x7F800000u | (man << 13));
    if (exp == 0) { const float v = (float)man * 0x1.0p-24f; return sign ? -v : v; }
    return from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* gguf's np_roundf: half away from zero */
static inline float round_away(float n) {
    const float a = fabsf(n), f = floorf(a), r = f + floorf(2 * (a - f));
    return n < 0 ? -r : (n > 0 ? r : 0.f);
}

static void q8_0(const float *x, uint8_t *y) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127, id = d != 0 ? 1 / d : 0;
    put16(y, to_f16(d));
    for (int i = 0; i < 32; i++) y[2 + i] = (uint8_t)(int8_t)round_away(x[i] * id);
}

static void q4_0(const float *x, uint8_t *y) {
    float peak = x[0], amax = fabsf(x[0]);
    for (int i = 1; i < 32; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); peak = x[i]; }  /* the first of the largest, signed */
    const float d = peak / -8, id = d != 0 ? 1 / d : 0;
    put16(y, to_f16(d));
    for (int i = 0; i < 16; i++) {
        float a = truncf(x[i] * id + 8.5f), b = truncf(x[i + 16] * id + 8.5f);
        a = a < 0 ? 0 : a > 15 ? 15 : a;
        b = b < 0 ? 0 : b > 15 ? 15 : b;
        y[2 + i] = (uint8_t)a | ((uint8_t)b << 4);
    }
}

static void q4_1(const float *x, uint8_t *y) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < 32; i++) { lo = fminf(lo, x[i]); hi = fmaxf(hi, x[i]); }
    const float d = (hi - lo) / 15, id = d != 0 ? 1 / d : 0;
    put16(y, to_f16(d));
    put16(y + 2, to_f16(lo));
    for (int i = 0; i < 16; i++) {
        float a = truncf((x[i] - lo) * id + 0.5f), b = truncf((x[i + 16] - lo) * id + 0.5f);
        a = a > 15 ? 15 : a;
        b = b > 15 ? 15 : b;
        y[4 + i] = (uint8_t)a | ((uint8_t)b << 4);
    }
}

/* llama.cpp's nearest_int: round half to even */
static inline int nearest(float v) { return (int)nearbyintf(v); }

/* llama.cpp's make_qkx2_quants(32, 15, x, w, L, &the_min, Laux, -1, 0.1, 20, false) */
static float scale_min(const float *x, const float *w, uint8_t *L, float *the_min) {
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < 32; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) { memset(L, 0, 32); *the_min = -lo; return 0.f; }
    float iscale = 15 / (hi - lo), scale = 1 / iscale, best = 0;
    for (int i = 0; i < 32; i++) {
        const int l = nearest(iscale * (x[i] - lo));
        L[i] = (uint8_t)(l < 0 ? 0 : l > 15 ? 15 : l);
        const float diff = scale * L[i] + lo - x[i];
        best += w[i] * (diff * diff);
    }
    uint8_t aux[32];
    for (int step = 0; step <= 20; step++) {
        iscale = (-1.f + 0.1f * step + 15) / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < 32; i++) {
            int l = nearest(iscale * (x[i] - lo));
            l = l < 0 ? 0 : l > 15 ? 15 : l;
            aux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) { this_min = 0; this_scale = sum_xl / sum_l2; }
            float err = 0;
            for (int i = 0; i < 32; i++) {
                const float diff = this_scale * aux[i] + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if (err < best) { memcpy(L, aux, 32); best = err; scale = this_scale; lo = this_min; }
        }
    }
    *the_min = -lo;
    return scale;
}

static void q4_k(const float *x, uint8_t *y) {
    uint8_t L[256], sc[12] = {0};
    float scales[8], mins[8], weights[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xj = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xj[l] * xj[l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(xj[l]);
        scales[j] = scale_min(xj, weights, L + 32 * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)nearest(inv_scale * scales[j]), lm = (uint8_t)nearest(inv_min * mins[j]);
        ls = ls > 63 ? 63 : ls;
        lm = lm > 63 ? 63 : lm;
        if (j < 4) { sc[j] = ls; sc[j + 4] = lm; }
        else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t d16 = to_f16(max_scale / 63.f), dmin16 = to_f16(max_min / 63.f);
    put16(y, d16);
    put16(y + 2, dmin16);
    memcpy(y + 4, sc, 12);
    for (int j = 0; j < 8; j++) {
        const uint8_t s = j < 4 ? sc[j] & 63 : (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
        const uint8_t m = j < 4 ? sc[j + 4] & 63 : (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
        const float d = from_f16(d16) * s;
        if (!d) continue;
        const float dm = from_f16(dmin16) * m;
        for (int i = 0; i < 32; i++) {
            const int l = nearest((x[32 * j + i] + dm) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > 15 ? 15 : l);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) y[16 + 32 * j + l] = (uint8_t)(L[64 * j + l] | (L[64 * j + 32 + l] << 4));
}

void qblock_quantize(const float *w, int64_t ldw, int kind, int rows, int K, uint8_t *out, int threads) {
    const int block = BLOCK[kind], bb = BLOCK_BYTES[kind];
    const int64_t row_bytes = (int64_t)(K / block) * bb;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < K / block; b++) {
            const float *x = w + r * ldw + (int64_t)b * block;
            uint8_t *y = out + r * row_bytes + (int64_t)b * bb;
            switch (kind) {
                case KIND_Q8_0: q8_0(x, y); break;
                case KIND_Q4_0: q4_0(x, y); break;
                case KIND_Q4_1: q4_1(x, y); break;
                default: q4_k(x, y); break;
            }
        }
}
