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
 *
 * paged_prefill_f32 (AVX2 + FMA) attends prefill chunks of float32 queries over a float32 or bf16 cache in place,
 * where the portable path gathers each chunk's whole context out of the pool (and widens a bf16 one) every layer
 * before an SDPA call: the few-token chunks a time-sized step puts beside decodes paid that copy for a handful of
 * queries. A task is a tile of a chunk's rows x the G heads of one KV head, at most 16 queries, one per float32
 * lane of two vectors, so every step is vertical (no horizontal sums): scores are a key's broadcast elements times
 * the transposed queries, the online softmax is lane-wise, and the transposed accumulator takes V's broadcast
 * elements times the probabilities; keys go 32 at a time, the next 32 prefetched while these compute.
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

#define MAXQ 16  /* queries in a prefill tile, one per float32 lane of two vectors: R rows x the G heads of a KV head */
_Static_assert(MAXG <= MAXQ, "a prefill tile holds at least one row's G query heads");
#define NK 32    /* keys scored, exponentiated and summed into the tile's state at a time */

/* A value the compiler must keep in a register: without this GCC folds a reused vector load into every FMA that
   reads it, and a register tile becomes load-bound. */
#define PIN(x) __asm__("" : "+x"(x))

/* st[t][0..16) = the 16 lanes of transposed queries qt[d][lane] dotted with key row kr[t], for C keys */
static inline __attribute__((always_inline)) void score_keys(const float *qt, const float *const *kr, float *st, int D,
                                                             const int C) {
    __m256 s[6][2];
    for (int t = 0; t < C; t++) s[t][0] = s[t][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m256 q0 = _mm256_load_ps(qt + d * MAXQ), q1 = _mm256_load_ps(qt + d * MAXQ + 8);
        PIN(q0); PIN(q1);
        for (int t = 0; t < C; t++) {
            const __m256 kv = _mm256_broadcast_ss(kr[t] + d);
            s[t][0] = _mm256_fmadd_ps(kv, q0, s[t][0]);
            s[t][1] = _mm256_fmadd_ps(kv, q1, s[t][1]);
        }
    }
    for (int t = 0; t < C; t++) { _mm256_store_ps(st + t * MAXQ, s[t][0]); _mm256_store_ps(st + t * MAXQ + 8, s[t][1]); }
}

/* at[t][lane] = at[t][lane] * corr[lane] + sum_j vr[j][d + t] st[j][lane], for C columns from d */
static inline __attribute__((always_inline)) void accumulate_values(float *at, const float *st,
                                                                    const float *const *vr, int d, int nk, __m256 c0,
                                                                    __m256 c1, const int C) {
    __m256 a[6][2];
    for (int t = 0; t < C; t++) {
        a[t][0] = _mm256_mul_ps(_mm256_load_ps(at + t * MAXQ), c0);
        a[t][1] = _mm256_mul_ps(_mm256_load_ps(at + t * MAXQ + 8), c1);
    }
    for (int j = 0; j < nk; j++) {
        __m256 p0 = _mm256_load_ps(st + j * MAXQ), p1 = _mm256_load_ps(st + j * MAXQ + 8);
        PIN(p0); PIN(p1);
        for (int t = 0; t < C; t++) {
            const __m256 vv = _mm256_broadcast_ss(vr[j] + d + t);
            a[t][0] = _mm256_fmadd_ps(vv, p0, a[t][0]);
            a[t][1] = _mm256_fmadd_ps(vv, p1, a[t][1]);
        }
    }
    for (int t = 0; t < C; t++) { _mm256_store_ps(at + t * MAXQ, a[t][0]); _mm256_store_ps(at + t * MAXQ + 8, a[t][1]); }
}

/* Prefill tile: rows r0 .. r0 + R - 1 of a chunk (row r at position p0 + r, flat row row0 + r), the G query heads
   of KV head h; row r attends to keys [lo_r, p0 + r + 1) of its sequence. The tile's queries sit in the lanes of
   two vectors, so every step is vertical: a key's scores for all of them are D broadcasts of the key times the
   transposed queries (no horizontal sums), the online softmax's max, rescale and sums are lane-wise, and the
   transposed accumulator takes V's elements as broadcasts times the probabilities. K and V rows are read in place
   from a float32 cache and widened once into kf, vf from a bf16 one. */
