/* A decode step's whole decoder stack in one call (CPU, float32 activations, a float32 or bf16 KV cache).
 *
 * At batch 1 a step of a small model is ~250 kernel calls that each take tens of microseconds; made one by one
 * from Python, each also pays the interpreter, ctypes and torch's dispatch, and on two cores that overhead was
 * half the step. Here model/decode_graph.py describes the model once (every layer's norms, linears and cache),
 * and a step is one call that runs the same kernels in the same order as LlamaForCausalLM.forward:
 *
 *   residual = embeddings; h = norm(residual)                         (layer 0: input_layernorm, no add)
 *   per layer: qkv = h W_qkv; RoPE on q and k, k and v into the cache slots; attention per decode group;
 *              x = o W_o; h = norm(residual += x); x = silu(gate) * up of h W_gate_up; x = x W_down;
 *              h = norm(residual += x) with the next layer's input_layernorm (the final norm after the last)
 *
 * Each op is a function of another library, reached through a pointer: the linears through each weight
 * format's GraphLinear entry (graph.h), the norm and SiLU-and-multiply from fused_f32.c, attention from
 * paged_attention.c. RoPE is computed here as apply_rope does in torch (two products and a sum, each rounded:
 * no FMA contraction), so a step's hidden states equal the Python path's bit for bit
 * (tests/model/test_decode_graph.py).
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "graph.h"

typedef void (*NormFn)(const float *x, int64_t ldx, float *residual, const float *w, float *out, int64_t ldo, int T,
                       int N, float eps, int threads);
typedef void (*SiluMulFn)(const float *gate_up, int64_t ldg, float *out, int T, int I, int threads);
typedef void (*AttendFn)(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                         const int64_t *lens, float *out, int n, int H, int KVH, int D, int BS, int max_blocks,
                         int window, float scale, int threads);

typedef struct {  /* one linear: its calls, each writing its own columns of y */
    const GraphLinear *calls;
    int64_t n;
} Linear;

typedef struct {
    const float *input_norm, *post_norm;  /* RMSNorm weights [hidden] */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;              /* [blocks, block_size, kv_heads, head_dim], float32 or bf16 */
} Layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size, window;
    int64_t kv_bf16;                /* the cache holds bf16 (model/kv_format.py's Bf16KV), rounded as torch rounds */
    float eps, scale;
    const Layer *layer;
    const float *final_norm;
    const float *cos, *sin_signed;  /* [positions, head_dim]: RotaryEmbedding's tables (the sign of rotate_half
                                       folded into sin) */
    NormFn norm;
    SiluMulFn silu_mul;
    AttendFn attend;
} Graph;

typedef struct {  /* one decode group (model/attention.py's DecodeGroup) */
    int64_t start, n, max_blocks;
    const int64_t *tables, *lens;
} Group;

static int linear(const Linear *l, const float *x, int64_t ldx, float *y, int64_t ldy, int M, int threads) {
    for (int64_t i = 0; i < l->n; i++) {
        const GraphLinear *c = &l->calls[i];
        if (c->run(c, x, ldx, y + c->col, ldy, M, threads)) return -1;
    }
    return 0;
}

static inline void put(void *cache, int64_t i, float x, int bf) {
    if (bf) ((uint16_t *)cache)[i] = f32_to_bf16(x);
    else ((float *)cache)[i] = x;
}

/* q and k heads of each row rotated (x * cos + roll(x, D/2) * sin_signed), q into q [M, H, D], k and v into the
 * cache at the row's slot */
static void rope_write(const Graph *g, const Layer *L, const float *qkv, const int64_t *pos, const int64_t *slots,
                       float *q, int M) {
    const int64_t D = g->head_dim, half = D / 2, qs = g->heads * D, kvs = g->kv_heads * D, row = qs + 2 * kvs;
    for (int t = 0; t < M; t++) {
        const float *c = g->cos + pos[t] * D, *s = g->sin_signed + pos[t] * D, *src = qkv + t * row;
        for (int64_t h = 0; h < g->heads + g->kv_heads; h++) {
            const float *x = src + h * D;
            const int to_q = h < g->heads;
            const int64_t at = to_q ? t * qs + h * D : slots[t] * kvs + (h - g->heads) * D;
            for (int64_t d = 0; d < D; d++) {
                const float a = x[d] * c[d], b = x[d < half ? d + half : d - half] * s[d];
                if (to_q) q[at + d] = a + b;
                else put(L->k_cache, at + d, a + b, (int)g->kv_bf16);
            }
        }
        for (int64_t i = 0; i < kvs; i++) put(L->v_cache, slots[t] * kvs + i, src[qs + kvs + i], (int)g->kv_bf16);
    }
}

/* embed [M, hidden] (the step's embeddings), positions and cache slots [M]; out [M, hidden]: the final norm's
 * output. Every row is a decode (a query over its own prefix, in one of the groups). Returns 0, or -1 if memory
 * ran out or a kernel failed. */
int decode_graph_run(const Graph *g, const float *embed, const int64_t *pos, const int64_t *slots,
                     const Group *groups, int n_groups, float *out, int M, int threads) {
    const int64_t hid = g->hidden, qs = g->heads * g->head_dim, qkv_w = qs + 2 * g->kv_heads * g->head_dim;
    float *res = malloc(sizeof(float) * M * hid), *x = malloc(sizeof(float) * M * hid),
          *h = malloc(sizeof(float) * M * hid), *qkv = malloc(sizeof(float) * M * qkv_w),
          *q = malloc(sizeof(float) * M * qs), *att = malloc(sizeof(float) * M * qs),
          *gu = malloc(sizeof(float) * M * 2 * g->inter), *act = malloc(sizeof(float) * M * g->inter);
    int rc = -1;
    if (!res || !x || !h || !qkv || !q || !att || !gu || !act) goto done;
    memcpy(res, embed, sizeof(float) * M * hid);
    g->norm(res, hid, NULL, g->layer[0].input_norm, h, hid, M, (int)hid, g->eps, threads);
    for (int64_t l = 0; l < g->layers; l++) {
        const Layer *L = &g->layer[l];
        if (l > 0) g->norm(x, hid, res, L->input_norm, h, hid, M, (int)hid, g->eps, threads);
        if (linear(&L->qkv, h, hid, qkv, qkv_w, M, threads)) goto done;
        rope_write(g, L, qkv, pos, slots, q, M);
        for (int i = 0; i < n_groups; i++) {
            const Group *gr = &groups[i];
            g->attend(q + gr->start * qs, L->k_cache, L->v_cache, gr->tables, gr->lens, att + gr->start * qs,
                      (int)gr->n, (int)g->heads, (int)g->kv_heads, (int)g->head_dim, (int)g->block_size,
                      (int)gr->max_blocks, (int)g->window, g->scale, threads);
        }
        if (linear(&L->o, att, qs, x, hid, M, threads)) goto done;
        g->norm(x, hid, res, L->post_norm, h, hid, M, (int)hid, g->eps, threads);
        if (linear(&L->gate_up, h, hid, gu, 2 * g->inter, M, threads)) goto done;
        g->silu_mul(gu, 2 * g->inter, act, M, (int)g->inter, threads);
        if (linear(&L->down, act, g->inter, x, hid, M, threads)) goto done;
    }
    g->norm(x, hid, res, g->final_norm, out, hid, M, (int)hid, g->eps, threads);
    rc = 0;
done:
    free(res); free(x); free(h); free(qkv); free(q); free(att); free(gu); free(act);
    return rc;
}
