/* Linear layers over bf16 or int8 weights with float32 activations, for CPUs with AVX2 and FMA but no bf16 dot
 * products.
 *
 * There a bf16 checkpoint computes in float32 (model/compute_dtype.py), and a decode step streams every weight
 * from memory: kept in float32 the weights cost four bytes each, in bf16 two. This kernel keeps them in bf16 and
 * widens them in registers (a bf16 is the top half of a float32: zero-extend, shift left 16), so a step reads half
 * the bytes and every product is the exact float32 product of the stored values:
 *
 *   y[m][n] = sum_k x[m][k] * float(w[n][k]) + bias[n]      (float32 sums, k in order, one FMA each)
 *
 * int8 weights (model/quant.py's format: a float32 scale per weight row, y = scale[n] * (x . q[n]) + bias[n]; an
 * int8 is exact in float32) take the same path at one byte a weight, a quarter of float32's bytes.
 *
 * The weights come in panels (model/packed_linear.py packs them once): NR = 16 weight rows k-major, [K][NR], the
 * last panel zero-padded, panel after panel. Each k of a panel is then two float32 vectors, and a block of
 * activation rows runs as outer products: per k, the two panel vectors, one broadcast of each x row, two FMAs a
 * row, into register accumulators that each hold one output's sum, the GEMM micro-kernel form. No horizontal sums
 * and no transposes, so the FMA units set the pace once a step has more than 8 rows:
 * - more than 8 rows: a thread widens KC k of a panel into a float32 chunk in L1 and runs blocks of up to MR rows
 *   over it, adding into y across the chunks; the chunk after next is prefetched while one is widened, so memory
 *   reads overlap arithmetic. Each weight is widened once per pass of up to MC rows.
 * - up to 8 rows (decode): memory-bound; the panels stream once, widened in registers, rows in blocks of up to
 *   four; four panels side by side for one row (eight accumulators: enough independent FMAs to hide their
 *   latency), two for two rows, one for three or four.
 * Every output is the same FMA chain over k at every row count, so a row gets the same bits in any batch; the
 * panels serve every row count, prefill chunks too.
 *
 * x [M, K] float32 (row stride ldx), bias [N] float32 or NULL, y [M, N] (row stride ldy).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "twospeed-unsupported: needs AVX2 and FMA (avx2, fma)"
#endif
#include <immintrin.h>
#include <stdint.h>

#include "graph.h"

#define NR 16             /* weight rows per panel: two float32 vectors a k */
#define MR 6              /* activation rows per chunk block: 2 x MR accumulators + 2 panel vectors + 1 broadcast */
#define KC 256            /* k per float32 chunk: KC x NR x 4 bytes = 16 KB, in L1 */
#define MC 256            /* rows a pass takes past 8: MC x KC x 4 bytes = 256 KB of activations, in L2 */
#define CHUNK_MIN_ROWS 9  /* from here each weight is widened once into a chunk; below, in registers per row block */
#define PF_AHEAD 512      /* bytes ahead a streaming panel prefetches: too few rows for the hardware prefetcher */

#define FMT_BF16 0
#define FMT_INT8 1

/* The NR weights at element `at` of the panels, as two float32 vectors. */
static inline __attribute__((always_inline)) void widen16(const void *w, int64_t at, int fmt, __m256 *lo,
                                                          __m256 *hi) {
    if (fmt == FMT_BF16) {
        const uint16_t *h = (const uint16_t *)w + at;
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
        *hi = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + 8))), 16));
    } else {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)w + at));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    }
}

static inline const char *element(const void *w, int64_t at, int fmt) {
    return (const char *)w + at * (fmt == FMT_BF16 ? 2 : 1);
}

/* y[r][j] = out[r][j] x scale[j] + bias[j] for r < R, j < C (the panel's real rows; scale and bias may be NULL).
   The sums come through memory: handing the register accumulators themselves to a function makes GCC keep a copy
   of them in memory, a store per FMA. */
static inline void store_rows(float out[][NR], const float *scale, const float *bias, float *y, int64_t ldy, int R,
                              int C) {
    for (int r = 0; r < R; r++) {
        if (C == NR) {
            __m256 a0 = _mm256_load_ps(out[r]), a1 = _mm256_load_ps(out[r] + 8);
            if (scale) {
                a0 = _mm256_mul_ps(a0, _mm256_loadu_ps(scale));
                a1 = _mm256_mul_ps(a1, _mm256_loadu_ps(scale + 8));
            }
            if (bias) {
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
            }
            _mm256_storeu_ps(y + r * ldy, a0);
            _mm256_storeu_ps(y + r * ldy + 8, a1);
        } else {
            for (int j = 0; j < C; j++)
                y[r * ldy + j] = (scale ? out[r][j] * scale[j] : out[r][j]) + (bias ? bias[j] : 0.0f);
        }
    }
}

/* Rows from CHUNK_MIN_ROWS: the R (a constant where inlined) rows' sums over one float32 chunk p [kn][NR], added to
   the running sums in y unless `first`; on the `last` chunk the scale and bias join them. */
