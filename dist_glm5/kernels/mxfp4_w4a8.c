/* Routed MoE experts from the packed MXFP4 serving layout with int8 activations ("w4a8"): an
 * opt-in, faster and less exact sibling of mxfp4_moe.c (same layout, same contract otherwise).
 *
 * Layout (as mxfp4_moe.c): w13 [E, 2I, H/2] uint8 E2M1 codes, two per byte, LOW nibble = even
 * input column, rows [gate (I); up (I)] per expert; s13 [E, 2I, H/32] E8M0 scales 2^(byte-127)
 * (255 = NaN); w2 [E, H, I/2], s2 [E, H, I/32] the down projection.
 *
 * The arithmetic (the Python module's docstring states it in full; the test's oracle repeats it):
 * - an activation row is quantised per block of 32 consecutive inputs: d = amax / 127.0f (fp32),
 *   q_i = rint(x_i / d) (fp32 division, round half to even) as int8, all q = 0 when d == 0;
 * - a code c is the integer v = 2 * E2M1[c] in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12} and the row's
 *   block scale is 2^(byte-127) / 2 = 2^(byte-128) (WSCALE);
 * - block dot S = sum q_i * v_i, exact in int32; row result y = sum over blocks of
 *   (float)S * fp32(d * wscale), accumulated in fp32.
 *
 * Why it is shaped like this:
 * - The exact kernel decodes each weight to fp32 and spends FMAs (8 MACs each); here the AVX2 path
 *   does 32 MACs with vpmaddubsw + vpmaddwd (the llama.cpp MXFP4 x Q8_0 product): the nibbles of a
 *   block go through ONE vpshufb on a 16-entry table of w + 12 (unsigned, as vpmaddubsw wants
 *   its first operand; a vpsignb per row and per token before, 4-5% slower at 1-32 tokens),
 *   vpmaddubsw / vpmaddwd sum the products in int16 / int32 lanes (at most 2 * 24 * 127 = 6096
 *   per int16 pair: never saturates), one cvt + FMA per block applies d * wscale to the fp32
 *   accumulator, and 12 * sum(q) * d * wscale, one FMA per row and block for all the tokens, is
 *   subtracted at the end. The integers are the scalar path's; only fp32 roundings differ.
 * - The nibble split puts the low nibbles (even columns) of a block in the first 16 bytes and the
 *   high nibbles (odd columns) in the last 16, so each quantised row is stored in that order: in
 *   every block of 32, the 16 even columns, then the 16 odd ones (qpos). The scalar path reads
 *   the same layout, so both compute the same integers.
 * - Grouping, threading and prefetch as mxfp4_moe.c: tokens grouped by expert (each touched
 *   expert's rows read once for all its tokens), several rows x several tokens per pass, work
 *   items of 128 rows taken dynamically by OpenMP threads, software prefetch PF_BYTES ahead.
 * - OpenMP outlines a parallel region before inlining and target cloning, so the parallel regions
 *   live in the plain entry points and the hot loops in functions with explicit target
 *   attributes (rows_avx2_*), picked at run time through a table: no -march flag is needed.
 * - AVX-512 CPUs run the AVX2 path (an AVX512-VNNI vpdpbusd variant would be the next step).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define W4_X86 1
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1 };
enum { MAX_GROUP = 8 }; /* tokens whose accumulators stay in registers while a row streams by */

/* 2 * E2M1[code], exact int8 (the sign is bit 3; -0 is 0) */
static const int8_t W8[16] __attribute__((aligned(16))) = {0,  1,  2,  3,  4,  6,  8,  12,
                                                           0, -1, -2, -3, -4, -6, -8, -12};
/* W8 + 12: the unsigned operand of vpmaddubsw (the AVX2 path subtracts 12 * sum(q) after) */
enum { W_OFF = 12 };
static const uint8_t U8[16] __attribute__((aligned(16))) = {12, 13, 14, 15, 16, 18, 20, 24,
                                                            12, 11, 10, 9,  8,  6,  4,  0};
static float WSCALE[256]; /* E8M0 byte -> 2^(byte-128) = 2^(byte-127) / 2; 255 -> NaN */
static int g_isa = -1;

static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        if (b == 255) {
            WSCALE[b] = NAN;
            continue;
        }
        /* 2^(b-128): normal for b >= 2, exact subnormal 2^-128 (b = 0) and 2^-127 (b = 1) */
        WSCALE[b] = ldexpf(1.0f, b - 128);
    }
}