static inline __attribute__((always_inline)) void prefill_tile(const float *q, const void *k_cache,
                                                               const void *v_cache, const int64_t *table,
                                                               int64_t row0, int p0, int R, int h, int H, int KVH,
                                                               int D, int BS, int window, float scale, float *out,
                                                               int bf) {
    const int G = H / KVH, NQ = R * G;
    const int64_t RS = (int64_t)KVH * D;
    float qt[MAXD][MAXQ] __attribute__((aligned(32)));   /* the queries, transposed and scaled */
    float at[MAXD][MAXQ] __attribute__((aligned(32)));   /* the accumulator, transposed */
    float st[NK][MAXQ] __attribute__((aligned(32)));     /* scores, then probabilities, of NK keys */
    float kf[NK * MAXD] __attribute__((aligned(32))), vf[NK * MAXD] __attribute__((aligned(32)));
    int lo_i[MAXQ] __attribute__((aligned(32))), hi_i[MAXQ] __attribute__((aligned(32)));
    for (int i = 0; i < MAXQ; i++) { lo_i[i] = 0; hi_i[i] = 0; }  /* a lane without a query sees no key */
    for (int d = 0; d < D; d++)
        for (int i = 0; i < MAXQ; i++) { qt[d][i] = 0.f; at[d][i] = 0.f; }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int i = r * G + g;
            const float *qp = q + ((row0 + r) * H + (int64_t)h * G + g) * D;
            for (int d = 0; d < D; d++) qt[d][i] = qp[d] * scale;
            hi_i[i] = p0 + r + 1;
            lo_i[i] = (window > 0 && hi_i[i] > window) ? hi_i[i] - window : 0;
        }
    const __m256i lo0 = _mm256_load_si256((const __m256i *)lo_i), lo1 = _mm256_load_si256((const __m256i *)(lo_i + 8));
    const __m256i hi0 = _mm256_load_si256((const __m256i *)hi_i), hi1 = _mm256_load_si256((const __m256i *)(hi_i + 8));
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, l0 = _mm256_setzero_ps(), l1 = l0;
    const int klo = lo_i[0], khi = hi_i[NQ - 1];
    for (int k0 = klo; k0 < khi; k0 += NK) {
        const int nk = khi - k0 < NK ? khi - k0 : NK;
        const float *kr[NK], *vr[NK];  /* each key's K and V row */
        const int nn = khi - k0 - nk < NK ? khi - k0 - nk : NK;  /* keys of the next pass, prefetched now */
        const int eb = bf ? 2 : 4;  /* bytes a cache element */
        /* key k0 + j: row jb of block b; the key NK further on: row jn of block bn */
        for (int j = 0, b = k0 / BS, jb = k0 % BS, bn = (k0 + NK) / BS, jn = (k0 + NK) % BS; j < nk; j++) {
            const int64_t at_row = (table[b] * BS + jb) * RS + (int64_t)h * D;
            if (++jb == BS) { jb = 0; b++; }
            if (j < nn) {  /* a cache miss away while this pass computes */
                const int64_t nrow = (table[bn] * BS + jn) * RS + (int64_t)h * D;
                const char *kn = (const char *)k_cache + nrow * eb, *vn = (const char *)v_cache + nrow * eb;
                for (int off = 0; off < D * eb; off += 64) {
                    _mm_prefetch(kn + off, _MM_HINT_T0);
                    _mm_prefetch(vn + off, _MM_HINT_T0);
                }
                if (++jn == BS) { jn = 0; bn++; }
            }
            if (bf) {
                for (int d = 0; d < D; d += 8) {
                    _mm256_store_ps(&kf[j * D + d], kv8(k_cache, at_row + d, 1));
                    _mm256_store_ps(&vf[j * D + d], kv8(v_cache, at_row + d, 1));
                }
                kr[j] = kf + j * D; vr[j] = vf + j * D;
            } else {
                kr[j] = (const float *)k_cache + at_row; vr[j] = (const float *)v_cache + at_row;
            }
        }
        /* scores: 6 keys x 16 lanes a pass, one FMA chain per (key, vector) over d */
        int j = 0;
        for (; j + 6 <= nk; j += 6) score_keys(&qt[0][0], kr + j, &st[j][0], D, 6);
        for (; j + 2 <= nk; j += 2) score_keys(&qt[0][0], kr + j, &st[j][0], D, 2);
        if (j < nk) score_keys(&qt[0][0], kr + j, &st[j][0], D, 1);
        /* the mask (a key outside a lane's [lo, hi) scores -inf), then each lane's max over these keys */
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        __m256 b0 = ninf, b1 = ninf;
        for (j = 0; j < nk; j++) {
            const __m256i p = _mm256_set1_epi32(k0 + j);
            const __m256i out0 = _mm256_or_si256(_mm256_cmpgt_epi32(lo0, p), _mm256_cmpgt_epi32(_mm256_add_epi32(p, _mm256_set1_epi32(1)), hi0));
            const __m256i out1 = _mm256_or_si256(_mm256_cmpgt_epi32(lo1, p), _mm256_cmpgt_epi32(_mm256_add_epi32(p, _mm256_set1_epi32(1)), hi1));
            const __m256 x0 = _mm256_blendv_ps(_mm256_load_ps(&st[j][0]), ninf, _mm256_castsi256_ps(out0));
            const __m256 x1 = _mm256_blendv_ps(_mm256_load_ps(&st[j][8]), ninf, _mm256_castsi256_ps(out1));
            _mm256_store_ps(&st[j][0], x0); _mm256_store_ps(&st[j][8], x1);
            b0 = _mm256_max_ps(b0, x0); b1 = _mm256_max_ps(b1, x1);
        }
        /* new max; a lane that has seen no key yet stays at -inf and exp256 gives 0 for its NaN differences */
        const __m256 n0 = _mm256_max_ps(m0, b0), n1 = _mm256_max_ps(m1, b1);
        const __m256 c0 = exp256(_mm256_sub_ps(m0, n0)), c1 = exp256(_mm256_sub_ps(m1, n1));
        __m256 u0 = _mm256_setzero_ps(), u1 = u0;
        for (j = 0; j < nk; j++) {
            const __m256 p0v = exp256(_mm256_sub_ps(_mm256_load_ps(&st[j][0]), n0));
            const __m256 p1v = exp256(_mm256_sub_ps(_mm256_load_ps(&st[j][8]), n1));
            _mm256_store_ps(&st[j][0], p0v); _mm256_store_ps(&st[j][8], p1v);
            u0 = _mm256_add_ps(u0, p0v); u1 = _mm256_add_ps(u1, p1v);
        }
        l0 = _mm256_fmadd_ps(l0, c0, u0); l1 = _mm256_fmadd_ps(l1, c1, u1);
        m0 = n0; m1 = n1;
        /* at[d] = at[d] * corr + sum_j V[j][d] p[j]: 6 columns x 16 lanes a pass, over the keys */
        int d = 0;
        for (; d + 6 <= D; d += 6) accumulate_values(&at[d][0], &st[0][0], vr, d, nk, c0, c1, 6);
        for (; d + 2 <= D; d += 2) accumulate_values(&at[d][0], &st[0][0], vr, d, nk, c0, c1, 2);
    }
    float l[MAXQ] __attribute__((aligned(32)));
    _mm256_store_ps(l, l0); _mm256_store_ps(l + 8, l1);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int i = r * G + g;
            float *op = out + ((row0 + r) * H + (int64_t)h * G + g) * D;
            const float inv = 1.f / l[i];
            for (int d = 0; d < D; d++) op[d] = at[d][i] * inv;
        }
}

