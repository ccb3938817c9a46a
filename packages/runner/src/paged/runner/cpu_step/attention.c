/* Paged attention on CPU for every causal query run: decode rows (one query per
 * request), speculative-verification rows (a few per request) and prefill chunks (up
 * to the step's token budget), one call per layer for the whole batch. bfloat16 cache
 * and activations, float32 maths.
 *
 * Called through ctypes from paged/runner/cpu_step/attention_ops.py, which checks
 * dtypes, shapes and strides; this file checks what depends on values (slots, block
 * ids, lengths) and returns an error code instead of touching memory it must not.
 *
 * Layout: the cache is [num_blocks, block_size, hkv, d], so one block holds
 * block_size slots of hkv * d values each. Keys are taken in chunks of up to 16
 * (LANES) consecutive positions inside one block, chunks in order and every KV
 * head of a chunk in turn (the block's bytes are read once, sequentially); each
 * head's keys are transposed so that one vector holds the chunk's 16 scores, and
 * then used by every query vector that needs it: the GQA group's heads times the
 * request's query rows. Two builds of that step: with AVX512-BF16 and a head size
 * that is a multiple of 64, the pair path (PAGED_PAIRS, below: keys stay bf16,
 * scores by _mm512_dpbf16_ps, values read straight from the cache); otherwise keys
 * and values are widened to float32 first (load_chunk, chunk_scores, fold_chunk).
 * A machine uses one of them for every call, so the promises below hold per build.
 *
 * Exactness across batch layouts (why the loops look the way they do): a query row
 * at position p sees the keys max(0, p - window + 1) .. p. Its result depends only
 * on those keys and on the chunk grid (fixed by absolute positions and the block
 * size), never on the request's other rows or on seq_len: masked lanes score -inf,
 * become exactly +0 after the exp, and the value sum runs over the row's own valid
 * lanes only. So a one-row request (plain decode) and the same position inside a
 * multi-row request (verification, or a prefill chunk) give the same bits, which is
 * what keeps greedy speculative output equal to plain greedy output.
 *
 * Softmax is online (running max, rescaled sum and accumulator per query vector),
 * chunk by chunk. AVX-512 intrinsics where the compiler targets them (-march=native),
 * else plain loops over fixed 16-lane arrays that the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int paged_attention_abi(void) { return 3; }

enum { LANES = 16 };

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
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

/* e^x, Cephes' expf in plain float ops (as step_ops.c): vectorisable, within 2 ulp.
 * -inf (a masked lane) gives exactly 0. */
static inline float exp_f32(float x) {
    if (x == -INFINITY) return 0.0f;
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
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

#if defined(__AVX512F__)
static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* r[i][j] <- r[j][i] for a 16x16 float tile: 2x2, 4x4 (in 128-bit lanes), then
 * 128-bit blocks across registers (64 shuffles, no gathers). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* exp_f32's operations on 16 lanes (the same Cephes steps). */
static inline __m512 exp_f32x16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
    const __m512 shifter = _mm512_set1_ps(12582912.0f);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter),
                             shifter);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX512F__)
/* Ask for the cache lines of a block's keys and values (n values from `at`) ahead of
 * use: blocks lie anywhere in the cache, so the hardware prefetcher cannot follow the
 * block table, and at decode a layer's K/V (~15 MB at batch 32) comes from DRAM. */
/* Blocks ahead: 1 measured best (30 layers x 32 requests x 400 keys, one thread: 38 ms a
 * step against 39 and 42 ms for 2 and 3, and 52 ms without prefetching, load ~4.5). */
