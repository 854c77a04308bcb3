/* eyas CPU kernels: the output head with fp32 activations (a Q8_0 or an fp32 weight). */
#include "kernels.h"

#define LANES 8

/* logits [:, n] = x [M, K] . W[n]^T for a Q8_0 weight: qw int8 [N, K], d float [N, K/32] (w = d * q).
 * Row n of W is read once for all M rows of x; each (m, n) uses the same per-block sequence. */
EYAS_INLINE void q8_head_col_body(const int isa, const float *x, const int8_t *qw, const float *d, float *out, int M,
                                  int N, int K, int n) {
    (void)isa;  /* plain C: only the vectorization differs */
    const int nb = K / 32;
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
EYAS_VARIANTS(q8_head_col, (const float *x, const int8_t *qw, const float *d, float *out, int M, int N, int K, int n),
              x, qw, d, out, M, N, K, n)

void eyas_q8_matmul(const float *x, const int8_t *qw, const float *d, float *out, int M, int N, int K,
                    int nthreads) {
    void (*const col)(const float *, const int8_t *, const float *, float *, int, int, int, int) =
        EYAS_PICK(q8_head_col);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) col(x, qw, d, out, M, N, K, n);
}

/* out [:, n] = x [M, K] . w[n]^T for an fp32 weight [N, K] (a head that is not Q8_0) */
EYAS_INLINE void f32_head_col_body(const int isa, const float *x, const float *w, float *out, int M, int N, int K,
                                   int n) {
    (void)isa;
    const float *wn = w + (int64_t)n * K;
    for (int r = 0; r < M; r++) out[(int64_t)r * N + n] = dot_f32(x + (int64_t)r * K, wn, K);
}
EYAS_VARIANTS(f32_head_col, (const float *x, const float *w, float *out, int M, int N, int K, int n),
              x, w, out, M, N, K, n)

void eyas_f32_matmul(const float *x, const float *w, float *out, int M, int N, int K, int nthreads) {
    void (*const col)(const float *, const float *, float *, int, int, int, int) = EYAS_PICK(f32_head_col);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) col(x, w, out, M, N, K, n);
}
