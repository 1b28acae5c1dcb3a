/* Linear layers over bf16 weights with float32 activations, for CPUs with AVX2 and FMA but no bf16 dot products.
 *
 * There a bf16 checkpoint computes in float32 (model/compute_dtype.py), and a decode step streams every weight
 * from memory: kept in float32 the weights cost four bytes each, in bf16 two. This kernel keeps them in bf16 and
 * widens them in registers (a bf16 is the top half of a float32: zero-extend, shift left 16), so a step reads half
 * the bytes and every product is the exact float32 product of the stored values:
 *
 *   y[m][n] = sum_k x[m][k] * float(w[n][k]) + bias[n]      (float32 sums, k in order, one FMA each)
 *
 * bf16 weights come in panels (model/packed_linear.py packs them once): NR = 16 weight rows k-major, [K][NR], the
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
 * Every output is the same FMA chain over k at every row count, so a row gets the same bits in any batch.
 *
 * int8 weights (model/quant.py's format: one byte a weight row-major, a float32 scale per row,
 * y = scale[n] * (x . q[n]) + bias[n]; an int8 is exact in float32; a quarter of float32's bytes) run as
 * dot-product blocks: a thread takes a tile of 48 weight rows; blocks of 4 activation rows x 3 weight rows run as
 * 12 register accumulators over k, and every block of activation rows sweeps the tile while it sits in L2, so the
 * weights are read from memory once per call; the first sweep prefetches the rows a few blocks ahead.
 *
 * bf16 panels serve any row count (a prefill chunk too); int8 past WIDEN_MAX_ROWS takes model/quant.py's
 * portable path.
 * x [M, K] float32 (row stride ldx), bias [N] float32 or NULL, y [M, N] (row stride ldy).
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "twospeed-unsupported: needs AVX2 and FMA (avx2, fma)"
#endif
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "graph.h"

/* -- int8 rows ------------------------------------------------------------------------------------------------- */
#define MB 4    /* activation rows per register block */
#define NB 3    /* weight rows per register block: MB x NB accumulators + NB widened weights + one x vector = 16 */
#define TILE 48 /* weight rows a thread takes at a time (a multiple of NB): its rows stay in L2 while every block
                   of activation rows sweeps them, so the weights are read from memory once per call */

#define PF_BLOCKS 2 /* how far ahead the first sweep prefetches: each block reads NB rows of K at once, streams too
                       short for the hardware prefetcher to run ahead (1-8 rows on a Zen 3: +15-25% bandwidth) */

static inline __m256 widen8_i8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r][c] = scale[c] * sum_k x[r][k] w[c][k] + bias[c] for r < R, c < C (constants where inlined: R <= MB,
   C <= NB). w points at weight row 0 of the block; scale and bias at its first row (bias may be NULL). */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const int8_t *w, int K,
                                                        const float *scale, const float *bias, float *y,
                                                        int64_t ldy, int R, int C, int pf) {
    __m256 acc[MB][NB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf && (k & 31) == 0)  /* a cache line of each row PF_BLOCKS blocks ahead: the streams are short */
            for (int c = 0; c < C; c++) _mm_prefetch((const char *)(w + (int64_t)(c + PF_BLOCKS * NB) * K + k), _MM_HINT_T0);
        __m256 wv[NB];
        for (int c = 0; c < C; c++) wv[c] = widen8_i8(w + (int64_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int kk = k; kk < K; kk++) s += x[r * ldx + kk] * (float)w[(int64_t)c * K + kk];
            y[r * ldy + c] = s * scale[c] + (bias ? bias[c] : 0.0f);
        }
}

/* One instantiation per (R, C), so every loop above unrolls over registers. */
#define BLOCK(R, C) block(x, ldx, w, K, scale, bias, y, ldy, R, C, pf)
static void block_int8(const float *x, int64_t ldx, const int8_t *w, int K, const float *scale, const float *bias,
                       float *y, int64_t ldy, int R, int C, int pf) {
    switch (R * 4 + C) {
        case 4 * 4 + 3: BLOCK(4, 3); break;  case 4 * 4 + 2: BLOCK(4, 2); break;
        case 4 * 4 + 1: BLOCK(4, 1); break;  case 3 * 4 + 3: BLOCK(3, 3); break;
        case 3 * 4 + 2: BLOCK(3, 2); break;  case 3 * 4 + 1: BLOCK(3, 1); break;
        case 2 * 4 + 3: BLOCK(2, 3); break;  case 2 * 4 + 2: BLOCK(2, 2); break;
        case 2 * 4 + 1: BLOCK(2, 1); break;  case 1 * 4 + 3: BLOCK(1, 3); break;
        case 1 * 4 + 2: BLOCK(1, 2); break;  default: BLOCK(1, 1); break;
    }
}

