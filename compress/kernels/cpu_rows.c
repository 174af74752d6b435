/* Few-row matmuls for CPU decoding: y[M, N] = x[M, K] @ W^T (+ bias), M = 1..16, float32 activations.
 *
 * Why: at batch 1 a decode step is bound by reading the weights, and speculative verification multiplies 2-9 rows by
 * the same weights. torch's float32 F.linear on this project's CPUs reads a 1536 x 576 weight at ~9 GB/s for one row
 * and is compute-bound from 5 rows (bench/verify_matmul.py); the weights laid out in strips of 32 output columns,
 * each strip's K rows contiguous ([N / 32][K][32]), stream linearly, and every row of x is one broadcast and one FMA
 * per strip vector, so 1 to 8 rows cost about the same as one.
 *
 * Every output element is the same sum in the same order whatever M is (each row has its own accumulators, k runs
 * 0..K-1), so a row's result does not depend on which other rows share the call: one-row decoding and multi-row
 * verification agree bit for bit.
 *
 * Plain C with GCC vector extensions (no intrinsics): compiled with -march=native, a 16-float vector is one AVX-512
 * register or two AVX2 ones. No torch headers: Python calls it through ctypes (compress/kernels/cpu_rows.py).
 *
 * Layouts (NP = N rounded up to 32; padding columns hold zeros and are not written to y):
 *   f32:  w [NP / 32][K][32] float
 *   int4: w [NP / 32][K][16] bytes, byte i of a k-row: code of column i in the low nibble, column 16 + i in the high;
 *         codes u in 0..15 on the grid w = (u - z) * s; per group of G inputs: s and z*s as [NP / 32][K / G][32]
 *   int8: w [NP / 32][K][32] signed codes, w = q * s[n] (symmetric, one scale per output column)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#define STRIP 32
#define PREFETCH 8 /* k-rows ahead */
#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) { v16 v; memcpy(&v, p, 64); return v; }

/* 16 bytes -> 16 int32 lanes. GCC 12 scalarizes __builtin_convertvector from bytes, so the widening is one
 * instruction per ISA where there is one, and a plain loop elsewhere. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
INLINE i32x16 widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    i32x16 r; memcpy(&r, &a, 32); memcpy((char *)&r + 32, &b, 32); return r;
#else
    i32x16 r; for (int i = 0; i < 16; ++i) r[i] = p[i]; return r;
#endif
}
INLINE i32x16 widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    i32x16 r; memcpy(&r, &a, 32); memcpy((char *)&r + 32, &b, 32); return r;
#else
    i32x16 r; for (int i = 0; i < 16; ++i) r[i] = p[i]; return r;
#endif
}
INLINE void store16(float *p, v16 v) { memcpy(p, &v, 64); }

INLINE void finish(float *y, int64_t N, int64_t n0, const float *bias, const v16 *acc, int M) {
    /* acc[m * 2 + j]: columns n0 + 16 j .. n0 + 16 j + 15 of row m */
    float tmp[STRIP];
    for (int m = 0; m < M; ++m) {
        store16(tmp, acc[m * 2]);
        store16(tmp + 16, acc[m * 2 + 1]);
        int64_t cols = N - n0 < STRIP ? N - n0 : STRIP;
        for (int64_t c = 0; c < cols; ++c) y[m * N + n0 + c] = tmp[c] + (bias ? bias[n0 + c] : 0.0f);
    }
}

INLINE void f32_rows_m(const float *x, const float *w, const float *bias, float *y, int64_t N, int64_t K, int M,
                       int64_t s0, int64_t s1) { /* strips s0 .. s1 - 1 */
    for (int64_t s = s0; s < s1; ++s) {
        const float *ws = w + s * K * STRIP;
        v16 acc[16];
        for (int i = 0; i < 2 * M; ++i) acc[i] = (v16){0};
        for (int64_t k = 0; k < K; ++k) {
            v16 w0 = load16(ws + k * STRIP), w1 = load16(ws + k * STRIP + 16);
            __builtin_prefetch(ws + (k + PREFETCH) * STRIP);
            __builtin_prefetch(ws + (k + PREFETCH) * STRIP + 16);
            for (int m = 0; m < M; ++m) {
                float xs = x[m * K + k];
                acc[2 * m] += w0 * xs;
                acc[2 * m + 1] += w1 * xs;
            }
        }
        finish(y, N, s * STRIP, bias, acc, M);
    }
}

