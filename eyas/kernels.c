/* eyas CPU kernels: batch-invariant attention and the Q8_0 output head.
 *
 * Why: speculative verification runs S rows where plain decoding runs one. Library kernels (MKL sgemm,
 * torch's SDPA) pick their blocking and reduction order by row count, so row i of an S-row forward
 * differs in its last bits from the same row computed alone; in the native (bf16-activation) mode those
 * bits survive the next bf16 rounding and can flip a greedy token. Every output element here is computed
 * by the same instruction sequence whatever S, the batch, the mask or the position of the other rows:
 * one (row, head) walks its visible keys in position order; one (row, vocab entry) walks K in blocks of 32.
 * Built at first use with the machine's C compiler (see eyas/kernels.py); no torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

/* exp with a fixed polynomial (Cephes expf's), so the compiler can vectorize it and every build computes the
 * same function for every element; x <= -87 gives exactly 0 (masked keys carry -inf). */
static inline float exp_det(float x) {
    const float keep = x > -87.0f ? 1.0f : 0.0f;
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    const float r2 = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r2 + r + 1.0f;
    union { float f; int32_t i; } sc;
    sc.i = ((int32_t)n + 127) << 23;
    return y * sc.f * keep;
}

/* dot product with a fixed reduction tree (8 lane partials, then pairwise) */
static inline float dot_f32(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int t = 0; t < LANES; t++) acc[t] += a[d + t] * b[d + t];
    for (; d < n; d++) acc[d % LANES] += a[d] * b[d];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* q [B, S, nh, hd]; k, v: one layer's cache [B, kvh, maxlen, hd]; keys 0..start+S-1 are valid.
 * mask: NULL (causal: row i sees keys 0..start+i) or uint8 [*, S, start+S] with batch stride mask_bstride
 * (0 = one mask for every sequence). out [B, S, nh, hd].
 * One (sequence, head) per work item; its S rows walk the keys together so each key is read once, but every
 * row's arithmetic is its own sequence over its visible keys in position order (two passes: scores and max,
 * then exp-weights and values). */
void eyas_attention(const float *q, const float *k, const float *v, int64_t maxlen, int B, int S, int nh,
                    int kvh, int hd, int start, const uint8_t *mask, int64_t mask_bstride, float scale,
                    float *out, int nthreads) {
    const int T = start + S;
    const int group = nh / kvh;
    const int items = B * nh;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)S * (T > 0 ? T : 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)S * hd);
        float *mx = (float *)malloc(sizeof(float) * (size_t)S);
        float *l = (float *)malloc(sizeof(float) * (size_t)S);
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int b = it / nh, h = it % nh, g = h / group;
            const float *kb = k + ((int64_t)b * kvh + g) * maxlen * hd;
            const float *vb = v + ((int64_t)b * kvh + g) * maxlen * hd;
            const uint8_t *mb = mask ? mask + b * mask_bstride : NULL;
            for (int i = 0; i < S; i++) {
                mx[i] = -INFINITY;
                l[i] = 0.0f;
                for (int d = 0; d < hd; d++) acc[(int64_t)i * hd + d] = 0.0f;
            }
            for (int j = 0; j < T; j++) {
                const float *kj = kb + (int64_t)j * hd;
                for (int i = 0; i < S; i++) {
                    float s = -INFINITY;
                    if (mb ? mb[(int64_t)i * T + j] : j <= start + i) {
                        s = dot_f32(q + (((int64_t)b * S + i) * nh + h) * hd, kj, hd) * scale;
                        if (s > mx[i]) mx[i] = s;
                    }
                    sc[(int64_t)i * T + j] = s;
                }
            }
            for (int i = 0; i < S; i++) {
                /* weights of hidden keys are exactly 0 and are skipped below: the visible keys' sequence of
                   operations is the one a plain step performs */
                float *row = sc + (int64_t)i * T;
                const float m = mx[i];
                if (m == -INFINITY) continue;
                const int lim = mb ? T : start + i + 1;  /* causal rows: keys after lim are never read */
                for (int j = 0; j < lim; j++) row[j] = exp_det(row[j] - m);
                float li = 0.0f;
                for (int j = 0; j < lim; j++) li += row[j];
                l[i] = li;
            }
            for (int j = 0; j < T; j++) {
                const float *vj = vb + (int64_t)j * hd;
                for (int i = 0; i < S; i++) {
                    if (!mb && j > start + i) continue;
                    const float p = sc[(int64_t)i * T + j];
                    if (p == 0.0f || mx[i] == -INFINITY) continue;
                    float *a = acc + (int64_t)i * hd;
                    for (int d = 0; d < hd; d++) a[d] += p * vj[d];
                }
            }
            for (int i = 0; i < S; i++) {
                float *o = out + (((int64_t)b * S + i) * nh + h) * hd;
                const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                for (int d = 0; d < hd; d++) o[d] = acc[(int64_t)i * hd + d] * inv;
            }
        }
        free(sc);
        free(acc);
        free(mx);
        free(l);
    }
}

