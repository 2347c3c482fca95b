/* The few-row bf16 product's tiles: y[m, n0 .. n0+wr) = x[m, K] . w[n0 .., K]^T (+ b), fp32
 * products and sums, rounded to bf16 once. Shared by the kernels that multiply a decode step's
 * rows (bf16_gemv.c, mla_project.c), so a product is the same bits whichever of them runs it.
 * Always inlined: each includer's target clones compile their own ISA. */
#ifndef DIST_GLM5_GEMV_TILES_H
#define DIST_GLM5_GEMV_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
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
     * of rows starts from cache (rows of K = 1024 on one thread here: 7.4 GB/s without, 16.2 with).
     * Into every level (T0): the non-temporal hint skips L2 on Intel cores, where one row of
     * GLM-5's q_a read 5.8 GB/s with it and 12.0 without (an Intel Xeon with AMX; bench linear) */
    const char *next = (const char *)(w + (int64_t)(n0 + wr) * K);
    for (int k = 0; k < K8; k += 8) {
        __builtin_prefetch(next + (int64_t)wr * 2 * k, 0, 3);
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

/* The tiles over every x row for weight rows n0 .. n0+wr-1, each tile called with constant
 * shapes (TILE: tile or tile16, on X): 4 weight rows x 2 x rows while a row or two remain (decode:
 * more weight streams in flight), 2 x 4 otherwise. */
#define ROWS_OF(TILE, X)                                                                         \
    do {                                                                                         \
        int r0 = 0;                                                                              \
        for (; m - r0 >= 4 && wr >= 2; r0 += 4) {                                                \
            TILE(X, K, w, n0, 2, r0, 4, b, y, N);                                                \
            if (wr > 2) TILE(X, K, w, n0 + 2, wr - 2 == 1 ? 1 : 2, r0, 4, b, y, N);              \
        }                                                                                        \
        for (; r0 < m; r0 += 2) {                                                                \
            int mr = m - r0 >= 2 ? 2 : 1;                                                        \
            switch (wr * 4 + mr) {                                                               \
            case 4 * 4 + 2: TILE(X, K, w, n0, 4, r0, 2, b, y, N); break;                         \
            case 4 * 4 + 1: TILE(X, K, w, n0, 4, r0, 1, b, y, N); break;                         \
            case 3 * 4 + 2: TILE(X, K, w, n0, 3, r0, 2, b, y, N); break;                         \
            case 3 * 4 + 1: TILE(X, K, w, n0, 3, r0, 1, b, y, N); break;                         \
            case 2 * 4 + 2: TILE(X, K, w, n0, 2, r0, 2, b, y, N); break;                         \
            case 2 * 4 + 1: TILE(X, K, w, n0, 2, r0, 1, b, y, N); break;                         \
            case 1 * 4 + 2: TILE(X, K, w, n0, 1, r0, 2, b, y, N); break;                         \
            default: TILE(X, K, w, n0, 1, r0, 1, b, y, N);                                       \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* ROWS_OF for the AVX-512 tiles (TILE: tilez or tile16), which have 32 registers: a whole quad
 * of weight rows against 6 x rows at a time first (24 accumulators: vdpbf16ps's latency needs
 * about 12 in flight, and 4 + 6 loads feed 24 of them, where ROWS_OF's 2 x 4 tile, shaped for 16
 * AVX2 registers, loads 6 for 8), then ROWS_OF's tiles for what is left. The tile shape does not
 * change a product's bits. */
#define QUADS6_OF(TILE, X)                                                                       \
    do {                                                                                         \
        if (wr == 4) {                                                                           \
            int q0 = 0;                                                                          \
            for (; m - q0 >= MT16; q0 += MT16) TILE(X, K, w, n0, 4, q0, MT16, b, y, N);         \
            if (m - q0 >= 4) {                                                                   \
                TILE(X, K, w, n0, 4, q0, 4, b, y, N);                                            \
                q0 += 4;                                                                         \
            }                                                                                    \
            X += (int64_t)q0 * K, y += (int64_t)q0 * N, m -= q0;                                 \
        }                                                                                        \
        ROWS_OF(TILE, X);                                                                        \
    } while (0)

/* Weight rows n0 .. n0+wr-1 against every x row (fp32 tiles). */
static inline __attribute__((always_inline)) void rows(const float *xf, int m, int K,
                                                       const uint16_t *w, int n0, int wr,
                                                       const uint16_t *b, uint16_t *y, int N) {
    ROWS_OF(tile, xf);
}

/* ---- The fp32 tiles with 16 lanes, for CPUs with AVX-512 but not AVX512-BF16 (Skylake-X to
 * Ice Lake): the 8-lane tiles above are what an x86-64-v4 clone makes of a v8 (one ymm), so at
 * batch 32, where the products are arithmetic, half of each FMA unit idled (the small model's bf16
 * step at 32 rows, one thread of an Ice Lake Xeon: 1.34x llama.cpp's). Lane l takes k = l mod 16
 * in k order, a short tail the scalar loop, then _mm512_reduce_add_ps: a fixed order per (row,
 * weight row) whatever the tile, so a row's bits depend on neither m nor the thread count (they
 * differ from the 8-lane tiles' by the order of the fp32 additions). DIST_GLM5_GEMV_ZMM=0 keeps
 * the 8-lane tiles (tests and benches compare the two). */
#define ZMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

static inline __attribute__((always_inline)) ZMM __m512 widen16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define MT16 6 /* x rows per AVX-512 tile (tilez, tile16), at most: 4 x 6 of 32 registers */

static inline __attribute__((always_inline)) ZMM void tilez(const float *xf, int K,
                                                            const uint16_t *w, int n0, int wr,
                                                            int r0, int mr, const uint16_t *b,
                                                            uint16_t *y, int N) {
    __m512 acc[WT][MT16];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++)
#pragma GCC unroll 6
        for (int r = 0; r < MT16; r++) acc[j][r] = _mm512_setzero_ps();
    const uint16_t *wj[WT];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++) wj[j] = w + (int64_t)(n0 + (j < wr ? j : 0)) * K;
    const int K16 = K & ~15;
    const char *next = (const char *)(w + (int64_t)(n0 + wr) * K);
    for (int k = 0; k < K16; k += 16) {
        /* the next tile's rows at this one's pace (as the 8-lane tile): wr x 32 bytes a step */
        for (int o = 0; o < wr * 32; o += 64)
            __builtin_prefetch(next + (int64_t)wr * 2 * k + o, 0, 3);
        __m512 a[WT];
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (j < wr) a[j] = widen16(wj[j] + k);
#pragma GCC unroll 6
        for (int r = 0; r < MT16; r++) {
            if (r < mr) {
                const __m512 xv = _mm512_loadu_ps(xf + (int64_t)(r0 + r) * K + k);
#pragma GCC unroll 4
                for (int j = 0; j < WT; j++)
                    if (j < wr) acc[j][r] = _mm512_fmadd_ps(a[j], xv, acc[j][r]);
            }
        }
    }
    /* constant bounds, as tile16's: an accumulator indexed at run time would live in memory */
#pragma GCC unroll 6
    for (int r = 0; r < MT16; r++)
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (r < mr && j < wr) {
                const float *xr = xf + (int64_t)(r0 + r) * K;
                float s = _mm512_reduce_add_ps(acc[j][r]);
                for (int k = K16; k < K; k++) s += bf16_to_f32(wj[j][k]) * xr[k];
                if (b) s += bf16_to_f32(b[n0 + j]);
                y[(int64_t)(r0 + r) * N + n0 + j] = f32_to_bf16(s);
            }
}

/* rows, with the 16-lane tiles (QUADS6_OF). */
static inline __attribute__((always_inline)) ZMM void rowsz(const float *xf, int m, int K,
                                                            const uint16_t *w, int n0, int wr,
                                                            const uint16_t *b, uint16_t *y,
                                                            int N) {
    QUADS6_OF(tilez, xf);
}

/* Weight rows [n0, n0 + wr) against the n fp32 rows xf with the 16-lane tiles (quad16's twin). */
static __attribute__((unused)) ZMM void quadz(const float *xf, int n, int K, const uint16_t *w,
                                              int n0, int wr, uint16_t *y, int N) {
    rowsz(xf, n, K, w, n0, wr, NULL, y, N);
}

/* ---- The same tiles with AVX512-BF16 (vdpbf16ps: 16 lanes, each adding a pair of bf16
 * products a step): x in bf16 (x16: xf's values, which are bf16), weight rows read as they are.
 * Per (row, weight row) the order is fixed whatever the tile: lane l takes pairs 2l, 2l+1 of each
 * 32-element chunk in k order (a short last chunk zero-padded), then the lanes' fixed-order sum;
 * so, as above, a product's bits depend on neither m nor the thread count. Products are exact in
 * fp32 as in the fp32 tiles; the sums run in another order (and flush subnormals, as the
 * instruction does). About 4x the fp32 tiles' products an instruction: at 8-32 rows the fp32
 * tiles ran 3-6x slower than torch's bf16 GEMM on such a CPU. */
#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

static inline __attribute__((always_inline)) BF16DOT void tile16(const uint16_t *x16, int K,
                                                                 const uint16_t *w, int n0, int wr,
                                                                 int r0, int mr,
                                                                 const uint16_t *b, uint16_t *y,
                                                                 int N) {
    __m512 acc[WT][MT16];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++)
#pragma GCC unroll 6
        for (int r = 0; r < MT16; r++) acc[j][r] = _mm512_setzero_ps();
    const uint16_t *wj[WT];
#pragma GCC unroll 4
    for (int j = 0; j < WT; j++) wj[j] = w + (int64_t)(n0 + (j < wr ? j : 0)) * K;
    const char *next = (const char *)(w + (int64_t)(n0 + wr) * K);
    for (int k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1);
        /* the next tile's rows at this one's pace: wr cache lines a step, as the fp32 tile */
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (j < wr) __builtin_prefetch(next + (int64_t)wr * 2 * k + 64 * j, 0, 3);
        __m512bh a[WT];
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (j < wr) a[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, wj[j] + k);
#pragma GCC unroll 6
        for (int r = 0; r < MT16; r++) {
            if (r < mr) {
                const __m512bh xv =
                    (__m512bh)_mm512_maskz_loadu_epi16(m, x16 + (int64_t)(r0 + r) * K + k);
#pragma GCC unroll 4
                for (int j = 0; j < WT; j++)
                    if (j < wr) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], a[j], xv);
            }
        }
    }
    /* unrolled with constant bounds, as the loop above: an accumulator indexed at run time
     * lives in memory, and gcc then stored all of them every step (24 stores a step: the
     * tiles ran at half of vdpbf16ps's rate) */
