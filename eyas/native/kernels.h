/* eyas CPU kernels: what the kernel files (the .c files here) share; eyas/native/kernels.py builds them into one
 * library.
 *
 * Why these kernels: speculative verification runs S rows where plain decoding runs one. Library kernels (MKL sgemm,
 * torch's SDPA) pick their blocking and reduction order by row count, so row i of an S-row forward
 * differs in its last bits from the same row computed alone; in the native (bf16-activation) mode those
 * bits survive the next bf16 rounding and can flip a greedy token. Every output element here is computed
 * by the same instruction sequence whatever S, the batch, the mask or the position of the other rows:
 * one (row, head) walks its visible keys in position order; one (row, vocab entry) walks K in blocks of 32.
 * Built at first use with the machine's C compiler (see eyas/native/kernels.py); no torch headers.
 *
 * Files: attention.c (attention, RoPE + KV write), layer_ops.c (residual RMSNorm, SwiGLU in bf16), matmul_head.c
 * (fp32-activation heads), matmul_q4.c and matmul_q8.c (4- and 8-bit weights x 8-bit activations), q4_layers.c
 * (the fused 4-bit decoder stack), draft_layer.c (the EAGLE-3 draft layer). The helpers below are static inline
 * so that each file compiles the same instruction sequence for them.
 */
#ifndef EYAS_KERNELS_H
#define EYAS_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- instruction sets, chosen at run time (isa.c) ------------------------------------------------------------
 * The library is compiled for the baseline of its architecture (any x86-64); the hot kernels also come in variants
 * compiled for AVX2+FMA and for AVX-512 F/BW/VL + VNNI through per-function target attributes. isa.c reads the CPU's
 * features (cpuid) once at load and picks the best level the CPU has; eyas_isa_select can force a lower one and
 * refuses one the CPU lacks, so a variant whose instructions the CPU does not have is never called. Every variant
 * computes the same bits: integer dots are exact in any order, and the float operations of each 32-block (and each
 * attention lane) run in the portable path's order (the build passes -ffp-contract=off, so no variant fuses what
 * the portable path rounds twice). */
#define EYAS_ISA_PORTABLE 0
#define EYAS_ISA_AVX2 1       /* AVX2 + FMA */
#define EYAS_ISA_AVX512VNNI 2 /* AVX-512 F, BW, VL and VNNI */
extern int eyas_isa_level;    /* the level in use (isa.c) */
int eyas_isa_select(const char *name);
int eyas_isa_supported(const char *name);
const char *eyas_isa_name(void);
const char *eyas_isa_names(void);

/* EYAS_PORTABLE_ONLY builds what a non-x86 machine builds (the portable variant alone): tests/test_isa.py */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(EYAS_PORTABLE_ONLY)
#include <immintrin.h>
#define EYAS_X86 1
#define EYAS_TGT_AVX2 __attribute__((target("avx2,fma")))
#define EYAS_TGT_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
/* the three variants of a void function: name##_body(isa, args...) is always inlined into each with its level as
 * a constant, so the compiler vectorizes the plain C for that instruction set and the body picks that level's
 * intrinsic helpers (which must not be always_inline: the portable variant holds calls to them, never taken);
 * EYAS_PICK(name) is the variant for the level in use */
#define EYAS_VARIANTS(name, params, ...) \
    static void name##_portable params { name##_body(EYAS_ISA_PORTABLE, __VA_ARGS__); } \
    static EYAS_TGT_AVX2 void name##_avx2 params { name##_body(EYAS_ISA_AVX2, __VA_ARGS__); } \
    static EYAS_TGT_AVX512 void name##_avx512 params { name##_body(EYAS_ISA_AVX512VNNI, __VA_ARGS__); }
#define EYAS_PICK(name) (eyas_isa_level >= EYAS_ISA_AVX512VNNI ? name##_avx512 \
                         : eyas_isa_level >= EYAS_ISA_AVX2 ? name##_avx2 : name##_portable)
#else
#define EYAS_VARIANTS(name, params, ...) \
    static void name##_portable params { name##_body(EYAS_ISA_PORTABLE, __VA_ARGS__); }
#define EYAS_PICK(name) name##_portable
#endif
#define EYAS_INLINE static inline __attribute__((always_inline))

/* exp with a fixed polynomial (Cephes expf's), so the compiler can vectorize it and every build computes the
 * same function for every element; x <= -87 gives exactly 0 (masked keys carry -inf). */
EYAS_INLINE float exp_det(float x) {
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
EYAS_INLINE float dot_f32(const float *a, const float *b, int n) {
    float acc[32] = {0};
    int d = 0;
    for (; d + 32 <= n; d += 32)
        for (int t = 0; t < 32; t++) acc[t] += a[d + t] * b[d + t];
    for (int t = 0; d < n && t < 32; d++, t++) acc[t] += a[d] * b[d];  /* the n % 32 tail */
    for (int w = 16; w >= 1; w /= 2)
        for (int t = 0; t < w; t++) acc[t] += acc[t + w];
    return acc[0];
}

/* exp_det on n consecutive values in place */
EYAS_INLINE void exp_det_n(float *x, int n) {
    for (int j = 0; j < n; j++) x[j] = exp_det(x[j]);
}

#ifdef EYAS_X86
/* the same, 8 at a time with AVX2: the same operations lane by lane */
static inline EYAS_TGT_AVX2 void exp_det_n_avx2(float *x, int n) {
    int j = 0;
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
    for (; j < n; j++) x[j] = exp_det(x[j]);
}
#define EXP_DET_N(isa, x, n) ((isa) >= EYAS_ISA_AVX2 ? exp_det_n_avx2(x, n) : exp_det_n(x, n))
#else
#define EXP_DET_N(isa, x, n) exp_det_n(x, n)
#endif

/* bf16 values are uint16 with round-to-nearest-even, as torch converts */
EYAS_INLINE uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    const uint32_t r = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);  /* branch-free: vectorizes */
}

