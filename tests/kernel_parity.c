/* Two builds of specdraft's kernels, bit for bit: `kernel_parity REFERENCE.so CANDIDATE.so`
 * loads both and calls each exported function of both on the same random inputs (block
 * products of every format and scale form at widths 1..13 and partial column blocks, row
 * lookups, RMSNorm, SwiGLU, attention over chains and token trees, an attention block with
 * rotary positions, a decoder layer), comparing the outputs byte for byte. Prints one line per
 * failing case and a summary; exits 0 when every case matched, 1 otherwise, 2 when a library
 * cannot be loaded.
 *
 * tests/test_neon_kernels.py compiles it with the AArch64 cross compiler and runs it under
 * qemu-user against the scalar and NEON builds (the CPU that would run NEON is not this one);
 * tests/test_scalar_kernels.py runs it natively against the scalar and x86 builds, so the
 * harness itself is checked where it can fail for real.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels_shared.h"

typedef int (*MatmulFn)(const float *, int, int, const void *, const void *, const void *, int, int, int, int, int,
                        float *, int);
typedef int (*RowsFn)(const void *, const void *, const void *, int, int, int, int, int, const int64_t *, int, float *);
typedef int (*AttentionFn)(const float *, const float *, const float *, int, int, int, int, int, int, float,
                           const int *, int, float *, int);
typedef int (*BlockFn)(const float *, int, int, int, int, int, const float *, const float *, float, const float *,
                       const float *, float *, float *, int, float, const int *, int, float *, int);
typedef int (*NormFn)(const float *, const float *, int, int, float, float *);
typedef int (*SwigluFn)(const float *, int, int, float *);
typedef int (*LayersFn)(float *, int, int, int, const Layer *, int, int, int, int, float *, float *, int,
                        const float *, const float *, int, float, const int *, int);

typedef struct {
    void *handle;
    int isa;
    MatmulFn matmul;
    RowsFn rows;
    AttentionFn attention;
    BlockFn block;
    NormFn norm;
    SwigluFn swiglu, geglu;
    LayersFn layers;
} Build;

static int failures = 0, cases = 0;
static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next_random(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static float uniform(float low, float high) { return low + (high - low) * (float)(next_random() % 1000003) / 1000003.0f; }

static void fill_bytes(void *p, size_t n) {
    for (size_t i = 0; i < n; i++) ((uint8_t *)p)[i] = (uint8_t)next_random();
}

static void fill_floats(float *p, size_t n, float low, float high) {
    for (size_t i = 0; i < n; i++) p[i] = uniform(low, high);
}

/* Finite float16 bits of magnitude about 2^-10 .. 2^5, either sign. */
static void fill_halves(uint16_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint16_t)((next_random() & 0x8000) | ((5 + next_random() % 16) << 10) | (next_random() & 0x3FF));
}

/* Finite bfloat16 bits of magnitude about 2^-8 .. 2^1. */
static void fill_bfloats(uint16_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint16_t)((next_random() & 0x8000) | ((119 + next_random() % 10) << 7) | (next_random() & 0x7F));
}

static int load(const char *path, Build *b) {
    b->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!b->handle) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        return 0;
    }
    int (*isa)(void) = (int (*)(void))dlsym(b->handle, "kernel_isa");
    int (*supported)(void) = (int (*)(void))dlsym(b->handle, "isa_supported");
    b->matmul = (MatmulFn)dlsym(b->handle, "block_matmul");
    b->rows = (RowsFn)dlsym(b->handle, "block_rows");
    b->attention = (AttentionFn)dlsym(b->handle, "causal_attention");
    b->block = (BlockFn)dlsym(b->handle, "attention_block");
    b->norm = (NormFn)dlsym(b->handle, "rms_norm_rows");
    b->swiglu = (SwigluFn)dlsym(b->handle, "swiglu_rows");
    b->geglu = (SwigluFn)dlsym(b->handle, "geglu_rows");
    b->layers = (LayersFn)dlsym(b->handle, "decoder_layers");
    if (!isa || !supported || !b->matmul || !b->rows || !b->attention || !b->block || !b->norm || !b->swiglu
        || !b->geglu || !b->layers) {
        fprintf(stderr, "%s lacks a kernel function\n", path);
        return 0;
    }
    if (!supported()) {
        fprintf(stderr, "%s: this CPU does not run its instructions\n", path);
        return 0;
    }
    b->isa = isa();
    return 1;
}

