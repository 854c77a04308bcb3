/* eyas CPU kernels: the output head with fp32 activations (a Q8_0 or an fp32 weight). */
#include "kernels.h"

#define LANES 8

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

/* out [M, N] = x [M, K] . W^T for an fp32 weight [N, K] (a head that is not Q8_0), same scheme as above. */
void eyas_f32_matmul(const float *x, const float *w, float *out, int M, int N, int K, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const float *wn = w + (int64_t)n * K;
        for (int r = 0; r < M; r++) out[(int64_t)r * N + n] = dot_f32(x + (int64_t)r * K, wn, K);
    }
}