INLINE void i4_rows_m(const float *x, const uint8_t *w, const float *scale, const float *zs, const float *xsum,
                      const float *bias, float *y, int64_t N, int64_t K, int64_t G, int M) {
    int64_t strips = (N + STRIP - 1) / STRIP, groups = K / G;
    for (int64_t s = 0; s < strips; ++s) {
        const uint8_t *ws = w + s * K * 16;
        v16 acc[16];
        for (int i = 0; i < 2 * M; ++i) acc[i] = (v16){0};
        for (int64_t g = 0; g < groups; ++g) {
            v16 part[16];
            for (int i = 0; i < 2 * M; ++i) part[i] = (v16){0};
            for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                i32x16 c = widen_u8(ws + k * 16);
                __builtin_prefetch(ws + (k + 4 * PREFETCH) * 16);
                v16 lo = __builtin_convertvector(c & 15, v16), hi = __builtin_convertvector(c >> 4, v16);
                for (int m = 0; m < M; ++m) {
                    float xs = x[m * K + k];
                    part[2 * m] += lo * xs;
                    part[2 * m + 1] += hi * xs;
                }
            }
            const float *sg = scale + (s * groups + g) * STRIP, *zg = zs + (s * groups + g) * STRIP;
            v16 s0 = load16(sg), s1 = load16(sg + 16), z0 = load16(zg), z1 = load16(zg + 16);
            for (int m = 0; m < M; ++m) {
                float xg = xsum[m * groups + g];
                acc[2 * m] += part[2 * m] * s0 - z0 * xg;
                acc[2 * m + 1] += part[2 * m + 1] * s1 - z1 * xg;
            }
        }
        finish(y, N, s * STRIP, bias, acc, M);
    }
}

INLINE void i8_rows_m(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t N,
                      int64_t K, int M) {
    int64_t strips = (N + STRIP - 1) / STRIP;
    for (int64_t s = 0; s < strips; ++s) {
        const int8_t *ws = w + s * K * STRIP;
        v16 acc[16];
        for (int i = 0; i < 2 * M; ++i) acc[i] = (v16){0};
        for (int64_t k = 0; k < K; ++k) {
            __builtin_prefetch(ws + (k + 2 * PREFETCH) * STRIP);
            v16 w0 = __builtin_convertvector(widen_i8(ws + k * STRIP), v16);
            v16 w1 = __builtin_convertvector(widen_i8(ws + k * STRIP + 16), v16);
            for (int m = 0; m < M; ++m) {
                float xs = x[m * K + k];
                acc[2 * m] += w0 * xs;
                acc[2 * m + 1] += w1 * xs;
            }
        }
        v16 s0 = load16(scale + s * STRIP), s1 = load16(scale + s * STRIP + 16);
        for (int m = 0; m < M; ++m) {
            acc[2 * m] *= s0;
            acc[2 * m + 1] *= s1;
        }
        finish(y, N, s * STRIP, bias, acc, M);
    }
}

/* M is dispatched to a constant so that each case's accumulators live in registers. Returns 0, or -1 for M
 * outside 1..8. */
#define DISPATCH(call) \
    switch (M) { \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; case 8: call(8); break; \
    default: return -1; } \
    return 0;

static int f32_rows8(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int64_t s0, int64_t s1) {
#define F32(m) f32_rows_m(x, w, bias, y, N, K, m, s0, s1)
    DISPATCH(F32)
}

static int i4_rows8(const float *x, const uint8_t *w, const float *scale, const float *zs, const float *bias,
                    float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    float xsum[8 * 1024]; /* group sums of x: K / G <= 1024 */
    int64_t groups = K / G;
    if (M < 1 || M > 8 || groups > 1024) return -1;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            float t = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; ++k) t += x[m * K + k];
            xsum[m * groups + g] = t;
        }
#define I4(m) i4_rows_m(x, w, scale, zs, xsum, bias, y, N, K, G, m)
    DISPATCH(I4)
}

static int i8_rows8(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K) {
#define I8(m) i8_rows_m(x, w, scale, bias, y, N, K, m)
    DISPATCH(I8)
}

