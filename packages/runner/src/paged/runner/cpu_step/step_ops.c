/* Fused per-layer CPU ops of a decode step, bfloat16 activations, float32 maths.
 *
 * Each function replaces a chain of 5-40 small torch ops whose cost at batch 1
 * is dispatch, not arithmetic (benchmarks/profile_step.py). Called through
 * ctypes from paged/runner/cpu_step/ops.py, which checks shapes, dtypes and
 * strides; nothing here allocates memory the caller does not free.
 *
 * bfloat16 values travel as uint16_t bit patterns. float32 -> bfloat16 rounds
 * to nearest even, NaN stays NaN: what torch's .to(torch.bfloat16) does.
 * Compiled with -ffp-contract=off so that a*b - c*d is never fused into an
 * fma: the rotary then computes exactly paged.kernels.reference's products
 * and sums. -fopenmp-simd (no OpenMP runtime) lets the loops marked
 * `omp simd` vectorise the inline exp; the norm's sum keeps torch's exact order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


int paged_step_ops_abi(void) { return 1; }

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;
    /* a select, not a branch: loops over it vectorise */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

/* e^x for float32, Cephes' expf (range reduction by ln 2 in two parts, degree-6
 * polynomial; within 2 ulp of expf over the range used) written in plain float ops so
 * that `omp simd` loops vectorise it: glibc's vector expf is only declared under
 * -ffast-math. Inputs are clamped to [-87.3, 88.3]: e^x stays a normal float. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* round to nearest by adding 1.5 * 2^23 (|x log2 e| < 128): no floorf call */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sum(x[i]^2) summed in exactly the order of torch's CPU float sum over a contiguous
 * row (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum -> vectorized_inner_sum ->
 * row_sum -> multi_row_sum: VEC-float vectors, 4 accumulators, 4 cascade levels), so
 * the norm's mean square, hence every output, equals F.rms_norm's bit for bit (tested
 * against it). A near-tie in the README quickstart's answer flipped on a plain
 * 16-lane sum: 12 one-ulp differences in 1.3M normed values were enough. */
enum { MAX_VEC = 16, ILP = 4, LEVELS = 4 };
/* torch's vector width in floats for that sum: 8 with this machine's torch, 16 with
 * some builds; ops.py measures it once against torch.sum (paged_set_sum_width). */
static int VEC = 8;

int paged_set_sum_width(int width) {
    if (width != 8 && width != 16) return -1;
    VEC = width;
    return 0;
}


static int ceil_log2(int64_t n) {
    int r = 0;
    while (((int64_t)1 << r) < n) r++;
    return r;
}

