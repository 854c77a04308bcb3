#include "kernels.h"

/* ---- 4-bit weights x 8-bit activations (ggml's Q4_1 x Q8_1 dot) -----------------------------------------
 * Weights come interleaved by 8 outputs (kernels.pack_q4): for output group g and 32-block b, a 192-byte tile
 * holds float d[8], float m[8] (w = d * q + m; Q4_0 comes as m = -8d) and 128 bytes of nibbles. Byte
 * 32p + 4j + e holds output j's element 4p + e in its low nibble and element 4(p + 4) + e in its high one, so
 * one 32-byte load unpacks to two registers of 8 outputs x 4 consecutive elements and a broadcast of 4
 * activations feeds all 8 outputs: the per-block scale work is shared by 8 outputs instead of done per output.
 * Each row of x is quantized per 32-block to int8 (dx = max|x| / 127, xq = nearest(x / dx), sx = dx * sum xq).
 * A block's dot is the exact integer P = sum q * xq (int16 partial sums stay below 8 * 2 * 15 * 127 = 30480),
 * then acc = fma(d * dx, P, acc) ; acc = fma(m, sx, acc), block after block: ggml's scalar reference formula.
 * Every (row, output) runs this same sequence whatever the number of rows in the call: row-invariant.
 * Three variants (kernels.h: instruction sets) compute P differently and everything else alike: plain C; AVX2
 * (maddubs: unsigned nibble x signed xq pairs to int16, then to int32); AVX-512 VNNI (vpdpbusd: four unsigned
 * nibble x signed xq products summed straight into int32). The nibbles are the unsigned codes 0..15 in every
 * variant and the offset (Q4_1's m, or Q4_0's -8d) enters as m * sx, so no variant needs a signed weight. */
#define Q4_TILE 192  /* bytes per (8-output group, 32-block) */

/* the same arithmetic lane by lane, the reference the vector variants match bit for bit */
EYAS_INLINE void q4_row_scalar(const uint8_t *tiles, int nb, const int8_t *xr, const float *dxr, const float *sxr,
                               uint16_t *out, int nout) {
    float acc[8] = {0};
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q4_TILE;
        float dv[8], mv[8];
        memcpy(dv, t, 32);
        memcpy(mv, t + 32, 32);
        const int8_t *xb = xr + b * 32;
        for (int j = 0; j < 8; j++) {
            int p = 0;
            for (int c = 0; c < 4; c++)
                for (int e = 0; e < 4; e++) {
                    const uint8_t byte = t[64 + 32 * c + 4 * j + e];
                    p += (byte & 15) * xb[4 * c + e] + (byte >> 4) * xb[4 * c + 16 + e];
                }
            acc[j] = fmaf(dv[j] * dxr[b], (float)p, acc[j]);
            acc[j] = fmaf(mv[j], sxr[b], acc[j]);
        }
    }
    for (int j = 0; j < nout; j++) out[j] = to_bf16(acc[j]);
}

/* one 8-output group g (tiles tg) for all M rows: out og [M, N] at column 8g */
#define Q4_GROUP_PARAMS (const uint8_t *tg, int nb, const int8_t *xq, const float *dx, const float *sx, int M, \
                         int K, uint16_t *og, int N, int nout)
static void q4_group_portable Q4_GROUP_PARAMS {
    for (int r = 0; r < M; r++)
        q4_row_scalar(tg, nb, xq + (int64_t)r * K, dx + (int64_t)r * nb, sx + (int64_t)r * nb, og + (int64_t)r * N,
                      nout);
}

/* activations: row block rb (32 values) -> xq, dx and sx = dx * sum xq, each block on its own */
EYAS_INLINE void q4_quant_body(const int isa, const uint16_t *x, int8_t *xq, float *dx, float *sx, int64_t rb) {
    (void)isa;  /* plain C: only the vectorization differs */
    float v[32];
    for (int t = 0; t < 32; t++) v[t] = from_bf16(x[rb * 32 + t]);
    const int s = quantize_q8_block(v, xq + rb * 32, dx + rb);
    sx[rb] = dx[rb] * (float)s;
}
EYAS_VARIANTS(q4_quant, (const uint16_t *x, int8_t *xq, float *dx, float *sx, int64_t rb), x, xq, dx, sx, rb)

#ifdef EYAS_X86
static inline EYAS_TGT_AVX2 void q4_store(__m256 acc, uint16_t *o, int nout) {
    float a[8];
    _mm256_storeu_ps(a, acc);
    for (int j = 0; j < nout; j++) o[j] = to_bf16(a[j]);
}

/* row i's share of one nibble load: s_i += P over elements 4p..4p+3 and 4p+16..4p+19 of its block */
#define Q4_DOT(si, xb) do { int32_t a0_, a1_; memcpy(&a0_, (xb) + 4 * p, 4); memcpy(&a1_, (xb) + 4 * p + 16, 4); \
    si = _mm256_add_epi16(si, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0_)), \
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1_)))); } while (0)
/* row i's block b closes: acc_i = fma(d * dx, P, acc_i) ; acc_i = fma(m, sx, acc_i) */
#define Q4_CLOSE(acc, si, rb) do { \
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps((const float *)t), _mm256_set1_ps(dx[rb])), \
                          _mm256_cvtepi32_ps(_mm256_madd_epi16(si, ones)), acc); \
    acc = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)t + 8), _mm256_set1_ps(sx[rb]), acc); } while (0)

/* AVX2: R = 1..4 rows (r0..) against one 8-output group, every accumulator in its own register: lane j of
 * acc_i = row r0 + i, output 8g + j. Each row's sequence is the same whatever R. */
