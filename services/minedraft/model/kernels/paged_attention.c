/* Paged attention on CPU: each sequence's keys and values read in place through its block table.
 *
 * The CPU path's kernel for short queries (decode steps, k + 1 verification tokens, draft steps); built
 * once per machine by cpu_attention.py and called through ctypes. Semantics as everywhere in the
 * engine: query i of a sequence sits at position start + i and sees keys 0 .. start + i; query head h
 * reads kv head h / (heads / kv_heads).
 *
 * One work item per (sequence, kv head): its rows are the (query, head) pairs of the heads that share the
 * kv head, so each cache block is read once per item, keys then values while they are in cache. Softmax is
 * online, one cache block at a time. Every row is computed by the same loop whatever the batch around it,
 * in the same order, so a token's output does not depend on the other sequences or on how many queries
 * its own sequence brought.
 */
#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TRANSPOSE_ROWS 4

/* a . b over n floats (n a multiple of LANES): LANES partial sums, added in a fixed tree. */
static inline float dot(const float *a, const float *b, int n) {
    vec part = *(const vec *)a * *(const vec *)b;
    for (int i = LANES; i < n; i += LANES) part += *(const vec *)(a + i) * *(const vec *)(b + i);
    return vec_total(part);
}

/* kt[d][t] = keys[t][d] for the n keys of a chunk (n <= LANES), zeros past them: LANES keys become one vector. */
static inline void transpose_keys(float *kt, const float *keys, int64_t stride, int n, int dim) {
    if (n < LANES) memset(kt, 0, sizeof(float) * LANES * dim);
    for (int t = 0; t < n; t++)
        for (int d = 0; d < dim; d++) kt[d * LANES + t] = keys[t * stride + d];
}

/* scores[t] = scale * q . key t for a chunk's LANES keys (kt from transpose_keys): four sums over the dims
 * (d mod 4), added in a fixed order. dim is a multiple of LANES. */
static inline void chunk_scores(float *scores, const float *q, const float *kt, int dim, float scale) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int d = 0; d < dim; d += 4) {
        a0 += q[d] * *(const vec *)(kt + d * LANES);
        a1 += q[d + 1] * *(const vec *)(kt + (d + 1) * LANES);
        a2 += q[d + 2] * *(const vec *)(kt + (d + 2) * LANES);
        a3 += q[d + 3] * *(const vec *)(kt + (d + 3) * LANES);
    }
    vec sum = ((a0 + a1) + (a2 + a3)) * scale;
    memcpy(scores, &sum, sizeof sum);
}

/* acc += sum over t < keys of p[t] * v[t * stride ...], n floats (a multiple of LANES): per chunk of LANES
 * floats, two sums held in registers over the keys (even and odd keys), added at the end. */
static inline void add_weighted(float *acc, const float *p, const float *v, int64_t stride, int keys, int n) {
    for (int i = 0; i < n; i += LANES) {
        vec even = *(vec *)(acc + i), odd = {0};
        int t = 0;
        for (; t + 1 < keys; t += 2) {
            even += p[t] * *(const vec *)(v + t * stride + i);
            odd += p[t + 1] * *(const vec *)(v + (t + 1) * stride + i);
        }
        if (t < keys) even += p[t] * *(const vec *)(v + t * stride + i);
        *(vec *)(acc + i) = even + odd;
    }
}

/* x[i] = exp(x[i]) for x[i] <= 0, in a form the compiler vectorizes: x = k ln 2 + r with |r| <= ln 2 / 2,
 * exp(r) by its Taylor series to r^6 (relative error below 2e-7), times 2^k built in the exponent bits.
 * Inputs below -87 give exp(-87) ~ 1.6e-38 instead of less: a weight no sum of float32 can see. */
static inline void exp_nonpositive(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = __builtin_rintf(v * 1.44269504f);
        float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
        float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
                                                                                   r * (1.0f / 720))))));
        int32_t bits = ((int32_t)k + 127) << 23;
        float two_k;
        memcpy(&two_k, &bits, sizeof two_k);
        x[i] = p * two_k;
    }
}

/* The largest and the sum of a full chunk's LANES scores, in a fixed tree (the compiler makes it vector ops). */
static inline float lanes_max(const float *s) {
    float lane[LANES];
    memcpy(lane, s, sizeof lane);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lane[j] = lane[j] > lane[j + width] ? lane[j] : lane[j + width];
    return lane[0];
}

static inline float lanes_sum(const float *s) {
    float lane[LANES];
    memcpy(lane, s, sizeof lane);
    return lanes_total(lane);
}

/* Fold a row's scores of `seen` keys (s, overwritten with their weights) and those keys' values into its
 * running max, sum and weighted sum of values. */