static float sum_squares_f32(const float *x, int64_t n) {
    int64_t vec_numel = n / VEC, size_ilp = vec_numel / ILP;
    int level_power = ceil_log2(size_ilp) / LEVELS;
    if (level_power < 4) level_power = 4;
    int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][MAX_VEC];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size_ilp) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP; k++) {
                const float *v = x + (i * ILP + k) * VEC;
                for (int l = 0; l < VEC; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < VEC; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size_ilp; ++i)
        for (int k = 0; k < ILP; k++) {
            const float *v = x + (i * ILP + k) * VEC;
            for (int l = 0; l < VEC; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < VEC; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t r = size_ilp * ILP; r < vec_numel; ++r) {
        const float *v = x + r * VEC;
        for (int l = 0; l < VEC; l++) acc[0][0][l] += v[l] * v[l];
    }
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < VEC; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    if (vec_numel == 0) {
        for (int64_t r = 0; r < n; r++) total += x[r] * x[r];
        return total;
    }
    for (int64_t r = vec_numel * VEC; r < n; ++r) total += x[r] * x[r];
    for (int l = 0; l < VEC; l++) total += acc[0][0][l];
    return total;
}

/* torch's order: x * rsqrt(mean(x^2) + eps) * w, mean = sum / h, 1 / sqrt correctly rounded. */
static void normalize_row(const float *x, const float *w, float eps, int64_t h, uint16_t *out) {
    float inv = 1.0f / sqrtf(sum_squares_f32(x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = f32_to_bf16(x[i] * inv * w[i]);
}

/* sum of squares of each row of x [t, h] (float32), for the width calibration. */
int paged_sum_squares(const float *x, int64_t t, int64_t h, float *out) {
    for (int64_t r = 0; r < t; r++) out[r] = sum_squares_f32(x + r * h, h);
    return 0;
}

/* out[t] = bf16(rms_norm(x[t]) * w); x float32 (x_is_bf16 = 0) or bfloat16 rows. */
int paged_rms_norm(const void *x, int x_is_bf16, int64_t x_stride, const float *w, float eps,
                   uint16_t *out, int64_t t, int64_t h) {
    float *row = malloc((size_t)h * sizeof(float));
    if (!row) return -1;
    for (int64_t r = 0; r < t; r++) {
        if (x_is_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * x_stride;
            for (int64_t i = 0; i < h; i++) row[i] = bf16_to_f32(src[i]);
        } else {
            memcpy(row, (const float *)x + r * x_stride, (size_t)h * sizeof(float));
        }
        normalize_row(row, w, eps, h, out + r * h);
    }
    free(row);
    return 0;
}

/* residual[t] += x[t] (float32, in place), out[t] = bf16(rms_norm(residual[t]) * w). */
int paged_add_rms_norm(const uint16_t *x, int64_t x_stride, float *residual, const float *w,
                       float eps, uint16_t *out, int64_t t, int64_t h) {
    for (int64_t r = 0; r < t; r++) {
        float *res = residual + r * h;
        const uint16_t *src = x + r * x_stride;
        for (int64_t i = 0; i < h; i++) res[i] = bf16_to_f32(src[i]) + res[i];
        normalize_row(res, w, eps, h, out + r * h);
    }
    return 0;
}

/* out[t] = bf16(act(x[t, :i]) * x[t, i:]); kind 0 = silu, 1 = gelu (tanh approximation). */
int paged_gated_act(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t t, int64_t i,
                    int kind) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2/pi), GELU's cubic term */
    for (int64_t r = 0; r < t; r++) {
        const uint16_t *gate = x + r * x_stride, *up = gate + i;
        uint16_t *o = out + r * i;
        /* omp simd: exp_f32 inline, vectorised. */
        if (kind == 0) {
#pragma omp simd
            for (int64_t j = 0; j < i; j++) {
                float g = bf16_to_f32(gate[j]);
                o[j] = f32_to_bf16(g / (1.0f + exp_f32(-g)) * bf16_to_f32(up[j]));
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < i; j++) {
                float g = bf16_to_f32(gate[j]);
                /* 0.5 (1 + tanh(y)) = 1 / (1 + e^(-2y)): no cancellation for large -y */
                float a = g / (1.0f + exp_f32(-2.0f * k0 * (g + k1 * g * g * g)));
                o[j] = f32_to_bf16(a * bf16_to_f32(up[j]));
            }
        }
    }
    return 0;
}

static void rotate_heads(const uint16_t *x, int64_t heads, int64_t d, const float *cs,
                         uint16_t *out) {
    int64_t half = d / 2;
    const float *cos = cs, *sin = cs + half;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *xh = x + h * d;
        uint16_t *oh = out + h * d;
        for (int64_t j = 0; j < half; j++) {
            float x1 = bf16_to_f32(xh[j]), x2 = bf16_to_f32(xh[j + half]);
            oh[j] = f32_to_bf16(x1 * cos[j] - x2 * sin[j]);
            oh[j + half] = f32_to_bf16(x2 * cos[j] + x1 * sin[j]);
        }
    }
}

/* NeoX rotary over every head of q [T, nq*d] and k [T, nk*d] (row strides given) at
 * positions; cos_sin [max_pos, d] float32 = cos | sin. Returns -1 for a position
 * outside [0, max_pos) (nothing written past that row). */
int paged_rotary_neox(const uint16_t *q, int64_t q_stride, int64_t nq, const uint16_t *k,
                      int64_t k_stride, int64_t nk, const int64_t *positions,
                      const float *cos_sin, int64_t max_pos, int64_t d, uint16_t *q_out,
                      uint16_t *k_out, int64_t t) {
    for (int64_t r = 0; r < t; r++) {
        int64_t p = positions[r];
        if (p < 0 || p >= max_pos) return -1;
        const float *cs = cos_sin + p * d;
        rotate_heads(q + r * q_stride, nq, d, cs, q_out + r * nq * d);
        rotate_heads(k + r * k_stride, nk, d, cs, k_out + r * nk * d);
    }
    return 0;
}

/* The decode attention moved to attention.c (its own library: attention_ops.py). */
