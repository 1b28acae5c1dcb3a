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
 * rows of D values followed by their bf16 scale (row stride D + 2), *_f8 reads fp8 e4m3 rows, and
 * paged_decode_f32_b16 a bf16 cache under float32 queries (a float32 model's K and V in half the bytes).
 *
 * paged_decode_f32 and paged_decode_f32_b16 (head_dim a multiple of 8) have an AVX2 + FMA version: each key's
 * row is read once for the G query heads, the block's G x BS scores are exponentiated eight lanes at a time
 * (Cephes' expf polynomial, about 2 ulp), and P x V runs a register tile of 8 columns over the block's rows. When a step has
 * fewer (sequence, KV head) tasks than a few per thread (batch 1: a handful of KV heads on every core), each
 * task's context is split into chunks whose partial softmax states (max, sum, accumulator) merge after the
 * parallel loop, as flash-decoding does on a GPU, so every core works on a lone sequence.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdlib.h>

#define SPLIT_MIN 128  /* fewest keys a split chunk takes (a chunk's fixed cost: q loads, the merge) */

static inline __m256 exp256(__m256 x) {  /* Cephes' expf, as csrc/bf16.h's exp512; below -87.3 gives 0 */
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

typedef struct { float m[MAXG], l[MAXG], acc[MAXG][MAXD]; } Partial;  /* an online softmax's state */

/* 8 cache elements from index i as float32: a float32 cache's, or a bf16 cache's widened (the top half of a float) */
static inline __attribute__((always_inline)) __m256 kv8(const void *cache, int64_t i, int bf) {
    if (bf)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i))), 16));
    return _mm256_loadu_ps((const float *)cache + i);
}

/* keys [k0, k1) of sequence s, KV head h into part (m = -inf, l = 0, acc = 0 on entry); bf: a bf16 cache */
static inline __attribute__((always_inline)) void attend(const float *q, const void *k_cache, const void *v_cache,
                                                         const int64_t *table, int s, int h, int k0, int k1, int H,
                                                         int KVH, int D, int BS, float scale, Partial *part, int bf) {
    const int G = H / KVH;
    const int64_t RS = (int64_t)KVH * D;
    float qf[MAXG][MAXD] __attribute__((aligned(32)));
    float sc[MAXG][MAXBS + 8] __attribute__((aligned(32)));
    for (int g = 0; g < G; g++) {
        const float *qp = q + ((int64_t)s * H + (int64_t)h * G + g) * D;
        for (int d = 0; d < D; d++) qf[g][d] = qp[d] * scale;
    }
    for (int b = k0 / BS; b * BS < k1; b++) {
        const int j0 = b * BS < k0 ? k0 - b * BS : 0, j1 = (b + 1) * BS <= k1 ? BS : k1 - b * BS;
        const int64_t base = table[b] * BS * RS + (int64_t)h * D;  /* the block's first row of head h */
        for (int g = 0; g < G; g++)  /* scores of 8 keys at a time: 8 independent FMA chains, one hadd tree */
            for (int j = j0; j < j1; j += 8) {
                int64_t kr[8];
                for (int i = 0; i < 8; i++) kr[i] = base + (j + i < j1 ? j + i : j1 - 1) * RS;  /* past j1: masked */
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_load_ps(&qf[g][d]);
                    for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, kv8(k_cache, kr[i] + d, bf), a[i]);
                }
                const __m256 h03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                const __m256 h47 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
                _mm256_storeu_ps(&sc[g][j], _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20),
                                                          _mm256_permute2f128_ps(h03, h47, 0x31)));
            }
        for (int g = 0; g < G; g++) {
            float bm = -INFINITY;
            for (int j = j0; j < j1; j++) bm = sc[g][j] > bm ? sc[g][j] : bm;
            const float mn = bm > part->m[g] ? bm : part->m[g], corr = expf(part->m[g] - mn);
            const __m256 vmn = _mm256_set1_ps(mn);
            __m256 vsum = _mm256_setzero_ps();
            for (int j = j0; j < j1; j += 8) {  /* lanes past j1 are scored -inf: exp gives 0 */
                const int left = j1 - j;
                __m256 x = _mm256_loadu_ps(&sc[g][j]);
                if (left < 8) {
                    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x,
                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), idx)));
                }
                const __m256 p = exp256(_mm256_sub_ps(x, vmn));
                _mm256_storeu_ps(&sc[g][j], p);
                vsum = _mm256_add_ps(vsum, p);
            }
            part->l[g] = part->l[g] * corr + hsum256(vsum);
            part->m[g] = mn;
            const __m256 vc = _mm256_set1_ps(corr);
            int d = 0;  /* acc[g] in registers over the block's keys, 64 then 8 columns at a time */
            for (; d + 64 <= D; d += 64) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_load_ps(&part->acc[g][d + 8 * i]), vc);
                for (int j = j0; j < j1; j++) {
                    const __m256 p = _mm256_set1_ps(sc[g][j]);
                    const int64_t vr = base + j * RS + d;
                    for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(p, kv8(v_cache, vr + 8 * i, bf), a[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_store_ps(&part->acc[g][d + 8 * i], a[i]);
            }
            for (; d < D; d += 8) {
                __m256 a = _mm256_mul_ps(_mm256_load_ps(&part->acc[g][d]), vc);
                for (int j = j0; j < j1; j++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(sc[g][j]), kv8(v_cache, base + j * RS + d, bf), a);
                _mm256_store_ps(&part->acc[g][d], a);
            }
        }
    }
}

