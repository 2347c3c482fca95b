/* What every CPU kernel here shares: the ISA clones, an 8-lane fp32 vector, its horizontal sum and
 * the bf16 <-> fp32 conversions (torch's rounding). A header, not a library: each kernel inlines
 * these into its own target clones. dist_glm5/kernels/build.py hashes it with each source that includes it. */
#ifndef DIST_GLM5_COMMON_H
#define DIST_GLM5_COMMON_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
/* x86-64-v3 = AVX2 + FMA (plain "avx2" would leave the products and sums unfused) */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* 8 fp32 lanes as a GCC vector: each target clone compiles it to its own ISA (one ymm on AVX2 and
 * AVX-512, two xmm on the baseline). Helpers taking one are always inlined, so no call ever passes
 * a vector across an ABI. */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define HSUM(a) ((((a)[0] + (a)[4]) + ((a)[1] + (a)[5])) + (((a)[2] + (a)[6]) + ((a)[3] + (a)[7])))

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));

static inline __attribute__((always_inline)) v8 widen(const uint16_t *p) { /* 8 bf16 -> 8 fp32 */
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* 8 lanes rounded to bf16 as f32_to_bf16 rounds (nearest even, NaN stays NaN), still fp32 */
static inline __attribute__((always_inline)) v8 round_bf16_8(v8 f) {
    v8u u;
    memcpy(&u, &f, sizeof u);
    const v8u nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = ((nan & (u | 0x400000u)) | (~nan & (u + 0x7fffu + ((u >> 16) & 1u)))) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 8 fp32 lanes that hold bf16 values (round_bf16_8's) -> their bf16 bits at p */
static inline __attribute__((always_inline)) void store_bf16_8(uint16_t *p, v8 f) {
    v8u u;
    memcpy(&u, &f, sizeof u);
    const v8h h = __builtin_convertvector(u >> 16, v8h);
    memcpy(p, &h, sizeof h);
}

/* lanes of a where m is set, else of b (m: a comparison's all-ones / zero lanes; C has no vector ?:) */
static inline __attribute__((always_inline)) v8 v8_select(v8i m, v8 a, v8 b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof a), memcpy(&bi, &b, sizeof b);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

#define V8(c) ((v8){(c), (c), (c), (c), (c), (c), (c), (c)})

/* exp of 8 lanes as expf gives it, within 2 ulp: Cephes' expf (x = n ln2 + r, r in [-ln2/2, ln2/2]
 * with ln2 in two parts, a degree-6 polynomial in r), then 2^n as two factors 2^(n/2), so that a
 * result in the subnormal range rounds once. 0 below -104, inf above 88.8, NaN stays NaN. */
static inline __attribute__((always_inline)) v8 vexp(v8 x) {
    x = v8_select(x < V8(-104.0f), V8(-104.0f), x); /* a NaN compares false: it goes through */
    x = v8_select(x > V8(88.8f), V8(88.8f), x);
    v8 n = x * V8(1.44269504088896341f) + V8(12582912.0f); /* round to the nearest integer */
    n = n - V8(12582912.0f);
    v8 r = x - n * V8(0.693359375f);
    r = r - n * V8(-2.12194440e-4f);
    v8 p = V8(1.9875691500e-4f);
    p = p * r + V8(1.3981999507e-3f);
    p = p * r + V8(8.3334519073e-3f);
    p = p * r + V8(4.1665795894e-2f);
    p = p * r + V8(1.6666665459e-1f);
    p = p * r + V8(5.0000001201e-1f);
    p = p * (r * r) + r + V8(1.0f);
    const v8i ni = __builtin_convertvector(v8_select(n == n, n, V8(0.0f)), v8i); /* NaN: 0 */
    const v8i n1 = ni >> 1, e1 = (n1 + 127) << 23, e2 = (ni - n1 + 127) << 23;
    v8 f1, f2;
    memcpy(&f1, &e1, sizeof f1), memcpy(&f2, &e2, sizeof f2);
    return p * f1 * f2;
}

/* silu(g) = g / (1 + exp(-g)) on 8 lanes */
static inline __attribute__((always_inline)) v8 vsilu(v8 g) { return g / (V8(1.0f) + vexp(-g)); }

/* out = silu(g) * u over n values (n a multiple of 8), 8 lanes at a time: the experts' act (libm's
 * scalar expf there was 7% of a 32-token MoE layer and 15% of a one-token one) */
__attribute__((unused)) CLONES static void silu_mul_row(const float *g, const float *u, int n,
                                                        float *out) {
    for (int i = 0; i < n; i += 8) {
        v8 gv, uv;
        memcpy(&gv, g + i, sizeof gv), memcpy(&uv, u + i, sizeof uv);
        const v8 a = vsilu(gv) * uv;
        memcpy(out + i, &a, sizeof a);
    }
}

/* Rows per work item of a matrix of `rows` rows of row_bytes each (the packed experts' items):
 * at least ITEM_BYTES of it and 128 rows, a multiple of 32 (the act's blocks), and at most rows /
 * parts (rounded up) so that `parts` threads all get one. Each item is a stream the prefetch
 * restarts on: with the small model's 512-byte w13 rows, items of 128 rows (64 KiB) read one
 * token's experts from DRAM at 34 GB/s on two threads and 20 on one; of 512 rows, 50 and 27
 * (GLM-5's 3 KiB rows give 128 rows either way). */
enum { ITEM_BYTES = 256 << 10, ITEM_MIN_ROWS = 128 };
__attribute__((unused)) static int item_rows(size_t row_bytes, int rows, int parts) {
    int c = (int)(ITEM_BYTES / row_bytes);
    if (c < ITEM_MIN_ROWS) c = ITEM_MIN_ROWS;
    if (parts > 1 && c > (rows + parts - 1) / parts) c = (rows + parts - 1) / parts;
    c = (c + 31) & ~31;
    return c < rows ? c : rows;
}

#endif