/* int4 weights times int8 activations (W4A8), for drafts, where an approximation only costs acceptance: x is
 * rounded per row and per weight group to int8 (xq = round(x / sx), sx = max|x| / 127 over the group), and
 *   y[m, n] = sum_g s[g, n] * sx[m, g] * (sum_k u[k, n] * xq[m, k] - z[g, n] * sum_k xq[m, k]).
 * On CPUs with AVX512-VNNI, vpdpbusd multiplies 4 code bytes by 4 activation bytes and adds them into each of 16
 * int32 lanes: 64 multiply-adds an instruction, so the weights stream at memory speed where the float int4 kernel
 * above spends 7 instructions on 32 weights. Layout: strips of 16 columns, w [NP / 16][K / 8][16][4] bytes: byte b
 * of column n's word holds u[k0 + b] (low nibble) and u[k0 + 4 + b] (high nibble); s and z*s as [NP / 16][K / G][16].
 */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
int compress_has_vnni(void) { return 1; }

INLINE void w4a8_rows_m(const int8_t *xq, const float *sx, const int32_t *xqsum, const uint8_t *w, const float *scale,
                        const float *zs, const float *bias, float *y, int64_t N, int64_t K, int64_t G, int M) {
    int64_t strips = (N + 15) / 16, groups = K / G;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int64_t s = 0; s < strips; ++s) {
        const uint8_t *ws = w + s * (K / 8) * 64;
        __m512 acc[8];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
            __m512i part[8];
            for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_si512();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                __m512i v = _mm512_loadu_si512((const void *)(ws + (k / 8) * 64));
                __builtin_prefetch(ws + (k / 8 + 8) * 64);
                __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                for (int m = 0; m < M; ++m) {
                    int32_t a, b;
                    memcpy(&a, xq + m * K + k, 4);
                    memcpy(&b, xq + m * K + k + 4, 4);
                    part[m] = _mm512_dpbusd_epi32(part[m], lo, _mm512_set1_epi32(a));
                    part[m] = _mm512_dpbusd_epi32(part[m], hi, _mm512_set1_epi32(b));
                }
            }
            __m512 sg = _mm512_loadu_ps(scale + (s * groups + g) * 16);
            __m512 zg = _mm512_loadu_ps(zs + (s * groups + g) * 16);
            for (int m = 0; m < M; ++m) {
                float f = sx[m * groups + g];
                __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(part[m]), sg,
                                           _mm512_mul_ps(zg, _mm512_set1_ps((float)xqsum[m * groups + g])));
                acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(f), acc[m]);
            }
        }
        int64_t cols = N - s * 16 < 16 ? N - s * 16 : 16;
        for (int m = 0; m < M; ++m) {
            float tmp[16];
            _mm512_storeu_ps(tmp, acc[m]);
            for (int64_t c = 0; c < cols; ++c) y[m * N + s * 16 + c] = tmp[c] + (bias ? bias[s * 16 + c] : 0.0f);
        }
    }
}

static int w4a8_rows8(const int8_t *xq, const float *sx, const int32_t *xqsum, const uint8_t *w, const float *scale,
                      const float *zs, const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
#define W4A8(m) w4a8_rows_m(xq, sx, xqsum, w, scale, zs, bias, y, N, K, G, m)
    DISPATCH(W4A8)
}

/* x [M, K] float -> xq int8, sx [M, K / G] and the int sums of xq per group; then the matmul. */
int compress_w4a8_rows(const float *x, const uint8_t *w, const float *scale, const float *zs, const float *bias,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    if (M < 1 || M > 16 || K % 8 || G % 8 || K % G) return -1;
    int64_t groups = K / G;
    int8_t *xq = malloc(M * K);
    float *sx = malloc(sizeof(float) * M * groups);
    int32_t *xs = malloc(sizeof(int32_t) * M * groups);
    int rc = (xq && sx && xs) ? 0 : -1;
    for (int64_t m = 0; m < M && !rc; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + m * K + g * G;
            float amax = 0.0f;
            for (int64_t i = 0; i < G; ++i) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
            float step = amax > 0.0f ? amax / 127.0f : 1.0f;
            int32_t sum = 0;
            for (int64_t i = 0; i < G; ++i) {
                float r = nearbyintf(xg[i] / step); /* round half to even, as torch.round */
                int8_t qv = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
                xq[m * K + g * G + i] = qv;
                sum += qv;
            }
            sx[m * groups + g] = step;
            xs[m * groups + g] = sum;
        }
    for (int64_t m = 0; m < M && !rc; m += 8)
        rc = w4a8_rows8(xq + m * K, sx + m * groups, xs + m * groups, w, scale, zs, bias, y + m * N,
                        M - m < 8 ? M - m : 8, N, K, G);
    free(xq); free(sx); free(xs);
    return rc;
}
#else
int compress_has_vnni(void) { return 0; }
int compress_w4a8_rows(const float *x, const uint8_t *w, const float *scale, const float *zs, const float *bias,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    (void)x; (void)w; (void)scale; (void)zs; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)G;
    return -1;
}
#endif