static void partial_init(Partial *p, int G, int D) {
    for (int g = 0; g < G; g++) {
        p->m[g] = -INFINITY; p->l[g] = 0.f;
        for (int d = 0; d < D; d++) p->acc[g][d] = 0.f;
    }
}

/* attend for each cache type, bf a constant there: the parallel regions below are outlined before any inlining,
   so a flag passed through them would be tested at every load */
typedef void (*AttendFn)(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int s, int h,
                         int k0, int k1, int H, int KVH, int D, int BS, float scale, Partial *part);

static void attend_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int s, int h,
                       int k0, int k1, int H, int KVH, int D, int BS, float scale, Partial *part) {
    attend(q, k_cache, v_cache, table, s, h, k0, k1, H, KVH, D, BS, scale, part, 0);
}

static void attend_b16(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int s, int h,
                       int k0, int k1, int H, int KVH, int D, int BS, float scale, Partial *part) {
    attend(q, k_cache, v_cache, table, s, h, k0, k1, H, KVH, D, BS, scale, part, 1);
}

static void decode_avx2(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                        const int64_t *lens, float *out, int n, int H, int KVH, int D, int BS, int max_blocks,
                        int window, float scale, int threads, AttendFn attend_rows) {
    const int G = H / KVH, tasks = n * KVH;
    int longest = 0;
    for (int s = 0; s < n; s++) longest = (int)lens[s] > longest ? (int)lens[s] : longest;
    int splits = 1;  /* chunks per task: enough that every thread has work, none under SPLIT_MIN keys */
    while (splits < 64 && tasks * splits < 4 * threads && longest / (2 * splits) >= SPLIT_MIN) splits *= 2;
    Partial *parts = splits > 1 ? aligned_alloc(32, sizeof(Partial) * (size_t)tasks * splits) : NULL;
    if (!parts) {  /* one chunk per task (or no memory for the chunks' states): each written where computed */
        #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int task = 0; task < tasks; task++) {
            const int s = task / KVH, h = task % KVH, len = (int)lens[s];
            const int start = (window > 0 && len > window) ? len - window : 0;
            Partial p __attribute__((aligned(32)));
            partial_init(&p, G, D);
            attend_rows(q, k_cache, v_cache, tables + (int64_t)s * max_blocks, s, h, start, len, H, KVH, D, BS, scale,
                        &p);
            for (int g = 0; g < G; g++) {
                float *op = out + ((int64_t)s * H + (int64_t)h * G + g) * D;
                const float inv = 1.f / p.l[g];
                for (int d = 0; d < D; d++) op[d] = p.acc[g][d] * inv;
            }
        }
        return;
    }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < tasks * splits; t++) {
        const int task = t / splits, c = t % splits, s = task / KVH, h = task % KVH, len = (int)lens[s];
        const int start = (window > 0 && len > window) ? len - window : 0;
        const int span = len - start, k0 = start + (int)((int64_t)span * c / splits),
                  k1 = start + (int)((int64_t)span * (c + 1) / splits);
        partial_init(&parts[t], G, D);
        if (k1 > k0)
            attend_rows(q, k_cache, v_cache, tables + (int64_t)s * max_blocks, s, h, k0, k1, H, KVH, D, BS, scale,
                        &parts[t]);
    }
    #pragma omp parallel for num_threads(tasks >= threads ? threads : 1) schedule(static)
    for (int task = 0; task < tasks; task++) {  /* merge the chunks' states: rescale each to the common max */
        const int s = task / KVH, h = task % KVH;
        const Partial *p = &parts[(int64_t)task * splits];
        for (int g = 0; g < G; g++) {
            float m = -INFINITY, l = 0.f;
            for (int c = 0; c < splits; c++) m = p[c].m[g] > m ? p[c].m[g] : m;
            float *op = out + ((int64_t)s * H + (int64_t)h * G + g) * D;
            for (int d = 0; d < D; d++) op[d] = 0.f;
            for (int c = 0; c < splits; c++) {
                if (p[c].l[g] == 0.f) continue;  /* an empty chunk */
                const float w = expf(p[c].m[g] - m);
                l += p[c].l[g] * w;
                for (int d = 0; d < D; d++) op[d] += p[c].acc[g][d] * w;
            }
            const float inv = 1.f / l;
            for (int d = 0; d < D; d++) op[d] *= inv;
        }
    }
    free(parts);
}
#endif

