/* GGUF's own bytes in qgemm.c's tiles (inlined into qgemm.c by cpu_kernels/build.py:
 * one translation unit; the packing is cpu_kernels/packing_native.py).
 *
 * The packed formats of qgemm.c keep float32 scales per 16 rows x 32 inputs (4-bit:
 * 6 bits a weight) and widen 6-bit codes to int8 (12 bits a weight). These keep
 * the checkpoint's byte count, in the same tiles of 16 output rows so that one
 * 64-byte load still holds 4 inputs of 16 rows (vpdpbusd's shape):
 *
 *   FMT_Q4K (GGUF Q4_K, 4.5 bits a weight), per tile and super-block of 256 inputs,
 *   Q4K_SB = 2304 bytes:
 *       8 x 256 B  codes of groups 0..7, each exactly qgemm.c's 4-bit code block
 *       32 B  d[16] f16    32 B  dm[16] f16             (per row: w = d sc q + dm m)
 *       64 B  sc low nibbles: byte (j * 16 + l) = sc[j][l] & 15 | (sc[j + 4][l] & 15) << 4
 *       64 B  m low nibbles, the same
 *       32 B  sc high bits: byte (v * 16 + l), bits 2i..2i+1 = sc[4v + i][l] >> 4
 *       32 B  m high bits, the same                    (sc, m: 6 bits, 0..63)
 *     GGUF stores d, dmin = -dm and the same 6-bit sc / m (12 bytes a row); this is
 *     that, interleaved across the 16 rows so that a group's 16 scales are one
 *     16-byte load. d sc and dm m are exact in float32 (11 + 6 bits): the same
 *     float32 values as the expanded 4-bit block, so the same results, bit for bit.
 *   FMT_Q5K (GGUF Q5_K, 5.5 bits a weight), per tile and super-block, Q5K_SB = 2816 bytes:
 *       8 x (256 B low 4 bits of q, Q4_K's code block; 64 B high bits: bit c of byte
 *            (l * 4 + b) = q[row l][4c + b] >> 4, q in 0..31)
 *       256 B the header of Q4_K, the same bytes             w = d sc q + dm m
 *     GGUF's block_q5_K is d, dmin, the same 12 scale bytes, qh[32], qs[128] (176
 *     bytes a 256): the same count. It expands into qgemm.c's 5-bit block (the
 *     4-bit block + the high-bit plane, Q5_BLOCK), which the 4-bit kernels run
 *     with HB = 1: the same float32 operations as Q4_K on codes 0..31.
 *   FMT_Q6K (GGUF Q6_K, 6.5625 bits), per tile and super-block, Q6K_SB = 3360 bytes:
 *       8 x (256 B low nibbles of q (q = code + 32, 0..63), in the 4-bit code block
 *            order; 128 B high bits: byte (v * 64 + l * 4 + b), bits 2i..2i+1 =
 *            q[row l][4 (4v + i) + b] >> 4)
 *       256 B sc[8 groups][2 halves][16 rows] int8     32 B d[16] f16
 *                                                      w = d sc (q - 32) per 16 inputs
 *   FMT_Q40 (GGUF Q4_0, 4.5 bits), per tile and group of 32, Q40_BLOCK = 288 bytes:
 *       256 B codes (4-bit code block), 32 B d[16] f16     w = d q - 8 d
 *   FMT_Q41 (GGUF Q4_1, 5 bits), Q41_BLOCK = 320 bytes: the same, then 32 B m[16] f16
 *                                                      w = d q + m
 *   FMT_Q80 (GGUF Q8_0, 8.5 bits; 10 in qgemm.c's block, which adds a 64 B int32
 *       correction), Q80_BLOCK = 544 bytes: 512 B codes q ^ 0x80 (unsigned: vpdpbusd's
 *       first operand) in the 8-bit code block order, 32 B d[16] f16     w = d q
 *
 * Kernels: on the VNNI path, calls of at most 2 rows (decode) read these bytes
 * directly: the scales are decoded in registers, each weight byte read once.
 * Everything else (more rows, the AVX2 and scalar paths) expands each tile once
 * into qgemm.c's float32-scale block of the same values (expand_tile) and runs
 * the tile kernels above on it: with many rows the expansion is a small share,
 * and below VNNI the fallbacks stay the tested ones. The direct kernels do the
 * float32 operations of those kernels in the same order on the same values, so a
 * row's result does not depend on which path, batch or thread computed it.
 */