#pragma GCC unroll 6
    for (int r = 0; r < MT16; r++)
#pragma GCC unroll 4
        for (int j = 0; j < WT; j++)
            if (r < mr && j < wr) {
                float s = _mm512_reduce_add_ps(acc[j][r]);
                if (b) s += bf16_to_f32(b[n0 + j]);
                y[(int64_t)(r0 + r) * N + n0 + j] = f32_to_bf16(s);
            }
}

/* rows, with the AVX512-BF16 tiles (QUADS6_OF). */
static inline __attribute__((always_inline)) BF16DOT void rows16(const uint16_t *x16, int m,
                                                                 int K, const uint16_t *w, int n0,
                                                                 int wr, const uint16_t *b,
                                                                 uint16_t *y, int N) {
    QUADS6_OF(tile16, x16);
}

/* Weight rows [n0, n0 + wr) of w [N, K] against the n bf16 rows x16 with the AVX512-BF16 tiles:
 * y [n, N] (row stride N). A function with their target, so that they inline in it: a caller's
 * own parallel region calls it per work item (a CLONES caller cannot inline a BF16DOT helper). */
static __attribute__((unused)) BF16DOT void quad16(const uint16_t *x16, int n, int K,
                                                   const uint16_t *w, int n0, int wr, uint16_t *y,
                                                   int N) {
    rows16(x16, n, K, w, n0, wr, NULL, y, N);
}

