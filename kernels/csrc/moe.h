/* A mixture-of-experts MLP in native calls (moe.c): the router's top-k picks per token and the
   picked experts' SiLU MLPs, summed by the routing weights. Used by the per-layer path
   (models/moe.py through kernels/native.py) and by the decode stack (decode_stack.c), so both
   give the same bits. */
#ifndef RB_MOE_H
#define RB_MOE_H
#include "q4.h"

/* One layer's routed block for the decode stack: the router [experts, hidden] and per expert its
   gate|up chain [2 * intermediate, hidden] and its down projection [hidden, intermediate]; and
   Qwen2-MoE's shared expert (or NULLs): its gate|up [2 * shared_intermediate, hidden], down
   [hidden, shared_intermediate] and sigmoid gate [1, hidden], added as
   sigmoid(gate . x) * down(silu(gate_x) * up_x) (rb_sigmoid_gated_add). */
typedef struct {
    const rb_q4_weight *router;
    const rb_q4_weight *const *gate_up;
    const rb_q4_weight *const *down;
    int64_t experts, top_k, renormalise;
    const rb_q4_weight *shared_gate_up, *shared_down, *shared_gate;
    int64_t shared_intermediate;
} rb_moe_block;

/* logits [T, E] -> per row the top_k experts by softmax probability, largest first (ties: the
   lower id), ids [T, top_k], and their probabilities, divided by the picks' sum when
   `renormalise`, weights [T, top_k] */
void rb_moe_route(const float *logits, int64_t T, int64_t E, int64_t top_k, int64_t renormalise, int64_t *ids,
                  float *weights);

/* y [T, H] = for each row t, the sum over its picks in ascending expert order of
   weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]; the linears' activations as
   `bits`-bit integers (8 or 16; dense weights: fp32). Returns 0, -1 if memory ran out, -2 for
   other bits, -3 for an id outside 0..E-1. */
int rb_moe_experts(const rb_q4_weight *const *gate_up, const rb_q4_weight *const *down, int64_t E,
                   const float *x, int64_t T, const int64_t *ids, const float *weights, int64_t top_k, float *y,
                   int64_t threads, int64_t bits);

#endif
