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

/* dot product with a fixed reduction order: 32 partial sums (four 8-wide chains, so the FMA latency is
 * hidden), folded pairwise. Every caller gets the same sequence for the same n. */
static inline float dot_f32(const float *a, const float *b, int n) {
    float acc[32] = {0};
    int d = 0;
    for (; d + 32 <= n; d += 32)
        for (int t = 0; t < 32; t++) acc[t] += a[d + t] * b[d + t];
    for (int t = 0; d < n && t < 32; d++, t++) acc[t] += a[d] * b[d];  /* the n % 32 tail */
    for (int w = 16; w >= 1; w /= 2)
        for (int t = 0; t < w; t++) acc[t] += acc[t + w];
    return acc[0];
}

/* one query row of one head over its visible keys, in position order: scores and max, exp-weights (hidden
 * keys weigh exactly 0 and are skipped), their sum, then the weighted values. hd is a literal at the call
 * sites below so the accumulator stays in registers. */
static inline void attend_row(const float *qi, const float *kb, const float *vb, const uint8_t *mi, int lim,
                              float scale, float *row, float *o, const int hd) {
    float m = -INFINITY;
    for (int j = 0; j < lim; j++) {
        float sj = -INFINITY;
        if (!mi || mi[j]) {
            sj = dot_f32(qi, kb + (int64_t)j * hd, hd) * scale;
            if (sj > m) m = sj;
        }
        row[j] = sj;
    }
    float acc[256];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int j = 0; j < lim; j++) row[j] = exp_det(row[j] - m);
        for (int j = 0; j < lim; j++) l += row[j];
        for (int j = 0; j < lim; j++) {
            const float p = row[j];
            if (p == 0.0f) continue;
            const float *vj = vb + (int64_t)j * hd;
            for (int d = 0; d < hd; d++) acc[d] += p * vj[d];
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < hd; d++) o[d] = acc[d] * inv;
}

/* q [B, S, nh, hd]; k, v: one layer's cache [B, kvh, maxlen, hd]; keys 0..start+S-1 are valid.
 * mask: NULL (causal: row i sees keys 0..start+i) or uint8 [*, S, start+S] with batch stride mask_bstride
 * (0 = one mask for every sequence). out [B, S, nh, hd]. hd <= 256.
 * Work item = (sequence, head, row): a row's arithmetic never depends on the other rows. */
void eyas_attention(const float *q, const float *k, const float *v, int64_t maxlen, int B, int S, int nh,
                    int kvh, int hd, int start, const uint8_t *mask, int64_t mask_bstride, float scale,
                    float *out, int nthreads) {
    const int T = start + S;
    const int group = nh / kvh;
    const int items = B * nh * S;
#pragma omp parallel num_threads(items > 1 ? nthreads : 1)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)(T > 0 ? T : 1));
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int b = it / (nh * S), h = (it / S) % nh, i = it % S, g = h / group;
            const float *kb = k + ((int64_t)b * kvh + g) * maxlen * hd;
            const float *vb = v + ((int64_t)b * kvh + g) * maxlen * hd;
            const uint8_t *mi = mask ? mask + b * mask_bstride + (int64_t)i * T : NULL;
            const int lim = mask ? T : start + i + 1;
            const float *qi = q + (((int64_t)b * S + i) * nh + h) * hd;
            float *o = out + (((int64_t)b * S + i) * nh + h) * hd;
            switch (hd) {
            case 64: attend_row(qi, kb, vb, mi, lim, scale, row, o, 64); break;
            case 128: attend_row(qi, kb, vb, mi, lim, scale, row, o, 128); break;
            default: attend_row(qi, kb, vb, mi, lim, scale, row, o, hd);
            }
        }
        free(row);
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

/* out [M, N] = x [M, K] . W^T for an fp32 weight [N, K] (a head that is not Q8_0), same scheme as above. */
void eyas_f32_matmul(const float *x, const float *w, float *out, int M, int N, int K, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const float *wn = w + (int64_t)n * K;
        for (int r = 0; r < M; r++) out[(int64_t)r * N + n] = dot_f32(x + (int64_t)r * K, wn, K);
    }
}