/* The np products' weight rows in quads over threads (ROWSFN: rows or rows16, on X); np <= 8. */
#define OVER_QUADS(ROWSFN, X)                                                                    \
    do {                                                                                         \
        int start[9] = {0}; /* quad offsets of each product */                                   \
        for (int i = 0; i < np; i++) start[i + 1] = start[i] + (N[i] + 3) / 4;                   \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)")     \
        for (int q = 0; q < start[np]; q++) {                                                    \
            int i = 0;                                                                           \
            while (q >= start[i + 1]) i++;                                                       \
            int n0 = 4 * (q - start[i]), wr = N[i] - n0 < 4 ? N[i] - n0 : 4;                     \
            ROWSFN(X, m, K, w[i], n0, wr, b[i], y[i], N[i]);                                     \
        }                                                                                        \
    } while (0)

static BF16DOT void products16(const uint16_t *x16, int m, int K, int np, const uint16_t *const *w,
                               const int *N, const uint16_t *const *b, uint16_t *const *y,
                               int nthreads) {
    OVER_QUADS(rows16, x16);
}

static ZMM void productsz(const float *xf, int m, int K, int np, const uint16_t *const *w,
                          const int *N, const uint16_t *const *b, uint16_t *const *y,
                          int nthreads) {
    OVER_QUADS(rowsz, xf);
}