static int best_isa(void) {
#ifdef W4_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* Select the code path: -1 = best the CPU supports (a request above it is lowered). Returns the
 * path in use (0 scalar, 1 AVX2+FMA). Not thread safe: call before use. */
int w4_set_isa(int isa) {
    int best = best_isa();
    if (WSCALE[128] == 0.0f) init_tables();
    g_isa = (isa < 0 || isa > best) ? best : isa;
    return g_isa;
}

/* Natural column c of a quantised row -> its position: in each block of 32, the 16 even columns
 * (c / 2 within the block), then the 16 odd ones. */
static inline int qpos(int c) { return (c & ~31) | ((c & 1) << 4) | ((c & 31) >> 1); }

/* Quantise n fp32 values (n a multiple of 32) per block of 32: d[b] = amax / 127, q in qpos
 * order. A block holding inf or NaN gets d = NaN and q = 0: its rows' results are NaN. */
static void quantise(const float *x, int n, int8_t *q, float *d) {
    for (int b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        int finite = 1;
        for (int i = 0; i < 32; i++) finite &= isfinite(xb[i]) != 0;
        const float db = finite ? amax / 127.0f : NAN;
        d[b] = db;
        for (int i = 0; i < 32; i++)
            q[32 * b + qpos(i)] = (finite && db != 0.0f) ? (int8_t)lrintf(xb[i] / db) : 0;
    }
}

/* ---------------------------------------------------------------- row kernels
 * res[r * MAX_GROUP + t] = row_r . Q(x_t) over K inputs for NR consecutive packed rows and NT
 * quantised tokens: qs[t] int8 in qpos order; dt[MAX_GROUP * b + t] the token's d of block b
 * (transposed, so that one vector multiply makes d * wscale for all the tokens of a block), and
 * after them, at dt + MAX_GROUP * K / 32, the same layout of 12 * (the sum of the block's q). */
typedef void (*rows_fn)(const uint8_t *, const uint8_t *, int, const int8_t *const *,
                        const float *, float *);

static void rows_dot_scalar(const uint8_t *w, const uint8_t *s, int K, const int8_t *const *qs,
                            const float *dt, float *res, int nt) {
    for (int t = 0; t < nt; t++) {
        float acc = 0.0f;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *p = w + 16 * b;
            const int8_t *q = qs[t] + 32 * b;
            int32_t S = 0;
            for (int j = 0; j < 16; j++) S += W8[p[j] & 15] * q[j] + W8[p[j] >> 4] * q[16 + j];
            acc += (float)S * (dt[MAX_GROUP * b + t] * WSCALE[s[b]]);
        }
        res[t] = acc;
    }
}

#ifdef W4_X86
#define INLINE static inline __attribute__((always_inline))
#define AVX2 __attribute__((target("avx2,fma")))

/* Software prefetch PF_BYTES ahead in the group's rows (contiguous: one stream), one line per
 * block, as mxfp4_moe.c's prefetch_ahead. */
enum { PF_BYTES = 8192 };
INLINE void prefetch_ahead(const uint8_t *w, const uint8_t *s, int K, int NR, int b) {
    const size_t span = (size_t)NR * (K / 2), d = span > PF_BYTES ? span : PF_BYTES;
    _mm_prefetch((const char *)(w + d + (size_t)NR * 16 * b), _MM_HINT_T0);
    _mm_prefetch((const char *)(s + d / 16 + (size_t)NR * b), _MM_HINT_T0);
}

INLINE AVX2 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE AVX2 void rows_dot_avx2(const uint8_t *w, const uint8_t *s, int K, const int NR,
                               const int NT, const int8_t *const *qs, const float *dt,
                               float *res) {
    const size_t wb = K / 2, sb = K / 32;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)U8));
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const float *st = dt + MAX_GROUP * sb; /* 12 * sum(q) per block and token */
    float c[4][MAX_GROUP] __attribute__((aligned(32)));
    __m256 acc[MAX_GROUP * 4], corr[4];
#pragma GCC unroll 32
    for (int a = 0; a < NR * NT; a++) acc[a] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) corr[r] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        prefetch_ahead(w, s, K, NR, b);
        __m256i uv[4];
        const __m256 dv = _mm256_load_ps(dt + MAX_GROUP * b);
        const __m256 sv = _mm256_load_ps(st + MAX_GROUP * b);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + r * wb + 16 * b));
            /* low lane: low nibbles (even columns), high lane: high nibbles (odd columns) */
            const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
            uv[r] = _mm256_shuffle_epi8(lut, nib); /* w + 12, unsigned */
            /* fp32(d_t * wscale_r) of every token at once; the offset's share, all tokens */
            const __m256 cv = _mm256_mul_ps(dv, _mm256_broadcast_ss(WSCALE + s[r * sb + b]));
            _mm256_store_ps(c[r], cv);
            corr[r] = _mm256_fmadd_ps(sv, cv, corr[r]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m256i qv = _mm256_load_si256((const __m256i *)(qs[t] + 32 * b));
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                /* (w + 12) * q summed in pairs: at most 2 * 24 * 127, no int16 saturation */
                const __m256i p16 = _mm256_maddubs_epi16(uv[r], qv);
                const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r * NT + t] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&c[r][t]), acc[r * NT + t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        float cr[MAX_GROUP] __attribute__((aligned(32)));
        _mm256_store_ps(cr, corr[r]);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) res[r * MAX_GROUP + t] = hsum256(acc[r * NT + t]) - cr[t];
    }
}

