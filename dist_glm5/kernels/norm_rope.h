/* One row's RMSNorm and one row's rotary embedding, torch's roundings (norm_rope.c says which).
 * Shared by norm_rope.c and mla_project.c, so a norm or a rope is the same bits whichever of them
 * runs it. Compiled without fused multiply-adds (fp-contract off), whatever the includer's
 * setting: torch rounds each product before the sum. */
#ifndef DIST_GLM5_NORM_ROPE_H
#define DIST_GLM5_NORM_ROPE_H
#include <math.h>
#include <stdint.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

static inline float rb(float f) { return bf16_to_f32(f32_to_bf16(f)); } /* f rounded to bf16, as fp32 */

/* x [D] (bf16 or fp32, is_bf16), weight [D] of the same dtype -> out [D]: fp32 statistics,
 * x * rsqrt(mean(x^2) + eps) rounded to x's dtype, then times the weight in that dtype. */
CLONES static void rms_row(const void *x, int D, int is_bf16, const void *w, float eps,
                           void *out) {
    float acc[8] = {0}, ss;
    int D8 = D & ~7;
    if (is_bf16) {
        const uint16_t *xr = (const uint16_t *)x;
        v8 a = V8(0.0f); /* lane l: elements d + l, as the scalar acc[l] */
        for (int d = 0; d < D8; d += 8) {
            const v8 xv = widen(xr + d);
            a += xv * xv;
        }
        memcpy(acc, &a, sizeof acc);
        ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (int d = D8; d < D; d++) ss += bf16_to_f32(xr[d]) * bf16_to_f32(xr[d]);
        float k = 1.0f / sqrtf(ss / D + eps);
        uint16_t *o = (uint16_t *)out;
        const uint16_t *wb = (const uint16_t *)w;
        /* 8 at a time, the scalar tail's roundings (the scalar loop did not vectorise: 1 ns an
         * element, 0.6 ms of a 32-row step's 17 norms) */
        for (int d = 0; d < D8; d += 8)
            store_bf16_8(o + d, round_bf16_8(widen(wb + d) * round_bf16_8(widen(xr + d) * V8(k))));
        for (int d = D8; d < D; d++) o[d] = f32_to_bf16(bf16_to_f32(wb[d]) * rb(bf16_to_f32(xr[d]) * k));
    } else {
        const float *xr = (const float *)x;
        for (int d = 0; d < D8; d += 8)
            for (int l = 0; l < 8; l++) acc[l] += xr[d + l] * xr[d + l];
        ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (int d = D8; d < D; d++) ss += xr[d] * xr[d];
        float k = 1.0f / sqrtf(ss / D + eps);
        float *o = (float *)out;
        const float *wf = (const float *)w;
        for (int d = 0; d < D; d++) o[d] = wf[d] * (xr[d] * k);
    }
}

/* x [dim] (bf16 or fp32), cos/sin fp32 [dim/2] -> out [dim]: [x1*c - x2*s | x2*c + x1*s] with
 * (x1, x2) the even and odd elements (interleave) or the two halves. out may not alias x. */
static void rope_row(const void *x, int dim, int is_bf16, const float *ct, const float *sn,
                     int interleave, void *out) {
    const int half = dim / 2;
    for (int i = 0; i < half; i++) {
        int i1 = interleave ? 2 * i : i, i2 = interleave ? 2 * i + 1 : i + half;
        if (is_bf16) {
            const uint16_t *xr = (const uint16_t *)x;
            float a = bf16_to_f32(xr[i1]), b = bf16_to_f32(xr[i2]), c = rb(ct[i]), s = rb(sn[i]);
            uint16_t *o = (uint16_t *)out;
            o[i] = f32_to_bf16(rb(a * c) - rb(b * s));
            o[i + half] = f32_to_bf16(rb(b * c) + rb(a * s));
        } else {
            const float *xr = (const float *)x;
            float a = xr[i1], b = xr[i2], c = ct[i], s = sn[i];
            float *o = (float *)out;
            o[i] = a * c - b * s;
            o[i + half] = b * c + a * s;
        }
    }
}

#pragma GCC pop_options
#endif