static inline __attribute__((always_inline)) void chunk_block(const float *x, int64_t ldx, const float *p, int kn,
                                                              const float *scale, const float *bias, float *y,
                                                              int64_t ldy, int R, int C, int first, int last) {
    __m256 acc[MR][2];
    if (first) {
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    } else if (C == NR) {
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_loadu_ps(y + r * ldy);
            acc[r][1] = _mm256_loadu_ps(y + r * ldy + 8);
        }
    } else {
        float in[MR][NR] __attribute__((aligned(32)));
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NR; j++) in[r][j] = j < C ? y[r * ldy + j] : 0.0f;
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_load_ps(in[r]);
            acc[r][1] = _mm256_load_ps(in[r] + 8);
        }
    }
    for (int k = 0; k < kn; k++) {
        const __m256 w0 = _mm256_load_ps(p + k * NR), w1 = _mm256_load_ps(p + k * NR + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    float out[MR][NR] __attribute__((aligned(32)));
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {
        _mm256_store_ps(out[r], acc[r][0]);
        _mm256_store_ps(out[r] + 8, acc[r][1]);
    }
    store_rows(out, last ? scale : NULL, last ? bias : NULL, y, ldy, R, C);
}

static void chunk_rows(const float *x, int64_t ldx, const float *p, int kn, const float *scale, const float *bias,
                       float *y, int64_t ldy, int R, int C, int first, int last) {
    switch (R) {
        case 6: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 6, C, first, last); break;
        case 5: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 5, C, first, last); break;
        case 4: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 4, C, first, last); break;
        case 3: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 3, C, first, last); break;
        case 2: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 2, C, first, last); break;
        default: chunk_block(x, ldx, p, kn, scale, bias, y, ldy, 1, C, first, last); break;
    }
}

static inline int panel_cols(int N, int t) { return N - t * NR < NR ? N - t * NR : NR; }

static void panels_pass(const float *x, int64_t ldx, const void *w, int fmt, const float *scale, const float *bias,
                        float *y, int64_t ldy, int M, int N, int K, int threads) {
    const int panels = (N + NR - 1) / NR, chunks = (K + KC - 1) / KC;
    const int blocks = (M + MR - 1) / MR;  /* the rows in near-equal blocks of at most MR: 16 -> 6, 5, 5 */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < panels; t++) {
        float p[KC * NR] __attribute__((aligned(64)));
        const int C = panel_cols(N, t);
        for (int c = 0; c < chunks; c++) {
            const int k0 = c * KC, kn = K - k0 < KC ? K - k0 : KC;
            const int64_t src = ((int64_t)t * K + k0) * NR;
            /* the chunk after next, in this thread's order (panel by panel, chunk by chunk), or past the end */
            const int64_t ahead = (int64_t)t * chunks + c + 2;
            const int pf = ahead < (int64_t)panels * chunks;
            const int64_t pf_src = ((ahead / chunks) * K + ahead % chunks * KC) * NR;
            for (int k = 0; k < kn; k++) {
                if (pf && (k & 1) == 0) _mm_prefetch(element(w, pf_src + k * NR, fmt), _MM_HINT_T0);
                __m256 lo, hi;
                widen16(w, src + k * NR, fmt, &lo, &hi);
                _mm256_store_ps(p + k * NR, lo);
                _mm256_store_ps(p + k * NR + 8, hi);
            }
            for (int b = 0, m = 0; b < blocks; b++) {
                const int R = (M - m) / (blocks - b);
                chunk_rows(x + (int64_t)m * ldx + k0, ldx, p, kn, scale ? scale + t * NR : NULL,
                           bias ? bias + t * NR : NULL, y + (int64_t)m * ldy + t * NR, ldy, R, C, c == 0,
                           c == chunks - 1);
                m += R;
            }
        }
    }
}

/* Past MC rows (a prefill chunk) the rows go in passes of at most MC, so a pass's activations for one chunk of k
   (MC x KC floats, 256 KB) stay in L2 while every panel of the weight runs over them; the weights stream once a
   pass. */
static void panels_chunked(const float *x, int64_t ldx, const void *w, int fmt, const float *scale,
                           const float *bias, float *y, int64_t ldy, int M, int N, int K, int threads) {
    const int passes = (M + MC - 1) / MC;
    for (int p = 0, m = 0; p < passes; p++) {
        const int R = (M - m) / (passes - p);
        panels_pass(x + (int64_t)m * ldx, ldx, w, fmt, scale, bias, y + (int64_t)m * ldy, ldy, R, N, K, threads);
        m += R;
    }
}