enum { PREFETCH_AHEAD = 1 };
static void prefetch_block(const uint16_t *key_cache, const uint16_t *value_cache, int64_t at,
                           int64_t slots, int64_t row, int64_t d) {
    /* one KV head's d values in each of the block's slots (a task is one head) */
    for (int64_t t = 0; t < slots; t++)
        for (int64_t i = 0; i < d; i += 32) {
            _mm_prefetch((const char *)(key_cache + at + t * row + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(value_cache + at + t * row + i), _MM_HINT_T0);
        }
}
#endif

/* One chunk of <= 16 keys and values of one KV head, float32. Lanes >= count are 0. */
typedef struct {
    float kt[/* d */ 256 * LANES]; /* kt[i * LANES + t] = key t's i-th component */
    float v[LANES * 256];          /* v[t * d + i] */
} Chunk;

/* Convert `count` slots starting at `src` (slot stride `row`, this head's d values
 * each) into c: keys transposed, values as rows. */
static void load_chunk(const uint16_t *ksrc, const uint16_t *vsrc, int64_t row, int64_t d,
                       int64_t count, Chunk *c) {
#if defined(__AVX512F__)
    if (d % LANES == 0) {
        for (int64_t i0 = 0; i0 < d; i0 += LANES) {
            __m512 tile[LANES];
            for (int64_t t = 0; t < LANES; t++)
                tile[t] = t < count ? load_bf16x16(ksrc + t * row + i0) : _mm512_setzero_ps();
            transpose16(tile);
            for (int64_t i = 0; i < LANES; i++) _mm512_store_ps(c->kt + (i0 + i) * LANES, tile[i]);
        }
        for (int64_t t = 0; t < LANES; t++)
            for (int64_t i0 = 0; i0 < d; i0 += LANES)
                _mm512_store_ps(c->v + t * d + i0,
                                t < count ? load_bf16x16(vsrc + t * row + i0) : _mm512_setzero_ps());
        return;
    }
#endif
    for (int64_t t = 0; t < LANES; t++)
        for (int64_t i = 0; i < d; i++) {
            c->kt[i * LANES + t] = t < count ? bf16_to_f32(ksrc[t * row + i]) : 0.0f;
            c->v[t * d + i] = t < count ? bf16_to_f32(vsrc[t * row + i]) : 0.0f;
        }
}

/* s[n][t] = (q_n . key t) * scale for the chunk's 16 lanes, for n query vectors at q
 * (d floats apart). Each vector's sum runs in the same order whatever n is (two
 * chains, even and odd components), so batching vectors changes no bit; up to four
 * vectors share each key load, eight independent fma chains. */
static void chunk_scores(const float *q, int64_t n, const Chunk *c, int64_t d, float scale,
                         float *s) {
#if defined(__AVX512F__)
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        int64_t m = n - n0 < 4 ? n - n0 : 4;
        const float *q0 = q + n0 * d;
        const float *q1 = q0 + (m > 1 ? d : 0), *q2 = q0 + (m > 2 ? 2 * d : 0);
        const float *q3 = q0 + (m > 3 ? 3 * d : 0); /* repeats of q0 past m: discarded */
        __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
        __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        int64_t i = 0;
        for (; i + 1 < d; i += 2) {
            __m512 ke = _mm512_load_ps(c->kt + i * LANES);
            __m512 ko = _mm512_load_ps(c->kt + (i + 1) * LANES);
            e0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[i]), ke, e0);
            e1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[i]), ke, e1);
            e2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[i]), ke, e2);
            e3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[i]), ke, e3);
            o0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[i + 1]), ko, o0);
            o1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[i + 1]), ko, o1);
            o2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[i + 1]), ko, o2);
            o3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[i + 1]), ko, o3);
        }
        if (i < d) {
            __m512 ke = _mm512_load_ps(c->kt + i * LANES);
            e0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[i]), ke, e0);
            e1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[i]), ke, e1);
            e2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[i]), ke, e2);
            e3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[i]), ke, e3);
        }
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 r[4] = {_mm512_mul_ps(_mm512_add_ps(e0, o0), sc),
                       _mm512_mul_ps(_mm512_add_ps(e1, o1), sc),
                       _mm512_mul_ps(_mm512_add_ps(e2, o2), sc),
                       _mm512_mul_ps(_mm512_add_ps(e3, o3), sc)};
        for (int64_t k = 0; k < m; k++) _mm512_storeu_ps(s + (n0 + k) * LANES, r[k]);
    }
