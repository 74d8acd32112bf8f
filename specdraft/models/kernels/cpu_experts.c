/* A mixture-of-experts MLP (Qwen3-MoE) over rows h [n, hidden] on the build's block products:
 * each row's experts are chosen from its own router scores (Experts, cpu_kernels_shared.h),
 * each expert runs once over the rows that chose it (gathered into one block, as a verify
 * block's rows share a dense MLP's products), and each row's output is summed over its experts
 * in expert order. A row's result therefore depends on its own values only: a verify row
 * equals the one-token step bit for bit, whatever else the block holds. Plain C over the
 * build's kernels: every library compiles it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_shared.h"

/* Row r's experts chosen[r * used ..] (highest score first; ties and NaN scores: the lower
 * expert) and their weights: softmax probabilities over all experts, renormalized over the
 * chosen ones where the model does so. Chosen by score, which orders them as the
 * probabilities do. */
static void route(const float *scores, int n, const Experts *E, int *chosen, float *weight) {
    for (int r = 0; r < n; r++) {
        const float *s = scores + (size_t)r * E->count;
        int *c = chosen + (size_t)r * E->used;
        float *w = weight + (size_t)r * E->used;
        float top = s[0];
        for (int e = 1; e < E->count; e++) top = s[e] > top ? s[e] : top;
        float total = 0.0f;
        for (int e = 0; e < E->count; e++) total += expf(s[e] - top);
        for (int k = 0; k < E->used; k++) {
            int best = -1;
            for (int e = 0; e < E->count; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= c[j] == e;
                if (!taken && (best < 0 || s[e] > s[best])) best = e;
            }
            c[k] = best;
            w[k] = expf(s[best] - top) / total;
        }
        if (E->normalize) {
            float sum = 0.0f;
            for (int k = 0; k < E->used; k++) sum += w[k];
            for (int k = 0; k < E->used; k++) w[k] /= sum;
        }
    }
}

/* The rows of h that chose expert e (rows[j], and in which of their slots: slot[j]); returns
 * how many. */
static int rows_of(int e, const int *chosen, int n, int used, int *rows, int *slot) {
    int m = 0;
    for (int r = 0; r < n; r++)
        for (int k = 0; k < used; k++)
            if (chosen[(size_t)r * used + k] == e) {
                rows[m] = r;
                slot[m++] = k;
                break;
            }
    return m;
}

/* The inner width of expert 0's MLP (every expert's: checked in cpu_boundary.c). */
static int expert_inner(const Experts *E) {
    int width = 0;
    for (int p = 0; p < E->parts; p++) width += E->gate_up[p].N;
    return width / 2;
}

/* out [n, hidden] = the mixture's output for rows h [n, hidden] (see above). Returns 0, or
 * KERNEL_NO_MEMORY. The arguments were checked (cpu_boundary.c). */
int expert_mlp_impl(const float *h, int n, int hidden, const Experts *E, int activation, float *out,
                    int threads) {
    const size_t rows_n = (size_t)n;
    const int inner = expert_inner(E);
    float *scores = malloc(sizeof(float) * rows_n * E->count), *weight = malloc(sizeof(float) * rows_n * E->used);
    int *chosen = malloc(sizeof(int) * rows_n * E->used), *rows = malloc(sizeof(int) * rows_n);
    int *slot = malloc(sizeof(int) * rows_n);
    float *block = malloc(sizeof(float) * rows_n * hidden), *gate_up = malloc(sizeof(float) * rows_n * 2 * inner);
    float *act = malloc(sizeof(float) * rows_n * inner), *result = malloc(sizeof(float) * rows_n * hidden);
    int failed = !scores || !weight || !chosen || !rows || !slot || !block || !gate_up || !act || !result;
    if (!failed) failed = project_impl(h, n, hidden, &E->router, 1, scores, threads);
    if (!failed) {
        route(scores, n, E, chosen, weight);
        memset(out, 0, sizeof(float) * rows_n * hidden);
    }
    for (int e = 0; e < E->count && !failed; e++) {
        const int m = rows_of(e, chosen, n, E->used, rows, slot);
        if (!m) continue;
        for (int j = 0; j < m; j++)
            memcpy(block + (size_t)j * hidden, h + (size_t)rows[j] * hidden, sizeof(float) * hidden);
        failed = project_impl(block, m, hidden, E->gate_up + (size_t)e * E->parts, E->parts, gate_up, threads);
        if (failed) break;
        gated_impl(gate_up, m, inner, activation, act);
        failed = project_impl(act, m, inner, &E->down[e], 1, result, threads);
        for (int j = 0; j < m && !failed; j++) {
            const float w = weight[(size_t)rows[j] * E->used + slot[j]];
            float *y = out + (size_t)rows[j] * hidden;
            const float *r = result + (size_t)j * hidden;
            for (int c = 0; c < hidden; c++) y[c] += w * r[c];
        }
    }
    free(scores); free(weight); free(chosen); free(rows); free(slot); free(block); free(gate_up); free(act);
    free(result);
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