/* Fewer rows: G panels side by side (R x 2G <= 8 accumulators), widened in registers from the stream. */
static inline __attribute__((always_inline)) void stream_block(const float *x, int64_t ldx, const void *w, int fmt,
                                                               int K, const float *scale, const float *bias,
                                                               float *y, int64_t ldy, int N, int t, int R, int G) {
    __m256 acc[4][4][2];  /* [panel][row][half] */
    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[g][r][0] = acc[g][r][1] = _mm256_setzero_ps();
    const int64_t panel = (int64_t)K * NR, src = t * panel;
    for (int k = 0; k < K; k++) {
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {
            const int64_t at = src + g * panel + k * NR;
            if ((k & 1) == 0) _mm_prefetch(element(w, at, fmt) + PF_AHEAD, _MM_HINT_T0);
            __m256 w0, w1;
            widen16(w, at, fmt, &w0, &w1);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
                acc[g][r][0] = _mm256_fmadd_ps(xb, w0, acc[g][r][0]);
                acc[g][r][1] = _mm256_fmadd_ps(xb, w1, acc[g][r][1]);
            }
        }
    }
    float out[4][4][NR] __attribute__((aligned(32)));
    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            _mm256_store_ps(out[g][r], acc[g][r][0]);
            _mm256_store_ps(out[g][r] + 8, acc[g][r][1]);
        }
    for (int g = 0; g < G; g++)
        store_rows(out[g], scale ? scale + (t + g) * NR : NULL, bias ? bias + (t + g) * NR : NULL, y + (t + g) * NR,
                   ldy, R, panel_cols(N, t + g));
}

/* One instantiation per (rows, panels side by side, format), so every loop above unrolls over registers. */
#define STREAM(R, G, FMT) stream_block(x, ldx, w, FMT, K, scale, bias, y, ldy, N, t, R, G)
#define STREAM_SHAPES(FMT)                                                          \
    switch (R * 8 + G) {                                                            \
        case 1 * 8 + 4: STREAM(1, 4, FMT); break;                                  \
        case 2 * 8 + 2: STREAM(2, 2, FMT); break;                                  \
        case 4 * 8 + 1: STREAM(4, 1, FMT); break;                                  \
        case 3 * 8 + 1: STREAM(3, 1, FMT); break;                                  \
        case 2 * 8 + 1: STREAM(2, 1, FMT); break;                                  \
        default: STREAM(1, 1, FMT); break;                                         \
    }
static void stream_rows(const float *x, int64_t ldx, const void *w, int fmt, int K, const float *scale,
                        const float *bias, float *y, int64_t ldy, int N, int t, int R, int G) {
    if (fmt == FMT_BF16) STREAM_SHAPES(FMT_BF16)
    else STREAM_SHAPES(FMT_INT8)
}

/* A thread takes four panels at a time; the rows run in near-equal blocks of at most four (7 -> 4, 3), each over
   the four panels in groups of G (1 row: all four at once; 2 rows: two; more: one). */
static void panels_streamed(const float *x, int64_t ldx, const void *w, int fmt, const float *scale,
                            const float *bias, float *y, int64_t ldy, int M, int N, int K, int threads) {
    const int panels = (N + NR - 1) / NR, quads = (panels + 3) / 4, blocks = (M + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int q = 0; q < quads; q++) {
        const int here = panels - 4 * q < 4 ? panels - 4 * q : 4;
        for (int b = 0, m = 0; b < blocks; b++) {
            const int R = (M - m) / (blocks - b), G = R == 1 ? 4 : R == 2 ? 2 : 1;
            for (int t = 4 * q, g; t < 4 * q + here; t += g) {
                g = 4 * q + here - t < G ? 1 : G;  /* the last quad may hold fewer panels */
                stream_rows(x + (int64_t)m * ldx, ldx, w, fmt, K, scale, bias, y + (int64_t)m * ldy, ldy, N, t, R,
                            g);
            }
            m += R;
        }
    }
}

static void linear(const float *x, int64_t ldx, const void *w, int fmt, const float *scale, const float *bias,
                   float *y, int64_t ldy, int M, int N, int K, int threads) {
    if (M >= CHUNK_MIN_ROWS) panels_chunked(x, ldx, w, fmt, scale, bias, y, ldy, M, N, K, threads);
    else panels_streamed(x, ldx, w, fmt, scale, bias, y, ldy, M, N, K, threads);
}

/* bf16 weights in panels (above): ceil(N / NR) x K x NR */
void linear_widen(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int threads) {
    linear(x, ldx, w, FMT_BF16, NULL, bias, y, ldy, M, N, K, threads);
}

/* int8 weights in panels (above) with a float32 scale per weight row: y = scale[n] * (x . w[n]) + bias[n] */
void linear_widen_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale, const float *bias, float *y,
                     int64_t ldy, int M, int N, int K, int threads) {
    linear(x, ldx, w, FMT_INT8, scale, bias, y, ldy, M, N, K, threads);
}

/* the decode graph's entry (graph.h): int8 panels where the call carries scales, else bf16 */
int widen_graph_linear(const GraphLinear *op, const float *x, int64_t ldx, float *y, int64_t ldy, int M,
                       int threads) {
    linear(x, ldx, op->w, op->scale ? FMT_INT8 : FMT_BF16, op->scale, op->bias, y, ldy, M, op->N, op->K, threads);
    return 0;
}
