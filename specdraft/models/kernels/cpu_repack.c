/* A GGUF tensor's blocks, read from the mapped file, rewritten in the block products' layout
 * (cpu_kernels_shared.h) in one pass, a block of 16 output columns per step and the blocks
 * spread over threads: no float copy of a whole tensor is ever made, so loading a model needs
 * little more memory than the model itself.
 *
 * What each format becomes (the same numbers models/kernels/formats.py defines, bit for bit):
 * - Q4_0, Q4_1: one 4-bit term, the file's code bytes as they are (byte j: code j low, code
 *   j + 16 high, which is the kernels' group byte), scale d and offset -8 d or m in float16.
 * - Q5_0, Q5_1: two terms (the low nibbles; the fifth bit), scales d and 16 d.
 * - Q4_K, Q5_K: one or two terms with scales in the factored form: the file's float16 d (dmin)
 *   per super-block times its 6-bit sc (m), which is exactly what the file means.
 * - Q8_0: int8 codes, float16 scales.
 * - IQ4_NL, IQ4_XS: int8 codes, each the entry of llama.cpp's non-linear table (kvalues_iq4nl)
 *   its 4-bit index picks, with the file's scale: float16 d (IQ4_NL), or d x (ls - 32) in
 *   float32, one rounding as llama.cpp computes it (IQ4_XS).
 * - Q6_K, Q3_K: 6-bit codes with an int8 factor per 16 weights and the file's float16 d per
 *   256 (bits 6, cpu_kernels_six.c): Q6_K's codes as they are, Q3_K's 3-bit values + 32.
 * - Q2_K: each row dequantized (float32, the `gguf` package's arithmetic) and rounded to int8
 *   with one scale per row (its per-16 offsets have no exact layout here).
 * Float16 values that a format's arithmetic pushes out of float16 (16 d overflowing) are
 * refused with REPACK_NOT_HALF; the caller asks again for float32 scales.
 *
 * Plain C (no vector code): a load streams each byte once, bounded by memory, not arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_shared.h"

/* GGML's type numbers (ggml.h) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23 };
/* repack_tensor's statuses (cpu_kernels_shared.h) */
enum { REPACK_OK = KERNEL_OK, REPACK_UNSUPPORTED = KERNEL_UNSUPPORTED_TYPE, REPACK_BAD_ARGUMENT = KERNEL_BAD_ARGUMENT,
       REPACK_NOT_HALF = KERNEL_NOT_HALF, REPACK_NO_MEMORY = KERNEL_NO_MEMORY, REPACK_NULL = KERNEL_NULL_POINTER };

#define QK_K 256

/* `f` as a float16 when it is one exactly (finite); 0 when it is not. */
static int half_exactly(float f, uint16_t *out) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    int32_t exponent = (int32_t)((x >> 23) & 0xFF);
    uint32_t mantissa = x & 0x7FFFFF;
    if (exponent == 0xFF) return 0;
    if (exponent == 0) {
        if (mantissa) return 0;
        *out = sign;
        return 1;
    }
    int32_t e = exponent - 127;
    if (e > 15) return 0;
    if (e >= -14) {
        if (mantissa & 0x1FFF) return 0;
        *out = (uint16_t)(sign | ((e + 15) << 10) | (mantissa >> 13));
        return 1;
    }
    uint32_t full = mantissa | 0x800000u;
    int drop = -(e + 1); /* a float16 subnormal is q x 2^-24 */
    if (drop > 24 || (full & ((1u << drop) - 1))) return 0;
    *out = (uint16_t)(sign | (full >> drop));
    return 1;
}

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Where one column's numbers go: its block, its lane, and the tensor's group count. */
typedef struct {
    uint8_t *codes;
    void *scales, *offsets;
    int form, G;
    int64_t b;
    int c;
    int ok; /* cleared when a value cannot be held in the form asked for */
} Column;

