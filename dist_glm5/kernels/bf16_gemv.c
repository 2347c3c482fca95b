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
 * On CPUs with AVX-512 but not AVX512-BF16 the same tiles take 16 lanes (gemv_tiles.h's tilez,
 * 4 weight rows x 6 x rows first; DIST_GLM5_GEMV_ZMM=0 keeps the 8-lane ones).
 * On CPUs with AVX512-BF16 the dense products take gemv_tiles.h's vdpbf16ps tiles instead (same
 * tile shapes; DIST_GLM5_GEMV_FP32=1 keeps the fp32 ones), and on CPUs with AMX-BF16 its AMX
 * tiles (DIST_GLM5_GEMV_AMX=0 keeps the vdpbf16ps ones); the experts below too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gemv_tiles.h"
#ifdef _OPENMP
#include <omp.h>
#endif


/* x [m, K], w [N, K], b [N] or NULL, y [m, N]: all bf16, contiguous. Returns 0, or -1 when the
 * fp32 copy of x cannot be allocated. */
CLONES int bf16_gemv(const uint16_t *x, int m, int K, const uint16_t *w, int N, const uint16_t *b,
                     uint16_t *y, int nthreads) {
    return products(x, m, K, 1, &w, &N, &b, &y, nthreads);
}

/* Whether products of K inputs take the AMX tiles here (tests, benches). */
int bf16_gemv_amx(int K) { return amx16(K); }

/* Whether the fp32 tiles take 16 lanes here (tests, benches). */
int bf16_gemv_zmm(void) { return zmm(); }

/* ----- Routed experts with bf16 weights, for a few tokens: what ops/experts.experts_reference
 * does with torch's bf16 ops, every rounding where torch rounds (gate and up products, silu, their
 * product, the down product, the route weight, and each expert's add into the output in
 * ascending expert order), the products by the tiles above. The reference loops over experts in
 * Python: about ten eager ops per expert, 8 experts per layer, which at batch 1 cost more than
 * reading the experts' weights. */

