/* Routed MoE experts straight from the packed MXFP4 serving layout (CPU).
 *
 * Layout (one MoE layer, stacked over this rank's E local experts):
 *   w13 [E, 2I, H/2] uint8  E2M1 codes, two per byte, LOW nibble = even input column;
 *                           each expert's rows are [gate (I rows); up (I rows)].
 *   s13 [E, 2I, H/32] uint8 E8M0 scales, 2^(byte-127), one per 32 consecutive inputs.
 *   w2  [E, H, I/2], s2 [E, H, I/32]: the down projection, same encoding.
 * out[t] = sum over routes (t, j) whose expert is local of
 *          weight[t, j] * down(silu(gate(x_t)) * up(x_t)), accumulated in fp32.
 *
 * Why it is shaped like this:
 * - Decode is memory bound: each touched expert's packed rows are read ONCE for all the tokens
 *   routed to it (tokens are grouped by expert first), and a row is unpacked in registers, never
 *   written out. Bytes read ~ packed bytes of the touched experts. Rows are short (3 KiB), so
 *   the next rows are prefetched in software (prefetch_ahead).
 * - Unpacking (AVX2): E2M1 times a power-of-two scale is exact in bf16, so two 16-entry byte
 *   tables per scale byte (the bf16's high and low bytes) turn a block's 32 nibbles into 32 bf16
 *   values with two vpshufb, and a shift or a mask makes each fp32 (block_values). The values
 *   come out in a fixed shuffled order, so the activations are permuted once per call to match
 *   ("xp" order, xp_pos) instead of reordering every decoded weight. This replaced vpermps on an
 *   8-entry table (plus the sign xor-ed in), 1.2-1.4x slower here (AMD EPYC, bench kernels).
 *   AVX-512F (when the CPU has it) uses a 16-entry signed fp32 table per zmm and vpermps.
 * - Decoded weights are exact (an E2M1 value has 2 significant bits; a power-of-two scale is
 *   exact, scale byte 0 = 2^-127 gives exact subnormals, byte 255 is NaN), so results differ
 *   from "decode to fp32 then GEMM" only by the order of the fp32 additions.
 * - AVX512-BF16 (+ BW, VBMI), gate/up with bf16 x (decode's activations): the weights are exact
 *   in bf16 too and a bf16 x bf16 product is exact in fp32, so vdpbf16ps (32 products, fp32
 *   sums) gives the same result up to the order of additions, with half the decode work and half
 *   the multiply instructions per weight (row kernel 1.4x the fp32 one here, Zen 4, 4 rows x 4
 *   tokens). But it reads denormal inputs as zero and flushes denormal results whatever MXCSR
 *   says, so it runs only where neither can occur (bf16_exact: a range check of the rows' scale
 *   bytes against x's smallest exponent), the fp32 kernels elsewhere. fp32 x is never rounded to
 *   bf16, and the down projection keeps its fp32 input: both stay on the fp32 kernels.
 * - Several rows x several tokens per kernel call (register blocking); with more than 2 tokens
 *   the inputs go by column chunks that keep x in L1.
 * - Threads (OpenMP, same libgomp soname as torch's, so the loader reuses torch's copy and one
 *   runtime serves both): work items of 64 rows taken dynamically, two barriers per call.
 * - The fast functions carry target attributes and are picked at run time (__builtin_cpu_
 *   supports); a portable scalar path computes the same thing; no -march flag is needed.
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
#define MX_X86 1
#endif
#include "amx.h"

/* ISA_AMX: ISA_AVX512BF16's kernels, with w13 (bf16 x) on AMX-BF16 tiles (w13_amx) */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, NISA = 4, ISA_AMX = 4 };
enum { MAX_GROUP = 8 }; /* tokens whose accumulators stay in registers while a row streams by */

/* Tokens per group: AVX-512 does 4 rows x 4 tokens (16 accumulators, each x load feeds 4 FMAs)
 * faster than 2 rows x 8 tokens, which loads x twice as often. */
static const int GROUP[NISA] = {MAX_GROUP, MAX_GROUP, 4, 4};
static float SCALE[256]; /* E8M0 byte -> 2^(byte-127); 0 -> 2^-127 (subnormal); 255 -> NaN */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static int g_isa = -1;

/* Per scale byte, the unpacking tables with the scale already applied (a load per block instead
 * of a multiply and an xor; 8 + 16 KiB, of which the few bytes real scales use stay in L1):
 * LUT16[b][i] = E2M1[i] * SCALE[b] (AVX-512: codes with their sign), and LUT8[b][i] =
 * |E2M1[i]| * SCALE[b] with (i << 28) xor-ed into its bits (AVX2: see nib_values). */
static float LUT16[256][16] __attribute__((aligned(64)));
static float LUT8[256][8] __attribute__((aligned(32)));
/* AVX2 row kernels: E2M1[i] * SCALE[b] is exact in bf16 (2 significant bits; subnormals and NaN
 * included), so per scale byte two 16-entry byte tables (its high and low bytes, each repeated
 * for both 128-bit lanes) turn 32 nibbles into 32 bf16 values with two vpshufb; fp32 is then a
 * shift or a mask. vpshufb is one cheap uop where vpermps is not (two on Zen 2). */
static uint8_t BF_HI[256][32] __attribute__((aligned(32)));
static uint8_t BF_LO[256][32] __attribute__((aligned(32)));
/* AVX512-BF16 row kernels: per scale byte the 16 values as bf16 words, twice (vpermw reads 5
 * index bits, of which block_bf16 sets only the low 4). */
static uint16_t BFW[256][32] __attribute__((aligned(64)));
/* w13 rows computed by the bf16 kernels and by the fp32 ones (mx_w13_rows): how the tests see
 * which path ran. */
static int64_t g_w13_rows[2];
static int64_t g_amx_rows; /* of the bf16 ones, those on the AMX tiles */

