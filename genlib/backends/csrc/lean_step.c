/* The forward of a Llama-architecture model in float32 on the CPU for a few new tokens
 * ("slots") over KV caches: the arithmetic of genlib.backends.llama.LeanLlama's step in one OpenMP
 * parallel region. The slots are either
 *
 *   - one row's next k tokens at consecutive positions of one cache (an extend: verifying
 *     k drafted tokens, or a prompt in chunks from position 0), each attending causally
 *     to the cached prefix and to the slots before it; or
 *   - one token each of B rows, each row with its own cache and position (a batch step);
 *
 * or any mix: consecutive slots that share a cache are one row's tokens in order (a
 * "run"). The one-token step (`genlab_step`) is the case of one slot.
 *
 * A decode step reads every weight once and does two multiply-adds per weight per slot,
 * so at a few slots it is bound by memory bandwidth: each product reads a panel of
 * weight rows once and multiplies it by every slot's input while it is in registers and
 * L1 (`matmul`), prefetching the next panel meanwhile, so k slots cost little more than
 * one. What else keeps a step from that
 * bound is everything between the weight reads: a torch.compile'd step runs each of its
 * ~100 kernels as a parallel region of its own, with a barrier after each. Here the
 * threads stay in one region for the whole call and meet five times a layer, where a
 * result one thread computed is read by another:
 *
 *   qkv   rows of the q/k/v product split across threads            | barrier
 *   attn  (run, kv head) pairs split: rotary, KV cache writes,      | barrier
 *         softmax(q.k) . v, a run's slots in order
 *   o     rows split, added to the residual                         | barrier
 *   mlp   rows of gate and up split, silu(gate) * up                | barrier
 *   down  rows split, added to the residual                         | barrier
 *
 * and the norms are computed by every thread for itself (a few hundred numbers a slot).
 * Gemma's norms on each sublayer's output need its whole branch first: there the o and
 * down products write a branch buffer, and after a barrier each thread adds its rows of
 * the normed branch to the residual (`add_branch_of`: seven barriers a layer).
 * The products run on GCC's vector extensions (16 lanes where -march=native gives
 * AVX-512, 8 elsewhere: one AVX2 register, two SSE or NEON ones), a panel's column of
 * weights times a broadcast input; softmax and SiLU take a vectorized exp: AVX-512
 * intrinsics with AVX-512, AVX2 intrinsics with AVX2, libm's expf on other CPUs.
 *
 * Every slot's numbers are computed exactly as a one-slot call computes them: each
 * (weight row, slot) sum runs in the same order whatever the number of slots, and a
 * slot's attention reads the cache (now holding the run's earlier slots) as a one-token
 * step at its position would. So k slots give the bits of k one-token steps, and B rows
 * the bits of B one-row steps (and the same bits at any thread count).
 *
 * Weights are packed in panels of PANEL rows, each panel column by column (see
 * `matmul`); the q/k/v matrices are stacked ([q; k; v]). Built with
 * -DGENLAB_BF16_WEIGHTS, the matrices are bfloat16 (kernel.py packs them, each float32
 * rounded to its top half by torch, to nearest even) and widened to float32 as a panel
 * is read; the arithmetic stays float32. That is a draft model's step: its reads halve,
 * and the target checks its proposals anyway. KV buffers are (kv_heads,
 * capacity, head_dim) per layer, as genlib.backends.llama.LeanCache holds them. Sums run
 * in another order than PyTorch's, so logits differ from the lean forward's in the last
 * bits (the tests bound the difference and check the tokens).
 */
#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The products' vectors: 16 lanes with AVX-512; 8 elsewhere, one AVX2 register (two SSE
 * or NEON ones). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));
typedef float vec_u __attribute__((vector_size(LANES * 4), aligned(4)));  /* unaligned */

/* A matrix weight as the products read it, and LANES of them as a vector of floats.
 * The quantized formats (-DGENLAB_Q8_0_WEIGHTS, _NF4_, _Q4_0_) read bytes: blocks of
 * BLOCK columns, each with one float32 scale a row (see `panel_tile`). */
#if defined(GENLAB_Q8_0_WEIGHTS) || defined(GENLAB_NF4_WEIGHTS) || defined(GENLAB_Q4_0_WEIGHTS)
#define QUANTIZED 1
typedef unsigned char weight_t;
#elif defined(GENLAB_BF16_WEIGHTS)
typedef unsigned short weight_t;
typedef unsigned short weights_16 __attribute__((vector_size(LANES * 2)));
typedef unsigned int weights_32 __attribute__((vector_size(LANES * 4)));
static inline vec widen(const weight_t *w) {  /* bfloat16 -> float32: the bits, shifted */
    return (vec)(__builtin_convertvector(*(const weights_16 *)w, weights_32) << 16);
}
#else
typedef float weight_t;
static inline vec widen(const weight_t *w) { return *(const vec *)w; }
#endif

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, vocab, layers, threads;
    float eps, scale;
    const float *embed, *norm;
    const weight_t *lm_head;
    const float *cos, *sin;  /* tables: (positions, head_dim) */
    /* per layer */
    const float *const *input_norm;
    const weight_t *const *qkv;
    const float *const *qkv_bias;
    const weight_t *const *o;
    const float *const *post_norm;
    const weight_t *const *gate, *const *up, *const *down;
    /* The architecture's differences from Llama's block (genlib/backends/arch.py):
     * embeddings, residual branches and logits scaled (granite's multipliers, gemma's
     * sqrt(hidden); 1 elsewhere), per layer attention over the last windows[i]
     * positions (mistral, gemma's sliding layers; 0: all), and per layer each head's q
     * and k RMS-normed before rope (qwen3, gemma3; NULL elsewhere). */
    float embedding_multiplier, residual_multiplier, logits_scaling;
    const int *windows;
    const float *const *q_norm, *const *k_norm;
    /* gemma's: scores and logits soft-capped (cap * tanh(s / cap); 0: not), the MLP's
     * gate through gelu's tanh form (else silu), per layer the attention's and the
     * MLP's outputs RMS-normed before the residual add (NULL: not), and per layer rope
     * tables (gemma3's sliding layers have their own; NULL: cos and sin). The norms'
     * weights come as gemma multiplies by them, (1 + weight). */
    float attn_softcap, final_softcap;
    int gelu;
    const float *const *attn_out_norm, *const *mlp_out_norm;
    const float *const *layer_cos, *const *layer_sin;
    /* gpt2's: LayerNorm (the mean removed, then weight and bias) for every norm whose
     * bias is given (norm_bias, per layer input_norm_bias and post_norm_bias; NULL:
     * RMSNorm); biases on the o, up and down products (per layer; NULL: none); learned
     * positions, position_embed (positions, hidden) added to the token's embedding and
     * no rope (NULL: rope); and an MLP without a gate (gate NULL: act(up) alone). gelu
     * above is then GELU_TANH or GELU_EXACT (erf). */
    const float *norm_bias;
    const float *const *input_norm_bias, *const *post_norm_bias;
    const float *const *o_bias, *const *up_bias, *const *down_bias;
    const float *position_embed;
    /* The output matrix's product where it is stored in another format than the
     * layers' (NULL: the build's own `matmul`): a 4-bit build points it at the q8_0
     * build's `genlab_matmul`, lm_head then in q8_0 (llama.cpp's Q4_0 files keep it at
     * 6 or 8 bits). */
    void (*head_matmul)(const weight_t *w, int n, const float *x, long ldx, float *out,
                        long ldo, int r0, int r1, int m, int accumulate);
} Model;

