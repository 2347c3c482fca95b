/* Sparse MLA decode, absorbed form, one call per layer (CPU): for each decode row i and head j
 *   q_lat  = q_nope[i, j] . W_uk[j]                 (rounded to the activation dtype)
 *   s[t]   = (q_lat . lat[slot_t] + q_rot[i, j] . k_rot[slot_t]) * scale, -inf where not valid
 *   o_lat  = softmax(s) . lat[slots]                (fp32, then rounded to the activation dtype)
 *   out    = o_lat . W_uv[j]^T                      (rounded to the activation dtype)
 * with W_uk = kv_b_proj.weight rows [j*(nope+v), +nope), W_uv the next v rows, both [., c].
 *
 * Why: the torch form (ops/attention.absorbed_gathered: two einsums around attend_gathered's
 * gather, widen, two einsums, mask, softmax and einsum) is a dozen eager ops per layer, about
 * 0.8 ms of overhead per layer at batch 1 on this machine for 0.1 ms of arithmetic.
 *
 * How, in four phases of one parallel region (work items over threads):
 * 1. (head, block of 4 rows): q_lat, the rows sharing each widened row of W_uk, stored transposed
 *    with q_rot (qT[e] holds element e of every head, heads padded to H8 = a multiple of 8), so
 *    that a cache row scores all heads at once.
 * 2. (row, segment of SEG selected keys), flash-decoding style: the segment's cache rows widened
 *    once into fp32, scored 8 keys at a time (8 independent FMA chains: one key at a time was
 *    bound by the FMA latency), a vector exp, and the segment's unnormalised o_lat with its own
 *    max and sum per head.
 * 3. (row, head): the segments merged in order (each rescaled by exp(max_s - max)), divided by
 *    the sum and rounded: o_lat, stored head by head.
 * 4. (head, 4 outputs): o_lat . W_uv^T for every row, bf16 by gemv_tiles.h's product (so the
 *    weight rows are read once for all the rows; one output at a time per row and head was one
 *    FMA chain, bound by its latency: 0.16 of 0.48 ms a layer at 32 rows).
 * SEG is fixed, so the bits depend neither on the thread count nor on the batch: a row's result
 * is the same alone or among others, and one sequence still spreads over both cores.
 * Products and sums are fp32 with the reference's roundings; only the order of the fp32
 * additions and the exp's last bit differ. target_clones: AVX-512 / AVX2+FMA / baseline.
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

enum { SEG = 64, KB = 8 }; /* selected keys per work item; keys scored together */
enum { RB = 4 };          /* rows per phase-1 item (q_latent's R at most) */

/* element e of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float at(const void *p, int64_t e, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[e]) : ((const float *)p)[e];
}

static inline float round_to(float f, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline __attribute__((always_inline)) v8 vmax(v8 a, v8 b) { return v8_select(a > b, a, b); }

/* Phase 1, rows i0 .. i0+R-1 of head j: qT[e * H8 + j] = q_lat[e] (e < c), q_rot[e - c]
 * (c <= e < c + r) of each row. R rows share each widened weight row (R constant: the
 * accumulators stay in registers); an element's sum runs over d in order as one FMA chain, so its
 * bits depend neither on R nor on the rows beside it. */