static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        uint32_t bits = b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : (uint32_t)b << 23;
        memcpy(&SCALE[b], &bits, 4);
        for (int i = 0; i < 16; i++) LUT16[b][i] = E2M1[i] * SCALE[b];
        for (int i = 0; i < 8; i++) {
            const float v = E2M1[i] * SCALE[b];
            uint32_t u;
            memcpy(&u, &v, 4);
            u ^= (uint32_t)i << 28;
            memcpy(&LUT8[b][i], &u, 4);
        }
        for (int i = 0; i < 32; i++) {
            uint32_t u;
            memcpy(&u, &LUT16[b][i % 16], 4);
            BF_HI[b][i] = (uint8_t)(u >> 24);
            BF_LO[b][i] = (uint8_t)(u >> 16);
            BFW[b][i] = (uint16_t)(u >> 16);
        }
    }
}

static int best_isa(void) {
#ifdef MX_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        if (!(__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
              __builtin_cpu_supports("avx512bf16")))
            return ISA_AVX512;
        return amx_here(AMX_BF16) ? ISA_AMX : ISA_AVX512BF16;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* Select the code path: -1 = best the CPU supports; a request above that is lowered.
 * Returns the path in use (0 scalar, 1 AVX2+FMA, 2 AVX-512F, 3 AVX-512F with the AVX512-BF16 w13
 * kernels, 4 the same with w13 on AMX-BF16 tiles). Not thread safe: call before use. */
int mx_set_isa(int isa) {
    int best = best_isa();
    if (SCALE[1] == 0.0f) init_tables();
    g_isa = (isa < 0 || isa > best) ? best : isa;
    return g_isa;
}

/* ---------------------------------------------------------------- row kernels
 * A row kernel computes res[r * MAX_GROUP + t] = row_r . xs[t] over K inputs for NR packed rows
 * ld inputs apart (ld >= K: a column chunk of longer rows) and NT tokens (xs in xp order).
 * Several rows at once amortise the per-row tail (reductions, stores, the call) and let one
 * load of x feed NR FMAs; NA accumulators per (row, token) keep enough independent FMA chains
 * in flight when NR * NT is small. */
typedef void (*rows_fn)(const uint8_t *, const uint8_t *, int, int, const void *const *,
                        float *);

static void rows_dot_scalar(const uint8_t *w, const uint8_t *s, int K, const float *const *xs,
                            float *res, int nt) {
    for (int t = 0; t < nt; t++) res[t] = 0.0f;
    for (int b = 0; b < K / 32; b++) {
        const float sc = SCALE[s[b]];
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = w + 16 * b + 8 * h;
            const int base = 32 * b + 16 * h;
            for (int t = 0; t < nt; t++) {
                const float *x = xs[t] + base;
                float a = 0.0f;
                for (int i = 0; i < 8; i++)
                    a += E2M1[p[i] & 15] * sc * x[i] + E2M1[p[i] >> 4] * sc * x[8 + i];
                res[t] += a;
            }
        }
    }
}

#ifdef MX_X86
#define INLINE static inline __attribute__((always_inline))
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16,avx2,fma")))

/* Software prefetch, PF_BYTES ahead (at least one group of rows ahead). Rows are short (3 KiB
 * for GLM-5's w13, 256 B for the small model's w2), too short for the hardware streamer to ramp
 * up on each: without this one AVX-512 thread read 5.1 GB/s of GLM-5 experts, with it 9.3
 * (torch.sum: 13.6). When the NR rows are contiguous (ld == K) the group's bytes are one stream
 * and the prefetch runs ahead in it, one line per block; for a column chunk (ld > K) the next
 * group's rows get a line each per block, in turn. */
enum { PF_BYTES = 8192 }; /* 2, 8, 16 and 32 KiB measured alike */
INLINE void prefetch_ahead(const uint8_t *w, const uint8_t *s, int K, int ld, int NR, int b) {
    if (K == ld) {
        const size_t span = (size_t)NR * (K / 2), d = span > PF_BYTES ? span : PF_BYTES;
        for (int o = 0; o < NR * 16; o += 64) /* the NR rows' bytes of a block: NR * 16 */
            _mm_prefetch((const char *)(w + d + (size_t)NR * 16 * b + o), _MM_HINT_T0);
        _mm_prefetch((const char *)(s + d / 16 + (size_t)NR * b), _MM_HINT_T0);
    } else {
        const size_t r = NR + b % NR, line = 64 * (b / NR);
        _mm_prefetch((const char *)(w + r * (ld / 2) + line), _MM_HINT_T0);
        _mm_prefetch((const char *)(s + r * (ld / 32) + line), _MM_HINT_T0);
    }
}

/* ----- AVX2 + FMA: an 8-entry table of magnitudes per block, indexed with vpermps. */

INLINE AVX2 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 8 values of one nibble per byte of c (bytes zero-extended to 32-bit lanes). `lut` holds
 * scale * |E2M1[i]| with (i << 28) xor-ed in; xor-ing (nibble << 28) back removes that and
 * leaves the nibble's bit 3 on the sign bit: a lookup and a sign in two cheap ops. */
INLINE AVX2 __m256 nib_values(__m256 lut, __m256i nib) {
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, nib),
                         _mm256_castsi256_ps(_mm256_slli_epi32(nib, 28)));
}

INLINE AVX2 __m256 block_lut(const uint8_t *s, int b) { return _mm256_load_ps(LUT8[s[b]]); }

/* The 32 weights of one block as 4 x 8 fp32: bytes j of the block hold columns 2j (low nibble)
 * and 2j + 1 (high); lane 0 of v gets the low nibbles, lane 1 the high ones; the bf16 tables give
 * each nibble's value as a 16-bit word (unpack), and a shift or a mask puts a word in the high
 * half of its 32-bit lane. Columns of f[q] (xp order, groups of 32; xp_pos below):
 * f0 [0 4 8 12 | 1 5 9 13], f1 [2 6 10 14 | 3 7 11 15], f2 and f3 the same + 16. */
