/* Causal attention for the lean forward (models/lean/decoder.py, cpu_decoder.c) over a decode or
 * verify block, a chain or a token tree, on AVX2 (the rotary positions and the KV write before
 * it: attention_block, cpu_common.c; the same in plain C, bit for bit: cpu_attention_scalar.c).
 *
 * Every (row, head) is reduced in an order that depends only on the keys it attends: scores
 * eight keys at a time (each key's dot product in lanes, eight keys' lanes summed by one hadd
 * tree), their maximum, the exponentials and their sum in key order, the weighted values in
 * key order. So a row gets bit for bit the same output in a block of any width or shape: what
 * torch's SDPA does not promise (its kernels block queries and keys by the block's shape).
 *
 * What the loop order is for: a verify block's rows attend nearly the same keys (the cached
 * context, then their own few), so rows go in tiles that share each key block while it is in
 * L1, where one row at a time read every key from L2 once per row and head. The order of the
 * loops changes which row waits for which key, never a row's own sequence of operations.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_vector.h"

#define FORCE inline __attribute__((always_inline))

/* The dot product of two D-vectors (D a multiple of 8), in lanes, reduced in one fixed order. */
static FORCE __m256 dot_lanes(const float *a, const float *b, int D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return acc;
}

/* The scaled scores of query q against keys j .. j + 7 of its slot list (`slots` NULL: slot
 * j is key j), -inf from `length` on. */
static FORCE __m256 scores8(const float *q, const float *keys, const int *slots, int j, int length, int D,
                            float scale) {
    __m256 lanes[8];
    for (int u = 0; u < 8; u++) /* (a slot past `length` was never written: not read) */
        lanes[u] = j + u < length ? dot_lanes(q, keys + (size_t)(slots ? slots[j + u] : j + u) * D, D)
                                  : _mm256_setzero_ps();
    __m256 s01 = _mm256_hadd_ps(lanes[0], lanes[1]), s23 = _mm256_hadd_ps(lanes[2], lanes[3]);
    __m256 s45 = _mm256_hadd_ps(lanes[4], lanes[5]), s67 = _mm256_hadd_ps(lanes[6], lanes[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 mixed = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                 _mm256_permute2f128_ps(s0123, s4567, 0x31));
    mixed = _mm256_mul_ps(mixed, _mm256_set1_ps(scale));
    if (j + 8 > length) { /* past the row's last key: no weight */
        float tmp[8];
        _mm256_storeu_ps(tmp, mixed);
        for (int u = length - j; u < 8; u++) tmp[u] = -INFINITY;
        mixed = _mm256_loadu_ps(tmp);
    }
    return mixed;
}

/* acc [D] (zero when `fresh`) += weights[j] * value of slot j, for j = from .. to - 1 in order. */
static FORCE void add_values(const float *weights, const float *values, const int *slots, int from, int to, int D,
                             int fresh, float *acc) {
    __m256 accum[MAX_HEAD_DIM / 8];
    for (int d = 0; d < D / 8; d++) accum[d] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * d);
    for (int j = from; j < to; j++) {
        const float *vj = values + (size_t)(slots ? slots[j] : j) * D;
        const __m256 w = _mm256_set1_ps(weights[j]);
        for (int d = 0; d < D / 8; d++) accum[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * d), accum[d]);
    }
    for (int d = 0; d < D / 8; d++) _mm256_storeu_ps(acc + 8 * d, accum[d]);
}

/* Scratch of one thread: a tile's scores, key slots (token trees) and value sums. */
typedef struct {
    float *weights; /* [ROW_TILE, stride] */
    int *slots;     /* [ROW_TILE, stride], NULL for a chain */
    float *sums;    /* [ROW_TILE, D] */
    size_t stride;
} Scratch;

/* Rows first .. first + rows - 1 (at most ROW_TILE) of head h: out [n, H, D]. D is a
 * compile-time constant where the caller knows it (64, 128), so the loops unroll. */