static void linear_int8(const float *x, int64_t ldx, const int8_t *w, const float *scale, const float *bias,
                        float *y, int64_t ldy, int M, int N, int K, int threads) {
    const int tiles = (N + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int n_end = (t + 1) * TILE < N ? (t + 1) * TILE : N;
        for (int m = 0; m < M; m += MB) {
            const int R = M - m < MB ? M - m : MB;
            for (int n = t * TILE; n < n_end; n += NB) {
                const int C = n_end - n < NB ? n_end - n : NB;
                const int pf = m == 0 && n + NB < n_end;  /* the first sweep streams the tile from memory */
                block_int8(x + (int64_t)m * ldx, ldx, w + (int64_t)n * K, K, scale + n, bias ? bias + n : NULL,
                           y + (int64_t)m * ldy + n, ldy, R, C, pf);
            }
        }
    }
}

/* -- bf16 panels ------------------------------------------------------------------------------------------------ */
#define NR 16             /* weight rows per panel: two float32 vectors a k */
#define MR 6              /* activation rows per chunk block: 2 x MR accumulators + 2 panel vectors + 1 broadcast */
#define KC 256            /* k per float32 chunk: KC x NR x 4 bytes = 16 KB, in L1 */
#define MC 256            /* rows a pass takes past 8: MC x KC x 4 bytes = 256 KB of activations, in L2 */
#define CHUNK_MIN_ROWS 9  /* from here each weight is widened once into a chunk; below, in registers per row block */
#define PF_AHEAD 512      /* bytes ahead a streaming panel prefetches: too few rows for the hardware prefetcher */

static inline void widen16(const uint16_t *w, __m256 *lo, __m256 *hi) {
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 8))), 16));
}

/* y[r][j] = out[r][j] + bias[j] for r < R, j < C (the panel's real rows). The sums come through memory: handing
   the register accumulators themselves to a function makes GCC keep a copy of them in memory, a store per FMA. */
static inline void store_rows(float out[][NR], const float *bias, float *y, int64_t ldy, int R, int C) {
    for (int r = 0; r < R; r++) {
        if (C == NR) {
            __m256 a0 = _mm256_load_ps(out[r]), a1 = _mm256_load_ps(out[r] + 8);
            if (bias) {
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
            }
            _mm256_storeu_ps(y + r * ldy, a0);
            _mm256_storeu_ps(y + r * ldy + 8, a1);
        } else {
            for (int j = 0; j < C; j++) y[r * ldy + j] = out[r][j] + (bias ? bias[j] : 0.0f);
        }
    }
}

/* Rows from CHUNK_MIN_ROWS: the R (a constant where inlined) rows' sums over one float32 chunk p [kn][NR], added to
   the running sums in y unless `first`; on the `last` chunk the bias joins them. */
static inline __attribute__((always_inline)) void chunk_block(const float *x, int64_t ldx, const float *p, int kn,
                                                              const float *bias, float *y, int64_t ldy, int R,
                                                              int C, int first, int last) {
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
    store_rows(out, last ? bias : NULL, y, ldy, R, C);
}

static void chunk_rows(const float *x, int64_t ldx, const float *p, int kn, const float *bias, float *y,
                       int64_t ldy, int R, int C, int first, int last) {
    switch (R) {
        case 6: chunk_block(x, ldx, p, kn, bias, y, ldy, 6, C, first, last); break;
        case 5: chunk_block(x, ldx, p, kn, bias, y, ldy, 5, C, first, last); break;
        case 4: chunk_block(x, ldx, p, kn, bias, y, ldy, 4, C, first, last); break;
        case 3: chunk_block(x, ldx, p, kn, bias, y, ldy, 3, C, first, last); break;
        case 2: chunk_block(x, ldx, p, kn, bias, y, ldy, 2, C, first, last); break;
        default: chunk_block(x, ldx, p, kn, bias, y, ldy, 1, C, first, last); break;
    }
}

static inline int panel_cols(int N, int t) { return N - t * NR < NR ? N - t * NR : NR; }

static void panels_pass(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                        int M, int N, int K, int threads) {
    const int panels = (N + NR - 1) / NR, chunks = (K + KC - 1) / KC;
    const int blocks = (M + MR - 1) / MR;  /* the rows in near-equal blocks of at most MR: 16 -> 6, 5, 5 */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < panels; t++) {
        float p[KC * NR] __attribute__((aligned(64)));
        const int C = panel_cols(N, t);
        for (int c = 0; c < chunks; c++) {
            const int k0 = c * KC, kn = K - k0 < KC ? K - k0 : KC;
            const uint16_t *src = w + ((int64_t)t * K + k0) * NR;
            /* the chunk after next, in this thread's order (panel by panel, chunk by chunk), or past the end */
            const int64_t ahead = (int64_t)t * chunks + c + 2;
            const int pf = ahead < (int64_t)panels * chunks;
            const uint16_t *pf_src = w + ((ahead / chunks) * K + ahead % chunks * KC) * NR;
            for (int k = 0; k < kn; k++) {
                if (pf && (k & 1) == 0) _mm_prefetch((const char *)(pf_src + k * NR), _MM_HINT_T0);
                __m256 lo, hi;
                widen16(src + k * NR, &lo, &hi);
                _mm256_store_ps(p + k * NR, lo);
                _mm256_store_ps(p + k * NR + 8, hi);
            }
            for (int b = 0, m = 0; b < blocks; b++) {
                const int R = (M - m) / (blocks - b);
                chunk_rows(x + (int64_t)m * ldx + k0, ldx, p, kn, bias ? bias + t * NR : NULL,
                           y + (int64_t)m * ldy + t * NR, ldy, R, C, c == 0, c == chunks - 1);
                m += R;
            }
        }
    }
}