static inline __attribute__((always_inline)) void q_latent(
    const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot, const void *wkvb, int i0,
    int R, int j, int h, int H8, int nope, int v, int c, int r, int is_bf16, int64_t qsize,
    float *qT) {
    enum { E = 32 }; /* elements of e per pass */
    const int64_t w_uk = (int64_t)j * (nope + v) * c;
    for (int e0 = 0; e0 < c; e0 += E) {
        const int ne = c - e0 < E ? c - e0 : E;
        v8 acc[RB][E / 8];
        for (int i = 0; i < RB; i++)
            for (int b = 0; b < E / 8; b++) acc[i][b] = V8(0.0f);
        for (int d = 0; d < nope; d++) {
            const int64_t wd = w_uk + (int64_t)d * c + e0;
            v8 w[E / 8];
            if (ne == E && is_bf16)
                for (int b = 0; b < E / 8; b++) w[b] = widen((const uint16_t *)wkvb + wd + 8 * b);
            else if (ne == E)
                for (int b = 0; b < E / 8; b++) memcpy(&w[b], (const float *)wkvb + wd + 8 * b, 32);
            else { /* a tail of c */
                float t[E] = {0};
                for (int e = 0; e < ne; e++) t[e] = at(wkvb, wd + e, is_bf16);
                memcpy(w, t, sizeof t);
            }
            for (int i = 0; i < R; i++) {
                const v8 qd = V8(at(q_nope, (i0 + i) * qn_i + j * qn_j + d, is_bf16));
                for (int b = 0; b < E / 8; b++) acc[i][b] += qd * w[b];
            }
        }
        for (int i = 0; i < R; i++) {
            float *q = qT + (int64_t)(i0 + i) * qsize;
            for (int e = 0; e < ne; e++)
                q[(int64_t)(e0 + e) * H8 + j] = round_to(acc[i][e / 8][e % 8], is_bf16);
        }
    }
    for (int i = i0; i < i0 + R; i++)
        for (int e = 0; e < r; e++)
            qT[i * qsize + (int64_t)(c + e) * H8 + j] = at(q_rot, ((int64_t)i * h + j) * r + e, is_bf16);
}

/* Phase 2, row i segment [t0, t1): part = max [H8] | sum [H8] | o [h][c] (unnormalised, head
 * by head). scratch: SEG * (c + r) (widened rows) + SEG * H8 (scores, then exp) floats. */
