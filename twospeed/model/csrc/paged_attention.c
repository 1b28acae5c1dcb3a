/* Decode attention over the paged KV cache, reading each sequence's blocks in place (CPU, OpenMP).
 *
 * The portable path copies every block a decode batch needs out of the pool, every layer, before one SDPA
 * call; at a few dozen streams that copy was most of a decode step. Here each (sequence, KV head) task
 * walks its block table and keeps an online softmax (running max m, sum l, accumulator acc) for the G query
 * heads that share the KV head, block by block: scores for the block's tokens, one rescale, then the
 * weighted values. Math in float32; bf16 in and out, rounded to nearest even as torch rounds.
 *
 * q, out: [n, H, D]; k_cache, v_cache: [num_blocks, BS, KVH, D]; tables: [n, max_blocks] int64;
 * lens: [n] int64 context length of each sequence (its query is the token at position len - 1);
 * window > 0 keeps only the last `window` keys (sliding window). Limits: G <= 16, D <= 256, BS <= 64.
 *
 * Quantized caches (model/kv_format.py) are read in place and widened to float32 as they load: *_i8 reads int8
 * rows of D values followed by their bf16 scale (row stride D + 2), *_f8 reads fp8 e4m3 rows.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MAXG 16
#define MAXD 256
#define MAXBS 64

static inline float f32_id(float x) { return x; }

int paged_attention_limits(int *max_g, int *max_d, int *max_bs) { *max_g = MAXG; *max_d = MAXD; *max_bs = MAXBS; return 0; }

#define PAGED_DECODE(NAME, T, LOAD, STORE, KT, ROW, KLOAD, KSCALE)                                                 \
void NAME(const T *q, const KT *k_cache, const KT *v_cache, const int64_t *tables, const int64_t *lens, T *out,    \
          int n, int H, int KVH, int D, int BS, int max_blocks, int window, float scale, int threads) {            \
    const int64_t RS = ROW(D);                                                                                     \
    const int G = H / KVH;                                                                                         \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                          \
    for (int task = 0; task < n * KVH; task++) {                                                                   \
        const int s = task / KVH, h = task % KVH, len = (int)lens[s];                                              \
        const int start = (window > 0 && len > window) ? len - window : 0;                                         \
        float qf[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG];                                                   \
        float kf[MAXBS][MAXD], vf[MAXBS][MAXD], sc[MAXG][MAXBS];                                                   \
        for (int g = 0; g < G; g++) {                                                                              \
            const T *qp = q + ((int64_t)s * H + (int64_t)h * G + g) * D;                                           \
            for (int d = 0; d < D; d++) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; }                       \
            m[g] = -INFINITY; l[g] = 0.f;                                                                          \
        }                                                                                                          \
        const int64_t *table = tables + (int64_t)s * max_blocks;                                                   \
        for (int b = start / BS; b * BS < len; b++) {                                                              \
            const int j0 = b * BS < start ? start - b * BS : 0;                                                    \
            const int j1 = (b + 1) * BS <= len ? BS : len - b * BS;                                                \
            const int64_t base = table[b] * BS;                                                                    \
            for (int j = j0; j < j1; j++) {                                                                        \
                const KT *kp = k_cache + ((base + j) * KVH + h) * RS, *vp = v_cache + ((base + j) * KVH + h) * RS; \
                const float ks = KSCALE(kp, D), vs = KSCALE(vp, D);                                                \
                for (int d = 0; d < D; d++) { kf[j][d] = KLOAD(kp[d]) * ks; vf[j][d] = KLOAD(vp[d]) * vs; }        \
            }                                                                                                      \
            for (int g = 0; g < G; g++) {                                                                          \
                float bm = -INFINITY;                                                                              \
                for (int j = j0; j < j1; j++) {                                                                    \
                    float dot = 0.f;                                                                               \
                    for (int d = 0; d < D; d++) dot += qf[g][d] * kf[j][d];                                        \
                    sc[g][j] = dot;                                                                                \
                    bm = dot > bm ? dot : bm;                                                                      \
                }                                                                                                  \
                const float mn = bm > m[g] ? bm : m[g], corr = expf(m[g] - mn);                                    \
                float sum = l[g] * corr;                                                                           \
                for (int d = 0; d < D; d++) acc[g][d] *= corr;                                                     \
                for (int j = j0; j < j1; j++) {                                                                    \
                    const float p = expf(sc[g][j] - mn);                                                           \
                    sum += p;                                                                                      \
                    for (int d = 0; d < D; d++) acc[g][d] += p * vf[j][d];                                         \
                }                                                                                                  \
                l[g] = sum; m[g] = mn;                                                                             \
            }                                                                                                      \
        }                                                                                                          \
        for (int g = 0; g < G; g++) {                                                                              \
            T *op = out + ((int64_t)s * H + (int64_t)h * G + g) * D;                                               \
            const float inv = 1.f / l[g];                                                                          \
            for (int d = 0; d < D; d++) op[d] = STORE(acc[g][d] * inv);                                            \
        }                                                                                                          \
    }                                                                                                              \
}

/* KV loaders: the row stride in elements, the row's scale, a cache element to float32 */
#define PLAIN_ROW(D) (D)
#define I8_ROW(D) ((D) + 2)
#define NO_SCALE(row, D) 1.f
#define I8_SCALE(row, D) kv_row_scale((const int8_t *)(row), D)
#define I8_LOAD(x) ((float)(x))

PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, PLAIN_ROW, bf16_to_f32, NO_SCALE)
PAGED_DECODE(paged_decode_f32, float, f32_id, f32_id, float, PLAIN_ROW, f32_id, NO_SCALE)
PAGED_DECODE(paged_decode_bf16_i8, uint16_t, bf16_to_f32, f32_to_bf16, int8_t, I8_ROW, I8_LOAD, I8_SCALE)
PAGED_DECODE(paged_decode_f32_i8, float, f32_id, f32_id, int8_t, I8_ROW, I8_LOAD, I8_SCALE)
PAGED_DECODE(paged_decode_bf16_f8, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, PLAIN_ROW, fp8_to_f32, NO_SCALE)
PAGED_DECODE(paged_decode_f32_f8, float, f32_id, f32_id, uint8_t, PLAIN_ROW, fp8_to_f32, NO_SCALE)