INLINE AVX2 void block_values(const uint8_t *w, uint8_t s, __m256 f[4]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)w);
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                         _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)BF_HI[s]), nib);
    const __m256i lo = _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)BF_LO[s]), nib);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, top));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, top));
}

INLINE AVX2 void rows_dot_avx2(const uint8_t *w, const uint8_t *s, int K, int ld, const int NR,
                               const int NT, const int NA, const float *const *xs, float *res) {
    const size_t wb = ld / 2, sb = ld / 32;
    __m256 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < NR * NT * NA; a++) acc[a] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        prefetch_ahead(w, s, K, ld, NR, b);
        __m256 f[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) block_values(w + r * wb + 16 * b, s[r * sb + b], f[r]);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const __m256 xv = _mm256_loadu_ps(xs[t] + 32 * b + 8 * q);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    __m256 *a = acc + (r * NT + t) * NA + q % NA;
                    *a = _mm256_fmadd_ps(f[r][q], xv, *a);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m256 *a = acc + (r * NT + t) * NA;
            __m256 v = a[0];
#pragma GCC unroll 4
            for (int i = 1; i < NA; i++) v = _mm256_add_ps(v, a[i]);
            res[r * MAX_GROUP + t] = hsum256(v);
        }
}

/* ----- AVX-512F: vpermps on a zmm indexes 16 entries, so one table holds the signed codes: per
 * 32 inputs one widening, two permutes and a shift (half the AVX2 work) and FMAs twice as wide.
 * xp order with groups of 32: the block's 16 even inputs, then its 16 odd ones. */

INLINE AVX512 __m512 block_lut512(const uint8_t *s, int b) {
    return _mm512_load_ps(LUT16[s[b]]);
}

INLINE AVX512 void rows_dot_avx512(const uint8_t *w, const uint8_t *s, int K, int ld, const int NR,
                                   const int NT, const int NA, const float *const *xs,
                                   float *res) {
    const size_t wb = ld / 2, sb = ld / 32;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < NR * NT * NA; a++) acc[a] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        prefetch_ahead(w, s, K, ld, NR, b);
        __m512 lo[4], hi[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m512 lut = block_lut512(s + r * sb, b);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + r * wb + 16 * b));
            const __m512i c = _mm512_cvtepu8_epi32(bytes);
            lo[r] = _mm512_permutexvar_ps(c, lut); /* uses bits 3:0: the low nibble */
            hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const __m512 xl = _mm512_loadu_ps(xs[t] + 32 * b);
            const __m512 xh = _mm512_loadu_ps(xs[t] + 32 * b + 16);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                __m512 *a = acc + (r * NT + t) * NA;
                a[0] = _mm512_fmadd_ps(lo[r], xl, a[0]);
                a[NA - 1] = _mm512_fmadd_ps(hi[r], xh, a[NA - 1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m512 *a = acc + (r * NT + t) * NA;
            const __m512 v = NA > 1 ? _mm512_add_ps(a[0], a[1]) : a[0];
            res[r * MAX_GROUP + t] = _mm512_reduce_add_ps(v);
        }
}

/* ----- AVX512-BF16 (+ BW, VBMI; w13 with bf16 x only, where bf16_exact says so): per block a
 * broadcast load, one vpmultishiftqb and one vpermw on a 32-word table per scale byte give the 32
 * weights as bf16, and one vdpbf16ps per block and token does 32 products (the fp32 path: a
 * widening, two permutes, a shift and two FMAs). With vpmovzxbd + shift + or instead of the
 * broadcast + multishift (no VBMI needed) the row kernel ran ~10% slower here (Zen 4).
 * xb order, in each block of 32: position 8L + 4h + m holds column 16h + 4L + m (xb_pos). */

/* The block's 16 bytes in each 128-bit lane: qword 2L + h of the vector holds its bytes 8h..8h+7
 * (columns 16h..16h+15, 4 bits each), and the multishift puts columns 16h + 4L + m (m = 0..3) at
 * the low bits of its words m; vpermw reads bits 4:0 of each word, so the table holds the 16
 * values twice (bit 4 is the next column's bit 0). */
INLINE AVX512BF16 __m512i block_bf16(const uint8_t *w, uint8_t s) {
#define SHIFTS(L) (16LL * L | (16LL * L + 4) << 16 | (16LL * L + 8) << 32 | (16LL * L + 12) << 48)
    const __m512i ctl = _mm512_set_epi64(SHIFTS(3), SHIFTS(3), SHIFTS(2), SHIFTS(2), SHIFTS(1),
                                         SHIFTS(1), SHIFTS(0), SHIFTS(0));
#undef SHIFTS
    const __m512i src = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w));
    return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(ctl, src),
                                    _mm512_load_si512(BFW[s]));
}

INLINE AVX512BF16 void bf16_block(const uint8_t *w, const uint8_t *s, size_t wb, size_t sb,
                                  int b, const int NR, const int NT, const int NA, const int u,
                                  const uint16_t *const *xs, __m512 *acc) {
    __m512i wv[8];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) wv[r] = block_bf16(w + r * wb + 16 * b, s[r * sb + b]);
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m512i xv = _mm512_loadu_si512(xs[t] + 32 * b);
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            __m512 *a = acc + (r * NT + t) * NA + u;
            *a = _mm512_dpbf16_ps(*a, (__m512bh)wv[r], (__m512bh)xv);
        }
    }
}

INLINE AVX512BF16 void rows_dot_bf16(const uint8_t *w, const uint8_t *s, int K, int ld,
                                     const int NR, const int NT, const int NA,
                                     const uint16_t *const *xs, float *res) {
    const size_t wb = ld / 2, sb = ld / 32;
    const int nb = K / 32;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < NR * NT * NA; a++) acc[a] = _mm512_setzero_ps();
    int b = 0;
    for (; b + NA <= nb; b += NA) /* NA blocks in turn, each into its own accumulators */
