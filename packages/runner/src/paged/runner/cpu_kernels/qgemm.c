/* y[M, N] = x[M, K] @ W^T for group-quantised W, on CPU (paged-runner, cpu_kernels).
 *
 * Compiled on first use by cpu_kernels/build.py with the system C compiler
 * (-O3 -march=native); no Python or torch headers, called through ctypes.
 *
 * The idea is llama.cpp's, written here from scratch: every activation row is
 * quantised to int8 per group of 32 (scale xs = amax / 127, q = rne(x / xs)),
 * the per-group dot products are exact integer sums, and the groups' products
 * are accumulated in float32 (optionally a second int8 pass over the residual
 * x - xs q gives ~14-bit activations at twice the arithmetic: `levels` 2):
 *     4-bit:  sum_k w x = sum_g  d[g] xs[g] (sum q_w q_x)  +  m[g] xs[g] (sum q_x)
 *     8-bit:  sum_k w x = sum_s  d[s] xs[g] (sum q_w q_x)        (s: 32 or 16 weights)
 *
 * Packed weight layout (built by cpu_kernels/packing.py), in tiles of TILE = 16
 * output rows (N padded with zero rows), groups of 32 inputs inside a tile:
 *   4-bit block [16 rows x 32 inputs], Q4_BLOCK bytes:
 *       256 B codes: byte (c * 64 + l * 4 + b), c in 0..3, l in 0..15, b in 0..3,
 *                    low nibble = q[row l][4c + b], high nibble = q[row l][4(c + 4) + b]
 *        64 B d[16] float32, 64 B m[16] float32           w = d q + m, q in 0..15
 *   5-bit block (only as qgemm_native.c's Q5_K expands, no packer of its own),
 *       Q5_BLOCK bytes: the 4-bit block, then 64 B high bits: bit c of byte
 *       (l * 4 + b) is bit 4 of q[row l][4c + b] (q in 0..31; the 4-bit
 *       kernels with HB = 1 OR it into the unpacked codes)
 *   8-bit block, 512 + S * 128 bytes (S = 1: one scale per 32, S = 2: per 16):
 *       512 B codes: byte (c * 64 + l * 4 + b) = q[row l][4c + b], c in 0..7, int8
 *       S x 64 B corr[16] int32 = -128 * (sum of the sub-group's codes)
 *       S x 64 B d[16] float32                           w = d q
 * (qgemm_native.c keeps GGUF's own scales in these tiles instead: Q4_K, Q6_K, Q4_0,
 * Q4_1 and Q8_0 at the file's byte count, the same values.)
 * So one 64-byte load holds 4 consecutive inputs of 16 rows: the shape of
 * VNNI's vpdpbusd (16 int32 lanes, each a 4-long u8 x s8 dot), with the
 * activation's 4 bytes broadcast to every lane. One weight tile is loaded (and
 * unpacked) once per MB activation rows and stays in L1 for the other rows.
 *
 * Paths, chosen when compiling (build.py can force the lower ones):
 *   AVX512-VNNI (+BW, VL): vpdpbusd. 4-bit codes are the unsigned operand; for
 *       8-bit codes the activation is made unsigned (q + 128) and corr removes
 *       the 128 * sum(q_w) it adds.
 *   AVX2 (+FMA): maddubs; 4-bit: codes x activations, 8 chunks summed in int16
 *       (at most 8 * 2 * 15 * 127 = 30480); 8-bit: the abs/sign trick
 *       maddubs(|w|, sign(x, w)) and one madd per chunk.
 *   scalar C: the same sums in plain loops.
 * All paths give the same integer sums; only the float32 accumulation order
 * differs (tests/test_cpu_qgemm.py compares them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(PAGED_QGEMM_FORCE_SCALAR) && !defined(PAGED_QGEMM_FORCE_AVX2) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QG_VNNI 1
#include <immintrin.h>
#elif !defined(PAGED_QGEMM_FORCE_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#include <immintrin.h>
#endif

#define TILE 16
#define GROUP 32
#define Q4_BLOCK (256 + 64 + 64)
#define Q5_BLOCK (Q4_BLOCK + 64) /* + the fifth bits (qgemm_native.c's Q5_K) */
#define Q8_CODES 512
/* Activation rows per pass over a weight tile (MB_ROWS x 16 accumulators plus
 * the tile's 8 weight vectors fit AVX-512's 32 registers; AVX2 has 16). */
#if defined(QG_VNNI)
#define MB_ROWS 8
#else
#define MB_ROWS 4
#endif
#define M_CHUNK 256   /* activation rows whose int8 copy stays in L2 (a multiple of 2 MB_ROWS) */

#define QG_INLINE static inline __attribute__((always_inline))

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 };

int paged_qgemm_isa(void) {
#if defined(QG_VNNI)
    return ISA_AVX512_VNNI;
#elif defined(QG_AVX2)
    return ISA_AVX2;
#else
    return ISA_SCALAR;
#endif
}

int paged_qgemm_abi(void) { return 8; }

/* ---------------------------------------------------------------- helpers */

QG_INLINE int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

QG_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 cast (NaN kept a NaN). */
QG_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A per-thread scratch buffer for the int8 activations (grown, never shrunk). */
static __thread void *scratch_ptr = NULL;
static __thread size_t scratch_cap = 0;