#else
    for (int64_t v = 0; v < n; v++) {
        const float *qv = q + v * d;
        float a0[LANES] = {0}, a1[LANES] = {0};
        int64_t i = 0;
        for (; i + 1 < d; i += 2) {
#pragma omp simd
            for (int t = 0; t < LANES; t++) {
                a0[t] += qv[i] * c->kt[i * LANES + t];
                a1[t] += qv[i + 1] * c->kt[(i + 1) * LANES + t];
            }
        }
        if (i < d) {
#pragma omp simd
            for (int t = 0; t < LANES; t++) a0[t] += qv[i] * c->kt[i * LANES + t];
        }
#pragma omp simd
        for (int t = 0; t < LANES; t++) s[v * LANES + t] = (a0[t] + a1[t]) * scale;
    }
#endif
}

/* The running softmax state of one query vector. */
typedef struct {
    float max, sum;
} Running;

/* The softmax half of folding lanes [lo, hi) of a chunk's scores s into one query
 * vector's state: p[16] <- e^(s - new max) on those lanes (+0 elsewhere), the state's
 * max and sum updated; returns the factor the vector's accumulator is rescaled by. */
static float chunk_probs(float *s, int64_t lo, int64_t hi, float soft_cap, Running *st,
                         float *p) {
    if (soft_cap > 0.0f)
        for (int64_t t = lo; t < hi; t++) s[t] = soft_cap * tanhf(s[t] / soft_cap);
    float total, new_max;
#if defined(__AVX512F__)
    {
        __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
        __m512 x = _mm512_maskz_loadu_ps(valid, s);
        float m = _mm512_mask_reduce_max_ps(valid, x);
        new_max = m > st->max ? m : st->max;
        __m512 e = _mm512_maskz_mov_ps(valid, exp_f32x16(_mm512_sub_ps(x, _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(p, e);
        total = _mm512_reduce_add_ps(e);
    }
#else
    {
        float m = -INFINITY;
        for (int64_t t = lo; t < hi; t++) m = s[t] > m ? s[t] : m;
        new_max = m > st->max ? m : st->max;
#pragma omp simd
        for (int t = 0; t < LANES; t++)
            p[t] = (t >= lo && t < hi) ? exp_f32(s[t] - new_max) : 0.0f;
        /* a fixed pairwise order over the 16 lanes (masked lanes are +0: no effect) */
        float h8[8], h4[4];
        for (int t = 0; t < 8; t++) h8[t] = p[t] + p[t + 8];
        for (int t = 0; t < 4; t++) h4[t] = h8[t] + h8[t + 4];
        total = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    }
#endif
    float correction = st->max == -INFINITY ? 0.0f : exp_f32(st->max - new_max);
    st->sum = st->sum * correction + total;
    st->max = new_max;
    return correction;
}

/* Fold lanes [lo, hi) of the chunk's scores s into (state, acc[d]). */
static void fold_chunk(float *s, int64_t lo, int64_t hi, float soft_cap, const Chunk *c,
                       int64_t d, Running *st, float *acc) {
    float p[LANES];
    float correction = chunk_probs(s, lo, hi, soft_cap, st, p);
#if defined(__AVX512F__)
    if (d % LANES == 0) {
        __m512 corr = _mm512_set1_ps(correction);
        int64_t i0 = 0;
        for (; i0 + 4 * LANES <= d; i0 += 4 * LANES) { /* four independent chains */
            __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i0), corr);
            __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + i0 + LANES), corr);
            __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + i0 + 2 * LANES), corr);
            __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + i0 + 3 * LANES), corr);
            for (int64_t t = lo; t < hi; t++) {
                const float *vt = c->v + t * d + i0;
                __m512 pt = _mm512_set1_ps(p[t]);
                a0 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt), a0);
                a1 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + LANES), a1);
                a2 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + 2 * LANES), a2);
                a3 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + 3 * LANES), a3);
            }
            _mm512_storeu_ps(acc + i0, a0);
            _mm512_storeu_ps(acc + i0 + LANES, a1);
            _mm512_storeu_ps(acc + i0 + 2 * LANES, a2);
            _mm512_storeu_ps(acc + i0 + 3 * LANES, a3);
        }
        for (; i0 < d; i0 += LANES) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + i0), corr);
            for (int64_t t = lo; t < hi; t++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(c->v + t * d + i0), a);
            _mm512_storeu_ps(acc + i0, a);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) acc[i] *= correction;
    for (int64_t t = lo; t < hi; t++) {
        const float *vt = c->v + t * d;
        float pt = p[t];
#pragma omp simd
        for (int64_t i = 0; i < d; i++) acc[i] += pt * vt[i];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGED_PAIRS 1
/* The bfloat16-pair path (AVX512-BF16, head sizes a multiple of 64): keys are never
 * widened. A chunk's 16 keys of one head are transposed as 32-bit pairs of bf16
 * (kt[j][t] = key t's components 2j, 2j+1: half the shuffles of a float32
 * transpose, no conversion), and a score is 16 lanes of _mm512_dpbf16_ps, each
 * adding two exact bf16 x bf16 products to a float32 lane (the same products as
 * the float32 path, summed in another order). Values are read and widened straight
 * from the cache, and every query vector of one row (the GQA group, <= 4 at a time)
 * is updated from one load: at decode the group is the only reuse a key has, and
 * staging the chunk cost more than the arithmetic (SmolLM2, 3 vectors a row).
 * Every vector's arithmetic is the same whatever else is batched with it. */
typedef struct {
    uint32_t kt[/* d / 2 */ 128 * LANES]; /* kt[j * LANES + t] = key t's pair j */
} PairChunk;

static void load_pairs(const uint16_t *ksrc, int64_t row, int64_t d, int64_t count,
                       PairChunk *c) {
    for (int64_t j0 = 0; j0 < d / 2; j0 += LANES) {
        __m512 tile[LANES];
        for (int64_t t = 0; t < LANES; t++)
            tile[t] = t < count ? _mm512_castsi512_ps(_mm512_loadu_si512(ksrc + t * row + 2 * j0))
                                : _mm512_setzero_ps();
        transpose16(tile);
        for (int64_t j = 0; j < LANES; j++)
            _mm512_store_si512(c->kt + (j0 + j) * LANES, _mm512_castps_si512(tile[j]));
    }
}

/* chunk_scores on pairs: s[n][t] = (q_n . key t) * scale, q as d / 2 pairs a vector. */
static void pair_scores(const uint32_t *q, int64_t n, const PairChunk *c, int64_t d,
                        float scale, float *s) {
    const int64_t np = d / 2;
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        int64_t m = n - n0 < 4 ? n - n0 : 4;
        const uint32_t *q0 = q + n0 * np;
        const uint32_t *q1 = q0 + (m > 1 ? np : 0), *q2 = q0 + (m > 2 ? 2 * np : 0);
        const uint32_t *q3 = q0 + (m > 3 ? 3 * np : 0); /* repeats of q0 past m: discarded */
        __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
        __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        for (int64_t j = 0; j < np; j += 2) { /* np is even: d is a multiple of 64 */
            __m512bh ke = (__m512bh)_mm512_load_si512(c->kt + j * LANES);
            __m512bh ko = (__m512bh)_mm512_load_si512(c->kt + (j + 1) * LANES);
            e0 = _mm512_dpbf16_ps(e0, (__m512bh)_mm512_set1_epi32((int)q0[j]), ke);
            e1 = _mm512_dpbf16_ps(e1, (__m512bh)_mm512_set1_epi32((int)q1[j]), ke);
            e2 = _mm512_dpbf16_ps(e2, (__m512bh)_mm512_set1_epi32((int)q2[j]), ke);
            e3 = _mm512_dpbf16_ps(e3, (__m512bh)_mm512_set1_epi32((int)q3[j]), ke);
            o0 = _mm512_dpbf16_ps(o0, (__m512bh)_mm512_set1_epi32((int)q0[j + 1]), ko);
            o1 = _mm512_dpbf16_ps(o1, (__m512bh)_mm512_set1_epi32((int)q1[j + 1]), ko);
            o2 = _mm512_dpbf16_ps(o2, (__m512bh)_mm512_set1_epi32((int)q2[j + 1]), ko);
            o3 = _mm512_dpbf16_ps(o3, (__m512bh)_mm512_set1_epi32((int)q3[j + 1]), ko);
        }
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 r[4] = {_mm512_mul_ps(_mm512_add_ps(e0, o0), sc),
                       _mm512_mul_ps(_mm512_add_ps(e1, o1), sc),
                       _mm512_mul_ps(_mm512_add_ps(e2, o2), sc),
                       _mm512_mul_ps(_mm512_add_ps(e3, o3), sc)};
        for (int64_t k = 0; k < m; k++) _mm512_storeu_ps(s + (n0 + k) * LANES, r[k]);
    }
}

