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
#include "norm_rope.h"
#ifdef _OPENMP
#include <omp.h>
#endif



/* x rows [R, D] (row stride ld elements, last dim contiguous), weight [D], out [R, D]
 * contiguous; all bf16 (is_bf16) or all fp32. Every row count takes this path (prefill's too, rows
 * over threads), so a row's result never depends on the rows beside it: the sum of squares is
 * ours, not torch's, and a row normed here in a decode step and by torch in a prefill-sized one
 * could round differently. */
void rms_norm_rows(const void *x, int64_t ld, int R, int D, int is_bf16, const void *w, float eps,
                   void *out, int nthreads) {
    int nt = nthreads > 1 && (int64_t)R * D >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = 0; r < R; r++)
        rms_row((const char *)x + (int64_t)r * ld * (is_bf16 ? 2 : 4), D, is_bf16, w, eps,
                (char *)out + (int64_t)r * D * (is_bf16 ? 2 : 4));
}

/* x [T, M, dim] (strides st, sm elements; last dim contiguous), cos/sin fp32 [T, dim/2]
 * contiguous, out [T, M, dim] contiguous: [x1*c - x2*s | x2*c + x1*s] with (x1, x2) the even
 * and odd elements (interleave) or the two halves. */
void rope_rows(const void *x, int64_t st, int64_t sm, int T, int M, int dim, int is_bf16,
               const float *cos, const float *sin, int interleave, void *out) {
    const int half = dim / 2, es = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++)
        for (int m = 0; m < M; m++)
            rope_row((const char *)x + (t * st + m * sm) * es, dim, is_bf16,
                     cos + (int64_t)t * half, sin + (int64_t)t * half, interleave,
                     (char *)out + ((int64_t)t * M + m) * dim * es);
}