static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One route's act = rnd(rnd(silu(gate)) * up) over I values from its gate and up rows gu [2I]
 * (bf16), as torch's bf16 ops round: into a16 (bf16) when not NULL, else act (fp32). 8 lanes
 * at a time (common.h's vsilu, as silu_mul_row). */
CLONES static void silu_mul_bf16(const uint16_t *gu, int I, uint16_t *a16, float *act) {
    for (int i = 0; i < I; i += 8) {
        const int n = I - i < 8 ? I - i : 8;
        uint16_t g8[8] = {0}, u8[8] = {0};
        memcpy(g8, gu + i, sizeof(uint16_t) * n), memcpy(u8, gu + I + i, sizeof(uint16_t) * n);
        const v8 v = round_bf16_8(round_bf16_8(vsilu(widen(g8))) * widen(u8));
        float o[8];
        memcpy(o, &v, sizeof o);
        for (int l = 0; l < n; l++) {
            if (a16) a16[i + l] = f32_to_bf16(o[l]); /* exact: o is a bf16 value */
            else act[i + l] = o[l];
        }
    }
}

/* x [T, H] bf16, ids [T, k] int32 global, tw [T, k] fp32, w13 [E, 2I, H], w2 [E, H, I] bf16
 * (this rank's experts e_min .. e_min+E-1), out [T, H] bf16. Returns 0, or -1 (no memory).
 * One parallel region, the touched experts GROUP at a time in phases (four barriers per expert
 * cost more than the products at batch 1; all experts at once left the routes' buffers in L3 at
 * batch 32): gate/up of every (expert, weight quad), silu x up of every route, down of every
 * (expert, weight quad), then the routes' adds in ascending expert order per output column. A
 * product's bits do not depend on the tile or the thread that computes it, so the result is the
 * loop's whatever the thread count. */
enum { GROUP = 8 }; /* touched experts per phase: batch 1's 8 in one */

/* Each of a phase's ng experts' routes' rows of src (K wide; the expert's first route at
 * first[te[q]] - base) packed for the AMX B tiles at the same place in dst. A worksharing loop
 * without its own region: called by every thread of bf16_experts' region. */
static void pack_experts(const uint16_t *src, int K, const int *te, int ng, const int *first,
                         int base, uint16_t *dst) {
#pragma omp for schedule(static)
    for (int q = 0; q < ng; q++) {
        const int64_t a = first[te[q]] - base;
        amx_pack(src + a * K, first[te[q] + 1] - first[te[q]], K, dst + a * K);
    }
}

CLONES int bf16_experts(const uint16_t *x, int T, int H, int I, int k, const int32_t *ids,
                        const float *tw, int e_min, int E, const uint16_t *w13, const uint16_t *w2,
                        uint16_t *out, int nthreads) {
    const int R = T * k, bd = bf16dot(); /* bd: the AVX512-BF16 tiles, on bf16 x and act */
    const int z = zmm(); /* the 16-lane fp32 tiles (never with bd: zmm() asks !bf16dot()) */
    const int amx = bd && amx16(H) && amx16(I); /* the AMX tiles, on x and act packed (xT, aT) */
    int *tok = malloc(sizeof(int) * (R + 1)), *slot = malloc(sizeof(int) * (R + 1));
    int *first = malloc(sizeof(int) * (E + 1)), *fill = malloc(sizeof(int) * (E + 1));
    int *touched = malloc(sizeof(int) * (E + 1));
    float *xf = bd ? NULL : malloc(sizeof(float) * ((size_t)R * H + 1)),
          *act = bd ? NULL : malloc(sizeof(float) * ((size_t)R * I + 1)),
          *acc = malloc(sizeof(float) * ((size_t)T * H + 1));
    uint16_t *x16 = bd ? malloc(sizeof(uint16_t) * ((size_t)R * H + 1)) : NULL,
             *a16 = bd ? malloc(sizeof(uint16_t) * ((size_t)R * I + 1)) : NULL,
             *g16 = malloc(sizeof(uint16_t) * ((size_t)R * 2 * I + 1)),
             *y16 = malloc(sizeof(uint16_t) * ((size_t)R * H + 1)),
             *xT = amx ? malloc(sizeof(uint16_t) * ((size_t)R * H + 1)) : NULL,
             *aT = amx ? malloc(sizeof(uint16_t) * ((size_t)R * I + 1)) : NULL;
    int rc = -1;
    if (!tok || !slot || !first || !fill || !touched || !acc || !g16 || !y16 ||
        (bd ? !x16 || !a16 : !xf || !act) || (amx && (!xT || !aT)))
        goto done;
    /* routes grouped by local expert, ascending (counting sort: tokens keep their order) */
    memset(first, 0, sizeof(int) * (E + 1));
    for (int r = 0; r < R; r++) {
        int e = ids[r] - e_min;
        if (e >= 0 && e < E) first[e + 1]++;
    }
    int nt_e = 0;
    for (int e = 0; e < E; e++) {
        if (first[e + 1]) touched[nt_e++] = e;
        first[e + 1] += first[e];
    }
    memcpy(fill, first, sizeof(int) * (E + 1));
    for (int r = 0; r < R; r++) {
        int e = ids[r] - e_min;
        if (e >= 0 && e < E) {
            tok[fill[e]] = r / k;
            slot[fill[e]++] = r % k;
        }
    }
    /* work items: weight quads, or 16-row units on AMX */
    const int unit = amx ? 16 : 4, q13 = (2 * I + unit - 1) / unit, q2 = (H + unit - 1) / unit;
    for (int64_t i = 0; i < (int64_t)T * H; i++) acc[i] = 0.0f; /* torch.zeros_like(x) */
    int nt = nthreads > 1 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
    int cfg = -1; /* this thread's AMX tile configuration (amx_rows) */
    for (int g0 = 0; g0 < nt_e; g0 += GROUP) { /* the same on every thread */
        const int ng = nt_e - g0 < GROUP ? nt_e - g0 : GROUP, *te = touched + g0;
        const int base = first[te[0]], Rl = first[te[ng - 1] + 1] - base; /* the group's routes */
        /* each route's x row, in route order (an expert's rows are then contiguous) */
#pragma omp for schedule(static)
        for (int j = 0; j < Rl; j++) {
            const uint16_t *xr = x + (int64_t)tok[base + j] * H;
            if (bd)
                memcpy(x16 + (int64_t)j * H, xr, sizeof(uint16_t) * H);
            else
                for (int h = 0; h < H; h++) xf[(int64_t)j * H + h] = bf16_to_f32(xr[h]);
        }
        if (amx) pack_experts(x16, H, te, ng, first, base, xT);
#pragma omp for schedule(static)
        for (int it = 0; it < ng * q13; it++) { /* gate and up: g16 [route, 2I] */
            const int e = te[it / q13], a = first[e] - base, n = first[e + 1] - first[e];
            const int n0 = unit * (it % q13), wr = 2 * I - n0 < unit ? 2 * I - n0 : unit;
            const uint16_t *we = w13 + (int64_t)e * 2 * I * H;
#if HAVE_AMX
            if (amx)
                amx_rows(xT + (int64_t)a * H, n, H, we, n0, wr, NULL, g16 + (int64_t)a * 2 * I, 2 * I,
                         &cfg);
            else
#endif
            if (bd)
                quad16(x16 + (int64_t)a * H, n, H, we, n0, wr, g16 + (int64_t)a * 2 * I, 2 * I);
            else if (z)
                quadz(xf + (int64_t)a * H, n, H, we, n0, wr, g16 + (int64_t)a * 2 * I, 2 * I);
            else
                rows(xf + (int64_t)a * H, n, H, we, n0, wr, NULL, g16 + (int64_t)a * 2 * I, 2 * I);
        }
#pragma omp for schedule(static)
        for (int j = 0; j < Rl; j++) /* act = silu(gate) * up, rounded as torch rounds */
            silu_mul_bf16(g16 + (int64_t)j * 2 * I, I, bd ? a16 + (int64_t)j * I : NULL,
                          act + (int64_t)j * I);
        if (amx) pack_experts(a16, I, te, ng, first, base, aT);
#pragma omp for schedule(static)
        for (int it = 0; it < ng * q2; it++) { /* down: y16 [route, H] */
            const int e = te[it / q2], a = first[e] - base, n = first[e + 1] - first[e];
            const int n0 = unit * (it % q2), wr = H - n0 < unit ? H - n0 : unit;
            const uint16_t *wd = w2 + (int64_t)e * H * I;
#if HAVE_AMX
            if (amx)
                amx_rows(aT + (int64_t)a * I, n, I, wd, n0, wr, NULL, y16 + (int64_t)a * H, H, &cfg);
            else
#endif
            if (bd)
                quad16(a16 + (int64_t)a * I, n, I, wd, n0, wr, y16 + (int64_t)a * H, H);
            else if (z)
                quadz(act + (int64_t)a * I, n, I, wd, n0, wr, y16 + (int64_t)a * H, H);
            else
                rows(act + (int64_t)a * I, n, I, wd, n0, wr, NULL, y16 + (int64_t)a * H, H);
        }
        /* out[t] += rnd(y * w) route by route, experts ascending (the loop's order), in
         * column blocks over threads */
#pragma omp for schedule(static)
        for (int h0 = 0; h0 < H; h0 += 64)
            for (int j = 0; j < Rl; j++) {
                float wt = rnd(tw[(int64_t)tok[base + j] * k + slot[base + j]]);
                float *o = acc + (int64_t)tok[base + j] * H;
                const uint16_t *y = y16 + (int64_t)j * H;
                for (int h = h0; h < H && h < h0 + 64; h++) o[h] = rnd(o[h] + rnd(bf16_to_f32(y[h]) * wt));
            }
    }
#if HAVE_AMX
    if (cfg >= 0) amx_bf16_release(); /* only where the tiles ran: its ISA is AMX's */
#endif
    (void)cfg;
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++) out[i] = f32_to_bf16(acc[i]);
    rc = 0;
done:
    free(tok), free(slot), free(first), free(fill), free(touched), free(xf), free(act), free(acc);
    free(x16), free(a16), free(g16), free(y16), free(xT), free(aT);
    return rc;
}
