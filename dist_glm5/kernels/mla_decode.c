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
 * How, in three phases of one parallel region (work items over threads):
 * 1. (row, head): q_lat, stored transposed with q_rot (qT[e] holds element e of every head,
 *    heads padded to H8 = a multiple of 8), so that a cache row scores all heads at once.
 * 2. (row, segment of SEG selected keys), flash-decoding style: the segment's cache rows widened
 *    once into fp32, scored 8 keys at a time (8 independent FMA chains: one key at a time was
 *    bound by the FMA latency), a vector exp, and the segment's unnormalised o_lat with its own
 *    max and sum per head.
 * 3. (row, head): the segments merged in order (each rescaled by exp(max_s - max)), divided by
 *    the sum, rounded, and projected by W_uv.
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
#ifdef _OPENMP
#include <omp.h>
#endif

enum { SEG = 64, KB = 8 }; /* selected keys per work item; keys scored together */

/* element e of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float at(const void *p, int64_t e, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[e]) : ((const float *)p)[e];
}

static inline float round_to(float f, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline __attribute__((always_inline)) v8 vmax(v8 a, v8 b) { return v8_select(a > b, a, b); }

/* Phase 1, row i head j: qT[e * H8 + j] = q_lat[e] (e < c), q_rot[e - c] (c <= e < c + r). */
static inline __attribute__((always_inline)) void q_latent(
    const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot, const void *wkvb, int i,
    int j, int h, int H8, int nope, int v, int c, int r, int is_bf16, float *tmp, float *qT) {
    const int64_t w_uk = (int64_t)j * (nope + v) * c;
    memset(tmp, 0, sizeof(float) * c);
    for (int d = 0; d < nope; d++) { /* axpy over c: contiguous rows of the weight */
        float qd = at(q_nope, i * qn_i + j * qn_j + d, is_bf16);
        for (int e = 0; e < c; e++) tmp[e] += qd * at(wkvb, w_uk + (int64_t)d * c + e, is_bf16);
    }
    for (int e = 0; e < c; e++) qT[(int64_t)e * H8 + j] = round_to(tmp[e], is_bf16);
    for (int e = 0; e < r; e++) qT[(int64_t)(c + e) * H8 + j] = at(q_rot, ((int64_t)i * h + j) * r + e, is_bf16);
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
    for (int u = 0; u < n; u++) { /* an invalid key's row: zeros (its weight is 0) */
        float *row = rows + (int64_t)u * cr;
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

/* Phase 3, row i head j: merge the segments' parts, normalise, round, project by W_uv. */
static inline __attribute__((always_inline)) void merge_out(
    const float *parts, int64_t psize, int nseg, const void *wkvb, int i, int j, int h, int H8,
    int nope, int v, int c, int is_bf16, float *tmp, void *out) {
    float M = -INFINITY;
    for (int s = 0; s < nseg; s++) M = fmaxf(M, parts[s * psize + j]);
    float l = 0.0f;
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
    const int64_t w_uv = (int64_t)j * (nope + v) * c + (int64_t)nope * c;
    for (int vv = 0; vv < v; vv++) {
        float y = 0.0f;
        if (is_bf16) {
            const uint16_t *wr = (const uint16_t *)wkvb + w_uv + (int64_t)vv * c;
            v8 a0 = V8(0.0f), a1 = V8(0.0f);
            int e = 0;
            for (; e + 16 <= c; e += 16) {
                a0 += *(const v8 *)(tmp + e) * widen(wr + e);
                a1 += *(const v8 *)(tmp + e + 8) * widen(wr + e + 8);
            }
            for (; e + 8 <= c; e += 8) a0 += *(const v8 *)(tmp + e) * widen(wr + e);
            a0 += a1;
            y = HSUM(a0);
            for (; e < c; e++) y += tmp[e] * bf16_to_f32(wr[e]);
        } else {
            const float *wr = (const float *)wkvb + w_uv + (int64_t)vv * c;
            v8 a0 = V8(0.0f), a1 = V8(0.0f);
            int e = 0;
            for (; e + 16 <= c; e += 16) {
                a0 += *(const v8 *)(tmp + e) * *(const v8 *)(wr + e);
                a1 += *(const v8 *)(tmp + e + 8) * *(const v8 *)(wr + e + 8);
            }
            for (; e + 8 <= c; e += 8) a0 += *(const v8 *)(tmp + e) * *(const v8 *)(wr + e);
            a0 += a1;
            y = HSUM(a0);
            for (; e < c; e++) y += tmp[e] * wr[e];
        }
        const int64_t o = ((int64_t)i * h + j) * v + vv;
        if (is_bf16)
            ((uint16_t *)out)[o] = f32_to_bf16(y);
        else
            ((float *)out)[o] = y;
    }
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
    const int64_t per = (int64_t)SEG * cr + (int64_t)SEG * H8 + c + 8; /* a thread's scratch */
    const int items = n * (h > nseg ? h : nseg);
    const int nt = nthreads > 1 && items > 1 ? nthreads : 1;
    float *qT = malloc(sizeof(float) * ((size_t)n * qsize + 8));
    float *parts = malloc(sizeof(float) * ((size_t)n * nseg * psize + 8));
    float *scratch = malloc(sizeof(float) * ((size_t)per * nt + 8));
    if (!qT || !parts || !scratch) {
        free(qT), free(parts), free(scratch);
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
        for (int it = 0; it < n * h; it++) {
            const int i = it / h, j = it % h;
            /* a constant dtype per branch: the inner loops specialise and vectorise */
            if (is_bf16)
                q_latent(q_nope, qn_i, qn_j, q_rot, wkvb, i, j, h, H8, nope, v, c, r, 1, sc,
                         qT + i * qsize);
            else
                q_latent(q_nope, qn_i, qn_j, q_rot, wkvb, i, j, h, H8, nope, v, c, r, 0, sc,
                         qT + i * qsize);
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
                merge_out(p, psize, nseg, wkvb, i, j, h, H8, nope, v, c, 1, sc, out);
            else
                merge_out(p, psize, nseg, wkvb, i, j, h, H8, nope, v, c, 0, sc, out);
        }
    }
    free(qT), free(parts), free(scratch);
    return 0;
}
