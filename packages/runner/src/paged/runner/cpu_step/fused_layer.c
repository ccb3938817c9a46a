/* A decoder layer of the CPU quantised path in two C calls around its attention.
 *
 *   paged_fused_pre_attention   [residual += pending] -> RMSNorm -> qkv matmul
 *                               -> [q/k RMSNorm per head] -> NeoX rotary        (q, k, v ready)
 *   (attention: the caller's entry, paged.runner.attention)
 *   paged_fused_post_attention  o matmul -> norms and residual add -> gate/up matmul
 *                               -> SiLU/GeLU * up -> down matmul [-> norm, residual add]
 *
 * At batch 1 the per-op path spent more time in Python (module calls, tensor
 * allocations, ctypes argument conversion: ~8 ms of a 21 ms step on SmolLM2)
 * than in the matmuls; here one ctypes call replaces ~10 per sub-layer.
 *
 * No arithmetic of its own except the residual add: every step calls the same
 * exported functions as the per-op path, through pointers taken at start-up
 * from their loaded libraries (step_ops.c's norms/activation/rotary,
 * qgemm.c's paged_qgemm_q4/q8), with the same arguments, so a fused layer's
 * output is the per-op path's bit for bit (tested) and the libraries stay
 * separate. Everything that does not change per step (weight pointers,
 * shapes, norm weights, scratch buffers sized for `capacity` rows) is in a
 * LayerPlan that Python fills once (cpu_step/fused.py mirrors these structs).
 *
 * LoRA: a plan may carry, per matmul, the LoRA stacks of that layer (lora_delta.c's
 * LoraWeights, opaque here); when the step passes its token_slots, each such matmul is
 * followed by paged_lora_delta on the same input and output (cpu_kernels/lora_delta.c,
 * through a pointer), exactly the call the per-op path's LoRALinear.add_to makes.
 *
 * Returns 0, or FUSED_E_* below; nothing is allocated here (paged_lora_delta
 * allocates and frees its own row scratch).
 */
#include <stdint.h>
#include <stddef.h>

int paged_fused_abi(void) { return 3; }

typedef int (*q4_fn)(const uint8_t *, int64_t, int64_t, int, float, const void *, int64_t,
                     int64_t, int, void *, int64_t, int);
typedef int (*q8_fn)(const uint8_t *, int64_t, int64_t, int, int, float, const void *, int64_t,
                     int64_t, int, void *, int64_t, int);
typedef int (*native_fn)(int, const uint8_t *, int64_t, int64_t, int, float, const void *,
                         int64_t, int64_t, int, void *, int64_t, int);
typedef int (*rms_norm_fn)(const void *, int, int64_t, const float *, float, uint16_t *, int64_t,
                           int64_t);
typedef int (*add_rms_norm_fn)(const uint16_t *, int64_t, float *, const float *, float,
                               uint16_t *, int64_t, int64_t);
typedef int (*gated_act_fn)(const uint16_t *, int64_t, uint16_t *, int64_t, int64_t, int);
typedef int (*rotary_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, int64_t,
                         const int64_t *, const float *, int64_t, int64_t, uint16_t *,
                         uint16_t *, int64_t);
typedef int (*lora_fn)(const void *, const int64_t *, int64_t, const void *, int64_t, int, void *,
                       int64_t, int);

enum {
    FUSED_E_POSITION = -1, /* a position outside the rotary table */
    FUSED_E_GEMM = -2,     /* a matmul refused its arguments */
    FUSED_E_MEMORY = -3,   /* a matmul or norm ran out of memory */
    FUSED_E_ROWS = -4,     /* more rows than the scratch buffers hold */
    FUSED_E_LORA = -5,     /* the LoRA delta failed (a token slot out of range, memory) */
};

typedef struct {
    void *qgemm_q4, *qgemm_q8, *rms_norm, *add_rms_norm, *gated_act, *rotary_neox;
    void *qgemm_native;
    void *lora_delta; /* paged_lora_delta, or NULL when no plan carries LoRA */
} Kernels;

/* One quantised run of output rows: fmt 4 (paged_qgemm_q4), 8 (paged_qgemm_q8) or a
 * GGUF-native layout (paged_qgemm_native: qgemm_native.c's FMT_* numbers). */