/* The entry points: 1..16 rows, in chunks of at most 8 (a row's sum is the same whichever chunk holds it). */
#define MAX_ROWS 16
int compress_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || M > MAX_ROWS) return -1;
    int64_t strips = (N + STRIP - 1) / STRIP;
    if (M <= 8) return f32_rows8(x, w, bias, y, M, N, K, 0, strips);
    /* 9..16 rows (a draft tree's verify): strip by strip, each group of 8 rows in turn, so that a strip (K x 32
     * floats) comes from memory once and from cache for the second group: the weights stream once for all rows */
    for (int64_t s = 0; s < strips; ++s)
        for (int64_t m = 0; m < M; m += 8)
            if (f32_rows8(x + m * K, w, bias, y + m * N, M - m < 8 ? M - m : 8, N, K, s, s + 1)) return -1;
    return 0;
}

int compress_i4_rows(const float *x, const uint8_t *w, const float *scale, const float *zs, const float *bias,
                     float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    if (M < 1 || M > MAX_ROWS) return -1;
    for (int64_t m = 0; m < M; m += 8)
        if (i4_rows8(x + m * K, w, scale, zs, bias, y + m * N, M - m < 8 ? M - m : 8, N, K, G)) return -1;
    return 0;
}

int compress_i8_rows(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                     int64_t N, int64_t K) {
    if (M < 1 || M > MAX_ROWS) return -1;
    for (int64_t m = 0; m < M; m += 8)
        if (i8_rows8(x + m * K, w, scale, bias, y + m * N, M - m < 8 ? M - m : 8, N, K)) return -1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * A whole decoder block for 1..16 rows (the lean decode loop's step, compress/lean_decode.py), so that a step is one
 * call instead of some 35 torch operations a block, whose fixed cost (~10 ms a step for a 30-block model on this
 * project's CPUs) is what a small draft cannot shrink. Llama-style pre-norm block: RMSNorm, q/k/v, rotary (the
 * model's cos/sin for these positions, rotate_half convention), KV cache append, causal grouped-query attention,
 * o, residual; RMSNorm, gate/up, SiLU(gate) * up, down, residual. Each row is computed on its own, so a row's output
 * is the same bits whatever rows share the call. */
typedef struct {
    int64_t kind; /* 0 float32, 1 int4, 2 int8, 3 int4 with int8 activations (W4A8) */
    const void *w;
    const float *scale, *zs, *bias;
    int64_t n, k, g;
} Lin;

typedef struct {
    const float *ln1, *ln2;
    float eps1, eps2;
    Lin q, k, v;      /* fused: q holds q|k|v and k.n = v.n = 0 */
    Lin o, gate, up;  /* fused: gate holds gate|up and up.n = 0 */
    Lin down;
    float *kcache, *vcache; /* [kv_heads, max_len, head_dim] */
} Block;

static int linear(const Lin *L, const float *x, float *y, int64_t M) {
    const void *w = L->w;
    if (L->kind == 0) return compress_f32_rows(x, w, L->bias, y, M, L->n, L->k);
    if (L->kind == 1) return compress_i4_rows(x, w, L->scale, L->zs, L->bias, y, M, L->n, L->k, L->g);
    if (L->kind == 2) return compress_i8_rows(x, w, L->scale, L->bias, y, M, L->n, L->k);
    if (L->kind == 3) return compress_w4a8_rows(x, w, L->scale, L->zs, L->bias, y, M, L->n, L->k, L->g);
    return -1;
}

/* L's output into columns off .. off + L->n of dst's rows of width W (an unfused q/k/v or gate/up), through tmp */
static int linear_cols(const Lin *L, const float *x, float *tmp, float *dst, int64_t W, int64_t off, int64_t M) {
    if (linear(L, x, tmp, M)) return -1;
    for (int64_t m = 0; m < M; ++m) memcpy(dst + m * W + off, tmp + m * L->n, sizeof(float) * L->n);
    return 0;
}

/* exp on 16 lanes: 2^n * 2^f with f in [0, 1) by a degree-6 polynomial (relative error ~2e-7; libm's expf is
 * scalar without -ffast-math). Inputs below -87 give 0-ish, above 88 are clamped. */
INLINE v16 exp16(v16 x) {
    typedef int32_t mask16 __attribute__((vector_size(64)));
    v16 lo = x * 0.0f - 87.0f, hi = x * 0.0f + 88.0f;
    mask16 below = x < lo, above = x > hi;
    x = (v16)((below & (mask16)lo) | (~below & (mask16)x));
    x = (v16)((above & (mask16)hi) | (~above & (mask16)x));
    v16 t = x * 1.44269504088896341f;
    i32x16 n = __builtin_convertvector(t, i32x16); /* toward zero */
    n -= (i32x16)(t < __builtin_convertvector(n, v16)) & 1; /* floor */
    v16 f = t - __builtin_convertvector(n, v16);
    v16 p = f * 1.5403530e-4f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return p * (v16)((n + 127) << 23);
}

/* sum_d a[d] * b[d] in 16 lanes then across them (the same order for every row) */
INLINE float dot(const float *a, const float *b, int64_t D) {
    v16 acc = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) acc += load16(a + d) * load16(b + d);
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += acc[i];
    for (; d < D; ++d) s += a[d] * b[d];
    return s;
}

static void expf_inplace(float *x, int64_t n) { /* x = exp(x) */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(x + i, exp16(load16(x + i)));
    for (; i < n; ++i) x[i] = expf(x[i]);
}

static void rmsnorm(const float *x, const float *w, float eps, float *y, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; ++m) {
        float ss = 0.0f;
        for (int64_t i = 0; i < H; ++i) ss += x[m * H + i] * x[m * H + i];
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; ++i) y[m * H + i] = w[i] * (x[m * H + i] * r);
    }
}