#define SB_INPUTS 256
#define SB_GROUPS 8
#define Q4K_SB (SB_GROUPS * 256 + 256)
#define Q5K_GROUP (256 + 64)
#define Q5K_SB (SB_GROUPS * Q5K_GROUP + 256)
#define Q6K_GROUP (256 + 128)
#define Q6K_SB (SB_GROUPS * Q6K_GROUP + 256 + 32)
#define Q40_BLOCK (256 + 32)
#define Q41_BLOCK (256 + 64)
#define Q80_BLOCK (Q8_CODES + 32)
#define Q8_SUB2_BLOCK (Q8_CODES + 2 * 128)
#define Q8_SUB1_BLOCK (Q8_CODES + 128)

enum {
    FMT_Q4 = 4, FMT_Q4K = 5, FMT_Q6K = 6, FMT_Q40 = 7, FMT_Q8 = 8, FMT_Q80 = 9, FMT_Q41 = 10,
    FMT_Q5K = 11
};

QG_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

QG_INLINE uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Group j's 6-bit value of row l from the nibble plane lo and the 2-bit plane hi. */
QG_INLINE int six_bit(const uint8_t *lo, const uint8_t *hi, int j, int l) {
    const int low = (lo[(j & 3) * 16 + l] >> (4 * (j >> 2))) & 15;
    return low | ((hi[(j >> 2) * 16 + l] >> (2 * (j & 3))) & 3) << 4;
}

/* Weight bytes of one tile (16 rows, `groups` groups of 32 inputs). */
static int64_t native_tile_bytes(int fmt, int64_t groups) {
    if (fmt == FMT_Q4K) return groups / SB_GROUPS * Q4K_SB;
    if (fmt == FMT_Q5K) return groups / SB_GROUPS * Q5K_SB;
    if (fmt == FMT_Q6K) return groups / SB_GROUPS * Q6K_SB;
    if (fmt == FMT_Q80) return groups * Q80_BLOCK;
    if (fmt == FMT_Q41) return groups * Q41_BLOCK;
    return groups * Q40_BLOCK;
}

/* qgemm.c's blocks (fmt 4; Q5_K: its 5-bit block; fmt 8 with 2 scales per 32 for Q6_K, 1
 * for Q8_0) holding one native tile's values: out holds groups * expanded_group_bytes. */
