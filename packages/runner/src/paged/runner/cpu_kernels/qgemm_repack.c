/* GGUF blocks straight into qgemm_native.c's tiles, and rows read back out of any packed
 * weight (inlined at the end of qgemm.c by cpu_kernels/build.py; the Python side is
 * cpu_kernels/repack.py).
 *
 * paged_qgemm_repack: the loader used to decode every GGUF tensor to codes and float32
 * scales (numpy), copy them into staging buffers and have packing_native.py search for
 * the 6-bit / int8 sub-scales that the file already stores, in whole-tensor torch ops on
 * one thread: a 1.7B Q4_K_M model spent most of its start-up there. This writes the
 * same tiles from the file's bytes, one pass, on the kernels' pool:
 *
 *   GGUF (ggml-common.h)                         tile (qgemm_native.c's layouts)
 *   Q4_0  d, qs[16]: byte i = w[i] | w[i+16] << 4   FMT_Q40: the code block's byte
 *                                                      (c * 64 + l * 4 + b) = qs[4c + b]
 *   Q4_1  d, m, qs[16]                             FMT_Q41: the same, then m
 *   Q8_0  d, qs[32] int8                           FMT_Q80: codes ^ 0x80
 *   Q5_0  d, qh (32 bits), qs[16]: q - 16          FMT_Q80 (Q5_0's codes in Q8_0's form)
 *   Q4_K  d, dmin, 12 scale bytes, qs[128]         FMT_Q4K: d, dm = -dmin, 6-bit planes
 *   Q5_K  Q4_K's header, qh[32], qs[128]           FMT_Q5K: Q4_K's + a fifth-bit plane
 *   Q6_K  ql[128], qh[64], sc[16] int8, d          FMT_Q6K
 *
 * Rows are given as pointers (a run of rows may come from several tensors: q, k and v of
 * one projection), rows past n are the packers' zero padding. The K-quants keep the
 * file's (d, sub-scale) factoring; packing_native.factor_scales finds the first one that
 * multiplies out to the same float32 values (the file's own whenever its largest 6-bit
 * scale and min are 63, or its largest |Q6_K scale| is stored as -128, as llama.cpp's
 * quantisers write them): every kernel multiplies d by the sub-scale first, so both
 * give the same float32 scales and the same results, bit for bit.
 *
 * `flags` reports what the old packers would have done differently, so that the caller
 * can hand those tensors to them instead (RP_*): a non-finite f16 scale, a 4-bit tensor
 * whose every offset is -8 times its scale (packed as Q4_0 by QGemm.int4), a Q5_K tensor
 * with no code above 15 (packed as a 4-bit one).
 */

enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13,
       GG_Q6_K = 14 };
enum { RP_NONFINITE = 1, RP_NOT_Q40 = 2, RP_CODE_PAST_15 = 4 };

static int repack_fmt(int gtype) {
    switch (gtype) {
    case GG_Q4_0: return FMT_Q40;
    case GG_Q4_1: return FMT_Q41;
    case GG_Q5_0: case GG_Q8_0: return FMT_Q80;
    case GG_Q4_K: return FMT_Q4K;
    case GG_Q5_K: return FMT_Q5K;
    case GG_Q6_K: return FMT_Q6K;
    default: return -1;
    }
}

/* (weights, bytes) of one GGUF block */
static int64_t gguf_block_weights(int gtype) {
    return gtype == GG_Q4_K || gtype == GG_Q5_K || gtype == GG_Q6_K ? 256 : 32;
}

static int64_t gguf_block_bytes(int gtype) {
    switch (gtype) {
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q5_0: return 22;
    case GG_Q8_0: return 34;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    default: return 210; /* GG_Q6_K */
    }
}

QG_INLINE int f16_finite(const uint8_t *p) { return (ld16(p) & 0x7c00u) != 0x7c00u; }

/* Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and 8 mins (llama.cpp's
 * get_scale_min_k4). */
