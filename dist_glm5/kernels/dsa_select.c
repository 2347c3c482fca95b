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
 * tile is 8 lanes wide on all three (AVX-512 runs it on ymm: one source for every ISA). Where
 * the CPU has them, int8 keys take AVX-512 VNNI and bf16 keys AVX512-BF16 (16 keys a vector, 4x
 * the products an instruction; below), each with the portable path beside it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>
#include <math.h>

#include "amx.h"
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif



/* v8 (common.h): the tile's accumulators stay in registers */

/* The store's kinds: fp32 or bf16 rows of D values, or int8 rows (quant/index_q8.py: D int8
 * values, then the key's fp32 scale). With int8 keys the queries are quantised here the same way
 * (quantise_q: index_q8.quantise's rule, the same ints and scales qs [n, H]; in torch it was 9
 * eager ops a call, more than the scan of a few thousand keys). Both scales are positive, so they
 * leave the relu: a key's score is
 *   ks * (sum over even h of c[h] * relu(idot[h]) + sum over odd h of the same),  c = w * qs,
 * with idot the exact integer dot (exact in fp32 too: |idot| <= 256 * 127^2 < 2^24), each
 * parity's sum in head order. One multiply per head and key instead of three, and two chains
 * of adds instead of one (ops/indexer.index_scores_q8 is the same formula in torch). */
enum { KEYS_F32, KEYS_BF16, KEYS_Q8 };
static inline int64_t key_bytes(int kind, int D) {
    return kind == KEYS_Q8 ? (int64_t)D + 4 : (int64_t)D * (kind == KEYS_BF16 ? 2 : 4);
}

/* Per-thread scratch kept between calls: a decode step selects once per full layer over about
 * the same keys, and a fresh malloc of buffers over L keys is, past glibc's 128 KiB threshold,
 * an mmap whose pages fault in (and a munmap) on every call. OpenMP's threads persist between
 * regions, so each keeps its own. Slots: one per buffer a call holds at once. Returns NULL when
 * out of memory. A buffer over SCRATCH_KEEP (a prefill's rows x keys) is freed when its call
 * ends (scratch_trim), as before: held between calls it would add to the peak the memory plan
 * counts. */
enum { SCR_BMAX, SCR_VALS, SCR_IDX, SCR_SCORES, SCR_POS, SCR_CNT, SCR_SLOTS, SCR_VALID, NSCR };
static __thread void *scr_ptr[NSCR];
static __thread size_t scr_cap[NSCR];
#define SCRATCH_KEEP ((size_t)8 << 20) /* a decode row's scores over 2M keys */
static void scratch_trim(int slot) {
    if (scr_cap[slot] > SCRATCH_KEEP) {
        free(scr_ptr[slot]);
        scr_ptr[slot] = NULL;
        scr_cap[slot] = 0;
    }
}
static void *scratch(int slot, size_t bytes) {
    if (scr_cap[slot] < bytes) {
        free(scr_ptr[slot]);
        scr_cap[slot] = bytes + bytes / 8; /* a growing context asks a little more each step */
        scr_ptr[slot] = malloc(scr_cap[slot]);
        if (!scr_ptr[slot]) scr_cap[slot] = 0;
    }
    return scr_ptr[slot];
}

/* max(x, 0) with +0.0 for x <= 0, as `x > 0 ? x : 0` (C has no vector ?:); a macro, as common.h's
 * V8: a function without the clone's target would not inline into it */
#define relu(x) ((v8)((v8i)(x) & ((x) > zero)))

/* NH heads' dots against NV x 8 keys at kbT + jt, relu'd, weighted and added into sum[0..NV):
 * NH x NV accumulators, NV key vectors and NH broadcasts per d all fit the 16 vector registers
 * (a tile that does not fit makes the compiler re-read the keys as FMA memory operands and the
 * loop becomes load-bound). A macro, not a function: each target clone compiles it for its ISA.
 * Q8 (a constant): int8 keys, whose relu'd dots (exact integers in fp32) take c = w * qs into
 * sq[parity of the head] (h is even here); the key scale comes after the sum. */
