/* The few-row bf16 product's tiles: y[m, n0 .. n0+wr) = x[m, K] . w[n0 .., K]^T (+ b), fp32
 * products and sums, rounded to bf16 once. Shared by the kernels that multiply a decode step's
 * rows (bf16_gemv.c, mla_project.c), so a product is the same bits whichever of them runs it.
 * Always inlined: each includer's target clones compile their own ISA. */
#ifndef DIST_GLM5_GEMV_TILES_H
#define DIST_GLM5_GEMV_TILES_H
#include <stdint.h>
#include <string.h>

#include "common.h"

#define WT 4 /* weight rows per tile, at most */
#define MT 4 /* x rows per tile, at most */

/* One tile: weight rows n0 .. n0+wr-1 (wr <= WT) times x rows r0 .. r0+mr-1 (mr <= MT), with
 * wr * mr <= 8 accumulators. Called with constant wr and mr: the loops unroll and the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *xf, int K, const uint16_t *w,
                                                       int n0, int wr, int r0, int mr,
                                                       const uint16_t *b, uint16_t *y, int N) {
    v8 acc[WT][MT];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++)
#pragma GCC unroll 4
        for (int r = 0; r < MT; r++) acc[j][r] = (v8){0};
    const uint16_t *wj[WT];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++) wj[j] = w + (int64_t)(n0 + (j < wr ? j : 0)) * K;
    int K8 = K & ~7;
    /* The next tile's rows follow these in memory: fetch them at this tile's pace, so a new set
     * of rows starts from cache (rows of K = 1024 on one thread here: 7.4 GB/s without, 16.2 with). */
    const char *next = (const char *)(w + (int64_t)(n0 + wr) * K);
    for (int k = 0; k < K8; k += 8) {
        __builtin_prefetch(next + (int64_t)wr * 2 * k, 0, 0);
        v8 a[WT];
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (j < wr) a[j] = widen(wj[j] + k);
#pragma GCC unroll 4
        for (int r = 0; r < MT; r++) {
            if (r < mr) {
                v8 xv = *(const v8 *)(xf + (int64_t)(r0 + r) * K + k); /* v8: 4-aligned */
#pragma GCC unroll 4
                for (int j = 0; j < WT; j++)
                    if (j < wr) acc[j][r] += a[j] * xv;
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        const float *xr = xf + (int64_t)(r0 + r) * K;
        for (int j = 0; j < wr; j++) {
            float s = HSUM(acc[j][r]);
            for (int k = K8; k < K; k++) s += bf16_to_f32(wj[j][k]) * xr[k];
            if (b) s += bf16_to_f32(b[n0 + j]);
            y[(int64_t)(r0 + r) * N + n0 + j] = f32_to_bf16(s);
        }
    }
}

/* Weight rows n0 .. n0+wr-1 against every x row: tiles of 4 weight rows x 2 x rows while a row
 * or two remain (decode: more weight streams in flight), 2 x 4 otherwise. */
static inline __attribute__((always_inline)) void rows(const float *xf, int m, int K,
                                                       const uint16_t *w, int n0, int wr,
                                                       const uint16_t *b, uint16_t *y, int N) {
    int r0 = 0;
    for (; m - r0 >= 4 && wr >= 2; r0 += 4) {
        tile(xf, K, w, n0, 2, r0, 4, b, y, N);
        if (wr > 2) tile(xf, K, w, n0 + 2, wr - 2 == 1 ? 1 : 2, r0, 4, b, y, N);
    }
    for (; r0 < m; r0 += 2) {
        int mr = m - r0 >= 2 ? 2 : 1;
        switch (wr * 4 + mr) {
        case 4 * 4 + 2: tile(xf, K, w, n0, 4, r0, 2, b, y, N); break;
        case 4 * 4 + 1: tile(xf, K, w, n0, 4, r0, 1, b, y, N); break;
        case 3 * 4 + 2: tile(xf, K, w, n0, 3, r0, 2, b, y, N); break;
        case 3 * 4 + 1: tile(xf, K, w, n0, 3, r0, 1, b, y, N); break;
        case 2 * 4 + 2: tile(xf, K, w, n0, 2, r0, 2, b, y, N); break;
        case 2 * 4 + 1: tile(xf, K, w, n0, 2, r0, 1, b, y, N); break;
        case 1 * 4 + 2: tile(xf, K, w, n0, 1, r0, 2, b, y, N); break;
        default: tile(xf, K, w, n0, 1, r0, 1, b, y, N);
        }
    }
}

/* Every weight row of np products of the same x against every x row (xf: x widened to fp32;
 * product i: weights w[i] [N[i], K], bias b[i] or NULL, output y[i]), weight rows in quads over
 * threads, all the products' quads in one parallel region: a decode step's projections of one
 * row are a few small products, and a region per product paid its fork, join and idle thread on
 * the smallest. A product's bits depend on m, never on the thread count or its companions.
 * A function with its own target clones, not an inlined helper: OpenMP outlines a parallel
 * region before inlining, so a region inside an always-inline helper compiled once, for the
 * baseline ISA, whatever its includer's clone (every decode product ran in SSE2 code until
 * this). */
static CLONES void products(const float *xf, int m, int K, int np, const uint16_t *const *w,
                            const int *N, const uint16_t *const *b, uint16_t *const *y,
                            int nthreads) {
    int start[9] = {0}; /* np <= 8: quad offsets of each product */
    for (int i = 0; i < np; i++) start[i + 1] = start[i] + (N[i] + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int q = 0; q < start[np]; q++) {
        int i = 0;
        while (q >= start[i + 1]) i++;
        int n0 = 4 * (q - start[i]), wr = N[i] - n0 < 4 ? N[i] - n0 : 4;
        rows(xf, m, K, w[i], n0, wr, b[i], y[i], N[i]);
    }
}

#endif
