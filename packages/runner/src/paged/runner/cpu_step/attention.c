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
 * (LANES) consecutive positions inside one block; a chunk is converted to float32
 * once per KV head (keys transposed to [d][16] so that one vector holds the
 * chunk's 16 scores) and then used by every query vector that needs it: the
 * GQA group's heads times the request's query rows.
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
        /* keys: per 16-component slab, gather component i of the 16 keys with one
         * 16-bit gather per lane would be slow; instead convert each key's slab to a
         * float vector and transpose 16x16 through a small buffer. */
        float tile[LANES][LANES];
        for (int64_t i0 = 0; i0 < d; i0 += LANES) {
            for (int64_t t = 0; t < LANES; t++) {
                __m512 x = _mm512_setzero_ps();
                if (t < count) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)(ksrc + t * row + i0));
                    x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                }
                _mm512_storeu_ps(tile[t], x);
            }
            /* column i of the tile -> kt row i0 + i: 16 strided loads, by gather */
            const __m512i idx = _mm512_set_epi32(15 * LANES, 14 * LANES, 13 * LANES, 12 * LANES,
                                                 11 * LANES, 10 * LANES, 9 * LANES, 8 * LANES,
                                                 7 * LANES, 6 * LANES, 5 * LANES, 4 * LANES,
                                                 3 * LANES, 2 * LANES, 1 * LANES, 0);
            for (int64_t i = 0; i < LANES; i++)
                _mm512_storeu_ps(c->kt + (i0 + i) * LANES,
                                 _mm512_i32gather_ps(idx, &tile[0][i], 4));
        }
        for (int64_t t = 0; t < LANES; t++)
            for (int64_t i0 = 0; i0 < d; i0 += LANES) {
                __m512 x = _mm512_setzero_ps();
                if (t < count) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)(vsrc + t * row + i0));
                    x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                }
                _mm512_storeu_ps(c->v + t * d + i0, x);
            }
        return;
    }
#endif
    for (int64_t t = 0; t < LANES; t++)
        for (int64_t i = 0; i < d; i++) {
            c->kt[i * LANES + t] = t < count ? bf16_to_f32(ksrc[t * row + i]) : 0.0f;
            c->v[t * d + i] = t < count ? bf16_to_f32(vsrc[t * row + i]) : 0.0f;
        }
}

/* s[t] = (q . key t) * scale for the chunk's 16 lanes (lanes past the chunk score 0). */
static inline void chunk_scores(const float *q, const Chunk *c, int64_t d, float scale,
                                float *s) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < d; i += 2) { /* two chains: the fma latency, not its throughput */
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), _mm512_loadu_ps(c->kt + i * LANES), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[i + 1]),
                             _mm512_loadu_ps(c->kt + (i + 1) * LANES), a1);
    }
    if (i < d)
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), _mm512_loadu_ps(c->kt + i * LANES), a0);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(scale)));
#else
    float a0[LANES] = {0}, a1[LANES] = {0};
    int64_t i = 0;
    for (; i + 1 < d; i += 2) {
#pragma omp simd
        for (int t = 0; t < LANES; t++) {
            a0[t] += q[i] * c->kt[i * LANES + t];
            a1[t] += q[i + 1] * c->kt[(i + 1) * LANES + t];
        }
    }
    if (i < d) {
#pragma omp simd
        for (int t = 0; t < LANES; t++) a0[t] += q[i] * c->kt[i * LANES + t];
    }
#pragma omp simd
    for (int t = 0; t < LANES; t++) s[t] = (a0[t] + a1[t]) * scale;
#endif
}

/* The running softmax state of one query vector. */
typedef struct {
    float max, sum;
} Running;

