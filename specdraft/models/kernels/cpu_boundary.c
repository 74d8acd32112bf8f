/* The functions specdraft's Python calls (models/kernels/native.py declares them with ctypes):
 * each checks its arguments before any work and returns a status (cpu_kernels_shared.h,
 * KERNEL_*: 0, or a negative code per problem, which native.py names in the error it raises),
 * so that a wrong size or a NULL is a message and never a crash or a write past a buffer. What
 * C can check is checked here: pointers, sizes, the layouts' constraints (K a multiple of 32
 * for quantized weights, the group counts each layout reads, head sizes and counts, positions
 * inside the KV capacity, a token tree's parents, row ids); what it cannot (how long a buffer
 * is) Python checks before the call. The same file in every build; the work is the build's
 * (cpu_kernels.c and the files beside it, or cpu_kernels_scalar.c).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_shared.h"

#if SPECDRAFT_ISA == ISA_NEON && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#elif SPECDRAFT_ISA == ISA_NEON && defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

/* The version of the functions' signatures (models/kernels/native.py declares them): a benchmark
 * that loads another revision's build beside this one's compares only builds of the same
 * signatures. 2: the block products take `half` (float16 scales); 3: block_rows; 4: `half`
 * became `form` (SCALES_FACTORED added); 5: 6-bit weights (bits 6, cpu_kernels_six.c); 6: one
 * library per instruction set (kernel_isa fixed, no switch), every exported function returns
 * a status, kernel_layout; 7: a layer's QK norm (Layer.q_norm, k_norm, qk_eps; attention_block's
 * q_norm, k_norm, qk_eps); 8: Gemma 3's layers (Layer.post_norm1, post_norm2, activation,
 * window, rope; decoder_layers' rope_tables; the attentions' window; geglu_rows); 9: mixtures
 * of experts (Experts, Layer.experts, expert_mlp); 10: activations rounded as llama.cpp rounds
 * them for a file's format (Matrix.activations, block_matmul's `activations`); a build without
 * this function is 1. */
int kernel_interface(void) { return 10; }

/* This library's instruction set (ISA_SCALAR, ISA_AVX2, ISA_VNNI, ISA_NEON), fixed when it was compiled. */
int kernel_isa(void) { return SPECDRAFT_ISA; }

/* Whether this CPU runs this library's instructions (the scalar build: every CPU; NEON: every
 * AArch64 CPU, and the dot-product instruction where the build uses it). */
int isa_supported(void) {
#if SPECDRAFT_ISA == ISA_SCALAR
    return 1;
#elif SPECDRAFT_ISA == ISA_NEON
#if defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__ARM_FEATURE_DOTPROD) && defined(__APPLE__)
    int has = 0;
    size_t size = sizeof(has);
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &has, &size, NULL, 0) == 0 && has;
#else
    return 1;
#endif
#else
    __builtin_cpu_init();
    int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if SPECDRAFT_ISA == ISA_VNNI
    ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
         && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
         && __builtin_cpu_supports("avx512vnni");
#endif
    return ok;
#endif
}

/* The constants Python keeps copies of, then for each struct it mirrors with ctypes
 * (native_layers.py, structs.py) its size and each field's offset and size, in declaration
 * order: native.py compares them with its mirrors, field by field, when it loads a build.
 * Writes them into out[capacity] (when not NULL) and returns how many there are, or
 * KERNEL_BAD_SIZE when `capacity` is too small. */
#define AT(type, field) (int64_t)offsetof(type, field), (int64_t)sizeof(((type *)0)->field)
int kernel_layout(int64_t *out, int capacity) {
    const int64_t layout[] = {
        GROUP, BLOCK, SIX_GROUP_BYTES, SIX_SCALE_BYTES, MAX_PARTS, MAX_HEAD_DIM,
        sizeof(Matrix), AT(Matrix, codes), AT(Matrix, scale), AT(Matrix, offset), AT(Matrix, bias), AT(Matrix, N),
        AT(Matrix, groups), AT(Matrix, bits), AT(Matrix, form), AT(Matrix, activations),
        sizeof(Layer), AT(Layer, norm1), AT(Layer, norm2), AT(Layer, eps1), AT(Layer, eps2), AT(Layer, qkv),
        AT(Layer, gate_up), AT(Layer, out), AT(Layer, down), AT(Layer, qkv_parts), AT(Layer, gate_up_parts),
        AT(Layer, q_norm), AT(Layer, k_norm), AT(Layer, qk_eps), AT(Layer, post_norm1), AT(Layer, post_norm2),
        AT(Layer, activation), AT(Layer, window), AT(Layer, rope), AT(Layer, experts),
        sizeof(Experts), AT(Experts, router), AT(Experts, gate_up), AT(Experts, down), AT(Experts, count),
        AT(Experts, used), AT(Experts, parts), AT(Experts, normalize),
    };
    const int count = (int)(sizeof(layout) / sizeof(layout[0]));
    if (out) {
        if (capacity < count) return KERNEL_BAD_SIZE;
        memcpy(out, layout, sizeof(layout));
    }
    return count;
}
#undef AT