static void expand_tile(int fmt, const uint8_t *wt, int64_t groups, uint8_t *out) {
    for (int64_t g = 0; g < groups; g++) {
        const int64_t sb = g / SB_GROUPS;
        const int j = (int)(g % SB_GROUPS);
        if (fmt == FMT_Q40 || fmt == FMT_Q41) {
            const uint8_t *blk = wt + g * (fmt == FMT_Q40 ? Q40_BLOCK : Q41_BLOCK);
            uint8_t *o = out + g * Q4_BLOCK;
            float d[TILE], mn[TILE];
            for (int l = 0; l < TILE; l++) {
                d[l] = f16_to_f32(ld16(blk + 256 + 2 * l));
                mn[l] = fmt == FMT_Q40 ? d[l] * -8.0f : f16_to_f32(ld16(blk + 288 + 2 * l));
            }
            memcpy(o, blk, 256);
            memcpy(o + 256, d, 64);
            memcpy(o + 320, mn, 64);
        } else if (fmt == FMT_Q80) {
            const uint8_t *blk = wt + g * Q80_BLOCK;
            uint8_t *o = out + g * Q8_SUB1_BLOCK;
            int32_t corr[TILE] = {0};
            float d[TILE];
            for (int c = 0; c < 8; c++)
                for (int at = 0; at < 64; at++) {
                    const int8_t q = (int8_t)(blk[c * 64 + at] ^ 0x80);
                    o[c * 64 + at] = (uint8_t)q;
                    corr[at / 4] += -128 * q;
                }
            for (int l = 0; l < TILE; l++) d[l] = f16_to_f32(ld16(blk + Q8_CODES + 2 * l));
            memcpy(o + Q8_CODES, corr, sizeof corr);
            memcpy(o + Q8_CODES + 64, d, sizeof d);
        } else if (fmt == FMT_Q4K || fmt == FMT_Q5K) {
            const int five = fmt == FMT_Q5K;
            const int64_t gbytes = five ? Q5K_GROUP : 256;
            const uint8_t *s = wt + sb * (five ? Q5K_SB : Q4K_SB), *h = s + SB_GROUPS * gbytes;
            uint8_t *o = out + g * (five ? Q5_BLOCK : Q4_BLOCK);
            float d[TILE], mn[TILE];
            for (int l = 0; l < TILE; l++) {
                d[l] = f16_to_f32(ld16(h + 2 * l)) * (float)six_bit(h + 64, h + 192, j, l);
                mn[l] = f16_to_f32(ld16(h + 32 + 2 * l)) * (float)six_bit(h + 128, h + 224, j, l);
            }
            memcpy(o, s + j * gbytes, 256);
            memcpy(o + 256, d, 64);
            memcpy(o + 320, mn, 64);
            if (five) memcpy(o + Q4_BLOCK, s + j * gbytes + 256, 64);
        } else { /* FMT_Q6K -> int8 codes q - 32, corr = -128 sum, d sc per 16 inputs */
            const uint8_t *s = wt + sb * Q6K_SB, *blk = s + j * Q6K_GROUP;
            const int8_t *sc = (const int8_t *)(s + SB_GROUPS * Q6K_GROUP);
            const uint8_t *dh = s + SB_GROUPS * Q6K_GROUP + 256;
            uint8_t *o = out + g * Q8_SUB2_BLOCK;
            int32_t corr[2][TILE] = {{0}};
            float d[2][TILE];
            for (int c = 0; c < 8; c++)
                for (int l = 0; l < TILE; l++)
                    for (int b = 0; b < 4; b++) {
                        const int at = l * 4 + b;
                        const int low = (blk[(c & 3) * 64 + at] >> (4 * (c >> 2))) & 15;
                        const int high = (blk[256 + (c >> 2) * 64 + at] >> (2 * (c & 3))) & 3;
                        const int q = (low | high << 4) - 32;
                        o[c * 64 + at] = (uint8_t)(int8_t)q;
                        corr[c >> 2][l] += -128 * q;
                    }
            for (int half = 0; half < 2; half++)
                for (int l = 0; l < TILE; l++)
                    d[half][l] = f16_to_f32(ld16(dh + 2 * l)) * (float)sc[(j * 2 + half) * TILE + l];
            memcpy(o + Q8_CODES, corr, sizeof corr);
            memcpy(o + Q8_CODES + 128, d, sizeof d);
        }
    }
}

/* A per-thread buffer for one expanded tile (grown, never shrunk). */
static __thread uint8_t *expand_ptr = NULL;
static __thread size_t expand_cap = 0;

static uint8_t *expand_buffer(size_t bytes) {
    if (bytes > expand_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0) return NULL;
        free(expand_ptr);
        expand_ptr = (uint8_t *)p;
        expand_cap = bytes;
    }
    return expand_ptr;
}

/* ------------------------------------------------ direct kernels (VNNI, 1-2 rows)
 *
 * Each mirrors q4_tile_vnni / q8_tile_vnni's MB <= 2 case: per group, the codes
 * unpacked once into 8 vectors, two vpdpbusd chains per row, then per row
 * a = fma(float(i), scale * xs, a) (4-bit: then a = fma(m, xsum, a)), the
 * residual rows into a2, added at the end. */
#if defined(QG_VNNI)

/* One 4-bit group (code block at p) x one row: the high nibbles are multiplied in
 * place (p & 0xF0 = 16 q) and the sum divided by 16 (exact), one op fewer a vector
 * than shifting them down; the integer is the 4-bit kernels' sum, bit for bit. */
QG_INLINE __m512i q4n_dot(const __m512i *lo, const __m512i *hi16, const int8_t *xr) {
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        i0 = _mm512_dpbusd_epi32(i0, lo[c], _mm512_set1_epi32(ld32(xr + 4 * c)));
        i1 = _mm512_dpbusd_epi32(i1, hi16[c], _mm512_set1_epi32(ld32(xr + 4 * c + 16)));
    }
    return _mm512_add_epi32(i0, _mm512_srai_epi32(i1, 4));
}