#pragma GCC unroll 4
        for (int u = 0; u < NA; u++) {
            prefetch_ahead(w, s, K, ld, NR, b + u);
            bf16_block(w, s, wb, sb, b + u, NR, NT, NA, u, xs, acc);
        }
    for (; b < nb; b++) bf16_block(w, s, wb, sb, b, NR, NT, NA, 0, xs, acc);
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m512 *a = acc + (r * NT + t) * NA, v = a[0];
#pragma GCC unroll 4
            for (int i = 1; i < NA; i++) v = _mm512_add_ps(v, a[i]);
            res[r * MAX_GROUP + t] = _mm512_reduce_add_ps(v);
        }
}

#define ROWS(ISA, NR, NT, NA)                                                                \
    static ISA##_T void rows_##ISA##_##NR##_##NT(const uint8_t *w, const uint8_t *s, int K,    \
                                                 int ld, const void *const *xs, float *res) {  \
        rows_dot_##ISA(w, s, K, ld, NR, NT, NA, (const ISA##_X *const *)xs, res);              \
    }
#define avx2_T AVX2
#define avx512_T AVX512
#define bf16_T AVX512BF16
#define avx2_X float
#define avx512_X float
#define bf16_X uint16_t
/* Register budget: AVX2 has 16 ymm, AVX-512 32 zmm; NR * NT * NA <= 16 accumulators. */
ROWS(avx2, 1, 1, 4) ROWS(avx2, 2, 1, 2) ROWS(avx2, 1, 2, 2) ROWS(avx2, 2, 2, 1)
ROWS(avx2, 1, 3, 2) ROWS(avx2, 1, 4, 2) ROWS(avx2, 1, 5, 1) ROWS(avx2, 1, 6, 1)
ROWS(avx2, 1, 7, 1) ROWS(avx2, 1, 8, 1)
ROWS(avx512, 1, 1, 2) ROWS(avx512, 4, 1, 2) ROWS(avx512, 1, 2, 2) ROWS(avx512, 4, 2, 2)
ROWS(avx512, 1, 3, 1) ROWS(avx512, 4, 3, 1) ROWS(avx512, 1, 4, 1) ROWS(avx512, 4, 4, 1)
ROWS(avx512, 1, 5, 1) ROWS(avx512, 2, 5, 1) ROWS(avx512, 1, 6, 1) ROWS(avx512, 2, 6, 1)
ROWS(avx512, 1, 7, 1) ROWS(avx512, 2, 7, 1) ROWS(avx512, 1, 8, 1) ROWS(avx512, 2, 8, 1)
ROWS(bf16, 1, 1, 4) ROWS(bf16, 8, 1, 2) ROWS(bf16, 1, 2, 2) ROWS(bf16, 4, 2, 2)
ROWS(bf16, 1, 3, 2) ROWS(bf16, 4, 3, 1) ROWS(bf16, 1, 4, 2) ROWS(bf16, 4, 4, 1)

/* [isa][nt] -> the multi-row kernel and its row count; ONE_ROW for the remainder rows. */
static const rows_fn MULTI[NISA][MAX_GROUP + 1] = {
    {0},
    {0, rows_avx2_2_1, rows_avx2_2_2, rows_avx2_1_3, rows_avx2_1_4, rows_avx2_1_5, rows_avx2_1_6,
     rows_avx2_1_7, rows_avx2_1_8},
    {0, rows_avx512_4_1, rows_avx512_4_2, rows_avx512_4_3, rows_avx512_4_4, rows_avx512_2_5,
     rows_avx512_2_6, rows_avx512_2_7, rows_avx512_2_8},
    {0, rows_bf16_8_1, rows_bf16_4_2, rows_bf16_4_3, rows_bf16_4_4}};
static const int MULTI_NR[NISA][MAX_GROUP + 1] = {
    {0}, {0, 2, 2, 1, 1, 1, 1, 1, 1}, {0, 4, 4, 4, 4, 2, 2, 2, 2}, {0, 8, 4, 4, 4}};
static const rows_fn ONE_ROW[NISA][MAX_GROUP + 1] = {
    {0},
    {0, rows_avx2_1_1, rows_avx2_1_2, rows_avx2_1_3, rows_avx2_1_4, rows_avx2_1_5, rows_avx2_1_6,
     rows_avx2_1_7, rows_avx2_1_8},
    {0, rows_avx512_1_1, rows_avx512_1_2, rows_avx512_1_3, rows_avx512_1_4, rows_avx512_1_5,
     rows_avx512_1_6, rows_avx512_1_7, rows_avx512_1_8},
    {0, rows_bf16_1_1, rows_bf16_1_2, rows_bf16_1_3, rows_bf16_1_4}};

/* One packed row -> K fp32 values in natural column order. */
static AVX2 void decode_row_avx2(const uint8_t *w, const uint8_t *s, int K, float *out) {
    for (int b = 0; b < K / 32; b++) {
        const __m256 lut = block_lut(s, b);
        for (int h = 0; h < 2; h++) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(w + 16 * b + 8 * h));
            const __m256i c = _mm256_cvtepu8_epi32(bytes);
            __m256 lo = nib_values(lut, c);                           /* columns 0, 2, .., 14 */
            __m256 hi = nib_values(lut, _mm256_srli_epi32(c, 4));     /* columns 1, 3, .., 15 */
            __m256 a = _mm256_unpacklo_ps(lo, hi);                    /* 0 1 2 3 | 8 9 10 11 */
            __m256 d = _mm256_unpackhi_ps(lo, hi);                    /* 4 5 6 7 | 12 .. 15 */
            float *o = out + 32 * b + 16 * h;
            _mm256_storeu_ps(o, _mm256_permute2f128_ps(a, d, 0x20));
            _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(a, d, 0x31));
        }
    }
}