/* KV loaders: the row stride in elements, the row's scale, a cache element to float32 */
#define PLAIN_ROW(D) (D)
#define I8_ROW(D) ((D) + 2)
#define NO_SCALE(row, D) 1.f
#define I8_SCALE(row, D) kv_row_scale((const int8_t *)(row), D)
#define I8_LOAD(x) ((float)(x))

PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, PLAIN_ROW, bf16_to_f32, NO_SCALE)
PAGED_DECODE(paged_decode_f32_generic, float, f32_id, f32_id, float, PLAIN_ROW, f32_id, NO_SCALE)
PAGED_DECODE(paged_decode_bf16_i8, uint16_t, bf16_to_f32, f32_to_bf16, int8_t, I8_ROW, I8_LOAD, I8_SCALE)
PAGED_DECODE(paged_decode_f32_i8, float, f32_id, f32_id, int8_t, I8_ROW, I8_LOAD, I8_SCALE)
PAGED_DECODE(paged_decode_bf16_f8, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, PLAIN_ROW, fp8_to_f32, NO_SCALE)
PAGED_DECODE(paged_decode_f32_f8, float, f32_id, f32_id, uint8_t, PLAIN_ROW, fp8_to_f32, NO_SCALE)
PAGED_DECODE(paged_decode_f32_b16_generic, float, f32_id, f32_id, uint16_t, PLAIN_ROW, bf16_to_f32, NO_SCALE)

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                      const int64_t *lens, float *out, int n, int H, int KVH, int D, int BS, int max_blocks, int window,
                      float scale, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        decode_avx2(q, k_cache, v_cache, tables, lens, out, n, H, KVH, D, BS, max_blocks, window, scale, threads,
                    attend_f32);
        return;
    }
#endif
    paged_decode_f32_generic(q, k_cache, v_cache, tables, lens, out, n, H, KVH, D, BS, max_blocks, window, scale,
                             threads);
}

/* float32 queries over a bf16 cache (model/kv_format.py's Bf16KV: a float32 model's K and V in half the bytes) */
void paged_decode_f32_b16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                          const int64_t *lens, float *out, int n, int H, int KVH, int D, int BS, int max_blocks,
                          int window, float scale, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        decode_avx2(q, k_cache, v_cache, tables, lens, out, n, H, KVH, D, BS, max_blocks, window, scale, threads,
                    attend_b16);
        return;
    }
#endif
    paged_decode_f32_b16_generic(q, k_cache, v_cache, tables, lens, out, n, H, KVH, D, BS, max_blocks, window, scale,
                                 threads);
}
