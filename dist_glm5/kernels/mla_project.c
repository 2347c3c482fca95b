/* A decode step's MLA and DSA-indexer projections for a few rows, in one call per layer (CPU).
 *
 * What model/mla.py does before attending, with the backend's ops, for T rows of bf16 x:
 *   q_resid = rms_norm(x . W_qa^T)            q = q_resid . W_qb^T, q_rot = rope(each head's
 *   ckv = x . W_kva^T                          last `rope` dims of q)
 *   cache row = [rms_norm(ckv[:kv_lora]) | rope(ckv[kv_lora:])]  -> kv_store[slot]
 * and model/indexer.py, on a layer that has an indexer:
 *   iq = q_resid . W_iq^T, each head's FIRST `rope` dims roped
 *   ik = rope(layer_norm(x . W_ik^T)) (first `rope` dims)        -> idx_store[slot]
 *   iw = float(x . W_iw^T) * i_heads^-0.5
 * Why: in eager torch that is 7 products, 3 norms, 5 ropes, 4 concatenations and 2 cache writes
 * per layer, 40-odd ops and 20 Python calls: about a millisecond a layer here, where the
 * weights' bytes need a fifth of that. One call does it at the products' pace.
 * Bits: the products are gemv_tiles.h's and the norms and ropes norm_rope.h's, the code
 * bf16_gemv.c and norm_rope.c run, so q, iq, iw and the MLA cache row equal the unfused path's
 * bit for bit. The index key's LayerNorm is computed here (fp32 mean and variance, two passes;
 * torch's kernel orders its sums differently): within one bf16 rounding of torch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gemv_tiles.h"
#include "norm_rope.h"
#ifdef _OPENMP
#include <omp.h>
#endif

struct mla_proj {
    int T, H, q_lora, heads, nope, rope, kv_lora, interleave;
    const uint16_t *x;                            /* [T, H] */
    const uint16_t *w_qa, *b_qa, *n_qa;           /* [q_lora, H], [q_lora] or NULL, [q_lora] */
    const uint16_t *w_qb;                         /* [heads * (nope + rope), q_lora] */
    const uint16_t *w_kva, *b_kva, *n_kva;        /* [kv_lora + rope, H], bias or NULL, [kv_lora] */
    float eps_qa, eps_kva;
    const float *cos, *sin;                       /* [T, rope / 2] */
    const int64_t *slots;                         /* [T] the rows' cache slots, < n_slots */
    int64_t n_slots;                              /* rows of kv_store (and idx_store) */
    void *kv_store;                               /* [S, kv_lora + rope] */
    int kv_bf16;                                  /* kv_store bf16 (else fp32) */
    /* the indexer (w_iq NULL: the layer has none) */
    int i_heads, i_dim, i_interleave, idx_kind; /* idx_store fp32, bf16, int8 rows */
    const uint16_t *w_iq, *w_ik, *ln_w, *ln_b, *w_iw; /* [i_heads*i_dim, q_lora], [i_dim, H], [i_dim] x2, [i_heads, H] */
    float eps_ln, iw_scale;
    void *idx_store;                              /* [S, i_dim] */
    /* outputs */
    uint16_t *q;                                  /* [T, heads, nope + rope], unroped */
    uint16_t *q_rot;                              /* [T, heads, rope] */
    uint16_t *iq;                                 /* [T, i_heads, i_dim] */
    float *iw;                                    /* [T, i_heads] */
};

static void widen_rows(const uint16_t *x, int64_t n, float *xf) {
    for (int64_t i = 0; i < n; i++) xf[i] = bf16_to_f32(x[i]);
}

/* Rope the first `dim` elements of each of M blocks of `stride` elements in place (bf16). */
static void rope_blocks(uint16_t *x, int M, int stride, int dim, const float *ct, const float *sn,
                        int interleave) {
    uint16_t tmp[512];
    for (int m = 0; m < M; m++) {
        uint16_t *p = x + (int64_t)m * stride;
        rope_row(p, dim, 1, ct, sn, interleave, tmp);
        memcpy(p, tmp, sizeof(uint16_t) * dim);
    }
}

/* One cache row from a bf16 row: copied (bf16 store) or widened (fp32 store). */
static void store_row(void *store, int bf16, int64_t slot, int width, const uint16_t *row) {
    if (bf16)
        memcpy((uint16_t *)store + slot * width, row, sizeof(uint16_t) * width);
    else
        widen_rows(row, width, (float *)store + slot * width);
}

/* An int8 index-key row (quant/index_q8.py, whose torch form this follows op for op): scale =
 * amax / 127 (1 when all zero), values round-half-even(x / scale) within +-127, then the scale's
 * four bytes. */
static void store_q8_row(void *store, int64_t slot, int D, const uint16_t *row) {
    uint8_t *o = (uint8_t *)store + slot * ((int64_t)D + 4);
    float amax = 0.0f;
    for (int d = 0; d < D; d++) amax = fmaxf(amax, fabsf(bf16_to_f32(row[d])));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int d = 0; d < D; d++) {
        float v = nearbyintf(bf16_to_f32(row[d]) / scale);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        o[d] = (uint8_t)(int8_t)v;
    }
    memcpy(o + D, &scale, sizeof(float));
}