/* acc_g = acc_g * corr[g] + sum over t in [lo, hi) of p[g][t] v_t, for M vectors of one
 * row (acc_g at acc + g d); v_t read from the cache (slot stride `row`). Per component:
 * one rescale, then one fma per key in key order: fold_chunk's arithmetic. */
static inline __attribute__((always_inline)) void row_values_m(
    const uint16_t *vsrc, int64_t row, int64_t d, int64_t lo, int64_t hi, const float *p,
    const float *corr, float *acc, const int M) {
    for (int64_t i0 = 0; i0 < d; i0 += 4 * LANES) {
        __m512 a[4][4];
        for (int g = 0; g < M; g++) {
            __m512 c = _mm512_set1_ps(corr[g]);
            for (int k = 0; k < 4; k++)
                a[g][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + i0 + k * LANES), c);
        }
        for (int64_t t = lo; t < hi; t++) {
            const uint16_t *vt = vsrc + t * row + i0;
            __m512 v[4] = {load_bf16x16(vt), load_bf16x16(vt + LANES),
                           load_bf16x16(vt + 2 * LANES), load_bf16x16(vt + 3 * LANES)};
            for (int g = 0; g < M; g++) {
                __m512 pg = _mm512_set1_ps(p[g * LANES + t]);
                for (int k = 0; k < 4; k++) a[g][k] = _mm512_fmadd_ps(pg, v[k], a[g][k]);
            }
        }
        for (int g = 0; g < M; g++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(acc + g * d + i0 + k * LANES, a[g][k]);
    }
}

