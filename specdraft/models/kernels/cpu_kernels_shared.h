/* What every build of the kernels shares (plain C: no intrinsics, so the scalar build includes
 * it on any CPU; cpu_kernels_vector.h adds the vector helpers): the weight layout the block
 * products read, the quantized activations, the per-column float steps every build runs in the
 * same order, so that the scalar (cpu_kernels_scalar.c), AVX2 (cpu_kernels.c) and AVX-512 VNNI
 * (cpu_kernels_vnni.c) builds give the same numbers bit for bit, the structs Python mirrors
 * (native_layers.py), the status codes of the exported functions (cpu_boundary.c) and the
 * constants the C files share.
 *
 * The weight layout ("columns in lanes", as llama.cpp's repacked GEMMs): output columns go in
 * blocks of BLOCK = 16. For a 4-bit weight with G groups of 32 per column, block b's group g
 * is 256 bytes at codes + (b G + g) 256, four chunks of 64: chunk k holds, for each column c of
 * the block, bytes 4k .. 4k + 3 of that column's 16-byte group (byte j: code j in the low
 * nibble, code j + 16 in the high one) at + 64 k + 4 c. For an 8-bit weight the group is 512
 * bytes, eight chunks of 64, chunk k holding codes 4k .. 4k + 3 of each column. Scales and
 * offsets come in one of three forms (`form`, models/kernels/scale_forms.py), the same numbers each:
 * SCALES_FLOAT32, block b's group g column c at (b G + g) 16 + c; SCALES_FLOAT16 at the same
 * place, where every one of a weight's is a float16 exactly (the file's own scales mostly are),
 * widened exactly; SCALES_FACTORED (4-bit weights only, G a multiple of SUPER_GROUPS in every
 * term: K-quants, whose scales d x sc mostly are not float16), block b's FACTORED_BYTES x G bytes
 * holding first a uint8 factor per group and column at g 16 + c, then a float16 d per super-block
 * of SUPER_GROUPS groups and column at G 16 + 2 ((g / SUPER_GROUPS) 16 + c): the value is factor x
 * d in float32, exact (at most 8 + 11 significant bits). A vector lane is then one
 * column: a 4-byte dot product of its codes with four activation bytes (broadcast) adds into
 * that column's lane, so one group's integer sum per column is ready without any shuffle, and
 * the float work (convert, scale, add) is one vector operation for 8 or 16 columns.
 *
 * Per column and row the float steps are, for each group g in order:
 *   acc = fma(float(isum), dx[m, g'] * s[g, c], acc);  acc = fma(ax[m, g'], o[g, c], acc)
 * (g' = g modulo the activation groups: a weight of several terms repeats them; 8-bit weights
 * have no offsets). isum is the exact integer sum of the group's 32 products, however a build
 * forms it. So each output depends only on its own row and column, never on the number of rows
 * or on which rows share a call: a verify over K + 1 rows gives each row what a one-row step
 * gives, bit for bit.
 */
#ifndef SPECDRAFT_CPU_KERNELS_SHARED_H
#define SPECDRAFT_CPU_KERNELS_SHARED_H

#include <stdint.h>
#include <string.h>

/* Which build this is (-DSPECDRAFT_ISA=..., set by native.py per library; every library holds
 * one instruction set's kernels, fixed when it is compiled). */
#define ISA_SCALAR 0
#define ISA_AVX2 1
#define ISA_VNNI 2
#define ISA_NEON 3 /* AArch64 (with the dot-product instruction where the build was told so) */
#ifndef SPECDRAFT_ISA
#define SPECDRAFT_ISA ISA_SCALAR
#endif

#define GROUP 32
#define BLOCK 16 /* output columns of one weight block */

#define SCALES_FLOAT32 0
#define SCALES_FLOAT16 1
#define SCALES_FACTORED 2
#define SUPER_GROUPS 8    /* groups sharing one d in the factored form */
#define FACTORED_BYTES 20 /* per group and block in the factored form: 16 factors, 16 / 8 float16 d's */

/* 6-bit weights (`bits` 6: GGUF's Q6_K, and Q3_K, whose codes fit): block b's group g is
 * SIX_GROUP_BYTES at codes + (b G + g) SIX_GROUP_BYTES: first the 4-bit layout above holding
 * each code's low four bits, then for each half h of the block's columns 64 bytes at 256 + 64 h,
 * two parts of 32 (part p: codes 16 p .. 16 p + 15) holding, for column 8 h + c at 4 c, byte i's
 * bits 2k, 2k + 1 = the top two bits of code 16 p + 4 k + i. The value is (code - 32) x factor
 * x d: block b's SIX_SCALE_BYTES x G scale bytes hold first an int8 factor per group, part and
 * column at g 32 + p 16 + c, then a float16 d per super-block of SUPER_GROUPS groups and column
 * at G 32 + 2 ((g / SUPER_GROUPS) 16 + c). */