/* One 4-bit group (codes at p) with its row scales d and offsets mn, MB <= 2 rows. */
QG_INLINE void q4n_group(const uint8_t *p, __m512 d, __m512 mn, const QRows *o, int64_t r0,
                         int64_t g, int64_t groups, unsigned bits, const int MB, __m512 *a,
                         __m512 *a2) {
    const int64_t k = groups * GROUP; /* QOFF / SOFF's operands */
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    __m512i lo[4], hi16[4];
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + c * 64));
        lo[c] = _mm512_and_si512(v, low4);
        hi16[c] = _mm512_and_si512(v, high4);
    }
    for (int r = 0; r < MB; r++) {
        const int64_t at = SOFF(r0 + r, g);
        const __m512 f = _mm512_cvtepi32_ps(q4n_dot(lo, hi16, QX(o, r0 + r, g)));
        a[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs[at])), a[r]);
        a[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum[at]), a[r]);
    }
    for (int r = 0; r < MB; r++) {
        if (!(bits >> r & 1u)) continue;
        const int64_t at = SOFF(r0 + r, g);
        const __m512 f = _mm512_cvtepi32_ps(q4n_dot(lo, hi16, QX2(o, r0 + r, g)));
        a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs2[at])), a2[r]);
        a2[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum2[at]), a2[r]);
    }
}

/* A super-block's 8 x 16 six-bit values (planes lo: 64 B, hi: 32 B; see the layout)
 * -> out[j * 16 + l], once per super-block rather than once per group. */
QG_INLINE void six_bits_sb(const uint8_t *lo, const uint8_t *hi, uint8_t *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    /* 128-bit lane i of a broadcast high plane moves its bits 2i..2i+1 down */
    const __m512i shifts = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0);
    const __m512i v = _mm512_loadu_si512((const void *)lo);
    for (int half = 0; half < 2; half++) {
        const __m512i l = _mm512_and_si512(half ? _mm512_srli_epi16(v, 4) : v, low4);
        const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(hi + 16 * half)));
        const __m512i hb = _mm512_and_si512(_mm512_srlv_epi64(h, shifts), three);
        _mm512_store_si512((void *)(out + 64 * half), _mm512_or_si512(l, _mm512_slli_epi16(hb, 4)));
    }
}

/* 16 unsigned bytes -> 16 float32 lanes. */
QG_INLINE __m512 u8_to_ps(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)p)));
}

QG_INLINE __m512 f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

QG_INLINE void q4k_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf) {
    __m512 a[2], a2[2];
    uint8_t sc[128] __attribute__((aligned(64))), mins[128] __attribute__((aligned(64)));
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < groups / SB_GROUPS; sb++) {
        const uint8_t *s = wt + sb * Q4K_SB, *h = s + SB_GROUPS * 256;
        const __m512 dv = f16x16(h), dm = f16x16(h + 32);
        six_bits_sb(h + 64, h + 192, sc);
        six_bits_sb(h + 128, h + 224, mins);
        for (int j = 0; j < SB_GROUPS; j++) {
            const int64_t g = sb * SB_GROUPS + j;
            /* an eighth of the next tile's super-block a group, spread as the 4-bit
             * kernel's (a burst of 36 lines at once streamed at 2/3 of its rate) */
            prefetch_block(pf + sb * Q4K_SB + j * (Q4K_SB / SB_GROUPS), Q4K_SB / SB_GROUPS);
            const __m512 d = _mm512_mul_ps(dv, u8_to_ps(sc + 16 * j));
            const __m512 mn = _mm512_mul_ps(dm, u8_to_ps(mins + 16 * j));
            q4n_group(s + j * 256, d, mn, o, r0, g, groups, mask2 ? mask2[g] : 0u, MB, a, a2);
        }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

#if defined(__GFNI__)
/* Bit c of each byte of hv at bit 4, every other bit 0 (GF(2) affine: output bit 4 is
 * row byte 3 of the matrix, which selects input bit c). */
QG_INLINE __m512i fifth_bit(__m512i hv, int c) {
    return _mm512_gf2p8affine_epi64_epi8(hv, _mm512_set1_epi64((long long)(1u << c) << 24), 0);
}
#endif

/* Q5_K: per group the 4-bit codes with their fifth bits (or_bit4), then q4_tile_vnni's
 * MB <= 2 operations (the integer sums are the same, bit for bit). */
QG_INLINE void q5k_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf) {
    const int64_t k = groups * GROUP; /* QOFF / SOFF's operands */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 a[2], a2[2];
    uint8_t sc[128] __attribute__((aligned(64))), mins[128] __attribute__((aligned(64)));
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < groups / SB_GROUPS; sb++) {
        const uint8_t *s = wt + sb * Q5K_SB, *h = s + SB_GROUPS * Q5K_GROUP;
        const __m512 dv = f16x16(h), dm = f16x16(h + 32);
        six_bits_sb(h + 64, h + 192, sc);
        six_bits_sb(h + 128, h + 224, mins);
        for (int j = 0; j < SB_GROUPS; j++) {
            const int64_t g = sb * SB_GROUPS + j;
            const uint8_t *blk = s + j * Q5K_GROUP;
            prefetch_block(pf + sb * Q5K_SB + j * (Q5K_SB / SB_GROUPS), Q5K_SB / SB_GROUPS);
            const __m512 d = _mm512_mul_ps(dv, u8_to_ps(sc + 16 * j));
            const __m512 mn = _mm512_mul_ps(dm, u8_to_ps(mins + 16 * j));
            const __m512i hv = _mm512_loadu_si512((const void *)(blk + 256));
            __m512i w[8];
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + c * 64));
#if defined(__GFNI__)
                /* (nibble & 15) | fifth bit, the bit moved to bit 4 (all else 0) by one
                 * bit-matrix op: two ops a vector fewer than masking and shifting */
                w[c] = _mm512_ternarylogic_epi32(v, fifth_bit(hv, c), low4, 0xEC);
                w[c + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), fifth_bit(hv, c + 4),
                                                     low4, 0xEC); /* (a & c) | b */
