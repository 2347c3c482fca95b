/* Sparse MLA decode, absorbed form, one call per layer (CPU): for each decode row i and head j
 *   q_lat  = q_nope[i, j] . W_uk[j]                 (rounded to the activation dtype)
 *   s[t]   = (q_lat . lat[slot_t] + q_rot[i, j] . k_rot[slot_t]) * scale, -inf where not valid
 *   o_lat  = softmax(s) . lat[slots]                (fp32, then rounded to the activation dtype)
 *   out    = o_lat . W_uv[j]^T                      (rounded to the activation dtype)
 * with W_uk = kv_b_proj.weight rows [j*(nope+v), +nope), W_uv the next v rows, both [., c].
 *
 * Why: the torch form (ops/attention.absorbed_gathered: two einsums around attend_gathered's
 * gather, widen, two einsums, mask, softmax and einsum) is a dozen eager ops per layer, about
 * 0.8 ms of overhead per layer at batch 1 on this machine for 0.1 ms of arithmetic. Here each
 * selected cache row is widened once and scored for every head while in L1, the heads in the
 * vector lanes (at batch 32, 1.1-1.4x the head-by-head dot products it replaced).
 * Products and sums are fp32 with the reference's roundings; only the order of the fp32
 * additions differs. Rows go over threads. target_clones: AVX-512 / AVX2+FMA / baseline.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif





/* element e of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float at(const void *p, int64_t e, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[e]) : ((const float *)p)[e];
}

static inline float round_to(float f, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    v8 acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
        acc1 += *(const v8 *)(a + i + 8) * *(const v8 *)(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    acc0 += acc1;
    float s = HSUM(acc0);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One row i, all h heads, the heads in the vector lanes: the queries are kept transposed (qT[e]
 * holds element e of every head's q_lat | q_rot, heads padded to H8 = a multiple of 8 with
 * zeros), so a cache row scores all heads with one broadcast FMA per element and adds into all
 * heads' o_lat the same way: no horizontal sums in the loops over the selected rows.
 * scratch (floats): (c + r) * H8 (qT) + k * H8 (scores, then probabilities) + c * H8 (o_lat,
 * transposed) + (c + r) (a widened cache row) + c (a head's q_lat or o_lat) + 3 * H8. */
