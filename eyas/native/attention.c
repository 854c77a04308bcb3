/* eyas CPU kernels: batch-invariant attention, and RoPE + KV-cache write + attention for the native layer. */
#include "kernels.h"

static inline float fold8(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* q . k for hd % 16 == 0: lane t of two chains (16-element steps) takes elements t (mod 16) and t + 8 (mod 16)
 * by fused multiply-add; the chains add, then fold8 */
EYAS_INLINE float dot_hd16(const float *a, const float *b, int hd) {
    float t[8], o[8] = {0};
    for (int u = 0; u < 8; u++) t[u] = 0.0f;
    for (int d = 0; d < hd; d += 16)
        for (int u = 0; u < 8; u++) {
            t[u] = fmaf(a[d + u], b[d + u], t[u]);
            o[u] = fmaf(a[d + 8 + u], b[d + 8 + u], o[u]);
        }
    for (int u = 0; u < 8; u++) t[u] += o[u];
    return fold8(t);
}

#ifdef EYAS_X86
/* the same with the two chains in two AVX2 registers */
static inline EYAS_TGT_AVX2 float dot_hd16_avx2(const float *a, const float *b, int hd) {
    float t[8];
    __m256 e = _mm256_setzero_ps(), o = e;
    for (int d = 0; d < hd; d += 16) {
        e = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), e);
        o = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), o);
    }
    _mm256_storeu_ps(t, _mm256_add_ps(e, o));
    return fold8(t);
}

/* the same with both chains in one AVX-512 register (lanes 0-7: the first chain, 8-15: the second) */
static inline EYAS_TGT_AVX512 float dot_hd16_avx512(const float *a, const float *b, int hd) {
    float t[8];
    __m512 eo = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) eo = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), eo);
    _mm256_storeu_ps(t, _mm256_add_ps(_mm512_castps512_ps256(eo), 
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(eo), 1))));
    return fold8(t);
}
#define DOT_HD16(isa, a, b, hd) ((isa) >= EYAS_ISA_AVX512VNNI ? dot_hd16_avx512(a, b, hd) \
                                 : (isa) >= EYAS_ISA_AVX2 ? dot_hd16_avx2(a, b, hd) : dot_hd16(a, b, hd))
#else
#define DOT_HD16(isa, a, b, hd) dot_hd16(a, b, hd)
#endif

/* one query row of one head over its visible keys, in position order: scores and max, exp-weights (hidden
 * keys weigh exactly 0 and are skipped), their sum, then the weighted values. Keys are walked one by one in
 * slot order and every per-key quantity is the key's own, so a tree row (its ancestors at other slots, the
 * rest masked) computes the bits the same token gets in plain decoding. hd % 16 == 0 runs dot_hd16 and
 * fused multiply-adds; other head sizes the plain-C path. hd is a literal at the call sites, isa a constant. */
EYAS_INLINE void attend_row(const int isa, const float *qi, const float *kb, const float *vb, const uint8_t *mi,
                            int lim, float scale, float *row, float *o, const int hd) {
    const int v16 = hd % 16 == 0;
    float m = -INFINITY;
    for (int j = 0; j < lim; j++) {
        float sj = -INFINITY;
        if (!mi || mi[j]) {
            sj = (v16 ? DOT_HD16(isa, qi, kb + (int64_t)j * hd, hd) : dot_f32(qi, kb + (int64_t)j * hd, hd)) * scale;
            if (sj > m) m = sj;
        }
        row[j] = sj;
    }
    float acc[256];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int j = 0; j < lim; j++) row[j] -= m;
        EXP_DET_N(isa, row, lim);
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

#ifdef EYAS_X86
/* AVX-512, hd % 16 == 0: attend_row's arithmetic with 8 keys' scores at a time and the weighted values in registers.
 * Each key's two chains sit in one register (dot_hd16_avx512); the eight fold8 sums come from two rounds of hadd
 * and one add of 128-bit halves, which add the same pairs in the same order as fold8. A masked key's score is
 * computed and dropped (attend_row skips it): no other score changes. */
static inline EYAS_TGT_AVX512 __m256 dot8_hd16_avx512(const float *qi, const float *kb, int hd) {
    __m256 t[8];
    for (int k = 0; k < 8; k++) {
        const float *b = kb + (int64_t)k * hd;
        __m512 eo = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 16) eo = _mm512_fmadd_ps(_mm512_loadu_ps(qi + d), _mm512_loadu_ps(b + d), eo);
        t[k] = _mm256_add_ps(_mm512_castps512_ps256(eo), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(eo),
                                                                                                  1)));
    }
    /* y0 lanes: keys 0-3 of ((t0 + t1) + (t2 + t3)), then keys 0-3 of ((t4 + t5) + (t6 + t7)); y1 keys 4-7 */
    const __m256 y0 = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    const __m256 y1 = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(y0, y1, 0x20), _mm256_permute2f128_ps(y0, y1, 0x31));
}