static void k_scales(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 15) | ((q[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

/* The 6-bit values v[j][l] (8 x 16) as planes: 64 B low nibbles, 32 B high bits. */
static void six_bit_planes(const uint8_t v[8][TILE], uint8_t *lo, uint8_t *hi) {
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < TILE; l++)
            lo[j * 16 + l] = (uint8_t)((v[j][l] & 15) | (v[j + 4][l] & 15) << 4);
    for (int a = 0; a < 2; a++)
        for (int l = 0; l < TILE; l++) {
            uint8_t b = 0;
            for (int i = 0; i < 4; i++) b |= (uint8_t)((v[4 * a + i][l] >> 4) << (2 * i));
            hi[a * 16 + l] = b;
        }
}

QG_INLINE uint32_t ld32u(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One row's 32 four-bit values (bits `shift`.. of src[0..31]) as the code block's four
 * chunks: byte (c * 64 + b) of out = value 4c + b | value 16 + 4c + b << 4, four bytes a
 * step (the nibbles never cross a byte). */
QG_INLINE void nibble_chunks(const uint8_t *src, int shift, uint8_t *out) {
    for (int c = 0; c < 4; c++) {
        const uint32_t lo = (ld32u(src + 4 * c) >> shift) & 0x0F0F0F0Fu;
        const uint32_t hi = (ld32u(src + 16 + 4 * c) >> shift) & 0x0F0F0F0Fu;
        const uint32_t word = lo | hi << 4;
        memcpy(out + c * 64, &word, 4);
    }
}

typedef struct {
    int gtype, fmt;
    const uint8_t *const *rows;
    int64_t n, k, groups, tile_bytes, per_task;
    uint8_t *dst;
    int flags; /* RP_*, or-ed atomically by the tasks */
} RepackCall;

/* Tile t of a 32-weight format (Q4_0, Q4_1, Q8_0, Q5_0); returns RP_* flags. */
static int repack_tile_small(const RepackCall *c, int64_t t, uint8_t *out) {
    const int64_t bb = gguf_block_bytes(c->gtype);
    const int64_t block = c->fmt == FMT_Q80 ? Q80_BLOCK : c->fmt == FMT_Q41 ? Q41_BLOCK : Q40_BLOCK;
    const int64_t codes = c->fmt == FMT_Q80 ? Q8_CODES : 256;
    int flags = 0;
    for (int64_t g = 0; g < c->groups; g++) {
        uint8_t *o = out + g * block;
        memset(o, 0, (size_t)block);
        if (c->fmt == FMT_Q80) memset(o, 0x80, Q8_CODES); /* padding rows: code 0 */
        for (int l = 0; l < TILE && t * TILE + l < c->n; l++) {
            const uint8_t *b = c->rows[t * TILE + l] + g * bb;
            if (!f16_finite(b) || (c->gtype == GG_Q4_1 && !f16_finite(b + 2))) flags |= RP_NONFINITE;
            memcpy(o + codes + 2 * l, b, 2); /* d */
            if (c->gtype == GG_Q4_1) {
                memcpy(o + codes + 32 + 2 * l, b + 2, 2); /* m */
                if (-8.0f * f16_to_f32(ld16(b)) != f16_to_f32(ld16(b + 2))) flags |= RP_NOT_Q40;
            }
            if (c->gtype == GG_Q4_0 || c->gtype == GG_Q4_1) {
                const uint8_t *qs = b + (c->gtype == GG_Q4_0 ? 2 : 4);
                for (int cc = 0; cc < 4; cc++) memcpy(o + cc * 64 + l * 4, qs + 4 * cc, 4);
            } else if (c->gtype == GG_Q8_0) {
                for (int i = 0; i < 32; i++) o[(i / 4) * 64 + l * 4 + i % 4] = b[2 + i] ^ 0x80;
            } else { /* Q5_0: q = (4 low bits as Q4_0 | bit i of qh << 4) - 16 */
                uint32_t qh;
                memcpy(&qh, b + 2, 4);
                for (int i = 0; i < 32; i++) {
                    const int low = i < 16 ? b[6 + i] & 15 : b[6 + i - 16] >> 4;
                    const int q = (low | (int)((qh >> i) & 1u) << 4) - 16;
                    o[(i / 4) * 64 + l * 4 + i % 4] = (uint8_t)q ^ 0x80;
                }
            }
        }
    }
    return flags;
}

/* Tile t of Q4_K / Q5_K: per super-block 8 code blocks (Q5_K: + fifth bits), header. */
static int repack_tile_k4(const RepackCall *c, int64_t t, uint8_t *out) {
    const int five = c->gtype == GG_Q5_K;
    const int64_t gbytes = five ? Q5K_GROUP : 256, sb_bytes = five ? Q5K_SB : Q4K_SB;
    const int64_t bb = gguf_block_bytes(c->gtype);
    int flags = 0;
    for (int64_t s = 0; s < c->groups / SB_GROUPS; s++) {
        uint8_t *o = out + s * sb_bytes, *h = o + SB_GROUPS * gbytes;
        uint8_t sc[SB_GROUPS][TILE] = {{0}}, mn[SB_GROUPS][TILE] = {{0}};
        memset(o, 0, (size_t)sb_bytes);
        for (int l = 0; l < TILE && t * TILE + l < c->n; l++) {
            const uint8_t *b = c->rows[t * TILE + l] + s * bb;
            const uint8_t *qs = b + (five ? 48 : 16), *qh = b + 16;
            uint8_t s8[8], m8[8];
            if (!f16_finite(b) || !f16_finite(b + 2)) flags |= RP_NONFINITE;
            k_scales(b + 4, s8, m8);
            const float d = f16_to_f32(ld16(b)), dmin = f16_to_f32(ld16(b + 2));
            memcpy(h + 2 * l, b, 2);
            const uint16_t dm = (uint16_t)(ld16(b + 2) ^ 0x8000u); /* dm = -dmin: offset = dm m */
            memcpy(h + 32 + 2 * l, &dm, 2);
            for (int j = 0; j < SB_GROUPS; j++) {
                sc[j][l] = s8[j];
                mn[j][l] = m8[j];
                /* the loader's float32 scale and offset (loader/gguf_quant.py) */
                if (-8.0f * (d * (float)s8[j]) != -(dmin * (float)m8[j])) flags |= RP_NOT_Q40;
                uint8_t *blk = o + j * gbytes;
                nibble_chunks(qs + (j / 2) * 32, 4 * (j & 1), blk + l * 4);
                if (five) {
                    for (int i = 0; i < 32; i++) {
                        const int bit = (qh[i] >> j) & 1;
                        blk[256 + l * 4 + i % 4] |= (uint8_t)(bit << (i / 4));
                        if (bit) flags |= RP_CODE_PAST_15;
                    }
                }
            }
        }
        six_bit_planes((const uint8_t(*)[TILE])sc, h + 64, h + 192);
        six_bit_planes((const uint8_t(*)[TILE])mn, h + 128, h + 224);
    }
    return flags;
}

/* Tile t of Q6_K: group j of a super-block is quarter j % 4 of half j / 4 of ggml's
 * block: its weight i has 4 low bits at ql[64 half + 32 (j & 1) + i] >> 4 (j % 4 / 2)
 * and 2 high bits at qh[32 half + i] >> 2 (j % 4). */
static int repack_tile_q6k(const RepackCall *c, int64_t t, uint8_t *out) {
    int flags = 0;
    for (int64_t s = 0; s < c->groups / SB_GROUPS; s++) {
        uint8_t *o = out + s * Q6K_SB;
        int8_t *sc = (int8_t *)(o + SB_GROUPS * Q6K_GROUP);
        uint8_t *dh = o + SB_GROUPS * Q6K_GROUP + 256;
        memset(o, 0, (size_t)Q6K_SB); /* padding rows: all bits 0, as pack_q6k pads */
        for (int l = 0; l < TILE && t * TILE + l < c->n; l++) {
            const uint8_t *b = c->rows[t * TILE + l] + s * 210;
            if (!f16_finite(b + 208)) flags |= RP_NONFINITE;
            memcpy(dh + 2 * l, b + 208, 2);
            for (int e = 0; e < 16; e++) sc[e * TILE + l] = (int8_t)b[192 + e];
            for (int j = 0; j < SB_GROUPS; j++) {
                uint8_t *blk = o + j * Q6K_GROUP;
                const int half = j / 4, quarter = j % 4;
                const uint8_t *ql = b + 64 * half + 32 * (quarter & 1), *qh = b + 128 + 32 * half;
                const int shh = 2 * quarter;
                nibble_chunks(ql, 4 * (quarter >> 1), blk + l * 4);
                for (int v = 0; v < 2; v++) { /* byte b of chunk 4v + ii: bits 2 ii */
                    uint32_t word = 0;
                    for (int ii = 0; ii < 4; ii++)
                        word |= ((ld32u(qh + 4 * (4 * v + ii)) >> shh) & 0x03030303u) << (2 * ii);
                    memcpy(blk + 256 + v * 64 + l * 4, &word, 4);
                }
            }
        }
    }
    return flags;
}

static int repack_task(void *ctx, int64_t task) {
    RepackCall *c = (RepackCall *)ctx;
    const int64_t t0 = task * c->per_task;
    const int64_t tiles = (c->n + TILE - 1) / TILE;
    const int64_t t1 = t0 + c->per_task < tiles ? t0 + c->per_task : tiles;
    int flags = 0;
    for (int64_t t = t0; t < t1; t++) {
        uint8_t *out = c->dst + t * c->tile_bytes;
        if (c->fmt == FMT_Q4K || c->fmt == FMT_Q5K) flags |= repack_tile_k4(c, t, out);
        else if (c->fmt == FMT_Q6K) flags |= repack_tile_q6k(c, t, out);
        else flags |= repack_tile_small(c, t, out);
    }
    if (flags) __atomic_fetch_or(&c->flags, flags, __ATOMIC_RELAXED);
    return 0;
}

/* rows[n]: each row's k / block_weights GGUF blocks of type gtype (ggml's type number);
 * dst: native_tile_bytes(fmt, k / 32) * ceil(n / 16) bytes. Returns the RP_* flags
 * (>= 0), or -1 (bad arguments), or the pool's error. */
int paged_qgemm_repack(int gtype, const uint8_t *const *rows, int64_t n, int64_t k,
                       uint8_t *dst) {
    const int fmt = repack_fmt(gtype);
    if (fmt < 0 || n <= 0 || k <= 0 || k % gguf_block_weights(gtype) != 0) return -1;
    RepackCall c = {gtype, fmt, rows, n, k, k / GROUP, 0, 1, dst, 0};
    c.tile_bytes = native_tile_bytes(fmt, c.groups);
    const int64_t tiles = (n + TILE - 1) / TILE;
    /* about 256 KiB of tiles a task, at least 4 tasks a thread where there are tiles */
    int64_t per = 262144 / c.tile_bytes, spread = tiles / (4 * qg_threads);
    per = per > spread ? spread : per;
    c.per_task = per < 1 ? 1 : per;
    const int rc = qg_parallel((tiles + c.per_task - 1) / c.per_task, repack_task, &c,
                               tiles * c.tile_bytes);
    return rc != 0 ? (rc > 0 ? -rc : rc) : c.flags;
}

/* One row's 32 values of group g from a packed tile (any format qgemm runs), the
 * float32 operations the loader's codes and scales give: q * d (+ m). */
static void row_group(int fmt, int sub, const uint8_t *wt, int64_t g, int l, float *out) {
    const int64_t s = g / SB_GROUPS;
    const int j = (int)(g % SB_GROUPS);
    if (fmt == FMT_Q4 || fmt == FMT_Q40 || fmt == FMT_Q41) {
        const int64_t block = fmt == FMT_Q4 ? Q4_BLOCK : fmt == FMT_Q40 ? Q40_BLOCK : Q41_BLOCK;
        const uint8_t *blk = wt + g * block;
        float d, m;
        if (fmt == FMT_Q4) {
            memcpy(&d, blk + 256 + 4 * l, 4);
            memcpy(&m, blk + 320 + 4 * l, 4);
        } else {
            d = f16_to_f32(ld16(blk + 256 + 2 * l));
            m = fmt == FMT_Q40 ? d * -8.0f : f16_to_f32(ld16(blk + 288 + 2 * l));
        }
        for (int i = 0; i < 32; i++) {
            const uint8_t byte = blk[((i % 16) / 4) * 64 + l * 4 + i % 4];
            out[i] = (float)(i < 16 ? byte & 15 : byte >> 4) * d + m;
        }
    } else if (fmt == FMT_Q4K || fmt == FMT_Q5K) {
        const int five = fmt == FMT_Q5K;
        const int64_t gbytes = five ? Q5K_GROUP : 256;
        const uint8_t *sb = wt + s * (five ? Q5K_SB : Q4K_SB), *h = sb + SB_GROUPS * gbytes;
        const uint8_t *blk = sb + j * gbytes;
        const float d = f16_to_f32(ld16(h + 2 * l)) * (float)six_bit(h + 64, h + 192, j, l);
        const float m = f16_to_f32(ld16(h + 32 + 2 * l)) * (float)six_bit(h + 128, h + 224, j, l);
        for (int i = 0; i < 32; i++) {
            const uint8_t byte = blk[((i % 16) / 4) * 64 + l * 4 + i % 4];
            int q = i < 16 ? byte & 15 : byte >> 4;
            if (five) q |= ((blk[256 + l * 4 + i % 4] >> (i / 4)) & 1) << 4;
            out[i] = (float)q * d + m;
        }
    } else if (fmt == FMT_Q8 || fmt == FMT_Q80) {
        const int64_t block = fmt == FMT_Q8 ? Q8_CODES + sub * 128 : Q80_BLOCK;
        const uint8_t *blk = wt + g * block;
        for (int i = 0; i < 32; i++) {
            float d;
            if (fmt == FMT_Q8) memcpy(&d, blk + Q8_CODES + sub * 64 + (i * sub / 32) * 64 + 4 * l, 4);
            else d = f16_to_f32(ld16(blk + Q8_CODES + 2 * l));
            const uint8_t byte = blk[(i / 4) * 64 + l * 4 + i % 4];
            out[i] = (float)(int8_t)(fmt == FMT_Q80 ? byte ^ 0x80 : byte) * d;
        }
    } else { /* FMT_Q6K */
        const uint8_t *sb = wt + s * Q6K_SB, *blk = sb + j * Q6K_GROUP;
        const int8_t *sc = (const int8_t *)(sb + SB_GROUPS * Q6K_GROUP);
        const float dh = f16_to_f32(ld16(sb + SB_GROUPS * Q6K_GROUP + 256 + 2 * l));
        for (int i = 0; i < 32; i++) {
            const int cc = i / 4, at = l * 4 + i % 4;
            const int low = (blk[(cc & 3) * 64 + at] >> (4 * (cc >> 2))) & 15;
            const int high = (blk[256 + (cc >> 2) * 64 + at] >> (2 * (cc & 3))) & 3;
            const float d = dh * (float)sc[(j * 2 + i / 16) * TILE + l];
            out[i] = (float)((low | high << 4) - 32) * d;
        }
    }
}

/* out[m, k] float32 = rows ids[m] of a packed weight [n, k] (fmt 4, 8 with `sub` scales
 * per 32, or a native FMT_*): an embedding's lookup, the exact values the kernels
 * apply. Negative ids count from the end (torch indexing). Returns 0, or -1 (bad
 * arguments, an id out of range). */
int paged_qgemm_rows(int fmt, const uint8_t *w, int64_t n, int64_t k, int sub,
                     const int64_t *ids, int64_t m, float *out) {
    if (n <= 0 || k <= 0 || k % GROUP != 0 || m < 0) return -1;
    if (fmt != FMT_Q4 && fmt != FMT_Q8 && !native_fmt(fmt)) return -1;
    if (fmt == FMT_Q8 && sub != 1 && sub != 2) return -1;
    if ((fmt == FMT_Q4K || fmt == FMT_Q5K || fmt == FMT_Q6K) && k % SB_INPUTS != 0) return -1;
    const int64_t groups = k / GROUP;
    const int64_t tile_bytes = fmt == FMT_Q4   ? groups * Q4_BLOCK
                               : fmt == FMT_Q8 ? groups * (Q8_CODES + sub * 128)
                                               : native_tile_bytes(fmt, groups);
    for (int64_t r = 0; r < m; r++) {
        const int64_t id = ids[r] < 0 ? ids[r] + n : ids[r];
        if (id < 0 || id >= n) return -1;
        const uint8_t *wt = w + (id / TILE) * tile_bytes;
        for (int64_t g = 0; g < groups; g++)
            row_group(fmt, sub, wt, g, (int)(id % TILE), out + r * k + g * GROUP);
    }
    return 0;
}