static void row_values(const uint16_t *vsrc, int64_t row, int64_t d, int64_t lo, int64_t hi,
                       int64_t m, const float *p, const float *corr, float *acc) {
    switch (m) {
    case 1: row_values_m(vsrc, row, d, lo, hi, p, corr, acc, 1); break;
    case 2: row_values_m(vsrc, row, d, lo, hi, p, corr, acc, 2); break;
    case 3: row_values_m(vsrc, row, d, lo, hi, p, corr, acc, 3); break;
    default: row_values_m(vsrc, row, d, lo, hi, p, corr, acc, 4); break;
    }
}

/* One chunk (keys k0 .. k0 + count - 1) of one KV head for rows i_lo .. i_hi - 1 of a
 * request whose first row is at position p0; qb, state and acc start at the vector of
 * (i_lo, group member 0), `group` vectors a row. */
static void pair_chunk(const uint16_t *ksrc, const uint16_t *vsrc, int64_t row, int64_t d,
                       int64_t count, int64_t k0, int64_t p0, int64_t i_lo, int64_t i_hi,
                       int64_t group, int64_t window, float scale, float soft_cap,
                       const uint32_t *qb, PairChunk *pc, float *scores, Running *state,
                       float *acc) {
    load_pairs(ksrc, row, d, count, pc);
    pair_scores(qb, (i_hi - i_lo) * group, pc, d, scale, scores);
    for (int64_t i = i_lo; i < i_hi; i++) {
        int64_t p = p0 + i;
        int64_t first = window > 0 ? p - window + 1 : 0;
        int64_t lo = first > k0 ? first - k0 : 0;
        int64_t hi = p - k0 + 1 < count ? p - k0 + 1 : count;
        int64_t base = (i - i_lo) * group;
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            int64_t m = group - g0 < 4 ? group - g0 : 4;
            float probs[4 * LANES], corr[4];
            for (int64_t g = 0; g < m; g++) {
                int64_t n = base + g0 + g;
                corr[g] = chunk_probs(scores + n * LANES, lo, hi, soft_cap, state + n,
                                      probs + g * LANES);
            }
            row_values(vsrc, row, d, lo, hi, m, probs, corr, acc + (base + g0) * d);
        }
    }
}
#else
#define PAGED_PAIRS 0
#endif