#else
                w[c] = or_bit4(_mm512_and_si512(v, low4), hv, c);
                w[c + 4] = or_bit4(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), hv, c + 4);
#endif
            }
            for (int r = 0; r < MB; r++) {
                const int64_t at = SOFF(r0 + r, g);
                const __m512 f = _mm512_cvtepi32_ps(q4_dot_regs(w, QX(o, r0 + r, g)));
                a[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs[at])), a[r]);
                a[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum[at]), a[r]);
            }
            const unsigned bits = mask2 ? mask2[g] : 0u;
            for (int r = 0; r < MB; r++) {
                if (!(bits >> r & 1u)) continue;
                const int64_t at = SOFF(r0 + r, g);
                const __m512 f = _mm512_cvtepi32_ps(q4_dot_regs(w, QX2(o, r0 + r, g)));
                a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(o->xs2[at])), a2[r]);
                a2[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o->xsum2[at]), a2[r]);
            }
        }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

QG_INLINE void q40_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf) {
    __m512 a[2], a2[2];
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    const __m512 minus8 = _mm512_set1_ps(-8.0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * Q40_BLOCK;
        prefetch_block(pf + g * Q40_BLOCK, Q40_BLOCK);
        const __m512 d = f16x16(blk + 256);
        q4n_group(blk, d, _mm512_mul_ps(d, minus8), o, r0, g, groups, mask2 ? mask2[g] : 0u, MB, a,
                  a2);
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

QG_INLINE void q41_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf) {
    __m512 a[2], a2[2];
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * Q41_BLOCK;
        prefetch_block(pf + g * Q41_BLOCK, Q41_BLOCK);
        q4n_group(blk, f16x16(blk + 256), f16x16(blk + 288), o, r0, g, groups,
                  mask2 ? mask2[g] : 0u, MB, a, a2);
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

/* The sums of each 16 activation codes of the call's rows (at most 2), level 1 then
 * level 2: sums[(level * 2 + r) * 2 * groups + 2 g + half]. Unsigned weight codes
 * u = w + b (Q6_K: b = 32; Q8_0: 128) give sum w x = sum u x - b sum x; computed
 * once a call, not once a tile. */
static void x_sums16(const QRows *o, int64_t rows, int64_t groups, int levels, int32_t *bias) {
    const int64_t k = groups * GROUP; /* QOFF's operand */
    for (int lvl = 0; lvl < levels; lvl++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *x = (lvl ? o->q2 : o->q) + QOFF(r, g);
                int32_t s0 = 0, s1 = 0;
                for (int i = 0; i < 16; i++) {
                    s0 += x[i];
                    s1 += x[16 + i];
                }
                int32_t *b = bias + (lvl * 2 + r) * 2 * groups + 2 * g;
                b[0] = s0;
                b[1] = s1;
            }
}

/* Half `half` of a Q6_K group (4 chunks of unsigned codes w) x one row: sum (q - 32) x. */
QG_INLINE __m512 q6_half_dot(const __m512i *w, int half, const int8_t *xr, int32_t bias) {
    const int c0 = 4 * half;
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int c = c0; c < c0 + 4; c += 2) {
        i0 = _mm512_dpbusd_epi32(i0, w[c], _mm512_set1_epi32(ld32(xr + 4 * c)));
        i1 = _mm512_dpbusd_epi32(i1, w[c + 1], _mm512_set1_epi32(ld32(xr + 4 * c + 4)));
    }
    return _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(32 * bias)));
}

