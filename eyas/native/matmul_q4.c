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
 * Every (row, output) runs this same sequence whatever the number of rows in the call: row-invariant. */
#define Q4_TILE 192  /* bytes per (8-output group, 32-block) */

#ifdef EYAS_Q4_AVX2
/* row i's share of one nibble load: s_i += P over elements 4p..4p+3 and 4p+16..4p+19 of its block */
#define Q4_DOT(si, xb) do { int32_t a0_, a1_; memcpy(&a0_, (xb) + 4 * p, 4); memcpy(&a1_, (xb) + 4 * p + 16, 4); \
    si = _mm256_add_epi16(si, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0_)), \
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1_)))); } while (0)
/* row i's block b closes: acc_i = fma(d * dx, P, acc_i) ; acc_i = fma(m, sx, acc_i) */
#define Q4_CLOSE(acc, si, rb) do { \
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps((const float *)t), _mm256_set1_ps(dx[rb])), \
                          _mm256_cvtepi32_ps(_mm256_madd_epi16(si, ones)), acc); \
    acc = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)t + 8), _mm256_set1_ps(sx[rb]), acc); } while (0)

static inline void q4_store(__m256 acc, uint16_t *o, int nout) {
    float a[8];
    _mm256_storeu_ps(a, acc);
    for (int j = 0; j < nout; j++) o[j] = to_bf16(a[j]);
}

/* R = 1..4 rows (r0..) against one 8-output group, every accumulator in its own register: lane j of
 * acc_i = row r0 + i, output 8g + j. Each row's sequence is the same whatever R. */
static inline __attribute__((always_inline)) void q4_rows(const uint8_t *tiles, int nb, const int8_t *xq,
                                                          const float *dx, const float *sx, int r0, int K,
                                                          uint16_t *out, int64_t ostride, int nout, const int R) {
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
#else
/* the same arithmetic lane by lane, for machines without AVX2/FMA */
static void q4_row_scalar(const uint8_t *tiles, int nb, const int8_t *xr, const float *dxr, const float *sxr,
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
#endif

void eyas_q4_matmul_bf16(const uint16_t *x, const uint8_t *tiles, uint16_t *out, int M, int N, int K,
                         int nthreads) {
    const int nb = K / 32, G = (N + 7) / 8;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb), *sx = malloc(sizeof(float) * (size_t)M * nb);
#pragma omp parallel num_threads(G > 1 ? nthreads : 1)
    {
        /* activations: per row and block xq, dx and sx = dx * sum xq (each block on its own) */
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < (int64_t)M * nb; rb++) {
            float v[32];
            for (int t = 0; t < 32; t++) v[t] = from_bf16(x[rb * 32 + t]);
            const int s = quantize_q8_block(v, xq + rb * 32, dx + rb);
            sx[rb] = dx[rb] * (float)s;
        }
#pragma omp for schedule(static)
        for (int g = 0; g < G; g++) {
            const uint8_t *tg = tiles + (int64_t)g * nb * Q4_TILE;
            const int nout = N - 8 * g < 8 ? N - 8 * g : 8;
            uint16_t *og = out + 8 * g;
            int r = 0;
#ifdef EYAS_Q4_AVX2
            /* rows in groups of 4, then the 1-3 left in one group (each group shares the unpacked nibbles); a
             * row's own sequence is the same in every group */
            for (; r + 4 <= M; r += 4) q4_rows(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 4);
            if (M - r == 3) q4_rows(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 3);
            if (M - r == 2) q4_rows(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 2);
            if (M - r == 1) q4_rows(tg, nb, xq, dx, sx, r, K, og + (int64_t)r * N, N, nout, 1);
#else
            for (; r < M; r++)
                q4_row_scalar(tg, nb, xq + (int64_t)r * K, dx + (int64_t)r * nb, sx + (int64_t)r * nb,
                              og + (int64_t)r * N, nout);
#endif
        }
    }
    free(xq);
    free(dx);
    free(sx);
}
