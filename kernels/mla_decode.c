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
 * selected cache row is widened once and scored for every head while in L1.
 * Products and sums are fp32 with the reference's roundings; only the order of the fp32
 * additions differs. Rows x heads go over threads. target_clones: AVX-512 / AVX2+FMA / baseline.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#pragma GCC diagnostic ignored "-Wpsabi" /* v8 never crosses a call: always inlined */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define HSUM(a) ((((a)[0] + (a)[4]) + ((a)[1] + (a)[5])) + (((a)[2] + (a)[6]) + ((a)[3] + (a)[7])))

static inline float bf(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* element e of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float at(const void *p, int64_t e, int is_bf16) {
    return is_bf16 ? bf(((const uint16_t *)p)[e]) : ((const float *)p)[e];
}

static inline float round_to(float f, int is_bf16) { return is_bf16 ? bf(to_bf(f)) : f; }

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

/* One row i, one head j. scratch: c + (c + r) + k + c floats. */
static inline __attribute__((always_inline)) void one(
    const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot, const void *wkvb,
    const void *kv, const int64_t *slots, const uint8_t *valid, int i, int j, int h, int nope,
    int v, int c, int r, int k, float scale, int is_bf16, float *scratch, void *out) {
    float *q_lat = scratch, *row = q_lat + c, *s = row + c + r, *o_lat = s + k;
    const int64_t w_uk = (int64_t)j * (nope + v) * c, w_uv = w_uk + (int64_t)nope * c;
    /* q_lat = q_nope . W_uk (axpy over c: contiguous rows of the weight) */
    memset(q_lat, 0, sizeof(float) * c);
    for (int d = 0; d < nope; d++) {
        float qd = at(q_nope, i * qn_i + j * qn_j + d, is_bf16);
        for (int e = 0; e < c; e++) q_lat[e] += qd * at(wkvb, w_uk + (int64_t)d * c + e, is_bf16);
    }
    for (int e = 0; e < c; e++) q_lat[e] = round_to(q_lat[e], is_bf16);
    float qr[64 + 8];
    for (int e = 0; e < r; e++) qr[e] = at(q_rot, ((int64_t)i * h + j) * r + e, is_bf16);
    /* scores */
    float m = -INFINITY;
    for (int t = 0; t < k; t++) {
        if (!valid[(int64_t)i * k + t]) {
            s[t] = -INFINITY;
            continue;
        }
        int64_t base = slots[(int64_t)i * k + t] * (c + r);
        for (int e = 0; e < c + r; e++) row[e] = at(kv, base + e, is_bf16);
        s[t] = (dot(q_lat, row, c) + dot(qr, row + c, r)) * scale;
        if (s[t] > m) m = s[t];
    }
    float den = 0.0f;
    for (int t = 0; t < k; t++) {
        s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - m);
        den += s[t];
    }
    /* o_lat = softmax . lat */
    memset(o_lat, 0, sizeof(float) * c);
    for (int t = 0; t < k; t++) {
        if (s[t] == 0.0f) continue;
        float p = s[t] / den;
        int64_t base = slots[(int64_t)i * k + t] * (c + r);
        for (int e = 0; e < c; e++) o_lat[e] += p * at(kv, base + e, is_bf16);
    }
    for (int e = 0; e < c; e++) o_lat[e] = round_to(o_lat[e], is_bf16);
    /* out = o_lat . W_uv^T */
    for (int vv = 0; vv < v; vv++) {
        for (int e = 0; e < c; e++) row[e] = at(wkvb, w_uv + (int64_t)vv * c + e, is_bf16);
        float y = dot(o_lat, row, c);
        int64_t o = ((int64_t)i * h + j) * v + vv;
        if (is_bf16)
            ((uint16_t *)out)[o] = to_bf(y);
        else
            ((float *)out)[o] = y;
    }
}

/* q_nope [n, h, nope] (strides qn_i, qn_j; last dim contiguous), q_rot [n, h, r] contiguous,
 * wkvb [h*(nope+v), c], kv [S, c+r], slots/valid [n, k], out [n, h, v] contiguous; all float
 * arrays bf16 (is_bf16) or fp32. Returns 0, or -1 (r > 64 or no memory). */
CLONES int mla_decode(const void *q_nope, int64_t qn_i, int64_t qn_j, const void *q_rot,
                      const void *wkvb, const void *kv, const int64_t *slots,
                      const uint8_t *valid, int n, int h, int nope, int v, int c, int r, int k,
                      float scale, int is_bf16, void *out, int nthreads) {
    if (r > 64) return -1;
    int64_t per = (int64_t)c + c + r + k + c + 8;
    int nt = nthreads > 1 && n * h >= 8 ? nthreads : 1;
    float *scratch = malloc(sizeof(float) * per * nt);
    if (!scratch) return -1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int ij = 0; ij < n * h; ij++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = scratch + per * tid;
        /* a constant dtype per branch: the inner loops specialise and vectorise */
        if (is_bf16)
            one(q_nope, qn_i, qn_j, q_rot, wkvb, kv, slots, valid, ij / h, ij % h, h, nope, v, c,
                r, k, scale, 1, sc, out);
        else
            one(q_nope, qn_i, qn_j, q_rot, wkvb, kv, slots, valid, ij / h, ij % h, h, nope, v, c,
                r, k, scale, 0, sc, out);
    }
    free(scratch);
    return 0;
}