static void *scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0) return NULL;
        free(scratch_ptr);
        scratch_ptr = p;
        scratch_cap = bytes;
    }
    return scratch_ptr;
}

/* The int8 activations of one chunk of rows: level 1 for every row, level 2
 * (the residual) for the groups mask2 marks. Stored block-interleaved, in
 * blocks of MB_ROWS rows (the tile kernels' row blocks): a block's rows'
 * codes for one group are 32-byte neighbours, so the kernels reach all of
 * them at constant offsets from one pointer and walk memory in order. */
/* A call of fewer rows than MB_ROWS stores them at width bw = its row count
 * (one row: plain rows, as few cache lines as possible while the weights stream
 * through L1); bw < MB_ROWS means one block, so r / MB_ROWS and r % MB_ROWS
 * still index it. */
#define QOFF(r, g) \
    (((r) / MB_ROWS) * (o->bw * k) + (g) * (o->bw * GROUP) + ((r) % MB_ROWS) * GROUP)
#define SOFF(r, g) (((r) / MB_ROWS) * (o->bw * groups) + (g) * o->bw + ((r) % MB_ROWS))
typedef struct {
    int8_t *q, *q2;          /* [blocks, groups, MB_ROWS, 32] (QOFF) */
    float *xs, *xsum;        /* [blocks, groups, MB_ROWS] (SOFF) */
    float *xs2, *xsum2;      /* [blocks, groups, MB_ROWS] */
    uint8_t *mask2;          /* [rows / MB_ROWS blocks, groups]: bit r, row r of the block
                                has a residual in that group */
    int64_t bw;              /* rows per block in q / xs: MB_ROWS, or the call's rows if fewer */
} QRows;

#include "qgemm_quantize.c" /* quantize_rows (build.py inlines it) */

/* Write one tile's results acc[0..15] of row `row` (only the first `count` lanes). */
static void store_row(const float *acc, void *y, int y_bf16, int64_t y_stride, int64_t row,
                      int64_t n0, int64_t count) {
    if (y_bf16) {
        uint16_t *out = (uint16_t *)y + row * y_stride + n0;
        for (int64_t l = 0; l < count; l++) out[l] = f32_to_bf16(acc[l]);
    } else {
        float *out = (float *)y + row * y_stride + n0;
        memcpy(out, acc, (size_t)count * sizeof(float));
    }
}

/* ------------------------------------------------------------ tile kernels
 *
 * Each computes acc[r][0..15] for the MB activation rows r0 .. r0 + MB - 1 and
 * one tile of 16 output columns, over all groups of K. A weight group is
 * loaded (and, 4-bit, unpacked) once into registers and multiplied by all MB
 * rows; then, for levels 2, by the rows whose residual covers that group
 * (mask2: usually few). Per row and output the float32 sums run over the
 * groups in ascending order, level 1 and level 2 each in its own sum, added
 * at the end: the same operations in the same order on every path.
 */

/* Row r (of the chunk) and group g's int8 codes / scales (see QOFF, SOFF). */
#define QX(o, r, g) ((o)->q + QOFF(r, g))
#define QX2(o, r, g) ((o)->q2 + QOFF(r, g))

/* ------------------------------------------------------------ scalar path */

QG_INLINE int32_t q4_dot_scalar(const uint8_t *blk, int hb, int l, const int8_t *xr) {
    int32_t dot = 0;
    for (int c = 0; c < 4; c++)
        for (int b = 0; b < 4; b++) {
            const uint8_t byte = blk[c * 64 + l * 4 + b];
            const int high = hb ? blk[Q4_BLOCK + l * 4 + b] : 0; /* 5-bit: bit c of chunk c */
            dot += (int32_t)((byte & 15) | ((high >> c) & 1) << 4) * xr[4 * c + b];
            dot += (int32_t)((byte >> 4) | ((high >> (c + 4)) & 1) << 4) * xr[4 * (c + 4) + b];
        }
    return dot;
}

__attribute__((unused)) static void q4_tile_scalar(const uint8_t *wt, int64_t groups,
                                                   const QRows *o, int64_t r0, int64_t k,
                                                   const uint8_t *mask2, int mb, int hb,
                                                   float acc[][TILE]) {
    float res[MB_ROWS][TILE];
    for (int r = 0; r < mb; r++)
        for (int l = 0; l < TILE; l++) acc[r][l] = res[r][l] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * (hb ? Q5_BLOCK : Q4_BLOCK);
        const float *d = (const float *)(blk + 256), *mn = (const float *)(blk + 320);
        for (int r = 0; r < mb; r++) {
            const int64_t at = SOFF(r0 + r, g);
            for (int l = 0; l < TILE; l++) {
                acc[r][l] += (float)q4_dot_scalar(blk, hb, l, QX(o, r0 + r, g)) * (d[l] * o->xs[at]);
                acc[r][l] += mn[l] * o->xsum[at];
            }
        }
        for (unsigned bits = mask2 ? mask2[g] : 0u; bits; bits &= bits - 1) {
            const int r = __builtin_ctz(bits);
            const int64_t at = SOFF(r0 + r, g);
            for (int l = 0; l < TILE; l++) {
                res[r][l] += (float)q4_dot_scalar(blk, hb, l, QX2(o, r0 + r, g)) * (d[l] * o->xs2[at]);
                res[r][l] += mn[l] * o->xsum2[at];
            }
        }
    }
    if (mask2)
        for (int r = 0; r < mb; r++)
            for (int l = 0; l < TILE; l++) acc[r][l] += res[r][l];
}

