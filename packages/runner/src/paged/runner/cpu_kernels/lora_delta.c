/* The LoRA delta of one linear layer for every row of a step, on the CPU.
 *
 * Driven by paged/runner/cpu_kernels/lora_delta.py (the per-op path, LoRALinear.add_to)
 * and called through a pointer by cpu_step/fused_layer.c right after each base matmul
 * of a fused decoder layer. For each row t whose slot s = token_slots[t] is >= 0, and
 * each slice i of the layer (q, k, v of a fused qkv; gate, up of gate_up; one slice
 * otherwise), with r_s the slot's adapter rank (<= R, the slots' width):
 *
 *     u      = A[s, i*R : i*R + r_s, :] @ x[t]           float32 sums, rounded to the
 *                                                        adapters' dtype (as the torch
 *                                                        reference's shrink output is)
 *     u     *= scaling[s]
 *     y[t, off_i : off_i+1] += Bt[s, i*R : i*R + r_s, off_i : off_i+1]^T u
 *                                                        float32 sums, rounded once into y
 *
 * Layouts (row-major, the LoRALinear's stacks on the CPU):
 *     A  [slots, slices * R, in]     x [m, in]  (row stride x_stride)
 *     Bt [slots, slices * R, out]    y [m, out] (row stride y_stride)
 * Bt is B transposed ([out, slices * R] per slot is what the torch/Triton paths read;
 * on the CPU the stack is stored this way round and B is its transposed view): the
 * expand then runs along contiguous output columns. Only slice i's own block of the
 * block-diagonal B is read, and only the first r_s ranks (the rest is zero padding).
 *
 * Rows are taken slot by slot, ROWS at a time, so that a slot's A and Bt are read once
 * per ROWS rows and stay in cache across them (a decode step of 8 adapters x 4 rows
 * reads each adapter's weights once). Every output is computed in a fixed order that
 * does not depend on the instruction set: the AVX-512 path and the portable path do the
 * same float32 operations lane for lane (each product-sum one fused multiply-add,
 * vfmadd231ps or C's fmaf, both rounded once; nothing else contracted:
 * -ffp-contract=off), so both builds give the same bits (tested), and so do the per-op
 * and fused paths, which call this same function with the same arguments.
 *
 * Returns 0 or LORA_E_* below; nothing is left allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(PAGED_LORA_FORCE_SCALAR)
#include <immintrin.h>
#define LORA_AVX512 1
#else
#define LORA_AVX512 0
#endif

int paged_lora_abi(void) { return 2; }
int paged_lora_isa(void) { return LORA_AVX512; } /* 1: AVX-512, 0: portable */

enum { MAX_SLICES = 4, ROWS = 4, LANES = 16, VECS = 4, COLS = VECS * LANES };
enum {
    LORA_E_SLOT = -1,   /* a token slot outside [-1, slots) */
    LORA_E_MEMORY = -2, /* scratch allocation failed */
    LORA_E_ARGS = -3,   /* inconsistent weights description or a slot rank above R */
};

/* One layer's adapter stacks (lora_delta.py's _LoRAWeights mirrors it). */
typedef struct {
    const void *a;         /* [slots, num_slices * rank, in] */
    const void *bt;        /* [slots, num_slices * rank, out] */
    const float *scaling;  /* [slots] */
    const int64_t *ranks;  /* [slots]: each slot's adapter rank (0: empty), or NULL: rank */
    int64_t slots, rank, num_slices, in, out, ab_bf16;
    int64_t offsets[MAX_SLICES + 1]; /* slice i writes columns [offsets[i], offsets[i+1]) */
} LoraWeights;

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN stays NaN: torch's .to(torch.bfloat16). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float weight_at(const void *base, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The 16 lanes summed in one fixed tree: (l, l+8), (l, l+4), (l, l+2), (l, l+1). */
static inline float lane_sum(const float *acc) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#if LORA_AVX512
static inline __m512 load16(const void *base, int bf16, int64_t i, __mmask16 mask) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)base + i);
}
#endif

