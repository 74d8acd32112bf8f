/* specdraft's CPU kernels (models/native.py loads them): the product for weights in 4-bit
 * groups (models/block_linear.py) and causal attention for the lean forward (lean_decoder.py).
 *
 * The product:
 *
 * y[m, n] = sum over groups g of  dx[m, g] * ( s[n, g] * <c[n, g], qx[m, g]> + o[n, g] * sx[m, g] )
 *
 * c: a weight group's 32 codes in 0..15 (16 bytes: byte j holds code j low, code j + 16 high);
 * s, o: its scale and offset (the weight is c * s + o);
 * qx: the activations quantized per row and group of 32 to int8 with scale dx, sx their sum.
 * A weight with several terms repeats the activation groups (g modulo the groups of a row).
 *
 * Width invariance: every output y[m, n] is computed by one thread with the same sequence of
 * operations whatever the number of rows M and whichever rows share a block; the integer dot
 * products are exact, and the float sums run over groups in one fixed order. So a verify over
 * K + 1 rows gives each row bit for bit what a one-row step gives.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define ROWS 4 /* activation rows sharing one expansion of the weight codes */

static void quantize_row(const float *x, int groups, int8_t *q, float *d, int32_t *s) {
    for (int g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0.0f;
        for (int k = 0; k < GROUP; k++) {
            float a = fabsf(xg[k]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / 127.0f;
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
        for (int k = 0; k < GROUP; k++) {
            int v = (int)nearbyintf(xg[k] * inverse);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[g * GROUP + k] = (int8_t)v;
            sum += v;
        }
        d[g] = scale;
        s[g] = sum;
    }
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* One weight group gx of term t met by every row, into accumulator `which`. */
#define GROUP_STEP(gx_, which)                                                                     \
    do {                                                                                           \
        __m128i packed = _mm_loadu_si128((const __m128i *)(ct + (gx_) * 16));                     \
        __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_mask); \
        const __m256 s = _mm256_set1_ps(st[(gx_)]);                                                \
        for (int r = 0; r < rows; r++) {                                                           \
            const int m = m0 + r;                                                                  \
            __m256i q = _mm256_loadu_si256((const __m256i *)(qx + (size_t)m * xk + (gx_) * GROUP)); \
            __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), ones);                    \
            const __m256 d = _mm256_mul_ps(_mm256_set1_ps(dx[(size_t)m * xgroups + (gx_)]), s);     \
            acc##which[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc##which[r]);           \
        }                                                                                          \
    } while (0)

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Rows m0 .. m0 + ROWS_ - 1 of the output, columns n0 .. n1 - 1. `ax` [M, xgroups] is dx * sx.
 * Inlined for each row count, so the accumulators stay in registers; every row is computed
 * by the same sequence whatever the count (two accumulators, even and odd groups). */
static inline __attribute__((always_inline)) void block(
        const uint8_t *codes, const float *scale, const float *offset, int groups, int xgroups,
        const int8_t *qx, const float *dx, const float *ax, int m0, const int rows, int n0, int n1,
        float *y, int ldy) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int xk = xgroups * GROUP, terms = groups / xgroups;
    for (int n = n0; n < n1; n++) {
        const uint8_t *cn = codes + (size_t)n * groups * 16;
        const float *sn = scale + (size_t)n * groups, *on = offset + (size_t)n * groups;
        __m256 acc0[ROWS], acc1[ROWS];
        for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int t = 0; t < terms; t++) {
            const uint8_t *ct = cn + (size_t)t * xgroups * 16;
            const float *st = sn + t * xgroups;
            /* Even groups into acc[r][0], odd ones into acc[r][1]: two chains hide the FMA latency. */
            for (int gx = 0; gx < xgroups; gx += 2) {
                const int pair = gx + 1 < xgroups;
                GROUP_STEP(gx, 0);
                if (pair) GROUP_STEP(gx + 1, 1);
            }
        }
        __m256 tail[ROWS];
        for (int r = 0; r < rows; r++) tail[r] = _mm256_setzero_ps();
        for (int t = 0; t < terms; t++) {
            /* the offsets' share: sum over groups of ax[m, g] * o[n, g], 8 groups a step */
            const float *ot = on + t * xgroups;
            int gx = 0;
            for (; gx + 8 <= xgroups; gx += 8) {
                const __m256 o = _mm256_loadu_ps(ot + gx);
                for (int r = 0; r < rows; r++)
                    tail[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ax + (size_t)(m0 + r) * xgroups + gx), o, tail[r]);
            }
            if (gx < xgroups) {
                float o_rest[8] = {0}, a_rest[8] = {0};
                memcpy(o_rest, ot + gx, sizeof(float) * (xgroups - gx));
                const __m256 o = _mm256_loadu_ps(o_rest);
                for (int r = 0; r < rows; r++) {
                    memcpy(a_rest, ax + (size_t)(m0 + r) * xgroups + gx, sizeof(float) * (xgroups - gx));
                    tail[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a_rest), o, tail[r]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            y[(size_t)(m0 + r) * ldy + n] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + hsum(tail[r]);
    }
}

