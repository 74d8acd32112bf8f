/* Products for 6-bit weights with a scale per 16 (bits 6: GGUF's Q6_K and Q3_K, held as the file
 * holds them, cpu_kernels_shared.h SIX_*): w = (code - 32) x factor x d, code 0..63, factor an
 * int8 per 16 weights, d a float16 per 8 groups. Each group's 32 products are summed in two
 * exact integer halves, one per scale, and each half meets its scale in one fused multiply-add
 * per column, in a fixed order: a row's result never depends on the number of rows (the width
 * invariance lossless speculation needs). The VNNI build runs these products too, so both give
 * the same numbers. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_shared.h"

#define SIX_ROWS 4

/* Eight columns (half h) of a 6-bit weight's per-16 scale `part` (0: codes 0..15, 1: 16..31) of
 * group g: factor x d, exact. */
static inline __attribute__((always_inline)) __m256 six_scales8(const uint8_t *scales, int b, int G, int g, int part,
                                                                int h) {
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    const int8_t *factors = (const int8_t *)block + (size_t)g * 2 * BLOCK + part * BLOCK + h * 8;
    const uint16_t *supers = (const uint16_t *)(block + (size_t)G * 2 * BLOCK) + (g / SUPER_GROUPS) * BLOCK + h * 8;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)supers));
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)factors)));
    return _mm256_mul_ps(f, d);
}

static inline __attribute__((always_inline)) void block6(const uint8_t *codes, const uint8_t *scales, int G,
                                                         const Activations *a, int m0, const int rows, int b, int N,
                                                         float *y, int ldy) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), bias = _mm256_set1_epi8(32);
    const __m256i ones = _mm256_set1_epi16(1);
    const int K = G * GROUP;
    for (int h = 0; h < 2 && b * BLOCK + h * 8 < N; h++) {
        __m256 acc[SIX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
            if (h == 0) prefetch_codes(group, 6);
            const __m256i top0 = _mm256_loadu_si256((const __m256i *)(group + 256 + 64 * h));
            const __m256i top1 = _mm256_loadu_si256((const __m256i *)(group + 256 + 64 * h + 32));
            __m256i first[4], second[4]; /* signed codes - 32 of weights 4k .. 4k + 3 and 16 + 4k .. */
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + 64 * k + 32 * h));
                const __m256i high0 = _mm256_and_si256(_mm256_srli_epi16(top0, 2 * k), two);
                const __m256i high1 = _mm256_and_si256(_mm256_srli_epi16(top1, 2 * k), two);
                first[k] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, low), _mm256_slli_epi16(high0, 4)), bias);
                second[k] = _mm256_sub_epi8(
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_slli_epi16(high1, 4)), bias);
            }
            const __m256 s0 = six_scales8(scales, b, G, g, 0, h), s1 = six_scales8(scales, b, G, g, 1, h);
            for (int r = 0; r < rows; r++) {
                const size_t m = m0 + r;
                const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
                __m256i sum0 = _mm256_setzero_si256(), sum1 = sum0;
                for (int k = 0; k < 4; k++) { /* |w| x (x sign w): each pair at most 2 x 32 x 127 */
                    const __m256i x0 = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(q + 4 * k)), first[k]);
                    const __m256i x1 = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(q + 16 + 4 * k)), second[k]);
                    sum0 = _mm256_add_epi32(sum0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(first[k], first[k]), x0), ones));
                    sum1 = _mm256_add_epi32(sum1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(second[k], second[k]), x1), ones));
                }
                const __m256 dx = _mm256_set1_ps(a->dx[m * G + g]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), _mm256_mul_ps(dx, s0), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), _mm256_mul_ps(dx, s1), acc[r]);
            }
        }
        const int first_column = b * BLOCK + h * 8, valid = N - first_column < 8 ? N - first_column : 8;
        for (int r = 0; r < rows; r++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r]);
            memcpy(y + (size_t)(m0 + r) * ldy + first_column, lanes, sizeof(float) * valid);
        }
    }
}

void block6_any(const uint8_t *codes, const uint8_t *scales, int G, const Activations *a, int m0, int rows, int b,
                int N, float *y, int ldy) {
    for (int r0 = 0; r0 < rows; r0 += SIX_ROWS) {
        switch (rows - r0 < SIX_ROWS ? rows - r0 : SIX_ROWS) {
        case 1: block6(codes, scales, G, a, m0 + r0, 1, b, N, y, ldy); break;
        case 2: block6(codes, scales, G, a, m0 + r0, 2, b, N, y, ldy); break;
        case 3: block6(codes, scales, G, a, m0 + r0, 3, b, N, y, ldy); break;
        default: block6(codes, scales, G, a, m0 + r0, 4, b, N, y, ldy); break;
        }
    }
}

/* Column c of block b's group g dequantized into value[32]: (code - 32) x (factor x d), one
 * rounding per weight, as the `gguf` package computes Q6_K and Q3_K (d x scale, then x q). */
void six_group_values(const uint8_t *codes, const uint8_t *scales, int G, int b, int g, int c, float *value) {
    const uint8_t *group = codes + ((size_t)b * G + g) * SIX_GROUP_BYTES;
    const uint8_t *block = scales + (size_t)b * G * SIX_SCALE_BYTES;
    uint16_t super;
    memcpy(&super, block + (size_t)G * 2 * BLOCK + 2 * ((g / SUPER_GROUPS) * BLOCK + c), 2);
    const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(super)));
    const int h = c / 8, lane = c % 8;
    for (int j = 0; j < GROUP; j++) {
        const int part = j / 16, k = (j % 16) / 4, i = j % 4;
        const uint8_t byte = group[64 * k + 4 * c + i];
        const int low = part ? byte >> 4 : byte & 0x0F;
        const int high = (group[256 + 64 * h + 32 * part + 4 * lane + i] >> (2 * k)) & 0x03;
        const float scale = (float)((const int8_t *)block)[(size_t)g * 2 * BLOCK + part * BLOCK + c] * d;
        value[j] = (float)((low | (high << 4)) - 32) * scale;
    }
}