#define ROWS(NR, NT)                                                                            \
    static AVX2 void rows_avx2_##NR##_##NT(const uint8_t *w, const uint8_t *s, int K,           \
                                           const int8_t *const *qs, const float *dt, float *res) { \
        rows_dot_avx2(w, s, K, NR, NT, qs, dt, res);                                            \
    }
/* Register budget (16 ymm): NR * NT accumulators + 2 per row (w and |w|) + a few. */
ROWS(1, 1) ROWS(1, 2) ROWS(1, 3) ROWS(1, 4) ROWS(1, 5) ROWS(1, 6) ROWS(1, 7) ROWS(1, 8)
ROWS(4, 1) ROWS(2, 2) ROWS(2, 3) ROWS(2, 4)

/* [nt] -> the multi-row kernel and its row count; ONE_ROW for the remainder rows. */
static const rows_fn MULTI[MAX_GROUP + 1] = {0,           rows_avx2_4_1, rows_avx2_2_2,
                                             rows_avx2_2_3, rows_avx2_2_4, rows_avx2_1_5,
                                             rows_avx2_1_6, rows_avx2_1_7, rows_avx2_1_8};
static const int MULTI_NR[MAX_GROUP + 1] = {0, 4, 2, 2, 2, 1, 1, 1, 1};
static const rows_fn ONE_ROW[MAX_GROUP + 1] = {0,           rows_avx2_1_1, rows_avx2_1_2,
                                               rows_avx2_1_3, rows_avx2_1_4, rows_avx2_1_5,
                                               rows_avx2_1_6, rows_avx2_1_7, rows_avx2_1_8};
#endif /* W4_X86 */

/* ---------------------------------------------------------------- row loops */

/* For rows r in [r0, r1) of a packed matrix with K inputs and n quantised tokens:
 * alpha == NULL: dst[t][r] = row_r . Q(x_t);  else dst[t][r] += alpha[t] * (row_r . Q(x_t)).
 * dt: the thread's scratch of 2 * MAX_GROUP * K / 32 floats, 32-byte aligned. */
static void rows_dot(const uint8_t *w, const uint8_t *s, int K, int r0, int r1, int n,
                     const int8_t *const *qs, const float *const *ds, float *const *dst,
                     const float *alpha, float *dt) {
    float res[4 * MAX_GROUP];
    for (int g = 0; g < n; g += MAX_GROUP) {
        const int nt = n - g < MAX_GROUP ? n - g : MAX_GROUP;
        for (int b = 0; b < K / 32; b++)
            for (int t = 0; t < MAX_GROUP; t++) {
                dt[MAX_GROUP * b + t] = t < nt ? ds[g + t][b] : 0.0f;
                int sum = 0;
                for (int i = 0; t < nt && i < 32; i++) sum += qs[g + t][32 * b + i];
                dt[MAX_GROUP * (K / 32 + b) + t] = (float)(W_OFF * sum);
            }
        for (int r = r0; r < r1;) {
            const uint8_t *wr = w + (size_t)r * (K / 2);
            const uint8_t *sr = s + (size_t)r * (K / 32);
            int nr = 1;
#ifdef W4_X86
            if (g_isa == ISA_AVX2) {
                nr = MULTI_NR[nt] <= r1 - r ? MULTI_NR[nt] : 1;
                (nr > 1 ? MULTI : ONE_ROW)[nt](wr, sr, K, qs + g, dt, res);
            } else
#endif
                rows_dot_scalar(wr, sr, K, qs + g, dt, res, nt);
            for (int i = 0; i < nr; i++)
                for (int t = 0; t < nt; t++) {
                    const float v = res[i * MAX_GROUP + t];
                    if (alpha)
                        dst[g + t][r + i] += alpha[g + t] * v;
                    else
                        dst[g + t][r + i] = v;
                }
            r += nr;
        }
    }
}