/* u[j][r] = sum_k a_row_r[k] * xf[j][k] for j < nb rows, r < rank (16 lanes, lane_sum). */
static inline __attribute__((always_inline)) void shrink_rows(
    const void *a, int bf16, int64_t a_first, int64_t in, int64_t rank, const float *xf,
    const int nb, float *u, int64_t u_stride) {
    for (int64_t r = 0; r < rank; r++) {
        const int64_t row = a_first + r * in;
        float lanes[ROWS][LANES];
#if LORA_AVX512
        __m512 acc[ROWS];
        for (int j = 0; j < nb; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < in; k0 += LANES) {
            const int64_t len = in - k0 < LANES ? in - k0 : LANES;
            const __mmask16 mask = (__mmask16)(len == LANES ? 0xffffu : (1u << len) - 1u);
            const __m512 av = load16(a, bf16, row + k0, mask);
            for (int j = 0; j < nb; j++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mask, xf + j * in + k0);
                acc[j] = _mm512_fmadd_ps(av, xv, acc[j]);
            }
        }
        for (int j = 0; j < nb; j++) _mm512_storeu_ps(lanes[j], acc[j]);
#else
        for (int j = 0; j < nb; j++)
            for (int l = 0; l < LANES; l++) lanes[j][l] = 0.0f;
        for (int64_t k0 = 0; k0 < in; k0 += LANES) {
            const int64_t len = in - k0 < LANES ? in - k0 : LANES;
            float av[LANES];
            for (int l = 0; l < LANES; l++)
                av[l] = l < len ? weight_at(a, bf16, row + k0 + l) : 0.0f;
            for (int j = 0; j < nb; j++)
                for (int l = 0; l < LANES; l++) {
                    const float xv = l < len ? xf[j * in + k0 + l] : 0.0f;
                    lanes[j][l] = fmaf(av[l], xv, lanes[j][l]);
                }
        }
#endif
        for (int j = 0; j < nb; j++) u[j * u_stride + r] = lane_sum(lanes[j]);
    }
}

/* acc[j][c] = sum_r bt_r[c] * u[j][r] for c < ncols (<= COLS) columns from bt_first. */
static inline __attribute__((always_inline)) void expand_tile(
    const void *bt, int bf16, int64_t bt_first, int64_t out, int64_t rank, int64_t ncols,
    const float *u, int64_t u_stride, const int nb, float acc_out[ROWS][COLS]) {
#if LORA_AVX512
    __mmask16 masks[VECS];
    for (int v = 0; v < VECS; v++) {
        const int64_t len = ncols - v * LANES;
        masks[v] = (__mmask16)(len >= LANES ? 0xffffu : (len <= 0 ? 0u : (1u << len) - 1u));
    }
    __m512 acc[ROWS][VECS];
    for (int j = 0; j < nb; j++)
        for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; r++) {
        const int64_t row = bt_first + r * out;
        __m512 b[VECS];
        for (int v = 0; v < VECS; v++) b[v] = load16(bt, bf16, row + v * LANES, masks[v]);
        for (int j = 0; j < nb; j++) {
            const __m512 uj = _mm512_set1_ps(u[j * u_stride + r]);
            for (int v = 0; v < VECS; v++)
                acc[j][v] = _mm512_fmadd_ps(b[v], uj, acc[j][v]);
        }
    }
    for (int j = 0; j < nb; j++)
        for (int v = 0; v < VECS; v++) _mm512_storeu_ps(&acc_out[j][v * LANES], acc[j][v]);
#else
    for (int j = 0; j < nb; j++)
        for (int64_t c = 0; c < COLS; c++) acc_out[j][c] = 0.0f;
    for (int64_t r = 0; r < rank; r++) {
        const int64_t row = bt_first + r * out;
        for (int j = 0; j < nb; j++) {
            const float uj = u[j * u_stride + r];
            for (int64_t c = 0; c < ncols; c++)
                acc_out[j][c] = fmaf(weight_at(bt, bf16, row + c), uj, acc_out[j][c]);
        }
    }
#endif
}

/* y[row, col0 : col0 + n] += acc (float32), rounded once to y's dtype. */
static void add_into(void *y, int y_bf16, int64_t at, const float *acc, int64_t n) {
    if (y_bf16) {
        uint16_t *dst = (uint16_t *)y + at;
        for (int64_t c = 0; c < n; c++) dst[c] = f32_to_bf16(bf16_to_f32(dst[c]) + acc[c]);
    } else {
        float *dst = (float *)y + at;
        for (int64_t c = 0; c < n; c++) dst[c] = dst[c] + acc[c];
    }
}

