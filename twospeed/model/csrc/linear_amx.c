/* bf16 linear layers for batched decode steps (tens of rows) on AMX tiles, OpenMP.
 *
 * A step of 8-64 decode rows still streams every weight once, and AMX multiplies a 16-row tile of activations by
 * a 16-column tile of weights in a few cycles, so such a step can run at memory speed. oneDNN's kernels for these
 * shapes read the weights at under half of it here. This kernel reads the weights in csrc/linear_bf16.c's packed
 * layout, which is AMX's B-tile layout as it stands: a 16-output block holds [K / 2][16][2] bf16, so 32 k of it
 * are one tile of 16 rows of 64 bytes, read from memory once per step.
 *
 * Work: the activations are copied once into a zero-padded buffer of whole 32-row chunks; a thread takes 32
 * outputs at a time (two weight blocks) and, for each 32-row chunk, accumulates four float32 tiles (2 x 2) over
 * K: 2 A tiles + 2 B tiles + 4 C tiles are AMX's eight registers. The epilogue adds the bias and rounds to
 * bf16 once (nearest even), as linear_bf16.c and oneDNN do; the sums run in another order.
 *
 * y = x W^T (+ bias): x [M, K] bf16 (row stride ldx), W [N, K] packed by linear_bf16_pack (64-output tiles,
 * zero-padded), bias [N] bf16 or NULL, y [M, N] bf16 (row stride ldy). K must be a multiple of 32 (the Python
 * side falls back otherwise). linear_amx_init asks Linux for the tile state once per process (0 on success).
 */
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512BF16__)
#error "twospeed-unsupported: needs AMX (amx_tile, amx_bf16) and AVX-512 BF16"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MC 32  /* activation rows per chunk: two A tiles */
#define NC 32  /* outputs per work item: two B tiles */
#define PF 128  /* k ahead that the weights are prefetched (4 tiles of each block) */

int linear_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* 32 float32 outputs of one row (+ bias) -> bf16, the first `ncols` stored. */
static inline void store_row(const float *acc, const __m512 b[2], uint16_t *y, int ncols) {
    for (int j = 0; j < 2; j++) {
        const int left = ncols - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 16 * j), b[j]);
        _mm256_mask_storeu_epi16(y + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

void linear_amx(const uint16_t *x, int64_t ldx, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t ldy,
                int M, int N, int K, int threads) {
    const int chunks = (M + MC - 1) / MC, pairs = (N + NC - 1) / NC, K2 = K / 2;
    uint16_t *a = aligned_alloc(64, (size_t)chunks * MC * K * sizeof(uint16_t));
    if (a == NULL) return;
    for (int m = 0; m < chunks * MC; m++) {
        if (m < M) memcpy(a + (int64_t)m * K, x + (int64_t)m * ldx, (size_t)K * sizeof(uint16_t));
        else memset(a + (int64_t)m * K, 0, (size_t)K * sizeof(uint16_t));
    }
    const int64_t block = (int64_t)K2 * 32;  /* one 16-output block of the packed weight */
    #pragma omp parallel num_threads(threads)
    {
        configure();
        float acc[MC][NC] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int q = 0; q < pairs; q++) {
            const int n0 = q * NC, ncols = N - n0 < NC ? N - n0 : NC;
            const uint16_t *b0 = p + (int64_t)(2 * q) * block, *b1 = b0 + block;
            __m512 b[2];
            for (int j = 0; j < 2; j++) {
                const int left = ncols - 16 * j;
                if (bias == NULL || left <= 0) { b[j] = _mm512_setzero_ps(); continue; }
                const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0 + 16 * j);
                b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            }
            for (int c = 0; c < chunks; c++) {
                const uint16_t *a0 = a + (int64_t)c * MC * K, *a1 = a0 + (int64_t)16 * K;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int k = 0; k < K; k += 32) {
                    if (c == 0) {  /* the weights' first pass: fetch the next tiles' lines ahead of their loads */
                        for (int l = 0; l < 16; l++) {
                            _mm_prefetch((const char *)(b0 + (int64_t)(k + PF) * 16) + 64 * l, _MM_HINT_T0);
                            _mm_prefetch((const char *)(b1 + (int64_t)(k + PF) * 16) + 64 * l, _MM_HINT_T0);
                        }
                    }
                    _tile_loadd(4, a0 + k, K * 2);
                    _tile_loadd(6, b0 + (int64_t)k * 16, 64);
                    _tile_loadd(7, b1 + (int64_t)k * 16, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, a1 + k, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, &acc[0][0], NC * 4);
                _tile_stored(1, &acc[0][16], NC * 4);
                _tile_stored(2, &acc[16][0], NC * 4);
                _tile_stored(3, &acc[16][16], NC * 4);
                const int rows = M - c * MC < MC ? M - c * MC : MC;
                for (int i = 0; i < rows; i++) store_row(acc[i], b, y + (int64_t)(c * MC + i) * ldy + n0, ncols);
            }
        }
        _tile_release();
    }
    free(a);
}