/* One case: both builds' statuses 0 and their outputs equal byte for byte. */
static void compare(const char *what, int status_a, int status_b, const void *a, const void *b, size_t bytes) {
    cases++;
    if (status_a || status_b) {
        failures++;
        printf("FAIL %s: status %d and %d\n", what, status_a, status_b);
    } else if (memcmp(a, b, bytes)) {
        size_t at = 0;
        while (((const uint8_t *)a)[at] == ((const uint8_t *)b)[at]) at++;
        failures++;
        printf("FAIL %s: differ at float %zu (%.9g vs %.9g)\n", what, at / 4, ((const float *)a)[at / 4],
               ((const float *)b)[at / 4]);
    }
}

/* The bytes of a weight's codes and scales in the block layout (cpu_kernels_shared.h). */
static size_t code_bytes(int bits, int blocks, int groups, int K) {
    if (bits == 16 || bits == 32) return (size_t)blocks * K * BLOCK * (bits / 8);
    return (size_t)blocks * groups * (bits == 4 ? 256 : bits == 6 ? SIX_GROUP_BYTES : 512);
}

static size_t scale_bytes(int bits, int form, int blocks, int groups) {
    if (bits == 6) return (size_t)blocks * groups * SIX_SCALE_BYTES;
    if (form == SCALES_FACTORED) return (size_t)blocks * groups * FACTORED_BYTES;
    return (size_t)blocks * groups * BLOCK * (form == SCALES_FLOAT16 ? 2 : 4);
}

static void fill_scales(void *p, int bits, int form, int blocks, int groups) {
    const size_t bytes = scale_bytes(bits, form, blocks, groups);
    if (bits == 6 || form == SCALES_FACTORED) { /* factors, then float16 d's per super-block */
        const size_t per = bits == 6 ? 2 * BLOCK : BLOCK, factors = (size_t)groups * per;
        const size_t block = bits == 6 ? (size_t)groups * SIX_SCALE_BYTES : (size_t)groups * FACTORED_BYTES;
        for (int b = 0; b < blocks; b++) {
            fill_bytes((uint8_t *)p + b * block, factors);
            fill_halves((uint16_t *)((uint8_t *)p + b * block + factors), (block - factors) / 2);
        }
    } else if (form == SCALES_FLOAT16) {
        fill_halves(p, bytes / 2);
    } else {
        fill_floats(p, bytes / 4, -0.05f, 0.05f);
    }
}