typedef struct {
    int64_t fmt, n, k, sub, levels;
    double ratio;
    const uint8_t *w;
} Part;

enum { MAX_PARTS = 4 };
/* A projection: its parts' outputs side by side (a layer mixing formats, e.g. Q4_K q/k
 * with Q6_K v), each written straight into its columns of the output. */
typedef struct {
    int64_t num_parts, n;
    Part parts[MAX_PARTS];
} Proj;

/* Scratch shared by the layers of one model (they run one after another). */
typedef struct {
    int64_t capacity;                /* rows every buffer holds */
    float *residual;                 /* [cap, hidden] float32, the residual stream */
    uint16_t *normed;                /* [cap, hidden] */
    uint16_t *qkv;                   /* [cap, q + 2 kv] */
    uint16_t *q_normed, *k_normed;   /* [cap, q], [cap, kv] (q/k norm only) */
    uint16_t *q_rot, *k_rot;         /* [cap, q], [cap, kv] */
    uint16_t *o_out;                 /* [cap, hidden] */
    uint16_t *gate_up;               /* [cap, 2 inter] */
    uint16_t *act;                   /* [cap, inter] */
    uint16_t *mlp_out;               /* [cap, hidden] */
} Scratch;

typedef struct {
    const Kernels *kernels;
    const Scratch *scratch;
    int64_t hidden, q_size, kv_size, head_dim, inter, act_kind, max_pos;
    double eps;
    const float *cos_sin;            /* [max_pos, head_dim] float32 */
    /* Llama: input and post-attention norms, the residual add fused into each.
     * Gemma (sandwich, pre_ff_norm set): post_attn_norm normalises the attention
     * output before its add, pre_ff_norm the stream before the MLP, post_ff_norm
     * the MLP's output before its add. q_norm/k_norm: per head, before rotary. */
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm;
    Proj qkv, o, gate_up, down;
    /* Each matmul's LoRA stacks (a LoraWeights), NULL where the layer has none. */
    const void *lora_qkv, *lora_o, *lora_gate_up, *lora_down;
} LayerPlan;

static int gemm_code(int rc) { return rc == -2 ? FUSED_E_MEMORY : FUSED_E_GEMM; }

/* y[:, :proj.n] = x W^T for m rows (x bf16 rows of stride k, y bf16 rows of stride proj.n),
 * then + the LoRA deltas of the rows that have an adapter (lora and slots both set). */
static int run_proj(const Kernels *kern, const Proj *proj, const void *lora,
                    const int64_t *slots, const uint16_t *x, int64_t m, uint16_t *y) {
    int64_t col = 0;
    for (int64_t i = 0; i < proj->num_parts; i++) {
        const Part *p = &proj->parts[i];
        int64_t x_stride = p->k; /* qgemm.py passes k for one row and the row stride (k) else */
        int rc;
        if (p->fmt == 4)
            rc = ((q4_fn)kern->qgemm_q4)(p->w, p->n, p->k, (int)p->levels, (float)p->ratio, x, m,
                                         x_stride, 1, y + col, proj->n, 1);
        else if (p->fmt == 8)
            rc = ((q8_fn)kern->qgemm_q8)(p->w, p->n, p->k, (int)p->sub, (int)p->levels,
                                         (float)p->ratio, x, m, x_stride, 1, y + col, proj->n, 1);
        else
            rc = ((native_fn)kern->qgemm_native)((int)p->fmt, p->w, p->n, p->k, (int)p->levels,
                                                 (float)p->ratio, x, m, x_stride, 1, y + col,
                                                 proj->n, 1);
        if (rc != 0) return gemm_code(rc);
        col += p->n;
    }
    if (lora != NULL && slots != NULL &&
        ((lora_fn)kern->lora_delta)(lora, slots, m, x, proj->parts[0].k, 1, y, proj->n, 1) != 0)
        return FUSED_E_LORA;
    return 0;
}

/* residual[r] += x[r] for m rows of h (float32 += bf16): `hidden + normed` of the
 * per-op path (float32 + bfloat16 promotes to float32, one rounding). */
static void add_bf16_into(float *residual, const uint16_t *x, int64_t m, int64_t h) {
    for (int64_t i = 0; i < m * h; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        float f;
        __builtin_memcpy(&f, &u, sizeof f);
        residual[i] = residual[i] + f;
    }
}

