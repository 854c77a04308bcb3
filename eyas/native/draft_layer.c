/* ---- the EAGLE-3 draft layer in one call (serving, q8 draft weights) -----------------------------------------
 * R rows: x = [rms(emb) * w_in | rms(hidden) * w_hid] ; qkv = x . Wqkv ; RoPE on q, k ; k, v written at draft-cache
 * slots start.. ; attention over slots 0..start+R-1 under mask [R, start+R] ; h = hidden + o . Wo ;
 * out = h + (silu(g) * u) . Wd with [g | u] = rms(h) * w_post . Wgu. The same arithmetic as eyas.draft's torch
 * modules, without ~60 op dispatches per step; the draft only proposes, so its bits never change an output. */
#include "kernels.h"

static void rms_rows_f32(const float *x, const float *w, float *out, int R, int H, float eps, int ostride) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * H;
        const float inv = 1.0f / sqrtf(dot_f32(xr, xr, H) / (float)H + eps);
        for (int c = 0; c < H; c++) out[(int64_t)r * ostride + c] = w[c] * (xr[c] * inv);
    }
}

int eyas_draft_layer(const eyas_draft_layer_args *a) {
    if (a->struct_size != sizeof(eyas_draft_layer_args)) return EYAS_EARGS;
    const int R = a->R, H = a->H, nh = a->nh, kvh = a->kvh, hd = a->hd, I = a->I, start = a->start;
    const int nthreads = a->nthreads;
    const int64_t maxlen = a->maxlen;
    const float *hidden = a->hidden, *cos = a->cos, *sin = a->sin;
    float *kc = a->kc, *vc = a->vc;
    const int nq = nh * hd, nkv = kvh * hd, nqkv = nq + 2 * nkv, half = hd / 2;
    float *x = malloc(sizeof(float) * (size_t)R * 2 * H), *qkv = malloc(sizeof(float) * (size_t)R * nqkv);
    float *q = malloc(sizeof(float) * (size_t)R * nq), *att = malloc(sizeof(float) * (size_t)R * nq);
    float *h = malloc(sizeof(float) * (size_t)R * H), *gu = malloc(sizeof(float) * (size_t)R * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)R * I), *y = malloc(sizeof(float) * (size_t)R * H);
    if (!(x && qkv && q && att && h && gu && act && y)) {  /* nothing written yet: the caches are untouched */
        free(x); free(qkv); free(q); free(att); free(h); free(gu); free(act); free(y);
        return EYAS_ENOMEM;
    }
    rms_rows_f32(a->emb, a->w_in, x, R, H, a->eps, 2 * H);
    rms_rows_f32(hidden, a->w_hid, x + H, R, H, a->eps, 2 * H);
    int rc = eyas_q8q8_matmul(x, a->wqkv, qkv, R, nqkv, 2 * H, nthreads);
    for (int r = 0; rc == EYAS_OK && r < R; r++) {  /* the caches are written only once q|k|v exist */
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
    if (rc == EYAS_OK) {
        rc = eyas_attention(q, kc, vc, maxlen, 1, R, nh, kvh, hd, start, a->mask, 0, a->scale, att, nthreads);
        if (rc == EYAS_OK) rc = eyas_q8q8_matmul(att, a->wo, h, R, H, nq, nthreads);
    }
    if (rc == EYAS_OK) {
        for (int64_t i = 0; i < (int64_t)R * H; i++) h[i] += hidden[i];
        rms_rows_f32(h, a->w_post, x, R, H, a->eps, H);
        rc = eyas_q8q8_matmul(x, a->wgu, gu, R, 2 * I, H, nthreads);
    }
    for (int r = 0; rc == EYAS_OK && r < R; r++)
        for (int c = 0; c < I; c++) {
            const float g = gu[(int64_t)r * 2 * I + c], u = gu[(int64_t)r * 2 * I + I + c];
            act[(int64_t)r * I + c] = g / (1.0f + expf(-g)) * u;
        }
    if (rc == EYAS_OK) rc = eyas_q8q8_matmul(act, a->wd, y, R, H, I, nthreads);
    for (int64_t i = 0; rc == EYAS_OK && i < (int64_t)R * H; i++) a->out[i] = h[i] + y[i];
    free(x); free(qkv); free(q); free(att); free(h); free(gu); free(act); free(y);
    return rc;
}
