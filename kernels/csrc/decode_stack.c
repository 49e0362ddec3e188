/* A whole decode step's decoder stack in one native call, on 4-bit (GGUF Q4_1) weights.

   Why: a small decode step on a CPU is ~15 torch ops per layer, each a Python call, an allocation
   and (for the low-bit linears) two dtype casts; over 30 layers that costs as much as the weights
   take to stream. Here every layer (norms, the four linears, RoPE, the K/V write into the paged
   pool, attention over the pool in place) runs back to back in C on fp32 activations, and the
   4-bit weights are used exactly as the GGUF stores them (w = scale * code + minimum, fp16 scale
   and minimum); the linears' inputs enter as 16-bit integers (products within ~2e-5 of the fp32
   reference's on the same weights) or, for larger steps where the integer work dominates, as
   8-bit ones (q4.h). */
#include "cpu_kernels.h"
#include "moe.h"
#include "q4.h"
#include "thread_pool.h"

#include <stdlib.h>
#include <string.h>

/* ---- the decoder stack ---------------------------------------------------------------------- */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] RMSNorm weights before attention and MLP, or both
                                            NULL (OLMo 2: the stream enters both unnormed) */
    rb_q4_weight qkv, o, gate_up, down;  /* qkv: q, k, v heads stacked; gate_up: gate, up */
    float *k_cache, *v_cache;            /* this layer's pool [slots, kv_heads, head_dim]: fp32, or bf16 (KV16_POOL) */
    const float *q_norm, *k_norm;        /* RMSNorm weights before RoPE, or NULL: [head_dim] per head, or
                                            with `qk_norm_whole` [heads * head_dim] over the projection */
    int64_t qk_norm_whole;               /* OLMo 2: q and k normed over all heads at once */
    const rb_moe_block *moe;             /* a routed MLP instead of gate_up/down, or NULL */
    const float *cos_sin;                /* this layer's RoPE table, or NULL: the model's (dims) */
    int64_t window;                      /* a sliding window: each token sees its last `window` keys; 0: all */
    const float *attn_out_norm, *mlp_out_norm; /* Gemma 2/3: norms of the attention and MLP outputs, or NULL */
    int64_t activation;                  /* the MLP's: RB_SILU or RB_GELU_TANH */
    float softcap;                       /* Gemma 2: attention scores capped as softcap * tanh(s / softcap); 0: none */
} rb_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;     /* RMSNorm epsilon, attention scale */
    const float *cos_sin; /* [positions, rot]: cos half, sin half (neox RoPE) */
    int64_t rot;          /* rotated features per head (<= head_dim: partial rotary passes the rest) */
    float out_scale;      /* Granite's residual multiplier on the attention and MLP outputs (else 1) */
    int64_t attention_bf16; /* invariant attention's products in bf16 pairs (extend_attention.c): 1, or
                               KV16_POOL when the pool holds bf16 rows (then every row attends that way) */
    const float *final_norm; /* [hidden] the model's final RMSNorm weight, applied here, or NULL (the caller's) */
} rb_decoder_dims;

static inline int64_t max4(int64_t a, int64_t b, int64_t c, int64_t d) {
    const int64_t ab = a > b ? a : b, cd = c > d ? c : d;
    return ab > cd ? ab : cd;
}

/* residual += x, elementwise (the same sum as the fused add-and-norm's) */
static void add_rows(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) residual[i] += x[i];
}