/* A weight in the block layout met by inputs of width K: what the products will read of it. */
static int check_matrix(const Matrix *w, int K) {
    if (!w->codes) return KERNEL_NULL_POINTER;
    if (w->N <= 0 || K <= 0) return KERNEL_BAD_SIZE;
    if (FLOAT_WEIGHTS(w->bits)) return KERNEL_OK; /* (no scales: nothing else is read) */
    if (!w->scale || (w->bits == 4 && !w->offset)) return KERNEL_NULL_POINTER;
    if (K % GROUP) return KERNEL_BAD_WIDTH;
    const int groups = K / GROUP;
    if (w->activations < ACTIVATIONS_OWN || w->activations > ACTIVATIONS_Q8_K) return KERNEL_BAD_ARGUMENT;
    if (w->activations == ACTIVATIONS_Q8_K && groups % SUPER_GROUPS) return KERNEL_BAD_ARGUMENT; /* whole super-blocks */
    switch (w->bits) {
    case 4: /* groups: terms x K / 32 */
        if (w->groups <= 0 || w->groups % groups) return KERNEL_BAD_FORMAT;
        if (w->form == SCALES_FACTORED) return w->groups % SUPER_GROUPS ? KERNEL_BAD_FORMAT : KERNEL_OK;
        return w->form == SCALES_FLOAT32 || w->form == SCALES_FLOAT16 ? KERNEL_OK : KERNEL_BAD_FORMAT;
    case 6: /* a float16 d per SUPER_GROUPS groups; `form` unread */
        return w->groups != groups || groups % SUPER_GROUPS ? KERNEL_BAD_FORMAT : KERNEL_OK;
    case 8:
        if (w->groups != groups) return KERNEL_BAD_FORMAT;
        return w->form == SCALES_FLOAT32 || w->form == SCALES_FLOAT16 ? KERNEL_OK : KERNEL_BAD_FORMAT;
    default:
        return KERNEL_BAD_FORMAT;
    }
}

/* x [M, K] float32 -> y [M, N] float32 for a weight in the block layout: 4-bit codes with
 * offsets (`groups` = terms x K / 32), 8-bit codes or 6-bit codes (cpu_kernels_six.c) whose
 * `offset` is not read (a 6-bit weight's `scale` is its scale bytes, `form` unread), or
 * bfloat16 / float32 weights, `bits` 16 / 32, that read neither; `form`: how the scales and
 * offsets are held (cpu_kernels_shared.h). Returns a status. */
int block_matmul(const float *x, int M, int K, const void *codes, const void *scale, const void *offset, int form,
                 int bits, int N, int groups, int activations, float *y, int threads) {
    if (!x || !y) return KERNEL_NULL_POINTER;
    if (M <= 0 || threads <= 0) return KERNEL_BAD_SIZE;
    const Matrix w = {codes, scale, offset, NULL, N, groups, bits, form, activations};
    const int status = check_matrix(&w, K);
    if (status) return status;
    Activations a;
    if (prepare_activations(x, M, K, activations_of(&w), bits == 6, &a)) return KERNEL_NO_MEMORY;
    block_products(&a, M, K, codes, scale, offset, form, bits, N, groups, y, N, threads);
    free_activations(&a);
    return KERNEL_OK;
}

/* Rows `ids` [n] of a 4-bit (`terms` terms), 6-bit or 8-bit weight of N output rows,
 * dequantized into out [n, K] (cpu_common.c). KERNEL_BAD_ROW for an id outside 0 .. N - 1. */
int block_rows(const void *codes, const void *scale, const void *offset, int form, int bits, int N, int groups,
               int terms, const int64_t *ids, int n, float *out) {
    if (!ids || !out) return KERNEL_NULL_POINTER;
    if (n <= 0 || terms <= 0 || groups <= 0) return KERNEL_BAD_SIZE;
    if (FLOAT_WEIGHTS(bits) || groups % terms || (bits != 4 && terms != 1)) return KERNEL_BAD_FORMAT;
    const Matrix w = {codes, scale, offset, NULL, N, groups, bits, form};
    const int status = check_matrix(&w, groups / terms * GROUP);
    return status ? status : block_rows_impl(codes, scale, offset, form, bits, N, groups, terms, ids, n, out);
}

