/* DSA indexer scan + exact top-k for query rows of one sequence (CPU decode and prefill).
 *
 * For each query row r (a decode row, an MTP verify pair, or a prefill chunk's row block) over the
 * sequence's L keys, stored
 * in blocks of `bs` rows addressed by its block table:
 *   score[r, j] = sum_h w[r, h] * relu(q[r, h, :] . key[j, :])        (w already scaled)
 * then the top-k causal keys (j <= q_pos[r]) with the reference's tie rule: every key above the
 * k-th largest score, and among keys equal to it the earliest. Output: the kept positions of each
 * row in ascending key order and their count.
 *
 * Why: the torch path gathers the keys, widens them to fp32, runs a skinny GEMM, a relu pass, a
 * weighted-sum pass, a top-k and a mask-to-index pass: five passes over O(L) data per row. Here
 * each key block is read once (bf16 widened once per block), scored for every row while in L1
 * by a register-tiled loop at the GEMM rate, and the selection takes two passes over the row
 * (block maxima, then the candidates above their k-th largest), rows split over threads.
 * Products and sums are fp32 as in the reference; only the order of the additions over the
 * head dimension may differ (so near-ties can in principle select differently: the tests compare
 * the selected keys with the torch path on random data and require them identical).
 * Functions carry target_clones: GCC picks AVX-512 / AVX2+FMA / baseline at load time. The
 * tile is 8 lanes wide on all three (AVX-512 runs it on ymm: one source for every ISA).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__)
/* x86-64-v3 = AVX2 + FMA (plain "avx2" would leave the products and sums unfused) */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

/* 8 fp32 lanes as a GCC vector: each target clone compiles it to its own ISA (one ymm on AVX2
 * and AVX-512, two xmm on the baseline), and the tile's accumulators stay in registers. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* macros, not functions: a function without the clone's target would not inline into it */
#define splat(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})
/* max(x, 0) with +0.0 for x <= 0, as `x > 0 ? x : 0` (C has no vector ?:) */
#define relu(x) ((v8)((v8i)(x) & ((x) > zero)))

/* Scores of rows 0..n-1 against 64 keys (kbT: D x 64, transposed so the fast axis is the key).
 * Register tile: 4 heads x 16 keys, 8 accumulators; per d two key loads and four broadcasts feed
 * eight FMAs (the old one-head loop kept its 64 partial dots in memory: 21 GFLOP/s against 75 for
 * this tile, one thread). Keys past the block's end are zero rows; only the first m scores are
 * stored. The d-sum runs in order, d = 0..D-1, for every key and head. */
CLONES static void score_block(const float *q, const float *w, int n, int H, int D, const float *kbT,
                               int m, float *out, int64_t ld) {
    const v8 zero = splat(0.0f);
    for (int r = 0; r < n; r++) {
        const float *qr = q + (int64_t)r * H * D, *wr = w + (int64_t)r * H;
        float row[64] __attribute__((aligned(32)));
        for (int jt = 0; jt < 64; jt += 16) {
            v8 s0 = zero, s1 = zero;
            int h = 0;
            for (; h + 4 <= H; h += 4) {
                const float *q0 = qr + (int64_t)h * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
                v8 a0 = zero, b0 = zero, a1 = zero, b1 = zero;
                v8 a2 = zero, b2 = zero, a3 = zero, b3 = zero;
                for (int d = 0; d < D; d++) {
                    const v8 k0 = *(const v8 *)(kbT + d * 64 + jt);
                    const v8 k1 = *(const v8 *)(kbT + d * 64 + jt + 8);
                    const v8 x0 = splat(q0[d]), x1 = splat(q1[d]);
                    const v8 x2 = splat(q2[d]), x3 = splat(q3[d]);
                    a0 += x0 * k0, b0 += x0 * k1, a1 += x1 * k0, b1 += x1 * k1;
                    a2 += x2 * k0, b2 += x2 * k1, a3 += x3 * k0, b3 += x3 * k1;
                }
                /* relu, then the head weights (the same products, in head order) */
                s0 += splat(wr[h]) * relu(a0);
                s1 += splat(wr[h]) * relu(b0);
                s0 += splat(wr[h + 1]) * relu(a1);
                s1 += splat(wr[h + 1]) * relu(b1);
                s0 += splat(wr[h + 2]) * relu(a2);
                s1 += splat(wr[h + 2]) * relu(b2);
                s0 += splat(wr[h + 3]) * relu(a3);
                s1 += splat(wr[h + 3]) * relu(b3);
            }
            for (; h < H; h++) { /* heads left over from the groups of 4 */
                const float *qh = qr + (int64_t)h * D;
                v8 a = zero, b = zero;
                for (int d = 0; d < D; d++) {
                    const v8 x = splat(qh[d]);
                    a += x * *(const v8 *)(kbT + d * 64 + jt);
                    b += x * *(const v8 *)(kbT + d * 64 + jt + 8);
                }
                s0 += splat(wr[h]) * relu(a);
                s1 += splat(wr[h]) * relu(b);
            }
            *(v8 *)(row + jt) = s0;
            *(v8 *)(row + jt + 8) = s1;
        }
        memcpy(out + (int64_t)r * ld, row, sizeof(float) * m);
    }
}

