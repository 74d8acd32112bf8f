/* A run of the lean target's decoder layers in one call (models/lean/decoder.py), so that a
 * decode step costs its arithmetic and not a hundred trips through Python: per layer the same
 * kernels, in the same order, on the same numbers as the layer-by-layer path (RMSNorm, the
 * fused query/key/value product, attention with the KV write (a QK norm and a sliding window
 * where the layer has them), the output product (and its post-norm), the residual update fused
 * with the next RMSNorm, the gate/up product, SwiGLU or GeGLU, the down product), so the
 * two paths give the same logits bit for bit and each row stays width-invariant. Plain C over
 * the build's kernels: every library (scalar, AVX2, VNNI) compiles it. Matrix and Layer, the
 * table Python fills, are in cpu_kernels_shared.h.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_shared.h"

/* The MLP's inner width of a layer: half its gate/up projection's columns. */
static int inner_width(const Layer *L) {
    int width = 0;
    if (L->experts) return 0; /* (expert_mlp_impl has scratch of its own) */
    for (int p = 0; p < L->gate_up_parts; p++) width += L->gate_up[p].N;
    return width / 2;
}

/* y [n, sum of the parts' N] = x [n, K] times the parts side by side, plus their biases; the
 * activations are quantized once for all parts that round them alike (a file's parts in formats
 * llama.cpp rounds activations differently for each get their own). Returns 0, or
 * KERNEL_NO_MEMORY. */
int project_impl(const float *x, int n, int K, const Matrix *parts, int count, float *y, int threads) {
    int width = 0;
    for (int p = 0; p < count; p++) width += parts[p].N;
    Activations a;
    int prepared = 0, rule = ACTIVATIONS_FLOAT; /* what `a` holds */
    int column = 0;
    for (int p = 0; p < count; p++) {
        const Matrix *w = &parts[p];
        const int wanted = activations_of(w);
        if (!prepared || (wanted != ACTIVATIONS_FLOAT && wanted != rule)) { /* (float weights read any: a->x) */
            int halves = 0; /* whether a 6-bit part rounding alike reads the half sums */
            for (int q = p; q < count; q++) halves |= parts[q].bits == 6 && activations_of(&parts[q]) == wanted;
            if (prepared) free_activations(&a);
            if (prepare_activations(x, n, K, wanted, halves, &a)) return KERNEL_NO_MEMORY;
            prepared = 1;
            rule = wanted;
        }
        block_products(&a, n, K, w->codes, w->scale, w->offset, w->form, w->bits, w->N, w->groups, y + column, width,
                       threads);
        if (w->bias)
            for (int r = 0; r < n; r++)
                for (int c = 0; c < w->N; c++) y[(size_t)r * width + column + c] += w->bias[c];
        column += w->N;
    }
    if (prepared) free_activations(&a);
    return KERNEL_OK;
}

/* The MLP's gated activation: gate_up [rows, 2 inner] into out [rows, inner]. */
void gated_impl(const float *gate_up, int rows, int inner, int activation, float *out) {
    if (activation == ACT_GEGLU_TANH)
        geglu_impl(gate_up, rows, inner, out);
    else
        swiglu_impl(gate_up, rows, inner, out);
}

/* *delta [n, hidden] RMS-normalized by `weight` (a post-norm): written into *spare, and the
 * two buffers swapped, so *delta holds the result and nothing is copied. */
static void normed_in_place(float **delta, float **spare, const float *weight, int n, int hidden, float eps) {
    rms_norm_impl(*delta, weight, n, hidden, eps, *spare);
    float *normed = *spare;
    *spare = *delta;
    *delta = normed;
}

/* Layers 0 .. count - 1 of `layers` over the residual stream x [n, hidden] (updated in place),
 * written at KV slots start .. start + n - 1; keys and values [count, KVH, capacity, D] from
 * the first of these layers on; cos, sin [tables, n, D] at each row's position (a layer reads
 * table L->rope); `parents` NULL for a
 * chain or a token tree's parent rows (attention_block). Returns 0, or KERNEL_NO_MEMORY when
 * scratch memory cannot be had. The arguments were checked (cpu_boundary.c). */
int decoder_layers_impl(float *x, int n, int hidden, int start, const Layer *layers, int count, int H, int KVH,
                        int D, float *keys, float *values, int capacity, const float *cos, const float *sin,
                        float scale, const int *parents, int threads) {
    const size_t rows = (size_t)n, per_layer = (size_t)KVH * capacity * D;
    const int qkv_width = (H + 2 * KVH) * D;
    int inner = 1; /* the widest dense MLP among these layers: the scratch holds any of them */
    for (int i = 0; i < count; i++) {
        const int width = inner_width(&layers[i]);
        inner = width > inner ? width : inner;
    }
    float *h = malloc(sizeof(float) * rows * hidden), *qkv = malloc(sizeof(float) * rows * qkv_width);
    float *attended = malloc(sizeof(float) * rows * H * D), *delta = malloc(sizeof(float) * rows * hidden);
    float *gate_up = malloc(sizeof(float) * rows * 2 * inner), *act = malloc(sizeof(float) * rows * inner);
    float *post = malloc(sizeof(float) * rows * hidden); /* a post-norm's output (Gemma 3) */
    int failed = !h || !qkv || !attended || !delta || !gate_up || !act || !post; /* (every failure: no memory) */
    int pending = 0; /* delta holds the last layer's MLP output, not yet added to x */
    for (int i = 0; i < count && !failed; i++) {
        const Layer *L = &layers[i];
        const int width = inner_width(L);
        if (pending)
            add_rms_norm_impl(x, delta, L->norm1, n, hidden, L->eps1, h);
        else
            rms_norm_impl(x, L->norm1, n, hidden, L->eps1, h);
        const size_t table = (size_t)L->rope * n * D; /* this layer's rotary table */
        failed = project_impl(h, n, hidden, L->qkv, L->qkv_parts, qkv, threads)
                 || attention_block_impl(qkv, n, start, H, KVH, D, L->q_norm, L->k_norm, L->qk_eps, cos + table,
                                         sin + table, keys + i * per_layer, values + i * per_layer, capacity, scale,
                                         parents, L->window, attended, threads)
                 || project_impl(attended, n, H * D, &L->out, 1, delta, threads);
        if (failed) break;
        if (L->post_norm1) normed_in_place(&delta, &post, L->post_norm1, n, hidden, L->eps1);
        add_rms_norm_impl(x, delta, L->norm2, n, hidden, L->eps2, h);
        if (L->experts) {
            failed = expert_mlp_impl(h, n, hidden, L->experts, L->activation, delta, threads);
        } else {
            failed = project_impl(h, n, hidden, L->gate_up, L->gate_up_parts, gate_up, threads);
            if (failed) break;
            gated_impl(gate_up, n, width, L->activation, act);
            failed = project_impl(act, n, width, &L->down, 1, delta, threads);
        }
        if (!failed && L->post_norm2) normed_in_place(&delta, &post, L->post_norm2, n, hidden, L->eps2);
        pending = !failed;
    }
    if (pending && !failed)
        for (size_t i = 0; i < rows * hidden; i++) x[i] += delta[i];
    free(h); free(qkv); free(attended); free(delta); free(gate_up); free(act); free(post);
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