static void block_any(const uint8_t *codes, const float *scale, const float *offset, int groups, int xgroups,
                      const int8_t *qx, const float *dx, const float *ax, int m0, int rows, int n0, int n1,
                      float *y, int ldy) {
    switch (rows) {
    case 1: block(codes, scale, offset, groups, xgroups, qx, dx, ax, m0, 1, n0, n1, y, ldy); break;
    case 2: block(codes, scale, offset, groups, xgroups, qx, dx, ax, m0, 2, n0, n1, y, ldy); break;
    case 3: block(codes, scale, offset, groups, xgroups, qx, dx, ax, m0, 3, n0, n1, y, ldy); break;
    default: block(codes, scale, offset, groups, xgroups, qx, dx, ax, m0, 4, n0, n1, y, ldy); break;
    }
}

/* Activations quantized for the products: per row and group of 32, int8 codes qx, scale dx,
 * code sum sx and ax = dx * sx (the offsets' weight). */
typedef struct {
    int8_t *qx;
    float *dx, *ax;
    int32_t *sx;
} Activations;

static void free_activations(Activations *a) {
    free(a->qx); free(a->dx); free(a->sx); free(a->ax);
}

/* Returns 0, or -1 when memory cannot be had (then nothing is left allocated). */
static int quantize_activations(const float *x, int M, int K, Activations *a) {
    const int groups = K / GROUP;
    a->qx = (int8_t *)malloc((size_t)M * K);
    a->dx = (float *)malloc(sizeof(float) * (size_t)M * groups);
    a->sx = (int32_t *)malloc(sizeof(int32_t) * (size_t)M * groups);
    a->ax = (float *)malloc(sizeof(float) * (size_t)M * groups);
    if (!a->qx || !a->dx || !a->sx || !a->ax) {
        free_activations(a);
        return -1;
    }
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * K, groups, a->qx + (size_t)m * K, a->dx + (size_t)m * groups,
                     a->sx + (size_t)m * groups);
    for (size_t i = 0; i < (size_t)M * groups; i++) a->ax[i] = a->dx[i] * (float)a->sx[i];
    return 0;
}

/* x [M, K] float32 -> y [M, N] float32 for a weight of `groups` groups per row (K / 32 per
 * term). Columns are split evenly between threads in chunks of 16, rows go in blocks of ROWS.
 * Returns 0, or -1 when scratch memory cannot be had. */
int block_matmul(const float *x, int M, int K, const uint8_t *codes, const float *scale, const float *offset,
                 int N, int groups, float *y, int threads) {
    Activations a;
    if (quantize_activations(x, M, K, &a)) return -1;
    const int chunks = (N + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int chunk = 0; chunk < chunks; chunk++) {
        const int n0 = chunk * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int m0 = 0; m0 < M; m0 += ROWS)
            block_any(codes, scale, offset, groups, K / GROUP, a.qx, a.dx, a.ax, m0, M - m0 < ROWS ? M - m0 : ROWS,
                      n0, n1, y, N);
    }
    free_activations(&a);
    return 0;
}

/* The same product for weights stored as int8 codes with one scale per group of 32 (GGUF
 * Q8_0, and the int8 rows other formats become): y[m, n] = sum_g dx[m, g] s[n, g] <w[n, g],
 * qx[m, g]>, with |w| and sign(qx, w) fed to maddubs. Same invariance as block_matmul. */
#define GROUP_STEP8(gx_, which)                                                                     \
    do {                                                                                            \
        __m256i w = _mm256_loadu_si256((const __m256i *)(cn + (size_t)(gx_) * GROUP));               \
        __m256i aw = _mm256_sign_epi8(w, w);                                                        \
        const __m256 s = _mm256_set1_ps(sn[(gx_)]);                                                 \
        for (int r = 0; r < rows; r++) {                                                            \
            const int m = m0 + r;                                                                   \
            __m256i q = _mm256_loadu_si256((const __m256i *)(qx + (size_t)m * K + (gx_) * GROUP));    \
            __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)), ones); \
            const __m256 d = _mm256_mul_ps(_mm256_set1_ps(dx[(size_t)m * groups + (gx_)]), s);        \
            acc##which[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc##which[r]);            \
        }                                                                                           \
    } while (0)

