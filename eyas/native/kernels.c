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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EYAS_Q4_AVX2 1
#endif

static inline float fold8(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

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

/* exp_det on n consecutive values in place; 8 at a time with AVX2, the same operations lane by lane */
static inline void exp_det_n(float *x, int n) {
    int j = 0;
#ifdef EYAS_Q4_AVX2
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f), one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GT_OQ), one);
        v = _mm256_blendv_ps(lo, v, _mm256_cmp_ps(v, lo, _CMP_GT_OQ));
        v = _mm256_blendv_ps(hi, v, _mm256_cmp_ps(v, hi, _CMP_LT_OQ));
        const __m256 nn = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                                        _mm256_set1_ps(0.5f)));
        __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(nn, _mm256_set1_ps(0.693359375f)));
        r = _mm256_add_ps(r, _mm256_mul_ps(nn, _mm256_set1_ps(2.12194440e-4f)));
        const __m256 r2 = _mm256_mul_ps(r, r);
        __m256 y = _mm256_set1_ps(1.9875691500e-4f);
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
        y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, r2), r), one);
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(nn), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep));
    }
#endif
    for (; j < n; j++) x[j] = exp_det(x[j]);
}

/* q . k for hd % 16 == 0: lane t of two chains (16-element steps) takes elements t (mod 16) and t + 8 (mod 16)
 * by fused multiply-add; the chains add, then fold8 */
static inline float dot_hd16(const float *a, const float *b, int hd) {
    float t[8];
#ifdef EYAS_Q4_AVX2
    __m256 e = _mm256_setzero_ps(), o = e;
    for (int d = 0; d < hd; d += 16) {
        e = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), e);
        o = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), o);
    }
    _mm256_storeu_ps(t, _mm256_add_ps(e, o));
#else
    float o[8] = {0};
    for (int u = 0; u < 8; u++) t[u] = 0.0f;
    for (int d = 0; d < hd; d += 16)
        for (int u = 0; u < 8; u++) {
            t[u] = fmaf(a[d + u], b[d + u], t[u]);
            o[u] = fmaf(a[d + 8 + u], b[d + 8 + u], o[u]);
        }
    for (int u = 0; u < 8; u++) t[u] += o[u];
#endif
    return fold8(t);
}

/* one query row of one head over its visible keys, in position order: scores and max, exp-weights (hidden
 * keys weigh exactly 0 and are skipped), their sum, then the weighted values. Keys are walked one by one in
 * slot order and every per-key quantity is the key's own, so a tree row (its ancestors at other slots, the
 * rest masked) computes the bits the same token gets in plain decoding. hd % 16 == 0 runs dot_hd16 and
 * fused multiply-adds; other head sizes the plain-C path. hd is a literal at the call sites. */
static inline void attend_row(const float *qi, const float *kb, const float *vb, const uint8_t *mi, int lim,
                              float scale, float *row, float *o, const int hd) {
    const int v16 = hd % 16 == 0;
    float m = -INFINITY;
    for (int j = 0; j < lim; j++) {
        float sj = -INFINITY;
        if (!mi || mi[j]) {
            sj = (v16 ? dot_hd16(qi, kb + (int64_t)j * hd, hd) : dot_f32(qi, kb + (int64_t)j * hd, hd)) * scale;
            if (sj > m) m = sj;
        }
        row[j] = sj;
    }
    float acc[256];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int j = 0; j < lim; j++) row[j] -= m;
        exp_det_n(row, lim);
        for (int j = 0; j < lim; j++) l += row[j];
        for (int j = 0; j < lim; j++) {
            const float p = row[j];
            if (p == 0.0f) continue;
            const float *vj = vb + (int64_t)j * hd;
            if (v16)
                for (int d = 0; d < hd; d++) acc[d] = fmaf(p, vj[d], acc[d]);
            else
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

/* gu [R, 2I] bf16 (gate | up) -> out [R, I] bf16 = silu(gate) * up; every element on its own, so any split of
 * the (row, 256-column chunk) items over threads gives the same bits */
void eyas_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int R, int I, int nthreads) {
    const int chunks = (I + 255) / 256, items = R * chunks;
#pragma omp parallel for schedule(static) num_threads((int64_t)R * I >= 4096 ? nthreads : 1)
    for (int it = 0; it < items; it++) {
        const int r = it / chunks, c0 = (it % chunks) * 256;
        const uint16_t *g = gu + (int64_t)r * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)r * I;
        float buf[256];
        const int n = I - c0 < 256 ? I - c0 : 256;
        for (int c = 0; c < n; c++) buf[c] = -from_bf16(g[c0 + c]);
        exp_det_n(buf, n);
        for (int c = 0; c < n; c++) buf[c] = from_bf16(g[c0 + c]) / (1.0f + buf[c]) * from_bf16(u[c0 + c]);
        for (int c = 0; c < n; c++) o[c0 + c] = to_bf16(buf[c]);
    }
}