/* What attention reads and writes: n rows at KV slots start.. of `capacity`, H query heads over
 * KVH key/value heads of size D, a token tree's parents earlier rows, a window of 0 (none) or
 * more positions. */
static int check_attention(int n, int start, int H, int KVH, int D, int capacity, const int *parents, int window,
                           int threads) {
    if (n <= 0 || H <= 0 || KVH <= 0 || D <= 0 || capacity <= 0 || threads <= 0 || window < 0) return KERNEL_BAD_SIZE;
    if (H % KVH) return KERNEL_BAD_HEADS;
    if (D % HEAD_LANES || D > MAX_HEAD_DIM) return KERNEL_BAD_HEAD_DIM;
    if (start < 0 || (int64_t)start + n > capacity) return KERNEL_BAD_POSITION;
    if (parents)
        for (int i = 1; i < n; i++)
            if (parents[i] < 0 || parents[i] >= i) return KERNEL_BAD_PARENT;
    return KERNEL_OK;
}

/* Causal attention of q [n, H, D] over keys and values [KVH, capacity, D] into out [n, H, D]
 * (cpu_attention.c), each row over its last `window` positions (0: all). */
int causal_attention(const float *q, const float *keys, const float *values, int n, int start, int H, int KVH, int D,
                     int capacity, float scale, const int *parents, int window, float *out, int threads) {
    if (!q || !keys || !values || !out) return KERNEL_NULL_POINTER;
    const int status = check_attention(n, start, H, KVH, D, capacity, parents, window, threads);
    return status ? status
                  : causal_attention_impl(q, keys, values, n, start, H, KVH, D, capacity, scale, parents, window, out,
                                          threads);
}

/* The QK norm of queries and keys before their rotary positions (cpu_common.c), then the KV
 * write and attention of one block; q_norm, k_norm NULL: none. */
int attention_block(const float *qkv, int n, int start, int H, int KVH, int D, const float *q_norm,
                    const float *k_norm, float qk_eps, const float *cos, const float *sin, float *keys, float *values,
                    int capacity, float scale, const int *parents, int window, float *out, int threads) {
    if (!qkv || !cos || !sin || !keys || !values || !out) return KERNEL_NULL_POINTER;
    const int status = check_attention(n, start, H, KVH, D, capacity, parents, window, threads);
    return status ? status
                  : attention_block_impl(qkv, n, start, H, KVH, D, q_norm, k_norm, qk_eps, cos, sin, keys, values,
                                         capacity, scale, parents, window, out, threads);
}

/* RMSNorm of each row of x [rows, dim] into out (the build's rms_norm_impl). */
int rms_norm_rows(const float *x, const float *weight, int rows, int dim, float eps, float *out) {
    if (!x || !weight || !out) return KERNEL_NULL_POINTER;
    if (rows <= 0 || dim <= 0) return KERNEL_BAD_SIZE;
    rms_norm_impl(x, weight, rows, dim, eps, out);
    return KERNEL_OK;
}

/* x += delta, then out = RMSNorm(x) * weight (cpu_common.c). */
int add_rms_norm_rows(float *x, const float *delta, const float *weight, int rows, int dim, float eps, float *out) {
    if (!x || !delta || !weight || !out) return KERNEL_NULL_POINTER;
    if (rows <= 0 || dim <= 0) return KERNEL_BAD_SIZE;
    add_rms_norm_impl(x, delta, weight, rows, dim, eps, out);
    return KERNEL_OK;
}

/* gate_up [rows, 2 inner] -> out [rows, inner] = gelu(gate) * up, gelu's tanh form (cpu_common.c). */
int geglu_rows(const float *gate_up, int rows, int inner, float *out) {
    if (!gate_up || !out) return KERNEL_NULL_POINTER;
    if (rows <= 0 || inner <= 0) return KERNEL_BAD_SIZE;
    geglu_impl(gate_up, rows, inner, out);
    return KERNEL_OK;
}

/* gate_up [rows, 2 inner] -> out [rows, inner] = silu(gate) * up (the build's swiglu_impl). */
int swiglu_rows(const float *gate_up, int rows, int inner, float *out) {
    if (!gate_up || !out) return KERNEL_NULL_POINTER;
    if (rows <= 0 || inner <= 0) return KERNEL_BAD_SIZE;
    swiglu_impl(gate_up, rows, inner, out);
    return KERNEL_OK;
}

/* A mixture of experts met by rows of width `hidden`: a router with a score per expert, and
 * every expert's gate/up parts an even width (the same for all) whose half its down matrix
 * reads, back to `hidden`. */