static FORCE void attend_tile(const float *q, const float *kh, const float *vh, int first, int rows, int h, int H,
                              int D, int start, float scale, const int *parents, int window, const Scratch *s,
                              float *out) {
    int length[ROW_TILE], lo[ROW_TILE], most = 0;
    __m256 best[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        length[r] = parents ? tree_slots(parents, start, first + r, s->slots + r * s->stride) : start + first + r + 1;
        lo[r] = window_start(length[r], window); /* a row's keys: its slots lo .. length - 1 */
        length[r] -= lo[r];
        most = length[r] > most ? length[r] : most;
        best[r] = _mm256_set1_ps(-INFINITY);
    }
#define ROW_SLOTS(r) (parents ? s->slots + (r) * s->stride + lo[r] : NULL)
#define ROW_KEYS(r) (parents ? kh : kh + (size_t)lo[r] * D) /* (a chain's slot k is key k) */
#define ROW_VALUES(r) (parents ? vh : vh + (size_t)lo[r] * D)
#define QUERY(r) (q + ((size_t)(first + (r)) * H + h) * D)
    for (int j = 0; j < most; j += 8) /* every row of the tile against each key block in turn */
        for (int r = 0; r < rows; r++) {
            if (j >= length[r]) continue;
            const __m256 mixed = scores8(QUERY(r), ROW_KEYS(r), ROW_SLOTS(r), j, length[r], D, scale);
            _mm256_storeu_ps(s->weights + r * s->stride + j, mixed);
            best[r] = _mm256_max_ps(best[r], mixed);
        }
    float inverse[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        float *weights = s->weights + r * s->stride;
        const __m256 top = _mm256_set1_ps(hmax(best[r]));
        __m256 total = _mm256_setzero_ps();
        for (int j = 0; j < length[r]; j += 8) {
            __m256 w = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(weights + j), top));
            _mm256_storeu_ps(weights + j, w);
            total = _mm256_add_ps(total, w);
        }
        inverse[r] = 1.0f / hsum(total);
    }
    for (int j = 0; j < most; j += VALUE_SPAN) /* the same for the values, a span of keys at a time */
        for (int r = 0; r < rows; r++) {
            if (j >= length[r]) continue;
            const int to = j + VALUE_SPAN < length[r] ? j + VALUE_SPAN : length[r];
            add_values(s->weights + r * s->stride, ROW_VALUES(r), ROW_SLOTS(r), j, to, D, j == 0,
                       s->sums + (size_t)r * D);
        }
    for (int r = 0; r < rows; r++) {
        const __m256 norm = _mm256_set1_ps(inverse[r]);
        float *o = out + ((size_t)(first + r) * H + h) * D;
        for (int d = 0; d < D / 8; d++) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(s->sums + r * D + 8 * d), norm));
    }
#undef ROW_SLOTS
#undef ROW_KEYS
#undef ROW_VALUES
#undef QUERY
}

/* Causal attention for a decode or verify block.
 *
 * q [n, H, D]: the block's queries (D a multiple of 8, at most 256); keys and values [KVH,
 * capacity, D]: every cached position, the block's own included at start .. start + n - 1;
 * out [n, H, D]. A chain (`parents` NULL): row i attends slots 0 .. start + i. A token tree
 * (`parents[i]` < i the row of i's parent, row 0 the root): row i attends the cached slots and
 * its own path from the root, in that order, so it sees exactly what it would see as row d
 * (its depth) of a chain holding that path. A sliding `window` (0: none) keeps each row's last
 * `window` of these (window_start). Work items are (head, tile of rows); a head's
 * items go to one thread in turn, so heads sharing keys (grouped queries) find them in its
 * cache. Returns 0, or -1 when scratch memory cannot be had. */
int causal_attention_impl(const float *q, const float *keys, const float *values, int n, int start, int H,
                          int KVH, int D, int capacity, float scale, const int *parents, int window, float *out,
                          int threads) {
    const int group = H / KVH, tiles = (n + ROW_TILE - 1) / ROW_TILE;
    const size_t stride = (size_t)start + n + 8;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        Scratch s = {malloc(sizeof(float) * ROW_TILE * stride), parents ? malloc(sizeof(int) * ROW_TILE * stride) : NULL,
                     malloc(sizeof(float) * ROW_TILE * (size_t)D), stride};
        const int ready = s.weights && s.sums && (!parents || s.slots);
        if (!ready) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < tiles; t++) {
                if (!ready) continue;
                const float *kh = keys + (size_t)(h / group) * capacity * D;
                const float *vh = values + (size_t)(h / group) * capacity * D;
                const int first = t * ROW_TILE, rows = n - first < ROW_TILE ? n - first : ROW_TILE;
                if (D == 64)
                    attend_tile(q, kh, vh, first, rows, h, H, 64, start, scale, parents, window, &s, out);
                else if (D == 128)
                    attend_tile(q, kh, vh, first, rows, h, H, 128, start, scale, parents, window, &s, out);
                else
                    attend_tile(q, kh, vh, first, rows, h, H, D, start, scale, parents, window, &s, out);
            }
        free(s.weights);
        free(s.slots);
        free(s.sums);
    }
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
