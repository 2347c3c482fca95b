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

/* S[t, e] = sigmoid(x_t . W_e) for the nb tokens from t0 (nb a constant where inlined: the
 * accumulators stay in registers). The expert row's loads serve nb tokens (32 tokens' dots
 * 109 -> 90 us at 64 x 1024 against one token at a time); each token's dot keeps its own four
 * chains in one order, so its bits do not depend on the tokens beside it. */
enum { NB = 4 };
static inline __attribute__((always_inline)) void dots(const float *we, const float *xf, int H,
                                                       int H8, int t0, const int nb, float *S,
                                                       int E, int e) {
    v8 acc[NB][4];
    for (int u = 0; u < nb; u++)
        for (int c = 0; c < 4; c++) acc[u][c] = (v8){0};
    int i = 0;
    for (; i + 32 <= H8; i += 32)
        for (int c = 0; c < 4; c++) {
            v8 b;
            memcpy(&b, we + i + 8 * c, sizeof b);
            for (int u = 0; u < nb; u++) {
                v8 a;
                memcpy(&a, xf + (int64_t)(t0 + u) * H + i + 8 * c, sizeof a);
                acc[u][c] += a * b;
            }
        }
    for (; i < H8; i += 8) {
        v8 b;
        memcpy(&b, we + i, sizeof b);
        for (int u = 0; u < nb; u++) {
            v8 a;
            memcpy(&a, xf + (int64_t)(t0 + u) * H + i, sizeof a);
            acc[u][0] += a * b;
        }
    }
    for (int u = 0; u < nb; u++) {
        const float *xt = xf + (int64_t)(t0 + u) * H;
        const v8 sum4 = (acc[u][0] + acc[u][1]) + (acc[u][2] + acc[u][3]);
        float d = HSUM(sum4);
        for (int j = i; j < H; j++) d += xt[j] * we[j];
        S[(int64_t)(t0 + u) * E + e] = 1.0f / (1.0f + expf(-d));
    }
}

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
        int t0 = 0;
        for (; t0 + NB <= T; t0 += NB) dots(we, xf, H, H8, t0, NB, S, E, e);
        for (; t0 < T; t0++) dots(we, xf, H, H8, t0, 1, S, E, e);
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
        /* one pass keeping the k best in order (highest first; on a tie the lower id first: a
         * later expert goes after those equal to it). k passes over E cost 1.75 us a token at
         * E = 64, k = 8, a third of the call */
        float best[MAX_E];
        int n = 0;
        for (int e = 0; e < E; e++) {
            const float c = choice[e];
            if (n == k && !(c > best[k - 1])) continue;
            int j = n < k ? n++ : k - 1;
            for (; j > 0 && c > best[j - 1]; j--) best[j] = best[j - 1], id[j] = id[j - 1];
            best[j] = c, id[j] = e;
        }
        for (int j = 0; j < k; j++) {
            wt[j] = s[id[j]];
            sum += s[id[j]];
        }
        for (int j = 0; j < k; j++) wt[j] = (norm ? wt[j] / (sum + 1e-20f) : wt[j]) * scaling;
    }
    free(xf), free(S);
    return 0;
}