/* ---- the native layer's glue: norms, RoPE + KV write + attention, SwiGLU, in bf16/fp32 ---------------------
 * One call per step instead of a dozen torch ops (each ~5 us of dispatch: ~40% of a 4-bit decode step).
 * bf16 values are uint16 with round-to-nearest-even, as torch converts. Every row is computed on its own. */

static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    const uint32_t r = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);  /* branch-free: vectorizes */
}

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* x [R, H] fp32 (+= y bf16 [R, H] when y is given), then out = bf16(w * (x * rsqrt(mean(x^2) + eps))) */
void eyas_add_rms_bf16(float *x, const uint16_t *y, const float *w, uint16_t *out, int R, int H, float eps,
                       int nthreads) {
#pragma omp parallel for schedule(static) num_threads(R > 16 ? nthreads : 1)
    for (int r = 0; r < R; r++) {
        float *xr = x + (int64_t)r * H;
        if (y)
            for (int c = 0; c < H; c++) xr[c] += from_bf16(y[(int64_t)r * H + c]);
        const float ss = dot_f32(xr, xr, H);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        uint16_t *o = out + (int64_t)r * H;
        for (int c = 0; c < H; c++) o[c] = to_bf16(w[c] * (xr[c] * inv));
    }
}

/* gu [R, 2I] bf16 (gate | up) -> out [R, I] bf16 = silu(gate) * up */
void eyas_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int R, int I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(R > 16 ? nthreads : 1)
    for (int r = 0; r < R; r++) {
        const uint16_t *g = gu + (int64_t)r * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)r * I;
        float buf[256];
        for (int c0 = 0; c0 < I; c0 += 256) {  /* simple passes over a small buffer: each one vectorizes */
            const int n = I - c0 < 256 ? I - c0 : 256;
            for (int c = 0; c < n; c++) buf[c] = exp_det(-from_bf16(g[c0 + c]));
            for (int c = 0; c < n; c++) buf[c] = from_bf16(g[c0 + c]) / (1.0f + buf[c]) * from_bf16(u[c0 + c]);
            for (int c = 0; c < n; c++) o[c0 + c] = to_bf16(buf[c]);
        }
    }
}

/* qkv [B, S, (nh + 2 kvh) hd] bf16 from the fused projection; cos, sin [B, S, hd] (HF rotary, rotate-half form).
 * Rotates q and k, writes k and v into cache slots start..start+S-1, attends (eyas_attention) and writes
 * out [B, S, nh hd] bf16. qbuf, obuf: fp32 scratch of B*S*nh*hd. */
void eyas_rope_attend(const uint16_t *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t maxlen,
                      int B, int S, int nh, int kvh, int hd, int start, const uint8_t *mask, int64_t mask_bstride,
                      float scale, float *qbuf, float *obuf, uint16_t *out, int nthreads) {
    const int half = hd / 2, width = (nh + 2 * kvh) * hd;
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            const uint16_t *row = qkv + ((int64_t)b * S + s) * width;
            const float *cs = cos + ((int64_t)b * S + s) * hd, *sn = sin + ((int64_t)b * S + s) * hd;
            for (int h = 0; h < nh + kvh; h++) {
                const uint16_t *src = row + h * hd;
                float *dst = h < nh ? qbuf + (((int64_t)b * S + s) * nh + h) * hd
                                    : kc + (((int64_t)b * kvh + (h - nh)) * maxlen + start + s) * hd;
                for (int d = 0; d < hd; d++) {
                    const float x = from_bf16(src[d]);
                    const float rot = d < half ? -from_bf16(src[d + half]) : from_bf16(src[d - half]);
                    dst[d] = x * cs[d] + rot * sn[d];
                }
            }
            for (int h = 0; h < kvh; h++) {
                const uint16_t *src = row + (nh + kvh + h) * hd;
                float *dst = vc + (((int64_t)b * kvh + h) * maxlen + start + s) * hd;
                for (int d = 0; d < hd; d++) dst[d] = from_bf16(src[d]);
            }
        }
    eyas_attention(qbuf, kc, vc, maxlen, B, S, nh, kvh, hd, start, mask, mask_bstride, scale, obuf, nthreads);
    const int64_t n = (int64_t)B * S * nh * hd;
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(obuf[i]);
}
