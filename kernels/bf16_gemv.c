/* bf16 products of a few rows: y[m, N] = x[m, K] . w[N, K]^T (+ b[N]), bf16 in and out; and
 * the routed experts of a few tokens with bf16 weights, built on the same tiles (end of file).
 *
 * Why: a decode step multiplies one row (or a batch's few rows) by every dense weight. On CPUs
 * without bf16 dot-product instructions torch runs that GEMV on a generic path that widens element
 * by element (about 8 GB/s of weights per core here against 15-27 GB/s for fp32's), and its fp32
 * route for a few rows copies the whole weight to fp32 first. Here each weight row is read once,
 * widened in registers (a bf16 is the top half of an fp32: a shift), and multiplied into every x
 * row while in L1, so the product runs at the rate memory delivers the weight.
 * Products and sums are fp32, as torch's bf16 GEMM accumulates; the result is rounded to bf16 once
 * (nearest even). Only the order of the fp32 additions differs from torch's.
 * Tiles of 8-lane accumulators (8 of 16 AVX2 registers): 4 weight rows x 2 x rows for one or two
 * rows (four weight streams in flight from DRAM), 2 x 4 for more; weight rows split over threads. target_clones: GCC picks AVX-512 / AVX2+FMA / baseline at load time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif


typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));



static inline __attribute__((always_inline)) v8 widen(const uint16_t *p) {  /* 8 bf16 -> 8 fp32 */
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8 f;
    memcpy(&f, &u, sizeof f);
    return f;
}


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

/* x [m, K], w [N, K], b [N] or NULL, y [m, N]: all bf16, contiguous. Returns 0, or -1 when the
 * fp32 copy of x cannot be allocated. */
CLONES int bf16_gemv(const uint16_t *x, int m, int K, const uint16_t *w, int N, const uint16_t *b,
                     uint16_t *y, int nthreads) {
    float *xf = malloc((size_t)m * K * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)m * K; i++) xf[i] = bf16_to_f32(x[i]);
    int quads = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int q = 0; q < quads; q++) {
        int n0 = 4 * q, wr = N - n0 < 4 ? N - n0 : 4;
        rows(xf, m, K, w, n0, wr, b, y, N);
    }
    free(xf);
    return 0;
}

/* ----- Routed experts with bf16 weights, for a few tokens: what ops/experts.experts_reference
 * does with torch's bf16 ops, every rounding where torch rounds (gate and up products, silu, their
 * product, the down product, the route weight, and each expert's add into the output in
 * ascending expert order), the products by the tiles above. The reference loops over experts in
 * Python: about ten eager ops per expert, 8 experts per layer, which at batch 1 cost more than
 * reading the experts' weights. */

static inline float silu_bf(float g) { return bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g)))); }
static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* x [T, H] bf16, ids [T, k] int32 global, tw [T, k] fp32, w13 [E, 2I, H], w2 [E, H, I] bf16
 * (this rank's experts e_min .. e_min+E-1), out [T, H] bf16. Returns 0, or -1 (no memory). */
CLONES int bf16_experts(const uint16_t *x, int T, int H, int I, int k, const int32_t *ids,
                        const float *tw, int e_min, int E, const uint16_t *w13, const uint16_t *w2,
                        uint16_t *out, int nthreads) {
    int R = T * k;
    int *tok = malloc(sizeof(int) * (R + 1)), *slot = malloc(sizeof(int) * (R + 1));
    int *first = malloc(sizeof(int) * (E + 1));
    float *xf = malloc(sizeof(float) * ((size_t)T * H + 1)),
          *act = malloc(sizeof(float) * ((size_t)T * I + 1)),
          *acc = malloc(sizeof(float) * ((size_t)T * H + 1));
    uint16_t *g16 = malloc(sizeof(uint16_t) * ((size_t)T * 2 * I + 1)),
             *y16 = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
    int rc = -1;
    if (!tok || !slot || !first || !xf || !act || !acc || !g16 || !y16) goto done;
    /* routes grouped by local expert, ascending (counting sort: tokens keep their order) */
    memset(first, 0, sizeof(int) * (E + 1));
    for (int r = 0; r < R; r++) {
        int e = ids[r] - e_min;
        if (e >= 0 && e < E) first[e + 1]++;
    }
    for (int e = 0; e < E; e++) first[e + 1] += first[e];
    {
        int *fill = malloc(sizeof(int) * (E + 1));
        if (!fill) goto done;
        memcpy(fill, first, sizeof(int) * (E + 1));
        for (int r = 0; r < R; r++) {
            int e = ids[r] - e_min;
            if (e >= 0 && e < E) {
                tok[fill[e]] = r / k;
                slot[fill[e]++] = r % k;
            }
        }
        free(fill);
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++) acc[i] = 0.0f; /* torch.zeros_like(x) */
    int nt = nthreads > 1 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int e = 0; e < E; e++) {
        int a = first[e], n = first[e + 1] - a;
        if (n == 0) continue; /* the same on every thread: no barrier skipped by some */
#pragma omp single
        for (int j = 0; j < n; j++)
            for (int h = 0; h < H; h++) xf[(int64_t)j * H + h] = bf16_to_f32(x[(int64_t)tok[a + j] * H + h]);
        const uint16_t *we = w13 + (int64_t)e * 2 * I * H;
#pragma omp for schedule(static)
        for (int q = 0; q < (2 * I + 3) / 4; q++) {
            int n0 = 4 * q, wr = 2 * I - n0 < 4 ? 2 * I - n0 : 4;
            rows(xf, n, H, we, n0, wr, NULL, g16, 2 * I);
        }
#pragma omp single
        for (int j = 0; j < n; j++)
            for (int i = 0; i < I; i++) {
                float g = bf16_to_f32(g16[(int64_t)j * 2 * I + i]);
                float u = bf16_to_f32(g16[(int64_t)j * 2 * I + I + i]);
                act[(int64_t)j * I + i] = rnd(silu_bf(g) * u);
            }
        const uint16_t *wd = w2 + (int64_t)e * H * I;
#pragma omp for schedule(static)
        for (int q = 0; q < (H + 3) / 4; q++) {
            int n0 = 4 * q, wr = H - n0 < 4 ? H - n0 : 4;
            rows(act, n, I, wd, n0, wr, NULL, y16, H);
        }
#pragma omp single
        for (int j = 0; j < n; j++) {
            float wt = rnd(tw[(int64_t)tok[a + j] * k + slot[a + j]]);
            float *o = acc + (int64_t)tok[a + j] * H;
            for (int h = 0; h < H; h++) o[h] = rnd(o[h] + rnd(bf16_to_f32(y16[(int64_t)j * H + h]) * wt));
        }
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++) out[i] = f32_to_bf16(acc[i]);
    rc = 0;
done:
    free(tok), free(slot), free(first), free(xf), free(act), free(acc), free(g16), free(y16);
    return rc;
}
