/* A decoder layer's elementwise chains on CPU, each one call: the CPU counterparts of triton_fused.py.
 *
 * Unfused, torch runs RMSNorm as some ten operators (cast, square, mean, rsqrt, ...), the q/k norm, rotary
 * embedding and KV write as twenty more per layer, each dispatched from Python at a few microseconds however
 * little it computes. At a decode step of one sequence those dispatches cost more than the arithmetic. Built
 * once per machine by cpu_kernels.py and called through ctypes from cpu_fused.py; float32 only.
 *
 * Every row (a token, or a token's head) is computed by the same loop in the same order whatever the batch
 * around it, so a token's result does not depend on the other tokens of the forward. Sums of squares run in
 * LANES partial sums added in a fixed tree: the results differ from torch's ops only in that order.
 */
#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ROWS 64 /* fewer rows than this run on the calling thread: a parallel region costs more */

/* x . x over n floats: LANES partial sums (a ragged tail into the first lanes), added in a fixed tree. */
static inline float sum_of_squares(const float *x, int64_t n) {
    vec part = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) part += *(const vec *)(x + i) * *(const vec *)(x + i);
    float lane[LANES];
    memcpy(lane, &part, sizeof lane);
    for (int j = 0; i < n; i++, j++) lane[j] += x[i] * x[i];
    return lanes_total(lane);
}

/* Hugging Face's order: x / rms(x) first, then the weight. */
static inline float inverse_rms(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(sum_of_squares(x, n) / (float)n + eps);
}

/* out = RMSNorm(x + residual) and stream = x + residual per row; residual NULL: out = RMSNorm(x), stream unused. */
void add_rms_norm_f32(const float *x, int64_t stride_x, const float *residual, int64_t stride_r,
                      const float *weight, float *out, float *stream, int64_t rows, int64_t hidden, float eps,
                      int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t row = 0; row < rows; row++) {
        const float *src = x + row * stride_x;
        if (residual) {
            float *sum = stream + row * hidden;
            const float *r = residual + row * stride_r;
            for (int64_t j = 0; j < hidden; j++) sum[j] = src[j] + r[j];
            src = sum;
        }
        float inv = inverse_rms(src, hidden, eps);
        float *dst = out + row * hidden;
        for (int64_t j = 0; j < hidden; j++) dst[j] = weight[j] * (src[j] * inv);
    }
}

/* One q or k head of one token: normed (q_norm / k_norm weight, where the model has one), then rotated by the
 * token's cos and signed sin (x * cos + x.roll(dim / 2) * signed_sin), written to dst. */
static void rope_head(const float *src, const float *norm_weight, float eps, const float *cos,
                      const float *signed_sin, float *dst, int dim) {
    float normed[dim];
    if (norm_weight) {
        float inv = inverse_rms(src, dim, eps);
        for (int j = 0; j < dim; j++) normed[j] = norm_weight[j] * (src[j] * inv);
        src = normed;
    }
    int half = dim / 2;
    for (int j = 0; j < dim; j++) dst[j] = src[j] * cos[j] + src[(j + half) % dim] * signed_sin[j];
}

/* From a QKV projection's rows [tokens, (heads + 2 kv_heads) * dim]: q normed and rotated into q_out
 * [tokens, heads, dim]; k normed, rotated and v copied into the caches [kv_heads, blocks * block_size, dim]
 * (head stride `stride_cache_head`) at each token's flat index. */
void rope_write_kv_f32(const float *qkv, int64_t stride_qkv, const float *cos, const float *signed_sin,
                       int64_t stride_rope, const int64_t *token_index, float *q_out, float *k_cache,
                       float *v_cache, int64_t stride_cache_head, const float *q_norm, const float *k_norm,
                       float eps, int64_t tokens, int heads, int kv_heads, int dim, int threads) {
#pragma omp parallel for num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * stride_qkv;
        const float *c = cos + t * stride_rope, *s = signed_sin + t * stride_rope;
        int64_t slot = token_index[t] * dim;
        for (int h = 0; h < heads; h++)
            rope_head(row + (int64_t)h * dim, q_norm, eps, c, s, q_out + (t * heads + h) * dim, dim);
        for (int h = 0; h < kv_heads; h++) {
            const float *k = row + (int64_t)(heads + h) * dim, *v = row + (int64_t)(heads + kv_heads + h) * dim;
            rope_head(k, k_norm, eps, c, s, k_cache + h * stride_cache_head + slot, dim);
            memcpy(v_cache + h * stride_cache_head + slot, v, dim * sizeof(float));
        }
    }
}
