/* eyas CPU kernels: the native layer's glue in bf16/fp32: residual add + RMSNorm, SwiGLU (RoPE + KV write +
 * attention: attention.c). One call per step instead of a dozen torch ops (each ~5 us of dispatch: ~40% of a 4-bit
 * decode step). Every row is computed on its own. */
#include "kernels.h"

/* row r: x [R, H] fp32 (+= y bf16 [R, H] when y is given), then out = bf16(w * (x * rsqrt(mean(x^2) + eps))) */
EYAS_INLINE void rms_row_body(const int isa, float *x, const uint16_t *y, const float *w, uint16_t *out, int r, int H,
                              float eps) {
    (void)isa;  /* plain C: only the vectorization differs */
    float *xr = x + (int64_t)r * H;
    if (y)
        for (int c = 0; c < H; c++) xr[c] += from_bf16(y[(int64_t)r * H + c]);
    const float ss = dot_f32(xr, xr, H);
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    uint16_t *o = out + (int64_t)r * H;
    for (int c = 0; c < H; c++) o[c] = to_bf16(w[c] * (xr[c] * inv));
}
EYAS_VARIANTS(rms_row, (float *x, const uint16_t *y, const float *w, uint16_t *out, int r, int H, float eps),
              x, y, w, out, r, H, eps)

void eyas_add_rms_bf16(float *x, const uint16_t *y, const float *w, uint16_t *out, int R, int H, float eps,
                       int nthreads) {
    void (*const row)(float *, const uint16_t *, const float *, uint16_t *, int, int, float) = EYAS_PICK(rms_row);
#pragma omp parallel for schedule(static) num_threads(R > 16 ? nthreads : 1)
    for (int r = 0; r < R; r++) row(x, y, w, out, r, H, eps);
}

/* one (row, 256-column chunk) item of silu(gate) * up */
EYAS_INLINE void silu_item_body(const int isa, const uint16_t *gu, uint16_t *out, int I, int it) {
    const int chunks = (I + 255) / 256, r = it / chunks, c0 = (it % chunks) * 256;
    const uint16_t *g = gu + (int64_t)r * 2 * I, *u = g + I;
    uint16_t *o = out + (int64_t)r * I;
    float buf[256];
    const int n = I - c0 < 256 ? I - c0 : 256;
    for (int c = 0; c < n; c++) buf[c] = -from_bf16(g[c0 + c]);
    EXP_DET_N(isa, buf, n);
    for (int c = 0; c < n; c++) buf[c] = from_bf16(g[c0 + c]) / (1.0f + buf[c]) * from_bf16(u[c0 + c]);
    for (int c = 0; c < n; c++) o[c0 + c] = to_bf16(buf[c]);
}
EYAS_VARIANTS(silu_item, (const uint16_t *gu, uint16_t *out, int I, int it), gu, out, I, it)

/* gu [R, 2I] bf16 (gate | up) -> out [R, I] bf16 = silu(gate) * up; every element on its own, so any split of
 * the (row, 256-column chunk) items over threads gives the same bits */
void eyas_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int R, int I, int nthreads) {
    const int chunks = (I + 255) / 256, items = R * chunks;
    void (*const item)(const uint16_t *, uint16_t *, int, int) = EYAS_PICK(silu_item);
#pragma omp parallel for schedule(static) num_threads((int64_t)R * I >= 4096 ? nthreads : 1)
    for (int it = 0; it < items; it++) item(gu, out, I, it);
}
