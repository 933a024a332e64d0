/* A decoder's whole layer stack for a step of short queries on CPU, in one call (decode, verification, drafting).
 *
 * A draft step of one sequence runs two layers of 128 features: some thirty thousand multiply-adds per layer,
 * which one core does in microseconds, while the layers' forty-odd torch operators (the GEMMs among them),
 * each dispatched from Python, took a millisecond; the bundled target's step likewise cost its dispatch more
 * than reading its weights. Here every layer runs as loops over the weights held transposed and packed by tiles
 * of 64 outputs (gemm): RMSNorm, the QKV projection, the q/k norm, rotary embedding and KV write and the
 * paged attention (the kernels of model/fused_layers.c and model/paged_attention.c, included below), the
 * output projection added to the residual stream, RMSNorm, gate and up, SiLU(gate) x up, down added to the
 * stream; then the final norm and the LM head for the rows that need logits. Built once per machine by
 * model/cpu_kernels.py, called through ctypes by model/cpu_stack.py; float32 only.
 *
 * A row's result depends on that row alone: every output is one sum over the input features in order, the
 * same loop whatever the rows around it and however the outputs are split between threads.
 */
#include "fused_layers.c"
#include "paged_attention.c"

#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 8        /* rows that share each loaded weight vector (a verification window of k = 4 is 5) */
#define COL_VECS 4         /* output vectors (of LANES) a tile covers */
#define TILE (COL_VECS * LANES) /* a tile's outputs: 64, as model/cpu_stack.py packs the weights */
#define PARALLEL_MACS (1 << 16) /* a GEMM with fewer multiply-adds runs on the calling thread */

/* y[r][o0 .. o0 + cols * LANES) (+)= x[r] . w[i][c0 ..] for `rows` rows, w one tile's weights ([in][TILE]) and
 * c0 the block's first column in it; rows x cols accumulators stay in registers (AVX-512 has 32: up to 6 rows
 * of 4 vectors, 8 of 2). */
static inline __attribute__((always_inline)) void gemm_block(const float *x, int64_t in, const float *wtile,
                                                             int64_t c0, float *y, int64_t stride_y, int rows,
                                                             int cols, int accumulate) {
    vec acc[ROW_BLOCK][COL_VECS] = {{{0}}};
    for (int64_t i = 0; i < in; i++) {
        const float *w = wtile + i * TILE + c0;
        vec wv[COL_VECS];
        for (int c = 0; c < cols; c++) wv[c] = *(const vec *)(w + c * LANES);
        for (int r = 0; r < rows; r++) {
            float xi = x[r * in + i];
            for (int c = 0; c < cols; c++) acc[r][c] += xi * wv[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            vec *dst = (vec *)(y + r * stride_y + c0 + c * LANES);
            *dst = accumulate ? *dst + acc[r][c] : acc[r][c];
        }
}

/* One tile (TILE outputs; y its first output of row 0) for `rows` <= ROW_BLOCK rows: every weight vector is
 * loaded once for all of them. Past 6 rows the tile runs as two halves, which sum each output as one pass would. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t in, const float *wtile,
                                                            float *y, int64_t stride_y, int rows, int accumulate) {
    if (rows <= 6) {
        gemm_block(x, in, wtile, 0, y, stride_y, rows, COL_VECS, accumulate);
        return;
    }
    for (int half = 0; half < 2; half++)
        gemm_block(x, in, wtile, half * (TILE / 2), y, stride_y, rows, COL_VECS / 2, accumulate);
}

/* The `width` outputs past the last full tile (weights [in][width]), one at a time (same order of sums). */
static void gemm_tail(const float *x, int64_t in, const float *wtail, int64_t width, float *y, int64_t stride_y,
                      int rows, int accumulate) {
    for (int r = 0; r < rows; r++)
        for (int64_t o = 0; o < width; o++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < in; i++) sum += x[r * in + i] * wtail[i * width + o];
            y[r * stride_y + o] = accumulate ? y[r * stride_y + o] + sum : sum;
        }
}

/* y (+)= x @ W (+ bias): x [rows, in] contiguous, y rows `stride_y` apart; wt: W [in, out] packed by tiles of
 * TILE columns, each [in][TILE] contiguous, then the last out % TILE columns as [in][out % TILE] (model/cpu_stack.py
 * packs them): a tile's weights stream from memory in order. */
static void gemm(const float *x, int64_t rows, int64_t in, const float *wt, const float *bias, int64_t out,
                 float *y, int64_t stride_y, int accumulate, int threads) {
    const int64_t tiles = out / TILE;
    int parallel = threads > 1 && rows * in * out >= PARALLEL_MACS;
#pragma omp parallel for num_threads(threads) if (parallel) collapse(2)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            const float *xr = x + r0 * in, *wtile = wt + t * in * TILE;
            float *yr = y + r0 * stride_y + t * TILE;
            switch (rows - r0 >= ROW_BLOCK ? ROW_BLOCK : rows - r0) { /* constant row counts: registers */
            case 8: gemm_tile(xr, in, wtile, yr, stride_y, 8, accumulate); break;
            case 7: gemm_tile(xr, in, wtile, yr, stride_y, 7, accumulate); break;
            case 6: gemm_tile(xr, in, wtile, yr, stride_y, 6, accumulate); break;
            case 5: gemm_tile(xr, in, wtile, yr, stride_y, 5, accumulate); break;
            case 4: gemm_tile(xr, in, wtile, yr, stride_y, 4, accumulate); break;
            case 3: gemm_tile(xr, in, wtile, yr, stride_y, 3, accumulate); break;
            case 2: gemm_tile(xr, in, wtile, yr, stride_y, 2, accumulate); break;
            default: gemm_tile(xr, in, wtile, yr, stride_y, 1, accumulate); break;
            }
        }
    if (tiles * TILE < out)
        gemm_tail(x, in, wt + tiles * in * TILE, out - tiles * TILE, y + tiles * TILE, stride_y, (int)rows, accumulate);
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++) y[r * stride_y + o] += bias[o];
}