#define HEADS(NH, NV, Q8)                                                                        \
    do {                                                                                         \
        v8 acc[NH][NV];                                                                          \
        for (int i = 0; i < NH; i++)                                                             \
            for (int v = 0; v < NV; v++) acc[i][v] = zero;                                       \
        for (int d = 0; d < D; d++) {                                                            \
            v8 kv[NV];                                                                           \
            for (int v = 0; v < NV; v++) /* volatile: loaded once, not re-read per FMA */        \
                kv[v] = *(const volatile v8 *)(kbT + d * 64 + jt + 8 * v);                       \
            for (int i = 0; i < NH; i++) {                                                       \
                const v8 x = V8(qr[(int64_t)(h + i) * D + d]);                               \
                for (int v = 0; v < NV; v++) acc[i][v] += x * kv[v];                             \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < NH; i++) /* relu, then the head weights, in head order */            \
            for (int v = 0; v < NV; v++) {                                                       \
                if (Q8) sq[i & 1][v] += V8(cr[h + i]) * relu(acc[i][v]);                     \
                else sum[v] += V8(wr[h + i]) * relu(acc[i][v]);                               \
            }                                                                                    \
    } while (0)

/* Scores of rows 0..n-1 against 64 keys (kbT: D x 64, transposed so the fast axis is the key).
 * Register tiles of 2 heads x 32 keys: 8 accumulators, and per d 4 key loads and 2 broadcasts
 * feed 8 FMAs (the old one-head loop kept its 64 partial dots in memory: 21 GFLOP/s, one thread,
 * against about the mm rate for this tile). Keys past the block's end are zero rows; only the
 * first m scores are stored, and (mx not NULL) their maximum, at mx[r * ldm]. The d-sum runs in
 * order, d = 0..D-1, for every key and head. */
CLONES static void score_block(const float *q, const float *w, const float *c, int n, int H,
                               int D, const float *kbT, const float *ks, int m, float *out,
                               int64_t ld, float *mx, int64_t ldm) {
    const v8 zero = V8(0.0f);
    for (int r = 0; r < n; r++) {
        const float *qr = q + (int64_t)r * H * D, *wr = w + (int64_t)r * H;
        float row[64] __attribute__((aligned(32)));
        for (int jt = 0; jt < 64; jt += 32) {
            v8 sum[4] = {zero, zero, zero, zero};
            v8 sq[2][4] = {{zero, zero, zero, zero}, {zero, zero, zero, zero}}; /* int8: by parity */
            const float *cr = ks ? c + (int64_t)r * H : NULL; /* int8 keys: c = w * qs */
            int h = 0;
            if (ks) { /* int8 keys (ks: the key scales) */
                for (; h + 2 <= H; h += 2) HEADS(2, 4, 1);
                if (h < H) HEADS(1, 4, 1);
                for (int v = 0; v < 4; v++)
                    sum[v] = (sq[0][v] + sq[1][v]) * *(const v8 *)(ks + jt + 8 * v);
            } else {
                for (; h + 2 <= H; h += 2) HEADS(2, 4, 0);
                if (h < H) HEADS(1, 4, 0); /* an odd head count's last head */
            }
            for (int v = 0; v < 4; v++) *(v8 *)(row + jt + 8 * v) = sum[v];
        }
        memcpy(out + (int64_t)r * ld, row, sizeof(float) * m);
        if (mx) {
            float v = row[0];
            for (int j = 1; j < m; j++) v = row[j] > v ? row[j] : v;
            mx[(int64_t)r * ldm] = v;
        }
    }
}

static const int ORDER[4] = {0, 2, 1, 3}; /* the dims (and + 4) the transpose's b[0..3] hold */

/* Keys row0 .. row0+m-1 (m <= 64) of the store, widened to fp32 and transposed into kbT [D, 64]
 * (keys past m are zero rows). In tiles of 8 keys x 8 dims: 8 vector loads, an 8 x 8 transpose
 * in registers (three rounds of two-input shuffles) and 8 vector stores, where the scalar loop
 * stored one float at a time: at one decode row it took longer than scoring the block (1.47 ms
 * per layer at 32K keys here, more than the scores' FMAs). Same values, so the same bits. */
/* (int8 keys: their values widened, exact, and their scales into ks[0..m).) */
CLONES static void load_keys(const void *store, int kind, int64_t row0, int m, int D, float *kbT,
                             float *ks) {
    const int64_t qrow = (int64_t)D + 4; /* an int8 row's bytes */
    if (kind == KEYS_Q8)
        for (int j = 0; j < 64; j++) {
            float sc = 0.0f;
            if (j < m) memcpy(&sc, (const uint8_t *)store + (row0 + j) * qrow + D, sizeof(float));
            ks[j] = sc;
        }
    if (m < 64)
        for (int d = 0; d < D; d++) memset(kbT + d * 64 + m, 0, sizeof(float) * (64 - m));
    int j = 0;
    if (D % 8 == 0)
        for (; j + 8 <= m; j += 8)
            for (int d = 0; d < D; d += 8) {
                v8 r[8];
                for (int i = 0; i < 8; i++) {
                    if (kind == KEYS_BF16) {
                        r[i] = widen((const uint16_t *)store + (row0 + j + i) * D + d);
                    } else if (kind == KEYS_Q8) {
                        typedef int8_t v8c __attribute__((vector_size(8), aligned(1)));
                        v8c c;
                        memcpy(&c, (const int8_t *)store + (row0 + j + i) * qrow + d, sizeof(c));
                        r[i] = __builtin_convertvector(c, v8);
                    } else {
                        memcpy(&r[i], (const float *)store + (row0 + j + i) * D + d, sizeof(v8));
                    }
                }
                v8 a[8], b[8];
                for (int i = 0; i < 8; i += 2) { /* pairs of keys, interleaved by dim */
                    a[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                    a[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
                }
                for (int i = 0; i < 8; i += 4)
                    for (int h = 0; h < 2; h++) { /* quads of keys */
                        b[i + h] = __builtin_shufflevector(a[i + h], a[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                        b[i + h + 2] = __builtin_shufflevector(a[i + h], a[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                    }
                /* b[0..3]: keys 0-3, dims (0,4) (1,5) (2,6) (3,7) in their halves; b[4..7] keys 4-7 */
                for (int t = 0; t < 4; t++) {
                    v8 lo = __builtin_shufflevector(b[t], b[t + 4], 0, 1, 2, 3, 8, 9, 10, 11);
                    v8 hi = __builtin_shufflevector(b[t], b[t + 4], 4, 5, 6, 7, 12, 13, 14, 15);
                    memcpy(kbT + (int64_t)(d + ORDER[t]) * 64 + j, &lo, sizeof(v8));
                    memcpy(kbT + (int64_t)(d + ORDER[t] + 4) * 64 + j, &hi, sizeof(v8));
                }
            }
    for (; j < m; j++) {
        if (kind == KEYS_BF16) {
            const uint16_t *kr = (const uint16_t *)store + (row0 + j) * D;
            for (int d = 0; d < D; d++) kbT[d * 64 + j] = bf16_to_f32(kr[d]);
        } else if (kind == KEYS_Q8) {
            const int8_t *kr = (const int8_t *)store + (row0 + j) * qrow;
            for (int d = 0; d < D; d++) kbT[d * 64 + j] = (float)kr[d];
        } else {
            const float *kr = (const float *)store + (row0 + j) * D;
            for (int d = 0; d < D; d++) kbT[d * 64 + j] = kr[d];
        }
    }
}

/* ---- int8 keys on AVX-512 VNNI: vpdpbusd does 64 byte products an instruction (u8 x s8 into
 * int32 lanes, four bytes a lane). Lanes are keys: 16 keys' rows are transposed in registers so
 * that vector g holds dims 4g..4g+3 of each, and each (row, head) broadcasts its query's 4
 * bytes. The keys go in as u8 (k + 128) and 128 * sum(q) comes off each dot, so the integer dots
 * and then every fp32 operation are the portable path's, in its order: the same scores. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* t[i] (i < 16): lane j = dword g + i of key j's row (keys past nk and dwords past nd zero) */
VNNI static void transpose16(const uint8_t *rows, int64_t stride, int nk, int g, int nd,
                             __m512i *t) {
    const __mmask16 lm = (__mmask16)((1u << nd) - 1);
    __m512i r[16], a[16], b[16];
    for (int j = 0; j < 16; j++)
        r[j] = j < nk ? _mm512_maskz_loadu_epi32(lm, rows + j * stride + 4 * g)
                      : _mm512_setzero_si512();
    for (int i = 0; i < 16; i += 2) { /* within each 128-bit lane: pairs of keys by dword */
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* b[i + c], lane L: dword 4L + c of keys i..i+3 */
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

/* The chunk's maximum per row (mx[r * ldm]) from its m stored scores (out, row stride ld). */
VNNI static inline __attribute__((always_inline)) void stored_max(const float *out, int64_t ld,
                                                                  int n, int m, float *mx,
                                                                  int64_t ldm) {
    for (int r = 0; r < n; r++) {
        __m512 v = _mm512_set1_ps(-INFINITY);
        for (int j0 = 0; j0 < m; j0 += 16) {
            const __mmask16 km = (__mmask16)((1u << (m - j0 < 16 ? m - j0 : 16)) - 1);
            v = _mm512_mask_max_ps(v, km, v, _mm512_maskz_loadu_ps(km, out + (int64_t)r * ld + j0));
        }
        mx[(int64_t)r * ldm] = _mm512_reduce_max_ps(v);
    }
}

/* acc += the 16 lanes' u8 x s8 dots of k with the 4 query bytes at p, broadcast from memory
 * ({1to16}). gcc's intrinsic form loads each broadcast into a register and copies the
 * accumulators around it: twice the instructions, and the loop ran at half the VNNI rate. */
#define DPBUSD_BCST(acc, k, p)                                                                   \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*(const int32_t *)(p)))

/* NH heads of row r, from head h (even) on, against the 16 transposed keys kt, into s0 (even
 * heads) and s1 (odd). A macro with a constant NH, so that the accumulators live in registers.
 * Each accumulator starts at -128 * sum(q) (the u8 bias's share), so after the G dwords it
 * holds the exact integer dot. */
#define VNNI_HEADS(NH)                                                                           \
    do {                                                                                         \
        const int64_t rh = (int64_t)r * H + h;                                                   \
        __m512i acc[NH];                                                                         \
        for (int i = 0; i < NH; i++) acc[i] = _mm512_set1_epi32(-qcorr[rh + i]);                 \
        const int32_t *qh = q4 + rh * G;                                                         \
        for (int g = 0; g < G; g++)                                                              \
            for (int i = 0; i < NH; i++) DPBUSD_BCST(acc[i], kt[g], qh + i * G + g);             \
        for (int i = 0; i < NH; i++) { /* relu on the integers (+0 for <= 0), then c[h] */       \
            const __m512 f = _mm512_cvtepi32_ps(_mm512_max_epi32(acc[i], zi));                   \
            if (i & 1) s1 = _mm512_fmadd_ps(_mm512_set1_ps(c[rh + i]), f, s1);                   \
            else s0 = _mm512_fmadd_ps(_mm512_set1_ps(c[rh + i]), f, s0);                         \
        }                                                                                        \
    } while (0)

/* score_block for int8 keys: rows 0..n-1 (q4: each (row, head)'s query as G = D / 4 dwords of
 * int8, qcorr: 128 * the sum of its bytes, c = w * qs) against the m <= 64 keys from `rows` on
 * (stride D + 4). Each 16 keys are transposed once for all rows. Inlined with G a constant for
 * the common widths (score_block_vnni): the dword loop then unrolls and the transposed keys stay
 * in registers; with G at run time the loop's setup cost as much as its 8 dots at D = 32. */
VNNI static inline __attribute__((always_inline)) void
vnni_block(const int32_t *q4, const int32_t *qcorr, const float *c, int n, int H, const int G,
           const uint8_t *rows, int m, float *out, int64_t ld, float *mx, int64_t ldm) {
    const int D = 4 * G;
    const int64_t stride = (int64_t)D + 4;
    const __m512i bias = _mm512_set1_epi8((char)0x80), zi = _mm512_setzero_si512();
    const __m512 zero = _mm512_setzero_ps();
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    __m512i kt[(G + 15) / 16 * 16]; /* a constant size (transpose16 fills 16): kept in registers */
    for (int j0 = 0; j0 < m; j0 += 16) {
        const int nk = m - j0 < 16 ? m - j0 : 16;
        const uint8_t *kr = rows + j0 * stride;
        /* the G dwords of each key, and its scale (dword G) in the last transpose's spare lane
         * when there is one (G % 16 != 0), else gathered */
        for (int g = 0; g < G; g += 16) transpose16(kr, stride, nk, g, G - g < 16 ? G + 1 - g : 16, kt + g);
        const __mmask16 km = (__mmask16)((1u << nk) - 1);
        const __m512 ks = G % 16 ? _mm512_castsi512_ps(kt[G])
                                 : _mm512_mask_i32gather_ps(zero, km, at, kr + D, 1);
        for (int g = 0; g < G; g++) kt[g] = _mm512_xor_si512(kt[g], bias);
        for (int r = 0; r < n; r++) {
            __m512 s0 = zero, s1 = zero;
            int h = 0;
            for (; h + 8 <= H; h += 8) VNNI_HEADS(8); /* 8 chains keep both VNNI pipes fed */
            for (; h + 2 <= H; h += 2) VNNI_HEADS(2);
            if (h < H) VNNI_HEADS(1);
            _mm512_mask_storeu_ps(out + (int64_t)r * ld + j0, km,
                                  _mm512_mul_ps(_mm512_add_ps(s0, s1), ks));
        }
    }
    if (mx) stored_max(out, ld, n, m, mx, ldm);
}

VNNI static void score_block_vnni(const int32_t *q4, const int32_t *qcorr, const float *c, int n,
                                  int H, int D, const uint8_t *rows, int m, float *out,
                                  int64_t ld, float *mx, int64_t ldm) {
    switch (D) { /* the embedded and bench models' widths, and GLM-5's */
    case 32: vnni_block(q4, qcorr, c, n, H, 8, rows, m, out, ld, mx, ldm); break;
    case 64: vnni_block(q4, qcorr, c, n, H, 16, rows, m, out, ld, mx, ldm); break;
    case 128: vnni_block(q4, qcorr, c, n, H, 32, rows, m, out, ld, mx, ldm); break;
    default: vnni_block(q4, qcorr, c, n, H, D / 4, rows, m, out, ld, mx, ldm);
    }
}

/* ---- int8 keys on AMX (Intel Sapphire Rapids on): tdpbssd multiplies a 16 x K-byte tile of s8
 * (K <= 64) by a K-byte x 16 tile into 16 x 16 int32, 16K products an instruction where vpdpbusd
 * does 64. The keys are the A tile straight from the store (16 rows of D bytes at the row
 * stride: no transpose, and s8 x s8, so no u8 bias); a row's queries are the B tile (head h's
 * dword g at row g, column h; built once a call), so C[key][head] is the exact integer dot, as
 * the VNNI path's. A key's score is then a sum along C's row: relu, c[h], and a tree of adds
 * over 16 keys at once (hsum16). The same products as the other paths, added over the heads in
 * another order (pairs 8 apart first), as the bf16 path's dots differ from the portable one's:
 * the tests compare the selections with the torch form's. D <= 128 (two K chunks) and H <= 64
 * (four tiles of 16 heads); other shapes take the VNNI path. */
#if HAVE_AMX
#define AMX_T __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#endif
typedef amx_tilecfg tilecfg;

/* tmm0: C (16 keys x 16 heads, int32; 8 heads when H <= 8); tmm2, tmm3: A (16 keys x the first
 * 64 bytes, the rest); tmm4, tmm5: B (those bytes' dwords x 16 heads, or 8). */
static void amx_config(tilecfg *t, int D, int H) {
    const int k0 = D < 64 ? D : 64, k1 = D - k0;
    const uint16_t nb = H <= 8 ? 32 : 64;
    memset(t, 0, sizeof *t);
    t->palette = 1;
    t->rows[0] = 16, t->colsb[0] = nb;
    t->rows[2] = 16, t->colsb[2] = (uint16_t)k0;
    t->rows[4] = (uint8_t)(k0 / 4), t->colsb[4] = nb;
    if (k1) {
        t->rows[3] = 16, t->colsb[3] = (uint16_t)k1;
        t->rows[5] = (uint8_t)(k1 / 4), t->colsb[5] = nb;
    }
}

#if HAVE_AMX
/* The tile state is per thread: each thread of a scan loads the configuration and releases it. */
AMX_T static void amx_begin(const tilecfg *t) { _tile_loadconfig(t); }
AMX_T static void amx_end(void) { _tile_release(); }

/* Lane k of hsum16's result: the sum of v[SIGMA[k]]'s 16 lanes. Four rounds of shuffles and adds
 * (15 adds) instead of 16 horizontal reductions; SIGMA is the order the rounds leave the sums
 * in (its own inverse), so the caller puts key k's vector at v[SIGMA[k]]. hsum_halves is its
 * last three rounds: a[i]'s two 256-bit halves are v[i] and v[i + 8], 8 lanes each. */
static const int SIGMA[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
AMX_T static inline __m512 hsum_halves(const __m512 *a) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++) /* 128-bit lanes: v[i], v[i + 8], v[i + 4], v[i + 12], 4 each */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88),
                             _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* each lane: b[i]'s vector 2 partial sums, b[i + 2]'s 2 */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44),
                             _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
AMX_T static inline __m512 hsum16(const __m512 *v) {
    __m512 a[8];
    for (int i = 0; i < 8; i++) /* 256-bit halves: v[i]'s 8 partial sums, v[i + 8]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                             _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    return hsum_halves(a);
}
/* With at most 8 heads C holds 8 lanes a key, so one vector holds keys 2i and 2i + 1, already
 * the first round's form: hsum_halves of those 8 vectors leaves key PAIRS[k] in lane k (v[p] is
 * key 2p, v[p + 8] key 2p + 1, by SIGMA), and one permute puts key k in lane k. */
static const int PAIRS[16] = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};

/* score_block for int8 keys on AMX: rows 0..n-1 (qb: each row's NT x 2 B tiles of 1 KiB, cv:
 * its c = w * qs, 16 a head tile, zero past H) against the m <= 64 keys from `rows` on. H <= 8
 * (one head tile of 8 columns): two keys a vector in the sum over heads. */
AMX_T static void score_block_amx(const int8_t *qb, const float *cv, int n, int H, int NT, int D,
                                  const uint8_t *rows, int m, float *out, int64_t ld, float *mx,
                                  int64_t ldm) {
    const __m512i pairs = _mm512_loadu_si512(PAIRS);
    const int64_t stride = (int64_t)D + 4;
    const int two = D > 64;
    int32_t cb[4][256] __attribute__((aligned(64))); /* C of each head tile */
    uint8_t pad[16 * (128 + 4)] __attribute__((aligned(64)));
    const __m512 zero = _mm512_setzero_ps();
    const __m512i zi = _mm512_setzero_si512();
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    for (int j0 = 0; j0 < m; j0 += 16) {
        const int nk = m - j0 < 16 ? m - j0 : 16;
        const uint8_t *kr = rows + j0 * stride;
        if (nk < 16) { /* a tile load reads 16 rows: past the chunk's end is not ours */
            memset(pad, 0, (size_t)(16 * stride));
            memcpy(pad, kr, (size_t)(nk * stride));
            kr = pad;
        }
        const __mmask16 km = (__mmask16)((1u << nk) - 1);
        const __m512 ks = _mm512_mask_i32gather_ps(zero, km, at, kr + D, 1);
        _tile_loadd(2, kr, stride);
        if (two) _tile_loadd(3, kr + 64, stride);
        /* one row of one head tile (a decode row of up to 16 heads): its B tiles stay loaded */
        const int reload = !(n == 1 && NT == 1) || j0 == 0;
        for (int r = 0; r < n; r++) {
            for (int nt = 0; nt < NT; nt++) {
                const int8_t *b = qb + (int64_t)(r * NT + nt) * 2048;
                _tile_zero(0);
                if (reload) _tile_loadd(4, b, 64);
                _tile_dpbssd(0, 2, 4);
                if (two) {
                    if (reload) _tile_loadd(5, b + 1024, 64);
                    _tile_dpbssd(0, 3, 5);
                }
                _tile_stored(0, cb[nt], H <= 8 ? 32 : 64);
            }
            const float *c = cv + (int64_t)r * NT * 16;
            if (H <= 8) { /* keys 2i and 2i + 1 in one vector: C's rows are 32 bytes */
                const __m512 c2 = _mm512_castsi512_ps(_mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)c)));
                __m512 a[8];
                for (int i = 0; i < 8; i++)
                    a[i] = _mm512_mul_ps(c2, _mm512_cvtepi32_ps(_mm512_max_epi32(
                                                 _mm512_load_si512(cb[0] + 16 * i), zi)));
                const __m512 sc = _mm512_permutexvar_ps(pairs, hsum_halves(a));
                _mm512_mask_storeu_ps(out + (int64_t)r * ld + j0, km, _mm512_mul_ps(sc, ks));
                continue;
            }
            __m512 v[16];
            for (int i = 0; i < 16; i++) { /* key i's 16 (or NT x 16) heads, relu and c[h] */
                __m512 s = _mm512_mul_ps(
                    _mm512_loadu_ps(c),
                    _mm512_cvtepi32_ps(_mm512_max_epi32(_mm512_load_si512(cb[0] + 16 * i), zi)));
                for (int nt = 1; nt < NT; nt++)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(c + 16 * nt),
                                        _mm512_cvtepi32_ps(_mm512_max_epi32(
                                            _mm512_load_si512(cb[nt] + 16 * i), zi)),
                                        s);
                v[SIGMA[i]] = s;
            }
            _mm512_mask_storeu_ps(out + (int64_t)r * ld + j0, km, _mm512_mul_ps(hsum16(v), ks));
        }
    }
    if (mx) stored_max(out, ld, n, m, mx, ldm);
}
#endif

/* ---- bf16 keys on AVX512-BF16: vdpbf16ps adds 16 lanes' pairs of bf16 products into fp32, 32
 * products an instruction against the fp32 tiles' 8. Lanes are keys again: transpose16 moves
 * each key's dims (2p, 2p + 1), one dword, into lane j of vector p, and each (row, head)
 * broadcasts its query's pair p. Products of bf16 values are exact in fp32, so the dots differ
 * from the portable path's only in the order of their additions (by pairs), as the fp32 tiles'
 * already differ from torch's GEMM; the instruction treats subnormal inputs as zero. Taken only
 * when every query value is a bf16 value (a bf16 model's are), so nothing is rounded. */
#define VNNI_BF16                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma")))

/* acc += the 16 lanes' pair dots of k with the query pair at p, broadcast from memory ({1to16}),
 * as DPBUSD_BCST */
#define DPBF16_BCST(acc, k, p)                                                                   \
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*(const int32_t *)(p)))

/* NH heads of row r from head h on against the 16 transposed keys kt: relu'd and weighted into
 * s in head order (the portable path's order). A macro with a constant NH, as VNNI_HEADS. */
#define BF16_HEADS(NH)                                                                           \
    do {                                                                                         \
        const int64_t rh = (int64_t)r * H + h;                                                   \
        __m512 acc[NH];                                                                          \
        for (int i = 0; i < NH; i++) acc[i] = zero;                                              \
        const uint32_t *qh = q2 + rh * P;                                                        \
        for (int p = 0; p < P; p++)                                                              \
            for (int i = 0; i < NH; i++) DPBF16_BCST(acc[i], kt[p], qh + i * P + p);            \
        for (int i = 0; i < NH; i++)                                                             \
            s = _mm512_fmadd_ps(_mm512_set1_ps(w[rh + i]), _mm512_max_ps(acc[i], zero), s);     \
    } while (0)

/* score_block for bf16 keys: rows 0..n-1 (q2: each (row, head)'s query as P = D / 2 bf16
 * pairs; w: the head weights) against the m <= 64 keys from `rows` on (stride 2D bytes). Each
 * 16 keys are transposed once for all rows. P a constant for the common widths (score_block_bf16),
 * as vnni_block. */
VNNI_BF16 static inline __attribute__((always_inline)) void
bf16_block(const uint32_t *q2, const float *w, int n, int H, const int P, const uint8_t *rows,
           int m, float *out, int64_t ld, float *mx, int64_t ldm) {
    const int64_t stride = 4 * (int64_t)P;
    const __m512 zero = _mm512_setzero_ps();
    __m512i kt[(P + 15) / 16 * 16];
    for (int j0 = 0; j0 < m; j0 += 16) {
        const int nk = m - j0 < 16 ? m - j0 : 16;
        const uint8_t *kr = rows + j0 * stride;
        for (int g = 0; g < P; g += 16) transpose16(kr, stride, nk, g, P - g < 16 ? P - g : 16, kt + g);
        const __mmask16 km = (__mmask16)((1u << nk) - 1);
        for (int r = 0; r < n; r++) {
            __m512 s = zero;
            int h = 0;
            for (; h + 8 <= H; h += 8) BF16_HEADS(8);
            for (; h + 2 <= H; h += 2) BF16_HEADS(2);
            if (h < H) BF16_HEADS(1);
            _mm512_mask_storeu_ps(out + (int64_t)r * ld + j0, km, s);
        }
    }
    if (mx) stored_max(out, ld, n, m, mx, ldm);
}

VNNI_BF16 static void score_block_bf16(const uint32_t *q2, const float *w, int n, int H, int D,
                                     const uint8_t *rows, int m, float *out, int64_t ld, float *mx,
                                     int64_t ldm) {
    switch (D) {
    case 32: bf16_block(q2, w, n, H, 16, rows, m, out, ld, mx, ldm); break;
    case 64: bf16_block(q2, w, n, H, 32, rows, m, out, ld, mx, ldm); break;
    case 128: bf16_block(q2, w, n, H, 64, rows, m, out, ld, mx, ldm); break;
    default: bf16_block(q2, w, n, H, D / 2, rows, m, out, ld, mx, ldm);
    }
}

/* The VNNI path runs where the CPU has it, D is a multiple of 4, and no test forces the
 * portable one (dsa_select_portable). */
static int portable = 0;
void dsa_select_portable(int on) { portable = on; }
/* The VNNI target's ISA is here and no test forces the portable path. */
static int vnni_here(void) {
    return !portable && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
int dsa_select_q8_vnni(int D) { return D % 4 == 0 && vnni_here(); }
/* The AMX path for int8 keys: built with it, the CPU has AMX-INT8 and the kernel lets this
 * process use the tiles (Linux asks: arch_prctl ARCH_REQ_XCOMP_PERM, once), the VNNI path's
 * conditions, D <= 128, H <= 64, and no test turns it off (dsa_select_no_amx). */
static int no_amx = 0;
void dsa_select_no_amx(int on) { no_amx = on; }
int dsa_select_q8_amx(int D, int H) {
    return !no_amx && dsa_select_q8_vnni(D) && D <= 128 && H <= 64 && amx_here(AMX_INT8);
}
/* The AVX512-BF16 path for bf16 keys: the CPU has it (and VNNI, for the transpose's target), D is
 * even and no test forces the portable path. */
int dsa_select_bf16dot(int D) {
    return D % 2 == 0 && vnni_here() && __builtin_cpu_supports("avx512bf16");
}

/* `iters` x 16 independent vpdpbusd on zmm registers (16 chains hide the latency), nothing else:
 * timed by the caller, the rate at which this core issues the int8 scan's one product
 * instruction (bench longctx's arithmetic floor; the VM has no counters). Returns 16 x iters,
 * or 0 where the VNNI path does not run. */
VNNI static int64_t vnni_spin(int64_t iters) {
    for (int64_t i = 0; i < iters; i++)
        __asm__ volatile(
#define D1(r) "vpdpbusd %%zmm16, %%zmm17, %%zmm" #r "\n\t"
            D1(0) D1(1) D1(2) D1(3) D1(4) D1(5) D1(6) D1(7)
            D1(8) D1(9) D1(10) D1(11) D1(12) D1(13) D1(14) D1(15)
#undef D1
            ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
            "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17");
    return 16 * iters;
}
int64_t dsa_select_vnni_spin(int64_t iters) { return vnni_here() ? vnni_spin(iters) : 0; }

/* How many keys the 64-key chunk starting at key j0 of cache block b holds: up to 64, the
 * block's end (blocks of bs keys) and the sequence's end (L). */
static inline int chunk_keys(int64_t j0, int64_t b, int bs, int64_t L) {
    int64_t m = (b + 1) * bs - j0;
    if (m > 64) m = 64;
    if (j0 + m > L) m = L - j0;
    return (int)m;
}

/* scores [n, L]: the indexer scan, blocks split over threads when there are at least
 * SCAN_PAR_MIN keys x rows (one decode row over a few thousand keys is tens of us: waking a
 * second thread for it costs more than it saves). */
/* bmax (NULL, or [n, ceil(L / 64)] when bs is a multiple of 64): each 64-key block's maximum. */
#define SCAN_PAR_MIN 16384
/* index_q8.quantise of each (row, head)'s D query values: scale = amax / 127 (1 when amax is 0),
 * values rint(q / scale) clamped to +-127 (rint: nearest even, as torch.round), into qv (as
 * floats) and qs. */
static void quantise_q(const float *q, int64_t rows, int D, float *qv, float *qs) {
    for (int64_t rh = 0; rh < rows; rh++) {
        const float *x = q + rh * D;
        float amax = 0.0f;
        for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float sc = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int d = 0; d < D; d++) {
            const float v = rintf(x[d] / sc);
            qv[rh * D + d] = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        }
        qs[rh] = sc;
    }
}

/* quantise_q for the tests (index_q8.quantise's ints and scales, compared) */
void dsa_select_quantise(const float *q, int64_t rows, int D, float *qv, float *qs) {
    quantise_q(q, rows, D, qv, qs);
}

static int scan(const float *q, const float *w, int n, int H, int D,
                const void *store, int kind, const int64_t *table, int bs, int64_t L,
                float *scores, float *bmax, int nthreads) {
    const int64_t ldm = (L + 63) / 64;
    const int64_t kb = key_bytes(kind, D);
    int64_t nblk = (L + bs - 1) / bs;
    /* int8 keys on VNNI: the queries' bytes as dwords, and 128 x their sums (the u8 bias) */
    /* AMX's sum over heads costs the same per key-row at any row count, where VNNI's transposes
     * are shared by the rows: with 16 heads of 32 bytes, 64 prefill rows over 4K keys took
     * 0.72 ms on AMX and 0.61 on VNNI (0.084 and 0.083 at 8 rows); with 8 x 64 and 32 x 128
     * AMX stays ahead (0.55 / 0.60, 2.4 / 4.2) */
    const int amx = kind == KEYS_Q8 && dsa_select_q8_amx(D, H) && (n <= 8 || H <= 8 || D >= 64);
    const int vnni = !amx && kind == KEYS_Q8 && dsa_select_q8_vnni(D);
    int8_t *q8 = NULL;
    int32_t *qcorr = NULL;
    float *c = NULL; /* int8 keys: c = w * qs, the scales folded into the head weights */
    float *qv = NULL; /* int8 keys: the quantised queries' values; q then points at them */
    if (kind == KEYS_Q8) {
        c = malloc(sizeof(float) * ((size_t)n * H + 1));
        qv = malloc(sizeof(float) * ((size_t)n * H * D + 1));
        if (!c || !qv) {
            free(c), free(qv);
            return -2;
        }
        quantise_q(q, (int64_t)n * H, D, qv, c);
        for (int64_t rh = 0; rh < (int64_t)n * H; rh++) c[rh] *= w[rh];
        q = qv;
    }
    /* bf16 keys on AVX512-BF16, when every query value is a bf16 value: the queries as pairs */
    uint32_t *q2 = NULL;
    if (kind == KEYS_BF16 && dsa_select_bf16dot(D)) {
        int exact = 1;
        for (int64_t i = 0; i < (int64_t)n * H * D && exact; i++)
            exact = bf16_to_f32(f32_to_bf16(q[i])) == q[i] || q[i] != q[i];
        if (exact) {
            if (!(q2 = malloc(sizeof(uint32_t) * ((size_t)n * H * D / 2 + 1)))) return -2; /* c, qv: NULL */
            for (int64_t i = 0; i < (int64_t)n * H * D / 2; i++)
                q2[i] = (uint32_t)f32_to_bf16(q[2 * i]) | (uint32_t)f32_to_bf16(q[2 * i + 1]) << 16;
        }
    }
    /* int8 keys on AMX: each row's queries as B tiles (NT head tiles x 2 K chunks of 1 KiB,
     * head h's dword g at row g, column h % 16; zero past H and D) and c by head tile */
    const int NT = (H + 15) / 16;
    int8_t *qb = NULL;
    float *cv = NULL;
    tilecfg cfg;
    if (amx) {
        qb = calloc((size_t)n * NT * 2048, 1);
        cv = calloc((size_t)n * NT * 16, sizeof(float));
        if (!qb || !cv) {
            free(qb), free(cv), free(c), free(qv), free(q2);
            return -2;
        }
        for (int r = 0; r < n; r++)
            for (int h = 0; h < H; h++) {
                const int64_t rh = (int64_t)r * H + h;
                int8_t *b = qb + ((int64_t)r * NT + h / 16) * 2048 + 4 * (h % 16);
                for (int d = 0; d < D; d++)
                    b[(d / 64) * 1024 + (d % 64) / 4 * 64 + d % 4] = (int8_t)q[rh * D + d];
                cv[((int64_t)r * NT + h / 16) * 16 + h % 16] = c[rh];
            }
        amx_config(&cfg, D, H);
    }
    if (vnni) {
        q8 = malloc((size_t)n * H * D + 1);
        qcorr = malloc(sizeof(int32_t) * ((size_t)n * H + 1));
        if (!q8 || !qcorr) {
            free(q8), free(qcorr), free(c), free(qv), free(q2);
            return -2;
        }
        for (int64_t rh = 0; rh < (int64_t)n * H; rh++) {
            int32_t sum = 0;
            for (int d = 0; d < D; d++) sum += q8[rh * D + d] = (int8_t)q[rh * D + d];
            qcorr[rh] = 128 * sum;
        }
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && (int64_t)n * L >= SCAN_PAR_MIN)
    {
        float kbT[64 * 256] __attribute__((aligned(32))); /* D <= 256, 64 keys at a time */
        float ks[64] __attribute__((aligned(32)));        /* int8 keys: their scales */
#if HAVE_AMX
        if (amx) amx_begin(&cfg);
#endif
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            for (int64_t j0 = b * bs; j0 < (b + 1) * bs && j0 < L; j0 += 64) {
                const int m = chunk_keys(j0, b, bs, L);
                int64_t row0 = table[b] * bs + (j0 - b * bs);
                /* the next chunk (this cache block's, or the next block's first) starts from
                 * cache: blocks sit anywhere in the store, where the hardware prefetcher does
                 * not follow */
                const int64_t jn = j0 + 64 < (b + 1) * bs ? j0 + 64 : (b + 1) * bs;
                if (jn < L) {
                    const int64_t bn = jn / bs;
                    const char *p0 = (const char *)store + (table[bn] * bs + jn - bn * bs) * kb;
                    const int64_t bytes = chunk_keys(jn, bn, bs, L) * kb;
                    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p0 + o, 0, 3);
                }
                float *mx = bmax ? bmax + j0 / 64 : NULL;
#if HAVE_AMX
                if (amx) {
                    score_block_amx(qb, cv, n, H, NT, D, (const uint8_t *)store + row0 * kb, m,
                                    scores + j0, L, mx, ldm);
                    continue;
                }
#endif
                if (q2) {
                    score_block_bf16(q2, w, n, H, D, (const uint8_t *)store + row0 * kb, m,
                                     scores + j0, L, mx, ldm);
                    continue;
                }
                if (vnni) {
                    score_block_vnni((const int32_t *)q8, qcorr, c, n, H, D,
                                     (const uint8_t *)store + row0 * kb, m, scores + j0, L, mx,
                                     ldm);
                    continue;
                }
                load_keys(store, kind, row0, m, D, kbT, ks);
                score_block(q, w, c, n, H, D, kbT, kind == KEYS_Q8 ? ks : NULL, m, scores + j0,
                            L, mx, ldm);
            }
        }
#if HAVE_AMX
        if (amx) amx_end();
#endif
    }
    free(q8), free(qcorr), free(c), free(qv), free(q2), free(qb), free(cv);
    return 0;
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