/* Group g's 16 code bytes of a 4-bit column (byte j: code j low, code j + 16 high). */
static void put_codes4(Column *col, int g, const uint8_t bytes[16]) {
    uint8_t *group = col->codes + ((size_t)col->b * col->G + g) * 256 + 4 * col->c;
    for (int k = 0; k < 4; k++) memcpy(group + 64 * k, bytes + 4 * k, 4);
}

static void put_codes8(Column *col, int g, const int8_t codes[32]) {
    uint8_t *group = col->codes + ((size_t)col->b * col->G + g) * 512 + 4 * col->c;
    for (int k = 0; k < 8; k++) memcpy(group + 64 * k, codes + 4 * k, 4);
}

/* Group g of a 6-bit column (cpu_kernels_shared.h SIX_*): 32 codes 0..63, the int8 factors of
 * its two halves and, at a super-block's first group, the file's float16 d (its bits). */
static void put_six(Column *col, int g, const uint8_t code[32], int8_t first, int8_t second, uint16_t d) {
    uint8_t *group = col->codes + ((size_t)col->b * col->G + g) * SIX_GROUP_BYTES;
    const int h = col->c / 8, lane = col->c % 8;
    for (int j = 0; j < 16; j++)
        group[64 * (j / 4) + 4 * col->c + j % 4] = (uint8_t)((code[j] & 0x0F) | ((code[j + 16] & 0x0F) << 4));
    for (int part = 0; part < 2; part++)
        for (int i = 0; i < 4; i++) {
            uint8_t top = 0;
            for (int k = 0; k < 4; k++) top |= (uint8_t)(((code[16 * part + 4 * k + i] >> 4) & 0x03) << (2 * k));
            group[256 + 64 * h + 32 * part + 4 * lane + i] = top;
        }
    uint8_t *block = (uint8_t *)col->scales + (size_t)col->b * col->G * SIX_SCALE_BYTES;
    ((int8_t *)block)[(size_t)g * 2 * BLOCK + col->c] = first;
    ((int8_t *)block)[(size_t)g * 2 * BLOCK + BLOCK + col->c] = second;
    if (g % SUPER_GROUPS == 0) memcpy(block + (size_t)col->G * 2 * BLOCK + 2 * ((g / SUPER_GROUPS) * BLOCK + col->c), &d, 2);
}

/* A group's scale (or offset) given as a float16 (its bits) in FLOAT16 or FLOAT32 form. */
static void put_value(Column *col, void *where, int g, float value) {
    size_t at = ((size_t)col->b * col->G + g) * BLOCK + col->c;
    if (col->form == SCALES_FLOAT32) {
        ((float *)where)[at] = value;
    } else {
        uint16_t h = 0;
        if (!half_exactly(value, &h)) col->ok = 0;
        ((uint16_t *)where)[at] = h;
    }
}

/* A group's value as factor x d (d the super-block's float16) in the FACTORED form, or the
 * product in FLOAT32 form. */
static void put_factored(Column *col, void *where, int g, int factor, float d) {
    if (col->form == SCALES_FLOAT32) {
        ((float *)where)[((size_t)col->b * col->G + g) * BLOCK + col->c] = (float)factor * d;
        return;
    }
    uint8_t *block = (uint8_t *)where + (size_t)col->b * col->G * FACTORED_BYTES;
    block[g * BLOCK + col->c] = (uint8_t)factor;
    if (g % SUPER_GROUPS == 0) {
        uint16_t h;
        if (!half_exactly(d, &h)) col->ok = 0;
        memcpy(block + (size_t)col->G * BLOCK + 2 * ((g / SUPER_GROUPS) * BLOCK + col->c), &h, 2);
    }
}

static void low_nibble_bytes(const uint8_t *qs, uint8_t out[16]) { memcpy(out, qs, 16); }

/* Bits of the fifth-bit term, packed as a 4-bit group (weight j's bit at code j). */
static void bit_bytes(const uint8_t bits[32], uint8_t out[16]) {
    for (int j = 0; j < 16; j++) out[j] = (uint8_t)(bits[j] | (bits[j + 16] << 4));
}

