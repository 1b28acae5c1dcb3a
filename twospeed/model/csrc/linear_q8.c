/* Linear layers over 8-bit weights (int8 or fp8 e4m3) with a float32 scale per output row, bf16 activations.
 *
 * A decode step streams every weight from memory once, so one byte per weight instead of bf16's two halves the
 * step's weight traffic. The weights are widened in registers, never in memory: an int8 or e4m3 value has at
 * most 8 significant bits, so it is exactly a bf16 value, and a 128-entry table of those bf16 values (two
 * vpermi2b lookups, one for each byte of the bf16, on the magnitude; the sign ORed in) widens 64 weights in a
 * handful of instructions. The bf16 weights then feed vdpbf16ps in the VNNI pair layout csrc/linear_bf16.c
 * uses (16 output rows x 2 consecutive k per vector); the scale multiplies the float32 sum once per output. So
 * every product is exact and the only roundings are float32 summation and the final bf16 rounding:
 *
 *   y[m][n] = bf16( scale[n] * sum_k x[m][k] * w[n][k] + bias[n] )
 *
 * Two kernels behind one call:
 * - linear_q8 (AVX-512 BF16 + VBMI): a thread owns a 64-row tile of W and sweeps every activation row over it,
 *   MR rows at a time; each tile is read from memory once per call. For decode's few rows.
 * - linear_q8_amx (AMX-BF16, Sapphire Rapids and later): for many rows (prefill chunks). A thread widens a
 *   panel of 32 output rows x all of K into bf16 once (in its own cache-resident buffer, already in the AMX
 *   B-tile layout), then runs every 32-row block of activations through it with tile dot products. The
 *   widening is paid once per call, not per row; the sums are the same exact products in float32.
 *
 * Layout: for each 16-row block, each pair of k pairs (k2, k2 + 1) is one 64-byte group: the 32 bytes of k2
 * (16 rows x 2 k) and the 32 of k2 + 1, interleaved 8 bytes at a time, the order vpunpck{l,h}bw undo. Blocks of
 * 16 rows, 4 to a 64-row tile (rows past N are zero); an odd last k pair is padded with zero weights. scale [N]
 * float32; bias [N] bf16 or NULL; x [M, K] bf16 (row stride ldx), y [M, N] bf16 (row stride ldy). K even; the
 * AMX kernel needs K % 32 == 0.
 */
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__) || \
    !defined(__AVX512VBMI__)
#error "twospeed-unsupported: needs AVX-512 BF16 and VBMI (avx512f, avx512bw, avx512vl, avx512_bf16, avx512vbmi)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bf16.h"

#define NT 64  /* output rows per tile: 4 vectors of 16 */
#define MR 4   /* activation rows per register block: 4 x 4 accumulators + the tables and widening temps */
#define FMT_INT8 0
#define FMT_FP8 1

int linear_q8_tile_rows(void) { return NT; }

/* bytes of the packed weight: tiles of 64 rows x K rounded up to whole groups of 4 k */
int64_t linear_q8_packed_bytes(int N, int K) { return (int64_t)((N + NT - 1) / NT) * NT * ((K + 3) / 4 * 4); }

/* W [N, K] row-major bytes -> the grouped pair layout above. */
void linear_q8_pack(const uint8_t *w, uint8_t *p, int N, int K, int threads) {
    const int blocks = (N + NT - 1) / NT * (NT / 16), K2 = K / 2, groups = (K2 + 1) / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        uint8_t *dst = p + (int64_t)b * groups * 64;
        for (int g = 0; g < groups; g++)
            for (int half = 0; half < 2; half++) {  /* k pair 2g (A) and 2g + 1 (B) */
                const int k2 = 2 * g + half;
                for (int e = 0; e < 32; e++) {  /* element e of the pair's vector: row e / 2, k 2 k2 + e % 2 */
                    const int n = b * 16 + e / 2, k = 2 * k2 + e % 2;
                    dst[(int64_t)g * 64 + 16 * (e / 8) + 8 * half + e % 8] = n < N && k2 < K2 ? w[(int64_t)n * K + k] : 0;
                }
            }
    }
}

/* The tables: bf16 of each magnitude 0..127, low bytes and high bytes, 64 entries per register. */
static uint8_t TABLES[2][2][128];  /* [fmt][lo, hi][magnitude] */

void linear_q8_init(void) {
    for (int m = 0; m < 128; m++) {
        const uint16_t i8 = f32_to_bf16((float)m), f8 = f32_to_bf16(fp8_to_f32((uint8_t)m));
        TABLES[FMT_INT8][0][m] = (uint8_t)i8; TABLES[FMT_INT8][1][m] = (uint8_t)(i8 >> 8);
        TABLES[FMT_FP8][0][m] = (uint8_t)f8; TABLES[FMT_FP8][1][m] = (uint8_t)(f8 >> 8);
    }
}