static inline __attribute__((always_inline)) void segment(
    const float *qT, const void *kv, const int64_t *sl, const uint8_t *ok, int t0, int t1, int h,
    int H8, int c, int r, float scale, int is_bf16, float *scratch, float *part) {
    const int cr = c + r;
    float *rows = scratch, *S = rows + (int64_t)SEG * cr;
    float *mx = part, *sum = part + H8, *o = part + 2 * H8;
    /* invalid keys after the last valid one are left out (a weight of 0 adds +0.0: the same
     * bits); a segment with none valid is skipped whole, as the merge skips it (max -inf). The
     * selection pads a short context's row to index_topk with invalid keys: at 128 keys of 256,
     * half of the work was padding. */
    int n = t1 - t0;
    while (n > 0 && !ok[t0 + n - 1]) n--;
    if (n == 0) {
        for (int j = 0; j < H8; j++) mx[j] = -INFINITY, sum[j] = 0.0f;
        return;
    }
    /* the selected rows lie anywhere in the cache, where the hardware prefetcher does not
     * follow: each row's lines are asked for PF rows ahead of its widening */
    enum { PF = 8 };
    const int64_t rb = (int64_t)cr * (is_bf16 ? 2 : 4);
    for (int u = 0; u < n && u < PF; u++)
        for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch((const char *)kv + sl[t0 + u] * rb + o);
    for (int u = 0; u < n; u++) { /* an invalid key's row: zeros (its weight is 0) */
        float *row = rows + (int64_t)u * cr;
        if (u + PF < n)
            for (int64_t o = 0; o < rb; o += 64)
                __builtin_prefetch((const char *)kv + sl[t0 + u + PF] * rb + o);
        if (!ok[t0 + u]) {
            memset(row, 0, sizeof(float) * cr);
            continue;
        }
        const int64_t base = sl[t0 + u] * cr;
        if (is_bf16)
            for (int e = 0; e < cr; e++) row[e] = bf16_to_f32(((const uint16_t *)kv)[base + e]);
        else
            memcpy(row, (const float *)kv + base, sizeof(float) * cr);
    }
    /* scores [n][H8]: KB keys at a time, one FMA chain each */
    for (int j8 = 0; j8 < H8; j8 += 8) {
        int u = 0;
        for (; u + KB <= n; u += KB) {
            v8 a[KB];
            for (int b = 0; b < KB; b++) a[b] = V8(0.0f);
            for (int e = 0; e < cr; e++) {
                const v8 q = *(const v8 *)(qT + (int64_t)e * H8 + j8);
                for (int b = 0; b < KB; b++) a[b] += rows[(int64_t)(u + b) * cr + e] * q;
            }
            for (int b = 0; b < KB; b++) *(v8 *)(S + (int64_t)(u + b) * H8 + j8) = a[b] * scale;
        }
        for (; u < n; u++) {
            v8 a = V8(0.0f);
            for (int e = 0; e < cr; e++)
                a += rows[(int64_t)u * cr + e] * *(const v8 *)(qT + (int64_t)e * H8 + j8);
            *(v8 *)(S + (int64_t)u * H8 + j8) = a * scale;
        }
    }
    /* the segment's max per head over its valid keys, then exp(s - max) (0 where not valid) */
    for (int j8 = 0; j8 < H8; j8 += 8) {
        v8 m = V8(-INFINITY);
        for (int u = 0; u < n; u++)
            if (ok[t0 + u]) m = vmax(m, *(const v8 *)(S + (int64_t)u * H8 + j8));
        v8 l = V8(0.0f);
        /* all keys invalid: max -inf, every weight 0 (the merge gives this segment weight 0) */
        const v8 m0 = v8_select(m == V8(-INFINITY), V8(0.0f), m);
        for (int u = 0; u < n; u++) {
            v8 *s = (v8 *)(S + (int64_t)u * H8 + j8);
            *s = ok[t0 + u] ? vexp(*s - m0) : V8(0.0f);
            l += *s;
        }
        *(v8 *)(mx + j8) = m;
        *(v8 *)(sum + j8) = l;
    }
    /* o[j][e] = sum_u p[u][j] * lat[u][e]: 2 heads x 32 elements of e in registers */
    for (int j = 0; j < h; j += 2) {
        const int two = j + 1 < h;
        for (int e0 = 0; e0 < c; e0 += 32) {
            if (e0 + 32 <= c) {
                v8 a0[4] = {0}, a1[4] = {0};
                for (int u = 0; u < n; u++) {
                    const float *row = rows + (int64_t)u * cr + e0;
                    const v8 p0 = V8(S[(int64_t)u * H8 + j]);
                    const v8 p1 = V8(two ? S[(int64_t)u * H8 + j + 1] : 0.0f);
                    for (int b = 0; b < 4; b++) {
                        const v8 x = *(const v8 *)(row + 8 * b);
                        a0[b] += p0 * x;
                        a1[b] += p1 * x;
                    }
                }
                for (int b = 0; b < 4; b++) {
                    *(v8 *)(o + (int64_t)j * c + e0 + 8 * b) = a0[b];
                    if (two) *(v8 *)(o + (int64_t)(j + 1) * c + e0 + 8 * b) = a1[b];
                }
            } else { /* a tail of c */
                for (int jj = j; jj < j + 1 + two; jj++)
                    for (int e = e0; e < c; e++) {
                        float acc = 0.0f;
                        for (int u = 0; u < n; u++) acc += S[(int64_t)u * H8 + jj] * rows[(int64_t)u * cr + e];
                        o[(int64_t)jj * c + e] = acc;
                    }
            }
        }
    }
}

/* Phase 3, row i head j: merge the segments' parts, normalise and round: o_lat into ol (fp32)
 * and ol16 (its bf16 bits, when not NULL), both [h][n][c] so that phase 4 reads a head's rows
 * contiguous. */
static inline __attribute__((always_inline)) void merge(const float *parts, int64_t psize,
                                                        int nseg, int i, int j, int n, int H8,
                                                        int c, int is_bf16, float *ol,
                                                        uint16_t *ol16) {
    float M = -INFINITY;
    for (int s = 0; s < nseg; s++) M = fmaxf(M, parts[s * psize + j]);
    float l = 0.0f, *tmp = ol + ((int64_t)j * n + i) * c;
    for (int e = 0; e < c; e++) tmp[e] = 0.0f;
    for (int s = 0; s < nseg; s++) {
        const float *p = parts + s * psize;
        const float m = p[j];
        if (m == -INFINITY) continue; /* no valid key in this segment */
        const float w = expf(m - M);
        l += w * p[H8 + j];
        const float *o = p + 2 * H8 + (int64_t)j * c;
        for (int e = 0; e < c; e++) tmp[e] += w * o[e];
    }
    for (int e = 0; e < c; e++) tmp[e] = round_to(tmp[e] / l, is_bf16);
    if (ol16)
        for (int e = 0; e < c; e++) ol16[((int64_t)j * n + i) * c + e] = f32_to_bf16(tmp[e]);
}

