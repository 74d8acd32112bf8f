/* What cpu_kernels.c (AVX2) and cpu_kernels_vnni.c (AVX-512 VNNI) share: the weight layout
 * the block products read, the quantized activations, and the per-column float steps both run
 * in the same order, so that the two builds give the same numbers bit for bit.
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

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

/* One specialisation of a product per scale form (and, inside, per row count: `cases`). */
#define FORM_CASES(form, cases, call)                                                                       \
    switch (form) {                                                                                         \
    case SCALES_FLOAT16: cases(call, SCALES_FLOAT16); break;                                                \
    case SCALES_FACTORED: cases(call, SCALES_FACTORED); break;                                              \
    default: cases(call, SCALES_FLOAT32); break;                                                            \
    }

/* The activations of a product: the float rows x [M, K] (what float weights meet) and, for
 * weights in 4- or 8-bit groups, the rows quantized per group of 32: int8 codes qx (-127..127),
 * scale dx, code sum sx and ax = dx * sx (the offsets' weight); NULL when not quantized. */
typedef struct {
    const float *x;
    int8_t *qx;
    float *dx, *ax;
    int32_t *sx;
    int32_t *sx16; /* the code sums of each half group (16 values): what 6-bit weights' codes - 32 need */
} Activations;

/* Float weights (`bits` 16: bfloat16, 32: float32) in the block layout: block b holds, for
 * k = 0 .. K - 1, its 16 columns' weights side by side at (b K + k) 16. Per column and row the
 * sum runs over k in order, one fused multiply-add at a time: again nothing depends on the
 * number of rows. */
#define FLOAT_WEIGHTS(bits) ((bits) == 16 || (bits) == 32)

/* Defined in cpu_kernels.c, used by cpu_decoder.c as well. `quantize` 0 leaves the codes
 * out (every weight the activations meet is float). */
int prepare_activations(const float *x, int M, int K, int quantize, Activations *a);
void free_activations(Activations *a);
void block_products(const Activations *a, int M, int K, const void *codes, const void *scale, const void *offset,
                    int form, int bits, int N, int groups, float *y, int ldy, int threads);
void rms_norm_rows(const float *x, const float *weight, int rows, int dim, float eps, float *out);
void add_rms_norm_rows(float *x, const float *delta, const float *weight, int rows, int dim, float eps, float *out);
void swiglu_rows(const float *gate_up, int rows, int inner, float *out);
/* Defined in cpu_kernels_six.c. */
void block6_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                int N, float *y, int ldy);
void six_group_values(const uint8_t *codes, const uint8_t *scales, int G, int b, int g, int c, float *value);
/* Defined in cpu_attention.c. */
int attention_block(const float *qkv, int n, int start, int H, int KVH, int D, const float *cos, const float *sin,
                    float *keys, float *values, int capacity, float scale, const int *parents, float *out,
                    int threads);

/* A weight's codes stream through once per forward, far more bytes than the caches hold and
 * none of them read again soon, so each group of a 4-bit product asks for the group
 * PREFETCH_AHEAD bytes further on (in the same stream: a thread walks its blocks in order), so
 * that it arrives in time for the multiply; non-temporally, since nothing reads it again this
 * forward (whole runs were faster with that hint than with an ordinary prefetch). The 8-bit
 * products do not: with the same prefetch, whole runs whose output head is 8-bit were slower
 * than without it. Prefetching never faults, so reading past a weight's end is harmless. Both
 * macros may be set with -D to try other values. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_NTA
#endif

static inline __attribute__((always_inline)) void prefetch_codes(const void *group, int lines) {
    for (int k = 0; k < lines; k++) _mm_prefetch((const char *)group + PREFETCH_AHEAD + 64 * k, PREFETCH_HINT);
}

/* The columns of one block that exist (the last block of a weight may be partial). */
static inline int block_columns(int b, int N) {
    return N - b * BLOCK < BLOCK ? N - b * BLOCK : BLOCK;
}

static inline __attribute__((always_inline)) int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The horizontal sum of a vector (attention's normalizer, RMSNorm's sum of squares). */
static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __attribute__((always_inline)) float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp(x) for x <= 0 (Cephes' single-precision polynomial): the same operations for every
 * lane, so a score's weight never depends on its neighbours. */
static inline __attribute__((always_inline)) __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

#endif