static void matmul_case(const Build *a, const Build *b, int bits, int form, int terms, int K, int N) {
    const int blocks = (N + BLOCK - 1) / BLOCK, groups = terms * K / GROUP;
    const size_t codes_n = code_bytes(bits, blocks, groups, K), scales_n = scale_bytes(bits, form, blocks, groups);
    uint8_t *codes = malloc(codes_n), *scale = malloc(scales_n), *offset = malloc(scales_n);
    if (bits == 16)
        fill_bfloats((uint16_t *)codes, codes_n / 2);
    else if (bits == 32)
        fill_floats((float *)codes, codes_n / 4, -0.1f, 0.1f);
    else
        fill_bytes(codes, codes_n);
    fill_scales(scale, bits, form, blocks, groups);
    fill_scales(offset, bits, form, blocks, groups);
    const int widths[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13};
    /* every way of rounding the activations (ACTIVATIONS_*), Q8_K where K holds whole super-blocks */
    for (int rule = ACTIVATIONS_OWN; rule <= ACTIVATIONS_Q8_K; rule++)
    for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
        if (rule == ACTIVATIONS_Q8_K && K % (SUPER_GROUPS * GROUP)) continue;
        const int M = widths[w];
        float *x = malloc(sizeof(float) * M * K), *ya = malloc(sizeof(float) * M * N), *yb = malloc(sizeof(float) * M * N);
        fill_floats(x, (size_t)M * K, -2.0f, 2.0f);
        if (K >= 2 * GROUP) memset(x + GROUP, 0, sizeof(float) * GROUP); /* a group of zeros: scale 0 */
        x[0] = 1000.0f; /* a group dominated by one value (most codes 0) */
        char what[128];
        snprintf(what, sizeof what, "block_matmul bits %d form %d terms %d K %d N %d M %d activations %d", bits, form,
                 terms, K, N, M, rule);
        const int sa = a->matmul(x, M, K, codes, scale, offset, form, bits, N, groups, rule, ya, 2);
        const int sb = b->matmul(x, M, K, codes, scale, offset, form, bits, N, groups, rule, yb, 2);
        compare(what, sa, sb, ya, yb, sizeof(float) * M * N);
        free(x); free(ya); free(yb);
    }
    if (bits != 16 && bits != 32) {
        int64_t ids[] = {0, N - 1, N / 2, 3};
        const int width = groups / terms * GROUP;
        float *ra = malloc(sizeof(float) * 4 * width), *rb = malloc(sizeof(float) * 4 * width);
        char what[128];
        snprintf(what, sizeof what, "block_rows bits %d form %d terms %d K %d", bits, form, terms, K);
        compare(what, a->rows(codes, scale, offset, form, bits, N, groups, terms, ids, 4, ra),
                b->rows(codes, scale, offset, form, bits, N, groups, terms, ids, 4, rb), ra, rb, sizeof(float) * 4 * width);
        free(ra); free(rb);
    }
    free(codes); free(scale); free(offset);
}

static void products(const Build *a, const Build *b) {
    const int Ns[] = {16, 40};
    for (int i = 0; i < 2; i++) {
        const int N = Ns[i];
        for (int form = 0; form < 3; form++) {
            matmul_case(a, b, 4, form, 1, 256, N);
            matmul_case(a, b, 4, form, 2, 256, N);
            if (form != SCALES_FACTORED) {
                matmul_case(a, b, 4, form, 1, 96, N);
                matmul_case(a, b, 8, form, 1, 96, N);
                matmul_case(a, b, 8, form, 1, 256, N);
            }
        }
        matmul_case(a, b, 6, 0, 1, 256, N);
        matmul_case(a, b, 6, 0, 1, 512, N);
        matmul_case(a, b, 16, 0, 1, 40, N);
        matmul_case(a, b, 32, 0, 1, 72, N);
    }
}

static void norms(const Build *a, const Build *b) {
    const int dims[] = {7, 8, 64, 100, 576};
    for (int i = 0; i < 5; i++) {
        const int dim = dims[i], rows = 3;
        float *x = malloc(sizeof(float) * rows * dim), *w = malloc(sizeof(float) * dim);
        float *oa = malloc(sizeof(float) * rows * dim), *ob = malloc(sizeof(float) * rows * dim);
        fill_floats(x, (size_t)rows * dim, -3.0f, 3.0f);
        fill_floats(w, dim, 0.5f, 1.5f);
        char what[64];
        snprintf(what, sizeof what, "rms_norm_rows dim %d", dim);
        compare(what, a->norm(x, w, rows, dim, 1e-6f, oa), b->norm(x, w, rows, dim, 1e-6f, ob), oa, ob,
                sizeof(float) * rows * dim);
        free(x); free(w); free(oa); free(ob);
    }
    const int inners[] = {5, 8, 12, 64, 100};
    for (int i = 0; i < 5; i++) {
        const int inner = inners[i], rows = 2;
        float *g = malloc(sizeof(float) * rows * 2 * inner), *oa = malloc(sizeof(float) * rows * inner);
        float *ob = malloc(sizeof(float) * rows * inner);
        fill_floats(g, (size_t)rows * 2 * inner, -12.0f, 12.0f);
        g[0] = -100.0f; /* below exp's floor */
        g[1] = -0.0f;
        char what[64];
        snprintf(what, sizeof what, "swiglu_rows inner %d", inner);
        compare(what, a->swiglu(g, rows, inner, oa), b->swiglu(g, rows, inner, ob), oa, ob,
                sizeof(float) * rows * inner);
        snprintf(what, sizeof what, "geglu_rows inner %d", inner);
        compare(what, a->geglu(g, rows, inner, oa), b->geglu(g, rows, inner, ob), oa, ob,
                sizeof(float) * rows * inner);
        free(g); free(oa); free(ob);
    }
}