static void rope(float *x, const float *cos, const float *sin, int64_t D) { /* one head's vector in place */
    int64_t half = D / 2;
    float tmp[1024];
    for (int64_t d = 0; d < D; ++d) tmp[d] = x[d];
    for (int64_t d = 0; d < half; ++d) x[d] = tmp[d] * cos[d] - tmp[d + half] * sin[d];
    for (int64_t d = half; d < D; ++d) x[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

/* h [M, H] updated in place; rows written to cache slots start .. start + M - 1, rotated by cos, sin [M, D] (their
 * positions). Causal by default: row m reads slots 0 .. start + m. With `tree` (a speculative draft tree, one verify
 * over its branches): slots below tree_start are read by every row, and row m reads slot tree_start + j (j <= start
 * + m - tree_start) only where tree[m * tree_stride + j] is set (its ancestors and itself). The keys a row reads are
 * taken in slot order, so a tree's row gives the same bits as the decode step of its branch. Returns 0, or -1 for a
 * shape the kernels refuse. */
int compress_blocks(const Block *blocks, int64_t n_blocks, float *h, int64_t M, int64_t start, const float *cos,
                    const float *sin, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, float scaling,
                    const uint8_t *tree, int64_t tree_start, int64_t tree_stride) {
    if (M < 1 || M > MAX_ROWS || D > 1024 || start + M > max_len || heads % kv_heads) return -1;
    if (tree && (tree_start < 0 || tree_start > start || tree_stride < start + M - tree_start)) return -1;
    int64_t H = blocks[0].q.k, QD = heads * D, KD = kv_heads * D, groups = heads / kv_heads, end = start + M;
    int64_t ffn = blocks[0].down.k;
    float *x = malloc(sizeof(float) * M * H), *qkv = malloc(sizeof(float) * M * (QD + 2 * KD));
    float *att = malloc(sizeof(float) * M * QD), *o = malloc(sizeof(float) * M * H);
    float *gu = malloc(sizeof(float) * M * 2 * ffn), *act = malloc(sizeof(float) * M * ffn);
    float *p = malloc(sizeof(float) * end), *tmp = malloc(sizeof(float) * M * (QD > ffn ? QD : ffn));
    int64_t *keys = malloc(sizeof(int64_t) * end);
    int rc = (x && qkv && att && o && gu && act && p && tmp && keys) ? 0 : -1;
    int64_t W = QD + 2 * KD;
    for (int64_t b = 0; b < n_blocks && !rc; ++b) {
        const Block *B = &blocks[b];
        rmsnorm(h, B->ln1, B->eps1, x, M, H);
        if (B->k.n == 0) /* rows of [q | k | v] */
            rc |= linear(&B->q, x, qkv, M);
        else
            rc |= linear_cols(&B->q, x, tmp, qkv, W, 0, M) | linear_cols(&B->k, x, tmp, qkv, W, QD, M) |
                  linear_cols(&B->v, x, tmp, qkv, W, QD + KD, M);
        for (int64_t m = 0; m < M; ++m) {
            float *row = qkv + m * W;
            for (int64_t hd = 0; hd < heads; ++hd) rope(row + hd * D, cos + m * D, sin + m * D, D);
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                rope(row + QD + kh * D, cos + m * D, sin + m * D, D);
                memcpy(B->kcache + (kh * max_len + start + m) * D, row + QD + kh * D, sizeof(float) * D);
                memcpy(B->vcache + (kh * max_len + start + m) * D, row + QD + KD + kh * D, sizeof(float) * D);
            }
        }
        for (int64_t m = 0; m < M; ++m) {
            int64_t len = 0; /* the slots row m reads, in order: causal 0 .. start + m, or the tree's */
            if (!tree)
                for (; len <= start + m; ++len) keys[len] = len;
            else {
                for (; len < tree_start; ++len) keys[len] = len;
                for (int64_t j = 0; j <= start + m - tree_start; ++j)
                    if (tree[m * tree_stride + j]) keys[len++] = tree_start + j;
            }
            for (int64_t hd = 0; hd < heads; ++hd) {
                const float *q = qkv + m * W + hd * D;
                const float *kc = B->kcache + (hd / groups) * max_len * D;
                const float *vc = B->vcache + (hd / groups) * max_len * D;
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < len; ++j) {
                    p[j] = dot(q, kc + keys[j] * D, D) * scaling;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = 0; j < len; ++j) p[j] -= mx;
                expf_inplace(p, len);
                for (int64_t j = 0; j < len; ++j) sum += p[j];
                float *out = att + m * QD + hd * D;
                for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
                for (int64_t j = 0; j < len; ++j) {
                    float pj = p[j] / sum;
                    const float *vj = vc + keys[j] * D;
                    for (int64_t d = 0; d < D; ++d) out[d] += pj * vj[d];
                }
            }
        }
        rc |= linear(&B->o, att, o, M);
        for (int64_t i = 0; i < M * H; ++i) h[i] += o[i];
        rmsnorm(h, B->ln2, B->eps2, x, M, H);
        if (B->up.n == 0) /* rows of [gate | up] */
            rc |= linear(&B->gate, x, gu, M);
        else
            rc |= linear_cols(&B->gate, x, tmp, gu, 2 * ffn, 0, M) | linear_cols(&B->up, x, tmp, gu, 2 * ffn, ffn, M);
        for (int64_t m = 0; m < M; ++m) { /* SiLU(gate) * up */
            float *e = act + m * ffn;
            const float *g = gu + m * 2 * ffn, *u = g + ffn;
            for (int64_t i = 0; i < ffn; ++i) e[i] = -g[i];
            expf_inplace(e, ffn);
            for (int64_t i = 0; i < ffn; ++i) e[i] = g[i] / (1.0f + e[i]) * u[i];
        }
        rc |= linear(&B->down, act, o, M);
        for (int64_t i = 0; i < M * H; ++i) h[i] += o[i];
    }
    free(x); free(qkv); free(att); free(o); free(gu); free(act); free(p); free(tmp); free(keys);
    return rc ? -1 : 0;
}
