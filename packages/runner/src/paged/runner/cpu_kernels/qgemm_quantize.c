/* Activation quantisation of qgemm.c (inlined into it by cpu_kernels/build.py:
 * one translation unit). x rows -> int8 codes per group of 32 in the
 * block-interleaved layout QOFF / SOFF describe; scalar on the AVX2 and
 * scalar paths, AVX-512 on the VNNI path, the same bits on all. */

/* x rows [m, k] (float32 or bfloat16, row stride x_stride elements) -> int8 q,
 * per-group scale xs = amax / 127 and xsum = xs * sum(q) [m, k / 32].
 * levels 2: each row also gets a residual row (x - xs q quantised the same way:
 * about 14 bits of x in all) in q2 / xs2 / xsum2, but only for the groups
 * whose largest value dwarfs the rest; mask2 marks them per block of MB_ROWS
 * rows and group, and the tile kernels multiply only those (with the weight
 * group they already hold in registers for level 1). flip: store q ^ 0x80 (= q + 128
 * as a u8), the unsigned operand of the 8-bit VNNI path. This scalar code is the
 * definition; quantize_rows_v below gives the same bits with AVX-512, so that all
 * paths see the same q (paged_qgemm_quantize lets the tests compare the two). */
static void quantize_group(const float *v, int flip, int8_t *qo, float *xs, float *xsum) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < GROUP; i++) {
        int32_t q = (int32_t)nearbyintf(v[i] * id);
        sum += q;
        qo[i] = (int8_t)(flip ? (q ^ 0x80) : q);
    }
    *xs = d;
    *xsum = d * (float)sum;
}

__attribute__((unused)) static void quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t x_stride,
                          int levels, float ratio, int flip, const QRows *o) {
    const int64_t groups = k / GROUP;
    float buf[GROUP];
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t base = r * x_stride + g * GROUP;
            for (int i = 0; i < GROUP; i++)
                buf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i])
                                : ((const float *)x)[base + i];
            const int64_t at = SOFF(r, g);
            int8_t *qo = o->q + QOFF(r, g);
            quantize_group(buf, flip, qo, o->xs + at, o->xsum + at);
            if (levels != 2) continue;
            const float d = o->xs[at];
            float amax = 0.0f, total = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                const float a = fabsf(buf[i]);
                amax = a > amax ? a : amax;
                total += a;
            }
            /* Only groups whose largest value dwarfs the rest (amax > ratio * mean |x|)
             * lose precision in one level; the others have no residual. */
            if (!(amax > ratio * (total / GROUP))) continue;
            for (int i = 0; i < GROUP; i++) {
                const int32_t q1 = flip ? (int32_t)(int8_t)(qo[i] ^ 0x80) : qo[i];
                const float coarse = d * (float)q1;
                buf[i] = buf[i] - coarse;
            }
            quantize_group(buf, flip, o->q2 + QOFF(r, g), o->xs2 + at, o->xsum2 + at);
            /* an all-zero residual adds nothing: leave it out, as the dense pass would skip it */
            if (o->xs2[at] != 0.0f)
                o->mask2[(r / MB_ROWS) * groups + g] |= (uint8_t)(1u << (r % MB_ROWS));
        }
    }
}

#if defined(QG_VNNI)
/* quantize_rows' groups with AVX-512: the same float32 operations lane by lane
 * (|x|, max, one multiply by 1 / xs, round to nearest even; residual x - xs q as
 * a multiply and a subtract), so the same q, xs and xsum bits as the scalar code.
 * One group is 32 values: two vectors. */
QG_INLINE float quantize_group_v(__m512 v0, __m512 v1, int flip, int8_t *qo, float *xs,
                                 float *xsum, __m512i *q0, __m512i *q1) {
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    *q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)); /* MXCSR rounding, as nearbyintf */
    *q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(*q0, *q1));
    const __m128i f = _mm_set1_epi8(flip ? (char)0x80 : 0);
    _mm_storeu_si128((__m128i *)qo, _mm_xor_si128(_mm512_cvtepi32_epi8(*q0), f));
    _mm_storeu_si128((__m128i *)(qo + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(*q1), f));
    *xs = d;
    *xsum = d * (float)sum;
    return amax;
}

/* The level-2 test amax > ratio * (total / GROUP), total the sum of |x| in index
 * order. A vector sum (another order) decides it when it is clear by far more than
 * the two sums can differ (< 32 ulps of the total); otherwise the ordered sum. */
QG_INLINE int has_residual(const void *x, int x_bf16, int64_t base, __m512 v0, __m512 v1,
                           float amax, float ratio) {
    const __m512 sum = _mm512_add_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float near = ratio * (_mm512_reduce_add_ps(sum) / GROUP);
    if (isfinite(near) && fabsf(amax - near) > 1e-4f * near) return amax > near;
    float total = 0.0f;
    for (int i = 0; i < GROUP; i++)
        total += fabsf(x_bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i])
                              : ((const float *)x)[base + i]);
    return amax > ratio * (total / GROUP);
}