/* ------------------------------------------------------------ threads
 *
 * The attention runs as tasks on the pool pool.py's CpuPool attached (no pool: the
 * same tasks in a loop on the calling thread): one task per (request, KV head, run
 * of up to ROWS_PER_TASK query rows). A query vector's result depends only on its own
 * keys, visited chunk by chunk in position order (see the top of this file), so a
 * task computes exactly the bits the whole call computed for its vectors: the
 * output does not depend on the thread count nor on how rows are split. */
typedef int (*pool_task_fn)(void *ctx, int64_t task);
typedef int (*pool_run_fn)(void *pool, int64_t ntasks, pool_task_fn fn, void *ctx);

static pool_run_fn at_run = NULL; /* set once by the engine, before any kernel call */
static void *at_pool = NULL;

void paged_attention_use_pool(void *run, void *pool, int threads) {
    (void)threads;
    at_run = (pool_run_fn)run;
    at_pool = run ? pool : NULL;
}

/* Work (query vectors x keys x head size) below this runs on the calling thread:
 * a decode row over a few hundred keys takes microseconds, less than a hand-off. */
enum { AT_PARALLEL_MIN = 1 << 18 };

static int at_parallel(int64_t ntasks, pool_task_fn fn, void *ctx, int64_t work) {
    if (at_run != NULL && ntasks > 1 && work >= AT_PARALLEL_MIN)
        return at_run(at_pool, ntasks, fn, ctx);
    int error = 0;
    for (int64_t t = 0; t < ntasks; t++) {
        const int rc = fn(ctx, t);
        if (rc != 0 && error == 0) error = rc;
    }
    return error;
}

/* Query rows per task: prefill chunks split so that both cores get work even with
 * one KV head; decode rows are one task per (request, head). */
enum { ROWS_PER_TASK = 32 };

typedef struct {
    int64_t r, h, i0, i1; /* request, KV head, its query rows i0 .. i1 - 1 */
} Task;

typedef struct {
    const uint16_t *q;
    int64_t q_stride;
    const uint16_t *key_cache, *value_cache;
    const int32_t *block_table;
    int64_t bt_stride, block_size;
    const int32_t *query_start_loc, *seq_lens;
    int64_t hq, hkv, d;
    float scale;
    int64_t window;
    float soft_cap;
    uint16_t *out;
    const Task *tasks;
} Call;