#define SIX_GROUP_BYTES 384
#define SIX_SCALE_BYTES 36

/* Rows one call of a block product takes at once (a block's codes are expanded once for them):
 * the row count changes only speed, never a row's numbers. */
#define ROWS 4        /* AVX2, 4- and 8-bit weights */
#define VNNI_ROWS 8   /* AVX-512 VNNI: 32 registers hold more */
#define SIX_ROWS 4    /* AVX2, 6-bit weights */
#define FLOAT_ROWS 6  /* float weights: 6 rows x 2 halves of accumulators */
#define SCALAR_ROWS 8 /* the scalar build */

/* Attention: D (the head size) a multiple of 8 (the lanes of a key's dot product) and at most
 * MAX_HEAD_DIM (the value sums' accumulators live in registers, D / 8 of them). */
#define HEAD_LANES 8
#define MAX_HEAD_DIM 256
#define ROW_TILE 16   /* rows one attention work item attends together */
#define VALUE_SPAN 64 /* keys whose values stay in L1 while each of a tile's rows adds them */

#define MAX_PARTS 3 /* a projection stored as up to three matrices side by side (q, k, v) */

/* The status every exported function returns (cpu_boundary.c checks the arguments before any
 * work; native.py names each in the error it raises). */
enum {
    KERNEL_OK = 0,
    KERNEL_NO_MEMORY = -1,       /* scratch memory could not be had */
    KERNEL_NULL_POINTER = -2,    /* a pointer the call reads or writes is NULL */
    KERNEL_BAD_SIZE = -3,        /* a size, count or thread count not positive */
    KERNEL_BAD_WIDTH = -4,       /* an input width K not a multiple of GROUP (32) */
    KERNEL_BAD_FORMAT = -5,      /* bits, scale form or group count not a layout the products read */
    KERNEL_BAD_HEAD_DIM = -6,    /* a head size not a multiple of HEAD_LANES, or over MAX_HEAD_DIM */
    KERNEL_BAD_HEADS = -7,       /* query heads not a multiple of the key/value heads */
    KERNEL_BAD_POSITION = -8,    /* start negative, or start + n past the KV capacity */
    KERNEL_BAD_PARENT = -9,      /* a token tree row's parent not an earlier row */
    KERNEL_BAD_ROW = -10,        /* a row id outside 0 .. N - 1 */
    KERNEL_BAD_SHAPE = -11,      /* widths that do not fit together (a layer's projections) */
    KERNEL_UNSUPPORTED_TYPE = -12, /* repack: a GGML type not repacked here */
    KERNEL_NOT_HALF = -13,       /* repack: a value float16 scales cannot hold exactly */
    KERNEL_BAD_ARGUMENT = -14    /* a value the call does not take (repack: sizes or forms; a layer: activation, window, rope table) */
};

/* One specialisation of a product per scale form (and, inside, per row count: `cases`). */
#define FORM_CASES(form, cases, call)                                                                       \
    switch (form) {                                                                                         \
    case SCALES_FLOAT16: cases(call, SCALES_FLOAT16); break;                                                \
    case SCALES_FACTORED: cases(call, SCALES_FACTORED); break;                                              \
    default: cases(call, SCALES_FLOAT32); break;                                                            \
    }

/* The activations of a product: the float rows x [M, K] (what float weights meet) and, for
 * weights in 4- or 8-bit groups, the rows quantized per group of 32: int8 codes qx (-127..127),
 * scale dx, code sum sx and ax, the offsets' weight (dx * sx; ACTIVATIONS_Q8_1: d x sx rounded
 * to float16); NULL when not quantized. */
typedef struct {
    const float *x;
    int8_t *qx;
    float *dx, *ax;
    int32_t *sx;
    int32_t *sx16; /* the code sums of each half group (16 values): what 6-bit weights' codes - 32 need
                    * (NULL unless prepared for one) */
} Activations;

/* Float weights (`bits` 16: bfloat16, 32: float32) in the block layout: block b holds, for
 * k = 0 .. K - 1, its 16 columns' weights side by side at (b K + k) 16. Per column and row the
 * sum runs over k in order, one fused multiply-add at a time: again nothing depends on the
 * number of rows. */