/* A token tree over n rows: row i's parent an earlier row (NULL: a chain). */
static int *tree_parents(int n, int tree) {
    if (!tree) return NULL;
    int *parents = malloc(sizeof(int) * n);
    parents[0] = -1;
    for (int i = 1; i < n; i++) parents[i] = (int)(next_random() % i);
    return parents;
}

static void attention(const Build *a, const Build *b) {
    const int Ds[] = {8, 64, 128, 256}, ns[] = {1, 3, 9}, starts[] = {0, 5, 17};
    const int H = 4, KVH = 2;
    for (int di = 0; di < 4; di++)
        for (int ni = 0; ni < 3; ni++)
            for (int si = 0; si < 3; si++)
                for (int tree = 0; tree < 2; tree++)
                for (int window = 0; window <= 4; window += 4) { /* 0: none; 4: fewer than most rows see */
                    const int D = Ds[di], n = ns[ni], start = starts[si], capacity = start + n + 3;
                    const size_t kv = (size_t)KVH * capacity * D, out_n = (size_t)n * H * D;
                    float *q = malloc(sizeof(float) * out_n), *k = malloc(sizeof(float) * kv);
                    float *v = malloc(sizeof(float) * kv), *oa = malloc(sizeof(float) * out_n);
                    float *ob = malloc(sizeof(float) * out_n);
                    fill_floats(q, out_n, -1.0f, 1.0f);
                    fill_floats(k, kv, -1.0f, 1.0f);
                    fill_floats(v, kv, -1.0f, 1.0f);
                    int *parents = tree_parents(n, tree);
                    const float scale = 1.0f / sqrtf((float)D);
                    char what[96];
                    snprintf(what, sizeof what, "causal_attention D %d n %d start %d %s window %d", D, n, start,
                             tree ? "tree" : "chain", window);
                    compare(what, a->attention(q, k, v, n, start, H, KVH, D, capacity, scale, parents, window, oa, 2),
                            b->attention(q, k, v, n, start, H, KVH, D, capacity, scale, parents, window, ob, 2), oa,
                            ob, sizeof(float) * out_n);
                    free(q); free(k); free(v); free(oa); free(ob); free(parents);
                }
}

/* A matrix of random 8-bit codes and float16 scales, N x K, kept in `keep`. */
static Matrix random_matrix(int N, int K, void **keep) {
    const int blocks = (N + BLOCK - 1) / BLOCK, groups = K / GROUP;
    keep[0] = malloc(code_bytes(8, blocks, groups, K));
    keep[1] = malloc(scale_bytes(8, SCALES_FLOAT16, blocks, groups));
    fill_bytes(keep[0], code_bytes(8, blocks, groups, K));
    fill_scales(keep[1], 8, SCALES_FLOAT16, blocks, groups);
    const Matrix m = {keep[0], keep[1], NULL, NULL, N, groups, 8, SCALES_FLOAT16, ACTIVATIONS_Q8_0};
    return m;
}

/* One decoder layer (8-bit weights, a QK norm, a token tree) and an attention block, each on both builds
 * from the same state: the residual stream and the KV cache afterwards compared. */