/* Fold lanes [lo, hi) of the chunk's scores s into (state, acc[d]). */
static void fold_chunk(float *s, int64_t lo, int64_t hi, float soft_cap, const Chunk *c,
                       int64_t d, Running *st, float *acc) {
    float m = -INFINITY;
    for (int t = 0; t < LANES; t++) {
        float x = s[t];
        if (soft_cap > 0.0f) x = soft_cap * tanhf(x / soft_cap);
        x = (t >= lo && t < hi) ? x : -INFINITY;
        s[t] = x;
        m = x > m ? x : m;
    }
    float new_max = m > st->max ? m : st->max;
    float correction = st->max == -INFINITY ? 0.0f : exp_f32(st->max - new_max);
    float p[LANES];
#pragma omp simd
    for (int t = 0; t < LANES; t++) p[t] = exp_f32(s[t] - new_max);
    /* a fixed pairwise order over the 16 lanes (masked lanes are +0: no effect) */
    float total = 0.0f;
    {
        float h8[8], h4[4];
        for (int t = 0; t < 8; t++) h8[t] = p[t] + p[t + 8];
        for (int t = 0; t < 4; t++) h4[t] = h8[t] + h8[t + 4];
        total = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    }
    st->sum = st->sum * correction + total;
    st->max = new_max;
#if defined(__AVX512F__)
    if (d % LANES == 0) {
        __m512 corr = _mm512_set1_ps(correction);
        for (int64_t i0 = 0; i0 < d; i0 += LANES) {
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
    int64_t nvec = max_q * group;
    Chunk *chunk = aligned_alloc(64, sizeof(Chunk));
    float *qf = malloc((size_t)(nvec * d * 2) * sizeof(float));
    Running *state = malloc((size_t)nvec * sizeof(Running));
    if (!chunk || !qf || !state) {
        free(chunk), free(qf), free(state);
        return -1;
    }
    float *acc = qf + nvec * d;
    float s[LANES];
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t q0 = query_start_loc[r], q_len = query_start_loc[r + 1] - q0, seq = seq_lens[r];
        if (q_len == 0) continue;
        int64_t p0 = seq - q_len; /* position of the request's first row */
        int64_t lo_key = window > 0 ? p0 - window + 1 : 0;
        if (lo_key < 0) lo_key = 0;
        const int32_t *table = block_table + r * bt_stride;
        for (int64_t h = 0; h < hkv; h++) {
            /* query vector n = row i, group member g: n = i * group + g */
            for (int64_t i = 0; i < q_len; i++)
                for (int64_t g = 0; g < group; g++) {
                    const uint16_t *src = q + (q0 + i) * q_stride + (h * group + g) * d;
                    float *dst = qf + (i * group + g) * d;
                    for (int64_t e = 0; e < d; e++) dst[e] = bf16_to_f32(src[e]);
                }
            memset(acc, 0, (size_t)(q_len * group * d) * sizeof(float));
            for (int64_t n = 0; n < q_len * group; n++) state[n] = (Running){-INFINITY, 0.0f};
            for (int64_t b = lo_key / block_size; b * block_size < seq; b++) {
                const int64_t base = (int64_t)table[b] * block_size;
                for (int64_t off = 0; off < block_size && b * block_size + off < seq;
                     off += LANES) {
                    int64_t k0 = b * block_size + off; /* position of lane 0 */
                    int64_t count = block_size - off < LANES ? block_size - off : LANES;
                    if (seq - k0 < count) count = seq - k0;
                    if (k0 + count <= lo_key) continue;
                    const int64_t slot0 = base + off;
                    load_chunk(key_cache + slot0 * row + h * d, value_cache + slot0 * row + h * d,
                               row, d, count, chunk);
                    for (int64_t i = 0; i < q_len; i++) {
                        int64_t p = p0 + i;
                        int64_t first = window > 0 ? p - window + 1 : 0;
                        if (k0 > p || k0 + count <= first) continue;
                        int64_t lo = first > k0 ? first - k0 : 0;
                        int64_t hi = p - k0 + 1 < count ? p - k0 + 1 : count;
                        for (int64_t g = 0; g < group; g++) {
                            int64_t n = i * group + g;
                            chunk_scores(qf + n * d, chunk, d, scale, s);
                            fold_chunk(s, lo, hi, soft_cap, chunk, d, state + n, acc + n * d);
                        }
                    }
                }
            }
            for (int64_t i = 0; i < q_len; i++)
                for (int64_t g = 0; g < group; g++) {
                    int64_t n = i * group + g;
                    float inv = 1.0f / state[n].sum;
                    const float *a = acc + n * d;
                    uint16_t *o = out + (q0 + i) * hq * d + (h * group + g) * d;
                    for (int64_t e = 0; e < d; e++) o[e] = f32_to_bf16(a[e] * inv);
                }
        }
    }
    free(chunk), free(qf), free(state);
    return 0;
}
