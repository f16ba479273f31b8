/* One decode step of a Llama-architecture model in float32 on the CPU, batch 1: the
 * arithmetic of genlib.backends.llama.LeanLlama._static_step in one OpenMP parallel region.
 *
 * A one-token step reads every weight once and does two multiply-adds per weight, so
 * it is bound by memory bandwidth, and what keeps it from that bound is everything
 * between the weight reads: a torch.compile'd step runs each of its ~100 kernels as a
 * parallel region of its own, with a barrier after each. Here the threads stay in one
 * region for the whole step and meet five times a layer, where a result one thread
 * computed is read by another:
 *
 *   qkv   rows of the q/k/v product split across threads        | barrier
 *   attn  heads split: rotary, KV cache write, softmax(q.k) . v  | barrier
 *   o     rows split, added to the residual                      | barrier
 *   mlp   rows of gate and up split, silu(gate) * up             | barrier
 *   down  rows split, added to the residual                      | barrier
 *
 * and the norms are computed by every thread for itself (a few hundred numbers). The
 * products read four weight rows at a time into vector accumulators, and softmax and
 * SiLU take a vectorized exp: AVX-512 intrinsics where -march=native gives AVX-512, GCC's
 * vector extensions and libm's expf elsewhere (AVX2, NEON, ...).
 *
 * Weights are row-major (out, in), as nn.Linear holds them; the q/k/v and gate/up
 * matrices are stacked ([q; k; v], [gate; up]). KV buffers are (kv_heads, capacity,
 * head_dim) per layer, as genlib.backends.llama.LeanCache holds them. Sums run in another order
 * than PyTorch's, so logits differ in the last bits (the tests bound the difference and
 * check the tokens).
 */
#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float vec __attribute__((vector_size(64)));
typedef float vec_u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads */
#define LANES 16

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, vocab, layers, threads;
    float eps, scale;
    const float *embed, *norm, *lm_head, *cos, *sin;  /* tables: (positions, head_dim) */
    /* per layer */
    const float *const *input_norm, *const *qkv, *const *qkv_bias, *const *o;
    const float *const *post_norm, *const *gate_up, *const *down;
} Model;

#ifdef __AVX512F__
#include <immintrin.h>
static float hsum(vec v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
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

/* gate[j] = silu(gate[j]) * up[j] = gate / (1 + e^-gate) * up, for j < n. */
static void silu_times(float *gate, const float *up, int n) {
    for (int j = 0; j < n; j += LANES) {
        __mmask16 lanes = n - j >= LANES ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(lanes, gate + j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(gate + j, lanes,
                              _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(lanes, up + j)));
    }
}
#else
static float exp_shifted(float *s, long n, float top) {
    float total = 0.0f;
    for (long j = 0; j < n; j++) total += s[j] = expf(s[j] - top);
    return total;
}

static void silu_times(float *gate, const float *up, int n) {
    for (int j = 0; j < n; j++) gate[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}
#endif

static float dot(const float *w, const float *x, int n) {
    vec acc = {0};
    int k = 0;
    for (; k + LANES <= n; k += LANES) acc += *(const vec_u *)(w + k) * *(const vec_u *)(x + k);
    float s = hsum(acc);
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}

#ifdef __AVX512F__
/* out[r] = dot(w[r], x) (+ out[r] when accumulate) for rows [r0, r1) of w (rows, n):
 * four rows at a time, 16 lanes, the last n % 16 columns through a masked load. */
static void matvec(const float *w, const float *x, float *out, int n, int r0, int r1,
                   int accumulate) {
    int full = n / LANES * LANES;
    __mmask16 tail = (__mmask16)((1u << (n - full)) - 1);
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const float *w0 = w + (long)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = 0; k < full; k += LANES) {
            __m512 xv = _mm512_loadu_ps(x + k);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
        }
        if (tail) {
            __m512 xv = _mm512_maskz_loadu_ps(tail, x + full);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + full), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w1 + full), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w2 + full), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w3 + full), xv, a3);
        }
        float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
        float s2 = _mm512_reduce_add_ps(a2), s3 = _mm512_reduce_add_ps(a3);
        if (accumulate) { out[r] += s0; out[r + 1] += s1; out[r + 2] += s2; out[r + 3] += s3; }
        else { out[r] = s0; out[r + 1] = s1; out[r + 2] = s2; out[r + 3] = s3; }
    }
    for (; r < r1; r++) {
        float s = dot(w + (long)r * n, x, n);
        out[r] = accumulate ? out[r] + s : s;
    }
}
#else
/* Elsewhere: the same with GCC's vector extensions (AVX2, NEON, ...). */
static void matvec(const float *w, const float *x, float *out, int n, int r0, int r1,
                   int accumulate) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const float *w0 = w + (long)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int k = 0;
        for (; k + LANES <= n; k += LANES) {
            vec xv = *(const vec_u *)(x + k);
            a0 += *(const vec_u *)(w0 + k) * xv;
            a1 += *(const vec_u *)(w1 + k) * xv;
            a2 += *(const vec_u *)(w2 + k) * xv;
            a3 += *(const vec_u *)(w3 + k) * xv;
        }
        float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
        for (; k < n; k++) {
            s0 += w0[k] * x[k]; s1 += w1[k] * x[k]; s2 += w2[k] * x[k]; s3 += w3[k] * x[k];
        }
        if (accumulate) { out[r] += s0; out[r + 1] += s1; out[r + 2] += s2; out[r + 3] += s3; }
        else { out[r] = s0; out[r + 1] = s1; out[r + 2] = s2; out[r + 3] = s3; }
    }
    for (; r < r1; r++) {
        float s = dot(w + (long)r * n, x, n);
        out[r] = accumulate ? out[r] + s : s;
    }
}