typedef struct { __m512i lo0, lo1, hi0, hi1; } Tables;

static inline Tables tables(int fmt) {
    Tables t;
    t.lo0 = _mm512_loadu_si512(TABLES[fmt][0]); t.lo1 = _mm512_loadu_si512(TABLES[fmt][0] + 64);
    t.hi0 = _mm512_loadu_si512(TABLES[fmt][1]); t.hi1 = _mm512_loadu_si512(TABLES[fmt][1] + 64);
    return t;
}

/* one 64-byte group -> the bf16 weights of k pairs 2g (a) and 2g + 1 (b). int8 is two's complement: its
 * magnitude indexes the table (the quantizer never writes -128); e4m3 is sign-magnitude already (vpermi2b reads
 * the low 7 bits). The sign goes into the high byte. */
static inline __attribute__((always_inline)) void widen64(const uint8_t *p, const int fmt, const Tables *t,
                                                          __m512bh *a, __m512bh *b) {
    const __m512i raw = _mm512_loadu_si512(p);
    const __m512i mag = fmt == FMT_INT8 ? _mm512_abs_epi8(raw) : raw;
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, mag, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, mag, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, raw, _mm512_set1_epi8((char)0x80), 0xF8);  /* hi | (raw & 0x80) */
    *a = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *b = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

/* the epilogue: scale, bias, one rounding to bf16, the tail columns masked */
static inline void store_row(uint16_t *y, const __m512 *acc, const __m512 *s, const __m512 *b, int ncols) {
    for (int j = 0; j < 4; j++) {
        const int left = ncols - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 v = _mm512_fmadd_ps(acc[j], s[j], b[j]);
        _mm256_mask_storeu_epi16(y + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

static inline __attribute__((always_inline)) void block(
        const int mr, const int fmt, const uint16_t *x, int64_t ldx, const uint8_t *tile, int K2,
        const __m512 s[4], const __m512 b[4], uint16_t *y, int64_t ldy, int ncols) {
    const Tables t = tables(fmt);
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t bstride = (int64_t)(K2 + 1) / 2 * 64;
    const uint32_t *xr[MR];
    for (int i = 0; i < mr; i++) xr[i] = (const uint32_t *)(x + i * ldx);
    int k2 = 0;
    for (; k2 + 1 < K2; k2 += 2) {
        const uint8_t *group = tile + (int64_t)k2 * 32;
        for (int j = 0; j < 4; j++) {
            __m512bh wa, wb;
            widen64(group + j * bstride, fmt, &t, &wa, &wb);
            for (int i = 0; i < mr; i++) {
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wa, (__m512bh)_mm512_set1_epi32((int)xr[i][k2]));
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wb, (__m512bh)_mm512_set1_epi32((int)xr[i][k2 + 1]));
            }
        }
    }
    if (k2 < K2) {  /* an odd last k pair: its group's second half is zero padding, and x has no pair there */
        for (int j = 0; j < 4; j++) {
            __m512bh wa, wb;
            widen64(tile + (int64_t)k2 * 32 + j * bstride, fmt, &t, &wa, &wb);
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wa, (__m512bh)_mm512_set1_epi32((int)xr[i][k2]));
        }
    }
    for (int i = 0; i < mr; i++) store_row(y + i * ldy, acc[i], s, b, ncols);
}

/* the tile's scales and biases as vectors; columns past N get 0 */
static void tile_vectors(const float *scale, const uint16_t *bias, int n0, int ncols, __m512 s[4], __m512 b[4]) {
    for (int j = 0; j < 4; j++) {
        const int left = ncols - 16 * j;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        s[j] = _mm512_maskz_loadu_ps(mask, scale + n0 + 16 * j);
        if (bias == NULL) { b[j] = _mm512_setzero_ps(); continue; }
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0 + 16 * j);
        b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
}

#define DISPATCH(FMT)                                                                                          \
    for (; m + MR <= M; m += MR) block(MR, FMT, x + m * ldx, ldx, tile, K2, s, b, y + m * ldy + n0, ldy, ncols); \
    switch (M - m) {                                                                                           \
        case 3: block(3, FMT, x + m * ldx, ldx, tile, K2, s, b, y + m * ldy + n0, ldy, ncols); break;           \
        case 2: block(2, FMT, x + m * ldx, ldx, tile, K2, s, b, y + m * ldy + n0, ldy, ncols); break;           \
        case 1: block(1, FMT, x + m * ldx, ldx, tile, K2, s, b, y + m * ldy + n0, ldy, ncols); break;           \
        default: break;                                                                                        \
    }