static AVX512 void decode_row_avx512(const uint8_t *w, const uint8_t *s, int K, float *out) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int b = 0; b < K / 32; b++) {
        const __m512 lut = block_lut512(s, b);
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * b)));
        __m512 lo = _mm512_permutexvar_ps(c, lut);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut);
        _mm512_storeu_ps(out + 32 * b, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

/* 32 * k values in natural column order -> xp order (AVX-512: in each 32, the even columns,
 * then the odd ones) */
static AVX512 void xp_order_avx512(const float *src, int cols, float *dst) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int c = 0; c < cols; c += 32) {
        const __m512 a = _mm512_loadu_ps(src + c), b = _mm512_loadu_ps(src + c + 16);
        _mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(a, odd, b));
    }
}
#endif /* MX_X86 */

static void decode_row_scalar(const uint8_t *w, const uint8_t *s, int K, float *out) {
    for (int i = 0; i < K / 2; i++) {
        const float sc = SCALE[s[i / 16]];
        out[2 * i] = E2M1[w[i] & 15] * sc;
        out[2 * i + 1] = E2M1[w[i] >> 4] * sc;
    }
}

/* ---------------------------------------------------------------- row loops */

/* For rows r in [r0, r1) of a packed matrix with K inputs and n tokens, with the row kernels of
 * `isa` (xs: fp32 in xp order; ISA_AVX512BF16: bf16 in xb order):
 * alpha == NULL: dst[t][r] = row_r . xs[t];  else dst[t][r] += alpha[t] * (row_r . xs[t]).
 * With more than 2 tokens the inputs go by column chunks sized so that one group's chunk of x
 * stays in L1 (otherwise every FMA waits on L2), and within a chunk group by group: the rows'
 * chunk is read from memory by the first group and from L2 by the next ones. */
static void rows_dot(const uint8_t *w, const uint8_t *s, int K, int r0, int r1, int n, int isa,
                     const void *const *xs, float *const *dst, const float *alpha) {
    enum { L1_FLOATS = 6144 }; /* 24 KiB of fp32 x per token group: half of a 48 KiB L1 */
    float res[8 * MAX_GROUP];
    const void *xo[MAX_GROUP];
    const size_t xsize = isa == ISA_AVX512BF16 ? 2 : 4; /* bytes per x element */
    const int group = GROUP[isa], widest = n < group ? n : group;
    int kc_len = K;
    if (widest > 2) {
        kc_len = (L1_FLOATS / widest) & ~63;
        if (kc_len > K) kc_len = K;
    }
    for (int kc = 0; kc < K; kc += kc_len) {
        const int kl = K - kc < kc_len ? K - kc : kc_len;
        for (int g = 0; g < n; g += group) {
            const int nt = n - g < group ? n - g : group;
            for (int t = 0; t < nt; t++) xo[t] = (const char *)xs[g + t] + kc * xsize;
            for (int r = r0; r < r1;) {
                const uint8_t *wr = w + (size_t)r * (K / 2) + kc / 2;
                const uint8_t *sr = s + (size_t)r * (K / 32) + kc / 32;
                int nr = 1;
#ifdef MX_X86
                if (isa != ISA_SCALAR) {
                    nr = MULTI_NR[isa][nt] <= r1 - r ? MULTI_NR[isa][nt] : 1;
                    (nr > 1 ? MULTI : ONE_ROW)[isa][nt](wr, sr, kl, K, xo, res);
                } else
#endif
                    rows_dot_scalar(wr, sr, kl, (const float *const *)xo, res, nt);
                for (int i = 0; i < nr; i++)
                    for (int t = 0; t < nt; t++) {
                        const float v = res[i * MAX_GROUP + t];
                        if (alpha)
                            dst[g + t][r + i] += alpha[g + t] * v;
                        else if (kc == 0)
                            dst[g + t][r + i] = v;
                        else
                            dst[g + t][r + i] += v;
                    }
                r += nr;
            }
        }
    }
}

/* Natural column c -> its position in xp order. Scalar (G = 16) and AVX-512 (G = 32): in each
 * group of G inputs, the even ones first, then the odd ones. AVX2: in each block of 32, the order
 * block_values makes: position 8q + 4l + e holds column 16 (q >> 1) + 2 (q & 1) + l + 4e. */
static inline int xp_group(void) { return g_isa >= ISA_AVX512 ? 32 : 16; }
static inline int xp_pos(int c, int G) {
    if (g_isa == ISA_AVX2) {
        const int r = c & 15, q = 2 * ((c >> 4) & 1) + ((r & 3) >> 1);
        return (c & ~31) | 8 * q + 4 * (r & 1) + (r >> 2);
    }
    return (c & ~(G - 1)) | ((c & 1) ? G / 2 : 0) | ((c & (G - 1)) >> 1);
}

static inline int xb_pos(int c) {
    return (c & ~31) | (8 * ((c >> 2) & 3) + 4 * ((c >> 4) & 1) + (c & 3));
}

/* dst (xp order) = silu(g) * u over cols columns (a multiple of 32) that start at a multiple of
 * 32, as the w2 kernels read the activations; 128 at a time through a buffer on the stack */
static void silu_mul_xp(const float *g, const float *u, int cols, float *dst, int G) {
    float a[128];
    for (int c0 = 0; c0 < cols; c0 += 128) {
        const int n = cols - c0 < 128 ? cols - c0 : 128;
        silu_mul_row(g + c0, u + c0, n, a);
#ifdef MX_X86
        if (g_isa >= ISA_AVX512) {
            xp_order_avx512(a, n, dst + c0);
            continue;
        }
#endif
        for (int i = 0; i < n; i++) dst[c0 + xp_pos(i, G)] = a[i];
    }
}

