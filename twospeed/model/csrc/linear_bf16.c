/* bf16 linear layers for few rows (decode steps) at memory speed: AVX-512 BF16 dot products, OpenMP.
 *
 * A decode step multiplies a handful of activation rows by every weight of the model, so it is bounded by
 * how fast the weights stream from memory; oneDNN's bf16 kernels read them at a third of what the memory
 * system gives here. This kernel reads each weight once per step, in the order it lies in memory.
 *
 * Weights are packed once, at load, into the VNNI pair layout that vdpbf16ps consumes: 16 output rows by
 * 2 consecutive k per 512-bit vector, [ceil(N / 64) * 4][K / 2][16][2], zero-padded to whole 64-row tiles.
 * One vector load then feeds 16 outputs of every activation row, each row's k pair broadcast: no
 * horizontal sums. A thread owns a 64-row tile (4 vectors wide) and sweeps all M rows over it, MR rows at a
 * time, so the tile is read from memory once and from cache for every further group of rows.
 *
 * y = x W^T (+ bias): x [M, K] bf16 row-major (row stride ldx), W [N, K] packed, bias [N] bf16 or NULL,
 * y [M, N] bf16 (row stride ldy), accumulated in float32 and rounded to nearest even once, as oneDNN does.
 * K must be even (the Python side falls back otherwise).
 */
/* Unsupported here unless -march=native enables these (model/cbuild.py skips on this mark, fails otherwise). */
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "twospeed-unsupported: needs AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NT 64  /* output rows per tile: 4 vectors of 16 */
#define MR 6   /* activation rows per register block: 6 x 4 accumulators + 4 weight vectors + 1 broadcast */

int linear_bf16_tile_rows(void) { return NT; }

/* W [N, K] row-major bf16 -> P [tiles * 4][K / 2][16][2]; rows past N are zero. */
void linear_bf16_pack(const uint16_t *w, uint16_t *p, int N, int K, int threads) {
    const int blocks = (N + NT - 1) / NT * (NT / 16), K2 = K / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        uint16_t *dst = p + (int64_t)b * K2 * 32;
        for (int k2 = 0; k2 < K2; k2++)
            for (int r = 0; r < 16; r++) {
                const int n = b * 16 + r;
                dst[(int64_t)k2 * 32 + 2 * r] = n < N ? w[(int64_t)n * K + 2 * k2] : 0;
                dst[(int64_t)k2 * 32 + 2 * r + 1] = n < N ? w[(int64_t)n * K + 2 * k2 + 1] : 0;
            }
    }
}

static inline __attribute__((always_inline)) void block(
        const int mr, const uint16_t *x, int64_t ldx, const uint16_t *tile, int K2, const __m512 bias[4],
        uint16_t *y, int64_t ldy, int ncols) {
    __m512 acc[MR][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = bias[j];
    const int64_t bstride = (int64_t)K2 * 32;
    const uint32_t *xr[MR];
    for (int i = 0; i < mr; i++) xr[i] = (const uint32_t *)(x + i * ldx);
    for (int k2 = 0; k2 < K2; k2++) {
        const uint16_t *wk = tile + (int64_t)k2 * 32;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + bstride);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 2 * bstride);
        const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 3 * bstride);
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[i][k2]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], w2, xv);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], w3, xv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) {
            const int left = ncols - 16 * j;
            if (left <= 0) break;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
        }
}

void linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                 int64_t ldy, int M, int N, int K, int threads) {
    const int tiles = (N + NT - 1) / NT, K2 = K / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint16_t *tile = p + (int64_t)t * 4 * K2 * 32;
        const int n0 = t * NT, ncols = N - n0 < NT ? N - n0 : NT;
        __m512 b[4];
        for (int j = 0; j < 4; j++) {
            if (bias == NULL || 16 * j >= ncols) { b[j] = _mm512_setzero_ps(); continue; }
            const int left = ncols - 16 * j;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0 + 16 * j);
            b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        int m = 0;
        for (; m + MR <= M; m += MR) block(MR, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols);
        switch (M - m) {  /* constant row counts: each case is unrolled with its accumulators in registers */
            case 5: block(5, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols); break;
            case 4: block(4, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols); break;
            case 3: block(3, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols); break;
            case 2: block(2, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols); break;
            case 1: block(1, x + m * ldx, ldx, tile, K2, b, y + m * ldy + n0, ldy, ncols); break;
            default: break;
        }
    }
}
