/* Paged attention on CPU for steps of short query runs: decode rows (one query per
 * request) and speculative-verification rows (a few per request), one call per layer
 * for the whole batch. bfloat16 cache and activations, float32 maths.
 *
 * Called through ctypes from paged/runner/cpu_step/attention_ops.py, which checks
 * dtypes, shapes and strides; this file checks what depends on values (slots, block
 * ids, lengths) and returns an error code instead of touching memory it must not.
 *
 * Layout: the cache is [num_blocks, block_size, hkv, d], so one block holds
 * block_size slots of hkv * d values each. Keys are taken in chunks of up to 16
 * (LANES) consecutive positions inside one block, chunks in order and every KV
 * head of a chunk in turn (the block's bytes are read once, sequentially); each
 * head's part is converted to float32 (keys transposed to [d][16] so that one
 * vector holds the chunk's 16 scores) and then used by every query vector that
 * needs it: the GQA group's heads times the request's query rows.
 *
 * Exactness across batch layouts (why the loops look the way they do): a query row
 * at position p sees the keys max(0, p - window + 1) .. p. Its result depends only
 * on those keys and on the chunk grid (fixed by absolute positions and the block
 * size), never on the request's other rows or on seq_len: masked lanes score -inf,
 * become exactly +0 after the exp, and the value sum runs over the row's own valid
 * lanes only. So a one-row request (plain decode) and the same position inside a
 * multi-row request (verification) give the same bits, which is what keeps greedy
 * speculative output equal to plain greedy output.
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

int paged_attention_abi(void) { return 2; }

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

/* Fold lanes [lo, hi) of the chunk's scores s into (state, acc[d]). */
static void fold_chunk(float *s, int64_t lo, int64_t hi, float soft_cap, const Chunk *c,
                       int64_t d, Running *st, float *acc) {
    if (soft_cap > 0.0f)
        for (int64_t t = lo; t < hi; t++) s[t] = soft_cap * tanhf(s[t] / soft_cap);
    float p[LANES], total, new_max;
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
    int64_t nvec = max_q * hq; /* every head of the longest request */
    Chunk *chunk = aligned_alloc(64, sizeof(Chunk));
    float *qf = malloc((size_t)(nvec * d * 2) * sizeof(float));
    Running *state = malloc((size_t)nvec * sizeof(Running));
    if (!chunk || !qf || !state) {
        free(chunk), free(qf), free(state);
        return -1;
    }
    float *acc = qf + nvec * d;
    float *scores = malloc((size_t)(nvec * LANES) * sizeof(float));
    if (!scores) {
        free(chunk), free(qf), free(state);
        return -1;
    }
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t q0 = query_start_loc[r], q_len = query_start_loc[r + 1] - q0, seq = seq_lens[r];
        if (q_len == 0) continue;
        int64_t p0 = seq - q_len; /* position of the request's first row */
        int64_t lo_key = window > 0 ? p0 - window + 1 : 0;
        if (lo_key < 0) lo_key = 0;
        const int32_t *table = block_table + r * bt_stride;
        /* query vector n = (h * q_len + i) * group + g: KV head h, row i, group member g.
         * Chunks outer, heads inner: a block's slots (all heads) are read once, in order. */
        const int64_t per_head = q_len * group;
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t i = 0; i < q_len; i++)
                for (int64_t g = 0; g < group; g++) {
                    const uint16_t *src = q + (q0 + i) * q_stride + (h * group + g) * d;
                    float *dst = qf + (h * per_head + i * group + g) * d;
                    for (int64_t e = 0; e < d; e++) dst[e] = bf16_to_f32(src[e]);
                }
        memset(acc, 0, (size_t)(hkv * per_head * d) * sizeof(float));
        for (int64_t n = 0; n < hkv * per_head; n++) state[n] = (Running){-INFINITY, 0.0f};
        for (int64_t b = lo_key / block_size; b * block_size < seq; b++) {
            const int64_t base = (int64_t)table[b] * block_size;
            for (int64_t off = 0; off < block_size && b * block_size + off < seq; off += LANES) {
                int64_t k0 = b * block_size + off; /* position of lane 0 */
                int64_t count = block_size - off < LANES ? block_size - off : LANES;
                if (seq - k0 < count) count = seq - k0;
                if (k0 + count <= lo_key) continue;
                /* the rows that see some key of this chunk, a contiguous run: row i
                 * sees it from k0 <= p0 + i on (causality), and, with a window, while
                 * its first key p0 + i - window + 1 is inside the chunk */
                int64_t i_lo = k0 > p0 ? k0 - p0 : 0, i_hi = q_len;
                if (window > 0 && k0 + count + window - 1 - p0 < i_hi)
                    i_hi = k0 + count + window - 1 - p0;
                if (i_lo >= i_hi) continue;
                const int64_t slot0 = base + off;
                for (int64_t h = 0; h < hkv; h++) {
                    load_chunk(key_cache + slot0 * row + h * d, value_cache + slot0 * row + h * d,
                               row, d, count, chunk);
                    const int64_t n0 = h * per_head + i_lo * group;
                    chunk_scores(qf + n0 * d, (i_hi - i_lo) * group, chunk, d, scale, scores);
                    for (int64_t i = i_lo; i < i_hi; i++) {
                        int64_t p = p0 + i;
                        int64_t first = window > 0 ? p - window + 1 : 0;
                        int64_t lo = first > k0 ? first - k0 : 0;
                        int64_t hi = p - k0 + 1 < count ? p - k0 + 1 : count;
                        for (int64_t g = 0; g < group; g++) {
                            int64_t n = h * per_head + i * group + g;
                            fold_chunk(scores + (n - n0) * LANES, lo, hi, soft_cap, chunk, d,
                                       state + n, acc + n * d);
                        }
                    }
                }
            }
        }
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t i = 0; i < q_len; i++)
                for (int64_t g = 0; g < group; g++) {
                    int64_t n = h * per_head + i * group + g;
                    float inv = 1.0f / state[n].sum;
                    const float *a = acc + n * d;
                    uint16_t *o = out + (q0 + i) * hq * d + (h * group + g) * d;
                    for (int64_t e = 0; e < d; e++) o[e] = f32_to_bf16(a[e] * inv);
                }
    }
    free(chunk), free(qf), free(state), free(scores);
    return 0;
}