void linear_q8(const uint16_t *x, int64_t ldx, const uint8_t *p, const float *scale, const uint16_t *bias,
               uint16_t *y, int64_t ldy, int M, int N, int K, int fmt, int threads) {
    const int tiles = (N + NT - 1) / NT, K2 = K / 2;
    const int64_t tile_bytes = 4 * (int64_t)((K2 + 1) / 2) * 64;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *tile = p + (int64_t)t * tile_bytes;
        const int n0 = t * NT, ncols = N - n0 < NT ? N - n0 : NT;
        __m512 s[4], b[4];
        tile_vectors(scale, bias, n0, ncols, s, b);
        int m = 0;
        if (fmt == FMT_FP8) { DISPATCH(FMT_FP8) } else { DISPATCH(FMT_INT8) }
    }
}

#ifdef __AMX_BF16__
/* AMX: tiles 0-3 accumulate C (2 row blocks x 2 column blocks of 16 x 16 float32), 4-5 hold A (16 rows x 32 k of
 * x each), 6-7 hold B (16 k pairs x 16 output rows, the packed layout's own order once widened). */
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;

/* Linux hands out the AMX register state only on request (once per process). 1 = usable. */
int linear_q8_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* one 16-row block's panel (all K; K2 even here) widened to bf16: [K/2][16][2] */
static void widen_panel(const uint8_t *src, uint16_t *dst, int K2, int fmt) {
    const Tables t = tables(fmt);
    for (int k2 = 0; k2 < K2; k2 += 2) {
        __m512bh a, b;
        if (fmt == FMT_FP8) widen64(src + (int64_t)k2 * 32, FMT_FP8, &t, &a, &b);
        else widen64(src + (int64_t)k2 * 32, FMT_INT8, &t, &a, &b);
        _mm512_storeu_si512(dst + (int64_t)k2 * 32, (__m512i)a);
        _mm512_storeu_si512(dst + (int64_t)(k2 + 1) * 32, (__m512i)b);
    }
}

void linear_q8_amx(const uint16_t *x, int64_t ldx, const uint8_t *p, const float *scale, const uint16_t *bias,
                   uint16_t *y, int64_t ldy, int M, int N, int K, int fmt, int threads) {
    const int K2 = K / 2, pairs = (N + 31) / 32, full = M / 32 * 32;
    /* the last, partial block of 32 rows, zero-padded, so no tile load reads past x */
    uint16_t *tail = NULL;
    if (full < M) {
        tail = aligned_alloc(64, (size_t)32 * K * sizeof(uint16_t));
        memset(tail, 0, (size_t)32 * K * sizeof(uint16_t));
        for (int r = 0; r < M - full; r++) memcpy(tail + (int64_t)r * K, x + (int64_t)(full + r) * ldx, (size_t)K * 2);
    }
    #pragma omp parallel num_threads(threads)
    {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        uint16_t *panel = aligned_alloc(64, (size_t)2 * K2 * 32 * sizeof(uint16_t));
        float c[32][32] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int pr = 0; pr < pairs; pr++) {
            const int n0 = pr * 32, ncols = N - n0 < 32 ? N - n0 : 32;
            for (int h = 0; h < 2; h++) widen_panel(p + (int64_t)(2 * pr + h) * K2 * 32, panel + (int64_t)h * K2 * 32, K2, fmt);
            __m512 s[4], b[4];
            tile_vectors(scale, bias, n0, ncols, s, b);  /* only s[0..1], b[0..1]: 32 columns */
            for (int m0 = 0; m0 < M; m0 += 32) {
                const uint16_t *a = m0 < full ? x + (int64_t)m0 * ldx : tail;
                const int64_t lda = (m0 < full ? ldx : K) * 2;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int kc = 0; kc < K / 32; kc++) {
                    _tile_loadd(4, a + 32 * kc, lda);
                    _tile_loadd(5, (const char *)(a + 32 * kc) + 16 * lda, lda);
                    _tile_loadd(6, panel + (int64_t)kc * 512, 64);
                    _tile_loadd(7, panel + (int64_t)K2 * 32 + (int64_t)kc * 512, 64);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, &c[0][0], 128); _tile_stored(1, &c[0][16], 128);
                _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128);
                const int rows = M - m0 < 32 ? M - m0 : 32;
                for (int r = 0; r < rows; r++) {
                    const __m512 acc[4] = {_mm512_load_ps(c[r]), _mm512_load_ps(c[r] + 16), _mm512_setzero_ps(),
                                           _mm512_setzero_ps()};
                    store_row(y + (int64_t)(m0 + r) * ldy + n0, acc, s, b, ncols);
                }
            }
        }
        free(panel);
        _tile_release();
    }
    free(tail);
}
#else
int linear_q8_amx_init(void) { return 0; }
void linear_q8_amx(const uint16_t *x, int64_t ldx, const uint8_t *p, const float *scale, const uint16_t *bias,
                   uint16_t *y, int64_t ldy, int M, int N, int K, int fmt, int threads) { (void)x; }
#endif