static EYAS_TGT_AVX512 void attend_row_avx512(const float *qi, const float *kb, const float *vb, const uint8_t *mi,
                                              int lim, float scale, float *row, float *o, const int hd) {
    float m = -INFINITY;
    int j = 0;
    for (; j + 8 <= lim; j += 8) {
        float sc[8];
        _mm256_storeu_ps(sc, _mm256_mul_ps(dot8_hd16_avx512(qi, kb + (int64_t)j * hd, hd), _mm256_set1_ps(scale)));
        for (int k = 0; k < 8; k++) {
            const float sj = !mi || mi[j + k] ? sc[k] : -INFINITY;
            if (sj > m) m = sj;
            row[j + k] = sj;
        }
    }
    for (; j < lim; j++) {
        float sj = -INFINITY;
        if (!mi || mi[j]) {
            sj = dot_hd16_avx512(qi, kb + (int64_t)j * hd, hd) * scale;
            if (sj > m) m = sj;
        }
        row[j] = sj;
    }
    __m512 acc[16];  /* hd <= 256 */
    for (int c = 0; c < hd / 16; c++) acc[c] = _mm512_setzero_ps();
    float l = 0.0f;
    if (m != -INFINITY) {
        for (j = 0; j < lim; j++) row[j] -= m;
        exp_det_n_avx2(row, lim);
        for (j = 0; j < lim; j++) l += row[j];
        for (j = 0; j < lim; j++) {
            const float p = row[j];
            if (p == 0.0f) continue;
            const float *vj = vb + (int64_t)j * hd;
            const __m512 pv = _mm512_set1_ps(p);
            for (int c = 0; c < hd / 16; c++) acc[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + 16 * c), acc[c]);
        }
    }
    const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
    for (int c = 0; c < hd / 16; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
}
#define ATTEND_ROW_V16(isa, qi, kb, vb, mi, lim, scale, row, o, hd) \
    ((isa) >= EYAS_ISA_AVX512VNNI ? attend_row_avx512(qi, kb, vb, mi, lim, scale, row, o, hd) \
                                  : attend_row(isa, qi, kb, vb, mi, lim, scale, row, o, hd))
#else
#define ATTEND_ROW_V16(isa, qi, kb, vb, mi, lim, scale, row, o, hd) \
    attend_row(isa, qi, kb, vb, mi, lim, scale, row, o, hd)
#endif

/* one (sequence, head, row) work item; the head sizes in use as literals */
EYAS_INLINE void attend_item_body(const int isa, const float *qi, const float *kb, const float *vb,
                                  const uint8_t *mi, int lim, float scale, float *row, float *o, int hd) {
    switch (hd) {
    case 64: ATTEND_ROW_V16(isa, qi, kb, vb, mi, lim, scale, row, o, 64); break;
    case 128: ATTEND_ROW_V16(isa, qi, kb, vb, mi, lim, scale, row, o, 128); break;
    default: attend_row(isa, qi, kb, vb, mi, lim, scale, row, o, hd);
    }
}
EYAS_VARIANTS(attend_item, (const float *qi, const float *kb, const float *vb, const uint8_t *mi, int lim,
                            float scale, float *row, float *o, int hd), qi, kb, vb, mi, lim, scale, row, o, hd)

/* q [B, S, nh, hd]; k, v: one layer's cache [B, kvh, maxlen, hd]; keys 0..start+S-1 are valid.
 * mask: NULL (causal: row i sees keys 0..start+i) or uint8 [*, S, start+S] with batch stride mask_bstride
 * (0 = one mask for every sequence). out [B, S, nh, hd]. hd <= 256.
 * Work item = (sequence, head, row): a row's arithmetic never depends on the other rows.
 * Returns EYAS_ENOMEM when a thread's score row cannot be allocated (its items are then left unwritten). */
int eyas_attention(const float *q, const float *k, const float *v, int64_t maxlen, int B, int S, int nh,
                   int kvh, int hd, int start, const uint8_t *mask, int64_t mask_bstride, float scale,
                   float *out, int nthreads) {
    int failed = 0;
    const int T = start + S;
    const int group = nh / kvh;
    const int items = B * nh * S;
    void (*const item)(const float *, const float *, const float *, const uint8_t *, int, float, float *, float *,
                       int) = EYAS_PICK(attend_item);
#pragma omp parallel num_threads(items > 1 ? nthreads : 1)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)(T > 0 ? T : 1));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            if (!row) continue;  /* every thread still reaches the loop's barrier */
            const int b = it / (nh * S), h = (it / S) % nh, i = it % S, g = h / group;
            const float *kb = k + ((int64_t)b * kvh + g) * maxlen * hd;
            const float *vb = v + ((int64_t)b * kvh + g) * maxlen * hd;
            const uint8_t *mi = mask ? mask + b * mask_bstride + (int64_t)i * T : NULL;
            const int lim = mask ? T : start + i + 1;
            const float *qi = q + (((int64_t)b * S + i) * nh + h) * hd;
            float *o = out + (((int64_t)b * S + i) * nh + h) * hd;
            item(qi, kb, vb, mi, lim, scale, row, o, hd);
        }
        free(row);
    }
    return failed ? EYAS_ENOMEM : EYAS_OK;
}

