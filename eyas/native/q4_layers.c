#include "kernels.h"

/* The native decoder stack in one call (every matrix 4-bit, plain llama layer): per layer
 *   h = rms(x += pending) ; [store x] ; qkv = h.Wqkv ; o = attend(rope(qkv)) ; h = rms(x += o.Wo)
 *   pending = silu_mul(h.Wgu).Wd
 * and finally x += pending: the same kernels, in the same order, as the per-layer Python loop it replaces
 * (eyas/engine/forward.py: Bf16Stack), without ~200 Python-level calls per forward. x [R, H] fp32 is updated in
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