static inline void absorb(float *s, int seen, const float *v, int64_t kv_stride_t, float *acc, float *best,
                          float *total, int dim) {
    float top = *best;
    if (seen == LANES) {
        float chunk = lanes_max(s);
        top = chunk > top ? chunk : top;
    } else {
        for (int t = 0; t < seen; t++)
            if (s[t] > top) top = s[t];
    }
    if (top > *best) { /* earlier keys' weights were taken against a smaller max */
        float rescale = expf(*best - top); /* 0 on the first keys (best is -inf) */
        *total *= rescale;
        for (int d = 0; d < dim; d++) acc[d] *= rescale;
    }
    for (int t = 0; t < seen; t++) s[t] -= top;
    exp_nonpositive(s, seen);
    if (seen == LANES) {
        *total += lanes_sum(s);
    } else {
        for (int t = 0; t < seen; t++) *total += s[t];
    }
    add_weighted(acc, s, v, kv_stride_t, seen, dim);
    *best = top;
}

static void attend_item(const float *q, int64_t q_stride_t, int64_t q_stride_h, const float *k, const float *v,
                        int64_t kv_stride_b, int64_t kv_stride_t, float *out, int64_t out_stride_t,
                        int64_t out_stride_h, const int32_t *table, int start, int offset, int length,
                        int kv_head, int group, int dim, int block_size, float scale, float *work) {
    int rows = length * group;
    /* Scores key by key (a dot product each) for a row or two; for more rows, LANES keys at once against
     * the chunk's keys transposed, which pays for the transpose from four rows on. The choice depends on
     * the sequence alone, never on the batch. */
    int transposed = rows >= TRANSPOSE_ROWS;
    float *acc = work;                  /* [rows][dim] */
    float *best = acc + rows * dim;     /* [rows] running max */
    float *total = best + rows;         /* [rows] running sum */
    float *kt = total + rows;           /* [dim][LANES] the chunk's keys, transposed */
    float s[LANES];
    for (int r = 0; r < rows; r++) best[r] = -INFINITY, total[r] = 0.0f;
    memset(acc, 0, sizeof(float) * rows * dim);
    int keys = start + length, n;
    for (int first = 0; first < keys; first += n) { /* up to LANES keys at a time, within one cache block */
        int64_t base = (int64_t)table[first / block_size] * kv_stride_b + (int64_t)(first % block_size) * kv_stride_t;
        n = keys - first < LANES ? keys - first : LANES;
        if (n > block_size - first % block_size) n = block_size - first % block_size;
        if (transposed) transpose_keys(kt, k + base, kv_stride_t, n, dim);
        for (int r = 0; r < rows; r++) {
            int query = r / group, head = kv_head * group + r % group;
            int seen = start + query + 1 - first; /* keys of this chunk the row sees */
            if (seen <= 0) continue;
            if (seen > n) seen = n;
            const float *qr = q + (int64_t)(offset + query) * q_stride_t + (int64_t)head * q_stride_h;
            if (transposed)
                chunk_scores(s, qr, kt, dim, scale);
            else
                for (int t = 0; t < seen; t++) s[t] = dot(qr, k + base + t * kv_stride_t, dim) * scale;
            absorb(s, seen, v + base, kv_stride_t, acc + r * dim, best + r, total + r, dim);
        }
    }
    for (int r = 0; r < rows; r++) {
        int query = r / group, head = kv_head * group + r % group;
        float *o = out + (int64_t)(offset + query) * out_stride_t + (int64_t)head * out_stride_h;
        float inv = 1.0f / total[r];
        for (int d = 0; d < dim; d++) o[d] = acc[r * dim + d] * inv;
    }
}

/* q: [tokens, heads, dim] (strided by token and head, dims contiguous); k, v: [kv_heads, blocks, block_size,
 * dim] with (block_size, dim) contiguous; out as q. Sequence s's rows are offsets[s] .. offsets[s] +
 * lengths[s] - 1 of q and out; tables: [seqs, table_width]. Returns 0, or -1 when scratch memory ran out. */
int paged_attention_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h, const float *k, const float *v,
                        int64_t kv_stride_h, int64_t kv_stride_b, int64_t kv_stride_t, float *out,
                        int64_t out_stride_t, int64_t out_stride_h, const int32_t *tables, int64_t table_width,
                        const int32_t *starts, const int32_t *offsets, const int32_t *lengths, int seqs,
                        int heads, int kv_heads, int dim, int block_size, float scale, int threads) {
    int group = heads / kv_heads, max_length = 0, failed = 0;
    for (int s = 0; s < seqs; s++)
        if (lengths[s] > max_length) max_length = lengths[s];
    int64_t rows = (int64_t)max_length * group;
    size_t scratch = sizeof(float) * (size_t)(rows * dim + 2 * rows + LANES * dim);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = malloc(scratch);
        if (!work) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < seqs * kv_heads; item++) {
            int s = item / kv_heads, h = item % kv_heads;
            if (work && lengths[s] > 0)
                attend_item(q, q_stride_t, q_stride_h, k + h * kv_stride_h, v + h * kv_stride_h, kv_stride_b,
                            kv_stride_t, out, out_stride_t, out_stride_h, tables + s * table_width, starts[s],
                            offsets[s], lengths[s], h, group, dim, block_size, scale, work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}