static void column_q4_0_1(Column *col, const uint8_t *row, int64_t cols, int with_min) {
    int groups = (int)(cols / GROUP), size = with_min ? 20 : 18;
    for (int g = 0; g < groups; g++) {
        const uint8_t *blk = row + (size_t)g * size;
        float d = half_to_float(u16_at(blk));
        uint8_t bytes[16];
        low_nibble_bytes(blk + (with_min ? 4 : 2), bytes);
        put_codes4(col, g, bytes);
        put_value(col, col->scales, g, d);
        put_value(col, col->offsets, g, with_min ? half_to_float(u16_at(blk + 2)) : -8.0f * d);
    }
}

static void column_q5(Column *col, const uint8_t *row, int64_t cols, int with_min) {
    int groups = (int)(cols / GROUP), size = with_min ? 24 : 22, head = with_min ? 4 : 2;
    for (int g = 0; g < groups; g++) {
        const uint8_t *blk = row + (size_t)g * size;
        float d = half_to_float(u16_at(blk));
        uint32_t high;
        memcpy(&high, blk + head, 4);
        uint8_t bits[32], bytes[16];
        for (int j = 0; j < 32; j++) bits[j] = (uint8_t)((high >> j) & 1);
        low_nibble_bytes(blk + head + 4, bytes);
        put_codes4(col, g, bytes);
        bit_bytes(bits, bytes);
        put_codes4(col, groups + g, bytes);
        /* d (low + 16 high - 16) = [low d - 16 d] + [high 16 d]; Q5_1: d low + m + 16 d high */
        put_value(col, col->scales, g, d);
        put_value(col, col->offsets, g, with_min ? half_to_float(u16_at(blk + 2)) : -16.0f * d);
        put_value(col, col->scales, groups + g, 16.0f * d);
        put_value(col, col->offsets, groups + g, 0.0f);
    }
}

static void column_q8_0(Column *col, const uint8_t *row, int64_t cols) {
    int groups = (int)(cols / GROUP);
    for (int g = 0; g < groups; g++) {
        const uint8_t *blk = row + (size_t)g * 34;
        put_codes8(col, g, (const int8_t *)(blk + 2));
        put_value(col, col->scales, g, half_to_float(u16_at(blk)));
    }
}

/* The values IQ4_NL's and IQ4_XS's 4-bit indices stand for (llama.cpp's kvalues_iq4nl). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 16 bytes of 4-bit indices (byte j: value j low, value j + 16 high) as 32 int8 codes. */
static void iq4_codes(const uint8_t *qs, int8_t codes[32]) {
    for (int j = 0; j < 16; j++) {
        codes[j] = IQ4_VALUES[qs[j] & 0x0F];
        codes[j + 16] = IQ4_VALUES[qs[j] >> 4];
    }
}

static void column_iq4_nl(Column *col, const uint8_t *row, int64_t cols) {
    for (int g = 0; g < (int)(cols / GROUP); g++) {
        const uint8_t *blk = row + (size_t)g * 18;
        int8_t codes[32];
        iq4_codes(blk + 2, codes);
        put_codes8(col, g, codes);
        put_value(col, col->scales, g, half_to_float(u16_at(blk)));
    }
}

/* IQ4_XS: per 256 a float16 d, then a 6-bit scale ls per 32 (low four bits in scales_l, the top
 * two in scales_h), the group's scale d (ls - 32). */
static void column_iq4_xs(Column *col, const uint8_t *row, int64_t cols) {
    for (int64_t s = 0; s < cols / QK_K; s++) {
        const uint8_t *blk = row + (size_t)s * 136;
        const float d = half_to_float(u16_at(blk));
        const int high = u16_at(blk + 2);
        for (int ib = 0; ib < QK_K / GROUP; ib++) {
            const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((high >> (2 * ib)) & 3) << 4);
            int8_t codes[32];
            iq4_codes(blk + 8 + 16 * ib, codes);
            put_codes8(col, (int)s * (QK_K / GROUP) + ib, codes);
            put_value(col, col->scales, (int)s * (QK_K / GROUP) + ib, d * (float)(ls - 32));
        }
    }
}

