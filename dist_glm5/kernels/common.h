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

#endif