/* ---------------------------------------------------------------- when bf16 is exact
 * vdpbf16ps reads denormal inputs as zero and flushes denormal results (whatever MXCSR says), so
 * the bf16 kernels run only where neither can occur, the fp32 kernels everywhere else. With ex
 * the biased exponent of x's smallest nonzero |value| (0: x has a bf16 denormal) and the row's
 * scale bytes in [lo, hi]:
 * - the weights are normal bf16 when lo >= 2 (0.5 * 2^(lo-127) >= 2^-126), not NaN when
 *   hi <= 254, and x has no denormal when ex >= 1;
 * - every product, so every partial sum, is an integer multiple of 2^(lo + ex - 262) (the
 *   smallest weight step 0.5 * 2^(lo-127) times x's 8-bit significand step 2^(ex-127-7)): a
 *   nonzero one is a normal fp32 when lo + ex >= 136.
 * Then every product is exact, as in the fp32 kernels, and the sums differ only in their order
 * (and in vdpbf16ps's one rounding per pair). Real experts (bytes ~110-127) and activations
 * (|x| > 1e-20) are far inside. */
static int x_min_exponent(const uint16_t *x, int H) { /* 255 when x is all zeros */
    int m = 255;
    for (int c = 0; c < H; c++) {
        const int a = x[c] & 0x7FFF, e = a >> 7;
        m = a && e < m ? e : m;
    }
    return m;
}

static int bf16_exact(const uint8_t *s, size_t n, int ex) {
    uint8_t lo = 255, hi = 0;
    for (size_t i = 0; i < n; i++) {
        lo = s[i] < lo ? s[i] : lo;
        hi = s[i] > hi ? s[i] : hi;
    }
    return ex >= 1 && lo >= 2 && lo + ex >= 136 && hi <= 254;
}

/* ---------------------------------------------------------------- w13 on AMX-BF16
 * Where bf16 is exact (above), tdpbf16ps takes 16 rows x 32 weights (A: each row's block
 * unpacked by block_bf16, stored to a 1 KiB buffer) times those 32 inputs x up to 16 tokens (B:
 * the tokens' bf16 x in xb order, dword pairs transposed, packed once a call by amx_pack_rows):
 * 512 products an instruction where vdpbf16ps does 32, so at a few tokens an expert the
 * unpacking is left and the products are not. The same exact products as the AVX512-BF16
 * kernels, summed pair by pair and block after block: another order of the fp32 additions,
 * which for a token depends on how many tokens share its expert (AMX_MIN_TOKENS), not on
 * which. */
/* Tokens an expert needs for its w13 to take the tiles: with one or two the unpacked block's
 * store and tile load cost more than the vdpbf16ps they save (8 experts of the small model's
 * shape, one thread, vdpbf16ps / AMX ms: 1.99 / 2.19 at 1 token, 2.29 / 2.42 at 2, 2.72 / 2.43
 * at 3, 6.51 / 3.62 at 8). So a token's w13 sums come in one order or the other by how many
 * tokens share its expert, as the register kernels' shapes (NA) already make them. */
enum { AMX_MIN_TOKENS = 3 };

#if HAVE_AMX
/* dst[t][r] = row_r . x_t for the w13 rows [r0, r1) and the n tokens packed at xT: 16 rows and
 * 32 tokens a pass (two C tiles share each A), the A buffer double (a tile load waits for the
 * stores before it; the other buffer's are not in its way). */
static AMX_BF16_T void w13_amx(const uint8_t *w, const uint8_t *s, int H, int r0, int r1, int n,
                            const uint16_t *xT, float *const *dst, int *cfg_key) {
    const size_t wb = H / 2, sb = H / 32;
    const int nb = H / 32;
    __m512i abuf[2][16];
    float c[2][16 * 16];
    for (int r = r0; r < r1; r += 16) {
        const int ar = r1 - r < 16 ? r1 - r : 16;
        const uint8_t *wr = w + (size_t)r * wb, *sr = s + (size_t)r * sb;
        /* the next 16 rows are the next bytes: fetch them at this group's pace */
        const char *next = (const char *)(wr + (size_t)ar * wb);
        const size_t pace = (size_t)ar * wb / nb;
        for (int t0 = 0; t0 < n; t0 += 32) {
            const int m0 = n - t0 < 16 ? n - t0 : 16;
            const int m1 = n - t0 - 16 <= 0 ? 0 : (n - t0 - 16 < 16 ? n - t0 - 16 : 16);
            const uint16_t *b0 = xT + (size_t)t0 * H, *b1 = xT + (size_t)(t0 + 16) * H;
            amx_bf16_shape(ar, m0, m1, cfg_key);
            _tile_zero(0);
            if (m1) _tile_zero(1);
            for (int b = 0; b < nb; b++) {
                __m512i *ab = abuf[b & 1];
                if (t0 == 0)
                    for (size_t o = 0; o < pace; o += 64) _mm_prefetch(next + pace * b + o, _MM_HINT_T0);
                for (int j = 0; j < ar; j++)
                    _mm512_store_si512(ab + j, block_bf16(wr + j * wb + 16 * b, sr[j * sb + b]));
                if (b & 1) {
                    _tile_loadd(3, ab, 64);
                    AMX_BF16_BLOCK(3, b0, b1, b, m0, m1);
                } else {
                    _tile_loadd(2, ab, 64);
                    AMX_BF16_BLOCK(2, b0, b1, b, m0, m1);
                }
            }
            AMX_BF16_STORE(c, m0, m1);
            for (int h = 0; h < 2; h++) {
                const int mt = h ? m1 : m0;
                for (int t = 0; t < mt; t++)
                    for (int j = 0; j < ar; j++) dst[t0 + 16 * h + t][r + j] = c[h][j * mt + t];
            }
        }
    }
}
#endif

