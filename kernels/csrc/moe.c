/* The routed experts of a mixture-of-experts layer (moe.h).

   Why native: a decode step of a small MoE runs top_k experts per layer, each two small matmuls
   and an activation; as separate calls that is ~20 dispatches per layer. For one token the picked
   experts' gate|up weights all read the same input, so they run as one chained matmul, and their
   down projections (each on its own expert's hidden row) as one call over every pick. For more
   tokens the rows are grouped by expert, so each picked expert reads its weights once per step.
   Each row's result is the same either way: the low-bit matmuls give a row the same bits whatever
   the other rows, and every row adds its experts' weighted outputs in ascending expert order. */
#include "moe.h"

#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void rb_moe_route(const float *logits, int64_t T, int64_t E, int64_t top_k, int64_t renormalise, int64_t *ids,
                  float *weights) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        int64_t *id = ids + t * top_k;
        float *w = weights + t * top_k;
        float top = l[0];
        for (int64_t e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
        float total = 0.f;
        for (int64_t e = 0; e < E; e++) total += expf(l[e] - top);
        for (int64_t j = 0; j < top_k; j++) { /* selection: the largest logit not yet picked */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
            w[j] = expf(l[best] - top) / total;
        }
        if (renormalise) {
            float picked = 0.f;
            for (int64_t j = 0; j < top_k; j++) picked += w[j];
            for (int64_t j = 0; j < top_k; j++) w[j] /= picked;
        }
    }
}

/* each scaled expert output is rounded before it is added (no fused multiply-add): the two paths
   below then agree bit for bit */
static void scale_rows(float *rows, int64_t n, int64_t width, const float *scales) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < width; c++) rows[i * width + c] *= scales[i];
}

/* One token: every pick's gate|up in one chained call, every pick's down projection in one call. */
static int experts_one_row(const rb_q4_weight *const *gate_up, const rb_q4_weight *const *down,
                           const float *x, const int64_t *ids, const float *weights, int64_t top_k, float *y,
                           int64_t threads, int64_t bits) {
    const int64_t H = gate_up[0]->in, I2 = q4_chain_out(gate_up[0]), I = I2 / 2, out = down[0]->out;
    int64_t order[top_k], links = 0;
    for (int64_t j = 0; j < top_k; j++) { /* picks in ascending expert order */
        int64_t i = j;
        for (; i > 0 && ids[order[i - 1]] > ids[j]; i--) order[i] = order[i - 1];
        order[i] = j;
        for (const rb_q4_weight *w = gate_up[ids[j]]; w; w = w->next) links++;
    }
    rb_q4_weight *chain = (rb_q4_weight *)malloc(sizeof(rb_q4_weight) * links);
    const rb_q4_weight **downs = (const rb_q4_weight **)malloc(sizeof(*downs) * top_k);
    float *buf = (float *)malloc(sizeof(float) * (top_k * (I2 + I + out) + top_k));
    q4_activations q;
    const int64_t widest = H > I ? H : I;
    if (!chain || !downs || !buf || q4_activations_alloc(&q, top_k, widest, (int)(bits / 8))) {
        free(chain), free(downs), free(buf);
        return -1;
    }
    float *gu = buf, *act = gu + top_k * I2, *ye = act + top_k * I, *scales = ye + top_k * out;
    int64_t n = 0;
    for (int64_t j = 0; j < top_k; j++) {
        const int64_t e = ids[order[j]];
        for (const rb_q4_weight *w = gate_up[e]; w; w = w->next, n++) {
            chain[n] = *w;
            chain[n].next = n + 1 < links ? chain + n + 1 : NULL;
        }
        downs[j] = down[e];
        scales[j] = weights[order[j]];
    }
    q4_linear(chain, x, 1, &q, gu, threads);
    rb_silu_and_mul(gu, top_k, I, act);
    q4_linear_rows(downs, top_k, act, &q, ye, threads);
    scale_rows(ye, top_k, out, scales);
    memcpy(y, ye, sizeof(float) * out);
    for (int64_t j = 1; j < top_k; j++)
        for (int64_t c = 0; c < out; c++) y[c] += ye[j * out + c];
    q4_activations_free(&q);
    free(chain), free(downs), free(buf);
    return 0;
}

/* Any number of tokens (and dense weights): the rows grouped by expert, each picked expert once. */
static int experts_grouped(const rb_q4_weight *const *gate_up, const rb_q4_weight *const *down, int64_t E,
                           const float *x, int64_t T, const int64_t *ids, const float *weights, int64_t top_k,
                           float *y, int64_t threads, int64_t bits) {
    const int64_t H = gate_up[0]->in, I2 = q4_chain_out(gate_up[0]), I = I2 / 2, out = down[0]->out;
    const int64_t picks = T * top_k, widest = H > I ? H : I;
    int64_t *pairs = (int64_t *)malloc(sizeof(int64_t) * (picks + E + 1));
    float *buf = (float *)malloc(sizeof(float) * (T * (H + I2 + I + out) + T));
    q4_activations q;
    if (!pairs || !buf || q4_activations_alloc(&q, T, widest, (int)(bits / 8))) {
        free(pairs), free(buf);
        return -1;
    }
    int64_t *start = pairs + picks; /* counting sort of the (token, pick) pairs by expert, stable */
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < picks; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t fill[E];
    memcpy(fill, start, sizeof(int64_t) * E);
    for (int64_t p = 0; p < picks; p++) pairs[fill[ids[p]]++] = p;
    float *xs = buf, *gu = xs + T * H, *act = gu + T * I2, *ye = act + T * I, *scales = ye + T * out;
    memset(y, 0, sizeof(float) * T * out);
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        if (!n) continue;
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = pairs[start[e] + i];
            memcpy(xs + i * H, x + (p / top_k) * H, sizeof(float) * H);
            scales[i] = weights[p];
        }
        q4_linear(gate_up[e], xs, n, &q, gu, threads);
        rb_silu_and_mul(gu, n, I, act);
        q4_linear(down[e], act, n, &q, ye, threads);
        scale_rows(ye, n, out, scales);
        for (int64_t i = 0; i < n; i++) {
            float *yt = y + (pairs[start[e] + i] / top_k) * out;
            for (int64_t c = 0; c < out; c++) yt[c] += ye[i * out + c];
        }
    }
    q4_activations_free(&q);
    free(pairs), free(buf);
    return 0;
}

int rb_moe_experts(const rb_q4_weight *const *gate_up, const rb_q4_weight *const *down, int64_t E,
                   const float *x, int64_t T, const int64_t *ids, const float *weights, int64_t top_k, float *y,
                   int64_t threads, int64_t bits) {
    if (bits != 8 && bits != 16) return -2;
    for (int64_t p = 0; p < T * top_k; p++)
        if (ids[p] < 0 || ids[p] >= E) return -3;
    int dense = 0;
    for (int64_t e = 0; e < E; e++) dense |= gate_up[e]->dense != NULL || down[e]->dense != NULL;
    if (T == 1 && !dense) return experts_one_row(gate_up, down, x, ids, weights, top_k, y, threads, bits);
    return experts_grouped(gate_up, down, E, x, T, ids, weights, top_k, y, threads, bits);
}
