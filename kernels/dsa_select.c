/* DSA indexer scan + exact top-k for a few query rows of one sequence (CPU decode).
 *
 * For each query row r (n small: decode, or an MTP verify pair) over the sequence's L keys, stored
 * in blocks of `bs` rows addressed by its block table:
 *   score[r, j] = sum_h w[r, h] * relu(q[r, h, :] . key[j, :])        (w already scaled)
 * then the top-k causal keys (j <= q_pos[r]) with the reference's tie rule: every key above the
 * k-th largest score, and among keys equal to it the earliest. Output: the kept positions of each
 * row in ascending key order and their count.
 *
 * Why: the torch path gathers the keys, widens them to fp32, runs a skinny GEMM, a relu pass, a
 * weighted-sum pass, a top-k and a mask-to-index pass: five passes over O(L) data per row. Here
 * each key block is read once (bf16 widened in registers), scored for every row while in L1,
 * and the selection is a quickselect on the row's scores (O(L), no sort).
 * Products and sums are fp32 as in the reference; only the order of the additions over the
 * head dimension may differ (so near-ties can in principle select differently: the tests compare
 * the selected keys with the torch path on random data and require them identical).
 * Functions carry target_clones: GCC picks AVX-512 / AVX2 / baseline at load time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

/* Scores of rows 0..n-1 against 64 keys (kbT: D x 64, transposed so the fast axis is the key and
 * the loops have constant trip counts: dot[] and acc[] live in vector registers). Keys past the
 * block's end are zero rows; only the first m scores are stored. */
CLONES static void score_block(const float *q, const float *w, int n, int H, int D, const float *kbT,
                               int m, float *out, int64_t ld) {
    for (int r = 0; r < n; r++) {
        float acc[64] = {0};
        for (int h = 0; h < H; h++) {
            const float *qh = q + ((int64_t)r * H + h) * D;
            float dot[64] = {0};
            for (int d = 0; d < D; d++) {
                const float qd = qh[d];
                const float *kd = kbT + (int64_t)d * 64;
                for (int j = 0; j < 64; j++) dot[j] += qd * kd[j];
            }
            const float wh = w[r * H + h];
            for (int j = 0; j < 64; j++) acc[j] += wh * (dot[j] > 0.0f ? dot[j] : 0.0f);
        }
        memcpy(out + (int64_t)r * ld, acc, sizeof(float) * m);
    }
}

/* scores [n, L]: the indexer scan, blocks split over threads. */
static void scan(const float *q, const float *w, int n, int H, int D, const void *store,
                 int bf16, const int64_t *table, int bs, int64_t L, float *scores, int nthreads) {
    int64_t nblk = (L + bs - 1) / bs;
#pragma omp parallel num_threads(nthreads)
    {
        float kbT[64 * 256]; /* D <= 256, 64 keys at a time */
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

/* Returns 0, or -1 if D > 256. out_pos [n, k] (ascending; unused tail left as is), out_cnt [n]. */
int dsa_select(const float *q, const float *w, int n, int H, int D, const void *store, int bf16,
               const int64_t *table, int bs, int64_t L, const int64_t *q_pos, int k,
               float *scores, int64_t *out_pos, int32_t *out_cnt, int nthreads) {
    if (D > 256) return -1;
    scan(q, w, n, H, D, store, bf16, table, bs, L, scores, nthreads);
    float *tmp = (float *)malloc(sizeof(float) * (size_t)(L > 0 ? L : 1));
    if (!tmp) return -2;
    for (int r = 0; r < n; r++) {
        const float *s = scores + (int64_t)r * L;
        int64_t m = q_pos[r] + 1 < L ? q_pos[r] + 1 : L; /* causal keys */
        int64_t *pos = out_pos + (int64_t)r * k;
        int64_t c = 0;
        if (m <= k) {
            for (int64_t j = 0; j < m; j++) pos[c++] = j;
        } else {
            memcpy(tmp, s, sizeof(float) * (size_t)m);
            float t = kth_largest(tmp, m, k);
            int64_t above = 0;
            for (int64_t j = 0; j < m; j++) above += s[j] > t;
            int64_t need = k - above;
            for (int64_t j = 0; j < m; j++) {
                if (s[j] > t || (s[j] == t && need-- > 0)) pos[c++] = j;
            }
        }
        out_cnt[r] = (int32_t)c;
    }
    free(tmp);
    return 0;
}