/* qkv [B, S, (nh + 2 kvh) hd] bf16 from the fused projection; cos, sin [B, S, hd] (HF rotary, rotate-half form).
 * Rotates q and k, writes k and v into cache slots start..start+S-1 (or, with slots and S = 1, row b's at slot
 * slots[b] <= start: rows of different lengths in one cache, the mask saying which slots each row sees), attends
 * (eyas_attention) and writes out [B, S, nh hd] bf16. qbuf, obuf: fp32 scratch of B*S*nh*hd. */
void eyas_rope_attend(const uint16_t *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t maxlen,
                      int B, int S, int nh, int kvh, int hd, int start, const int64_t *slots, const uint8_t *mask,
                      int64_t mask_bstride, float scale, float *qbuf, float *obuf, uint16_t *out, int nthreads) {
    const int half = hd / 2, width = (nh + 2 * kvh) * hd;
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            const int64_t slot = slots ? slots[b] : start + s;
            const uint16_t *row = qkv + ((int64_t)b * S + s) * width;
            const float *cs = cos + ((int64_t)b * S + s) * hd, *sn = sin + ((int64_t)b * S + s) * hd;
            for (int h = 0; h < nh + kvh; h++) {
                const uint16_t *src = row + h * hd;
                float *dst = h < nh ? qbuf + (((int64_t)b * S + s) * nh + h) * hd
                                    : kc + (((int64_t)b * kvh + (h - nh)) * maxlen + slot) * hd;
                for (int d = 0; d < hd; d++) {
                    const float x = from_bf16(src[d]);
                    const float rot = d < half ? -from_bf16(src[d + half]) : from_bf16(src[d - half]);
                    dst[d] = x * cs[d] + rot * sn[d];
                }
            }
            for (int h = 0; h < kvh; h++) {
                const uint16_t *src = row + (nh + kvh + h) * hd;
                float *dst = vc + (((int64_t)b * kvh + h) * maxlen + slot) * hd;
                for (int d = 0; d < hd; d++) dst[d] = from_bf16(src[d]);
            }
        }
    eyas_attention(qbuf, kc, vc, maxlen, B, S, nh, kvh, hd, start, mask, mask_bstride, scale, obuf, nthreads);
    const int64_t n = (int64_t)B * S * nh * hd;
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(obuf[i]);
}

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

/* A decode step streams ~126 MB of weights, far beyond the L3, and at 1-4 rows the arithmetic per tile is too
 * short for the hardware prefetcher to keep DRAM busy: ask for the tile 8 tiles ahead (the next group's tiles
 * follow this group's, so the distance runs on across groups). benchmarks/kernel_ab.py --cold-mb 128: 1 / 2 / 4
 * / 8 rows at 0.92 / 0.88 / 0.95 / 0.98 of the time without it (4 tiles ahead: 0.94 / 0.93 / 0.97 / 0.97,
 * 16: 0.93 / 0.89 / 0.94 / 0.99); only a call's first group of rows asks (the others find the tiles in L1).
 * A prefetch never changes a result. */