QG_INLINE int32_t q8_dot_scalar(const int8_t *codes, int l, int c0, int c1, const int8_t *xr) {
    int32_t dot = 0;
    for (int c = c0; c < c1; c++)
        for (int b = 0; b < 4; b++) dot += (int32_t)codes[c * 64 + l * 4 + b] * xr[4 * c + b];
    return dot;
}

__attribute__((unused)) static void q8_tile_scalar(const uint8_t *wt, int64_t groups, int sub,
                                                   const QRows *o, int64_t r0, int64_t k,
                                                   const uint8_t *mask2, int mb,
                                                   float acc[][TILE]) {
    const int64_t block = Q8_CODES + sub * 128;
    const int chunks = 8 / sub;
    float res[MB_ROWS][TILE];
    for (int r = 0; r < mb; r++)
        for (int l = 0; l < TILE; l++) acc[r][l] = res[r][l] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * block;
        const int8_t *codes = (const int8_t *)blk;
        for (int s = 0; s < sub; s++) {
            const float *d = (const float *)(blk + Q8_CODES + sub * 64 + s * 64);
            const int c0 = s * chunks, c1 = (s + 1) * chunks;
            for (int r = 0; r < mb; r++) {
                const float sx = o->xs[SOFF(r0 + r, g)];
                for (int l = 0; l < TILE; l++)
                    acc[r][l] +=
                        (float)q8_dot_scalar(codes, l, c0, c1, QX(o, r0 + r, g)) * (d[l] * sx);
            }
            for (unsigned bits = mask2 ? mask2[g] : 0u; bits; bits &= bits - 1) {
                const int r = __builtin_ctz(bits);
                const float sx = o->xs2[SOFF(r0 + r, g)];
                for (int l = 0; l < TILE; l++)
                    res[r][l] +=
                        (float)q8_dot_scalar(codes, l, c0, c1, QX2(o, r0 + r, g)) * (d[l] * sx);
            }
        }
    }
    if (mask2)
        for (int r = 0; r < mb; r++)
            for (int l = 0; l < TILE; l++) acc[r][l] += res[r][l];
}

#include "qgemm_avx2.c" /* the AVX2 path (build.py inlines it) */

/* ---------------------------------------------------------- AVX512-VNNI */
#if defined(QG_VNNI)

/* codes | (bit c of each byte of hv) << 4: the fifth bit of chunk c's codes (5-bit
 * block). Within a 16-bit lane the shift brings each byte's own bit c to bit 4. */
QG_INLINE __m512i or_bit4(__m512i codes, __m512i hv, int c) {
    const __m512i b4 = _mm512_set1_epi8(0x10);
    const __m512i s = c <= 4 ? _mm512_slli_epi16(hv, 4 - c) : _mm512_srli_epi16(hv, c - 4);
    return _mm512_ternarylogic_epi32(codes, s, b4, 0xF8); /* codes | (s & b4) */
}

/* One 4-bit (HB: 5-bit) group (packed at blk) x one row, for the residual rows (two
 * chains: latency). */
QG_INLINE __m512i q4_dot_vnni(const uint8_t *blk, const int HB, const int8_t *xr) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i hv = HB ? _mm512_loadu_si512((const void *)(blk + Q4_BLOCK)) : low4;
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i p = _mm512_loadu_si512((const void *)(blk + c * 64));
        __m512i lo = _mm512_and_si512(p, low4), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
        if (HB) {
            lo = or_bit4(lo, hv, c);
            hi = or_bit4(hi, hv, c + 4);
        }
        i0 = _mm512_dpbusd_epi32(i0, lo, _mm512_set1_epi32(ld32(xr + 4 * c)));
        i1 = _mm512_dpbusd_epi32(i1, hi, _mm512_set1_epi32(ld32(xr + 4 * c + 16)));
    }
    return _mm512_add_epi32(i0, i1);
}

/* The same from a group already unpacked into w[8] (chunk c: inputs 4c..4c+3). */
QG_INLINE __m512i q4_dot_regs(const __m512i *w, const int8_t *xr) {
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
        i0 = _mm512_dpbusd_epi32(i0, w[c], _mm512_set1_epi32(ld32(xr + 4 * c)));
        i1 = _mm512_dpbusd_epi32(i1, w[c + 1], _mm512_set1_epi32(ld32(xr + 4 * c + 4)));
    }
    return _mm512_add_epi32(i0, i1);
}

/* Weights stream from memory once per chunk of rows: while the first row block
 * works on one tile, the kernels ask for the next tile (pf) a group at a time, so
 * that it is in L1 when its turn comes (the hardware prefetcher alone leaves
 * every call waiting for memory at each tile's first block: the Q8_0 head at
 * 1-32 rows went 1.3-1.9x faster with this). */