/* Whether products take the AVX512-BF16 tiles: the CPU has them and DIST_GLM5_GEMV_FP32 is not
 * set (tests and benches compare the two). */
static int bf16dot(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("DIST_GLM5_GEMV_FP32");
        on = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
             !(e && *e && strcmp(e, "0"));
    }
    return on;
}

/* Whether the fp32 tiles take 16 lanes: the CPU has AVX-512 (F, BW, VL, DQ), not the
 * AVX512-BF16 tiles, and DIST_GLM5_GEMV_ZMM is not 0. */
static __attribute__((unused)) int zmm(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("DIST_GLM5_GEMV_ZMM");
        on = !bf16dot() && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") &&
             !(e && *e && !strcmp(e, "0"));
    }
    return on;
}

/* ---- The same products on AMX-BF16 (Intel Xeon from Sapphire Rapids on): tdpbf16ps multiplies
 * a tile of up to 16 weight rows x 32 inputs (A, loaded straight from w at its row stride: no
 * repacking of the weights) by those 32 inputs x up to 16 x rows (B: x's dword pairs
 * transposed, packed once a call by amx_pack) into 16 x 16 fp32 sums (C). 512 products an
 * instruction where vdpbf16ps does 32: at 32 rows the vdpbf16ps tiles read a weight at 20% of
 * the read rate on such a CPU (bench linear), these at about the read rate at any row count.
 * Products are exact in fp32 as in the other tiles; C[r][t] is summed pair by pair, block after
 * block, in an order fixed by K alone, so a row's bits depend neither on the rows beside it nor
 * on the thread (the tests check both). Subnormals flush, as with vdpbf16ps. K % 32 == 0 only
 * (every model's shapes); other products keep the vdpbf16ps tiles. */

/* x [m, K] -> xT, amx_pack_rows' layout (rows [a, a + n) of x pack into xT + a * K). */
static __attribute__((unused)) void amx_pack(const uint16_t *x, int m, int K, uint16_t *xT) {
    for (int c = 0; c < m; c += 16) {
        const uint16_t *rows[16];
        const int mt = m - c < 16 ? m - c : 16;
        for (int t = 0; t < mt; t++) rows[t] = x + (int64_t)(c + t) * K;
        amx_pack_rows(rows, mt, K, xT + (int64_t)c * K);
    }
}

#if HAVE_AMX
/* Weight rows [n0, n0 + ar) (ar <= 16) of w [N, K] against the m packed x rows xT: y [m, N]
 * (+ b), 32 x rows a pass (two C tiles sharing each A tile); cfg_key: amx_bf16_shape's. */
static __attribute__((unused)) AMX_BF16_T void amx_rows(const uint16_t *xT, int m, int K,
                                                     const uint16_t *w, int n0, int ar,
                                                     const uint16_t *b, uint16_t *y, int N,
                                                     int *cfg_key) {
    float c[2][16 * 16];
    const uint16_t *wa = w + (int64_t)n0 * K;
    for (int t0 = 0; t0 < m; t0 += 32) {
        const int m0 = m - t0 < 16 ? m - t0 : 16;
        const int m1 = m - t0 - 16 <= 0 ? 0 : (m - t0 - 16 < 16 ? m - t0 - 16 : 16);
        amx_bf16_shape(ar, m0, m1, cfg_key);
        _tile_zero(0);
        if (m1) _tile_zero(1);
        const uint16_t *b0 = xT + (int64_t)t0 * K, *b1 = xT + (int64_t)(t0 + 16) * K;
        /* the next 16 rows follow these in memory: fetch them at this pass's pace, so that the
         * next call starts from cache (16 streams are more than the prefetcher follows), into L2
         * (locality 2): into L1 they pushed out lines of the tile being read (the bf16 experts
         * at 32 tokens, one thread: 16.4-16.7 ms against 16.9-17.5, and none 17.2-17.8) */
        const char *next = (const char *)(wa + (int64_t)ar * K);
        const int64_t pace = t0 == 0 ? 2 * (int64_t)ar * 32 : 0; /* bytes a block, first pass */
        for (int kb = 0; kb < K / 32; kb++) {
            for (int64_t o = 0; o < pace; o += 64) __builtin_prefetch(next + pace * kb + o, 0, 2);
            _tile_loadd(2, wa + 32 * kb, 2 * K);
            AMX_BF16_BLOCK(2, b0, b1, kb, m0, m1);
        }
        AMX_BF16_STORE(c, m0, m1);
        for (int h = 0; h < 2; h++) {
            const int mt = h ? m1 : m0;
            for (int t = 0; t < mt; t++)
                for (int r = 0; r < ar; r++) {
                    float s = c[h][r * mt + t];
                    if (b) s += bf16_to_f32(b[n0 + r]);
                    y[(int64_t)(t0 + 16 * h + t) * N + n0 + r] = f32_to_bf16(s);
                }
        }
    }
}
#endif