static void layers(const Build *a, const Build *b) {
    const int hidden = 64, H = 2, KVH = 1, D = 32, inner = 96, n = 4, start = 3, capacity = 12;
    void *keep[8];
    float norm1[64], norm2[64];
    fill_floats(norm1, hidden, 0.5f, 1.5f);
    fill_floats(norm2, hidden, 0.5f, 1.5f);
    Layer L;
    memset(&L, 0, sizeof L);
    float qn[32], kn[32];
    fill_floats(qn, D, 0.5f, 1.5f);
    fill_floats(kn, D, 0.5f, 1.5f);
    L.norm1 = norm1, L.norm2 = norm2, L.eps1 = L.eps2 = 1e-5f, L.qkv_parts = L.gate_up_parts = 1;
    L.q_norm = qn, L.k_norm = kn, L.qk_eps = 1e-6f; /* (Qwen3's shape) */
    L.qkv[0] = random_matrix((H + 2 * KVH) * D, hidden, keep);
    L.gate_up[0] = random_matrix(2 * inner, hidden, keep + 2);
    L.out = random_matrix(hidden, H * D, keep + 4);
    L.down = random_matrix(hidden, inner, keep + 6);
    const size_t kv = (size_t)KVH * capacity * D;
    float xa[4 * 64], xb[4 * 64], cos[4 * 32], sin[4 * 32], ka[12 * 32], kb[12 * 32], va[12 * 32], vb[12 * 32];
    fill_floats(xa, (size_t)n * hidden, -1.0f, 1.0f);
    memcpy(xb, xa, sizeof xa);
    fill_floats(cos, (size_t)n * D, -1.0f, 1.0f);
    fill_floats(sin, (size_t)n * D, -1.0f, 1.0f);
    fill_floats(ka, kv, -1.0f, 1.0f);
    fill_floats(va, kv, -1.0f, 1.0f);
    memcpy(kb, ka, sizeof ka);
    memcpy(vb, va, sizeof va);
    int parents[4] = {-1, 0, 0, 1};
    const float scale = 1.0f / sqrtf((float)D);
    const int sa = a->layers(xa, n, hidden, start, &L, 1, H, KVH, D, ka, va, capacity, cos, sin, 1, scale, parents, 2);
    const int sb = b->layers(xb, n, hidden, start, &L, 1, H, KVH, D, kb, vb, capacity, cos, sin, 1, scale, parents, 2);
    compare("decoder_layers: residual stream", sa, sb, xa, xb, sizeof(float) * n * hidden);
    compare("decoder_layers: keys", sa, sb, ka, kb, sizeof(float) * kv);
    /* Gemma 3's shape: post-norms, GeGLU, a sliding window, the second of two rotary tables */
    float post1[64], post2[64], cos2[2 * 4 * 32], sin2[2 * 4 * 32];
    fill_floats(post1, hidden, 0.5f, 1.5f);
    fill_floats(post2, hidden, 0.5f, 1.5f);
    fill_floats(cos2, 2 * (size_t)n * D, -1.0f, 1.0f);
    fill_floats(sin2, 2 * (size_t)n * D, -1.0f, 1.0f);
    L.post_norm1 = post1, L.post_norm2 = post2, L.activation = ACT_GEGLU_TANH, L.window = 3, L.rope = 1;
    const int ga = a->layers(xa, n, hidden, start, &L, 1, H, KVH, D, ka, va, capacity, cos2, sin2, 2, scale, parents, 2);
    const int gb = b->layers(xb, n, hidden, start, &L, 1, H, KVH, D, kb, vb, capacity, cos2, sin2, 2, scale, parents, 2);
    compare("decoder_layers, Gemma 3's shape: residual stream", ga, gb, xa, xb, sizeof(float) * n * hidden);
    L.post_norm1 = L.post_norm2 = NULL, L.activation = ACT_SWIGLU, L.window = 0, L.rope = 0;
    float qkv[4 * 128], oa[4 * 64], ob[4 * 64];
    fill_floats(qkv, (size_t)n * (H + 2 * KVH) * D, -1.0f, 1.0f);
    compare("attention_block",
            a->block(qkv, n, start, H, KVH, D, NULL, NULL, 0.0f, cos, sin, ka, va, capacity, scale, NULL, 0, oa, 2),
            b->block(qkv, n, start, H, KVH, D, NULL, NULL, 0.0f, cos, sin, kb, vb, capacity, scale, NULL, 0, ob, 2), oa,
            ob, sizeof(float) * n * H * D);
    compare("attention_block with a QK norm",
            a->block(qkv, n, start, H, KVH, D, qn, kn, 1e-6f, cos, sin, ka, va, capacity, scale, NULL, 2, oa, 2),
            b->block(qkv, n, start, H, KVH, D, qn, kn, 1e-6f, cos, sin, kb, vb, capacity, scale, NULL, 2, ob, 2), oa,
            ob, sizeof(float) * n * H * D);
    for (int i = 0; i < 8; i++) free(keep[i]);
}

