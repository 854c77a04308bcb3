#include "kernels.h"

/* ---- 8-bit weights x 8-bit activations (ggml's Q8_0 x Q8_0 dot) -------------------------------------------
 * Weights come interleaved by 8 outputs (kernels.pack_q8): for output group g and 32-block b, a 288-byte tile
 * holds float d[8] (w = d * q) and 256 bytes where byte 32c + 4j + e is output j's element 4c + e, so a broadcast
 * of 4 activations feeds 8 outputs. x fp32 [M, K] is quantized per row and 32-block as for 4-bit weights
 * (quantize_q8_block). A block's dot is the exact integer P = sum q * xq (AVX2 takes |q| as unsigned bytes and
 * moves q's sign onto xq; each 4-element chunk is summed to int32 at once), then acc = fma(d * dx, P, acc), block
 * after block: every (row, output) runs this sequence whatever the number of rows in the call. The AVX-512 VNNI
 * variant sums (xq + 128) x q with vpdpbusd straight into int32 and takes 128 sum q off (q8_rows_vnni): the same
 * P, the same bits. */
#define Q8_TILE 288

/* the same arithmetic lane by lane, the reference the vector variants match bit for bit */
EYAS_INLINE void q8_row_scalar(const uint8_t *tiles, int nb, const int8_t *xr, const float *dxr, float *out,
                               int nout) {
    float acc[8] = {0};
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q8_TILE;
        float dv[8];
        memcpy(dv, t, 32);
        const int8_t *w = (const int8_t *)(t + 32), *xb = xr + b * 32;
        for (int j = 0; j < 8; j++) {
            int p = 0;
            for (int c = 0; c < 8; c++)
                for (int e = 0; e < 4; e++) p += w[32 * c + 4 * j + e] * xb[4 * c + e];
            acc[j] = fmaf(dv[j] * dxr[b], (float)p, acc[j]);
        }
    }
    for (int j = 0; j < nout; j++) out[j] = acc[j];
}

/* one 8-output group (tiles tg) for all M rows: out og [M, N] at column 8g */
#define Q8_GROUP_PARAMS (const uint8_t *tg, int nb, const int8_t *xq, const float *dx, int M, int K, float *og, \
                         int N, int nout)
static void q8_group_portable Q8_GROUP_PARAMS {
    for (int r = 0; r < M; r++)
        q8_row_scalar(tg, nb, xq + (int64_t)r * K, dx + (int64_t)r * nb, og + (int64_t)r * N, nout);
}

EYAS_INLINE void q8_quant_body(const int isa, const float *x, int8_t *xq, float *dx, int64_t rb) {
    quantize_q8_block(x + rb * 32, xq + rb * 32, dx + rb);
    if (isa >= EYAS_ISA_AVX512VNNI)  /* the VNNI dot reads xq + 128 (1..255) as unsigned bytes: see q8_rows_vnni */
        for (int t = 0; t < 32; t++) xq[rb * 32 + t] = (int8_t)(xq[rb * 32 + t] ^ -128);
}
EYAS_VARIANTS(q8_quant, (const float *x, int8_t *xq, float *dx, int64_t rb), x, xq, dx, rb)

#ifdef EYAS_X86
#define Q8_DOT(si, xb) do { int32_t a_; memcpy(&a_, (xb) + 4 * c, 4); \
    si = _mm256_add_epi32(si, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(a_), \
                                                                                           w)), ones)); } while (0)
#define Q8_CLOSE(acc, si, rb) \
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps((const float *)t), _mm256_set1_ps(dx[rb])), \
                          _mm256_cvtepi32_ps(si), acc)

static inline EYAS_TGT_AVX2 void q8_store(__m256 acc, float *o, int nout) {
    float a[8];
    _mm256_storeu_ps(a, acc);
    for (int j = 0; j < nout; j++) o[j] = a[j];
}

/* AVX2: R = 1..4 rows (r0..) against one 8-output group; lane j of acc_i = row r0 + i, output 8g + j */
static inline __attribute__((always_inline)) EYAS_TGT_AVX2 void q8_rows_avx2(
    const uint8_t *tiles, int nb, const int8_t *xq, const float *dx, int r0, int K, float *out, int64_t ostride,
    int nout, const int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const int8_t *x0 = xq + (int64_t)r0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    const int64_t b0 = (int64_t)r0 * nb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q8_TILE;
        if (r0 == 0) prefetch_ahead(t, Q8_TILE);
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 32 + 32 * c));
            const __m256i aw = _mm256_sign_epi8(w, w);
            Q8_DOT(s0, x0 + b * 32);
            if (R > 1) Q8_DOT(s1, x1 + b * 32);
            if (R > 2) Q8_DOT(s2, x2 + b * 32);
            if (R > 3) Q8_DOT(s3, x3 + b * 32);
        }
        Q8_CLOSE(c0, s0, b0 + b);
        if (R > 1) Q8_CLOSE(c1, s1, b0 + nb + b);
        if (R > 2) Q8_CLOSE(c2, s2, b0 + 2 * nb + b);
        if (R > 3) Q8_CLOSE(c3, s3, b0 + 3 * nb + b);
    }
    q8_store(c0, out, nout);
    if (R > 1) q8_store(c1, out + ostride, nout);
    if (R > 2) q8_store(c2, out + 2 * ostride, nout);
    if (R > 3) q8_store(c3, out + 3 * ostride, nout);
}