/* Whether products of K inputs take the AMX tiles: built with them, the CPU has AMX-BF16 and the
 * vdpbf16ps tiles, Linux lets this process use the tiles (arch_prctl ARCH_REQ_XCOMP_PERM, once),
 * K % 32 == 0, and DIST_GLM5_GEMV_AMX is not 0 (tests and benches compare the paths). */
static __attribute__((unused)) int amx16(int K) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("DIST_GLM5_GEMV_AMX");
        on = bf16dot() && !(e && *e && !strcmp(e, "0")) && amx_here(AMX_BF16);
    }
    return on && K % 32 == 0;
}

#if HAVE_AMX
/* The np products' weight rows, 16 at a time over threads, on the AMX tiles (xT: amx_pack's). */
static __attribute__((unused)) AMX_BF16_T void products_amx(const uint16_t *xT, int m, int K, int np,
                                                         const uint16_t *const *w, const int *N,
                                                         const uint16_t *const *b,
                                                         uint16_t *const *y, int nthreads) {
    int start[9] = {0}; /* 16-row unit offsets of each product */
    for (int i = 0; i < np; i++) start[i + 1] = start[i] + (N[i] + 15) / 16;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int cfg = -1;
#pragma omp for schedule(static)
        for (int q = 0; q < start[np]; q++) {
            int i = 0;
            while (q >= start[i + 1]) i++;
            const int n0 = 16 * (q - start[i]), ar = N[i] - n0 < 16 ? N[i] - n0 : 16;
            amx_rows(xT, m, K, w[i], n0, ar, b[i], y[i], N[i], &cfg);
        }
        if (cfg >= 0) amx_bf16_release();
    }
}
#endif

/* Every weight row of np products of the same x (bf16 [m, K]) against every x row (product i:
 * weights w[i] [N[i], K], bias b[i] or NULL, output y[i]), weight rows in quads over threads,
 * all the products' quads in one parallel region: a decode step's projections of one row are a
 * few small products, and a region per product paid its fork, join and idle thread on the
 * smallest. A product's bits depend on m, never on the thread count or its companions. The fp32
 * tiles take x widened once here; the AVX512-BF16 tiles take it as it is.
 * A function with its own target clones, not an inlined helper: OpenMP outlines a parallel
 * region before inlining, so a region inside an always-inline helper compiled once, for the
 * baseline ISA, whatever its includer's clone (every decode product ran in SSE2 code until
 * this). Returns 0, or -1 when the fp32 copy of x (the AMX tiles: its packed copy) cannot be
 * allocated. */
static CLONES int products(const uint16_t *x, int m, int K, int np, const uint16_t *const *w,
                           const int *N, const uint16_t *const *b, uint16_t *const *y,
                           int nthreads) {
#if HAVE_AMX
    if (amx16(K)) {
        uint16_t *xT = malloc(sizeof(uint16_t) * ((size_t)m * K + 1));
        if (!xT) return -1;
        amx_pack(x, m, K, xT);
        products_amx(xT, m, K, np, w, N, b, y, nthreads);
        free(xT);
        return 0;
    }
#endif
    if (bf16dot()) {
        products16(x, m, K, np, w, N, b, y, nthreads);
        return 0;
    }
    float *xf = malloc(sizeof(float) * ((size_t)m * K + 1));
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)m * K; i++) xf[i] = bf16_to_f32(x[i]);
    if (zmm())
        productsz(xf, m, K, np, w, N, b, y, nthreads);
    else
        OVER_QUADS(rows, xf);
    free(xf);
    return 0;
}

#endif
