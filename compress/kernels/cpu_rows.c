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
#include <stdint.h>
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

INLINE void f32_rows_m(const float *x, const float *w, const float *bias, float *y, int64_t N, int64_t K, int M) {
    int64_t strips = (N + STRIP - 1) / STRIP;
    for (int64_t s = 0; s < strips; ++s) {
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

static int f32_rows8(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
#define F32(m) f32_rows_m(x, w, bias, y, N, K, m)
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

/* The entry points: 1..16 rows, in chunks of at most 8 (a row's sum is the same whichever chunk holds it). */
#define MAX_ROWS 16
int compress_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || M > MAX_ROWS) return -1;
    for (int64_t m = 0; m < M; m += 8)
        if (f32_rows8(x + m * K, w, bias, y + m * N, M - m < 8 ? M - m : 8, N, K)) return -1;
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
#include <math.h>
#include <stdlib.h>

typedef struct {
    int64_t kind; /* 0 float32, 1 int4, 2 int8 */
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
    if (L->kind == 0) return compress_f32_rows(x, (const float *)L->w, L->bias, y, M, L->n, L->k);
    if (L->kind == 1) return compress_i4_rows(x, (const uint8_t *)L->w, L->scale, L->zs, L->bias, y, M, L->n, L->k, L->g);
    if (L->kind == 2) return compress_i8_rows(x, (const int8_t *)L->w, L->scale, L->bias, y, M, L->n, L->k);
    return -1;
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

/* h [M, H] updated in place; tokens at positions start .. start + M - 1; cos, sin [M, D]. Returns 0, or -1 for a
 * shape the kernels refuse. */
int compress_blocks(const Block *blocks, int64_t n_blocks, float *h, int64_t M, int64_t start, const float *cos,
                    const float *sin, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, float scaling) {
    if (M < 1 || M > MAX_ROWS || D > 1024 || start + M > max_len || heads % kv_heads) return -1;
    int64_t H = blocks[0].q.k, QD = heads * D, KD = kv_heads * D, groups = heads / kv_heads, end = start + M;
    int64_t ffn = blocks[0].down.k;
    float *x = malloc(sizeof(float) * M * H), *qkv = malloc(sizeof(float) * M * (QD + 2 * KD));
    float *att = malloc(sizeof(float) * M * QD), *o = malloc(sizeof(float) * M * H);
    float *gu = malloc(sizeof(float) * M * 2 * ffn), *act = malloc(sizeof(float) * M * ffn);
    float *p = malloc(sizeof(float) * end);
    int rc = (x && qkv && att && o && gu && act && p) ? 0 : -1;
    int64_t W = QD + 2 * KD;
    for (int64_t b = 0; b < n_blocks && !rc; ++b) {
        const Block *B = &blocks[b];
        rmsnorm(h, B->ln1, B->eps1, x, M, H);
        if (B->k.n == 0) {
            rc |= linear(&B->q, x, qkv, M); /* rows of [q | k | v] */
        } else {
            float *tq = malloc(sizeof(float) * M * QD), *tk = malloc(sizeof(float) * M * KD),
                  *tv = malloc(sizeof(float) * M * KD);
            rc |= linear(&B->q, x, tq, M) | linear(&B->k, x, tk, M) | linear(&B->v, x, tv, M);
            for (int64_t m = 0; m < M; ++m) {
                memcpy(qkv + m * W, tq + m * QD, sizeof(float) * QD);
                memcpy(qkv + m * W + QD, tk + m * KD, sizeof(float) * KD);
                memcpy(qkv + m * W + QD + KD, tv + m * KD, sizeof(float) * KD);
            }
            free(tq); free(tk); free(tv);
        }
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
            int64_t len = start + m + 1; /* causal: keys 0 .. start + m */
            for (int64_t hd = 0; hd < heads; ++hd) {
                const float *q = qkv + m * W + hd * D;
                const float *kc = B->kcache + (hd / groups) * max_len * D, *vc = B->vcache + (hd / groups) * max_len * D;
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < len; ++j) {
                    float s = 0.0f;
                    for (int64_t d = 0; d < D; ++d) s += q[d] * kc[j * D + d];
                    p[j] = s * scaling;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = 0; j < len; ++j) { p[j] = expf(p[j] - mx); sum += p[j]; }
                float *out = att + m * QD + hd * D;
                for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
                for (int64_t j = 0; j < len; ++j) {
                    float pj = p[j] / sum;
                    for (int64_t d = 0; d < D; ++d) out[d] += pj * vc[j * D + d];
                }
            }
        }
        rc |= linear(&B->o, att, o, M);
        for (int64_t i = 0; i < M * H; ++i) h[i] += o[i];
        rmsnorm(h, B->ln2, B->eps2, x, M, H);
        if (B->up.n == 0) {
            rc |= linear(&B->gate, x, gu, M); /* rows of [gate | up] */
        } else {
            float *tg = malloc(sizeof(float) * M * ffn), *tu = malloc(sizeof(float) * M * ffn);
            rc |= linear(&B->gate, x, tg, M) | linear(&B->up, x, tu, M);
            for (int64_t m = 0; m < M; ++m) {
                memcpy(gu + m * 2 * ffn, tg + m * ffn, sizeof(float) * ffn);
                memcpy(gu + m * 2 * ffn + ffn, tu + m * ffn, sizeof(float) * ffn);
            }
            free(tg); free(tu);
        }
        for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 0; i < ffn; ++i) {
                float g = gu[m * 2 * ffn + i];
                act[m * ffn + i] = g / (1.0f + expf(-g)) * gu[m * 2 * ffn + ffn + i];
            }
        rc |= linear(&B->down, act, o, M);
        for (int64_t i = 0; i < M * H; ++i) h[i] += o[i];
    }
    free(x); free(qkv); free(att); free(o); free(gu); free(act); free(p);
    return rc ? -1 : 0;
}