QG_INLINE void q6k_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf, const int32_t *bias) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    const int64_t k = groups * GROUP; /* QOFF / SOFF's operands */
    __m512 a[2], a2[2];
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < groups / SB_GROUPS; sb++) {
        const uint8_t *s = wt + sb * Q6K_SB;
        const int8_t *sc = (const int8_t *)(s + SB_GROUPS * Q6K_GROUP);
        const __m512 dv = f16x16(s + SB_GROUPS * Q6K_GROUP + 256);
        for (int j = 0; j < SB_GROUPS; j++) {
            const int64_t g = sb * SB_GROUPS + j;
            const uint8_t *blk = s + j * Q6K_GROUP;
            prefetch_block(pf + sb * Q6K_SB + j * (Q6K_SB / SB_GROUPS), Q6K_SB / SB_GROUPS);
            __m512i w[8];
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + c * 64));
                w[c] = _mm512_and_si512(v, low4);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            for (int half = 0; half < 2; half++) { /* bits 2i..2i+1 -> bits 4..5 */
                const __m512i hv = _mm512_loadu_si512((const void *)(blk + 256 + half * 64));
                const int c = 4 * half;
                w[c] = _mm512_ternarylogic_epi32(w[c], _mm512_slli_epi16(hv, 4), two, 0xF8);
                w[c + 1] = _mm512_ternarylogic_epi32(w[c + 1], _mm512_slli_epi16(hv, 2), two, 0xF8);
                w[c + 2] = _mm512_ternarylogic_epi32(w[c + 2], hv, two, 0xF8);
                w[c + 3] = _mm512_ternarylogic_epi32(w[c + 3], _mm512_srli_epi16(hv, 2), two, 0xF8);
            }
            const unsigned bits = mask2 ? mask2[g] : 0u;
            for (int half = 0; half < 2; half++) {
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(sc + (j * 2 + half) * TILE));
                const __m512 d =
                    _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
                for (int r = 0; r < MB; r++) {
                    const __m512 sx = _mm512_set1_ps(o->xs[SOFF(r0 + r, g)]);
                    const int32_t b = bias[(r0 + r) * 2 * groups + 2 * g + half];
                    const __m512 f = q6_half_dot(w, half, QX(o, r0 + r, g), b);
                    a[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx), a[r]);
                }
                for (int r = 0; r < MB; r++) {
                    if (!(bits >> r & 1u)) continue;
                    const __m512 sx2 = _mm512_set1_ps(o->xs2[SOFF(r0 + r, g)]);
                    const int32_t b = bias[(2 + r0 + r) * 2 * groups + 2 * g + half];
                    const __m512 f = q6_half_dot(w, half, QX2(o, r0 + r, g), b);
                    a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx2), a2[r]);
                }
            }
        }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

QG_INLINE void q80_tile_direct(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                               const uint8_t *mask2, const int MB, float acc[][TILE],
                               const uint8_t *pf, const int32_t *sums) {
    const int64_t k = groups * GROUP; /* QOFF / SOFF's operands */
    __m512 a[2], a2[2];
    for (int r = 0; r < MB; r++) a[r] = a2[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = wt + g * Q80_BLOCK;
        prefetch_block(pf + g * Q80_BLOCK, Q80_BLOCK);
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(blk + c * 64));
        const __m512 d = f16x16(blk + Q8_CODES);
        const unsigned bits = mask2 ? mask2[g] : 0u;
        for (int lvl = 0; lvl < 2; lvl++)
            for (int r = 0; r < MB; r++) {
                if (lvl == 1 && !(bits >> r & 1u)) continue;
                const int64_t at = SOFF(r0 + r, g);
                const int8_t *xr = lvl ? QX2(o, r0 + r, g) : QX(o, r0 + r, g);
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int c = 0; c < 8; c += 2) {
                    i0 = _mm512_dpbusd_epi32(i0, w[c], _mm512_set1_epi32(ld32(xr + 4 * c)));
                    i1 = _mm512_dpbusd_epi32(i1, w[c + 1], _mm512_set1_epi32(ld32(xr + 4 * c + 4)));
                }
                const int32_t *s2 = sums + (lvl * 2 + r0 + r) * 2 * groups + 2 * g;
                const __m512i bias = _mm512_set1_epi32(128 * (s2[0] + s2[1]));
                const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(i0, i1), bias));
                const __m512 sx = _mm512_set1_ps(lvl ? o->xs2[at] : o->xs[at]);
                if (lvl) a2[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx), a2[r]);
                else a[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, sx), a[r]);
            }
    }
    for (int r = 0; r < MB; r++) {
        if (mask2) a[r] = _mm512_add_ps(a[r], a2[r]);
        _mm512_storeu_ps(acc[r], a[r]);
    }
}