/* A float's bits as an unsigned key in the floats' order (negative ones flipped whole, positive
 * ones with the sign bit set; -0 just below +0, which compare equal: the selection's tie rule
 * compares the floats themselves). */
#define RADIX_BITS 11
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u ^ (u >> 31 ? 0xFFFFFFFFu : 0x80000000u);
}

/* One row's top-k of its first m scores (m > k) into pos (ascending), with the reference's tie
 * rule. The k-th largest block maximum is a lower bound t0 of the k-th largest score (k blocks
 * each hold a score >= it), so every kept key lies in a block whose maximum is >= t0: with the
 * scan's 64-key maxima (bmax, not NULL) only those blocks (about k of them) are read; without,
 * one pass counts the scores by the top bits of their order_key and a second takes those in the
 * k-th largest's bin and above. The exact k-th value and the kept keys then come from those few
 * candidates.
 * vals/idx: scratch of m entries. Returns the count (k). */
static int64_t select_row(const float *s, int64_t m, int64_t k, const float *bmax, float *vals,
                          int64_t *idx, int64_t *pos) {
    int64_t c = 0;
    if (bmax && m / 64 >= k) {
        const int64_t full = m / 64, nb = (m + 63) / 64;
        float last = 0.0f; /* the partial block's maximum over its causal keys only */
        if (nb > full) {
            last = s[full * 64];
            for (int64_t j = full * 64 + 1; j < m; j++) last = s[j] > last ? s[j] : last;
        }
        memcpy(vals, bmax, sizeof(float) * (size_t)full);
        if (nb > full) vals[full] = last;
        const float t0 = kth_largest(vals, nb, k);
        for (int64_t b = 0; b < nb; b++) {
            if ((b < full ? bmax[b] : last) < t0) continue;
            const int64_t e = b * 64 + 64 < m ? b * 64 + 64 : m;
            for (int64_t j = b * 64; j < e; j++)
                if (s[j] >= t0) idx[c++] = j;
        }
    } else {
        /* the top RADIX_BITS of each score's order-preserving key: a count per bin finds the bin
         * holding the k-th largest, and the candidates are the scores in it and above (k plus
         * that bin's share). Block maxima of m / k keys bounded it far less tightly here: at
         * 4K keys and k = 256 a third of the keys were candidates (35 us a row) */
        uint32_t hist[1 << RADIX_BITS];
        memset(hist, 0, sizeof hist);
        for (int64_t j = 0; j < m; j++) hist[order_key(s[j]) >> (32 - RADIX_BITS)]++;
        int64_t above = 0;
        uint32_t b = (1u << RADIX_BITS) - 1;
        while (b > 0 && above + hist[b] < k) above += hist[b--];
        for (int64_t j = 0; j < m; j++)
            if (order_key(s[j]) >> (32 - RADIX_BITS) >= b) idx[c++] = j;
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

/* Returns 0, or -1 if D > 256. out_pos [n, k] (ascending; the unused tail repeats the first
 * pick), out_cnt [n]; out_slots [n, k] the picks' cache slots (through the block table, the tail
 * likewise) and out_valid [n, k] (1 for the real picks), each when not NULL. */
int dsa_select(const float *q, const float *w, int n, int H, int D,
               const void *store, int kind,
               const int64_t *table, int bs, int64_t L, const int64_t *q_pos, int k,
               float *scores, int64_t *out_pos, int32_t *out_cnt, int64_t *out_slots,
               uint8_t *out_valid, int nthreads) {
    if (D > 256) return -1;
    /* rows with at most k causal keys take them all, unscored: when every row does (a context
     * up to index_topk), the scan is skipped (at batch 32 x 256 keys it was 5% of a step) */
    int scored = 0;
    for (int r = 0; r < n && !scored; r++) scored = (q_pos[r] + 1 < L ? q_pos[r] + 1 : L) > k;
    const int64_t ldm = (L + 63) / 64;
    float *bmax = NULL;
    if (scored) {
        /* the scan's block maxima: on the 64-key grid only when the cache's blocks tile it */
        if (bs % 64 == 0 &&
            !(bmax = (float *)scratch(SCR_BMAX, sizeof(float) * (size_t)(n * ldm + 1))))
            return -2;
        if (scan(q, w, n, H, D, store, kind, table, bs, L, scores, bmax, nthreads)) {
            scratch_trim(SCR_BMAX);
            return -2;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (n > 1 && nthreads > 1) reduction(| : failed)
    {
        float *vals = (float *)scratch(SCR_VALS, sizeof(float) * (size_t)(L > 0 ? L : 1));
        int64_t *idx = (int64_t *)scratch(SCR_IDX, sizeof(int64_t) * (size_t)(L > 0 ? L : 1));
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
                c = select_row(s, m, k, bmax ? bmax + (int64_t)r * ldm : NULL, vals, idx, pos);
            }
            out_cnt[r] = (int32_t)c;
            for (int64_t j = c; j < k; j++) pos[j] = c ? pos[0] : 0; /* padding: the first pick */
            if (out_slots) {
                int64_t *sl = out_slots + (int64_t)r * k;
                for (int64_t j = 0; j < k; j++) sl[j] = table[pos[j] / bs] * bs + pos[j] % bs;
            }
            if (out_valid)
                for (int64_t j = 0; j < k; j++) out_valid[(int64_t)r * k + j] = j < c;
        }
        scratch_trim(SCR_VALS);
        scratch_trim(SCR_IDX);
    }
    scratch_trim(SCR_BMAX);
    return failed ? -2 : 0;
}

/* Sequence s of dsa_select_many: its rows' selection with nthreads, into the batch's outputs. */
static int select_seq(const float *q, const float *w, int s, const int32_t *row_off, int H, int D,
                      const void *store, int kind, const int64_t *tables,
                      const int64_t *tab_off,
                      int bs, const int64_t *Ls, const int64_t *q_pos, int topk,
                      int64_t *out_slots, uint8_t *out_valid, int nthreads) {
    const int r0 = row_off[s], n = row_off[s + 1] - r0;
    const int64_t L = Ls[s];
    const int k = topk < L ? topk : (int)L;
    float *scores = (float *)scratch(SCR_SCORES, sizeof(float) * (size_t)(n * L + 1));
    int64_t *pos = (int64_t *)scratch(SCR_POS, sizeof(int64_t) * (size_t)(n * k + 1));
    int32_t *cnt = (int32_t *)scratch(SCR_CNT, sizeof(int32_t) * (size_t)(n + 1));
    int64_t *slots = (int64_t *)scratch(SCR_SLOTS, sizeof(int64_t) * (size_t)(n * k + 1));
    uint8_t *valid = (uint8_t *)scratch(SCR_VALID, (size_t)(n * k + 1));
    int rc = -2;
    if (scores && pos && cnt && slots && valid)
        rc = dsa_select(q + (int64_t)r0 * H * D, w + (int64_t)r0 * H,
                        n, H, D, store, kind,
                        tables + tab_off[s], bs, L, q_pos + r0, k, scores, pos, cnt, slots,
                        valid, nthreads);
    if (rc == 0)
        for (int r = 0; r < n; r++) {
            int64_t *so = out_slots + (int64_t)(r0 + r) * topk;
            uint8_t *vo = out_valid + (int64_t)(r0 + r) * topk;
            memcpy(so, slots + (int64_t)r * k, sizeof(int64_t) * k);
            memcpy(vo, valid + (int64_t)r * k, (size_t)k);
            for (int j = k; j < topk; j++) {
                so[j] = so[0];
                vo[j] = 0;
            }
        }
    for (int i = SCR_SCORES; i <= SCR_VALID; i++) scratch_trim(i);
    return rc;
}

/* dsa_select for the rows of S sequences in one call (a decode step's batch): sequence s owns
 * rows [row_off[s], row_off[s + 1]) of q, w and q_pos, and its L[s] keys through the block table
 * at tables + tab_off[s]. Out: slots and valid [rows, topk], each sequence's k = min(topk, L[s])
 * picks then padding (its first pick's slot, valid 0), so every row has the same width. The
 * sequences go over threads, each one's selection on one thread (one sequence: all threads).
 * Returns 0, -1 (index_head_dim > 256) or -2 (out of memory). */
int dsa_select_many(const float *q, const float *w, int S, const int32_t *row_off, int H, int D,
                    const void *store, int kind, const int64_t *tables,
                    const int64_t *tab_off,
                    int bs, const int64_t *Ls, const int64_t *q_pos, int topk, int64_t *out_slots,
                    uint8_t *out_valid, int nthreads) {
    if (D > 256) return -1;
    if (S == 1) /* not inside a region of one thread: the scan's own region would then be a
                 * nested team, new threads each call (3 ms a call at 2 threads, measured) */
        return select_seq(q, w, 0, row_off, H, D, store, kind, tables, tab_off, bs, Ls, q_pos,
                          topk, out_slots, out_valid, nthreads);
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int s = 0; s < S; s++)
        failed |= select_seq(q, w, s, row_off, H, D, store, kind, tables, tab_off, bs, Ls, q_pos,
                             topk, out_slots, out_valid, 1) != 0;
    return failed ? -2 : 0;
}