QG_INLINE void prefetch_block(const uint8_t *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

QG_INLINE void q4_tile_vnni(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                            int64_t k, const uint8_t *mask2, const int MB, const int HB,
                            float acc[][TILE], const uint8_t *pf) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t block = HB ? Q5_BLOCK : Q4_BLOCK;
    __m512 a[MB_ROWS], a2[2];
    float res[MB_ROWS][TILE] __attribute__((aligned(64)));
    for (int r = 0; r < MB; r++) {
        a[r] = _mm512_setzero_ps();
        if (MB <= 2) a2[r] = _mm512_setzero_ps();
        else if (mask2) _mm512_store_ps(res[r], _mm512_setzero_ps());
    }
    /* r0 is a multiple of MB_ROWS: the block's codes and scales start here */
    const int8_t *xb = o->q + r0 * k;
    const float *xs = o->xs + r0 * groups, *xsum = o->xsum + r0 * groups;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * block;
        const int8_t *xg = xb + g * (o->bw * GROUP);
        prefetch_block(pf + g * block, block);
        const __m512i hv = HB ? _mm512_loadu_si512((const void *)(blk + Q4_BLOCK)) : low4;
        /* All MB rows' chains side by side (they hide each other's latency);
         * each 64-byte code vector is unpacked into its two nibble vectors
         * just before use, so that only two of them are live. */
        __m512i i[MB_ROWS], w[8];
        if (MB <= 2) {
            /* few rows (decode): unpack the group once into 8 vectors, which the
             * residual rows reuse; two chains per row, or vpdpbusd's latency binds */
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_loadu_si512((const void *)(blk + c * 64));
                w[c] = _mm512_and_si512(p, low4);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
            }
            if (HB)
                for (int c = 0; c < 8; c++) w[c] = or_bit4(w[c], hv, c);
            for (int r = 0; r < MB; r++) i[r] = q4_dot_regs(w, xg + r * GROUP);
        } else {
            for (int r = 0; r < MB; r++) i[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_loadu_si512((const void *)(blk + c * 64));
                __m512i lo = _mm512_and_si512(p, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
                if (HB) {
                    lo = or_bit4(lo, hv, c);
                    hi = or_bit4(hi, hv, c + 4);
                }
                for (int r = 0; r < MB; r++) {
                    i[r] = _mm512_dpbusd_epi32(i[r], lo,
                                               _mm512_set1_epi32(ld32(xg + r * GROUP + 4 * c)));
                    i[r] = _mm512_dpbusd_epi32(i[r], hi,
                                               _mm512_set1_epi32(ld32(xg + r * GROUP + 4 * c + 16)));
                }
            }
        }
        const __m512 d = _mm512_loadu_ps((const float *)(blk + 256));
        const __m512 mn = _mm512_loadu_ps((const float *)(blk + 320));
        const float *sx = xs + g * o->bw, *sm = xsum + g * o->bw;
        for (int r = 0; r < MB; r++) {
            const __m512 f = _mm512_cvtepi32_ps(i[r]);
            a[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(sx[r])), a[r]);
            a[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sm[r]), a[r]);
        }
        const unsigned bits = mask2 ? mask2[g] : 0u;
        if (MB <= 2) {
            /* few rows: the residual sums stay in registers */
            for (int r = 0; r < MB; r++) {
                if (!(bits >> r & 1u)) continue;
                const int64_t at = SOFF(r0 + r, g);
                const __m512 f = _mm512_cvtepi32_ps(q4_dot_regs(w, QX2(o, r0 + r, g)));
                a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs2[at])), a2[r]);
                a2[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum2[at]), a2[r]);
            }
            continue;
        }
        for (unsigned left = bits; left; left &= left - 1) {
            const int r = __builtin_ctz(left);
            const int64_t at = SOFF(r0 + r, g);
            const __m512 f = _mm512_cvtepi32_ps(q4_dot_vnni(blk, HB, QX2(o, r0 + r, g)));
            __m512 v = _mm512_load_ps(res[r]);
            v = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs2[at])), v);
            v = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum2[at]), v);
            _mm512_store_ps(res[r], v);
        }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], MB <= 2 ? a2[r] : _mm512_load_ps(res[r]));
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