/* expand_tile with AVX-512 (the same values, bit for bit): with 3+ rows on the VNNI
 * path every tile is expanded once per chunk of rows, and the scalar loops cost as
 * much as the 64-row matmul itself (Q6_K: twice the float32-scale block's time). */
static void expand_tile_vnni(int fmt, const uint8_t *wt, int64_t groups, uint8_t *out) {
    const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8((char)0x80);
    if (fmt == FMT_Q4K || fmt == FMT_Q5K) {
        const int five = fmt == FMT_Q5K;
        const int64_t gbytes = five ? Q5K_GROUP : 256, obytes = five ? Q5_BLOCK : Q4_BLOCK;
        uint8_t sc[128] __attribute__((aligned(64))), mins[128] __attribute__((aligned(64)));
        for (int64_t sb = 0; sb < groups / SB_GROUPS; sb++) {
            const uint8_t *s = wt + sb * (five ? Q5K_SB : Q4K_SB), *h = s + SB_GROUPS * gbytes;
            const __m512 dv = f16x16(h), dm = f16x16(h + 32);
            six_bits_sb(h + 64, h + 192, sc);
            six_bits_sb(h + 128, h + 224, mins);
            for (int j = 0; j < SB_GROUPS; j++) {
                uint8_t *o = out + (sb * SB_GROUPS + j) * obytes;
                memcpy(o, s + j * gbytes, 256);
                _mm512_storeu_ps(o + 256, _mm512_mul_ps(dv, u8_to_ps(sc + 16 * j)));
                _mm512_storeu_ps(o + 320, _mm512_mul_ps(dm, u8_to_ps(mins + 16 * j)));
                if (five) memcpy(o + Q4_BLOCK, s + j * gbytes + 256, 64);
            }
        }
    } else if (fmt == FMT_Q6K) {
        const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
        const __m512i bias = _mm512_set1_epi8(32);
        for (int64_t sb = 0; sb < groups / SB_GROUPS; sb++) {
            const uint8_t *s = wt + sb * Q6K_SB;
            const int8_t *sc = (const int8_t *)(s + SB_GROUPS * Q6K_GROUP);
            const __m512 dv = f16x16(s + SB_GROUPS * Q6K_GROUP + 256);
            for (int j = 0; j < SB_GROUPS; j++) {
                const uint8_t *blk = s + j * Q6K_GROUP;
                uint8_t *o = out + (sb * SB_GROUPS + j) * Q8_SUB2_BLOCK;
                __m512i w[8];
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(blk + c * 64));
                    w[c] = _mm512_and_si512(v, low4);
                    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                for (int half = 0; half < 2; half++) {
                    const __m512i hv = _mm512_loadu_si512((const void *)(blk + 256 + half * 64));
                    const int c = 4 * half;
                    w[c] = _mm512_ternarylogic_epi32(w[c], _mm512_slli_epi16(hv, 4), two, 0xF8);
                    w[c + 1] = _mm512_ternarylogic_epi32(w[c + 1], _mm512_slli_epi16(hv, 2), two, 0xF8);
                    w[c + 2] = _mm512_ternarylogic_epi32(w[c + 2], hv, two, 0xF8);
                    w[c + 3] = _mm512_ternarylogic_epi32(w[c + 3], _mm512_srli_epi16(hv, 2), two, 0xF8);
                }
                for (int half = 0; half < 2; half++) {
                    __m512i sum = _mm512_setzero_si512();
                    for (int c = 4 * half; c < 4 * half + 4; c++) {
                        const __m512i q = _mm512_sub_epi8(w[c], bias);
                        _mm512_storeu_si512((void *)(o + c * 64), q);
                        sum = _mm512_dpbusd_epi32(sum, ones, q); /* each row's 4 codes */
                    }
                    _mm512_storeu_si512((void *)(o + Q8_CODES + half * 64),
                                        _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
                    const __m128i s8 = _mm_loadu_si128((const __m128i *)(sc + (j * 2 + half) * TILE));
                    const __m512 d = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
                    _mm512_storeu_ps(o + Q8_CODES + 128 + half * 64, d);
                }
            }
        }
    } else if (fmt == FMT_Q80) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = wt + g * Q80_BLOCK;
            uint8_t *o = out + g * Q8_SUB1_BLOCK;
            __m512i sum = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i q = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + c * 64)), flip);
                _mm512_storeu_si512((void *)(o + c * 64), q);
                sum = _mm512_dpbusd_epi32(sum, ones, q);
            }
            _mm512_storeu_si512((void *)(o + Q8_CODES), _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
            _mm512_storeu_ps(o + Q8_CODES + 64, f16x16(blk + Q8_CODES));
        }
    } else { /* FMT_Q40, FMT_Q41 */
        const int64_t block = fmt == FMT_Q40 ? Q40_BLOCK : Q41_BLOCK;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = wt + g * block;
            uint8_t *o = out + g * Q4_BLOCK;
            memcpy(o, blk, 256);
            const __m512 d = f16x16(blk + 256);
            _mm512_storeu_ps(o + 256, d);
            _mm512_storeu_ps(o + 320, fmt == FMT_Q40 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                                                     : f16x16(blk + 288));
        }
    }
}