/* dst[t][r] = row_r . x_t for the w13 rows [r0, r1) of one expert and its n tokens: the bf16
 * kernels (xb: the tokens' bf16 rows, NULL when not on that path; on AMX xT: them packed, cfg:
 * the thread's tile configuration) when bf16_exact holds for all the rows' scale bytes (a range
 * check over 1/16 of the bytes the rows read), else the fp32 kernels of fisa (xs, xp order). */
static void w13_rows(const uint8_t *w, const uint8_t *s, int H, int r0, int r1, int n, int fisa,
                     const float *const *xs, const uint16_t *const *xb, int ex,
                     const uint16_t *xT, int *cfg, float *const *dst) {
    const size_t sb = H / 32;
    const int bf = xb && bf16_exact(s + r0 * sb, (r1 - r0) * sb, ex);
#if HAVE_AMX
    if (bf && xT && n >= AMX_MIN_TOKENS) {
        w13_amx(w, s, H, r0, r1, n, xT, dst, cfg);
        __atomic_fetch_add(&g_amx_rows, r1 - r0, __ATOMIC_RELAXED);
    } else
#endif
        rows_dot(w, s, H, r0, r1, n, bf ? ISA_AVX512BF16 : fisa,
                 bf ? (const void *const *)xb : (const void *const *)xs, dst, NULL);
    (void)xT, (void)cfg;
    __atomic_fetch_add(&g_w13_rows[!bf], r1 - r0, __ATOMIC_RELAXED);
}

/* ---------------------------------------------------------------- entry points */

/* The w13 rows computed since the last call by the bf16 kernels (out[0]), by the fp32 ones
 * (out[1], any ISA) and, of out[0], on the AMX tiles (out[2]); the counts restart at zero. For
 * tests: which path ran. */
void mx_w13_rows(int64_t *out) {
    out[0] = __atomic_exchange_n(&g_w13_rows[0], 0, __ATOMIC_RELAXED);
    out[1] = __atomic_exchange_n(&g_w13_rows[1], 0, __ATOMIC_RELAXED);
    out[2] = __atomic_exchange_n(&g_amx_rows, 0, __ATOMIC_RELAXED);
}

/* act = silu(g) * u over cols (a multiple of 32) columns, in natural order, as the forward
 * computes its activations (silu_mul_xp). For tests. Returns 0, or -1 if memory ran out. */
int mx_silu_mul(const float *g, const float *u, int cols, float *act) {
    if (g_isa < 0) mx_set_isa(-1);
    const int G = xp_group();
    float *tmp = malloc(sizeof(float) * ((size_t)cols + 1));
    if (!tmp) return -1;
    silu_mul_xp(g, u, cols, tmp, G);
    for (int i = 0; i < cols; i++) act[i] = tmp[xp_pos(i, G)];
    free(tmp);
    return 0;
}

/* Decode rows x K of a packed matrix to fp32 (natural order), split over nthreads. */
void mx_decode(const uint8_t *w, const uint8_t *s, int64_t rows, int K, float *out, int nthreads) {
    if (g_isa < 0) mx_set_isa(-1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#ifdef MX_X86
        if (g_isa >= ISA_AVX512) {
            decode_row_avx512(w + r * (K / 2), s + r * (K / 32), K, out + r * K);
            continue;
        }
        if (g_isa == ISA_AVX2) {
            decode_row_avx2(w + r * (K / 2), s + r * (K / 32), K, out + r * K);
            continue;
        }
#endif
        decode_row_scalar(w + r * (K / 2), s + r * (K / 32), K, out + r * K);
    }
}

/* The routed-experts forward over this rank's experts [emin, emin + E).
 *   x [T, H] fp32 (x_bf16 = 0) or bf16 bits (x_bf16 = 1; the AVX512-BF16 path reads it as given
 *   for w13, see bf16_exact); ids [T, k] int32 global expert ids;
 *   tw [T, k] fp32 router weights; out [T, H] fp32, fully written.
 *   Experts with >= skip_min routes are left out (the caller runs them as a GEMM); counts [E]
 *   (may be NULL) receives every local expert's number of routes. Returns 0, or -1 if memory
 *   ran out. */
