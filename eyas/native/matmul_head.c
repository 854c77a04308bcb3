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

/* out [M, N] = x [M, K] @ w [K, N] for an fp32 weight stored input-major (gpt-oss's experts, MLA's absorbed key
 * matrix): each (row, column) adds its K products in k order, one rounding for each product and each sum, whatever
 * M or the other rows; columns n0..n1 at a time, vectorized across columns only */
EYAS_INLINE void f32_kn_cols_body(const int isa, const float *x, const float *w, float *out, int M, int N, int K,
                                  int n0, int n1) {
    (void)isa;
    for (int r = 0; r < M; r++) {
        float *o = out + (int64_t)r * N;
        const float *xr = x + (int64_t)r * K;
        for (int n = n0; n < n1; n++) o[n] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float a = xr[k];
            const float *wk = w + (int64_t)k * N;
            for (int n = n0; n < n1; n++) o[n] += a * wk[n];
        }
    }
}
EYAS_VARIANTS(f32_kn_cols, (const float *x, const float *w, float *out, int M, int N, int K, int n0, int n1),
              x, w, out, M, N, K, n0, n1)

void eyas_f32_matmul_kn(const float *x, const float *w, float *out, int M, int N, int K, int nthreads) {
    void (*const cols)(const float *, const float *, float *, int, int, int, int, int) = EYAS_PICK(f32_kn_cols);
    const int blocks = (N + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int c = 0; c < blocks; c++) cols(x, w, out, M, N, K, c * 64, c * 64 + 64 < N ? c * 64 + 64 : N);
}