/* One tile of a native format for mb (1 or 2) rows read directly. */
static void native_tile_rows(int fmt, const uint8_t *wt, int64_t groups, const QRows *o,
                             int64_t r0, const uint8_t *mask2, int mb, float acc[][TILE],
                             const uint8_t *pf, const int32_t *bias) {
    if (fmt == FMT_Q4K) {
        if (mb == 2) q4k_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf);
        else q4k_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf);
    } else if (fmt == FMT_Q5K) {
        if (mb == 2) q5k_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf);
        else q5k_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf);
    } else if (fmt == FMT_Q6K) {
        if (mb == 2) q6k_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf, bias);
        else q6k_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf, bias);
    } else if (fmt == FMT_Q80) {
        if (mb == 2) q80_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf, bias);
        else q80_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf, bias);
    } else if (fmt == FMT_Q41) {
        if (mb == 2) q41_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf);
        else q41_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf);
    } else {
        if (mb == 2) q40_tile_direct(wt, groups, o, r0, mask2, 2, acc, pf);
        else q40_tile_direct(wt, groups, o, r0, mask2, 1, acc, pf);
    }
}
#define QG_DIRECT_ROWS 2 /* calls of at most this many rows read native tiles directly */
#else
#define QG_DIRECT_ROWS 0
#define expand_tile_vnni expand_tile /* the scalar expansion below VNNI */
static void native_tile_rows(int fmt, const uint8_t *wt, int64_t groups, const QRows *o,
                             int64_t r0, const uint8_t *mask2, int mb, float acc[][TILE],
                             const uint8_t *pf, const int32_t *bias) {
    (void)fmt, (void)wt, (void)groups, (void)o, (void)r0, (void)mask2, (void)mb, (void)acc;
    (void)pf, (void)bias;
}
static void x_sums16(const QRows *o, int64_t rows, int64_t groups, int levels, int32_t *bias) {
    (void)o, (void)rows, (void)groups, (void)levels, (void)bias;
}
#endif

/* Test hook: every tile of a native weight expanded into the qgemm.c blocks (fmt 4 or
 * 8 with two scales per 32), so that Python reads the values the kernels apply. */
static int native_fmt(int fmt) {
    return fmt == FMT_Q4K || fmt == FMT_Q5K || fmt == FMT_Q6K || fmt == FMT_Q40 || fmt == FMT_Q80 ||
           fmt == FMT_Q41;
}

/* Bytes of qgemm.c's block a native group expands into. */
static int64_t expanded_group_bytes(int fmt) {
    return fmt == FMT_Q6K ? Q8_SUB2_BLOCK : fmt == FMT_Q80 ? Q8_SUB1_BLOCK
         : fmt == FMT_Q5K ? Q5_BLOCK : Q4_BLOCK;
}

int paged_qgemm_expand(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (!native_fmt(fmt) || n <= 0 || k <= 0) return -1;
    if (k % (fmt == FMT_Q4K || fmt == FMT_Q5K || fmt == FMT_Q6K ? SB_INPUTS : GROUP) != 0) return -1;
    const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
    const int64_t in_bytes = native_tile_bytes(fmt, groups);
    const int64_t out_bytes = groups * expanded_group_bytes(fmt);
    for (int64_t t = 0; t < tiles; t++) expand_tile(fmt, w + t * in_bytes, groups, out + t * out_bytes);
    return 0;
}
