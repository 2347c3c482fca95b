/* The MoE router of a decode step's few tokens in one C call: model/router.route's math.
 *
 *   s = sigmoid(x . W^T) (fp32; x bf16 widened exactly), choice = s + bias; with n_group > 1 the
 *   groups ranked by the sum of their two best choices and the best topk_group kept; the top_k
 *   experts by choice among them; weights = s of those (normalised to sum 1 when norm) * scaling.
 *
 * Why: in torch that is about ten eager ops per layer (widen, linear, sigmoid, add, topk,
 * gather, sum, div, mul, cast), 120-170 us per call on this VM against a few tens for the dot
 * products' bytes. Differences from torch: the order of the fp32 additions of each dot, expf for
 * torch's vectorised exp (a score may differ in its last bit), and the ids come ordered by
 * choice, highest first (torch.topk(sorted=False) leaves the order to its implementation); ties
 * go to the lower expert id.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { MAX_E = 1024, MAX_G = 64 };

/* x [T, H] (bf16 when x_bf16), W [E, H] fp32, bias [E] fp32 -> w_out [T, k] fp32, ids [T, k].
 * Returns 0, -1 for sizes it does not take (E > MAX_E, n_group > MAX_G, k or topk_group out
 * of range, E not a multiple of n_group), or -2 (no memory). */
CLONES int router(const void *x, int x_bf16, int T, int H, const float *W, const float *bias,
                  int E, int k, int n_group, int topk_group, int norm, float scaling,
                  float *w_out, int32_t *ids_out) {
    if (E > MAX_E || E <= 0 || k <= 0 || k > E || n_group <= 0 || n_group > MAX_G ||
        E % n_group || topk_group <= 0 || topk_group > n_group)
        return -1;
    /* scores of every token, each expert's row read once for all of them */
    float *xf = malloc(sizeof(float) * ((size_t)T * H + 1));
    float *S = malloc(sizeof(float) * ((size_t)T * E + 1));
    if (!xf || !S) {
        free(xf), free(S);
        return -2;
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++)
        xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const int per = E / n_group, H8 = H & ~7;
    for (int e = 0; e < E; e++) {
        const float *we = W + (int64_t)e * H;
        for (int t = 0; t < T; t++) {
            const float *xt = xf + (int64_t)t * H;
            v8 acc[4] = {{0}, {0}, {0}, {0}}; /* four chains: one waits on each FMA's latency */
            int i = 0;
            for (; i + 32 <= H8; i += 32)
                for (int c = 0; c < 4; c++) {
                    v8 a, b;
                    memcpy(&a, xt + i + 8 * c, sizeof a);
                    memcpy(&b, we + i + 8 * c, sizeof b);
                    acc[c] += a * b;
                }
            for (; i < H8; i += 8) {
                v8 a, b;
                memcpy(&a, xt + i, sizeof a);
                memcpy(&b, we + i, sizeof b);
                acc[0] += a * b;
            }
            const v8 sum4 = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            float d = HSUM(sum4);
            for (; i < H; i++) d += xt[i] * we[i];
            S[(int64_t)t * E + e] = 1.0f / (1.0f + expf(-d));
        }
    }
    for (int t = 0; t < T; t++) {
        const float *s = S + (int64_t)t * E;
        float choice[MAX_E];
        for (int e = 0; e < E; e++) choice[e] = s[e] + bias[e];
        if (n_group > 1) { /* keep the topk_group groups with the best sums of two */
            float gs[MAX_G];
            int keep[MAX_G];
            for (int g = 0; g < n_group; g++) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int e = g * per; e < (g + 1) * per; e++) {
                    const float c = choice[e];
                    if (c > b1) b2 = b1, b1 = c;
                    else if (c > b2) b2 = c;
                }
                gs[g] = per > 1 ? b1 + b2 : b1;
                keep[g] = 0;
            }
            for (int j = 0; j < topk_group; j++) {
                int best = -1;
                for (int g = 0; g < n_group; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = 1;
            }
            for (int g = 0; g < n_group; g++)
                if (!keep[g])
                    for (int e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
        float *wt = w_out + (int64_t)t * k, sum = 0.0f;
        int32_t *id = ids_out + (int64_t)t * k;
        for (int j = 0; j < k; j++) { /* k passes: k is small (8 of 256 for GLM-5) */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
            }
            id[j] = best;
            wt[j] = s[best];
            sum += s[best];
        }
        for (int j = 0; j < k; j++) wt[j] = (norm ? wt[j] / (sum + 1e-20f) : wt[j]) * scaling;
    }
    free(xf), free(S);
    return 0;
}