static void layer_norm_row(uint16_t *x, int D, const uint16_t *w, const uint16_t *b, float eps) {
    float mean = 0.0f, var = 0.0f;
    for (int d = 0; d < D; d++) mean += bf16_to_f32(x[d]);
    mean /= D;
    for (int d = 0; d < D; d++) {
        float c = bf16_to_f32(x[d]) - mean;
        var += c * c;
    }
    float rstd = 1.0f / sqrtf(var / D + eps);
    for (int d = 0; d < D; d++)
        x[d] = f32_to_bf16((bf16_to_f32(x[d]) - mean) * rstd * bf16_to_f32(w[d]) + bf16_to_f32(b[d]));
}

/* Returns 0; -1 when scratch cannot be allocated, -2 when a rope is wider than 512, -3 when a
 * slot is outside the stores (nothing written). */
CLONES int mla_project(const struct mla_proj *p, int nthreads) {
    const int T = p->T, H = p->H, QL = p->q_lora, hd = p->nope + p->rope;
    const int KV = p->kv_lora + p->rope, half = p->rope / 2;
    if (p->rope > 512) return -2;
    for (int t = 0; t < T; t++)
        if (p->slots[t] < 0 || p->slots[t] >= p->n_slots) return -3;
    const int ix = p->w_iq != NULL;
    const int NI = ix ? p->i_heads * p->i_dim : 0;
    uint16_t *qa = malloc(sizeof(uint16_t) * ((size_t)T * QL + 1));
    uint16_t *qr = malloc(sizeof(uint16_t) * ((size_t)T * QL + 1));
    uint16_t *ckv = malloc(sizeof(uint16_t) * ((size_t)T * KV + 1));
    uint16_t *row = malloc(sizeof(uint16_t) * ((size_t)KV + 1)); /* one MLA cache row */
    uint16_t *ik = malloc(sizeof(uint16_t) * ((size_t)T * (ix ? p->i_dim : 1) + 1));
    uint16_t *iwb = malloc(sizeof(uint16_t) * ((size_t)T * (ix ? p->i_heads : 1) + 1));
    int rc = -1;
    if (!qa || !qr || !ckv || !row || !ik || !iwb) goto done;
    /* the products of x */
    {
        const uint16_t *w[4] = {p->w_qa, p->w_kva, p->w_ik, p->w_iw};
        const uint16_t *b[4] = {p->b_qa, p->b_kva, NULL, NULL};
        uint16_t *y[4] = {qa, ckv, ik, iwb};
        const int N[4] = {QL, KV, p->i_dim, p->i_heads};
        if (products(p->x, T, H, ix ? 4 : 2, w, N, b, y, nthreads)) goto done;
    }
    /* q_resid, then its products */
    for (int t = 0; t < T; t++)
        rms_row(qa + (int64_t)t * QL, QL, 1, p->n_qa, p->eps_qa, qr + (int64_t)t * QL);
    {
        const uint16_t *w[2] = {p->w_qb, p->w_iq}, *b[2] = {NULL, NULL};
        uint16_t *y[2] = {p->q, p->iq};
        const int N[2] = {p->heads * hd, NI};
        if (products(qr, T, QL, ix ? 2 : 1, w, N, b, y, nthreads)) goto done;
    }
    for (int t = 0; t < T; t++) {
        const float *ct = p->cos + (int64_t)t * half, *sn = p->sin + (int64_t)t * half;
        /* MLA ropes each head's last dims, the indexer its first ones */
        for (int h = 0; h < p->heads; h++)
            rope_row(p->q + ((int64_t)t * p->heads + h) * hd + p->nope, p->rope, 1, ct, sn,
                     p->interleave, p->q_rot + ((int64_t)t * p->heads + h) * p->rope);
        const uint16_t *c = ckv + (int64_t)t * KV;
        rms_row(c, p->kv_lora, 1, p->n_kva, p->eps_kva, row);
        rope_row(c + p->kv_lora, p->rope, 1, ct, sn, p->interleave, row + p->kv_lora);
        store_row(p->kv_store, p->kv_bf16, p->slots[t], KV, row);
        if (!ix) continue;
        rope_blocks(p->iq + (int64_t)t * NI, p->i_heads, p->i_dim, p->rope, ct, sn,
                    p->i_interleave);
        uint16_t *k = ik + (int64_t)t * p->i_dim;
        layer_norm_row(k, p->i_dim, p->ln_w, p->ln_b, p->eps_ln);
        rope_blocks(k, 1, p->i_dim, p->rope, ct, sn, p->i_interleave);
        if (p->idx_kind == 2)
            store_q8_row(p->idx_store, p->slots[t], p->i_dim, k);
        else
            store_row(p->idx_store, p->idx_kind == 1, p->slots[t], p->i_dim, k);
        for (int h = 0; h < p->i_heads; h++)
            p->iw[(int64_t)t * p->i_heads + h] =
                bf16_to_f32(iwb[(int64_t)t * p->i_heads + h]) * p->iw_scale;
    }
    rc = 0;
done:
    free(qa), free(qr), free(ckv), free(row), free(ik), free(iwb);
    return rc;
}