/* Row t of x (fp32, or bf16 bits when x_bf16) to fp32 in buf. */
static const float *row_f32(const void *x, int x_bf16, int t, int K, float *buf) {
    if (!x_bf16) return (const float *)x + (size_t)t * K;
    const uint16_t *xb = (const uint16_t *)x + (size_t)t * K;
    for (int c = 0; c < K; c++) buf[c] = bf16_to_f32(xb[c]);
    return buf;
}

/* ---------------------------------------------------------------- entry points */

/* out[t, r] = row_r . Q(x_t): x [T, K] fp32 (x_bf16 = 0) or bf16 bits, w [R, K/2], s [R, K/32],
 * out [T, R] fp32. One quantised product, the building block of the experts forward (exposed for
 * tests and for dense MXFP4 layers). Returns 0, or -1 if memory ran out. */
int w4_linear(const void *x, int x_bf16, int T, int K, const uint8_t *w, const uint8_t *s, int R,
              float *out, int nthreads) {
    if (g_isa < 0) w4_set_isa(-1);
    int8_t *xq = aligned_alloc(32, (size_t)T * K + 32);
    float *xd = malloc(sizeof(float) * ((size_t)T * (K / 32) + 1));
    /* per thread: a row of x in fp32, then the transposed d's of a token group (rows_dot) */
    const size_t per_thread = (size_t)K + 2 * MAX_GROUP * (K / 32);
    float *buf = aligned_alloc(32, sizeof(float) * nthreads * per_thread);
    const int8_t **qs = malloc(sizeof(int8_t *) * (T + 1));
    const float **ds = malloc(sizeof(float *) * (T + 1));
    float **dst = malloc(sizeof(float *) * (T + 1));
    int rc = -1;
    if (!xq || !xd || !buf || !qs || !ds || !dst) goto done;
    for (int t = 0; t < T; t++) {
        qs[t] = xq + (size_t)t * K;
        ds[t] = xd + (size_t)t * (K / 32);
        dst[t] = out + (size_t)t * R;
    }
    enum { CHUNK = 128 };
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        float *mine = buf + (size_t)omp_get_thread_num() * per_thread;
#else
        float *mine = buf;
#endif
        float *dt = mine + K;
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            quantise(row_f32(x, x_bf16, t, K, mine), K, xq + (size_t)t * K,
                     xd + (size_t)t * (K / 32));
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < (R + CHUNK - 1) / CHUNK; c++) {
            const int r0 = c * CHUNK, r1 = r0 + CHUNK < R ? r0 + CHUNK : R;
            rows_dot(w, s, K, r0, r1, T, qs, ds, dst, NULL, dt);
        }
    }
    rc = 0;
done:
    free(xq); free(xd); free(buf); free(qs); free(ds); free(dst);
    return rc;
}

/* The routed-experts forward over this rank's experts [emin, emin + E), quantised activations.
 *   x [T, H] fp32 (x_bf16 = 0) or bf16 bits (x_bf16 = 1); ids [T, k] int32 global expert ids;
 *   tw [T, k] fp32 router weights; out [T, H] fp32, fully written. Returns 0, or -1 if memory
 *   ran out. */