/* logits [M, N] = x [M, K] . W^T for a Q8_0 weight: qw int8 [N, K], d float [N, K/32] (w = d * q).
 * Rows of W are read once for all M rows of x; each (m, n) uses the same per-block sequence. */
void eyas_q8_matmul(const float *x, const int8_t *qw, const float *d, float *out, int M, int N, int K,
                    int nthreads) {
    const int nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const int8_t *wn = qw + (int64_t)n * K;
        const float *dn = d + (int64_t)n * nb;
        float accs[16][LANES];
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int mm = M - m0 < 16 ? M - m0 : 16;
            for (int r = 0; r < mm; r++)
                for (int t = 0; t < LANES; t++) accs[r][t] = 0.0f;
            for (int bI = 0; bI < nb; bI++) {
                float wf[32];
                for (int t = 0; t < 32; t++) wf[t] = (float)wn[bI * 32 + t];
                const float db = dn[bI];
                for (int r = 0; r < mm; r++) {
                    const float *xr = x + (int64_t)(m0 + r) * K + bI * 32;
                    float s[LANES] = {0};
                    for (int c = 0; c < 32; c += LANES)
                        for (int t = 0; t < LANES; t++) s[t] += wf[c + t] * xr[c + t];
                    for (int t = 0; t < LANES; t++) accs[r][t] += db * s[t];
                }
            }
            for (int r = 0; r < mm; r++) {
                float *a = accs[r];
                out[(int64_t)(m0 + r) * N + n] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            }
        }
    }
}

/* out [M, N] = x [M, K] . W^T for a 4-bit weight in GGUF Q4_0/Q4_1 block order: qs uint8 [N, K/2]
 * (block b of row n: byte t holds element t in its low nibble and element t+16 in its high nibble),
 * w = d * q + m per block (Q4_0: m = -8 d). Per row: sum_b d_b (q_b . x_b) + sum_b m_b sum(x_b). */
void eyas_q4_matmul(const float *x, const uint8_t *qs, const float *d, const float *mn, float *out, int M, int N,
                    int K, int nthreads) {
    const int nb = K / 32;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)M * nb);
    for (int r = 0; r < M; r++)
        for (int bI = 0; bI < nb; bI++) {
            const float *xr = x + (int64_t)r * K + bI * 32;
            float s[LANES] = {0};
            for (int c = 0; c < 32; c += LANES)
                for (int t = 0; t < LANES; t++) s[t] += xr[c + t];
            xsum[r * nb + bI] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const uint8_t *wn = qs + (int64_t)n * (K / 2);
        const float *dn = d + (int64_t)n * nb;
        const float *mnn = mn + (int64_t)n * nb;
        float accs[16][LANES];
        float accm[16];
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int mm = M - m0 < 16 ? M - m0 : 16;
            for (int r = 0; r < mm; r++) {
                for (int t = 0; t < LANES; t++) accs[r][t] = 0.0f;
                accm[r] = 0.0f;
            }
            for (int bI = 0; bI < nb; bI++) {
                uint8_t qq[32];
                float wf[32];
                const uint8_t *qb = wn + bI * 16;
                uint64_t w[2], lo[2], hi[2];
                memcpy(w, qb, 16);  /* nibbles via 64-bit words: compilers do not vectorize byte shifts */
                for (int t = 0; t < 2; t++) {
                    lo[t] = w[t] & 0x0F0F0F0F0F0F0F0FULL;
                    hi[t] = (w[t] >> 4) & 0x0F0F0F0F0F0F0F0FULL;
                }
                memcpy(qq, lo, 16);
                memcpy(qq + 16, hi, 16);
                for (int t = 0; t < 32; t++) wf[t] = (float)qq[t];
                const float db = dn[bI], mb = mnn[bI];
                for (int r = 0; r < mm; r++) {
                    const float *xr = x + (int64_t)(m0 + r) * K + bI * 32;
                    float s[LANES] = {0};
                    for (int c = 0; c < 32; c += LANES)
                        for (int t = 0; t < LANES; t++) s[t] += wf[c + t] * xr[c + t];
                    for (int t = 0; t < LANES; t++) accs[r][t] += db * s[t];
                    accm[r] += mb * xsum[(m0 + r) * nb + bI];
                }
            }
            for (int r = 0; r < mm; r++) {
                float *a = accs[r];
                out[(int64_t)(m0 + r) * N + n] =
                    (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) + accm[r];
            }
        }
    }
    free(xsum);
}

/* out [M, N] = x [M, K] . W^T for an fp32 weight [N, K] (a head that is not Q8_0), same scheme as above. */
void eyas_f32_matmul(const float *x, const float *w, float *out, int M, int N, int K, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const float *wn = w + (int64_t)n * K;
        for (int r = 0; r < M; r++) out[(int64_t)r * N + n] = dot_f32(x + (int64_t)r * K, wn, K);
    }
}