/* Chunks c0..c1 of an 8-bit group (codes at blk) x one (flipped, unsigned) row, from corr. */
QG_INLINE __m512 q8_dot_vnni(const uint8_t *blk, __m512i corr, int c0, int c1,
                             const int8_t *xr) {
    __m512i i0 = corr, i1 = _mm512_setzero_si512();
    for (int c = c0; c < c1; c += 2) {
        i0 = _mm512_dpbusd_epi32(i0, _mm512_set1_epi32(ld32(xr + 4 * c)),
                                 _mm512_loadu_si512((const void *)(blk + c * 64)));
        i1 = _mm512_dpbusd_epi32(i1, _mm512_set1_epi32(ld32(xr + 4 * c + 4)),
                                 _mm512_loadu_si512((const void *)(blk + c * 64 + 64)));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
}

/* The same from codes already in registers. */
QG_INLINE __m512 q8_dot_regs(const __m512i *w, __m512i corr, int c0, int c1, const int8_t *xr) {
    __m512i i0 = corr, i1 = _mm512_setzero_si512();
    for (int c = c0; c < c1; c += 2) {
        i0 = _mm512_dpbusd_epi32(i0, _mm512_set1_epi32(ld32(xr + 4 * c)), w[c]);
        i1 = _mm512_dpbusd_epi32(i1, _mm512_set1_epi32(ld32(xr + 4 * c + 4)), w[c + 1]);
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
}

QG_INLINE void q8_tile_vnni(const uint8_t *wt, int64_t groups, const int sub, const QRows *o,
                            int64_t r0, int64_t k, const uint8_t *mask2, const int MB,
                            float acc[][TILE], const uint8_t *pf) {
    const int64_t block = Q8_CODES + sub * 128;
    const int chunks = 8 / sub;
    __m512 a[MB_ROWS], a2[2];
    float res[MB_ROWS][TILE] __attribute__((aligned(64)));
    for (int r = 0; r < MB; r++) {
        a[r] = _mm512_setzero_ps();
        if (MB <= 2) a2[r] = _mm512_setzero_ps();
        else if (mask2) _mm512_store_ps(res[r], _mm512_setzero_ps());
    }
    const int8_t *xb = o->q + r0 * k;
    const float *xs = o->xs + r0 * groups;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * block;
        prefetch_block(pf + g * block, block);
        __m512i w8[8]; /* few rows: the group's codes, loaded once (the residual reuses them) */
        const int8_t *xg = xb + g * (o->bw * GROUP);
        for (int s = 0; s < sub; s++) {
            const __m512i corr = _mm512_loadu_si512((const void *)(blk + Q8_CODES + s * 64));
            const int c0 = s * chunks, c1 = (s + 1) * chunks;
            __m512i i[MB_ROWS], j[MB_ROWS];
            for (int r = 0; r < MB; r++) {
                i[r] = corr;
                j[r] = _mm512_setzero_si512();
            }
            if (MB <= 2 && s == 0)
                for (int c = 0; c < 8; c++) w8[c] = _mm512_loadu_si512((const void *)(blk + c * 64));
            for (int c = c0; c < c1; c++) {
                const __m512i w = MB <= 2 ? w8[c] : _mm512_loadu_si512((const void *)(blk + c * 64));
                for (int r = 0; r < MB; r++) {
                    const __m512i xc = _mm512_set1_epi32(ld32(xg + r * GROUP + 4 * c));
                    /* few rows: odd chunks in a second chain (vpdpbusd's latency) */
                    if (MB <= 2 && (c & 1)) j[r] = _mm512_dpbusd_epi32(j[r], xc, w);
                    else i[r] = _mm512_dpbusd_epi32(i[r], xc, w);
                }
            }
            if (MB <= 2)
                for (int r = 0; r < MB; r++) i[r] = _mm512_add_epi32(i[r], j[r]);
            const __m512 d = _mm512_loadu_ps((const float *)(blk + Q8_CODES + sub * 64 + s * 64));
            const float *sx = xs + g * o->bw;
            for (int r = 0; r < MB; r++)
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[r]),
                                       _mm512_mul_ps(d, _mm512_set1_ps(sx[r])), a[r]);
            const unsigned bits = mask2 ? mask2[g] : 0u;
            if (MB <= 2) {
                for (int r = 0; r < MB; r++) {
                    if (!(bits >> r & 1u)) continue;
                    const __m512 sx2 = _mm512_set1_ps(o->xs2[SOFF(r0 + r, g)]);
                    const __m512 f = q8_dot_regs(w8, corr, c0, c1, QX2(o, r0 + r, g));
                    a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx2), a2[r]);
                }
                continue;
            }
            for (unsigned left = bits; left; left &= left - 1) {
                const int r = __builtin_ctz(left);
                const __m512 sx2 = _mm512_set1_ps(o->xs2[SOFF(r0 + r, g)]);
                const __m512 f = q8_dot_vnni(blk, corr, c0, c1, QX2(o, r0 + r, g));
                __m512 v = _mm512_load_ps(res[r]);
                _mm512_store_ps(res[r], _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx2), v));
            }
        }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], MB <= 2 ? a2[r] : _mm512_load_ps(res[r]));
        _mm512_storeu_ps(acc[r], a[r]);
    }
}
#endif

#include "qgemm_native.c" /* GGUF's own layouts: Q4_K, Q6_K, Q4_0 (build.py inlines it) */

/* --------------------------------------------------------------- drivers */

#if defined(QG_VNNI)
#define Q4_TILE(MBV) q4_tile_vnni(wt, groups, o, r0, k, mask2, MBV, 0, acc, pf)
#define Q5_TILE(MBV) q4_tile_vnni(wt, groups, o, r0, k, mask2, MBV, 1, acc, pf)
#define Q8_TILE(MBV, SUB) q8_tile_vnni(wt, groups, SUB, o, r0, k, mask2, MBV, acc, pf)
#elif defined(QG_AVX2)
#define Q4_TILE(MBV) q4_tile_avx2(wt, groups, o, r0, k, mask2, MBV, 0, acc)
#define Q5_TILE(MBV) q4_tile_avx2(wt, groups, o, r0, k, mask2, MBV, 1, acc)
#define Q8_TILE(MBV, SUB) q8_tile_avx2(wt, groups, SUB, o, r0, k, mask2, MBV, acc)
#else
#define Q4_TILE(MBV) q4_tile_scalar(wt, groups, o, r0, k, mask2, MBV, 0, acc)
#define Q5_TILE(MBV) q4_tile_scalar(wt, groups, o, r0, k, mask2, MBV, 1, acc)
#define Q8_TILE(MBV, SUB) q8_tile_scalar(wt, groups, SUB, o, r0, k, mask2, MBV, acc)
#endif