static EYAS_TGT_AVX2 void q8_group_avx2 Q8_GROUP_PARAMS {
    int r = 0;
    for (; r + 4 <= M; r += 4) q8_rows_avx2(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 4);
    if (M - r == 3) q8_rows_avx2(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 3);
    if (M - r == 2) q8_rows_avx2(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 2);
    if (M - r == 1) q8_rows_avx2(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 1);
}

/* AVX-512 VNNI: R = 1..8 rows against one 8-output group. vpdpbusd multiplies unsigned by signed bytes; xq arrives
 * as xq + 128 (the AVX-512 quantization writes it so), so sum (xq + 128) q = P + 128 sum q, and 128 sum q (one
 * vpdpbusd of ones per chunk, shared by the R rows) is taken off: the same integer P, exactly. */
static inline __attribute__((always_inline)) EYAS_TGT_AVX512 void q8_rows_vnni(
    const uint8_t *tiles, int nb, const int8_t *xq, const float *dx, int r0, int K, float *out, int64_t ostride,
    int nout, const int R) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[8];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    const int8_t *x0 = xq + (int64_t)r0 * K;
    const int64_t b0 = (int64_t)r0 * nb;
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = tiles + (int64_t)b * Q8_TILE;
        if (r0 == 0) prefetch_ahead(t, Q8_TILE);
        __m256i s[8], h[8];  /* chunks 0-3 and 4-7 apart: two short dependency chains per row */
        for (int i = 0; i < R; i++) s[i] = h[i] = _mm256_setzero_si256();
        __m256i ws = _mm256_setzero_si256(), ws2 = ws;  /* lane j: sum of output j's 32 weights */
        for (int c = 0; c < 4; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 32 + 32 * c));
            const __m256i w2 = _mm256_loadu_si256((const __m256i *)(t + 160 + 32 * c));
            ws = _mm256_dpbusd_epi32(ws, ones, w);
            ws2 = _mm256_dpbusd_epi32(ws2, ones, w2);
            for (int i = 0; i < R; i++) {
                int32_t a, a2;
                memcpy(&a, x0 + (int64_t)i * K + b * 32 + 4 * c, 4);
                memcpy(&a2, x0 + (int64_t)i * K + b * 32 + 16 + 4 * c, 4);
                s[i] = _mm256_dpbusd_epi32(s[i], _mm256_set1_epi32(a), w);
                h[i] = _mm256_dpbusd_epi32(h[i], _mm256_set1_epi32(a2), w2);
            }
        }
        const __m256i off = _mm256_slli_epi32(_mm256_add_epi32(ws, ws2), 7);
        const __m256 d = _mm256_loadu_ps((const float *)t);
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[b0 + (int64_t)i * nb + b])),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(s[i], h[i]), off)),
                                     acc[i]);
    }
    for (int i = 0; i < R; i++) q8_store(acc[i], out + (int64_t)i * ostride, nout);
}

static EYAS_TGT_AVX512 void q8_group_avx512 Q8_GROUP_PARAMS {
    int r = 0;
    for (; r + 8 <= M; r += 8) q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 8);
    switch (M - r) {  /* the 1-7 left in one group */
    case 7: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 7); break;
    case 6: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 6); break;
    case 5: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 5); break;
    case 4: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 4); break;
    case 3: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 3); break;
    case 2: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 2); break;
    case 1: q8_rows_vnni(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 1); break;
    default: break;
    }
}
#endif

int eyas_q8q8_matmul(const float *x, const uint8_t *tiles, float *out, int M, int N, int K, int nthreads) {
    const int nb = K / 32, G = (N + 7) / 8;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb);
    if (!xq || !dx) {  /* out untouched */
        free(xq); free(dx);
        return EYAS_ENOMEM;
    }
    void (*const quant)(const float *, int8_t *, float *, int64_t) = EYAS_PICK(q8_quant);
    void (*const group)Q8_GROUP_PARAMS = EYAS_PICK(q8_group);
#pragma omp parallel num_threads(G > 1 ? nthreads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < (int64_t)M * nb; rb++) quant(x, xq, dx, rb);
#pragma omp for schedule(static)
        for (int g = 0; g < G; g++)
            group(tiles + (int64_t)g * nb * Q8_TILE, nb, xq, dx, M, K, out + 8 * g, N, N - 8 * g < 8 ? N - 8 * g : 8);
    }
    free(xq);
    free(dx);
    return EYAS_OK;
}