/* x *= s elementwise (one rounding, as torch's `out * scale`); nothing for s == 1 */
static void scale_rows(float *x, int64_t n, float s) {
    if (s == 1.f) return;
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* One new token per request. Token t belongs to request t, sits at positions[t], writes its K/V
   at pool slot out_slots[t], and attends to the slots kv_indices[starts[t] : starts[t] + lens[t]]
   (its own slot included). residual: in, the embeddings [T, hidden]; out, the residual stream
   before the last layer's MLP output, which goes to `hidden` [T, hidden] (the model's final norm
   adds the two); with `d->final_norm` that norm is taken here: `hidden` is then its output and
   `residual` the whole stream (the caller's add-and-norm of the two, bit for bit, without a
   round of Python and torch calls on every step). The linears split their rows, and attention
   its requests (or a long request's keys), over `threads` threads; the linears' activations are `activation_bits` (8 or 16) integers;
   `invariant`: attention gives each row the extend kernel's bits (extend_attention.c), reading keys
   that several requests begin with once per chunk of `sharing` (NULL: none; unwindowed layers).
   Layers may norm q and k per head (Qwen3, Gemma 3), route their MLP over experts (`moe`,
   moe.c), see a sliding window of keys, take their own RoPE table, norm their attention and MLP
   outputs (Gemma's sandwich norms), rotate part of each head (Phi-4-mini), scale both outputs
   (Granite), soft-cap their attention scores (Gemma 2; head sizes that are
   multiples of 16) and gate their MLP with GELU.
   Returns 0, -1 if memory ran out, -2 for other activation bits. */
int rb_decode_stack(const rb_decoder_layer *layers, int64_t n_layers, const rb_decoder_dims *d, int64_t T,
                    const int64_t *positions, const int64_t *out_slots, const int64_t *kv_indices,
                    const int64_t *starts, const int64_t *lens, const rb_key_sharing *sharing, float *residual,
                    float *hidden, int64_t threads, int64_t activation_bits, int64_t invariant) {
    const int64_t H = d->hidden, D = d->head_dim, q_size = d->heads * D, kv_size = d->kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, I = d->intermediate;
    if (activation_bits != 8 && activation_bits != 16) return -2;
    int64_t experts = 0, top_k = 0; /* the widest routed block's router outputs and picks */
    int64_t shared = 0; /* the widest shared expert (Qwen2-MoE) */
    for (int64_t l = 0; l < n_layers; l++)
        if (layers[l].moe) {
            experts = layers[l].moe->experts > experts ? layers[l].moe->experts : experts;
            top_k = layers[l].moe->top_k > top_k ? layers[l].moe->top_k : top_k;
            shared = layers[l].moe->shared_intermediate > shared ? layers[l].moe->shared_intermediate : shared;
        }
    const int64_t widest = max4(H, I, q_size, shared); /* of the linears' inputs */
    float *scratch = (float *)malloc(sizeof(float) * (T * (H + qkv_size + 2 * q_size + 3 * I + experts + 3 * shared + H + 1)
                                                      + kv_size));
    int64_t *picks = (int64_t *)malloc(sizeof(int64_t) * T * (top_k * 2 + 2) + 1); /* ids, fp32 weights; windows */
    q4_activations quantized;
    if (!scratch || !picks || q4_activations_alloc(&quantized, T, widest, (int)(activation_bits / 8))) {
        free(scratch), free(picks);
        return -1;
    }
    float *normed = scratch, *qkv = normed + T * H, *q = qkv + T * qkv_size, *attn = q + T * q_size;
    float *gate_up = attn + T * q_size, *act = gate_up + T * 2 * I, *route = act + T * I;
    float *shared_gate_up = route + T * experts, *shared_act = shared_gate_up + T * 2 * shared;
    float *shared_out = shared_act + T * shared, *shared_logit = shared_out + T * H;
    float *k_row = shared_logit + T; /* one token's keys before they are rounded into a bf16 pool */
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const rb_decoder_layer *L = layers + l;
        const float *attn_in = L->input_norm ? normed : residual; /* OLMo 2: the stream itself */
        if (L->input_norm)
            rb_add_rms_norm(l ? hidden : NULL, residual, L->input_norm, T, H, d->eps, normed, l ? residual : NULL);
        else if (l)
            add_rows(residual, hidden, T * H);
        q4_linear(&L->qkv, attn_in, T, &quantized, qkv, threads);
        for (int64_t t = 0; L->q_norm && t < T; t++) { /* normed in place: each head (Qwen3), or all (OLMo 2) */
            float *row = qkv + t * qkv_size;
            const int64_t q_rows = L->qk_norm_whole ? 1 : d->heads, k_rows = L->qk_norm_whole ? 1 : d->kv_heads;
            rb_add_rms_norm(NULL, row, L->q_norm, q_rows, q_size / q_rows, d->eps, row, NULL);
            rb_add_rms_norm(NULL, row + q_size, L->k_norm, k_rows, kv_size / k_rows, d->eps, row + q_size, NULL);
        }
        const float *cos_sin = L->cos_sin ? L->cos_sin : d->cos_sin;
        rb_rope(qkv, qkv_size, T, d->heads, D, positions, cos_sin, d->rot, q);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkv_size;
            if (d->attention_bf16 == KV16_POOL) { /* rounded as the attention products round them */
                uint16_t *k16 = (uint16_t *)L->k_cache + out_slots[t] * kv_size;
                rb_rope(row + q_size, qkv_size, 1, d->kv_heads, D, positions + t, cos_sin, d->rot, k_row);
                rb_round_bf16(k_row, kv_size, k16);
                rb_round_bf16(row + q_size + kv_size, kv_size, (uint16_t *)L->v_cache + out_slots[t] * kv_size);
                continue;
            }
            rb_rope(row + q_size, qkv_size, 1, d->kv_heads, D, positions + t, cos_sin, d->rot,
                    L->k_cache + out_slots[t] * kv_size);
            memcpy(L->v_cache + out_slots[t] * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
        }
        const int64_t *layer_starts = starts, *layer_lens = lens;
        const rb_key_sharing *layer_sharing = sharing;
        if (L->window > 0) { /* each token's last `window` keys */
            int64_t *ws = picks + T * top_k * 2, *wl = ws + T;
            for (int64_t t = 0; t < T; t++) {
                wl[t] = lens[t] < L->window ? lens[t] : L->window;
                ws[t] = starts[t] + lens[t] - wl[t];
            }
            layer_starts = ws, layer_lens = wl, layer_sharing = NULL;
        }
        /* soft-capped scores and a bf16 pool: this kernel only */
        if ((invariant || L->softcap > 0 || d->attention_bf16 == KV16_POOL) && D % 16 == 0)
            rc = rb_decode_attention_invariant(q, L->k_cache, L->v_cache, kv_indices, layer_starts, layer_lens, T,
                                               d->kv_heads, d->heads / d->kv_heads, D, d->scale, L->softcap, layer_sharing,
                                               attn, NULL, threads, d->attention_bf16);
        else
            rc = rb_decode_attention(q, L->k_cache, L->v_cache, kv_indices, layer_starts, layer_lens, T, d->kv_heads,
                                     d->heads / d->kv_heads, D, d->scale, attn, NULL, threads);
        q4_linear(&L->o, attn, T, &quantized, hidden, threads);
        scale_rows(hidden, T * H, d->out_scale);
        if (L->attn_out_norm) rb_add_rms_norm(NULL, hidden, L->attn_out_norm, T, H, d->eps, hidden, NULL);
        const float *mlp_in = L->post_norm ? normed : residual;
        if (L->post_norm)
            rb_add_rms_norm(hidden, residual, L->post_norm, T, H, d->eps, normed, residual);
        else
            add_rows(residual, hidden, T * H);
        if (L->moe) {
            const rb_moe_block *M = L->moe;
            q4_linear(M->router, mlp_in, T, &quantized, route, threads);
            rb_moe_route(route, T, M->experts, M->top_k, M->renormalise, picks, (float *)(picks + T * M->top_k));
            rc = rb_moe_experts(M->gate_up, M->down, M->experts, mlp_in, T, picks, (float *)(picks + T * M->top_k),
                                M->top_k, hidden, threads, activation_bits);
            if (M->shared_gate_up) { /* Qwen2-MoE: the shared expert, gated by a sigmoid */
                q4_linear(M->shared_gate_up, mlp_in, T, &quantized, shared_gate_up, threads);
                rb_silu_and_mul(shared_gate_up, T, M->shared_intermediate, shared_act);
                q4_linear(M->shared_down, shared_act, T, &quantized, shared_out, threads);
                q4_linear(M->shared_gate, mlp_in, T, &quantized, shared_logit, threads);
                rb_sigmoid_gated_add(hidden, shared_logit, shared_out, T, H);
            }
        } else {
            if (q4_glu(&L->gate_up, mlp_in, T, &quantized, act, threads, L->activation)) { /* dense (fp32 path) */
                q4_linear(&L->gate_up, mlp_in, T, &quantized, gate_up, threads);
                (L->activation == RB_GELU_TANH ? rb_gelu_tanh_and_mul : rb_silu_and_mul)(gate_up, T, I, act);
            }
            q4_linear(&L->down, act, T, &quantized, hidden, threads);
        }
        scale_rows(hidden, T * H, d->out_scale);
        if (L->mlp_out_norm) rb_add_rms_norm(NULL, hidden, L->mlp_out_norm, T, H, d->eps, hidden, NULL);
    }
    if (rc == 0 && d->final_norm) rb_add_rms_norm(hidden, residual, d->final_norm, T, H, d->eps, hidden, residual);
    q4_activations_free(&quantized);
    free(scratch), free(picks);
    return rc;
}