/* One call per (tile, block of mb rows), mb (and SUB) a constant in each case
 * so that the inlined tile kernel is unrolled and keeps its vectors in
 * registers. Blocks hold MB_ROWS rows but the call's last. */
#if MB_ROWS == 8
#define MB_CASES(T) \
    case 8: T(8); break; case 7: T(7); break; case 6: T(6); break; case 5: T(5); break; \
    case 4: T(4); break; case 3: T(3); break; case 2: T(2); break; default: T(1); break;
#else
#define MB_CASES(T) \
    case 4: T(4); break; case 3: T(3); break; case 2: T(2); break; default: T(1); break;
#endif
#define Q8_SUB1(MBV) Q8_TILE(MBV, 1)
#define Q8_SUB2(MBV) Q8_TILE(MBV, 2)

/* hb: 5-bit blocks (Q5_BLOCK, a separate instance of each kernel: the 4-bit ones
 * keep their code) */
static void q4_tile_rows(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                         int64_t k, const uint8_t *mask2, int mb, int hb, float acc[][TILE],
                         const uint8_t *pf) {
    (void)pf; /* used by the VNNI kernels only */
    if (hb) {
        switch (mb) { MB_CASES(Q5_TILE) }
    } else {
        switch (mb) { MB_CASES(Q4_TILE) }
    }
}

static void q8_tile_rows(const uint8_t *wt, int64_t groups, int sub, const QRows *o, int64_t r0,
                         int64_t k, const uint8_t *mask2, int mb, float acc[][TILE],
                         const uint8_t *pf) {
    (void)pf;
    if (sub == 2) {
        switch (mb) { MB_CASES(Q8_SUB2) }
    } else {
        switch (mb) { MB_CASES(Q8_SUB1) }
    }
}

/* ------------------------------------------------------------ threads
 *
 * A call runs as tasks on the pool that pool.py's CpuPool attached (no pool: the
 * same tasks in a loop on the calling thread). Two kinds, one pool run each:
 * quantising blocks of MB_ROWS activation rows (prefill; a block's rows share
 * their mask2 byte, so a block is one task), then runs of whole weight tiles for
 * all the chunk's rows. Each output element is made by exactly one tile call,
 * with the same operations in the same order whoever runs it: the result bits
 * do not depend on the thread count (tests/test_cpu_threads.py). */
typedef int (*pool_task_fn)(void *ctx, int64_t task);
typedef int (*pool_run_fn)(void *pool, int64_t ntasks, pool_task_fn fn, void *ctx);

static pool_run_fn qg_run = NULL; /* set once by the engine, before any kernel call */
static void *qg_pool = NULL;
static int64_t qg_threads = 1;

void paged_qgemm_use_pool(void *run, void *pool, int threads) {
    qg_run = (pool_run_fn)run;
    qg_pool = run ? pool : NULL;
    qg_threads = run && threads > 1 ? threads : 1;
}

/* Work below this (weight bytes x row blocks) runs on the calling thread: a run's
 * hand-off and wait cost more than its share (SmolLM2-135M's 576 x 576 projections
 * are ~250 KB; a 1-2B model's smallest is several MB). */
enum { QG_PARALLEL_MIN = 256 * 1024 };

static int qg_parallel(int64_t ntasks, pool_task_fn fn, void *ctx, int64_t work) {
    if (qg_run != NULL && ntasks > 1 && work >= QG_PARALLEL_MIN)
        return qg_run(qg_pool, ntasks, fn, ctx);
    int error = 0;
    for (int64_t t = 0; t < ntasks; t++) {
        const int rc = fn(ctx, t);
        if (rc != 0 && error == 0) error = rc;
    }
    return error;
}

typedef struct {
    int fmt, sub, levels, x_bf16, y_bf16, flip;
    int direct; /* a native format read directly (VNNI, few rows), else expanded per tile */
    int32_t *bias; /* direct Q6_K / Q8_0: each 16 activation codes' sum (x_sums16) */
    float ratio;
    const uint8_t *w;
    int64_t n, k, groups, tiles, tile_bytes, per_task, y_stride, x_stride, m0, mc;
    const void *xc;
    void *y;
    const QRows *o;
} QCall;

/* Rows MB_ROWS * task .. of the chunk quantised into their block of o (see QOFF:
 * a block of MB_ROWS rows is a contiguous run of every array). */