/* scores [n, L]: the indexer scan, blocks split over threads. */
static void scan(const float *q, const float *w, int n, int H, int D, const void *store,
                 int bf16, const int64_t *table, int bs, int64_t L, float *scores, int nthreads) {
    int64_t nblk = (L + bs - 1) / bs;
#pragma omp parallel num_threads(nthreads)
    {
        float kbT[64 * 256] __attribute__((aligned(32))); /* D <= 256, 64 keys at a time */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            for (int64_t j0 = b * bs; j0 < (b + 1) * bs && j0 < L; j0 += 64) {
                int m = (int)((b + 1) * bs - j0);
                if (m > 64) m = 64;
                if (j0 + m > L) m = (int)(L - j0);
                int64_t row0 = table[b] * bs + (j0 - b * bs);
                if (m < 64)
                    for (int d = 0; d < D; d++) memset(kbT + d * 64 + m, 0, sizeof(float) * (64 - m));
                for (int j = 0; j < m; j++) {
                    if (bf16) {
                        const uint16_t *kr = (const uint16_t *)store + (row0 + j) * D;
                        for (int d = 0; d < D; d++) kbT[d * 64 + j] = bf16_to_f32(kr[d]);
                    } else {
                        const float *kr = (const float *)store + (row0 + j) * D;
                        for (int d = 0; d < D; d++) kbT[d * 64 + j] = kr[d];
                    }
                }
                score_block(q, w, n, H, D, kbT, m, scores + j0, L);
            }
        }
    }
}

/* The k-th largest of a[0..m) (0 < k <= m), a is scrambled. */
static float kth_largest(float *a, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1, want = k - 1; /* index in descending order */
    while (lo < hi) {
        float p = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[lo];
}

/* Block maxima of s[0..m) over blocks of B keys (the last may be short) -> mx[0..nb). */
CLONES static void block_max(const float *s, int64_t m, int64_t B, float *mx) {
    for (int64_t b = 0, i = 0; b < m; b += B, i++) {
        const int64_t e = b + B < m ? b + B : m;
        float v = s[b];
        for (int64_t j = b + 1; j < e; j++) v = s[j] > v ? s[j] : v;
        mx[i] = v;
    }
}

/* One row's top-k of its first m scores (m > k) into pos (ascending), with the reference's tie
 * rule. The k-th largest block maximum is a lower bound t0 of the k-th largest score (k blocks
 * each hold a score >= it), so every kept key is among the candidates s[j] >= t0, found in one
 * pass; the exact k-th value and the kept keys come from those few. Two passes over the row in
 * all, where a quickselect over the whole row moves it around several times.
 * vals/idx: scratch of m entries. Returns the count (k). */
static int64_t select_row(const float *s, int64_t m, int64_t k, float *vals, int64_t *idx,
                          int64_t *pos) {
    int64_t B = m / k < 64 ? m / k : 64; /* >= 1 since m > k; at least k blocks */
    int64_t nb = (m + B - 1) / B;
    block_max(s, m, B, vals);
    const float t0 = kth_largest(vals, nb, k);
    int64_t c = 0;
    for (int64_t j = 0; j < m; j++) {
        if (s[j] >= t0) idx[c++] = j;
    }
    for (int64_t i = 0; i < c; i++) vals[i] = s[idx[i]];
    const float t = kth_largest(vals, c, k);
    int64_t above = 0;
    for (int64_t i = 0; i < c; i++) above += s[idx[i]] > t;
    int64_t need = k - above, o = 0;
    for (int64_t i = 0; i < c; i++) {
        const float v = s[idx[i]];
        if (v > t || (v == t && need-- > 0)) pos[o++] = idx[i];
    }
    return o;
}

/* Returns 0, or -1 if D > 256. out_pos [n, k] (ascending; unused tail left as is), out_cnt [n]. */
int dsa_select(const float *q, const float *w, int n, int H, int D, const void *store, int bf16,
               const int64_t *table, int bs, int64_t L, const int64_t *q_pos, int k,
               float *scores, int64_t *out_pos, int32_t *out_cnt, int nthreads) {
    if (D > 256) return -1;
    scan(q, w, n, H, D, store, bf16, table, bs, L, scores, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(n > 1 ? nthreads : 1) reduction(| : failed)
    {
        float *vals = (float *)malloc(sizeof(float) * (size_t)(L > 0 ? L : 1));
        int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(L > 0 ? L : 1));
        failed = !vals || !idx;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < n; r++) {
            const float *s = scores + (int64_t)r * L;
            int64_t m = q_pos[r] + 1 < L ? q_pos[r] + 1 : L; /* causal keys */
            int64_t *pos = out_pos + (int64_t)r * k;
            int64_t c = 0;
            if (m <= k) {
                for (int64_t j = 0; j < m; j++) pos[c++] = j;
            } else if (!failed) {
                c = select_row(s, m, k, vals, idx, pos);
            }
            out_cnt[r] = (int32_t)c;
        }
        free(vals);
        free(idx);
    }
    return failed ? -2 : 0;
}
