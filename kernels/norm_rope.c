/* RMSNorm and rotary embedding over rows, in one call each (CPU).
 *
 * Why: at decode these run on a handful of rows, and their torch forms are 6-8 eager ops each
 * (widen, square, mean, rsqrt, scale, narrow, weight; or slice, cast, four products, two sums,
 * a concatenation): 60-100 us a call here, all of it per-op overhead, 33 norms and 32 ropes per
 * step of the small model. One C call does a row in well under a microsecond.
 * Same math as ops/norm.rms_norm and ops/rope.apply_rope, rounding where torch rounds:
 * - rms_norm: fp32 statistics, x * rsqrt(mean(x^2) + eps) rounded to x's dtype, then times the
 *   weight in that dtype (one more rounding in bf16). Only the order of the sum of squares
 *   differs from torch's.
 * - rope: in bf16 every product and sum is rounded to bf16, as torch's eager bf16 ops do, so the
 *   result is torch's bit for bit; fp32 likewise (no fused multiply-add: contraction is off).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>

#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif



static inline float rb(float f) { return bf16_to_f32(f32_to_bf16(f)); } /* f rounded to bf16, as fp32 */

/* x rows [R, D] (row stride ld elements, last dim contiguous), weight [D], out [R, D]
 * contiguous; all bf16 (is_bf16) or all fp32. Every row count takes this path (prefill's too, rows
 * over threads), so a row's result never depends on the rows beside it: the sum of squares is
 * ours, not torch's, and a row normed here in a decode step and by torch in a prefill-sized one
 * could round differently. */
void rms_norm_rows(const void *x, int64_t ld, int R, int D, int is_bf16, const void *w, float eps,
                   void *out, int nthreads) {
    int nt = nthreads > 1 && (int64_t)R * D >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = 0; r < R; r++) {
        float acc[8] = {0}, ss;
        int D8 = D & ~7;
        if (is_bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * ld;
            for (int d = 0; d < D8; d += 8)
                for (int l = 0; l < 8; l++) acc[l] += bf16_to_f32(xr[d + l]) * bf16_to_f32(xr[d + l]);
            ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (int d = D8; d < D; d++) ss += bf16_to_f32(xr[d]) * bf16_to_f32(xr[d]);
            float k = 1.0f / sqrtf(ss / D + eps);
            uint16_t *o = (uint16_t *)out + (int64_t)r * D;
            const uint16_t *wb = (const uint16_t *)w;
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(bf16_to_f32(wb[d]) * rb(bf16_to_f32(xr[d]) * k));
        } else {
            const float *xr = (const float *)x + r * ld;
            for (int d = 0; d < D8; d += 8)
                for (int l = 0; l < 8; l++) acc[l] += xr[d + l] * xr[d + l];
            ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (int d = D8; d < D; d++) ss += xr[d] * xr[d];
            float k = 1.0f / sqrtf(ss / D + eps);
            float *o = (float *)out + (int64_t)r * D;
            const float *wf = (const float *)w;
            for (int d = 0; d < D; d++) o[d] = wf[d] * (xr[d] * k);
        }
    }
}

/* x [T, M, dim] (strides st, sm elements; last dim contiguous), cos/sin fp32 [T, dim/2]
 * contiguous, out [T, M, dim] contiguous: [x1*c - x2*s | x2*c + x1*s] with (x1, x2) the even
 * and odd elements (interleave) or the two halves. */
void rope_rows(const void *x, int64_t st, int64_t sm, int T, int M, int dim, int is_bf16,
               const float *cos, const float *sin, int interleave, void *out) {
    const int half = dim / 2;
    for (int t = 0; t < T; t++) {
        const float *ct = cos + (int64_t)t * half, *sn = sin + (int64_t)t * half;
        for (int m = 0; m < M; m++) {
            int64_t src = t * st + m * sm, dst = ((int64_t)t * M + m) * dim;
            for (int i = 0; i < half; i++) {
                int i1 = interleave ? 2 * i : i, i2 = interleave ? 2 * i + 1 : i + half;
                if (is_bf16) {
                    const uint16_t *xr = (const uint16_t *)x + src;
                    float a = bf16_to_f32(xr[i1]), b = bf16_to_f32(xr[i2]), c = rb(ct[i]), s = rb(sn[i]);
                    uint16_t *o = (uint16_t *)out + dst;
                    o[i] = f32_to_bf16(rb(a * c) - rb(b * s));
                    o[i + half] = f32_to_bf16(rb(b * c) + rb(a * s));
                } else {
                    const float *xr = (const float *)x + src;
                    float a = xr[i1], b = xr[i2], c = ct[i], s = sn[i];
                    float *o = (float *)out + dst;
                    o[i] = a * c - b * s;
                    o[i + half] = b * c + a * s;
                }
            }
        }
    }
}
