/* Round-to-nearest fake quantization of float32 weights by groups of columns, one pass per row (cpu_quant.py).

   The searches of AWQ try many candidate weights: each is Q(W * s) / s, quantized and dequantized at once, or, in
   the clipping search, Q(clamp(W, lo, hi)) - W. In torch that is a dozen passes over the weight (product, minima,
   maxima, scales, codes, clamp, dequantization, division, cast), each through memory; here each group of a row is
   read once and written once. Every value is computed with the same IEEE float32 operations in the same order as
   quantizers/rtn.py's fake_quantize (products, true divisions, round half to even; no contraction into fused
   multiply-adds), so the results are torch's bit for bit (tested).

   compress_fake_quant(w, colmul, clip_lo, clip_hi, rows, cols, group, symmetric, qmin, qmax, scale_kind, out, mode):
     t = w[r][c] * colmul[c] (colmul NULL: t = w), then, with clip_lo / clip_hi ([rows, cols / group]; NULL: none),
       t = min(max(t, clip_lo[r][g]), clip_hi[r][g])
     per (row, group of `group` columns): asymmetric lo = min(min t, 0), hi = max(max t, 0), scale = (hi - lo) /
       (qmax - qmin); symmetric scale = max |t| / qmax. The scale rounded to scale_kind (0 float32, 1 float16,
       2 bfloat16), then 1 where it is not > 0; zero = clamp(round(-lo / scale), qmin, qmax).
     q = clamp(round(t / scale) + zero, qmin, qmax); v = (q - zero) * scale (symmetric: clamp(round(t / scale),
       qmin, qmax) * scale); v = v / colmul[c] (colmul NULL: v).
     out (mode 0) float32 v, (1) bfloat16 bits of v, (2) float32 v - w.
   Returns 0, or 1 for bad arguments. */
/* no a * b + c fused into one rounding: GCC's default in GNU C is to fuse, clang's within an expression */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 4096

static inline float round_scale(float x, int kind) {
    if (kind == 1) {
        _Float16 h = (_Float16)x; /* round to nearest even, as torch's float16 cast */
        return (float)h;
    }
    if (kind == 2) {
        uint32_t b;
        memcpy(&b, &x, 4);
        b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u; /* finite values: round to nearest even */
        memcpy(&x, &b, 4);
    }
    return x;
}

static inline uint16_t to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    uint16_t rounded = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    return (b & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : rounded; /* NaN: torch's one quiet NaN */
}