/* A decoder layer whose MLP is a mixture of experts (Qwen3-MoE's shape: 6 experts, 2 a row, a float32
 * router, each expert's gate and up as two parts), over a token tree, on both builds. */
static void mixture(const Build *a, const Build *b) {
    enum { hidden = 64, H = 2, KVH = 1, D = 32, inner = 32, n = 5, start = 2, capacity = 12, E = 6 };
    void *keep[6 + 6 * E];
    float norm1[hidden], norm2[hidden], router[E * hidden];
    fill_floats(norm1, hidden, 0.5f, 1.5f);
    fill_floats(norm2, hidden, 0.5f, 1.5f);
    fill_floats(router, E * hidden, -1.0f, 1.0f);
    Matrix gate_up[2 * E], down[E];
    for (int e = 0; e < E; e++) {
        gate_up[2 * e] = random_matrix(inner, hidden, keep + 6 + 6 * e);
        gate_up[2 * e + 1] = random_matrix(inner, hidden, keep + 8 + 6 * e);
        down[e] = random_matrix(hidden, inner, keep + 10 + 6 * e);
    }
    /* the router in the float32 block layout: block b holds, for each k, its 16 columns side by side */
    float routed[BLOCK * hidden];
    memset(routed, 0, sizeof routed);
    for (int c = 0; c < E; c++)
        for (int k = 0; k < hidden; k++) routed[k * BLOCK + c] = router[c * hidden + k];
    const Experts experts = {{routed, NULL, NULL, NULL, E, 0, 32, 0}, gate_up, down, E, 2, 2, 1};
    Layer L;
    memset(&L, 0, sizeof L);
    L.norm1 = norm1, L.norm2 = norm2, L.eps1 = L.eps2 = 1e-5f, L.qkv_parts = 1, L.experts = &experts;
    L.qkv[0] = random_matrix((H + 2 * KVH) * D, hidden, keep);
    L.out = random_matrix(hidden, H * D, keep + 2);
    float xa[n * hidden], xb[n * hidden], cos[n * D], sin[n * D], ka[capacity * D], kb[capacity * D];
    float va[capacity * D], vb[capacity * D];
    fill_floats(xa, (size_t)n * hidden, -1.0f, 1.0f);
    memcpy(xb, xa, sizeof xa);
    fill_floats(cos, (size_t)n * D, -1.0f, 1.0f);
    fill_floats(sin, (size_t)n * D, -1.0f, 1.0f);
    fill_floats(ka, capacity * D, -1.0f, 1.0f);
    fill_floats(va, capacity * D, -1.0f, 1.0f);
    memcpy(kb, ka, sizeof ka);
    memcpy(vb, va, sizeof va);
    int parents[n] = {-1, 0, 0, 1, 2};
    const float scale = 1.0f / sqrtf((float)D);
    const int sa = a->layers(xa, n, hidden, start, &L, 1, H, KVH, D, ka, va, capacity, cos, sin, 1, scale, parents, 2);
    const int sb = b->layers(xb, n, hidden, start, &L, 1, H, KVH, D, kb, vb, capacity, cos, sin, 1, scale, parents, 2);
    compare("decoder_layers, a mixture of experts: residual stream", sa, sb, xa, xb, sizeof(float) * n * hidden);
    keep[4] = keep[5] = NULL;
    for (int i = 0; i < 6 + 6 * E; i++) free(keep[i]);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s REFERENCE.so CANDIDATE.so\n", argv[0]);
        return 2;
    }
    Build a, b;
    if (!load(argv[1], &a) || !load(argv[2], &b)) return 2;
    products(&a, &b);
    norms(&a, &b);
    attention(&a, &b);
    layers(&a, &b);
    mixture(&a, &b);
    printf("isa %d against isa %d: %d cases, %d differ\n", b.isa, a.isa, cases, failures);
    return failures ? 1 : 0;
}