static inline __attribute__((always_inline)) EYAS_TGT_AVX2 void q4_rows_avx2(
    const uint8_t *tiles, int nb, const int8_t *xq, const float *dx, const float *sx, int r0, int K, uint16_t *out,
    int64_t ostride, int nout, const int R) {
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const int8_t *x0 = xq + (int64_t)r0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    const int64_t b0 = (int64_t)r0 * nb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q4_TILE;
        if (r0 == 0) prefetch_ahead(t, Q4_TILE);  /* later row groups find the tiles in L1 */
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(t + 64 + 32 * p));
            const __m256i lo = _mm256_and_si256(raw, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            Q4_DOT(s0, x0 + b * 32);
            if (R > 1) Q4_DOT(s1, x1 + b * 32);
            if (R > 2) Q4_DOT(s2, x2 + b * 32);
            if (R > 3) Q4_DOT(s3, x3 + b * 32);
        }
        Q4_CLOSE(c0, s0, b0 + b);
        if (R > 1) Q4_CLOSE(c1, s1, b0 + nb + b);
        if (R > 2) Q4_CLOSE(c2, s2, b0 + 2 * nb + b);
        if (R > 3) Q4_CLOSE(c3, s3, b0 + 3 * nb + b);
    }
    q4_store(c0, out, nout);
    if (R > 1) q4_store(c1, out + ostride, nout);
    if (R > 2) q4_store(c2, out + 2 * ostride, nout);
    if (R > 3) q4_store(c3, out + 3 * ostride, nout);
}

/* rows in groups of 4, then the 1-3 left in one group (each group shares the unpacked nibbles); a row's own
 * sequence is the same in every group */
static EYAS_TGT_AVX2 void q4_group_avx2 Q4_GROUP_PARAMS {
    int r = 0;
    for (; r + 4 <= M; r += 4) q4_rows_avx2(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 4);
    if (M - r == 3) q4_rows_avx2(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 3);
    if (M - r == 2) q4_rows_avx2(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 2);
    if (M - r == 1) q4_rows_avx2(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 1);
}

/* AVX-512 VNNI: R = 1..8 rows against one 8-output group (32 vector registers hold 8 rows' sums and accumulators).
 * vpdpbusd adds lane j's four nibble x xq products to its int32 sum, so P needs no int16 stage. */
static inline __attribute__((always_inline)) EYAS_TGT_AVX512 void q4_rows_vnni(
    const uint8_t *tiles, int nb, const int8_t *xq, const float *dx, const float *sx, int r0, int K, uint16_t *out,
    int64_t ostride, int nout, const int R) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 c[8];
    for (int i = 0; i < R; i++) c[i] = _mm256_setzero_ps();
    const int8_t *x0 = xq + (int64_t)r0 * K;
    const int64_t b0 = (int64_t)r0 * nb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q4_TILE;
        if (r0 == 0) prefetch_ahead(t, Q4_TILE);
        __m256i s[8], h[8];  /* low- and high-nibble sums apart: two short dependency chains per row */
        for (int i = 0; i < R; i++) s[i] = h[i] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(t + 64 + 32 * p));
            const __m256i lo = _mm256_and_si256(raw, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            for (int i = 0; i < R; i++) {
                const int8_t *xb = x0 + (int64_t)i * K + b * 32;
                int32_t a0, a1;
                memcpy(&a0, xb + 4 * p, 4);
                memcpy(&a1, xb + 4 * p + 16, 4);
                s[i] = _mm256_dpbusd_epi32(s[i], lo, _mm256_set1_epi32(a0));
                h[i] = _mm256_dpbusd_epi32(h[i], hi, _mm256_set1_epi32(a1));
            }
        }
        const __m256 d = _mm256_loadu_ps((const float *)t), m = _mm256_loadu_ps((const float *)t + 8);
        for (int i = 0; i < R; i++) {
            const int64_t rb = b0 + (int64_t)i * nb + b;
            const __m256i P = _mm256_add_epi32(s[i], h[i]);
            c[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[rb])), _mm256_cvtepi32_ps(P), c[i]);
            c[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[rb]), c[i]);
        }
    }
    for (int i = 0; i < R; i++) q4_store(c[i], out + (int64_t)i * ostride, nout);
}

static EYAS_TGT_AVX512 void q4_group_avx512 Q4_GROUP_PARAMS {
    int r = 0;
    for (; r + 8 <= M; r += 8) q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 8);
    switch (M - r) {  /* the 1-7 left in one group */
    case 7: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 7); break;
    case 6: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 6); break;
    case 5: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 5); break;
    case 4: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 4); break;
    case 3: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 3); break;
    case 2: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 2); break;
    case 1: q4_rows_vnni(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 1); break;
    default: break;
    }
}
#endif

int eyas_q4_matmul_bf16(const uint16_t *x, const uint8_t *tiles, uint16_t *out, int M, int N, int K,
                        int nthreads) {
    const int nb = K / 32, G = (N + 7) / 8;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb), *sx = malloc(sizeof(float) * (size_t)M * nb);
    if (!xq || !dx || !sx) {  /* out untouched */
        free(xq); free(dx); free(sx);
        return EYAS_ENOMEM;
    }
    void (*const quant)(const uint16_t *, int8_t *, float *, float *, int64_t) = EYAS_PICK(q4_quant);
    void (*const group)Q4_GROUP_PARAMS = EYAS_PICK(q4_group);
#pragma omp parallel num_threads(G > 1 ? nthreads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < (int64_t)M * nb; rb++) quant(x, xq, dx, sx, rb);
#pragma omp for schedule(static)
        for (int g = 0; g < G; g++)
            group(tiles + (int64_t)g * nb * Q4_TILE, nb, xq, dx, sx, M, K, out + 8 * g, N,
                  N - 8 * g < 8 ? N - 8 * g : 8);
    }
    free(xq);
    free(dx);
    free(sx);
    return EYAS_OK;
}