static inline __attribute__((always_inline)) void one(
    const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot, const void *wkvb,
    const void *kv, const int64_t *slots, const uint8_t *valid, int i, int h, int nope, int v,
    int c, int r, int k, float scale, int is_bf16, float *scratch, void *out) {
    const int H8 = (h + 7) & ~7, cr = c + r;
    float *qT = scratch, *S = qT + (int64_t)cr * H8, *oT = S + (int64_t)k * H8;
    float *row = oT + (int64_t)c * H8, *tmp = row + cr, *m = tmp + c, *den = m + H8;
    const int64_t *sl = slots + (int64_t)i * k;
    const uint8_t *ok = valid + (int64_t)i * k;
    memset(qT, 0, sizeof(float) * (size_t)cr * H8);
    for (int j = 0; j < h; j++) {
        /* q_lat = q_nope . W_uk (axpy over c: contiguous rows of the weight) */
        const int64_t w_uk = (int64_t)j * (nope + v) * c;
        memset(tmp, 0, sizeof(float) * c);
        for (int d = 0; d < nope; d++) {
            float qd = at(q_nope, i * qn_i + j * qn_j + d, is_bf16);
            for (int e = 0; e < c; e++) tmp[e] += qd * at(wkvb, w_uk + (int64_t)d * c + e, is_bf16);
        }
        for (int e = 0; e < c; e++) qT[(int64_t)e * H8 + j] = round_to(tmp[e], is_bf16);
        for (int e = 0; e < r; e++) qT[(int64_t)(c + e) * H8 + j] = at(q_rot, ((int64_t)i * h + j) * r + e, is_bf16);
    }
    /* scores [k][H8], a cache row at a time, 8 heads per vector */
    for (int t = 0; t < k; t++) {
        float *st = S + (int64_t)t * H8;
        if (!ok[t]) {
            for (int j = 0; j < H8; j++) st[j] = -INFINITY;
            continue;
        }
        const int64_t base = sl[t] * cr;
        for (int e = 0; e < cr; e++) row[e] = at(kv, base + e, is_bf16);
        for (int j8 = 0; j8 < H8; j8 += 8) {
            v8 a0 = {0}, a1 = {0};
            int e = 0;
            for (; e + 2 <= cr; e += 2) {
                a0 += row[e] * *(const v8 *)(qT + (int64_t)e * H8 + j8);
                a1 += row[e + 1] * *(const v8 *)(qT + (int64_t)(e + 1) * H8 + j8);
            }
            for (; e < cr; e++) a0 += row[e] * *(const v8 *)(qT + (int64_t)e * H8 + j8);
            *(v8 *)(st + j8) = (a0 + a1) * scale;
        }
    }
    /* softmax per head over the k rows: exp(s - max) / sum */
    for (int j = 0; j < H8; j++) m[j] = -INFINITY, den[j] = 0.0f;
    for (int t = 0; t < k; t++)
        for (int j = 0; j < H8; j++) m[j] = S[(int64_t)t * H8 + j] > m[j] ? S[(int64_t)t * H8 + j] : m[j];
    for (int t = 0; t < k; t++)
        for (int j = 0; j < H8; j++) {
            float *x = S + (int64_t)t * H8 + j;
            *x = ok[t] ? expf(*x - m[j]) : 0.0f;
            den[j] += *x;
        }
    for (int t = 0; t < k; t++)
        for (int j = 0; j < H8; j++) S[(int64_t)t * H8 + j] /= den[j];
    /* o_lat [c][H8] = P^T . lat, a cache row at a time */
    memset(oT, 0, sizeof(float) * (size_t)c * H8);
    for (int t = 0; t < k; t++) {
        if (!ok[t]) continue;
        const int64_t base = sl[t] * cr;
        for (int e = 0; e < c; e++) row[e] = at(kv, base + e, is_bf16);
        for (int j8 = 0; j8 < H8; j8 += 8) {
            const v8 pt = *(const v8 *)(S + (int64_t)t * H8 + j8);
            for (int e = 0; e < c; e++) *(v8 *)(oT + (int64_t)e * H8 + j8) += row[e] * pt;
        }
    }
    /* out = o_lat . W_uv^T, head by head */
    for (int j = 0; j < h; j++) {
        for (int e = 0; e < c; e++) tmp[e] = round_to(oT[(int64_t)e * H8 + j], is_bf16);
        const int64_t w_uv = (int64_t)j * (nope + v) * c + (int64_t)nope * c;
        for (int vv = 0; vv < v; vv++) {
            for (int e = 0; e < c; e++) row[e] = at(wkvb, w_uv + (int64_t)vv * c + e, is_bf16);
            float y = dot(tmp, row, c);
            int64_t o = ((int64_t)i * h + j) * v + vv;
            if (is_bf16)
                ((uint16_t *)out)[o] = f32_to_bf16(y);
            else
                ((float *)out)[o] = y;
        }
    }
}

/* q_nope [n, h, nope] (strides qn_i, qn_j; last dim contiguous), q_rot [n, h, r] contiguous,
 * wkvb [h*(nope+v), c], kv [S, c+r], slots/valid [n, k], out [n, h, v] contiguous; all float
 * arrays bf16 (is_bf16) or fp32. Returns 0, or -1 (no memory). */
CLONES int mla_decode(const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot,
                      const void *wkvb, const void *kv, const int64_t *slots,
                      const uint8_t *valid, int n, int h, int nope, int v, int c, int r, int k,
                      float scale, int is_bf16, void *out, int nthreads) {
    const int64_t H8 = (h + 7) & ~7;
    int64_t per = (c + r) * H8 + (int64_t)k * H8 + (int64_t)c * H8 + (c + r) + c + 3 * H8 + 16;
    int nt = nthreads > 1 && n > 1 ? nthreads : 1;
    float *scratch = malloc(sizeof(float) * per * nt);
    if (!scratch) return -1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int i = 0; i < n; i++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = scratch + per * tid;
        /* a constant dtype per branch: the inner loops specialise and vectorise */
        if (is_bf16)
            one(q_nope, qn_i, qn_j, q_rot, wkvb, kv, slots, valid, i, h, nope, v, c, r, k, scale,
                1, sc, out);
        else
            one(q_nope, qn_i, qn_j, q_rot, wkvb, kv, slots, valid, i, h, nope, v, c, r, k, scale,
                0, sc, out);
    }
    free(scratch);
    return 0;
}