EYAS_INLINE float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

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
EYAS_INLINE int quantize_q8_block(const float *v, int8_t *qb, float *dx) {
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

/* the exported kernels one file calls from another; those returning int give EYAS_OK or EYAS_ENOMEM (a scratch
 * allocation failed) */
int eyas_attention(const float *q, const float *k, const float *v, int64_t maxlen, int B, int S, int nh,
                   int kvh, int hd, int start, const uint8_t *mask, int64_t mask_bstride, float scale,
                   float *out, int nthreads);
void eyas_add_rms_bf16(float *x, const uint16_t *y, const float *w, uint16_t *out, int R, int H, float eps,
                       int nthreads);
void eyas_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int R, int I, int nthreads);
int eyas_rope_attend(const uint16_t *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t maxlen,
                     int B, int S, int nh, int kvh, int hd, int start, const int64_t *slots, const uint8_t *mask,
                     int64_t mask_bstride, float scale, float *qbuf, float *obuf, uint16_t *out, int nthreads);
/* out untouched when these two return EYAS_ENOMEM */
int eyas_q4_matmul_bf16(const uint16_t *x, const uint8_t *tiles, uint16_t *out, int M, int N, int K, int nthreads);
int eyas_q8q8_matmul(const float *x, const uint8_t *tiles, float *out, int M, int N, int K, int nthreads);

/* ---- the entry points with many arguments take one struct by pointer (eyas/native/boundary.py mirrors each as a
 * ctypes.Structure; eyas_args_sizes lets it compare sizes at load time, and struct_size is checked per call). They
 * return EYAS_OK or an error code instead of crashing: */
#define EYAS_OK 0
#define EYAS_ENOMEM 1 /* a scratch allocation failed */
#define EYAS_EARGS 2  /* the caller's struct_size is not this build's sizeof */

/* the fused 4-bit decoder stack (q4_layers.c); per-layer arrays have L entries */
typedef struct {
    size_t struct_size;                 /* sizeof(eyas_q4_layers_args) as the caller laid it out */
    float *x;                           /* [R, H] fp32, updated in place; R = B * S */
    const uint8_t *const *wqkv;         /* 4-bit tiles (kernels.pack_q4) of q|k|v, o, gate|up, down */
    const uint8_t *const *wo;
    const uint8_t *const *wgu;
    const uint8_t *const *wd;
    const float *const *ln1;            /* RMSNorm weights [H] before attention and before the MLP */
    const float *const *ln2;
    const float *cos;                   /* [R, hd] */
    const float *sin;
    float *const *kc;                   /* each layer's caches [B, kvh, maxlen, hd] fp32 */
    float *const *vc;
    const int64_t *slots;               /* [B] per-row cache slots (S = 1) or NULL */
    const uint8_t *const *masks;        /* each layer's mask [B|1, S, start+S] or NULL (causal) */
    const int64_t *mask_bstrides;       /* each mask's batch stride in bytes, 0 = shared */
    float *const *store;                /* [R, H] receives stream i, or NULL */
    int64_t maxlen;
    float eps, scale;
    int R, H, L, B, S, nh, kvh, hd, I, start, nthreads;
} eyas_q4_layers_args;
int eyas_q4_layers(const eyas_q4_layers_args *a);

/* the EAGLE-3 draft layer (draft_layer.c) */
typedef struct {
    size_t struct_size;                 /* sizeof(eyas_draft_layer_args) as the caller laid it out */
    const float *hidden;                /* [R, H] fp32 */
    const float *emb;                   /* [R, H] fp32 */
    const float *cos;                   /* [R, hd] */
    const float *sin;
    const uint8_t *wqkv;                /* 8-bit tiles (kernels.pack_q8) of q|k|v, o, gate|up, down */
    const uint8_t *wo;
    const uint8_t *wgu;
    const uint8_t *wd;
    const float *w_in;                  /* RMSNorm weights [H]: embedding, hidden, post-attention */
    const float *w_hid;
    const float *w_post;
    float *kc;                          /* draft caches [kvh, maxlen, hd] fp32, rows written at start.. */
    float *vc;
    const uint8_t *mask;                /* [R, start+R] */
    float *out;                         /* [R, H] fp32 */
    int64_t maxlen;
    float eps, scale;
    int R, H, nh, kvh, hd, I, start, nthreads;
} eyas_draft_layer_args;
int eyas_draft_layer(const eyas_draft_layer_args *a);

/* sizes[0..n) = sizeof of each struct above in declaration order; returns how many there are */
int eyas_args_sizes(int64_t *sizes, int n);

#endif