static int check_experts(const Experts *E, int hidden) {
    if (!E->gate_up || !E->down) return KERNEL_NULL_POINTER;
    if (E->count < 1 || E->used < 1 || E->used > E->count || E->parts < 1 || E->parts > MAX_PARTS)
        return KERNEL_BAD_SIZE;
    int status = check_matrix(&E->router, hidden), width = -1;
    if (!status && E->router.N != E->count) return KERNEL_BAD_SHAPE;
    for (int e = 0; e < E->count && !status; e++) {
        int gate_up = 0;
        for (int p = 0; p < E->parts && !status; p++) {
            status = check_matrix(&E->gate_up[(size_t)e * E->parts + p], hidden);
            gate_up += E->gate_up[(size_t)e * E->parts + p].N;
        }
        if (!status) status = check_matrix(&E->down[e], gate_up / 2);
        if (!status && (gate_up % 2 || (width >= 0 && gate_up != width) || E->down[e].N != hidden))
            return KERNEL_BAD_SHAPE;
        width = gate_up;
    }
    return status;
}

/* out [n, hidden] = the mixture of experts `experts` over rows h [n, hidden] with the MLP
 * activation `activation` (ACT_*; cpu_experts.c). */
int expert_mlp(const float *h, int n, int hidden, const Experts *experts, int activation, float *out, int threads) {
    if (!h || !experts || !out) return KERNEL_NULL_POINTER;
    if (n <= 0 || hidden <= 0 || threads <= 0) return KERNEL_BAD_SIZE;
    if (activation != ACT_SWIGLU && activation != ACT_GEGLU_TANH) return KERNEL_BAD_ARGUMENT;
    const int status = check_experts(experts, hidden);
    return status ? status : expert_mlp_impl(h, n, hidden, experts, activation, out, threads);
}

/* A layer of the table: its norms, and its projections' widths fitting the model's (the
 * query/key/value parts (H + 2 KVH) D wide over `hidden` inputs, the output projection back
 * to `hidden`, the gate/up parts an even width whose half the down projection reads). */
static int check_layer(const Layer *L, int hidden, int H, int KVH, int D, int rope_tables) {
    if (!L->norm1 || !L->norm2) return KERNEL_NULL_POINTER;
    if ((L->activation != ACT_SWIGLU && L->activation != ACT_GEGLU_TANH) || L->window < 0 || L->rope < 0
        || L->rope >= rope_tables)
        return KERNEL_BAD_ARGUMENT;
    const int dense = !L->experts;
    if (L->qkv_parts < 1 || L->qkv_parts > MAX_PARTS
        || (dense && (L->gate_up_parts < 1 || L->gate_up_parts > MAX_PARTS)))
        return KERNEL_BAD_SIZE;
    int qkv = 0, gate_up = 0, status = KERNEL_OK;
    for (int p = 0; p < L->qkv_parts && !status; p++) {
        status = check_matrix(&L->qkv[p], hidden);
        qkv += L->qkv[p].N;
    }
    for (int p = 0; p < L->gate_up_parts && dense && !status; p++) {
        status = check_matrix(&L->gate_up[p], hidden);
        gate_up += L->gate_up[p].N;
    }
    if (!status) status = check_matrix(&L->out, H * D);
    if (!status) status = dense ? check_matrix(&L->down, gate_up / 2) : check_experts(L->experts, hidden);
    if (status) return status;
    if (qkv != (H + 2 * KVH) * D || L->out.N != hidden || (dense && (gate_up % 2 || L->down.N != hidden)))
        return KERNEL_BAD_SHAPE;
    return KERNEL_OK;
}

/* Layers 0 .. count - 1 of `layers` over the residual stream x [n, hidden] (cpu_decoder.c);
 * cos, sin [rope_tables, n, D]. */
int decoder_layers(float *x, int n, int hidden, int start, const Layer *layers, int count, int H, int KVH, int D,
                   float *keys, float *values, int capacity, const float *cos, const float *sin, int rope_tables,
                   float scale, const int *parents, int threads) {
    if (!x || !layers || !keys || !values || !cos || !sin) return KERNEL_NULL_POINTER;
    if (hidden <= 0 || count <= 0 || rope_tables <= 0) return KERNEL_BAD_SIZE;
    int status = check_attention(n, start, H, KVH, D, capacity, parents, 0, threads);
    for (int i = 0; i < count && !status; i++) status = check_layer(&layers[i], hidden, H, KVH, D, rope_tables);
    return status ? status
                  : decoder_layers_impl(x, n, hidden, start, layers, count, H, KVH, D, keys, values, capacity, cos, sin,
                                        scale, parents, threads);
}