#define FLOAT_WEIGHTS(bits) ((bits) == 16 || (bits) == 32)

/* How the activations a quantized weight meets are rounded to int8 (Matrix.activations,
 * cpu_common.c). ACTIVATIONS_OWN: per group of 32, a float32 scale amax / 127 (weights that
 * are not a GGUF file's). The others round as llama.cpp does for the file's format, so that a
 * file's model is llama.cpp's up to the order of float sums: ACTIVATIONS_Q8_0 (Q4_0, Q5_0,
 * Q8_0, IQ4_NL: per 32, the scale rounded to float16), ACTIVATIONS_Q8_1 (Q4_1, Q5_1: as Q8_0,
 * and the offsets' weight d x sum rounded to float16), ACTIVATIONS_Q8_K (K-quants, IQ4_XS: one
 * scale per SUPER_GROUPS groups, 256 values). ACTIVATIONS_FLOAT: none (float weights read the
 * float rows). */
#define ACTIVATIONS_FLOAT (-1)
#define ACTIVATIONS_OWN 0
#define ACTIVATIONS_Q8_0 1
#define ACTIVATIONS_Q8_1 2
#define ACTIVATIONS_Q8_K 3

/* A weight in the block layout (block_linear.BlockLinear): `bits` 4 (offsets), 6, 8, or 16 / 32
 * (bfloat16 / float32 weights, no scales); `form`: how its scales and offsets are held;
 * `activations`: how the activations it meets are quantized (ACTIVATIONS_*). Python mirrors it
 * and Layer with ctypes (native_layers.py), checked against `struct_layout`. */
typedef struct {
    const void *codes, *scale, *offset; /* offset NULL unless 4 bits */
    const float *bias;                  /* NULL when none */
    int N, groups, bits, form, activations;
} Matrix;

/* The MLP's gated activation: silu(gate) x up (Llama), or gelu(gate) x up with gelu's tanh
 * form (Gemma). */
#define ACT_SWIGLU 0
#define ACT_GEGLU_TANH 1

/* The experts of a mixture-of-experts MLP (Qwen3-MoE; cpu_experts.c): a row's scores over the
 * `count` experts are its product with `router`; the `used` highest (ties: the lower expert)
 * are its experts, weighted by their softmax probabilities, renormalized to sum to 1 where
 * `normalize`. Expert e is a gated MLP: its gate and up matrices side by side in gate_up[e *
 * parts .. e * parts + parts - 1], then down[e]. */
typedef struct {
    Matrix router;
    const Matrix *gate_up, *down;
    int count, used, parts, normalize;
} Experts;

/* One decoder layer of the lean forward (cpu_decoder.c). q_norm, k_norm: an RMSNorm over each
 * head's D values of the queries and keys before their rotary positions (Qwen3, Gemma 3), with
 * epsilon qk_eps; NULL where the architecture has none. post_norm1, post_norm2: an RMSNorm of
 * the attention's and the MLP's output before each is added to the residual stream (Gemma 3;
 * epsilon eps1, eps2 as the norms before them; NULL: none). window: the keys a row attends are
 * its last `window` positions (a sliding window; 0: all). rope: which of the rotary tables the
 * call is given this layer's positions come from (Gemma 3: local and global layers). experts:
 * the MLP is a mixture of experts (gate_up and down unused), NULL: a dense MLP. */
typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    Matrix qkv[MAX_PARTS], gate_up[MAX_PARTS], out, down;
    int qkv_parts, gate_up_parts;
    const float *q_norm, *k_norm;
    float qk_eps;
    const float *post_norm1, *post_norm2;
    int activation, window, rope;
    const Experts *experts;
} Layer;

/* Per build (cpu_kernels.c, cpu_kernels_scalar.c, cpu_kernels_neon.c): the largest |x| over groups
 * of 32 values and their int8 codes (x times `inverse`, rounded to nearest even, within
 * -127..127, with each group's code sum), from which cpu_common.c quantizes activations by every
 * rule; the block products, RMSNorm, SwiGLU and attention over cached keys. */
float amax_of(const float *x, int groups);
void quantize_groups(const float *x, int groups, float inverse, int8_t *q, int32_t *s);
void block_products(const Activations *a, int M, int K, const void *codes, const void *scale, const void *offset,
                    int form, int bits, int N, int groups, float *y, int ldy, int threads);