/* Phase 4, fp32 arrays, head j, output elements [v0, v0 + nv) of every row:
 * out[i, j, vv] = o_lat[i, j] . W_uv[j][vv]. (bf16 arrays take gemv_tiles.h's tiles.) */
static inline __attribute__((always_inline)) void project_f32(const float *ol, const float *wkvb,
                                                              int j, int v0, int nv, int n, int h,
                                                              int nope, int v, int c, float *out) {
    const int64_t w_uv = (int64_t)j * (nope + v) * c + (int64_t)nope * c;
    for (int i = 0; i < n; i++) {
        const float *x = ol + ((int64_t)j * n + i) * c;
        for (int vv = v0; vv < v0 + nv; vv++) {
            const float *wr = wkvb + w_uv + (int64_t)vv * c;
            v8 a0 = V8(0.0f), a1 = V8(0.0f);
            int e = 0;
            for (; e + 16 <= c; e += 16) {
                a0 += *(const v8 *)(x + e) * *(const v8 *)(wr + e);
                a1 += *(const v8 *)(x + e + 8) * *(const v8 *)(wr + e + 8);
            }
            for (; e + 8 <= c; e += 8) a0 += *(const v8 *)(x + e) * *(const v8 *)(wr + e);
            a0 += a1;
            float y = HSUM(a0);
            for (; e < c; e++) y += x[e] * wr[e];
            out[((int64_t)i * h + j) * v + vv] = y;
        }
    }
}

/* Bytes of mla_decode's scratch per query row (qT, parts, ol, ol16 below), which callers keep
 * under their cap by the rows they pass a call. */
CLONES int64_t mla_decode_row_bytes(int h, int c, int r, int k, int is_bf16) {
    const int64_t H8 = (h + 7) & ~7, nseg = (k + SEG - 1) / SEG;
    const int64_t floats = (c + r) * H8 + nseg * (2 * H8 + (int64_t)h * c + 8) + (int64_t)h * c;
    return 4 * floats + (is_bf16 && bf16dot() ? 2 * (int64_t)h * c : 0);
}

/* q_nope [n, h, nope] (strides qn_i, qn_j; last dim contiguous), q_rot [n, h, r] contiguous,
 * wkvb [h*(nope+v), c], kv [S, c+r], slots/valid [n, k], out [n, h, v] contiguous; all float
 * arrays bf16 (is_bf16) or fp32. Returns 0, or -1 (no memory). */
