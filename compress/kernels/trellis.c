/* Trellis codes (compress/core/trellis.py): the Viterbi encoder and a few-row decode matmul, on the CPU.
 *
 * The code is a bit-shift trellis of L state bits: a sequence of T weights is the walk s_0, s_1, ..., s_{T-1} with
 * s_t = ((s_{t-1} << k) | b_t) & (2^L - 1), each step choosing k new bits b_t, and weight t decodes to cb[s_t]
 * (a computed Gaussian codebook of 2^L values). Stored: s_0 (L bits) and b_1..b_{T-1} (k bits each).
 *
 * Viterbi: the walk that minimises sum_t (x_t - cb[s_t])^2 exactly. The predecessors of state s are the 2^k states
 * p = (s >> k) | (top << (L - k)), so each step takes, for every j = s >> k, the cheapest of 2^k costs that lie
 * 2^(L-k) apart (contiguous loops the compiler vectorises), remembers which (one byte per j), and adds each state's
 * own error. Work per sequence: T * 2^L; memory: T * 2^(L-k) bytes of back pointers.
 *
 * Why C: a sequence's costs (2^L floats) stay in the L1/L2 cache across its T steps; the same recursion in torch
 * over a batch of sequences streams B * 2^L floats per step through memory (measured ~40x slower here). Single
 * threaded: the quantize stage runs two layers at once on two threads (ctypes releases the GIL).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* target [S][T] float, cb [2^L] float -> start [S] (int32 s_0), steps [S][T-1] (uint8 b_t), err [S] (sum of
 * squared errors; may be NULL). Returns 0, or 1 for bad arguments, 2 when memory runs out. */
int compress_trellis_viterbi(const float *target, const float *cb, int64_t S, int64_t T, int64_t L, int64_t k,
                             int32_t *start, uint8_t *steps, float *err) {
    if (L < 2 || L > 24 || k < 1 || k > 8 || k >= L || T < 1) return 1;
    const int64_t N = (int64_t)1 << L, G = N >> k, B = (int64_t)1 << k;
    float *cost = malloc(sizeof(float) * N), *next = malloc(sizeof(float) * N), *best = malloc(sizeof(float) * G);
    uint8_t *back = malloc((size_t)(T > 1 ? T - 1 : 1) * G);
    if (!cost || !next || !best || !back) { free(cost); free(next); free(best); free(back); return 2; }
    for (int64_t q = 0; q < S; ++q) {
        const float *x = target + q * T;
        const float x0 = x[0];
        for (int64_t s = 0; s < N; ++s) { float d = x0 - cb[s]; cost[s] = d * d; }
        for (int64_t t = 1; t < T; ++t) {
            uint8_t *bp = back + (t - 1) * G;
            for (int64_t j = 0; j < G; ++j) { best[j] = cost[j]; bp[j] = 0; }
            for (int64_t top = 1; top < B; ++top) {
                const float *c = cost + top * G;
                for (int64_t j = 0; j < G; ++j) {
                    float v = c[j];
                    int lower = v < best[j];
                    best[j] = lower ? v : best[j];
                    bp[j] = lower ? (uint8_t)top : bp[j];
                }
            }
            const float xt = x[t];
            for (int64_t s = 0; s < N; ++s) {
                float d = xt - cb[s];
                next[s] = best[s >> k] + d * d;
            }
            float *tmp = cost; cost = next; next = tmp;
        }
        int64_t s = 0;
        float m = cost[0];
        for (int64_t i = 1; i < N; ++i) if (cost[i] < m) { m = cost[i]; s = i; }
        if (err) err[q] = m;
        uint8_t *out = steps + q * (T - 1);
        for (int64_t t = T - 1; t >= 1; --t) {
            out[t - 1] = (uint8_t)(s & (B - 1));
            int64_t j = s >> k;
            s = j | ((int64_t)back[(t - 1) * G + j] << (L - k));
        }
        start[q] = (int32_t)s;
    }
    free(cost); free(next); free(best); free(back);
    return 0;
}

#define LANES 4 /* tiles decoded together: four independent state chains keep the core busy */

/* y[M][R] = x[M][C] @ W^T for one matrix held as trellis tiles of `tile` x `tile` weights, as stored: tiles
 * [R/tile][C/tile] in row-major order, each `stride` bytes: s_0 in two bytes (little end first), then b_1..b_{T-1} as
 * one little-endian stream of k bits each. Tile (i, j)'s weight (r, c) is step r * tile + c of its walk, worth
 * cb[s] * scale[i * tile + r]. M <= 16 rows of float x.
 *
 * Each tile is decoded once into a small float buffer (LANES tiles of a tile row at a time, their state chains
 * interleaved) and applied to every row of x: for each input c, the tile's column c times x[c] added to the tile
 * row's `tile` accumulators, a vector operation without reassociation. */
int compress_trellis_rows(const float *x, const uint8_t *codes, int64_t stride, const float *cb, const float *scale,
                          float *y, int64_t M, int64_t R, int64_t C, int64_t L, int64_t k, int64_t tile) {
    if (M < 1 || M > 16 || tile < 1 || tile > 64 || R % tile || C % tile || L > 16 || k < 1 || k >= L) return 1;
    const int64_t T = tile * tile, nj = C / tile;
    const uint32_t mask = ((uint32_t)1 << L) - 1, low = ((uint32_t)1 << k) - 1;
    float *w = malloc(sizeof(float) * LANES * T), *acc = malloc(sizeof(float) * 16 * tile);
    if (!w || !acc) { free(w); free(acc); return 2; }
    for (int64_t i = 0; i < R / tile; ++i) {
        memset(acc, 0, sizeof(float) * M * tile);
        for (int64_t j0 = 0; j0 < nj; j0 += LANES) {
            const int nq = (int)(nj - j0 < LANES ? nj - j0 : LANES);
            uint32_t s[LANES] = {0};
            uint64_t bitbuf[LANES] = {0};
            int have[LANES] = {0};
            const uint8_t *bits[LANES];
            for (int q = 0; q < nq; ++q) {
                const uint8_t *p = codes + (i * nj + j0 + q) * stride;
                s[q] = ((uint32_t)p[0] | ((uint32_t)p[1] << 8)) & mask;
                bits[q] = p + 2;
                w[q * T] = cb[s[q]];
            }
            for (int64_t r = 0; r < tile; ++r) {  /* step t = r * tile + c, stored at c * tile + r */
                for (int64_t c = r ? 0 : 1; c < tile; ++c) {
                    const int64_t at = c * tile + r;
                    for (int q = 0; q < nq; ++q) {
                        if (have[q] < k) { bitbuf[q] |= (uint64_t)(*bits[q]++) << have[q]; have[q] += 8; }
                        s[q] = ((s[q] << k) | ((uint32_t)bitbuf[q] & low)) & mask;
                        bitbuf[q] >>= k; have[q] -= (int)k;
                        w[q * T + at] = cb[s[q]];
                    }
                }
            }
            for (int q = 0; q < nq; ++q) {
                const float *wq = w + q * T;
                for (int64_t m = 0; m < M; ++m) {
                    const float *xr = x + m * C + (j0 + q) * tile;
                    float *a = acc + m * tile;
                    for (int64_t c = 0; c < tile; ++c) {
                        const float xc = xr[c];
                        const float *col = wq + c * tile;
                        for (int64_t r = 0; r < tile; ++r) a[r] += col[r] * xc;
                    }
                }
            }
        }
        for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < tile; ++r) y[m * R + i * tile + r] = acc[m * tile + r] * scale[i * tile + r];
    }
    free(w); free(acc);
    return 0;
}