static void prefill_tile_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                             int64_t row0, int p0, int R, int h, int H, int KVH, int D, int BS, int window, float scale,
                             float *out) {
    prefill_tile(q, k_cache, v_cache, table, row0, p0, R, h, H, KVH, D, BS, window, scale, out, 0);
}

static void prefill_tile_b16(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                             int64_t row0, int p0, int R, int h, int H, int KVH, int D, int BS, int window, float scale,
                             float *out) {
    prefill_tile(q, k_cache, v_cache, table, row0, p0, R, h, H, KVH, D, BS, window, scale, out, 1);
}

typedef void (*TileFn)(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t row0,
                       int p0, int R, int h, int H, int KVH, int D, int BS, int window, float scale, float *out);

/* Every span's tiles (span, KV head, R rows) in one parallel loop; the last rows of a span, which see the most
   keys, are handed out first. */
static void prefill_avx2(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len, float *out, int n,
                         int H, int KVH, int D, int BS, int max_blocks, int window, float scale, int threads,
                         TileFn tile) {
    const int R = MAXQ / (H / KVH);  /* rows a tile holds */
    int total = 0;
    for (int s = 0; s < n; s++) total += (int)((q_len[s] + R - 1) / R) * KVH;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < total; t++) {
        int s = 0, rest = t, tiles;  /* task t: span s, the rest-th of its tiles x KV heads */
        while (rest >= (tiles = (int)((q_len[s] + R - 1) / R)) * KVH) { rest -= tiles * KVH; s++; }
        const int h = rest % KVH, k = tiles - 1 - rest / KVH;
        const int r0 = k * R, rows = (int)q_len[s] - r0 < R ? (int)q_len[s] - r0 : R;
        const int p0 = (int)(ctx_len[s] - q_len[s]) + r0;
        tile(q, k_cache, v_cache, tables + (int64_t)s * max_blocks, q_start[s] + r0, p0, rows, h, H, KVH, D, BS,
             window, scale, out);
    }
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

/* Whether paged_prefill_f32 is built here (AVX2 + FMA); where not, float32 prefill chunks keep the portable path. */
int paged_prefill_has_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Prefill chunks with float32 queries over a float32 or bf16 cache (head_dim a multiple of 8, G <= 16): n spans,
   span s the q_len[s] rows from flat row q_start[s], the last positions of its ctx_len[s] tokens, their K and V
   already in the cache; tables: [n, max_blocks]. Only where paged_prefill_has_avx2(). */
void paged_prefill_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                       const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len, float *out, int n, int H,
                       int KVH, int D, int BS, int max_blocks, int window, float scale, int bf16_cache, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    prefill_avx2(q, k_cache, v_cache, tables, q_start, q_len, ctx_len, out, n, H, KVH, D, BS, max_blocks, window,
                 scale, threads, bf16_cache ? prefill_tile_b16 : prefill_tile_f32);
#else
    (void)q; (void)k_cache; (void)v_cache; (void)tables; (void)q_start; (void)q_len; (void)ctx_len; (void)out;
    (void)n; (void)H; (void)KVH; (void)D; (void)BS; (void)max_blocks; (void)window; (void)scale; (void)bf16_cache;
    (void)threads;
#endif
}