/* qkv [B, S, (nh + 2 kvh) hd] bf16 from the fused projection; cos, sin [B, S, hd] (HF rotary, rotate-half form).
 * Rotates q and k, writes k and v into cache slots start..start+S-1 (or, with slots and S = 1, row b's at slot
 * slots[b] <= start: rows of different lengths in one cache, the mask saying which slots each row sees), attends
 * (eyas_attention) and writes out [B, S, nh hd] bf16. qbuf, obuf: fp32 scratch of B*S*nh*hd. Returns
 * eyas_attention's code (the cache rows are written either way). */
int eyas_rope_attend(const uint16_t *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t maxlen,
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
    const int rc = eyas_attention(qbuf, kc, vc, maxlen, B, S, nh, kvh, hd, start, mask, mask_bstride, scale, obuf,
                                  nthreads);
    const int64_t n = (int64_t)B * S * nh * hd;
    for (int64_t i = 0; rc == EYAS_OK && i < n; i++) out[i] = to_bf16(obuf[i]);
    return rc;
}

/* attend_row's walk for keys and values of their own sizes, kd and vd (DeepSeek's MLA: 576-wide keys, latent and
 * rope part, over the 512-wide latents themselves), with an optional sink logit (gpt-oss: one per head, in the
 * softmax's sum but with no value, so the weights over real keys sum to less than one). The sink joins the max
 * before the shift and the sum after the keys; everything else is attend_row's order, so a row's bits never depend
 * on the other rows, S or the slots of masked keys. acc: vd floats of scratch. */
EYAS_INLINE void attend_kv_item_body(const int isa, const float *qi, const float *kb, const float *vb,
                                     const uint8_t *mi, int lim, float scale, const float *sink, float *row,
                                     float *acc, float *o, int kd, int vd) {
    float m = sink ? *sink : -INFINITY;
    for (int j = 0; j < lim; j++) {
        float sj = -INFINITY;
        if (!mi || mi[j]) {
            const float *kj = kb + (int64_t)j * kd;
            sj = (kd % 16 == 0 ? DOT_HD16(isa, qi, kj, kd) : dot_f32(qi, kj, kd)) * scale;
            if (sj > m) m = sj;
        }
        row[j] = sj;
    }
    for (int d = 0; d < vd; d++) acc[d] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int j = 0; j < lim; j++) row[j] -= m;
        EXP_DET_N(isa, row, lim);
        for (int j = 0; j < lim; j++) l += row[j];
        if (sink) l += exp_det(*sink - m);
        for (int j = 0; j < lim; j++) {
            const float p = row[j];
            if (p == 0.0f) continue;
            const float *vj = vb + (int64_t)j * vd;
            for (int d = 0; d < vd; d++) acc[d] = fmaf(p, vj[d], acc[d]);
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < vd; d++) o[d] = acc[d] * inv;
}
EYAS_VARIANTS(attend_kv_item, (const float *qi, const float *kb, const float *vb, const uint8_t *mi, int lim,
                               float scale, const float *sink, float *row, float *acc, float *o, int kd, int vd),
              qi, kb, vb, mi, lim, scale, sink, row, acc, o, kd, vd)

/* eyas_attention with key size kd and value size vd: q [B, S, nh, kd]; k [B, kvh, kmax, kd] and v [B, kvh, vmax,
 * vd] hold keys 0..start+S-1; sinks [nh] or NULL; out [B, S, nh, vd]. Mask as eyas_attention's. */
int eyas_attention_kv(const float *q, const float *k, int64_t kmax, const float *v, int64_t vmax, int B, int S,
                      int nh, int kvh, int kd, int vd, int start, const uint8_t *mask, int64_t mask_bstride,
                      const float *sinks, float scale, float *out, int nthreads) {
    int failed = 0;
    const int T = start + S;
    const int group = nh / kvh;
    const int items = B * nh * S;
    void (*const item)(const float *, const float *, const float *, const uint8_t *, int, float, const float *,
                       float *, float *, float *, int, int) = EYAS_PICK(attend_kv_item);
#pragma omp parallel num_threads(items > 1 ? nthreads : 1)
    {
        float *row = (float *)malloc(sizeof(float) * ((size_t)(T > 0 ? T : 1) + (size_t)vd));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            if (!row) continue;  /* every thread still reaches the loop's barrier */
            const int b = it / (nh * S), h = (it / S) % nh, i = it % S, g = h / group;
            const float *kb = k + ((int64_t)b * kvh + g) * kmax * kd;
            const float *vb = v + ((int64_t)b * kvh + g) * vmax * vd;
            const uint8_t *mi = mask ? mask + b * mask_bstride + (int64_t)i * T : NULL;
            const int lim = mask ? T : start + i + 1;
            item(q + (((int64_t)b * S + i) * nh + h) * kd, kb, vb, mi, lim, scale, sinks ? sinks + h : NULL, row,
                 row + (T > 0 ? T : 1), out + (((int64_t)b * S + i) * nh + h) * vd, kd, vd);
        }
        free(row);
    }
    return failed ? EYAS_ENOMEM : EYAS_OK;
}