/* One block of nb rows (all of slot s): shrink every slice, scale, expand. */
static inline __attribute__((always_inline)) void block(
    const LoraWeights *w, int64_t s, int64_t rank_s, const int64_t *rows, const int nb,
    const float *xf, float *u, void *y, int64_t y_stride, int y_bf16) {
    const int bf16 = (int)w->ab_bf16;
    const int64_t width = w->num_slices * w->rank; /* rows of A / Bt per slot */
    const float scale = w->scaling[s];
    for (int64_t i = 0; i < w->num_slices; i++) {
        const int64_t first = s * width + i * w->rank; /* this slice's first A / Bt row */
        shrink_rows(w->a, bf16, first * w->in, w->in, rank_s, xf, nb, u, rank_s);
        for (int j = 0; j < nb; j++)
            for (int64_t r = 0; r < rank_s; r++) {
                float t = u[j * rank_s + r];
                u[j * rank_s + r] = (bf16 ? round_bf16(t) : t) * scale;
            }
        for (int64_t c0 = w->offsets[i]; c0 < w->offsets[i + 1]; c0 += COLS) {
            const int64_t end = w->offsets[i + 1];
            const int64_t ncols = end - c0 < COLS ? end - c0 : COLS;
            float acc[ROWS][COLS];
            expand_tile(w->bt, bf16, first * w->out + c0, w->out, rank_s, ncols, u, rank_s, nb,
                        acc);
            for (int j = 0; j < nb; j++)
                add_into(y, y_bf16, rows[j] * y_stride + c0, acc[j], ncols);
        }
    }
}

/* The block's x rows as float32 (rounded to bfloat16 first when the adapters are
 * bfloat16 and x is not: the reference's x.to(lora_dtype)). */
static void load_rows(const void *x, int64_t x_stride, int x_bf16, int ab_bf16,
                      const int64_t *rows, int nb, int64_t in, float *xf) {
    for (int j = 0; j < nb; j++) {
        float *dst = xf + j * in;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + rows[j] * x_stride;
            for (int64_t k = 0; k < in; k++) dst[k] = bf16_to_f32(src[k]);
        } else {
            const float *src = (const float *)x + rows[j] * x_stride;
            if (ab_bf16)
                for (int64_t k = 0; k < in; k++) dst[k] = round_bf16(src[k]);
            else
                memcpy(dst, src, (size_t)in * sizeof(float));
        }
    }
}

int paged_lora_delta(const LoraWeights *w, const int64_t *token_slots, int64_t m,
                     const void *x, int64_t x_stride, int x_bf16, void *y, int64_t y_stride,
                     int y_bf16) {
    if (m <= 0) return 0;
    if (w->num_slices < 1 || w->num_slices > MAX_SLICES || w->rank < 1 || w->in < 1 ||
        w->offsets[0] != 0 || w->offsets[w->num_slices] != w->out)
        return LORA_E_ARGS;
    int64_t max_rank = 0;
    for (int64_t t = 0; t < m; t++) {
        const int64_t s = token_slots[t];
        if (s < -1 || s >= w->slots) return LORA_E_SLOT;
        if (s < 0) continue;
        const int64_t r = w->ranks != NULL ? w->ranks[s] : w->rank;
        if (r < 0 || r > w->rank) return LORA_E_ARGS;
        if (r > max_rank) max_rank = r;
    }
    if (max_rank == 0) return 0; /* no row with an adapter (or only empty slots) */
    float *xf = malloc((size_t)(ROWS * w->in + ROWS * max_rank) * sizeof(float));
    if (xf == NULL) return LORA_E_MEMORY;
    float *u = xf + ROWS * w->in;
    for (int64_t s = 0; s < w->slots; s++) {
        const int64_t rank_s = w->ranks != NULL ? w->ranks[s] : w->rank;
        if (rank_s == 0) continue;
        int64_t t = 0;
        for (;;) {
            int64_t rows[ROWS];
            int nb = 0;
            while (t < m && nb < ROWS) {
                if (token_slots[t] == s) rows[nb++] = t;
                t++;
            }
            if (nb == 0) break;
            load_rows(x, x_stride, x_bf16, (int)w->ab_bf16, rows, nb, w->in, xf);
            /* constant row counts: the compiler keeps the accumulators in registers */
            switch (nb) {
            case 1: block(w, s, rank_s, rows, 1, xf, u, y, y_stride, y_bf16); break;
            case 2: block(w, s, rank_s, rows, 2, xf, u, y, y_stride, y_bf16); break;
            case 3: block(w, s, rank_s, rows, 3, xf, u, y, y_stride, y_bf16); break;
            default: block(w, s, rank_s, rows, 4, xf, u, y, y_stride, y_bf16); break;
            }
        }
    }
    free(xf);
    return 0;
}