static int quantize_task(void *ctx, int64_t task) {
    const QCall *c = (const QCall *)ctx;
    const QRows *o = c->o;
    const int64_t r0 = task * MB_ROWS, rows = c->mc - r0 < MB_ROWS ? c->mc - r0 : MB_ROWS;
    const int64_t b = task;
    QRows part = *o;
    part.q = o->q + b * (o->bw * c->k);
    part.q2 = o->q2 ? o->q2 + b * (o->bw * c->k) : NULL;
    part.xs = o->xs + b * (o->bw * c->groups);
    part.xsum = o->xsum + b * (o->bw * c->groups);
    part.xs2 = o->xs2 ? o->xs2 + b * (o->bw * c->groups) : NULL;
    part.xsum2 = o->xsum2 ? o->xsum2 + b * (o->bw * c->groups) : NULL;
    part.mask2 = o->mask2 ? o->mask2 + b * c->groups : NULL;
    const void *x = c->x_bf16 ? (const void *)((const uint16_t *)c->xc + r0 * c->x_stride)
                              : (const void *)((const float *)c->xc + r0 * c->x_stride);
    quantize_chunk(x, c->x_bf16, rows, c->k, c->x_stride, c->levels, c->ratio, c->flip, &part);
    return 0;
}

/* Weight tiles per_task * task .. for every row of the chunk. */
static int tiles_task(void *ctx, int64_t task) {
    const QCall *c = (const QCall *)ctx;
    const QRows *o = c->o;
    float acc[MB_ROWS][TILE];
    const int64_t t0 = task * c->per_task;
    const int64_t t1 = t0 + c->per_task < c->tiles ? t0 + c->per_task : c->tiles;
    const int native = c->fmt != FMT_Q4 && c->fmt != FMT_Q8;
    /* an expanded native tile is qgemm.c's 4-bit block (Q5_K: 5-bit), or its 8-bit one */
    const int eight = c->fmt == FMT_Q6K || c->fmt == FMT_Q80;
    const int run_fmt = native ? (eight ? FMT_Q8 : FMT_Q4) : c->fmt;
    const int run_sub = native ? (c->fmt == FMT_Q6K ? 2 : 1) : c->sub;
    uint8_t *expanded = NULL;
    if (native && !c->direct) {
        expanded = expand_buffer((size_t)(c->groups * Q8_SUB2_BLOCK));
        if (expanded == NULL) return -2;
    }
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = c->w + t * c->tile_bytes;
        const int64_t n0 = t * TILE, count = c->n - n0 < TILE ? c->n - n0 : TILE;
        if (expanded != NULL) {
            expand_tile_vnni(c->fmt, wt, c->groups, expanded);
            wt = expanded;
        }
        for (int64_t r0 = 0; r0 < c->mc; r0 += MB_ROWS) {
            const int mb = (int)(c->mc - r0 < MB_ROWS ? c->mc - r0 : MB_ROWS);
            const uint8_t *mask2 = c->levels == 2 ? o->mask2 + (r0 / MB_ROWS) * c->groups : NULL;
            /* the next tile during the first block (see prefetch_block), else
             * this one (in L1: a no-op; a prefetch under a branch cost the 4-bit
             * kernel 15% at many rows, code generation) */
            const uint8_t *pf = r0 == 0 && t + 1 < t1 && expanded == NULL ? wt + c->tile_bytes : wt;
            if (c->direct)
                native_tile_rows(c->fmt, wt, c->groups, o, r0, mask2, mb, acc, pf, c->bias);
            else if (run_fmt == FMT_Q4)
                q4_tile_rows(wt, c->groups, o, r0, c->k, mask2, mb, c->fmt == FMT_Q5K, acc, pf);
            else
                q8_tile_rows(wt, c->groups, run_sub, o, r0, c->k, mask2, mb, acc, pf);
            for (int r = 0; r < mb; r++)
                store_row(acc[r], c->y, c->y_bf16, c->y_stride, c->m0 + r0 + r, n0, count);
        }
    }
    return 0;
}

/* Tiles per task: about 64 KiB of weights times the row blocks, so that a task
 * outweighs taking it, yet at least 4 tasks a thread where the tiles allow (a
 * stalled core then holds back a small share). */
static int64_t tiles_per_task(int64_t tiles, int64_t tile_bytes, int64_t row_blocks) {
    int64_t per = 65536 / (tile_bytes * row_blocks);
    const int64_t spread = tiles / (4 * qg_threads);
    if (per > spread) per = spread;
    return per < 1 ? 1 : per;
}

/* fmt 4: 4-bit blocks; fmt 8: 8-bit blocks with `sub` scales per 32 (1 or 2);
 * levels 1 (int8 activations) or 2 (int8 + int8 residual for the groups with
 * amax > ratio * mean |x|; ratio 0: every group; see quantize_rows).
 * Returns 0, or -1 (bad shape/argument), -2 (out of memory). */