#define PREFETCH_TILES 8
static inline void prefetch_ahead(const uint8_t *t, int tile) {
    for (int off = 0; off < tile; off += 64) __builtin_prefetch(t + PREFETCH_TILES * tile + off, 0, 3);
}

/* one 32-block of activations -> xq int8 [32] and its scale dx (max|v| / 127); returns sum xq */
static inline int quantize_q8_block(const float *v, int8_t *qb, float *dx) {
    float amax = 0.0f;
    for (int t = 0; t < 32; t++) {
        const float a = fabsf(v[t]);
        amax = a > amax ? a : amax;  /* fmaxf is a libm call here */
    }
    const float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
    int sum = 0;
    for (int t = 0; t < 32; t++) {
        const int q = (int)nearbyintf(v[t] * id);
        qb[t] = (int8_t)q;
        sum += q;
    }
    *dx = dd;
    return sum;
}

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

/* The native decoder stack in one call (every matrix 4-bit, plain llama layer): per layer
 *   h = rms(x += pending) ; [store x] ; qkv = h.Wqkv ; o = attend(rope(qkv)) ; h = rms(x += o.Wo)
 *   pending = silu_mul(h.Wgu).Wd
 * and finally x += pending: the same kernels, in the same order, as the per-layer Python loop it replaces
 * (eyas/model.py: _fused_layers), without ~200 Python-level calls per forward. x [R, H] fp32 is updated in
 * place; store[i] (or NULL) receives x at stream i. */
void eyas_q4_layers(float *x, int R, int H, int L, const uint8_t *const *wqkv, const uint8_t *const *wo,
                    const uint8_t *const *wgu, const uint8_t *const *wd, const float *const *ln1,
                    const float *const *ln2, float eps, const float *cos, const float *sin, float *const *kc,
                    float *const *vc, int64_t maxlen, int B, int S, int nh, int kvh, int hd, int I, int start,
                    const int64_t *slots, const uint8_t *const *masks, const int64_t *mask_bstrides, float scale, float *const *store,
                    int nthreads) {
    const int nqkv = (nh + 2 * kvh) * hd, no = nh * hd;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)R * H), *qkv = malloc(sizeof(uint16_t) * (size_t)R * nqkv);
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)R * no), *ob = malloc(sizeof(uint16_t) * (size_t)R * H);
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)R * 2 * I), *act = malloc(sizeof(uint16_t) * (size_t)R * I);
    uint16_t *pend = malloc(sizeof(uint16_t) * (size_t)R * H);
    float *qbuf = malloc(sizeof(float) * (size_t)R * no), *obuf = malloc(sizeof(float) * (size_t)R * no);
    for (int i = 0; i < L; i++) {
        eyas_add_rms_bf16(x, i ? pend : NULL, ln1[i], h, R, H, eps, nthreads);
        if (store[i]) memcpy(store[i], x, sizeof(float) * (size_t)R * H);
        eyas_q4_matmul_bf16(h, wqkv[i], qkv, R, nqkv, H, nthreads);
        eyas_rope_attend(qkv, cos, sin, kc[i], vc[i], maxlen, B, S, nh, kvh, hd, start, slots, masks[i],
                         mask_bstrides[i], scale, qbuf, obuf, o, nthreads);
        eyas_q4_matmul_bf16(o, wo[i], ob, R, H, no, nthreads);
        eyas_add_rms_bf16(x, ob, ln2[i], h, R, H, eps, nthreads);
        eyas_q4_matmul_bf16(h, wgu[i], gu, R, 2 * I, H, nthreads);
        eyas_silu_mul_bf16(gu, act, R, I, nthreads);
        eyas_q4_matmul_bf16(act, wd[i], pend, R, H, I, nthreads);
    }
    if (L) {
        const int64_t n = (int64_t)R * H;
        for (int64_t j = 0; j < n; j++) x[j] = x[j] + from_bf16(pend[j]);
    }
    free(h); free(qkv); free(o); free(ob); free(gu); free(act); free(pend); free(qbuf); free(obuf);
}