/* Model.gelu: the MLP's activation. */
#define SILU 0
#define GELU_TANH 1
#define GELU_EXACT 2

/* gelu's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), is
 * x * sigmoid(2u) = x / (1 + e^-(x (GELU_A + GELU_B x^2))): silu's form, the argument
 * changed. */
#define GELU_A 1.5957691216057308f  /* 2 sqrt(2 / pi) */
#define GELU_B 0.07135481627260025f  /* GELU_A * 0.044715 */

#ifdef __AVX512F__
#include <immintrin.h>
static float hsum(vec v) { return _mm512_reduce_add_ps((__m512)v); }
#else
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
typedef int lanes_i __attribute__((vector_size(32)));
#define SHUFFLE(v, ...) __builtin_shuffle(v, (lanes_i){__VA_ARGS__})
#endif
/* The sum of 8 lanes as a tree (lane i + lane i+4, then i+2, then i+1): three shuffles
 * and adds, where a lane-by-lane sum would be a chain of seven dependent adds. */
static float hsum(vec v) {
    v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += SHUFFLE(v, 2, 3, 0, 1, 2, 3, 0, 1);
    v += SHUFFLE(v, 1, 0, 1, 0, 1, 0, 1, 0);
    return v[0];
}
#endif

#ifdef __AVX512F__
/* e^x, 16 lanes: Cephes' expf (a degree-5 polynomial on x - n ln 2, within 2 ulp), the
 * power of two applied by scalef, which underflows to 0 as expf does. */
static __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.72f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f),
                                                    _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* s[j] = e^(s[j] - top) for j < n; their sum. */
static float exp_shifted(float *s, long n, float top) {
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (long j = 0; j < n; j += LANES) {
        __mmask16 lanes = n - j >= LANES ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), shift));
        _mm512_mask_storeu_ps(s + j, lanes, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* gate[j] = act(gate[j]) * up[j] (up NULL: act(gate[j])) for j < n: silu, gate / (1 + e^-gate), or with `gelu`
 * gelu's tanh form, gate / (1 + e^-(gate * (GELU_A + GELU_B * gate^2))) (see GELU_A). */
static void gate_times(float *gate, const float *up, int n, int gelu) {
    for (int j = 0; j < n; j += LANES) {
        __mmask16 lanes = n - j >= LANES ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(lanes, gate + j), t = g;
        if (gelu)
            t = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(GELU_B),
                                                 _mm512_set1_ps(GELU_A)));
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), t));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        if (up) silu = _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(lanes, up + j));
        _mm512_mask_storeu_ps(gate + j, lanes, silu);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* e^x, 8 lanes: the same polynomial as exp16; AVX2 has no scalef, so the power of two
 * is built in the exponent bits, in two halves so that each stays a normal number
 * (n runs from -150 to 128) and the product underflows to 0 as expf does. */
static __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.72f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f),
                                               _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i k = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(k, 1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* Lanes [0, count) of 8 set: the masked loads and stores of a row's last lanes. */
static __m256i first_lanes(long count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count < 8 ? count : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* s[j] = e^(s[j] - top) for j < n; their sum. */
static float exp_shifted(float *s, long n, float top) {
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (long j = 0; j < n; j += 8) {
        __m256i lanes = first_lanes(n - j);
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, lanes), shift));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes));
        _mm256_maskstore_ps(s + j, lanes, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum((vec)sum);
}

/* gate[j] = act(gate[j]) * up[j] for j < n, as the AVX-512 gate_times. */
static void gate_times(float *gate, const float *up, int n, int gelu) {
    for (int j = 0; j < n; j += 8) {
        __m256i lanes = first_lanes(n - j);
        __m256 g = _mm256_maskload_ps(gate + j, lanes), t = g;
        if (gelu)
            t = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(GELU_B),
                                                 _mm256_set1_ps(GELU_A)));
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), t));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        if (up) silu = _mm256_mul_ps(silu, _mm256_maskload_ps(up + j, lanes));
        _mm256_maskstore_ps(gate + j, lanes, silu);
    }
}
#else
static float exp_shifted(float *s, long n, float top) {
    float total = 0.0f;
    for (long j = 0; j < n; j++) total += s[j] = expf(s[j] - top);
    return total;
}

static void gate_times(float *gate, const float *up, int n, int gelu) {
    for (int j = 0; j < n; j++) {
        float g = gate[j], t = gelu ? g * (GELU_A + GELU_B * g * g) : g;
        gate[j] = up ? g / (1.0f + expf(-t)) * up[j] : g / (1.0f + expf(-t));
    }
}
#endif

/* The MLP's activation: gate[j] = act(gate[j]) * up[j] (up NULL: act(gate[j])), gelu
 * GELU_EXACT as torch's exact gelu, x / 2 (1 + erf(x / sqrt 2)); else `gate_times`. */