static inline __attribute__((always_inline)) void block8(
        const int8_t *codes, const float *scale, int groups, const int8_t *qx, const float *dx, int m0,
        const int rows, int n0, int n1, float *y, int ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int K = groups * GROUP;
    for (int n = n0; n < n1; n++) {
        const int8_t *cn = codes + (size_t)n * K;
        const float *sn = scale + (size_t)n * groups;
        __m256 acc0[ROWS], acc1[ROWS];
        for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int gx = 0; gx < groups; gx += 2) {
            GROUP_STEP8(gx, 0);
            if (gx + 1 < groups) GROUP_STEP8(gx + 1, 1);
        }
        for (int r = 0; r < rows; r++) y[(size_t)(m0 + r) * ldy + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
    }
}

static void block8_any(const int8_t *codes, const float *scale, int groups, const int8_t *qx, const float *dx,
                       int m0, int rows, int n0, int n1, float *y, int ldy) {
    switch (rows) {
    case 1: block8(codes, scale, groups, qx, dx, m0, 1, n0, n1, y, ldy); break;
    case 2: block8(codes, scale, groups, qx, dx, m0, 2, n0, n1, y, ldy); break;
    case 3: block8(codes, scale, groups, qx, dx, m0, 3, n0, n1, y, ldy); break;
    default: block8(codes, scale, groups, qx, dx, m0, 4, n0, n1, y, ldy); break;
    }
}

int block_matmul8(const float *x, int M, int K, const int8_t *codes, const float *scale, int N, float *y,
                  int threads) {
    Activations a;
    if (quantize_activations(x, M, K, &a)) return -1;
    const int chunks = (N + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int chunk = 0; chunk < chunks; chunk++) {
        const int n0 = chunk * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int m0 = 0; m0 < M; m0 += ROWS)
            block8_any(codes, scale, K / GROUP, a.qx, a.dx, m0, M - m0 < ROWS ? M - m0 : ROWS, n0, n1, y, N);
    }
    free_activations(&a);
    return 0;
}

/* exp(x) for x <= 0 (Cephes' single-precision polynomial): the same operations for every
 * lane, so a score's weight never depends on its neighbours. */
static inline __m256 exp_nonpositive(__m256 x) {
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

/* The dot product of two D-vectors (D a multiple of 8), reduced in one fixed order. */
static inline __m256 dot_lanes(const float *a, const float *b, int D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return acc;
}

/* Causal attention for a decode or verify block, one query row at a time.
 *
 * q [n, H, D]: the block's queries at positions start .. start + n - 1 (D a multiple of 8, at
 * most 256); keys and values [KVH, capacity, D]: every cached position, the block's own
 * included; out [n, H, D]. Row i attends positions 0 .. start + i. Each (row, head) is
 * computed alone, in an order that depends only on its own length (scores eight keys at a
 * time, their maximum, exponentials and their sum, the weighted values), so a row gets bit
 * for bit the same output in a block of any width: what torch's SDPA does not promise (its
 * kernels block queries and keys by the block's shape).
 * Returns 0, or -1 when scratch memory cannot be had. */
int causal_attention(const float *q, const float *keys, const float *values, int n, int start, int H, int KVH,
                     int D, int capacity, float scale, float *out, int threads) {
    const int group = H / KVH, longest = start + n;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *weights = (float *)malloc(sizeof(float) * ((size_t)longest + 8));
        if (!weights) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(static)
        for (int i = 0; i < n; i++) {
            for (int h = 0; h < H; h++) {
                if (!weights) continue;
                const float *qi = q + ((size_t)i * H + h) * D;
                const float *kh = keys + (size_t)(h / group) * capacity * D;
                const float *vh = values + (size_t)(h / group) * capacity * D;
                float *oi = out + ((size_t)i * H + h) * D;
                const int length = start + i + 1;
                /* scores, eight keys at a time: eight lane sums reduced by one hadd tree */
                __m256 best = _mm256_set1_ps(-INFINITY);
                for (int j = 0; j < length; j += 8) {
                    __m256 lanes[8];
                    for (int u = 0; u < 8; u++)
                        lanes[u] = j + u < length ? dot_lanes(qi, kh + (size_t)(j + u) * D, D) : _mm256_setzero_ps();
                    __m256 s01 = _mm256_hadd_ps(lanes[0], lanes[1]), s23 = _mm256_hadd_ps(lanes[2], lanes[3]);
                    __m256 s45 = _mm256_hadd_ps(lanes[4], lanes[5]), s67 = _mm256_hadd_ps(lanes[6], lanes[7]);
                    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
                    __m256 mixed = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                                 _mm256_permute2f128_ps(s0123, s4567, 0x31));
                    mixed = _mm256_mul_ps(mixed, _mm256_set1_ps(scale));
                    if (j + 8 > length) {  /* past the row's last key: no weight */
                        float tmp[8];
                        _mm256_storeu_ps(tmp, mixed);
                        for (int u = length - j; u < 8; u++) tmp[u] = -INFINITY;
                        mixed = _mm256_loadu_ps(tmp);
                    }
                    _mm256_storeu_ps(weights + j, mixed);
                    best = _mm256_max_ps(best, mixed);
                }
                float top = hmax(best);
                __m256 total = _mm256_setzero_ps();
                for (int j = 0; j < length; j += 8) {
                    __m256 w = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(weights + j), _mm256_set1_ps(top)));
                    _mm256_storeu_ps(weights + j, w);
                    total = _mm256_add_ps(total, w);
                }
                const float inverse = 1.0f / hsum(total);
                __m256 accum[32];
                for (int d = 0; d < D / 8; d++) accum[d] = _mm256_setzero_ps();
                for (int j = 0; j < length; j++) {
                    const float *vj = vh + (size_t)j * D;
                    const __m256 w = _mm256_set1_ps(weights[j]);
                    for (int d = 0; d < D / 8; d++) accum[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * d), accum[d]);
                }
                const __m256 norm = _mm256_set1_ps(inverse);
                for (int d = 0; d < D / 8; d++) _mm256_storeu_ps(oi + 8 * d, _mm256_mul_ps(accum[d], norm));
            }
        }
        free(weights);
    }
    return failed ? -1 : 0;
}