CLONES int mla_decode(const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot,
                      const void *wkvb, const void *kv, const int64_t *slots,
                      const uint8_t *valid, int n, int h, int nope, int v, int c, int r, int k,
                      float scale, int is_bf16, void *out, int nthreads) {
    const int H8 = (h + 7) & ~7, cr = c + r, nseg = (k + SEG - 1) / SEG;
    const int64_t qsize = (int64_t)cr * H8;                 /* a row's qT */
    const int64_t psize = 2 * H8 + (int64_t)h * c + 8;      /* a segment's part */
    const int64_t per = (int64_t)SEG * cr + (int64_t)SEG * H8 + 8; /* a thread's scratch */
    const int nrb = (n + RB - 1) / RB, nq = (v + 3) / 4;   /* row blocks; quads of outputs */
    const int items = n * (h > nseg ? h : nseg);
    const int nt = nthreads > 1 && items > 1 ? nthreads : 1;
    /* bf16 arrays: phase 4 is gemv_tiles.h's product (the AVX512-BF16 tiles where the CPU has
     * them and DIST_GLM5_GEMV_FP32 is unset), o_lat its rows and W_uv its weight rows */
    const int dot16 = is_bf16 && bf16dot();
    const int z16 = is_bf16 && zmm(); /* or the 16-lane fp32 tiles (AVX-512 without BF16) */
    float *qT = malloc(sizeof(float) * ((size_t)n * qsize + 8));
    float *parts = malloc(sizeof(float) * ((size_t)n * nseg * psize + 8));
    float *scratch = malloc(sizeof(float) * ((size_t)per * nt + 8));
    float *ol = malloc(sizeof(float) * ((size_t)n * h * c + 8));
    uint16_t *ol16 = dot16 ? malloc(sizeof(uint16_t) * ((size_t)n * h * c + 8)) : NULL;
    if (!qT || !parts || !scratch || !ol || (dot16 && !ol16)) {
        free(qT), free(parts), free(scratch), free(ol), free(ol16);
        return -1;
    }
    if (H8 != h) memset(qT, 0, sizeof(float) * (size_t)n * qsize); /* padded heads score 0 */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = scratch + per * tid;
#pragma omp for schedule(static)
        for (int it = 0; it < nrb * h; it++) {
            const int i0 = it / h * RB, j = it % h, R = n - i0 < RB ? n - i0 : RB;
            /* constant dtype and rows per branch: the inner loops specialise and unroll */
#define Q_LATENT(R_, BF) \
    q_latent(q_nope, qn_i, qn_j, q_rot, wkvb, i0, R_, j, h, H8, nope, v, c, r, BF, qsize, qT)
            if (is_bf16) {
                switch (R) {
                case 4: Q_LATENT(4, 1); break;
                case 3: Q_LATENT(3, 1); break;
                case 2: Q_LATENT(2, 1); break;
                default: Q_LATENT(1, 1);
                }
            } else {
                switch (R) {
                case 4: Q_LATENT(4, 0); break;
                case 3: Q_LATENT(3, 0); break;
                case 2: Q_LATENT(2, 0); break;
                default: Q_LATENT(1, 0);
                }
            }
#undef Q_LATENT
        }
#pragma omp for schedule(static)
        for (int it = 0; it < n * nseg; it++) {
            const int i = it / nseg, s = it % nseg;
            const int t0 = s * SEG, t1 = t0 + SEG < k ? t0 + SEG : k;
            const int64_t *sl = slots + (int64_t)i * k;
            const uint8_t *ok = valid + (int64_t)i * k;
            float *p = parts + ((int64_t)i * nseg + s) * psize;
            if (is_bf16)
                segment(qT + i * qsize, kv, sl, ok, t0, t1, h, H8, c, r, scale, 1, sc, p);
            else
                segment(qT + i * qsize, kv, sl, ok, t0, t1, h, H8, c, r, scale, 0, sc, p);
        }
#pragma omp for schedule(static)
        for (int it = 0; it < n * h; it++) {
            const int i = it / h, j = it % h;
            const float *p = parts + (int64_t)i * nseg * psize;
            if (is_bf16)
                merge(p, psize, nseg, i, j, n, H8, c, 1, ol, ol16);
            else
                merge(p, psize, nseg, i, j, n, H8, c, 0, ol, NULL);
        }
        /* phase 4, (head, quad of outputs): out[:, j, v0 .. v0+4) of every row */
#pragma omp for schedule(static)
        for (int it = 0; it < h * nq; it++) {
            const int j = it / nq, v0 = 4 * (it % nq), nv = v - v0 < 4 ? v - v0 : 4;
            const int64_t xo = (int64_t)j * n * c, w_uv = (int64_t)j * (nope + v) * c + (int64_t)nope * c;
            if (dot16)
                quad16(ol16 + xo, n, c, (const uint16_t *)wkvb + w_uv, v0, nv,
                       (uint16_t *)out + (int64_t)j * v, h * v);
            else if (z16)
                quadz(ol + xo, n, c, (const uint16_t *)wkvb + w_uv, v0, nv,
                      (uint16_t *)out + (int64_t)j * v, h * v);
            else if (is_bf16)
                rows(ol + xo, n, c, (const uint16_t *)wkvb + w_uv, v0, nv, NULL,
                     (uint16_t *)out + (int64_t)j * v, h * v);
            else
                project_f32(ol, wkvb, j, v0, nv, n, h, nope, v, c, out);
        }
    }
    free(qT), free(parts), free(scratch), free(ol), free(ol16);
    return 0;
}
