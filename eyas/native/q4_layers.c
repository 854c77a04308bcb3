#include "kernels.h"

/* The native decoder stack in one call (every matrix 4-bit, plain llama layer): per layer
 *   h = rms(x += pending) ; [store x] ; qkv = h.Wqkv ; o = attend(rope(qkv)) ; h = rms(x += o.Wo)
 *   pending = silu_mul(h.Wgu).Wd
 * and finally x += pending: the same kernels, in the same order, as the per-layer Python loop it replaces
 * (eyas/engine/forward.py: Bf16Stack), without ~200 Python-level calls per forward. a->x [R, H] fp32 is updated
 * in place; a->store[i] (or NULL) receives x at stream i. Returns EYAS_ENOMEM when scratch cannot be allocated:
 * before touching x or the caches for its own, part-way through the stack (x and the caches then hold a partial
 * forward, which the caller discards) for a matmul's. */
int eyas_q4_layers(const eyas_q4_layers_args *a) {
    if (a->struct_size != sizeof(eyas_q4_layers_args)) return EYAS_EARGS;
    const int R = a->R, H = a->H, I = a->I, nt = a->nthreads;
    const int nqkv = (a->nh + 2 * a->kvh) * a->hd, no = a->nh * a->hd;
    float *x = a->x;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)R * H), *qkv = malloc(sizeof(uint16_t) * (size_t)R * nqkv);
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)R * no), *ob = malloc(sizeof(uint16_t) * (size_t)R * H);
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)R * 2 * I), *act = malloc(sizeof(uint16_t) * (size_t)R * I);
    uint16_t *pend = malloc(sizeof(uint16_t) * (size_t)R * H);
    float *qbuf = malloc(sizeof(float) * (size_t)R * no), *obuf = malloc(sizeof(float) * (size_t)R * no);
    int rc = h && qkv && o && ob && gu && act && pend && qbuf && obuf ? EYAS_OK : EYAS_ENOMEM;
    for (int i = 0; rc == EYAS_OK && i < a->L; i++) {
        eyas_add_rms_bf16(x, i ? pend : NULL, a->ln1[i], h, R, H, a->eps, nt);
        if (a->store[i]) memcpy(a->store[i], x, sizeof(float) * (size_t)R * H);
        if ((rc = eyas_q4_matmul_bf16(h, a->wqkv[i], qkv, R, nqkv, H, nt))) break;
        if ((rc = eyas_rope_attend(qkv, a->cos, a->sin, a->kc[i], a->vc[i], a->maxlen, a->B, a->S, a->nh, a->kvh,
                                   a->hd, a->start, a->slots, a->masks[i], a->mask_bstrides[i], a->scale, qbuf, obuf,
                                   o, nt)))
            break;
        if ((rc = eyas_q4_matmul_bf16(o, a->wo[i], ob, R, H, no, nt))) break;
        eyas_add_rms_bf16(x, ob, a->ln2[i], h, R, H, a->eps, nt);
        if ((rc = eyas_q4_matmul_bf16(h, a->wgu[i], gu, R, 2 * I, H, nt))) break;
        eyas_silu_mul_bf16(gu, act, R, I, nt);
        rc = eyas_q4_matmul_bf16(act, a->wd[i], pend, R, H, I, nt);
    }
    if (rc == EYAS_OK && a->L) {
        const int64_t n = (int64_t)R * H;
        for (int64_t j = 0; j < n; j++) x[j] = x[j] + from_bf16(pend[j]);
    }
    free(h); free(qkv); free(o); free(ob); free(gu); free(act); free(pend); free(qbuf); free(obuf);
    return rc;
}

/* the argument structs' sizes, so that the ctypes side can refuse a layout that is not this build's */
int eyas_args_sizes(int64_t *sizes, int n) {
    const int64_t all[] = {(int64_t)sizeof(eyas_q4_layers_args), (int64_t)sizeof(eyas_draft_layer_args)};
    const int count = (int)(sizeof(all) / sizeof(all[0]));
    for (int i = 0; i < n && i < count; i++) sizes[i] = all[i];
    return count;
}