int compress_fake_quant(const float *w, const float *colmul, const float *clip_lo, const float *clip_hi, int64_t rows,
                        int64_t cols, int64_t group, int symmetric, float qmin, float qmax, int scale_kind, void *out,
                        int mode) {
    if (rows < 0 || cols <= 0 || group <= 0 || group > MAX_GROUP || cols % group || scale_kind < 0 ||
        scale_kind > 2 || mode < 0 || mode > 2 || (!clip_lo) != (!clip_hi))
        return 1;
    const int64_t groups = cols / group;
    float t[MAX_GROUP], v[MAX_GROUP];
    const float span = qmax - qmin;
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * cols;
        for (int64_t c0 = 0; c0 < cols; c0 += group) {
            const float *m = colmul ? colmul + c0 : NULL;
            for (int64_t j = 0; j < group; j++)
                t[j] = m ? wr[c0 + j] * m[j] : wr[c0 + j];
            if (clip_lo) {
                const float a = clip_lo[r * groups + c0 / group], b = clip_hi[r * groups + c0 / group];
                for (int64_t j = 0; j < group; j++) {
                    float x = t[j] > a ? t[j] : a; /* torch.maximum, then torch.minimum */
                    t[j] = x < b ? x : b;
                }
            }
            /* minimum and maximum over the group, in LANES independent lanes (vectorised) */
            float lo_l[LANES], hi_l[LANES];
            for (int l = 0; l < LANES; l++) {
                lo_l[l] = INFINITY;
                hi_l[l] = -INFINITY;
            }
            int64_t j = 0;
            for (; j + LANES <= group; j += LANES)
                for (int l = 0; l < LANES; l++) {
                    float x = symmetric ? fabsf(t[j + l]) : t[j + l];
                    lo_l[l] = x < lo_l[l] ? x : lo_l[l];
                    hi_l[l] = x > hi_l[l] ? x : hi_l[l];
                }
            for (; j < group; j++) {
                float x = symmetric ? fabsf(t[j]) : t[j];
                lo_l[0] = x < lo_l[0] ? x : lo_l[0];
                hi_l[0] = x > hi_l[0] ? x : hi_l[0];
            }
            float lo = lo_l[0], hi = hi_l[0];
            for (int l = 1; l < LANES; l++) {
                lo = lo_l[l] < lo ? lo_l[l] : lo;
                hi = hi_l[l] > hi ? hi_l[l] : hi;
            }
            float scale, zero = 0.0f;
            if (symmetric) {
                scale = hi / qmax;
            } else {
                lo = lo < 0.0f ? lo : 0.0f;
                hi = hi > 0.0f ? hi : 0.0f;
                scale = (hi - lo) / span;
            }
            scale = round_scale(scale, scale_kind);
            if (!(scale > 0.0f))
                scale = 1.0f;
            if (!symmetric) {
                zero = rintf(-lo / scale);
                zero = zero < qmin ? qmin : (zero > qmax ? qmax : zero);
            }
            if (symmetric)
                for (int64_t k = 0; k < group; k++) {
                    float q = rintf(t[k] / scale);
                    q = q < qmin ? qmin : (q > qmax ? qmax : q);
                    v[k] = q * scale;
                }
            else
                for (int64_t k = 0; k < group; k++) {
                    float q = rintf(t[k] / scale) + zero;
                    q = q < qmin ? qmin : (q > qmax ? qmax : q);
                    v[k] = (q - zero) * scale;
                }
            if (m)
                for (int64_t k = 0; k < group; k++)
                    v[k] = v[k] / m[k];
            if (mode == 1) {
                uint16_t *o = (uint16_t *)out + r * cols + c0;
                for (int64_t k = 0; k < group; k++)
                    o[k] = to_bf16(v[k]);
            } else if (mode == 2) {
                float *o = (float *)out + r * cols + c0;
                for (int64_t k = 0; k < group; k++)
                    o[k] = v[k] - wr[c0 + k];
            } else {
                memcpy((float *)out + r * cols + c0, v, group * sizeof(float));
            }
        }
    }
    return 0;
}

/* AutoRound's rounding of one weight for a tuning step (quantizers/autoround.rounding_forward's element-wise part),
   one pass over the weight. Per group (of `group` values; scale[g] and zero[g], zero NULL when symmetric):
     x = values / scale; q = round(x + v) (+ zero); c = clamp(q, qmin, qmax); inside = (q == c) ? 1 : 0;
     c = c (- zero); hat = c * scale (float32 or, hat_bf16, bfloat16 bits); ds_factor = c - x * inside.
   The same operations in the same order as the torch code, so the same bits (tested). */
int compress_autoround_round(const float *values, const float *v, const float *scale, const float *zero, int64_t groups,
                             int64_t group, float qmin, float qmax, void *hat, int hat_bf16, float *inside,
                             float *ds_factor) {
    if (groups < 0 || group <= 0)
        return 1;
    for (int64_t g = 0; g < groups; g++) {
        const float s = scale[g], z = zero ? zero[g] : 0.0f;
        const int64_t o = g * group;
        for (int64_t k = 0; k < group; k++) {
            float x = values[o + k] / s;
            float q = rintf(x + v[o + k]);
            if (zero)
                q = q + z;
            float c = q < qmin ? qmin : (q > qmax ? qmax : q);
            float in = q == c ? 1.0f : 0.0f;
            if (zero)
                c = c - z;
            float h = c * s;
            if (hat_bf16)
                ((uint16_t *)hat)[o + k] = to_bf16(h);
            else
                ((float *)hat)[o + k] = h;
            inside[o + k] = in;
            ds_factor[o + k] = c - x * in;
        }
    }
    return 0;
}

/* AutoRound's SignSGD step on V: v = clamp(v - lr * sign(grad), -bound, bound), in place (sign(0) = 0). */
int compress_sign_step(float *v, const float *grad, int64_t n, float lr, float bound) {
    if (n < 0)
        return 1;
    for (int64_t i = 0; i < n; i++) {
        float sg = (grad[i] > 0.0f) ? 1.0f : ((grad[i] < 0.0f) ? -1.0f : 0.0f);
        float x = v[i] - lr * sg;
        x = x < -bound ? -bound : x;
        v[i] = x > bound ? bound : x;
    }
    return 0;
}