static void activate(float *gate, const float *up, int n, int gelu) {
    if (gelu != GELU_EXACT) {
        gate_times(gate, up, n, gelu);
        return;
    }
    for (int j = 0; j < n; j++) {
        float g = gate[j] * 0.5f * (1.0f + erff(gate[j] * (float)M_SQRT1_2));
        gate[j] = up ? g * up[j] : g;
    }
}

static float dot(const float *w, const float *x, int n) {
    vec acc = {0};
    int k = 0;
    for (; k + LANES <= n; k += LANES) acc += *(const vec_u *)(w + k) * *(const vec_u *)(x + k);
    float s = hsum(acc);
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}

static void put(float *out, float s, int accumulate) { *out = accumulate ? *out + s : s; }

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* How far ahead the attention prefetches its keys and values, in cache rows: a row is
 * a head_dim of floats, a few cache lines, so the next few rows come too soon to hide a
 * read from memory. A batch step can read more KV cache than weights (code-target, 32
 * rows of 128-152 cached tokens: 110 MB against 69 MB), and these distances were the
 * fastest of those tried there (their timings: `git log -S KEYS_AHEAD`). */
#define KEYS_AHEAD 16
#define VALUES_AHEAD 8

/* Rows w0..w3 (row-major, n columns) times one input x: out[j] = dot(w_j, x), each sum
 * as dot() orders it (lanes, then hsum). For the attention's keys, which the cache holds
 * row by row; while it reads four rows it prefetches those KEYS_AHEAD rows on. */
ALWAYS_INLINE void four_rows(const float *w0, int n, const float *x, float *out) {
    const float *w[4] = {w0, w0 + n, w0 + 2 * n, w0 + 3 * n};
    vec a[4] = {{0}, {0}, {0}, {0}};
    int k = 0;
    for (; k + LANES <= n; k += LANES) {
        vec xv = *(const vec_u *)(x + k);
        for (int j = 0; j < 4; j++) {
            __builtin_prefetch(w[j] + k + (long)KEYS_AHEAD * n, 0, 3);
            a[j] += *(const vec_u *)(w[j] + k) * xv;
        }
    }
    for (int j = 0; j < 4; j++) {
        float s = hsum(a[j]);
        for (int t = k; t < n; t++) s += w[j][t] * x[t];
        out[j] = s;
    }
}

/* out[j] = dot(rows[j], x) for j < count: the attention's scores over cached keys. */
static void rows_times(const float *rows, int n, const float *x, long count, float *out) {
    long j = 0;
    for (; j + 4 <= count; j += 4) four_rows(rows + j * n, n, x, out + j);
    for (; j < count; j++) out[j] = dot(rows + j * n, x, n);
}

/* The weight matrices are packed in panels of PANEL rows (genlib/backends/kernel.py
 * packs them): panel p holds rows [p * PANEL, (p + 1) * PANEL) column by column, an
 * (n, PANEL) block, its rows past the matrix's last zero. One vector load takes LANES
 * rows' weights of one column, which multiply a slot's input broadcast, so a panel times
 * a slot needs no horizontal sum, and every (row, slot) sum runs over the columns in
 * order, one multiply-add each, whatever the number of slots: k slots give the bits of
 * k one-slot calls. */
#define PANEL (2 * LANES)
/* Slots per pass over a panel: 2 x TILE accumulators, the panel's two vectors and a
 * broadcast input fit the registers (AVX2's 16, AVX-512's 32); the quantized formats
 * hold a block's sums beside the totals, twice the accumulators. */
#if defined(__AVX512F__) && !defined(QUANTIZED)
#define TILE 12
#elif defined(__AVX512F__) || !defined(QUANTIZED)
#define TILE 6
#else
#define TILE 3
#endif

int genlab_panel_rows(void) { return PANEL; }
int genlab_weight_bytes(void) { return (int)sizeof(weight_t); }

/* The m slots' sums a[i] of one panel into out[i * ldo + j] (set or accumulated), for
 * the `valid` real rows of the panel. */
ALWAYS_INLINE void store_tile(vec (*a)[2], int m, float *out, long ldo, int valid,
                              int accumulate) {
    for (int i = 0; i < m; i++) {
        float *o = out + i * ldo;
        if (valid == PANEL) {
            vec_u *o0 = (vec_u *)o, *o1 = (vec_u *)(o + LANES);
            *o0 = accumulate ? *o0 + a[i][0] : a[i][0];
            *o1 = accumulate ? *o1 + a[i][1] : a[i][1];
        } else {
            float sums[PANEL];
            *(vec_u *)sums = a[i][0];
            *(vec_u *)(sums + LANES) = a[i][1];
            for (int j = 0; j < valid; j++) put(o + j, sums[j], accumulate);
        }
    }
}

#ifndef QUANTIZED
const char *genlab_weight_format(void) {
    return sizeof(weight_t) == 4 ? "float32" : "bfloat16";
}

/* Panel r / PANEL of a packed matrix of n columns. */
static inline const weight_t *panel_at(const weight_t *w, int r, int n) {
    return w + (long)r * n;
}

/* One panel (`valid` of its rows real) times m <= TILE slots' inputs x (row stride ldx):
 * out[i * ldo + j] set or accumulated. While it reads the panel, it prefetches the next
 * one, so the memory reads overlap the products. */
ALWAYS_INLINE void panel_tile(const weight_t *p, int n, const float *x, long ldx, float *out,
                              long ldo, int m, int valid, int accumulate) {
    vec a[TILE][2];
    for (int i = 0; i < m; i++) a[i][0] = a[i][1] = (vec){0};
    for (int k = 0; k < n; k++) {
        const weight_t *column = p + (long)k * PANEL;
        for (int line = 0; line < PANEL * (int)sizeof(weight_t); line += 64)
            __builtin_prefetch((const char *)(column + (long)n * PANEL) + line, 0, 3);
        vec v0 = widen(column), v1 = widen(column + LANES);
        for (int i = 0; i < m; i++) {
            float xi = x[i * ldx + k];
            a[i][0] += v0 * xi;
            a[i][1] += v1 * xi;
        }
    }
    store_tile(a, m, out, ldo, valid, accumulate);
}
#else
/* Quantized panels (genlib/backends/quant.py packs them): a panel is its blocks of
 * BLOCK columns in order, each block PANEL float32 scales (one a row) and then its
 * codes column by column, CODE_BYTES a column: q8_0 one int8 a row; nf4 and q4_0 a
 * nibble a row, byte j holding row j (low) and row j + LANES (high), looked up in a
 * 16-level table. A block's products sum code * input in float32, the sum then times
 * the row's scale: the float products of the dequantized weights, summed in another
 * order (the tests bound the difference). */