/* ---- 8-bit weights x 8-bit activations (ggml's Q8_0 x Q8_0 dot) -------------------------------------------
 * Weights come interleaved by 8 outputs (kernels.pack_q8): for output group g and 32-block b, a 288-byte tile
 * holds float d[8] (w = d * q) and 256 bytes where byte 32c + 4j + e is output j's element 4c + e, so a broadcast
 * of 4 activations feeds 8 outputs. x fp32 [M, K] is quantized per row and 32-block as above. A block's dot is
 * the exact integer P = sum q * xq (AVX2 takes |q| as unsigned bytes and moves q's sign onto xq; each 4-element
 * chunk is summed to int32 at once), then acc = fma(d * dx, P, acc), block after block: every (row, output)
 * runs this sequence whatever the number of rows in the call. */
#define Q8_TILE 288

#ifdef EYAS_Q4_AVX2
#define Q8_DOT(si, xb) do { int32_t a_; memcpy(&a_, (xb) + 4 * c, 4); \
    si = _mm256_add_epi32(si, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(a_), \
                                                                                           w)), ones)); } while (0)
#define Q8_CLOSE(acc, si, rb) \
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps((const float *)t), _mm256_set1_ps(dx[rb])), \
                          _mm256_cvtepi32_ps(si), acc)

static inline void q8_store(__m256 acc, float *o, int nout) {
    float a[8];
    _mm256_storeu_ps(a, acc);
    for (int j = 0; j < nout; j++) o[j] = a[j];
}

/* R = 1..4 rows (r0..) against one 8-output group; lane j of acc_i = row r0 + i, output 8g + j */
static inline __attribute__((always_inline)) void q8_rows(const uint8_t *tiles, int nb, const int8_t *xq,
                                                          const float *dx, int r0, int K, float *out,
                                                          int64_t ostride, int nout, const int R) {
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
#else
static void q8_row_scalar(const uint8_t *tiles, int nb, const int8_t *xr, const float *dxr, float *out, int nout) {
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
#endif

void eyas_q8q8_matmul(const float *x, const uint8_t *tiles, float *out, int M, int N, int K, int nthreads) {
    const int nb = K / 32, G = (N + 7) / 8;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb);
#pragma omp parallel num_threads(G > 1 ? nthreads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < (int64_t)M * nb; rb++) quantize_q8_block(x + rb * 32, xq + rb * 32, dx + rb);
#pragma omp for schedule(static)
        for (int g = 0; g < G; g++) {
            const uint8_t *tg = tiles + (int64_t)g * nb * Q8_TILE;
            const int nout = N - 8 * g < 8 ? N - 8 * g : 8;
            float *og = out + 8 * g;
            int r = 0;
#ifdef EYAS_Q4_AVX2
            for (; r + 4 <= M; r += 4) q8_rows(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 4);
            if (M - r == 3) q8_rows(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 3);
            if (M - r == 2) q8_rows(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 2);
            if (M - r == 1) q8_rows(tg, nb, xq, dx, r, K, og + (int64_t)r * N, N, nout, 1);
#else
            for (; r < M; r++)
                q8_row_scalar(tg, nb, xq + (int64_t)r * K, dx + (int64_t)r * nb, og + (int64_t)r * N, nout);
#endif
        }
    }
    free(xq);
    free(dx);
}

/* ---- the EAGLE-3 draft layer in one call (serving, q8 draft weights) -----------------------------------------
 * R rows: x = [rms(emb) * w_in | rms(hidden) * w_hid] ; qkv = x . Wqkv ; RoPE on q, k ; k, v written at draft-cache
 * slots start.. ; attention over slots 0..start+R-1 under mask [R, start+R] ; h = hidden + o . Wo ;
 * out = h + (silu(g) * u) . Wd with [g | u] = rms(h) * w_post . Wgu. The same arithmetic as eyas.draft's torch
 * modules, without ~60 op dispatches per step; the draft only proposes, so its bits never change an output. */
