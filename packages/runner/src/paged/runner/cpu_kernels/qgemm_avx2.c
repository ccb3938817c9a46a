/* The AVX2 (+FMA) tile kernels of qgemm.c (inlined into it by cpu_kernels/build.py:
 * one translation unit); see the layout comment at the top of qgemm.c. */
#if defined(QG_AVX2)

/* 8 chunks of a 4-bit group (one half of the tile) x one row: int16 sums, then int32.
 * 5-bit codes (HB): 4 chunks at most in int16 (4 * 2 * 31 * 128 = 31744), two int32 sums. */
QG_INLINE __m256 q4_dot_avx2(const __m256i *w, const int HB, const int8_t *xr) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (HB) {
        __m256i s0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(ld32(xr)));
        __m256i s1 = _mm256_maddubs_epi16(w[4], _mm256_set1_epi32(ld32(xr + 16)));
        for (int c = 1; c < 4; c++) {
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(ld32(xr + 4 * c))));
            s1 = _mm256_add_epi16(
                s1, _mm256_maddubs_epi16(w[c + 4], _mm256_set1_epi32(ld32(xr + 4 * c + 16))));
        }
        return _mm256_cvtepi32_ps(
            _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones)));
    }
    __m256i s = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(ld32(xr)));
    for (int c = 1; c < 8; c++)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(ld32(xr + 4 * c))));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
}

QG_INLINE void q4_tile_avx2(const uint8_t *wt, int64_t groups, const QRows *o, int64_t r0,
                            int64_t k, const uint8_t *mask2, const int MB, const int HB,
                            float acc[][TILE]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    const int64_t block = HB ? Q5_BLOCK : Q4_BLOCK;
    float res[MB_ROWS][TILE];
    for (int r = 0; r < MB; r++)
        for (int l = 0; l < TILE; l++) res[r][l] = 0.0f;
    for (int h = 0; h < 2; h++) { /* rows 0-7, then 8-15 of the tile */
        __m256 a[MB_ROWS];
        for (int r = 0; r < MB; r++) a[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = wt + g * block;
            __m256i w[8];
            for (int c = 0; c < 4; c++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + h * 32));
                w[c] = _mm256_and_si256(p, low4);
                w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
            }
            if (HB) { /* bit c of each plane byte -> bit 4 of chunk c's code (see qgemm.c) */
                const __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + Q4_BLOCK + h * 32));
                for (int c = 0; c < 8; c++) {
                    const __m256i s =
                        c <= 4 ? _mm256_slli_epi16(hv, 4 - c) : _mm256_srli_epi16(hv, c - 4);
                    w[c] = _mm256_or_si256(w[c], _mm256_and_si256(s, b4));
                }
            }
            const __m256 d = _mm256_loadu_ps((const float *)(blk + 256) + h * 8);
            const __m256 mn = _mm256_loadu_ps((const float *)(blk + 320) + h * 8);
            for (int r = 0; r < MB; r++) {
                const int64_t at = SOFF(r0 + r, g);
                const __m256 f = q4_dot_avx2(w, HB, QX(o, r0 + r, g));
                a[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(o->xs[at])), a[r]);
                a[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(o->xsum[at]), a[r]);
            }
            for (unsigned bits = mask2 ? mask2[g] : 0u; bits; bits &= bits - 1) {
                const int r = __builtin_ctz(bits);
                const int64_t at = SOFF(r0 + r, g);
                const __m256 f = q4_dot_avx2(w, HB, QX2(o, r0 + r, g));
                __m256 v = _mm256_loadu_ps(res[r] + h * 8);
                v = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(o->xs2[at])), v);
                v = _mm256_fmadd_ps(mn, _mm256_set1_ps(o->xsum2[at]), v);
                _mm256_storeu_ps(res[r] + h * 8, v);
            }
        }
        for (int r = 0; r < MB; r++) {
            if (mask2) a[r] = _mm256_add_ps(a[r], _mm256_loadu_ps(res[r] + h * 8));
            _mm256_storeu_ps(acc[r] + h * 8, a[r]);
        }
    }
}

/* Chunks c0..c1 of an 8-bit group x one row: maddubs(|w|, sign(x, w)), int32 sums. */
QG_INLINE __m256 q8_dot_avx2(const __m256i *w, const __m256i *aw, int c0, int c1,
                             const int8_t *xr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i i = _mm256_setzero_si256();
    for (int c = c0; c < c1; c++) {
        const __m256i xb = _mm256_set1_epi32(ld32(xr + 4 * c));
        const __m256i p = _mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xb, w[c]));
        i = _mm256_add_epi32(i, _mm256_madd_epi16(p, ones));
    }
    return _mm256_cvtepi32_ps(i);
}

QG_INLINE void q8_tile_avx2(const uint8_t *wt, int64_t groups, const int sub, const QRows *o,
                            int64_t r0, int64_t k, const uint8_t *mask2, const int MB,
                            float acc[][TILE]) {
    const int64_t block = Q8_CODES + sub * 128;
    const int chunks = 8 / sub;
    float res[MB_ROWS][TILE];
    for (int r = 0; r < MB; r++)
        for (int l = 0; l < TILE; l++) res[r][l] = 0.0f;
    for (int h = 0; h < 2; h++) {
        __m256 a[MB_ROWS];
        for (int r = 0; r < MB; r++) a[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = wt + g * block;
            __m256i w[8], aw[8];
            for (int c = 0; c < 8; c++) {
                w[c] = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + h * 32));
                aw[c] = _mm256_abs_epi8(w[c]);
            }
            for (int s = 0; s < sub; s++) {
                const __m256 d =
                    _mm256_loadu_ps((const float *)(blk + Q8_CODES + sub * 64 + s * 64) + h * 8);
                const int c0 = s * chunks, c1 = (s + 1) * chunks;
                for (int r = 0; r < MB; r++) {
                    const __m256 sx = _mm256_set1_ps(o->xs[SOFF(r0 + r, g)]);
                    const __m256 f = q8_dot_avx2(w, aw, c0, c1, QX(o, r0 + r, g));
                    a[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, sx), a[r]);
                }
                for (unsigned bits = mask2 ? mask2[g] : 0u; bits; bits &= bits - 1) {
                    const int r = __builtin_ctz(bits);
                    const __m256 sx = _mm256_set1_ps(o->xs2[SOFF(r0 + r, g)]);
                    const __m256 f = q8_dot_avx2(w, aw, c0, c1, QX2(o, r0 + r, g));
                    __m256 v = _mm256_loadu_ps(res[r] + h * 8);
                    _mm256_storeu_ps(res[r] + h * 8, _mm256_fmadd_ps(f, _mm256_mul_ps(d, sx), v));
                }
            }
        }
        for (int r = 0; r < MB; r++) {
            if (mask2) a[r] = _mm256_add_ps(a[r], _mm256_loadu_ps(res[r] + h * 8));
            _mm256_storeu_ps(acc[r] + h * 8, a[r]);
        }
    }
}
#endif
