/* One linear kernel call as the decode graph (csrc/decode_graph.c) makes it: every weight format with a C kernel
 * exports a `run` of this signature, and model/decode_graph.py fills one GraphLinear per call from the format's
 * own description (FormatLinear.graph_calls). y points at the call's first output column (row stride ldy). */
#ifndef TWOSPEED_GRAPH_H
#define TWOSPEED_GRAPH_H
#include <stdint.h>

typedef struct GraphLinear GraphLinear;
struct GraphLinear {
    int (*run)(const GraphLinear *op, const float *x, int64_t ldx, float *y, int64_t ldy, int M, int threads);
    const void *w;       /* the weight, in the kernel's own layout */
    const float *scale;  /* a float32 scale per output row, or NULL */
    const float *bias;   /* float32 [N], or NULL */
    int64_t col;         /* the first output column this call writes */
    int kind;            /* the kernel's own variant (a block kind) */
    int N, K;            /* output columns written, inputs read */
};

#endif