/* token_slots: this step's [m] adapter slots (-1: base row), or NULL: no LoRA rows. */
int paged_fused_pre_attention(const LayerPlan *p, int64_t m, const uint16_t *pending,
                              const int64_t *positions, const int64_t *token_slots) {
    const Kernels *kern = p->kernels;
    const Scratch *s = p->scratch;
    if (m > s->capacity) return FUSED_E_ROWS;
    if (m <= 0) return 0;
    const int64_t h = p->hidden, nqkv = p->qkv.n;
    const float eps = (float)p->eps;
    int rc = pending != NULL
                 ? ((add_rms_norm_fn)kern->add_rms_norm)(pending, h, s->residual, p->input_norm,
                                                         eps, s->normed, m, h)
                 : ((rms_norm_fn)kern->rms_norm)(s->residual, 0, h, p->input_norm, eps,
                                                 s->normed, m, h);
    if (rc != 0) return FUSED_E_MEMORY;
    rc = run_proj(kern, &p->qkv, p->lora_qkv, token_slots, s->normed, m, s->qkv);
    if (rc != 0) return rc;
    const uint16_t *q = s->qkv, *k = s->qkv + p->q_size;
    int64_t q_stride = nqkv, k_stride = nqkv;
    if (p->q_norm != NULL) {
        const int64_t d = p->head_dim;
        rms_norm_fn norm = (rms_norm_fn)kern->rms_norm;
        for (int64_t r = 0; r < m; r++) {
            const uint16_t *row = s->qkv + r * nqkv;
            if (norm(row, 1, d, p->q_norm, eps, s->q_normed + r * p->q_size, p->q_size / d, d) ||
                norm(row + p->q_size, 1, d, p->k_norm, eps, s->k_normed + r * p->kv_size,
                     p->kv_size / d, d))
                return FUSED_E_MEMORY;
        }
        q = s->q_normed, k = s->k_normed, q_stride = p->q_size, k_stride = p->kv_size;
    }
    rc = ((rotary_fn)kern->rotary_neox)(q, q_stride, p->q_size / p->head_dim, k, k_stride,
                                        p->kv_size / p->head_dim, positions, p->cos_sin,
                                        p->max_pos, p->head_dim, s->q_rot, s->k_rot, m);
    return rc != 0 ? FUSED_E_POSITION : 0;
}

int paged_fused_post_attention(const LayerPlan *p, int64_t m, const uint16_t *attn_out,
                               const int64_t *token_slots) {
    const Kernels *kern = p->kernels;
    const Scratch *s = p->scratch;
    if (m > s->capacity) return FUSED_E_ROWS;
    if (m <= 0) return 0;
    const int64_t h = p->hidden;
    const float eps = (float)p->eps;
    rms_norm_fn norm = (rms_norm_fn)kern->rms_norm;
    int rc = run_proj(kern, &p->o, p->lora_o, token_slots, attn_out, m, s->o_out);
    if (rc != 0) return rc;
    if (p->pre_ff_norm != NULL) {
        if (norm(s->o_out, 1, h, p->post_attn_norm, eps, s->normed, m, h)) return FUSED_E_MEMORY;
        add_bf16_into(s->residual, s->normed, m, h);
        if (norm(s->residual, 0, h, p->pre_ff_norm, eps, s->normed, m, h)) return FUSED_E_MEMORY;
    } else {
        ((add_rms_norm_fn)kern->add_rms_norm)(s->o_out, h, s->residual, p->post_attn_norm, eps,
                                               s->normed, m, h);
    }
    if ((rc = run_proj(kern, &p->gate_up, p->lora_gate_up, token_slots, s->normed, m,
                       s->gate_up)) != 0) return rc;
    ((gated_act_fn)kern->gated_act)(s->gate_up, 2 * p->inter, s->act, m, p->inter,
                                     (int)p->act_kind);
    rc = run_proj(kern, &p->down, p->lora_down, token_slots, s->act, m, s->mlp_out);
    if (rc != 0) return rc;
    if (p->post_ff_norm != NULL) {
        if (norm(s->mlp_out, 1, h, p->post_ff_norm, eps, s->normed, m, h)) return FUSED_E_MEMORY;
        add_bf16_into(s->residual, s->normed, m, h);
    }
    return 0;
}