/* One group of x (float32 or bfloat16) into two float32 vectors. */
QG_INLINE void load_group(const void *x, int x_bf16, int64_t base, __m512 *v0, __m512 *v1) {
    if (x_bf16) {
        const __m512i h = _mm512_loadu_si512((const void *)((const uint16_t *)x + base));
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1));
        *v0 = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
        *v1 = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
    } else {
        *v0 = _mm512_loadu_ps((const float *)x + base);
        *v1 = _mm512_loadu_ps((const float *)x + base + 16);
    }
}

static void quantize_rows_v(const void *x, int x_bf16, int64_t m, int64_t k, int64_t x_stride,
                            int levels, float ratio, int flip, const QRows *o) {
    const int64_t groups = k / GROUP;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t base = r * x_stride + g * GROUP, at = SOFF(r, g);
            __m512 v0, v1;
            __m512i q0, q1;
            load_group(x, x_bf16, base, &v0, &v1);
            const float amax = quantize_group_v(v0, v1, flip, o->q + QOFF(r, g), o->xs + at,
                                                o->xsum + at, &q0, &q1);
            if (levels != 2 || !has_residual(x, x_bf16, base, v0, v1, amax, ratio)) continue;
            /* the stored int8 codes, as the scalar code reads them back (they differ
             * from q0 / q1 only where x / xs overflowed: a subnormal xs) */
            q0 = _mm512_cvtepi8_epi32(_mm512_cvtepi32_epi8(q0));
            q1 = _mm512_cvtepi8_epi32(_mm512_cvtepi32_epi8(q1));
            const __m512 d = _mm512_set1_ps(o->xs[at]);
            v0 = _mm512_sub_ps(v0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)));
            v1 = _mm512_sub_ps(v1, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1)));
            quantize_group_v(v0, v1, flip, o->q2 + QOFF(r, g), o->xs2 + at, o->xsum2 + at, &q0,
                             &q1);
            if (o->xs2[at] != 0.0f)
                o->mask2[(r / MB_ROWS) * groups + g] |= (uint8_t)(1u << (r % MB_ROWS));
        }
    }
}
#endif

/* The path's quantiser: quantize_rows_v on the VNNI path, else quantize_rows. */
static void quantize_chunk(const void *x, int x_bf16, int64_t m, int64_t k, int64_t x_stride,
                           int levels, float ratio, int flip, const QRows *o) {
#if defined(QG_VNNI)
    quantize_rows_v(x, x_bf16, m, k, x_stride, levels, ratio, flip, o);
#else
    quantize_rows(x, x_bf16, m, k, x_stride, levels, ratio, flip, o);
#endif
}

/* Test hook: the codes the kernels see, row-major: q [m, k], xs / xsum [m, k / 32];
 * levels 2 also q2, xs2, xsum2 and has2 [m, k / 32] (1: the group has a residual;
 * zeros where it has none). scalar 1: quantize_rows, 0: this path's quantiser, so
 * that a test can check that the two give the same bits. Returns 0 or -1. */
int paged_qgemm_quantize(const void *x, int x_bf16, int64_t m, int64_t k, int levels,
                         float ratio, int flip, int scalar, int8_t *q, float *xs, float *xsum,
                         int8_t *q2, float *xs2, float *xsum2, uint8_t *has2) {
    if (k <= 0 || k % GROUP != 0 || m < 0 || (levels != 1 && levels != 2)) return -1;
    const int64_t groups = k / GROUP;
    if (levels == 2) {
        memset(q2, 0, (size_t)(m * k));
        memset(xs2, 0, (size_t)(m * groups) * sizeof(float));
        memset(xsum2, 0, (size_t)(m * groups) * sizeof(float));
        memset(has2, 0, (size_t)(m * groups));
    }
    for (int64_t r = 0; r < m; r++) {
        /* one row at a time, a block of width 1: QOFF / SOFF index it row-major */
        const QRows o = {q + r * k, levels == 2 ? q2 + r * k : NULL, xs + r * groups,
                         xsum + r * groups, levels == 2 ? xs2 + r * groups : NULL,
                         levels == 2 ? xsum2 + r * groups : NULL,
                         levels == 2 ? has2 + r * groups : NULL, 1};
        const void *xr = x_bf16 ? (const void *)((const uint16_t *)x + r * k)
                                : (const void *)((const float *)x + r * k);
        if (scalar)
            quantize_rows(xr, x_bf16, 1, k, k, levels, ratio, flip, &o);
        else
            quantize_chunk(xr, x_bf16, 1, k, k, levels, ratio, flip, &o);
    }
    return 0;
}