/* Past MC rows (a prefill chunk) the rows go in passes of at most MC, so a pass's activations for one chunk of k
   (MC x KC floats, 256 KB) stay in L2 while every panel of the weight runs over them; the weights stream once a
   pass. */
static void panels_chunked(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                           int M, int N, int K, int threads) {
    const int passes = (M + MC - 1) / MC;
    for (int p = 0, m = 0; p < passes; p++) {
        const int R = (M - m) / (passes - p);
        panels_pass(x + (int64_t)m * ldx, ldx, w, bias, y + (int64_t)m * ldy, ldy, R, N, K, threads);
        m += R;
    }
}

/* Fewer rows: G panels side by side (R x 2G <= 8 accumulators), widened in registers from the stream. */
static inline __attribute__((always_inline)) void stream_block(const float *x, int64_t ldx, const uint16_t *w,
                                                               int K, const float *bias, float *y, int64_t ldy,
                                                               int N, int t, int R, int G) {
    __m256 acc[4][4][2];  /* [panel][row][half] */
    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[g][r][0] = acc[g][r][1] = _mm256_setzero_ps();
    const int64_t panel = (int64_t)K * NR;
    const uint16_t *src = w + t * panel;
    for (int k = 0; k < K; k++) {
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {
            const uint16_t *at = src + g * panel + k * NR;
            if ((k & 1) == 0) _mm_prefetch((const char *)at + PF_AHEAD, _MM_HINT_T0);
            __m256 w0, w1;
            widen16(at, &w0, &w1);
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
        store_rows(out[g], bias ? bias + (t + g) * NR : NULL, y + (t + g) * NR, ldy, R, panel_cols(N, t + g));
}

static void stream_rows(const float *x, int64_t ldx, const uint16_t *w, int K, const float *bias, float *y,
                        int64_t ldy, int N, int t, int R, int G) {
    switch (R * 8 + G) {
        case 1 * 8 + 4: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 1, 4); break;
        case 2 * 8 + 2: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 2, 2); break;
        case 4 * 8 + 1: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 4, 1); break;
        case 3 * 8 + 1: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 3, 1); break;
        case 2 * 8 + 1: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 2, 1); break;
        default: stream_block(x, ldx, w, K, bias, y, ldy, N, t, 1, 1); break;
    }
}

/* A thread takes four panels at a time; the rows run in near-equal blocks of at most four (7 -> 4, 3), each over
   the four panels in groups of G (1 row: all four at once; 2 rows: two; more: one). */
static void panels_streamed(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y,
                            int64_t ldy, int M, int N, int K, int threads) {
    const int panels = (N + NR - 1) / NR, quads = (panels + 3) / 4, blocks = (M + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int q = 0; q < quads; q++) {
        const int here = panels - 4 * q < 4 ? panels - 4 * q : 4;
        for (int b = 0, m = 0; b < blocks; b++) {
            const int R = (M - m) / (blocks - b), G = R == 1 ? 4 : R == 2 ? 2 : 1;
            for (int t = 4 * q, g; t < 4 * q + here; t += g) {
                g = 4 * q + here - t < G ? 1 : G;  /* the last quad may hold fewer panels */
                stream_rows(x + (int64_t)m * ldx, ldx, w, K, bias, y + (int64_t)m * ldy, ldy, N, t, R, g);
            }
            m += R;
        }
    }
}

static void linear_bf16(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                        int M, int N, int K, int threads) {
    if (M >= CHUNK_MIN_ROWS) panels_chunked(x, ldx, w, bias, y, ldy, M, N, K, threads);
    else panels_streamed(x, ldx, w, bias, y, ldy, M, N, K, threads);
}

/* bf16 weights in panels (above): ceil(N / NR) x K x NR */
void linear_widen(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int threads) {
    linear_bf16(x, ldx, w, bias, y, ldy, M, N, K, threads);
}

/* int8 weights w [N, K] with a float32 scale per row: y = scale[n] * (x . w[n]) + bias[n] */
void linear_widen_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale, const float *bias, float *y,
                     int64_t ldy, int M, int N, int K, int threads) {
    linear_int8(x, ldx, w, scale, bias, y, ldy, M, N, K, threads);
}

/* the decode graph's entry (graph.h): int8 rows where the call carries scales, else bf16 panels */
int widen_graph_linear(const GraphLinear *op, const float *x, int64_t ldx, float *y, int64_t ldy, int M,
                       int threads) {
    if (op->scale) linear_int8(x, ldx, op->w, op->scale, op->bias, y, ldy, M, op->N, op->K, threads);
    else linear_bf16(x, ldx, op->w, op->bias, y, ldy, M, op->N, op->K, threads);
    return 0;
}