void rms_norm_impl(const float *x, const float *weight, int rows, int dim, float eps, float *out);
void swiglu_impl(const float *gate_up, int rows, int inner, float *out);
int causal_attention_impl(const float *q, const float *keys, const float *values, int n, int start, int H, int KVH,
                          int D, int capacity, float scale, const int *parents, int window, float *out, int threads);
/* Shared by every build (cpu_common.c, cpu_decoder.c, cpu_experts.c): `rule` one of ACTIVATIONS_*
 * (ACTIVATIONS_FLOAT leaves the codes out: every weight the activations meet is float). */
int prepare_activations(const float *x, int M, int K, int rule, int halves, Activations *a);
int activations_of(const Matrix *w); /* the rule a weight's products quantize by */
void free_activations(Activations *a);
void six_codes(const uint8_t *group, int c, int32_t *code);  /* a 6-bit group's 32 codes 0..63 of column c */
void add_rms_norm_impl(float *x, const float *delta, const float *weight, int rows, int dim, float eps, float *out);
int attention_block_impl(const float *qkv, int n, int start, int H, int KVH, int D, const float *q_norm,
                         const float *k_norm, float qk_eps, const float *cos, const float *sin, float *keys,
                         float *values, int capacity, float scale, const int *parents, int window, float *out,
                         int threads);
void geglu_impl(const float *gate_up, int rows, int inner, float *out);
int project_impl(const float *x, int n, int K, const Matrix *parts, int count, float *y, int threads);
void gated_impl(const float *gate_up, int rows, int inner, int activation, float *out);
int expert_mlp_impl(const float *h, int n, int hidden, const Experts *experts, int activation, float *out,
                    int threads);
/* One row of one head: `slots` NULL (a chain: slot j is key j) or the row's key slots, `length`
 * keys, `weights` scratch of length rounded up to 8, out [D] (the scalar and NEON builds'). */
typedef void (*AttendRow)(const float *q, const float *kh, const float *vh, const int *slots, int length, int D,
                          float scale, float *weights, float *out);
int attention_by_rows(AttendRow attend, const float *q, const float *keys, const float *values, int n, int start, int H,
                      int KVH, int D, int capacity, float scale, const int *parents, int window, float *out,
                      int threads);
int block_rows_impl(const void *codes, const void *scale, const void *offset, int form, int bits, int N, int groups,
                    int terms, const int64_t *ids, int n, float *out);
int decoder_layers_impl(float *x, int n, int hidden, int start, const Layer *layers, int count, int H, int KVH,
                        int D, float *keys, float *values, int capacity, const float *cos, const float *sin,
                        float scale, const int *parents, int threads);
/* The AVX2 and VNNI 6-bit products (cpu_kernels_six.c) and those of VNNI (cpu_kernels_vnni.c). */
void block6_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                int N, float *y, int ldy);
void block6_vnni_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows,
                     int b, int N, float *y, int ldy);
void block4_vnni_any(const uint8_t *codes, const void *scale, const void *offset, int form, int G, int xgroups,
                     const Activations *a, int m0, int rows, int b, int N, float *y, int ldy);
void block8_vnni_any(const int8_t *codes, const void *scale, int form, int G, const Activations *a, int m0, int rows,
                     int b, int N, float *y, int ldy);

/* The columns of one block that exist (the last block of a weight may be partial). */
static inline int block_columns(int b, int N) {
    return N - b * BLOCK < BLOCK ? N - b * BLOCK : BLOCK;
}

static inline __attribute__((always_inline)) int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A float16's value as a float32, exactly (as F16C's conversion gives it for every finite
 * value), in plain C. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The first of a row's `length` key slots it attends under a sliding window of `window`
 * positions (0: none). Slot k of a row's list (tree_slots', or a chain's 0 .. start + i) is at
 * position k, the row itself last, so the window keeps the last `window` of them. */
static inline int window_start(int length, int window) {
    return window > 0 && length > window ? length - window : 0;
}

/* The key slots row i of a token tree attends, in order: the cached positions 0 .. start - 1,
 * then the block's slots of its path from the root (row 0) down to itself. Returns how many. */
static inline int tree_slots(const int *parents, int start, int i, int *slots) {
    int depth = 0;
    for (int node = i; node > 0; node = parents[node]) depth++;
    for (int j = 0; j < start; j++) slots[j] = j;
    for (int node = i, d = depth; d >= 0; node = node > 0 ? parents[node] : 0, d--) slots[start + d] = start + node;
    return start + depth + 1;
}

#endif