static int attend_task(void *ctx, int64_t task) {
    const Call *c = (const Call *)ctx;
    const Task *tk = c->tasks + task;
    const int64_t r = tk->r, h = tk->h, i0 = tk->i0, i1 = tk->i1, d = c->d;
    const int64_t hkv = c->hkv, row = hkv * d, group = c->hq / hkv, block_size = c->block_size;
    const int64_t window = c->window;
    const int64_t q0 = c->query_start_loc[r], seq = c->seq_lens[r];
    const int64_t q_len = c->query_start_loc[r + 1] - q0;
    const int64_t p0 = seq - q_len; /* position of the request's first row */
    const int64_t hi_key = p0 + i1;  /* the task's last row sees keys < hi_key */
    int64_t lo_key = window > 0 ? p0 + i0 - window + 1 : 0;
    if (lo_key < 0) lo_key = 0;
    const int64_t nvec = (i1 - i0) * group; /* vector n = (i - i0) * group + g */
    Chunk *chunk = aligned_alloc(64, sizeof(Chunk));
    float *qf = malloc((size_t)(nvec * d * 2) * sizeof(float));
    Running *state = malloc((size_t)nvec * sizeof(Running));
    float *scores = malloc((size_t)(nvec * LANES) * sizeof(float));
    const int pairs = PAGED_PAIRS && d % (4 * LANES) == 0;
    /* the pair path: query vectors as bf16 pairs; the chunk buffer holds a PairChunk */
    uint32_t *qb = pairs ? malloc((size_t)(nvec * d / 2) * sizeof(uint32_t)) : NULL;
    if (!chunk || !qf || !state || !scores || (pairs && !qb)) {
        free(chunk), free(qf), free(state), free(scores), free(qb);
        return -1;
    }
    float *acc = qf + nvec * d;
    const int32_t *table = c->block_table + r * c->bt_stride;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < group; g++) {
            const uint16_t *src = c->q + (q0 + i) * c->q_stride + (h * group + g) * d;
            const int64_t n = (i - i0) * group + g;
            if (pairs) {
                memcpy(qb + n * d / 2, src, (size_t)d * sizeof(uint16_t));
                continue;
            }
            float *dst = qf + n * d;
            for (int64_t e = 0; e < d; e++) dst[e] = bf16_to_f32(src[e]);
        }
    memset(acc, 0, (size_t)(nvec * d) * sizeof(float));
    for (int64_t n = 0; n < nvec; n++) state[n] = (Running){-INFINITY, 0.0f};
    for (int64_t b = lo_key / block_size; b * block_size < hi_key; b++) {
        const int64_t base = (int64_t)table[b] * block_size;
#if defined(__AVX512F__)
        if ((b + PREFETCH_AHEAD) * block_size < hi_key) /* see prefetch_block */
            prefetch_block(c->key_cache, c->value_cache,
                           (int64_t)table[b + PREFETCH_AHEAD] * block_size * row + h * d,
                           block_size, row, d);
#endif
        for (int64_t off = 0; off < block_size && b * block_size + off < hi_key; off += LANES) {
            const int64_t k0 = b * block_size + off; /* position of lane 0 */
            int64_t count = block_size - off < LANES ? block_size - off : LANES;
            if (seq - k0 < count) count = seq - k0;
            if (k0 + count <= lo_key) continue;
            /* the rows that see some key of this chunk, a contiguous run: row i
             * sees it from k0 <= p0 + i on (causality), and, with a window, while
             * its first key p0 + i - window + 1 is inside the chunk */
            int64_t i_lo = k0 > p0 ? k0 - p0 : 0, i_hi = i1;
            if (i_lo < i0) i_lo = i0;
            if (window > 0 && k0 + count + window - 1 - p0 < i_hi)
                i_hi = k0 + count + window - 1 - p0;
            if (i_lo >= i_hi) continue;
            const int64_t slot0 = base + off;
            const int64_t n0 = (i_lo - i0) * group;
            const uint16_t *ksrc = c->key_cache + slot0 * row + h * d;
            const uint16_t *vsrc = c->value_cache + slot0 * row + h * d;
#if PAGED_PAIRS
            if (pairs) {
                pair_chunk(ksrc, vsrc, row, d, count, k0, p0, i_lo, i_hi, group, window,
                           c->scale, c->soft_cap, qb + n0 * d / 2, (PairChunk *)chunk, scores,
                           state + n0, acc + n0 * d);
                continue;
            }
#endif
            load_chunk(ksrc, vsrc, row, d, count, chunk);
            chunk_scores(qf + n0 * d, (i_hi - i_lo) * group, chunk, d, c->scale, scores);
            for (int64_t i = i_lo; i < i_hi; i++) {
                const int64_t p = p0 + i;
                const int64_t first = window > 0 ? p - window + 1 : 0;
                const int64_t lo = first > k0 ? first - k0 : 0;
                const int64_t hi = p - k0 + 1 < count ? p - k0 + 1 : count;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t n = (i - i0) * group + g;
                    fold_chunk(scores + (n - n0) * LANES, lo, hi, c->soft_cap, chunk, d,
                               state + n, acc + n * d);
                }
            }
        }
    }
    for (int64_t i = i0; i < i1; i++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t n = (i - i0) * group + g;
            const float inv = 1.0f / state[n].sum;
            const float *a = acc + n * d;
            uint16_t *o = c->out + (q0 + i) * c->hq * d + (h * group + g) * d;
            for (int64_t e = 0; e < d; e++) o[e] = f32_to_bf16(a[e] * inv);
        }
    free(chunk), free(qf), free(state), free(scores), free(qb);
    return 0;
}