/* Q4_K / Q5_K: sub-block s's 6-bit scale and min from the 12 packed bytes. */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void column_q45_k(Column *col, const uint8_t *row, int64_t cols, int five) {
    int supers = (int)(cols / QK_K), per_term = (int)(cols / GROUP), size = five ? 176 : 144;
    for (int sb = 0; sb < supers; sb++) {
        const uint8_t *blk = row + (size_t)sb * size;
        float d = half_to_float(u16_at(blk)), minus_dmin = -half_to_float(u16_at(blk + 2));
        const uint8_t *qs = blk + (five ? 48 : 16), *qh = blk + 16;
        for (int s = 0; s < 8; s++) {
            int g = sb * 8 + s, sc, m;
            k_scale_min(blk + 4, s, &sc, &m);
            uint8_t codes[32], bytes[16];
            for (int l = 0; l < 32; l++) codes[l] = (uint8_t)((qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0F);
            for (int j = 0; j < 16; j++) bytes[j] = (uint8_t)(codes[j] | (codes[j + 16] << 4));
            put_codes4(col, g, bytes);
            put_factored(col, col->scales, g, sc, d);
            put_factored(col, col->offsets, g, m, minus_dmin);
            if (five) {
                uint8_t bits[32];
                for (int l = 0; l < 32; l++) bits[l] = (uint8_t)((qh[l] >> s) & 1);
                bit_bytes(bits, bytes);
                put_codes4(col, per_term + g, bytes);
                put_factored(col, col->scales, per_term + g, sc, 16.0f * d);
                put_factored(col, col->offsets, per_term + g, 0, 0.0f);
            }
        }
    }
}

static void column_q6_k(Column *col, const uint8_t *row, int64_t cols) {
    for (int64_t sb = 0; sb < cols / QK_K; sb++) {
        const uint8_t *blk = row + sb * 210, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int s = 0; s < 8; s++) {
            uint8_t code[32];
            for (int j = 0; j < 32; j++) {
                const int w = s * 32 + j, n = w / 128, r = w % 128;
                code[j] = (uint8_t)(((ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0x0F) |
                                    (((qh[n * 32 + r % 32] >> (2 * (r / 32))) & 0x03) << 4));
            }
            put_six(col, (int)(sb * 8 + s), code, sc[2 * s], sc[2 * s + 1], u16_at(blk + 208));
        }
    }
}

static void column_q3_k(Column *col, const uint8_t *row, int64_t cols) {
    for (int64_t sb = 0; sb < cols / QK_K; sb++) {
        const uint8_t *blk = row + sb * 110, *hmask = blk, *qs = blk + 32, *s = blk + 96;
        int8_t factor[16];
        for (int i = 0; i < 16; i++) {
            const int low = (i < 8 ? s[i] : s[i - 8] >> 4) & 0x0F, high = (s[8 + i % 4] >> (2 * (i / 4))) & 0x03;
            factor[i] = (int8_t)((low | (high << 4)) - 32);
        }
        for (int g = 0; g < 8; g++) {
            uint8_t code[32];
            for (int j = 0; j < 32; j++) {
                const int w = g * 32 + j, n = w / 128, r = w % 128;
                const int low = (qs[n * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
                const int high = ((hmask[w % 32] >> (w / 32)) & 1) ^ 1;
                code[j] = (uint8_t)(low - (high << 2) + 32);
            }
            put_six(col, (int)(sb * 8 + g), code, factor[2 * g], factor[2 * g + 1], u16_at(blk + 108));
        }
    }
}

/* ---- formats with scales per 16 weights: a row in float32, as the `gguf` package computes it */

static void row_q2_k(const uint8_t *row, int64_t cols, float *out) {
    for (int64_t sb = 0; sb < cols / QK_K; sb++) {
        const uint8_t *blk = row + sb * 84, *scales = blk, *qs = blk + 16;
        float d = half_to_float(u16_at(blk + 80)), dmin = half_to_float(u16_at(blk + 82));
        for (int w = 0; w < QK_K; w++) {
            int n = w / 128, r = w % 128, i = w / 16;
            float q = (float)((qs[n * 32 + r % 32] >> (2 * (r / 32))) & 0x03);
            out[sb * QK_K + w] = d * (float)(scales[i] & 0x0F) * q - dmin * (float)(scales[i] >> 4);
        }
    }
}

/* The row as int8 codes with one scale (float32) for the whole row: the scale repeated for
 * each group, as models/kernels/formats.py int8_rows rounds it. */
static void column_int8_row(Column *col, const float *w, int64_t cols) {
    float largest = 0.0f;
    for (int64_t k = 0; k < cols; k++) {
        float a = fabsf(w[k]);
        largest = a > largest ? a : largest;
    }
    float scale = fmaxf(largest, 1e-12f) / 127.0f;
    int groups = (int)(cols / GROUP);
    for (int g = 0; g < groups; g++) {
        int8_t codes[32];
        for (int j = 0; j < 32; j++) { /* as numpy's rint (half to even) of the quotient, clipped */
            float q = __builtin_roundevenf(w[g * GROUP + j] / scale);
            codes[j] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
        }
        put_codes8(col, g, codes);
        ((float *)col->scales)[((size_t)col->b * col->G + g) * BLOCK + col->c] = scale;
    }
}

static int64_t row_bytes(int type, int64_t cols) {
    switch (type) {
    case T_Q4_0: return cols / 32 * 18;
    case T_Q4_1: return cols / 32 * 20;
    case T_Q5_0: return cols / 32 * 22;
    case T_Q5_1: return cols / 32 * 24;
    case T_Q8_0: return cols / 32 * 34;
    case T_Q2_K: return cols / QK_K * 84;
    case T_Q3_K: return cols / QK_K * 110;
    case T_Q4_K: return cols / QK_K * 144;
    case T_Q5_K: return cols / QK_K * 176;
    case T_Q6_K: return cols / QK_K * 210;
    case T_IQ4_NL: return cols / 32 * 18;
    case T_IQ4_XS: return cols / QK_K * 136;
    default: return -1;
    }
}

static int per_row_int8(int type) { return type == T_Q2_K; }

/* Zero lane c of block b in every group (a partial last block's missing columns). */
static void clear_column(Column *col, int bits) {
    uint8_t zeros[32] = {0};
    for (int g = 0; g < col->G; g++) {
        if (bits == 6) {
            put_six(col, g, zeros, 0, 0, 0);
            continue;
        }
        if (bits == 4) {
            put_codes4(col, g, zeros);
        } else {
            put_codes8(col, g, (const int8_t *)zeros);
        }
        size_t at = ((size_t)col->b * col->G + g) * BLOCK + col->c;
        if (col->form == SCALES_FACTORED) {
            put_factored(col, col->scales, g, 0, 0.0f);
            if (col->offsets) put_factored(col, col->offsets, g, 0, 0.0f);
        } else if (col->form == SCALES_FLOAT32) {
            ((float *)col->scales)[at] = 0.0f;
            if (col->offsets) ((float *)col->offsets)[at] = 0.0f;
        } else {
            ((uint16_t *)col->scales)[at] = 0;
            if (col->offsets) ((uint16_t *)col->offsets)[at] = 0;
        }
    }
}

/* The bits of the layout a format becomes (4, 6 or 8), -1 when not repacked here. */
int repack_bits(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q4_K: case T_Q5_0: case T_Q5_1: case T_Q5_K: return 4;
    case T_Q6_K: case T_Q3_K: return 6;
    case T_Q8_0: case T_Q2_K: case T_IQ4_NL: case T_IQ4_XS: return 8;
    default: return -1;
    }
}

/* The terms a format's 4-bit layout has (1 or 2); 0 for the other layouts, -1 when not repacked. */
int repack_terms(int type) {
    const int bits = repack_bits(type);
    if (bits != 4) return bits < 0 ? -1 : 0;
    return type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K ? 2 : 1;
}

/* Rows `src` of a GGUF tensor (`rows` x `cols` weights of GGML type `type`, the file's row
 * r at src + r x its row bytes; `source_bytes` the tensor's whole size, checked) into the
 * block layout: output column n is the file's row order[n] (order NULL: row n). `codes`,
 * `scales`, `offsets` (NULL for 8-bit codes) are the caller's buffers of the sizes the
 * layout gives for this format, scales in `form` (FLOAT16 or FACTORED as the format's
 * natural form, or FLOAT32 for any). Returns a REPACK_ status. */
int repack_tensor(const uint8_t *src, int64_t source_bytes, int type, int64_t rows, int64_t cols,
                  const int64_t *order, uint8_t *codes, void *scales, void *offsets, int form, int threads) {
    int terms = repack_terms(type), bits = repack_bits(type);
    if (bits < 0) return REPACK_UNSUPPORTED;
    int k_type = type == T_Q4_K || type == T_Q5_K || bits == 6 || per_row_int8(type) || type == T_IQ4_XS;
    int64_t stride = row_bytes(type, cols);
    if (!src || !codes || !scales) return REPACK_NULL;
    if (rows <= 0 || cols <= 0 || cols % (k_type ? QK_K : GROUP) != 0 ||
        cols / GROUP * (terms ? terms : 1) > (1 << 30) / BLOCK || stride * rows > source_bytes)
        return REPACK_BAD_ARGUMENT;
    if ((terms > 0) != (offsets != NULL)) return REPACK_BAD_ARGUMENT;
    if (bits == 6) form = SCALES_FLOAT32; /* (unread: a 6-bit weight's scales have one layout) */
    if (form != SCALES_FLOAT32 && form != SCALES_FLOAT16 && form != SCALES_FACTORED) return REPACK_BAD_ARGUMENT;
    if (form == SCALES_FACTORED && !(type == T_Q4_K || type == T_Q5_K)) return REPACK_BAD_ARGUMENT;
    if (form == SCALES_FLOAT16 && (type == T_Q4_K || type == T_Q5_K || per_row_int8(type))) return REPACK_BAD_ARGUMENT;
    if (order) {
        for (int64_t n = 0; n < rows; n++)
            if (order[n] < 0 || order[n] >= rows) return REPACK_BAD_ARGUMENT;
    }
    int G = (int)(cols / GROUP) * (terms ? terms : 1);
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    int failed = 0, no_memory = 0;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scratch = per_row_int8(type) ? malloc(sizeof(float) * (size_t)cols) : NULL;
        if (per_row_int8(type) && !scratch) {
            #pragma omp atomic write
            no_memory = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (per_row_int8(type) && !scratch) continue;
            for (int c = 0; c < BLOCK; c++) {
                Column col = {codes, scales, offsets, form, G, b, c, 1};
                int64_t n = b * BLOCK + c;
                if (n >= rows) {
                    clear_column(&col, bits);
                    continue;
                }
                const uint8_t *row = src + (order ? order[n] : n) * stride;
                switch (type) {
                case T_Q4_0: column_q4_0_1(&col, row, cols, 0); break;
                case T_Q4_1: column_q4_0_1(&col, row, cols, 1); break;
                case T_Q5_0: column_q5(&col, row, cols, 0); break;
                case T_Q5_1: column_q5(&col, row, cols, 1); break;
                case T_Q4_K: column_q45_k(&col, row, cols, 0); break;
                case T_Q5_K: column_q45_k(&col, row, cols, 1); break;
                case T_Q8_0: column_q8_0(&col, row, cols); break;
                case T_IQ4_NL: column_iq4_nl(&col, row, cols); break;
                case T_IQ4_XS: column_iq4_xs(&col, row, cols); break;
                case T_Q6_K: column_q6_k(&col, row, cols); break;
                case T_Q3_K: column_q3_k(&col, row, cols); break;
                case T_Q2_K: row_q2_k(row, cols, scratch); column_int8_row(&col, scratch, cols); break;
                }
                if (!col.ok) {
                    #pragma omp atomic write
                    failed = 1;
                }
            }
        }
        free(scratch);
    }
    if (no_memory) return REPACK_NO_MEMORY;
    return failed ? REPACK_NOT_HALF : REPACK_OK;
}