/* RMSNorm of each row of x [rows, dim] into out: x / sqrt(mean(x^2) + eps) * weight, the
 * sum of squares in one fixed order per row (so a row's result never depends on the others). */
void rms_norm_rows(const float *x, const float *weight, int rows, int dim, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= dim; d += 8) {
            __m256 v = _mm256_loadu_ps(xr + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float total = hsum(acc);
        for (; d < dim; d++) total += xr[d] * xr[d];
        const float scale = 1.0f / sqrtf(total / (float)dim + eps);
        const __m256 s = _mm256_set1_ps(scale);
        d = 0;
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), s), _mm256_loadu_ps(weight + d)));
        for (; d < dim; d++) o[d] = xr[d] * scale * weight[d];
    }
}

/* x += delta, then out = RMSNorm(x) * weight, row by row (the residual stream's update and
 * the next layer input's norm in one pass). */
void add_rms_norm_rows(float *x, const float *delta, const float *weight, int rows, int dim, float eps, float *out) {
    for (size_t i = 0; i < (size_t)rows * dim; i++) x[i] += delta[i];
    rms_norm_rows(x, weight, rows, dim, eps, out);
}

/* gate_up [rows, 2 I] -> out [rows, I] = silu(gate) * up. */
void swiglu_rows(const float *gate_up, int rows, int inner, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inner, *u = g + inner;
        float *o = out + (size_t)r * inner;
        for (int i = 0; i < inner; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary positions on one head vector: v * cos + rotate_half(v) * sin, rotate_half(v) being
 * [-v[D/2:], v[:D/2]] (transformers' convention). */
static inline void rope(const float *v, const float *cos, const float *sin, int D, float *out) {
    const int half = D / 2;
    for (int d = 0; d < half; d++) out[d] = v[d] * cos[d] - v[d + half] * sin[d];
    for (int d = half; d < D; d++) out[d] = v[d] * cos[d] + v[d - half] * sin[d];
}

/* One attention block of the lean forward: qkv [n, (H + 2 KVH) D] as the fused projection
 * gives it, cos and sin [n, D] for positions start.., keys and values [KVH, capacity, D]
 * (written here at start..start + n - 1), out [n, H D]. Rotates queries and keys, stores
 * keys and values, then attends (causal_attention). Every row's arithmetic is its own. */
int attention_block(const float *qkv, int n, int start, int H, int KVH, int D, const float *cos, const float *sin,
                    float *keys, float *values, int capacity, float scale, float *out, int threads) {
    const int width = (H + 2 * KVH) * D;
    float *q = (float *)malloc(sizeof(float) * (size_t)n * H * D);
    if (!q) return -1;
    for (int i = 0; i < n; i++) {
        const float *row = qkv + (size_t)i * width, *c = cos + (size_t)i * D, *s = sin + (size_t)i * D;
        for (int h = 0; h < H; h++) rope(row + h * D, c, s, D, q + ((size_t)i * H + h) * D);
        for (int h = 0; h < KVH; h++) {
            rope(row + (H + h) * D, c, s, D, keys + ((size_t)h * capacity + start + i) * D);
            memcpy(values + ((size_t)h * capacity + start + i) * D, row + (H + KVH + h) * D, sizeof(float) * D);
        }
    }
    int status = causal_attention(q, keys, values, n, start, H, KVH, D, capacity, scale, out, threads);
    free(q);
    return status;
}