static void rms_rows_f32(const float *x, const float *w, float *out, int R, int H, float eps, int ostride) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * H;
        const float inv = 1.0f / sqrtf(dot_f32(xr, xr, H) / (float)H + eps);
        for (int c = 0; c < H; c++) out[(int64_t)r * ostride + c] = w[c] * (xr[c] * inv);
    }
}

void eyas_draft_layer(const float *hidden, const float *emb, const float *cos, const float *sin,
                      const uint8_t *wqkv, const uint8_t *wo, const uint8_t *wgu, const uint8_t *wd,
                      const float *w_in, const float *w_hid, const float *w_post, float eps,
                      float *kc, float *vc, int64_t maxlen, int R, int H, int nh, int kvh, int hd, int I, int start,
                      const uint8_t *mask, float scale, float *out, int nthreads) {
    const int nq = nh * hd, nkv = kvh * hd, nqkv = nq + 2 * nkv, half = hd / 2;
    float *x = malloc(sizeof(float) * (size_t)R * 2 * H), *qkv = malloc(sizeof(float) * (size_t)R * nqkv);
    float *q = malloc(sizeof(float) * (size_t)R * nq), *att = malloc(sizeof(float) * (size_t)R * nq);
    float *h = malloc(sizeof(float) * (size_t)R * H), *gu = malloc(sizeof(float) * (size_t)R * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)R * I), *y = malloc(sizeof(float) * (size_t)R * H);
    rms_rows_f32(emb, w_in, x, R, H, eps, 2 * H);
    rms_rows_f32(hidden, w_hid, x + H, R, H, eps, 2 * H);
    eyas_q8q8_matmul(x, wqkv, qkv, R, nqkv, 2 * H, nthreads);
    for (int r = 0; r < R; r++) {
        const float *row = qkv + (int64_t)r * nqkv, *cs = cos + (int64_t)r * hd, *sn = sin + (int64_t)r * hd;
        for (int hh = 0; hh < nh + kvh; hh++) {
            const float *src = row + hh * hd;
            float *dst = hh < nh ? q + ((int64_t)r * nh + hh) * hd
                                 : kc + ((int64_t)(hh - nh) * maxlen + start + r) * hd;
            for (int d = 0; d < hd; d++) {
                const float rot = d < half ? -src[d + half] : src[d - half];
                dst[d] = src[d] * cs[d] + rot * sn[d];
            }
        }
        for (int hh = 0; hh < kvh; hh++)
            memcpy(vc + ((int64_t)hh * maxlen + start + r) * hd, row + nq + nkv + hh * hd, sizeof(float) * hd);
    }
    eyas_attention(q, kc, vc, maxlen, 1, R, nh, kvh, hd, start, mask, 0, scale, att, nthreads);
    eyas_q8q8_matmul(att, wo, h, R, H, nq, nthreads);
    for (int64_t i = 0; i < (int64_t)R * H; i++) h[i] += hidden[i];
    rms_rows_f32(h, w_post, x, R, H, eps, H);
    eyas_q8q8_matmul(x, wgu, gu, R, 2 * I, H, nthreads);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < I; c++) {
            const float g = gu[(int64_t)r * 2 * I + c], u = gu[(int64_t)r * 2 * I + I + c];
            act[(int64_t)r * I + c] = g / (1.0f + expf(-g)) * u;
        }
    eyas_q8q8_matmul(act, wd, y, R, H, I, nthreads);
    for (int64_t i = 0; i < (int64_t)R * H; i++) out[i] = h[i] + y[i];
    free(x); free(qkv); free(q); free(att); free(h); free(gu); free(act); free(y);
}