static int qgemm(int fmt, const uint8_t *w, int64_t n, int64_t k, int sub, int levels,
                 float ratio, const void *x, int64_t m, int64_t x_stride, int x_bf16, void *y,
                 int64_t y_stride, int y_bf16) {
    if (n <= 0 || k <= 0 || k % GROUP != 0 || m < 0 || x_stride < k || y_stride < n) return -1;
    if ((fmt == 8 && sub != 1 && sub != 2) || (levels != 1 && levels != 2)) return -1;
    if ((fmt == FMT_Q4K || fmt == FMT_Q5K || fmt == FMT_Q6K) && k % SB_INPUTS != 0) return -1;
    if (m == 0) return 0;
    const int64_t groups = k / GROUP;
    const int64_t tiles = (n + TILE - 1) / TILE;
    const int64_t tile_bytes = fmt == FMT_Q4   ? groups * Q4_BLOCK
                               : fmt == FMT_Q8 ? groups * (Q8_CODES + sub * 128)
                                               : native_tile_bytes(fmt, groups);
    /* native tiles: read directly by the VNNI kernels at decode's few rows */
    const int direct = fmt != FMT_Q4 && fmt != FMT_Q8 && m <= QG_DIRECT_ROWS;
    const int64_t chunk = M_CHUNK / levels;    /* input rows per pass (a multiple of MB_ROWS) */
    const int64_t rows = m < chunk ? m : chunk;
    const int64_t blocks = (rows + MB_ROWS - 1) / MB_ROWS;
    const int64_t slots = blocks * MB_ROWS; /* rows of the interleaved layout (QOFF) */
    const size_t qbytes = (size_t)(((slots * k + 63) / 64) * 64);
    const size_t fbytes = (size_t)(slots * groups) * sizeof(float);
    const size_t mbytes = levels == 2 ? (size_t)(blocks * groups) : 0;
    const int unsigned_w = fmt == FMT_Q6K || fmt == FMT_Q80; /* weights as u8 + bias */
    const size_t bbytes = direct && unsigned_w ? (size_t)(4 * 2 * groups) * 4 : 0;
    const size_t boff = (qbytes * levels + fbytes * 2 * levels + mbytes + 63) / 64 * 64;
    uint8_t *buf = (uint8_t *)scratch(boff + bbytes + 64);
    if (buf == NULL) return -2;
    QRows o;
    o.bw = rows < MB_ROWS ? rows : MB_ROWS;
    o.q = (int8_t *)buf;
    o.q2 = levels == 2 ? (int8_t *)(buf + qbytes) : NULL;
    o.xs = (float *)(buf + qbytes * levels);
    o.xsum = o.xs + slots * groups;
    o.xs2 = levels == 2 ? o.xsum + slots * groups : NULL;
    o.xsum2 = levels == 2 ? o.xs2 + slots * groups : NULL;
    o.mask2 = levels == 2 ? buf + qbytes * levels + fbytes * 2 * levels : NULL;
#if defined(QG_VNNI)
    /* the 8-bit VNNI tiles take unsigned activations (Q6_K's direct kernel: signed) */
    const int flip = fmt == FMT_Q8 || (unsigned_w && !direct);
#else
    const int flip = 0;
#endif
    int32_t *bias = bbytes ? (int32_t *)(buf + boff) : NULL;
    QCall c = {fmt, sub, levels, x_bf16, y_bf16, flip, direct, bias, ratio, w, n, k, groups, tiles,
               tile_bytes, 1, y_stride, x_stride, 0, 0, NULL, y, &o};
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
        c.m0 = m0;
        c.mc = mc;
        c.xc = x_bf16 ? (const void *)((const uint16_t *)x + m0 * x_stride)
                      : (const void *)((const float *)x + m0 * x_stride);
        if (levels == 2) memset(o.mask2, 0, mbytes);
        const int64_t row_blocks = (mc + MB_ROWS - 1) / MB_ROWS;
        /* quantising reads the rows once: its work is the activations' bytes */
        int rc = qg_parallel(row_blocks, quantize_task, &c, mc * k * 4);
        if (rc != 0) return rc;
        if (bias != NULL) x_sums16(&o, mc, groups, levels, bias);
        c.per_task = tiles_per_task(tiles, tile_bytes, row_blocks);
        rc = qg_parallel((tiles + c.per_task - 1) / c.per_task, tiles_task, &c,
                         tiles * tile_bytes * row_blocks);
        if (rc != 0) return rc;
    }
    return 0;
}

int paged_qgemm_q4(const uint8_t *w, int64_t n, int64_t k, int levels, float ratio,
                   const void *x, int64_t m, int64_t x_stride, int x_bf16, void *y,
                   int64_t y_stride, int y_bf16) {
    return qgemm(4, w, n, k, 1, levels, ratio, x, m, x_stride, x_bf16, y, y_stride, y_bf16);
}

int paged_qgemm_q8(const uint8_t *w, int64_t n, int64_t k, int sub, int levels, float ratio,
                   const void *x, int64_t m, int64_t x_stride, int x_bf16, void *y,
                   int64_t y_stride, int y_bf16) {
    return qgemm(8, w, n, k, sub, levels, ratio, x, m, x_stride, x_bf16, y, y_stride, y_bf16);
}

/* fmt FMT_Q4K, FMT_Q5K, FMT_Q6K (k a multiple of 256), FMT_Q40, FMT_Q41 or FMT_Q80: see
 * qgemm_native.c. */
int paged_qgemm_native(int fmt, const uint8_t *w, int64_t n, int64_t k, int levels, float ratio,
                       const void *x, int64_t m, int64_t x_stride, int x_bf16, void *y,
                       int64_t y_stride, int y_bf16) {
    if (!native_fmt(fmt)) return -1;
    return qgemm(fmt, w, n, k, 1, levels, ratio, x, m, x_stride, x_bf16, y, y_stride, y_bf16);
}

#include "qgemm_repack.c" /* GGUF blocks -> native tiles, rows back out (build.py inlines it) */