#if defined(GENLAB_Q8_0_WEIGHTS)
#define BLOCK 32
#define CODE_BYTES PANEL
#define FORMAT "q8_0"
typedef signed char codes_t __attribute__((vector_size(LANES), aligned(1)));
/* int8 -> float32: sign-extend, convert (GCC scalarizes a char vector's conversion,
 * which ran q8_0 at half float32's speed, hence the intrinsics). */
static inline void unpack(const weight_t *c, vec *v0, vec *v1) {
#if defined(__AVX512F__)
    *v0 = (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    *v1 = (vec)_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + LANES))));
#elif defined(__AVX2__)
    *v0 = (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
    *v1 = (vec)_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + LANES))));
#else
    *v0 = __builtin_convertvector(*(const codes_t *)c, vec);
    *v1 = __builtin_convertvector(*(const codes_t *)(c + LANES), vec);
#endif
}
#else
#define CODE_BYTES LANES
#ifdef GENLAB_NF4_WEIGHTS
#define BLOCK 64
#define FORMAT "nf4"
/* bitsandbytes' NF4 levels (genlib/backends/quant.py). */
static const float LEVELS[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
#else
#define BLOCK 32
#define FORMAT "q4_0"
static const float LEVELS[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
#endif
typedef unsigned char nibbles_t __attribute__((vector_size(LANES), aligned(1)));
/* A column's 2 * LANES nibbles as two vectors of their levels: with AVX-512 one
 * register holds the 16-level table, and one permute looks up 16 nibbles. */
static inline void unpack(const weight_t *c, vec *v0, vec *v1) {
#ifdef __AVX512F__
    __m512 table = _mm512_loadu_ps(LEVELS);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *v0 = (vec)_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table);
    *v1 = (vec)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
#else
    nibbles_t b = *(const nibbles_t *)c;
    for (int l = 0; l < LANES; l++) {
        (*v0)[l] = LEVELS[b[l] & 15];
        (*v1)[l] = LEVELS[b[l] >> 4];
    }
#endif
}
#endif

const char *genlab_weight_format(void) { return FORMAT; }

/* The bytes of a panel of n columns. */
static inline long panel_bytes(int n) {
    return (long)(n + BLOCK - 1) / BLOCK * PANEL * 4 + (long)n * CODE_BYTES;
}

static inline const weight_t *panel_at(const weight_t *w, int r, int n) {
    return w + (long)(r / PANEL) * panel_bytes(n);
}

/* One quantized panel times m <= TILE slots, as the float panel_tile: each block's sums
 * times its scales into the totals. Prefetches the next panel as it reads this one. */
ALWAYS_INLINE void panel_tile(const weight_t *p, int n, const float *x, long ldx, float *out,
                              long ldo, int m, int valid, int accumulate) {
    vec a[TILE][2], b[TILE][2];
    long ahead = panel_bytes(n);
    for (int i = 0; i < m; i++) a[i][0] = a[i][1] = (vec){0};
    for (int k0 = 0; k0 < n; k0 += BLOCK) {
        int columns = n - k0 < BLOCK ? n - k0 : BLOCK;
        vec s0 = *(const vec_u *)p, s1 = *(const vec_u *)(p + LANES * 4);
        for (int line = 0; line < PANEL * 4; line += 64)
            __builtin_prefetch(p + ahead + line, 0, 3);
        const weight_t *c = p + PANEL * 4;
        for (int i = 0; i < m; i++) b[i][0] = b[i][1] = (vec){0};
        for (int k = 0; k < columns; k++, c += CODE_BYTES) {
            if (k % (64 / CODE_BYTES) == 0) __builtin_prefetch(c + ahead, 0, 3);
            vec v0, v1;
            unpack(c, &v0, &v1);
            for (int i = 0; i < m; i++) {
                float xi = x[i * ldx + k0 + k];
                b[i][0] += v0 * xi;
                b[i][1] += v1 * xi;
            }
        }
        for (int i = 0; i < m; i++) {
            a[i][0] += b[i][0] * s0;
            a[i][1] += b[i][1] * s1;
        }
        p = c;
    }
    store_tile(a, m, out, ldo, valid, accumulate);
}
#endif

/* A panel times m slots, TILE slots at a time. */
ALWAYS_INLINE void panel_pass(const weight_t *p, int n, const float *x, long ldx, float *out,
                              long ldo, int m, int valid, int accumulate) {
    int i = 0;
    for (; i + TILE <= m; i += TILE)
        panel_tile(p, n, x + i * ldx, ldx, out + i * ldo, ldo, TILE, valid, accumulate);
    switch (m - i) {  /* the rest, with a constant m for each inlined copy */
#define REST(k) case k: panel_tile(p, n, x + i * ldx, ldx, out + i * ldo, ldo, k, valid, accumulate); break;
#if TILE > 6
    REST(11)
    REST(10)
    REST(9)
    REST(8)
    REST(7)
    REST(6)
#endif
#if TILE > 3
    REST(5)
    REST(4)
    REST(3)
#endif
    REST(2)
    REST(1)
    default: break;
    }
}

/* out[i * ldo + r] = dot(w[r], x[i]) (+ out[...] when accumulate) for rows [r0, r1) of
 * the packed matrix w (n columns; r0 a multiple of PANEL, r1 one too or the last row)
 * and the m slots' inputs x[i] = x + i * ldx: each panel read from memory once and
 * multiplied by every slot while it stays in L1. */
static void matmul(const weight_t *w, int n, const float *x, long ldx, float *out, long ldo,
                   int r0, int r1, int m, int accumulate) {
    for (int r = r0; r < r1; r += PANEL) {
        int valid = r1 - r < PANEL ? r1 - r : PANEL;
        const weight_t *p = panel_at(w, r, n);
        if (m == 1)
            panel_tile(p, n, x, ldx, out + r, ldo, 1, valid, accumulate);
        else
            panel_pass(p, n, x, ldx, out + r, ldo, m, valid, accumulate);
    }
}

/* `matmul` for another build's Model (its `head_matmul`). */
void genlab_matmul(const weight_t *w, int n, const float *x, long ldx, float *out, long ldo,
                   int r0, int r1, int m, int accumulate) {
    matmul(w, n, x, ldx, out, ldo, r0, r1, m, accumulate);
}

/* This thread's share [*r0, *r1) of `rows` weight rows, in whole panels. */
static void share(int rows, int thread, int threads, int *r0, int *r1) {
    int chunk = ((rows + threads - 1) / threads + PANEL - 1) / PANEL * PANEL;
    *r0 = thread * chunk < rows ? thread * chunk : rows;
    *r1 = *r0 + chunk < rows ? *r0 + chunk : rows;
}

static float rms_scale(const float *x, int n, float eps) {
    float squares = 0.0f;
    for (int i = 0; i < n; i++) squares += x[i] * x[i];
    return 1.0f / sqrtf(squares / n + eps);
}

static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    float scale = rms_scale(x, n, eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

/* LayerNorm: (x - mean) / sqrt(variance + eps) * weight + bias (gpt2's). */
static void layer_norm(const float *x, const float *weight, const float *bias, float *out,
                       int n, float eps) {
    float mean = 0.0f, variance = 0.0f;
    for (int i = 0; i < n; i++) mean += x[i];
    mean /= n;
    for (int i = 0; i < n; i++) variance += (x[i] - mean) * (x[i] - mean);
    float scale = 1.0f / sqrtf(variance / n + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] - mean) * scale * weight[i] + bias[i];
}

/* A block's norm: LayerNorm where it has a bias (gpt2's), else RMSNorm. */
static void block_norm(const float *x, const float *weight, const float *bias, float *out,
                       int n, float eps) {
    if (bias)
        layer_norm(x, weight, bias, out, n, eps);
    else
        rms_norm(x, weight, out, n, eps);
}

/* Layer i's entry of a per-layer array that may be absent (NULL). */
static const float *of_layer(const float *const *array, int i) {
    return array ? array[i] : 0;
}

/* cap * tanh(s / cap) for each of n scores or logits (gemma's soft-cap). */
static void soft_cap(float *s, long n, float cap) {
    for (long j = 0; j < n; j++) s[j] = tanhf(s[j] / cap) * cap;
}

/* x * cos + roll(x, half) * sin, the sine table carrying rotate_half's sign; x as it is
 * where there are no tables (cos NULL: learned positions). */
static void rotary(const float *x, const float *cos, const float *sin, float *out, int d) {
    if (!cos) {
        memcpy(out, x, sizeof(float) * d);
        return;
    }
    int half = d / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static void add_scaled(float *restrict out, const float *restrict row, float p, int d) {
    for (int i = 0; i < d; i++) out[i] += p * row[i];
}

/* Output floats a mix keeps in registers at once: 64, a common head_dim (4 AVX-512
 * vectors, 8 AVX2 ones); a wider head takes blocks of 64. */
#define MIX_FLOATS 64
#define MIX_VECS (MIX_FLOATS / LANES)

/* out = sum over j < count of (scores[j] / total) * values[j] (rows of d), plus
 * (last_score / total) * last, each output number summed in the order of j as
 * add_scaled row by row sums it, but MIX_VECS vectors of out at a time held in
 * registers: a row-by-row sum stores and reloads all of out for every row. */
static void mix_values(float *out, const float *values, long count, const float *scores,
                       float total, const float *last, float last_score, int d) {
    int c = 0;
    for (; c + MIX_VECS * LANES <= d; c += MIX_VECS * LANES) {
        vec acc[MIX_VECS];
        for (int v = 0; v < MIX_VECS; v++) acc[v] = (vec){0};
        for (long j = 0; j < count; j++) {
            float p = scores[j] / total;
            for (int line = 0; line < MIX_FLOATS * 4; line += 64)
                __builtin_prefetch((const char *)(values + (j + VALUES_AHEAD) * d + c) + line,
                                   0, 3);
            for (int v = 0; v < MIX_VECS; v++)
                acc[v] += p * *(const vec_u *)(values + j * d + c + v * LANES);
        }
        float p = last_score / total;
        for (int v = 0; v < MIX_VECS; v++)
            acc[v] += p * *(const vec_u *)(last + c + v * LANES);
        for (int v = 0; v < MIX_VECS; v++) *(vec_u *)(out + c + v * LANES) = acc[v];
    }
    if (c < d) {  /* the rest of the columns, row by row */
        memset(out + c, 0, sizeof(float) * (d - c));
        for (long j = 0; j < count; j++)
            add_scaled(out + c, values + j * d + c, scores[j] / total, d - c);
        add_scaled(out + c, last + c, last_score / total, d - c);
    }
}

/* One query over a KV head's `position` cached keys and values (rows of head_dim) and
 * its own new key and value: the scores are a product over the cached keys, the last
 * window - 1 of them under a sliding window. */
static void attend(const Model *m, int window, const float *q, const float *keys,
                   const float *values, const float *key, const float *value, long position,
                   float *scores, float *out) {
    int d = m->head_dim;
    if (window && position >= window) {
        long first = position - window + 1;
        keys += first * d;
        values += first * d;
        position -= first;
    }
    rows_times(keys, d, q, position, scores);
    scores[position] = dot(q, key, d);
    float top = -INFINITY;
    for (long j = 0; j <= position; j++) scores[j] *= m->scale;
    if (m->attn_softcap) soft_cap(scores, position + 1, m->attn_softcap);
    for (long j = 0; j <= position; j++) top = scores[j] > top ? scores[j] : top;
    float total = exp_shifted(scores, position + 1, top);
    mix_values(out, values, position, scores, total, value, scores[position], d);
}

/* One call's slots (see the header): slot s feeds tokens[s] at positions[s] of the cache
 * whose layer-i buffers are keys[s][i], values[s][i], of capacities[s] positions. Runs
 * of consecutive slots sharing a cache: run r is slots [run_start[r], run_start[r + 1]). */
typedef struct {
    int n, runs;
    const long *tokens, *positions, *capacities;
    float *const *const *keys, *const *const *values;
    const int *run_start;
} Slots;

/* Per-call buffers: one row per slot (x, qkv, attn, mlp, branch), one set per thread
 * (h, scores). */
typedef struct {
    float *x, *h, *qkv, *attn, *mlp, *branch, *scores;
} Buffers;

/* One head's q or k as rope takes it: RMS-normed by layer i's weights where the model
 * has them (into `normed`), else as it is. */
static const float *head_norm(const Model *m, const float *const *norms, int i,
                              const float *x, float *normed) {
    if (!norms) return x;
    rms_norm(x, norms[i], normed, m->head_dim, m->eps);
    return normed;
}

/* x[s][r] += (branch[s][r] + bias[r]) * multiplier for rows [r0, r1) of n slots
 * (granite's scaled residual branches; gpt2's biases, NULL: none). */
static void add_branch(float *x, const float *branch, const float *bias, int n, int hidden,
                       int r0, int r1, float multiplier) {
    for (int s = 0; s < n; s++)
        for (int r = r0; r < r1; r++) {
            float y = branch[(long)s * hidden + r];
            if (bias) y += bias[r];
            x[(long)s * hidden + r] += multiplier == 1.0f ? y : y * multiplier;
        }
}

/* x[s][r] += bias[r] for rows [r0, r1) of n slots of `width` (gpt2's biases). */
static void add_bias(float *x, const float *bias, int n, long width, int r0, int r1) {
    if (!bias) return;
    for (int s = 0; s < n; s++)
        for (int r = r0; r < r1; r++) x[s * width + r] += bias[r];
}

/* Each (run, KV head) pair is one thread's: it writes the run's keys and values of that
 * head in slot order, each slot attending right after its own write, so a slot sees the
 * run's earlier slots, and writes and reads of a head's cache never cross threads. */
static void attention(const Model *m, int i, const Slots *c, const Buffers *b, int thread,
                      int threads) {
    int d = m->head_dim, group = m->heads / m->kv_heads;
    int rows = (m->heads + 2 * m->kv_heads) * d, pairs = c->runs * m->kv_heads;
    const float *cos_table = m->layer_cos ? m->layer_cos[i] : m->cos;
    const float *sin_table = m->layer_sin ? m->layer_sin[i] : m->sin;
    float q[d], key[d], normed[d];
    /* pairs split evenly (no runs of four here: they are not weight rows) */
    for (int p = pairs * thread / threads; p < pairs * (thread + 1) / threads; p++) {
        int run = p / m->kv_heads, g = p % m->kv_heads;
        for (int s = c->run_start[run]; s < c->run_start[run + 1]; s++) {
            long position = c->positions[s], capacity = c->capacities[s];
            const float *cos = cos_table ? cos_table + position * d : 0;
            const float *sin = sin_table ? sin_table + position * d : 0;
            const float *qkv = b->qkv + (long)s * rows;
            const float *value = qkv + (m->heads + m->kv_heads + g) * d;
            float *keys = c->keys[s][i] + (long)g * capacity * d;
            float *values = c->values[s][i] + (long)g * capacity * d;
            rotary(head_norm(m, m->k_norm, i, qkv + (m->heads + g) * d, normed), cos, sin,
                   key, d);
            for (int h = g * group; h < (g + 1) * group; h++) {
                rotary(head_norm(m, m->q_norm, i, qkv + h * d, normed), cos, sin, q, d);
                attend(m, m->windows[i], q, keys, values, key, value, position, b->scores,
                       b->attn + ((long)s * m->heads + h) * d);
            }
            memcpy(keys + position * d, key, sizeof(float) * d);
            memcpy(values + position * d, value, sizeof(float) * d);
        }
    }
}

/* x[s][r] += RMSNorm(branch[s])[r] for rows [r0, r1) of n slots, the norm's scale over
 * the whole of each slot's branch (gemma's norms on the sublayers' outputs; `weight` is
 * (1 + its weight)). */
static void add_normed(const Model *m, float *x, const float *branch, const float *weight,
                       int n, int r0, int r1) {
    int hidden = m->hidden;
    for (int s = 0; s < n; s++) {
        const float *row = branch + (long)s * hidden;
        float scale = rms_scale(row, hidden, m->eps);
        for (int r = r0; r < r1; r++) x[(long)s * hidden + r] += weight[r] * (row[r] * scale);
    }
}

/* x += a sublayer's output: the product of w (n columns) with the slots' inputs `in`
 * (row stride ldi), this thread's rows [r0, r1) of it; RMS-normed first where `norm`
 * (gemma: the whole branch written, then read after a barrier), scaled where the model
 * has a residual multiplier (granite), its bias added first where it has one (gpt2). */
static void add_branch_of(const Model *m, const weight_t *w, int n, const float *in,
                          long ldi, const float *norm, const float *bias, const Slots *c,
                          const Buffers *b, int r0, int r1) {
    int hidden = m->hidden;
    if (norm) {
        matmul(w, n, in, ldi, b->branch, hidden, r0, r1, c->n, 0);
#pragma omp barrier
        add_normed(m, b->x, b->branch, norm, c->n, r0, r1);
    } else if (m->residual_multiplier == 1.0f && !bias) {
        matmul(w, n, in, ldi, b->x, hidden, r0, r1, c->n, 1);
    } else {  /* this thread's rows of the branch in its own h, then added */
        matmul(w, n, in, ldi, b->h, hidden, r0, r1, c->n, 0);
        add_branch(b->x, b->h, bias, c->n, hidden, r0, r1, m->residual_multiplier);
    }
}

/* This thread's rows [r0, r1) of the MLP's activations for n slots, in b->mlp (rows of
 * 2 * intermediate): act(gate) * up, or act(up + bias) without a gate (gpt2's). */
static void mlp(const Model *m, int i, int n, const Buffers *b, int r0, int r1) {
    int hidden = m->hidden, inter = m->intermediate;
    if (!m->gate) {
        matmul(m->up[i], hidden, b->h, hidden, b->mlp, 2 * inter, r0, r1, n, 0);
        add_bias(b->mlp, of_layer(m->up_bias, i), n, 2L * inter, r0, r1);
        for (int s = 0; s < n; s++)
            activate(b->mlp + (long)s * 2 * inter + r0, 0, r1 - r0, m->gelu);
        return;
    }
    matmul(m->gate[i], hidden, b->h, hidden, b->mlp, 2 * inter, r0, r1, n, 0);
    matmul(m->up[i], hidden, b->h, hidden, b->mlp + inter, 2 * inter, r0, r1, n, 0);
    for (int s = 0; s < n; s++) {
        float *row = b->mlp + (long)s * 2 * inter;
        activate(row + r0, row + inter + r0, r1 - r0, m->gelu);
    }
}

static void layer(const Model *m, int i, const Slots *c, const Buffers *b, int thread,
                  int threads) {
    int n = c->n, hidden = m->hidden, d = m->head_dim, r0, r1;
    int rows = (m->heads + 2 * m->kv_heads) * d, inter = m->intermediate;
    for (int s = 0; s < n; s++)
        block_norm(b->x + (long)s * hidden, m->input_norm[i], of_layer(m->input_norm_bias, i),
                   b->h + (long)s * hidden, hidden, m->eps);
    share(rows, thread, threads, &r0, &r1);
    matmul(m->qkv[i], hidden, b->h, hidden, b->qkv, rows, r0, r1, n, 0);
    if (m->qkv_bias[i])
        for (int s = 0; s < n; s++)
            for (int r = r0; r < r1; r++) b->qkv[(long)s * rows + r] += m->qkv_bias[i][r];
#pragma omp barrier
    attention(m, i, c, b, thread, threads);
#pragma omp barrier
    share(hidden, thread, threads, &r0, &r1);
    add_branch_of(m, m->o[i], m->heads * d, b->attn, m->heads * d,
                  of_layer(m->attn_out_norm, i), of_layer(m->o_bias, i), c, b, r0, r1);
#pragma omp barrier
    for (int s = 0; s < n; s++)
        block_norm(b->x + (long)s * hidden, m->post_norm[i], of_layer(m->post_norm_bias, i),
                   b->h + (long)s * hidden, hidden, m->eps);
    share(inter, thread, threads, &r0, &r1);
    mlp(m, i, n, b, r0, r1);
#pragma omp barrier
    share(hidden, thread, threads, &r0, &r1);
    add_branch_of(m, m->down[i], inter, b->mlp, 2 * inter, of_layer(m->mlp_out_norm, i),
                  of_layer(m->down_bias, i), c, b, r0, r1);
#pragma omp barrier
}

/* Scratch for n slots over caches of at most `capacity` positions: n * (hidden (x) +
 * threads * hidden (h) + qkv rows + heads * head_dim (attn) + 2 * intermediate (mlp) +
 * hidden (branch)) + threads * capacity (scores) floats. */
long genlab_forward_scratch_floats(const Model *m, long n, long capacity) {
    long rows = (m->heads + 2L * m->kv_heads) * m->head_dim;
    return n * (m->hidden * (2L + m->threads) + rows + (long)m->heads * m->head_dim
                + 2L * m->intermediate) + (long)m->threads * capacity;
}

long genlab_scratch_floats(const Model *m, long capacity) {
    return genlab_forward_scratch_floats(m, 1, capacity);
}

/* Feed n slots (see the header: tokens[s] at positions[s] of the cache keys[s][layer],
 * values[s][layer] of capacities[s] positions), write their keys and values into the
 * caches, and the logits of the `picked` slots picks[0..picked) into logits (`picked`
 * rows of vocab, in that order). The caller checks that tokens index the embeddings,
 * that positions fit their caches, and that a run's positions follow each other. */
void genlab_forward(const Model *m, int n, const long *tokens, const long *positions,
                    float *const *const *keys, float *const *const *values,
                    const long *capacities, int picked, const int *picks, float *scratch,
                    float *logits) {
    int run_start[n + 1], runs = 0;
    for (int s = 0; s < n; s++)
        if (s == 0 || keys[s] != keys[s - 1]) run_start[runs++] = s;
    run_start[runs] = n;
    long capacity = 0;
    for (int s = 0; s < n; s++) capacity = capacities[s] > capacity ? capacities[s] : capacity;
    Slots c = {n, runs, tokens, positions, capacities, keys, values, run_start};
    int hidden = m->hidden, rows = (m->heads + 2 * m->kv_heads) * m->head_dim;
    float *x = scratch, *hs = x + (long)n * hidden;
    float *qkv = hs + (long)m->threads * n * hidden, *attn = qkv + (long)n * rows;
    float *mlp = attn + (long)n * m->heads * m->head_dim;
    float *branch = mlp + 2L * n * m->intermediate, *scores = branch + (long)n * hidden;
    for (int s = 0; s < n; s++) {
        memcpy(x + (long)s * hidden, m->embed + tokens[s] * hidden, sizeof(float) * hidden);
        if (m->embedding_multiplier != 1.0f)
            for (int j = 0; j < hidden; j++) x[(long)s * hidden + j] *= m->embedding_multiplier;
        if (m->position_embed)
            for (int j = 0; j < hidden; j++)
                x[(long)s * hidden + j] += m->position_embed[positions[s] * hidden + j];
    }
#pragma omp parallel num_threads(m->threads)
    {
        int thread = 0, threads = 1, r0, r1;  /* the region may get fewer than asked */
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        Buffers b = {x, hs + (long)thread * n * hidden, qkv, attn, mlp, branch,
                     scores + (long)thread * capacity};
        for (int i = 0; i < m->layers; i++) layer(m, i, &c, &b, thread, threads);
        for (int j = 0; j < picked; j++)
            block_norm(x + (long)picks[j] * hidden, m->norm, m->norm_bias,
                       b.h + (long)j * hidden, hidden, m->eps);
        share(m->vocab, thread, threads, &r0, &r1);
        if (m->head_matmul)
            m->head_matmul(m->lm_head, hidden, b.h, hidden, logits, m->vocab, r0, r1, picked, 0);
        else
            matmul(m->lm_head, hidden, b.h, hidden, logits, m->vocab, r0, r1, picked, 0);
        if (m->logits_scaling != 1.0f)
            for (int j = 0; j < picked; j++)
                for (int r = r0; r < r1; r++) logits[(long)j * m->vocab + r] /= m->logits_scaling;
        if (m->final_softcap)
            for (int j = 0; j < picked; j++)
                soft_cap(logits + (long)j * m->vocab + r0, r1 - r0, m->final_softcap);
    }
}

/* One slot: feed `token` at `position` (the cached positions before it: 0..position-1),
 * write its key and value into the caches (per layer: keys[i], values[i]) and its
 * logits (vocab). */
void genlab_step(const Model *m, long token, long position, float *const *keys,
                 float *const *values, long capacity, float *scratch, float *logits) {
    float *const *k[1] = {keys}, *const *v[1] = {values};
    int pick = 0;
    genlab_forward(m, 1, &token, &position, k, v, &capacity, 1, &pick, scratch, logits);
}

/* The argmax of logits[0..vocab) once the `n_banned` ids of `banned` are set to -inf,
 * as torch's max takes it: the first of equal maxima; -1 where none exceeds -inf or any
 * is NaN (torch's max is NaN then), which ends a draft as the drafter's loop ends it. */
static long argmax_allowed(float *logits, int vocab, int n_banned, const long *banned) {
    for (int j = 0; j < n_banned; j++) logits[banned[j]] = -INFINITY;
    long best = -1;
    float top = -INFINITY;
    for (int t = 0; t < vocab; t++)
        if (!(logits[t] <= top)) {  /* greater, or NaN: one test for both in the loop */
            if (logits[t] != logits[t]) return -1;
            top = logits[t];
            best = t;
        }
    return best;
}

/* A greedy draft of one row in one call: feed its n tokens at positions position.. of
 * the cache (keys[i], values[i] of `capacity` positions), then up to `gamma` times take
 * the argmax of the last logits (`argmax_allowed`, the `n_banned` ids of `banned` banned
 * at the first `banned_draws` draws) and feed it, all but the last draw. A draw with no
 * candidate ends the draft. Each forward is `genlab_forward`'s, so a draw is the argmax
 * of the logits a one-token call gives. Writes the draws into `drawn` and the number of
 * forwards run into *forwards; returns the number of draws. The caller checks that the
 * tokens and banned ids index the embeddings and logits, that every id a draw can give
 * has an embedding, and that n + gamma - 1 slots fit the cache. Scratch:
 * genlab_forward_scratch_floats(m, n, capacity); logits: vocab floats (overwritten). */
int genlab_draft_greedy(const Model *m, int n, const long *tokens, long position,
                        float *const *keys, float *const *values, long capacity, int gamma,
                        int n_banned, const long *banned, int banned_draws, float *scratch,
                        float *logits, long *drawn, int *forwards) {
    if (n < 1 || gamma < 1) {  /* the caller refuses these; nothing to feed or draw */
        *forwards = 0;
        return 0;
    }
    long positions[n], capacities[n];
    float *const *k[n], *const *v[n];
    for (int s = 0; s < n; s++) {
        positions[s] = position + s;
        capacities[s] = capacity;
        k[s] = keys;
        v[s] = values;
    }
    int pick = n - 1, draws = 0;
    genlab_forward(m, n, tokens, positions, k, v, capacities, 1, &pick, scratch, logits);
    *forwards = 1;
    for (long next = position + n; draws < gamma; next++) {
        long token = argmax_allowed(logits, m->vocab, draws < banned_draws ? n_banned : 0,
                                    banned);
        if (token < 0) break;
        drawn[draws++] = token;
        if (draws == gamma) break;
        pick = 0;
        genlab_forward(m, 1, &token, &next, k, v, capacities, 1, &pick, scratch, logits);
        (*forwards)++;
    }
    return draws;
}

/* NF4 codes (rows, cols), one a byte, and scales (rows, blocks of 64) of a float32
 * matrix (rows, cols): genlib/backends/quant.py's `_nf4`, whose numbers these are, at
 * the speed of a load. For each of n_shares candidate scales (absmax times a share, in
 * float32) each weight takes the nearest of the 16 levels (its code: how many of the 15
 * middles between levels lie below w / scale), and the scale that fits those codes
 * best is sum(w * level) / sum(level^2), summed in double; the block keeps the
 * candidate of largest sum(w * level)^2 / sum(level^2) (least squared error), the first
 * on a tie. A product of two floats is exact in double, and `_nf4` sums in this
 * order too, so the two give the same bits. Rows split across `threads` threads. */
void genlab_nf4_quantize(const float *w, long rows, long cols, const float *levels,
                         const float *middles, const float *shares, int n_shares,
                         unsigned char *codes, float *scales, int threads) {
    long blocks = (cols + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        for (long b = 0; b < blocks; b++) {
            const float *x = w + r * cols + b * 64;
            int n = cols - b * 64 < 64 ? (int)(cols - b * 64) : 64;
            float absmax = 0.0f, y[64];
            unsigned char code[64], best[64];
            double best_gain = 0.0;
            float best_scale = 0.0f;
            for (int i = 0; i < n; i++) absmax = fmaxf(absmax, fabsf(x[i]));
            for (int s = 0; s < n_shares; s++) {
                float scale = absmax * shares[s];
                float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
                for (int i = 0; i < n; i++) {
                    y[i] = x[i] * inverse;
                    code[i] = 0;
                }
                for (int j = 0; j < 15; j++)
                    for (int i = 0; i < n; i++) code[i] += y[i] > middles[j];
                double fit = 0.0, size = 0.0;
                for (int i = 0; i < n; i++) {
                    double level = levels[code[i]];
                    fit += (double)x[i] * level;
                    size += level * level;
                }
                double fitted = size > 0.0 ? fit / size : 0.0, gain = fit * fitted;
                if (s == 0 || gain > best_gain) {
                    best_gain = gain;
                    best_scale = (float)fitted;
                    memcpy(best, code, (size_t)n);
                }
            }
            memcpy(codes + r * cols + b * 64, best, (size_t)n);
            scales[r * blocks + b] = best_scale;
        }
    }
}
