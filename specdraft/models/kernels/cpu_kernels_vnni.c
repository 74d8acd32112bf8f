/* The block products of cpu_kernels.c on AVX-512 VNNI, for the CPUs that have it (compiled only
 * into the VNNI library, -DSPECDRAFT_ISA=ISA_VNNI, which native.py loads where the CPU has it),
 * giving bit for bit what the AVX2 products give.
 *
 * Why they are the same: a 512-bit register holds one weight block's 16 columns, one per lane
 * (the layout in cpu_kernels_shared.h). `vpdpbusd` adds each column's four code x activation
 * products into its lane, so after a group's eight steps a lane holds the column's exact integer
 * sum of 32 products, the integer the AVX2 build forms with maddubs and madd. For 8-bit codes,
 * which vpdpbusd cannot take signed, the codes are shifted to w + 128 and 128 times the
 * activations' sum is taken off again: the same integer. The float steps that follow are the
 * shared ones, lane for lane. What changes is the work a row costs: one instruction per four
 * bytes of sixteen columns, where AVX2 takes two or three for eight.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_vector.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))
#define INLINE inline __attribute__((always_inline))

static VNNI INLINE void store16(const __m512 *acc, int rows, int m0, int b, int N, float *y, int ldy) {
    const int valid = block_columns(b, N);
    const __mmask16 lanes = valid == BLOCK ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + (size_t)(m0 + r) * ldy + b * BLOCK, lanes, acc[r]);
}

/* Block b's sixteen columns' scales (or offsets) of group g (G groups), float32 or float16
 * widened exactly. */
static VNNI INLINE __m512 scales16(const void *p, int b, int G, int g, const int form) {
    const size_t at = ((size_t)b * G + g) * BLOCK;
    if (form == SCALES_FLOAT16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
    return _mm512_loadu_ps((const float *)p + at);
}

/* The factored form (cpu_kernels_shared.h): the d's of block b's super-block holding group g,
 * widened, and group g's values, its factors times those d's (exact). */
static VNNI INLINE __m512 supers16(const void *p, int b, int G, int g) {
    const uint16_t *supers = (const uint16_t *)((const uint8_t *)p + (size_t)b * G * FACTORED_BYTES + (size_t)G * BLOCK);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(supers + (g / SUPER_GROUPS) * BLOCK)));
}

static VNNI INLINE __m512 factored16(const void *p, int b, int G, int g, __m512 d) {
    const uint8_t *factors = (const uint8_t *)p + (size_t)b * G * FACTORED_BYTES + (size_t)g * BLOCK;
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)factors))), d);
}

static VNNI INLINE void block4_vnni(const uint8_t *codes, const void *scale, const void *offset, const int form,
                                    int G, int xgroups, const Activations *a, int m0, const int rows, int b, int N,
                                    float *y, int ldy) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int K = xgroups * GROUP;
    __m512 acc[VNNI_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    __m512 ds = _mm512_setzero_ps(), dm = ds; /* factored form: the super-block's d's, read once per 8 groups */
    for (int g = 0; g < G; g++) {
        const int xg = g % xgroups;
        const uint8_t *group = codes + ((size_t)b * G + g) * 256;
        prefetch_codes(group, 4);
        __m512i lo[4], hi[4];
        for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(group + k * 64));
            lo[k] = _mm512_and_si512(raw, low);
            hi[k] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        if (form == SCALES_FACTORED && g % SUPER_GROUPS == 0) ds = supers16(scale, b, G, g), dm = supers16(offset, b, G, g);
        const __m512 s = form == SCALES_FACTORED ? factored16(scale, b, G, g, ds) : scales16(scale, b, G, g, form);
        const __m512 o = form == SCALES_FACTORED ? factored16(offset, b, G, g, dm) : scales16(offset, b, G, g, form);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + xg * GROUP;
            __m512i isum = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                isum = _mm512_dpbusd_epi32(isum, lo[k], _mm512_set1_epi32(four_bytes(q + 4 * k)));
                isum = _mm512_dpbusd_epi32(isum, hi[k], _mm512_set1_epi32(four_bytes(q + 16 + 4 * k)));
            }
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(a->dx[m * xgroups + xg]), s);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a->ax[m * xgroups + xg]), o, acc[r]);
        }
    }
    store16(acc, rows, m0, b, N, y, ldy);
}

/* One specialisation per row count and scale form, so each loop is unrolled for its case. */
#define ROW_CASES(call, form)                                                                               \
    switch (rows) {                                                                                         \
    case 1: call(form, 1); break;                                                                           \
    case 2: call(form, 2); break;                                                                           \
    case 3: call(form, 3); break;                                                                           \
    case 4: call(form, 4); break;                                                                           \
    case 5: call(form, 5); break;                                                                           \
    case 6: call(form, 6); break;                                                                           \
    case 7: call(form, 7); break;                                                                           \
    default: call(form, 8); break;                                                                          \
    }

VNNI void block4_vnni_any(const uint8_t *codes, const void *scale, const void *offset, int form, int G, int xgroups,
                          const Activations *a, int m0, int rows, int b, int N, float *y, int ldy) {
#define BLOCK4(f, r) block4_vnni(codes, scale, offset, f, G, xgroups, a, m0, r, b, N, y, ldy)
    FORM_CASES(form, ROW_CASES, BLOCK4)
#undef BLOCK4
}

static VNNI INLINE void block8_vnni(const int8_t *codes, const void *scale, const int form, int G,
                                    const Activations *a, int m0, const int rows, int b, int N, float *y, int ldy) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int K = G * GROUP;
    __m512 acc[VNNI_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int8_t *group = codes + ((size_t)b * G + g) * 512;
        __m512i shifted[8]; /* w + 128, read unsigned */
        for (int k = 0; k < 8; k++)
            shifted[k] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(group + k * 64)), flip);
        const __m512 s = scales16(scale, b, G, g, form);
        for (int r = 0; r < rows; r++) {
            const size_t m = m0 + r;
            const int8_t *q = a->qx + m * K + (size_t)g * GROUP;
            __m512i isum = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++)
                isum = _mm512_dpbusd_epi32(isum, shifted[k], _mm512_set1_epi32(four_bytes(q + 4 * k)));
            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(a->sx[m * G + g] * 128));
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(a->dx[m * G + g]), s);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc[r]);
        }
    }
    store16(acc, rows, m0, b, N, y, ldy);
}

VNNI void block8_vnni_any(const int8_t *codes, const void *scale, int form, int G, const Activations *a, int m0,
                          int rows, int b, int N, float *y, int ldy) {
#define BLOCK8(f, r) block8_vnni(codes, scale, f, G, a, m0, r, b, N, y, ldy)
    if (form == SCALES_FLOAT16) ROW_CASES(BLOCK8, SCALES_FLOAT16) else ROW_CASES(BLOCK8, SCALES_FLOAT32)
#undef BLOCK8
}