/* Write the step's T new K/V rows into the cache at slot_mapping (-1 = skip), then
 * attend every query row:
 *
 *   q [T, hq*d], k/v [T, hkv*d] bf16 rows (strides given); caches [num_slots, hkv, d]
 *   query_start_loc [R+1] int32: request r's rows are qsl[r] .. qsl[r+1]-1, the last
 *     q_len of its seq_lens[r] tokens (row i at position seq_len - q_len + i)
 *   block_table [R, bt_width] int32 (row stride bt_stride)
 *   window > 0: a row at p sees keys > p - window; soft_cap > 0: s = cap tanh(s / cap)
 *   out [T, hq*d] bf16; query head h reads KV head h / (hq / hkv).
 *
 * Returns 0, or -1 (memory), -2 (a slot outside the cache), -3 (a block id outside
 * the cache, or too few table columns), -4 (query_start_loc / seq_lens inconsistent),
 * -5 (head size over 256). Nothing is attended before every check has passed. */
int paged_attention_rows(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                         int64_t k_stride, const uint16_t *v, int64_t v_stride,
                         const int64_t *slot_mapping, int64_t num_tokens, uint16_t *key_cache,
                         uint16_t *value_cache, int64_t num_slots, const int32_t *block_table,
                         int64_t bt_stride, int64_t bt_width, int64_t block_size,
                         const int32_t *query_start_loc, const int32_t *seq_lens,
                         int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d, float scale,
                         int64_t window, float soft_cap, uint16_t *out) {
    if (d > 256 || d < 1) return -5;
    int64_t row = hkv * d, group = hq / hkv, num_blocks = num_slots / block_size;
    int64_t max_q = 0;
    if (query_start_loc[0] != 0 || query_start_loc[num_reqs] != num_tokens) return -4;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t q_len = query_start_loc[r + 1] - query_start_loc[r], seq = seq_lens[r];
        if (q_len < 0 || q_len > seq) return -4;
        if (q_len > max_q) max_q = q_len;
        if (q_len == 0) continue;
        int64_t first = seq - q_len - (window > 0 ? window - 1 : seq);
        if (first < 0) first = 0;
        const int32_t *table = block_table + r * bt_stride;
        for (int64_t j = first / block_size; j * block_size < seq; j++)
            if (j >= bt_width || table[j] < 0 || table[j] >= num_blocks) return -3;
    }
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot != -1 && (slot < 0 || slot >= num_slots)) return -2;
    }
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot == -1) continue;
        memcpy(key_cache + slot * row, k + t * k_stride, (size_t)row * sizeof(uint16_t));
        memcpy(value_cache + slot * row, v + t * v_stride, (size_t)row * sizeof(uint16_t));
    }
    if (max_q == 0) return 0;
    /* tasks: (request, KV head, run of up to ROWS_PER_TASK query rows) */
    int64_t ntasks = 0, work = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        ntasks += hkv * ((q_len + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
        work += q_len * hq * d * seq_lens[r];
    }
    Task *tasks = malloc((size_t)ntasks * sizeof(Task));
    if (!tasks) return -1;
    int64_t t = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t i0 = 0; i0 < q_len; i0 += ROWS_PER_TASK)
                tasks[t++] = (Task){r, h, i0, q_len - i0 < ROWS_PER_TASK ? q_len : i0 + ROWS_PER_TASK};
    }
    const Call call = {q, q_stride, key_cache, value_cache, block_table, bt_stride, block_size,
                       query_start_loc, seq_lens, hq, hkv, d, scale, window, soft_cap, out, tasks};
    const int rc = at_parallel(ntasks, attend_task, (void *)&call, work);
    free(tasks);
    return rc;
}