#endif

/* This thread's share [*r0, *r1) of `rows`, in runs of four rows. */
static void share(int rows, int thread, int threads, int *r0, int *r1) {
    int chunk = ((rows + threads - 1) / threads + 3) / 4 * 4;
    *r0 = thread * chunk < rows ? thread * chunk : rows;
    *r1 = *r0 + chunk < rows ? *r0 + chunk : rows;
}

static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    float squares = 0.0f;
    for (int i = 0; i < n; i++) squares += x[i] * x[i];
    float scale = 1.0f / sqrtf(squares / n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

/* x * cos + roll(x, half) * sin, the sine table carrying rotate_half's sign. */
static void rotary(const float *x, const float *cos, const float *sin, float *out, int d) {
    int half = d / 2;
    for (int i = 0; i < d; i++) out[i] = x[i] * cos[i] + x[(i + half) % d] * sin[i];
}

static void add_scaled(float *restrict out, const float *restrict row, float p, int d) {
    for (int i = 0; i < d; i++) out[i] += p * row[i];
}

/* Query head `head` over the cached positions [0, position) and the new key/value. */
static void attend(const Model *m, int head, const float *q, const float *keys,
                   const float *values, const float *key, const float *value, long position,
                   long capacity, float *scores, float *out) {
    int d = m->head_dim;
    const float *k = keys + (long)head * capacity * d, *v = values + (long)head * capacity * d;
    matvec(k, q, scores, d, 0, (int)position, 0);  /* the cached keys are a matrix's rows */
    scores[position] = dot(q, key, d);
    float top = -INFINITY;
    for (long j = 0; j <= position; j++) {
        scores[j] *= m->scale;
        top = scores[j] > top ? scores[j] : top;
    }
    float total = exp_shifted(scores, position + 1, top);
    memset(out, 0, sizeof(float) * d);
    for (long j = 0; j < position; j++) add_scaled(out, v + j * d, scores[j] / total, d);
    add_scaled(out, value, scores[position] / total, d);
}

static void attention(const Model *m, const float *cos, const float *sin, float *qkv,
                      float *key_cache, float *value_cache, long position, long capacity,
                      float *scores, float *out, int thread, int threads) {
    int d = m->head_dim, group = m->heads / m->kv_heads, h0, h1;
    const float *keys = qkv + m->heads * d, *values = keys + m->kv_heads * d;
    float q[d], key[d];
    share(m->kv_heads, thread, threads, &h0, &h1);
    for (int g = h0; g < h1; g++) {  /* writes and reads of a kv head stay in one thread */
        rotary(keys + g * d, cos, sin, key, d);
        for (int h = g * group; h < (g + 1) * group; h++) {
            rotary(qkv + h * d, cos, sin, q, d);
            attend(m, g, q, key_cache, value_cache, key, values + g * d, position, capacity,
                   scores + (long)h * capacity, out + h * d);
        }
        memcpy(key_cache + ((long)g * capacity + position) * d, key, sizeof(float) * d);
        memcpy(value_cache + ((long)g * capacity + position) * d, values + g * d,
               sizeof(float) * d);
    }
}

static void layer(const Model *m, int i, float *x, float *h, float *qkv, float *attn,
                  float *mlp, float *scores, float *keys, float *values, long position,
                  long capacity, int thread, int threads) {
    int d = m->head_dim, rows = (m->heads + 2 * m->kv_heads) * d, r0, r1;
    rms_norm(x, m->input_norm[i], h, m->hidden, m->eps);
    share(rows, thread, threads, &r0, &r1);
    matvec(m->qkv[i], h, qkv, m->hidden, r0, r1, 0);
    if (m->qkv_bias[i]) for (int r = r0; r < r1; r++) qkv[r] += m->qkv_bias[i][r];
#pragma omp barrier
    attention(m, m->cos + position * d, m->sin + position * d, qkv, keys, values, position,
              capacity, scores, attn, thread, threads);
#pragma omp barrier
    share(m->hidden, thread, threads, &r0, &r1);
    matvec(m->o[i], attn, x, m->heads * d, r0, r1, 1);
#pragma omp barrier
    rms_norm(x, m->post_norm[i], h, m->hidden, m->eps);
    share(m->intermediate, thread, threads, &r0, &r1);
    const float *gate_up = m->gate_up[i];
    matvec(gate_up, h, mlp, m->hidden, r0, r1, 0);
    matvec(gate_up + (long)m->intermediate * m->hidden, h, mlp + m->intermediate, m->hidden,
           r0, r1, 0);
    silu_times(mlp + r0, mlp + m->intermediate + r0, r1 - r0);
#pragma omp barrier
    share(m->hidden, thread, threads, &r0, &r1);
    matvec(m->down[i], mlp, x, m->intermediate, r0, r1, 1);
#pragma omp barrier
}

/* Scratch: hidden (x) + threads * hidden (h) + qkv rows + heads * head_dim (attn)
 * + 2 * intermediate (mlp) + heads * capacity (scores) floats: genlab_scratch_floats. */
long genlab_scratch_floats(const Model *m, long capacity) {
    return m->hidden * (1L + m->threads) + (m->heads + 2L * m->kv_heads) * m->head_dim
           + (long)m->heads * m->head_dim + 2L * m->intermediate + m->heads * capacity;
}

/* Feed `token` at `position` (the cached positions before it: 0..position-1), write its
 * key and value into the caches (per layer: keys[i], values[i]) and its logits (vocab). */
void genlab_step(const Model *m, long token, long position, float *const *keys,
                 float *const *values, long capacity, float *scratch, float *logits) {
    float *x = scratch, *hs = x + m->hidden;
    float *qkv = hs + (long)m->threads * m->hidden;
    float *attn = qkv + (m->heads + 2 * m->kv_heads) * m->head_dim;
    float *mlp = attn + m->heads * m->head_dim, *scores = mlp + 2 * m->intermediate;
    memcpy(x, m->embed + token * m->hidden, sizeof(float) * m->hidden);
#pragma omp parallel num_threads(m->threads)
    {
        int thread = 0, threads = 1, r0, r1;  /* the region may get fewer than asked */
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        float *h = hs + (long)thread * m->hidden;
        for (int i = 0; i < m->layers; i++)
            layer(m, i, x, h, qkv, attn, mlp, scores, keys[i], values[i], position,
                  capacity, thread, threads);
        rms_norm(x, m->norm, h, m->hidden, m->eps);
        share(m->vocab, thread, threads, &r0, &r1);
        matvec(m->lm_head, h, logits, m->hidden, r0, r1, 0);
    }
}