int mx_moe_forward(const void *x, int x_bf16, int T, int H, int I, int k, const int32_t *ids,
                   const float *tw, int emin, int E, const uint8_t *w13, const uint8_t *s13,
                   const uint8_t *w2, const uint8_t *s2, float *out, int nthreads, int skip_min,
                   int32_t *counts) {
    if (g_isa < 0) mx_set_isa(-1);
    const int G = xp_group(), nroutes = T * k;
    /* fp32 kernels: w2 always, w13 for fp32 x or where bf16 would not be exact */
    const int fisa = g_isa >= ISA_AVX512BF16 ? ISA_AVX512 : g_isa;
    const int bf = g_isa >= ISA_AVX512BF16 && x_bf16, amx = bf && g_isa == ISA_AMX;
    int32_t *own_counts = counts ? NULL : malloc(sizeof(int32_t) * (E + 1));
    if (!counts) counts = own_counts;
    if (!counts) return -1;
    memset(counts, 0, sizeof(int32_t) * E);
    for (int r = 0; r < nroutes; r++) {
        const int e = ids[r] - emin;
        if (e >= 0 && e < E) counts[e]++;
    }
    /* Group the routes by expert (counting sort, tokens ascending within an expert). */
    int *start = malloc(sizeof(int) * (E + 1));
    int *fill = malloc(sizeof(int) * E);
    int *route_tok = malloc(sizeof(int) * (nroutes + 1));
    float *route_w = malloc(sizeof(float) * (nroutes + 1));
    int *touched = malloc(sizeof(int) * (E + 1));
    if (!start || !fill || !route_tok || !route_w || !touched) goto oom;
    int ntouched = 0;
    start[0] = 0;
    for (int e = 0; e < E; e++) {
        const int take = counts[e] > 0 && counts[e] < skip_min;
        if (take) touched[ntouched++] = e;
        start[e + 1] = start[e] + (take ? counts[e] : 0);
        fill[e] = start[e];
    }
    const int R = start[E];
    for (int r = 0; r < nroutes; r++) {
        const int e = ids[r] - emin;
        if (e >= 0 && e < E && counts[e] < skip_min) {
            route_tok[fill[e]] = r / k;
            route_w[fill[e]++] = tw[r];
        }
    }
    float *xp = malloc(sizeof(float) * ((size_t)T * H + 1));
    float *h = malloc(sizeof(float) * ((size_t)R * 2 * I + 1));
    float *act = malloc(sizeof(float) * ((size_t)R * I + 1));
    const float **xs = malloc(sizeof(float *) * (R + 1));
    const float **as = malloc(sizeof(float *) * (R + 1));
    float **hd = malloc(sizeof(float *) * (R + 1));
    float **od = malloc(sizeof(float *) * (R + 1));
    /* bf16 path: x in xb order, per token its x_min_exponent */
    uint16_t *xbp = bf ? malloc(sizeof(uint16_t) * ((size_t)T * H + 1)) : NULL;
    const uint16_t **xb = bf ? malloc(sizeof(uint16_t *) * (R + 1)) : NULL;
    int *xe = bf ? malloc(sizeof(int) * (T + 1)) : NULL;
    uint16_t *xT = amx ? malloc(sizeof(uint16_t) * ((size_t)R * H + 1)) : NULL; /* AMX's B */
    if (!xp || !h || !act || !xs || !as || !hd || !od || (bf && (!xbp || !xb || !xe)) ||
        (amx && !xT)) {
        free(xp); free(h); free(act); free(xs); free(as); free(hd); free(od);
        free(xbp); free(xb); free(xe); free(xT);
        goto oom;
    }
    for (int j = 0; j < R; j++) {
        if (bf) xb[j] = xbp + (size_t)route_tok[j] * H;
        xs[j] = xp + (size_t)route_tok[j] * H;
        as[j] = act + (size_t)j * I;
        hd[j] = h + (size_t)j * 2 * I;
        od[j] = out + (size_t)route_tok[j] * H;
    }

    /* Work items of contiguous rows (item_rows), taken dynamically: a thread that the OS parks
     * (2 cores shared with other processes) delays one item, not a fixed half of the work. */
    const int c13 = item_rows(H / 2, I, 1), c2 = item_rows(I / 2, H, nthreads);
    const int ci = (I + c13 - 1) / c13, ch = (H + c2 - 1) / c2;
#pragma omp parallel num_threads(nthreads)
    {
        int cfg = -1; /* this thread's AMX tile configuration (w13_amx) */
        /* Activations to fp32 in xp order; the output starts at zero. */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            float *dst = xp + (size_t)t * H;
            for (int c = 0; c < H; c++)
                dst[xp_pos(c, G)] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[(size_t)t * H + c])
                                        : ((const float *)x)[(size_t)t * H + c];
            memset(out + (size_t)t * H, 0, sizeof(float) * H);
            if (bf) {
                const uint16_t *src = (const uint16_t *)x + (size_t)t * H;
                for (int c = 0; c < H; c++) xbp[(size_t)t * H + xb_pos(c)] = src[c];
                xe[t] = x_min_exponent(src, H);
            }
        }
        /* implicit barrier: xp is complete */
#if HAVE_AMX
        if (amx) { /* each expert's tokens packed for the B tiles */
#pragma omp for schedule(static)
            for (int q = 0; q < ntouched; q++) {
                const int e = touched[q], n = start[e + 1] - start[e];
                if (n >= AMX_MIN_TOKENS) amx_pack_rows(xb + start[e], n, H, xT + (size_t)start[e] * H);
            }
        }
#endif

        /* item (expert q, chunk c): gate and up rows [i0, i1) of expert q, then act = silu(gate)
         * * up for them; no other item writes those h or act entries. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < ntouched * ci; item++) {
            const int e = touched[item / ci], j0 = start[e], n = start[e + 1] - j0;
            const int i0 = (item % ci) * c13, i1 = i0 + c13 < I ? i0 + c13 : I;
            const uint8_t *we = w13 + (size_t)e * 2 * I * (H / 2);
            const uint8_t *se = s13 + (size_t)e * 2 * I * (H / 32);
            int ex = 255; /* the smallest x exponent of the expert's tokens */
            for (int j = j0; bf && j < j0 + n; j++) ex = xe[route_tok[j]] < ex ? xe[route_tok[j]] : ex;
            const uint16_t *const *xbj = bf ? xb + j0 : NULL;
            const uint16_t *xTj = amx ? xT + (size_t)j0 * H : NULL;
            w13_rows(we, se, H, i0, i1, n, fisa, xs + j0, xbj, ex, xTj, &cfg, hd + j0);
            w13_rows(we, se, H, I + i0, I + i1, n, fisa, xs + j0, xbj, ex, xTj, &cfg, hd + j0);
            for (int j = j0; j < j0 + n; j++) /* i0 and i1 are multiples of 32 (I is) */
                silu_mul_xp(hd[j] + i0, hd[j] + I + i0, i1 - i0, act + (size_t)j * I + i0, G);
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
                         n, fisa, (const void *const *)(as + j0), od + j0, route_w + j0);
            }
        }
#if HAVE_AMX
        if (cfg >= 0) amx_bf16_release(); /* only where the tiles ran: its ISA is AMX's */
#endif
    }
    free(xp); free(h); free(act); free(xs); free(as); free(hd); free(od);
    free(xbp); free(xb); free(xe); free(xT);
    free(start); free(fill); free(route_tok); free(route_w); free(touched); free(own_counts);
    return 0;
oom:
    free(start); free(fill); free(route_tok); free(route_w); free(touched); free(own_counts);
    return -1;
}