int w4_moe_forward(const void *x, int x_bf16, int T, int H, int I, int k, const int32_t *ids,
                   const float *tw, int emin, int E, const uint8_t *w13, const uint8_t *s13,
                   const uint8_t *w2, const uint8_t *s2, float *out, int nthreads) {
    if (g_isa < 0) w4_set_isa(-1);
    const int nroutes = T * k;
    /* Group the routes by expert (counting sort, tokens ascending within an expert). */
    int *start = calloc(E + 1, sizeof(int));
    int *fill = malloc(sizeof(int) * (E + 1));
    int *route_tok = malloc(sizeof(int) * (nroutes + 1));
    float *route_w = malloc(sizeof(float) * (nroutes + 1));
    int *touched = malloc(sizeof(int) * (E + 1));
    int8_t *xq = aligned_alloc(32, (size_t)T * H + 32);
    float *xd = malloc(sizeof(float) * ((size_t)T * (H / 32) + 1));
    const size_t per_thread = (size_t)H + 2 * MAX_GROUP * ((H > I ? H : I) / 32);
    float *buf = aligned_alloc(32, sizeof(float) * nthreads * per_thread);
    int rc = -1;
    if (!start || !fill || !route_tok || !route_w || !touched || !xq || !xd || !buf) goto done0;
    for (int r = 0; r < nroutes; r++) {
        const int e = ids[r] - emin;
        if (e >= 0 && e < E) start[e + 1]++;
    }
    int ntouched = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1] > 0) touched[ntouched++] = e;
        start[e + 1] += start[e];
        fill[e] = start[e];
    }
    const int R = start[E];
    for (int r = 0; r < nroutes; r++) {
        const int e = ids[r] - emin;
        if (e >= 0 && e < E) {
            route_tok[fill[e]] = r / k;
            route_w[fill[e]++] = tw[r];
        }
    }
    float *h = malloc(sizeof(float) * ((size_t)R * 2 * I + 1));
    int8_t *aq = aligned_alloc(32, (size_t)R * I + 32);
    float *ad = malloc(sizeof(float) * ((size_t)R * (I / 32) + 1));
    const int8_t **xqs = malloc(sizeof(int8_t *) * (R + 1));
    const float **xds = malloc(sizeof(float *) * (R + 1));
    const int8_t **aqs = malloc(sizeof(int8_t *) * (R + 1));
    const float **ads = malloc(sizeof(float *) * (R + 1));
    float **hd = malloc(sizeof(float *) * (R + 1));
    float **od = malloc(sizeof(float *) * (R + 1));
    if (!h || !aq || !ad || !xqs || !xds || !aqs || !ads || !hd || !od) goto done1;
    for (int j = 0; j < R; j++) {
        xqs[j] = xq + (size_t)route_tok[j] * H;
        xds[j] = xd + (size_t)route_tok[j] * (H / 32);
        aqs[j] = aq + (size_t)j * I;
        ads[j] = ad + (size_t)j * (I / 32);
        hd[j] = h + (size_t)j * 2 * I;
        od[j] = out + (size_t)route_tok[j] * H;
    }

    /* Work items of contiguous rows (common.h's item_rows: a multiple of 32, so an item
     * quantises whole blocks of act), taken dynamically, as in mxfp4_moe.c. */
    const int c13 = item_rows(H / 2, I, 1), c2 = item_rows(I / 2, H, nthreads);
    const int ci = (I + c13 - 1) / c13, ch = (H + c2 - 1) / c2;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        float *mine = buf + (size_t)omp_get_thread_num() * per_thread;
#else
        float *mine = buf;
#endif
        float *dt = mine + H;
        /* x quantised per token; the output starts at zero */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            quantise(row_f32(x, x_bf16, t, H, mine), H, xq + (size_t)t * H,
                     xd + (size_t)t * (H / 32));
            memset(out + (size_t)t * H, 0, sizeof(float) * H);
        }
        /* implicit barrier: xq is complete */

        /* item (expert q, chunk c): gate and up rows [i0, i1) of expert q, then act = silu(gate)
         * * up for them, quantised per block of 32 (the chunk holds whole blocks) */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < ntouched * ci; item++) {
            const int e = touched[item / ci], j0 = start[e], n = start[e + 1] - j0;
            const int i0 = (item % ci) * c13, i1 = i0 + c13 < I ? i0 + c13 : I;
            const uint8_t *we = w13 + (size_t)e * 2 * I * (H / 2);
            const uint8_t *se = s13 + (size_t)e * 2 * I * (H / 32);
            rows_dot(we, se, H, i0, i1, n, xqs + j0, xds + j0, hd + j0, NULL, dt);
            rows_dot(we, se, H, I + i0, I + i1, n, xqs + j0, xds + j0, hd + j0, NULL, dt);
            for (int j = j0; j < j0 + n; j++) {
                float *a = hd[j] + i0; /* act overwrites gate in place (i1 - i0: whole blocks) */
                silu_mul_row(a, hd[j] + I + i0, i1 - i0, a);
                quantise(a, i1 - i0, aq + (size_t)j * I + i0, ad + (size_t)j * (I / 32) + i0 / 32);
            }
        }
        /* implicit barrier: act is complete */

        /* item c: output columns [r0, r1) of every touched expert, so that no two threads add
         * into the same output element */
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < ch; c++) {
            const int r0 = c * c2, r1 = r0 + c2 < H ? r0 + c2 : H;
            for (int q = 0; q < ntouched; q++) {
                const int e = touched[q], j0 = start[e], n = start[e + 1] - j0;
                rows_dot(w2 + (size_t)e * H * (I / 2), s2 + (size_t)e * H * (I / 32), I, r0, r1,
                         n, aqs + j0, ads + j0, od + j0, route_w + j0, dt);
            }
        }
    }
    rc = 0;
done1:
    free(h); free(aq); free(ad); free(xqs); free(xds); free(aqs); free(ads); free(hd); free(od);
done0:
    free(start); free(fill); free(route_tok); free(route_w); free(touched);
    free(xq); free(xd); free(buf);
    return rc;
}