/* One layer's weights, as model/cpu_stack.py lays them out (pointers; NULL where the model has none). */
enum { IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS,
       WEIGHTS_PER_LAYER };

/* ids: the step's tokens, embedded from embed [vocab, hidden] into the residual stream; positions: each token's
 * position, its rotary rows read from cos_table and sin_table ([positions, dim] rows `stride_rope` apart; the sin
 * signed). logits: [num_logits, vocab], of the rows logits_rows (each < tokens), after the final norm. weights:
 * [layers][WEIGHTS_PER_LAYER] pointers; caches: [layers][2] pointers to k and v ([kv_heads, blocks, block_size,
 * dim], contiguous). token_index: each token's flat cache slot; tables .. lengths: the sequences as
 * paged_attention_f32 reads them (every token one of theirs). Returns 0, -1 when scratch memory ran out, -2 for
 * more logits rows than tokens. */
int decode_stack_f32(const int64_t *ids, const float *embed, const int64_t *positions, int64_t tokens,
                     int64_t hidden, int layers, const int64_t *weights, const int64_t *caches, int64_t kv_stride_h,
                     int64_t kv_stride_b, int64_t kv_stride_t, const float *cos_table, const float *sin_table,
                     int64_t stride_rope, const int64_t *token_index, const int32_t *tables, int64_t table_width,
                     const int32_t *starts, const int32_t *offsets, const int32_t *lengths, int seqs, int heads,
                     int kv_heads, int dim, int block_size, int64_t intermediate, float eps, float scale,
                     const int64_t *logits_rows, int64_t num_logits, const float *final_norm, const float *lm_head,
                     int64_t vocab, float *logits, int threads) {
    int64_t q_width = (int64_t)heads * dim, qkv_width = q_width + 2 * (int64_t)kv_heads * dim;
    size_t floats = (size_t)tokens * (2 * hidden + 2 * dim + qkv_width + 2 * q_width + 3 * intermediate);
    if (num_logits > tokens) return -2;
    float *x = malloc(sizeof(float) * floats);
    if (!x) return -1;
    float *h = x + tokens * hidden, *cos = h + tokens * hidden, *signed_sin = cos + tokens * dim;
    float *qkv = signed_sin + tokens * dim, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *gate_up = attn + tokens * q_width, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(x + t * hidden, embed + ids[t] * hidden, sizeof(float) * hidden);
        memcpy(cos + t * dim, cos_table + positions[t] * stride_rope, sizeof(float) * dim);
        memcpy(signed_sin + t * dim, sin_table + positions[t] * stride_rope, sizeof(float) * dim);
    }
    for (int l = 0; l < layers; l++) {
        const float *const *w = (const float *const *)(weights + (int64_t)l * WEIGHTS_PER_LAYER);
        float *k_cache = (float *)caches[2 * l], *v_cache = (float *)caches[2 * l + 1];
        add_rms_norm_f32(x, hidden, NULL, 0, w[IN_NORM], h, NULL, tokens, hidden, eps, 1);
        gemm(h, tokens, hidden, w[QKV], w[QKV_BIAS], qkv_width, qkv, qkv_width, 0, threads);
        rope_write_kv_f32(qkv, qkv_width, cos, signed_sin, dim, token_index, q, k_cache, v_cache,
                          kv_stride_h, w[Q_NORM], w[K_NORM], eps, tokens, heads, kv_heads, dim, 1);
        if (paged_attention_f32(q, q_width, dim, k_cache, v_cache, kv_stride_h, kv_stride_b, kv_stride_t, attn,
                                q_width, dim, tables, table_width, starts, offsets, lengths, seqs, heads, kv_heads,
                                dim, block_size, scale, threads) != 0) {
            free(x);
            return -1;
        }
        gemm(attn, tokens, q_width, w[O], w[O_BIAS], hidden, x, hidden, 1, threads);
        add_rms_norm_f32(x, hidden, NULL, 0, w[POST_NORM], h, NULL, tokens, hidden, eps, 1);
        gemm(h, tokens, hidden, w[GATE_UP], w[GATE_UP_BIAS], 2 * intermediate, gate_up, 2 * intermediate, 0,
             threads);
        for (int64_t t = 0; t < tokens; t++) {
            const float *g = gate_up + t * 2 * intermediate, *u = g + intermediate;
            float *a = act + t * intermediate;
            for (int64_t j = 0; j < intermediate; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        gemm(act, tokens, intermediate, w[DOWN], w[DOWN_BIAS], hidden, x, hidden, 1, threads);
    }
    /* The final norm of the rows that need logits, then the LM head (lm_head: [hidden, vocab]). */
    for (int64_t r = 0; r < num_logits; r++)
        add_rms_norm_f32(x + logits_rows[r] * hidden, hidden, NULL, 0, final_norm, h + r * hidden, NULL, 1, hidden,
                         eps, 1);
    gemm(h, num_logits, hidden, lm_head, NULL, vocab, logits, vocab, 0, threads);
    free(x);
    return 0;
}
