/* A decoder's whole layer stack for a step of short queries on CPU, in one call (decode, verification, drafting).
 *
 * A draft step of one sequence runs two layers of 128 features: some thirty thousand multiply-adds per layer,
 * which one core does in microseconds, while the layers' forty-odd torch operators (the GEMMs among them),
 * each dispatched from Python, took a millisecond; the bundled target's step likewise cost its dispatch more
 * than reading its weights. Here every layer runs as loops over the weights held transposed and packed by tiles
 * of 64 outputs (gemm): RMSNorm, the QKV projection, the q/k norm, rotary embedding and KV write and the
 * paged attention (the kernels of fused_layers.c and paged_attention.c, included below), the
 * output projection added to the residual stream, RMSNorm, gate and up, SiLU(gate) x up, down added to the
 * stream; then the final norm and the LM head for the rows that need logits. Built once per machine by
 * cpu_kernels.py, called through ctypes by cpu_stack.py with one argument (struct stack_call, below, mirrored
 * there as StackCall); float32 activations, the projections' weights float32 or bfloat16 (weights that are
 * bfloat16 values, widened to the same floats as they load).
 *
 * A row's result depends on that row alone: every output is one sum over the input features in order, the
 * same loop whatever the rows around it and however the outputs are split between threads.
 */
#include "vec.h"
#include "fused_layers.c"
#include "paged_attention.c"

#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROW_BLOCK 8        /* rows that share each loaded weight vector (a verification window of k = 4 is 5) */
#define COL_VECS 4         /* output vectors (of LANES) a tile covers */
#define TILE (COL_VECS * LANES) /* a tile's outputs: 64, as cpu_stack.py packs the weights */
#define PARALLEL_MACS (1 << 16) /* a GEMM with fewer multiply-adds runs on the calling thread */

/* LANES weights from w + i (elements): float32, or bfloat16 widened to float32 (its bits are the float's upper
 * half, so the float is the very value a float32 copy of the weight holds: the same products and sums). */
static inline __attribute__((always_inline)) vec load_weights(const void *w, int64_t i, int bf16) {
    if (!bf16) return *(const vec *)((const float *)w + i);
#if defined(__AVX512F__) && LANES == 16
    /* One zero-extending load and a shift: the generic widening below compiles (gcc, 256-bit vectors preferred)
     * into two half-width extensions, an extract and an insert, four shuffles on the port that also runs the
     * second FMA unit, which made a step of five rows cost 1.6x a step of one. */
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
    return (vec)_mm512_slli_epi32(wide, 16);
#else
    bits_vec bits = __builtin_convertvector(*(const bf16_vec *)((const uint16_t *)w + i), bits_vec) << 16;
    return (vec)bits;
#endif
}

static inline float load_weight(const void *w, int64_t i, int bf16) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* y[r][o0 .. o0 + cols * LANES) (+)= x[r] . w[i][c0 ..] for `rows` rows, w one tile's weights ([in][TILE]) and
 * c0 the block's first column in it; rows x cols accumulators stay in registers (AVX-512 has 32: up to 6 rows
 * of 4 vectors, 8 of 2). */
static inline __attribute__((always_inline)) void gemm_block(const float *x, int64_t in, const void *wtile,
                                                             int64_t c0, float *y, int64_t stride_y, int rows,
                                                             int cols, int accumulate, int bf16) {
    vec acc[ROW_BLOCK][COL_VECS] = {{{0}}};
    for (int64_t i = 0; i < in; i++) {
        vec wv[COL_VECS];
        for (int c = 0; c < cols; c++) wv[c] = load_weights(wtile, i * TILE + c0 + c * LANES, bf16);
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
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t in, const void *wtile, float *y,
                                                            int64_t stride_y, int rows, int accumulate, int bf16) {
    if (rows <= 6) {
        gemm_block(x, in, wtile, 0, y, stride_y, rows, COL_VECS, accumulate, bf16);
        return;
    }
    for (int half = 0; half < 2; half++)
        gemm_block(x, in, wtile, half * (TILE / 2), y, stride_y, rows, COL_VECS / 2, accumulate, bf16);
}

/* The `width` outputs past the last full tile (weights [in][width]), one at a time (same order of sums; each
 * step one fused multiply-add, as the tiles' are, whichever way the compiler vectorizes either weight type). */
static void gemm_tail(const float *x, int64_t in, const void *wtail, int64_t width, float *y, int64_t stride_y,
                      int rows, int accumulate, int bf16) {
    for (int r = 0; r < rows; r++)
        for (int64_t o = 0; o < width; o++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < in; i++) sum = fmaf(x[r * in + i], load_weight(wtail, i * width + o, bf16), sum);
            y[r * stride_y + o] = accumulate ? y[r * stride_y + o] + sum : sum;
        }
}

/* The weights from element `i` on, of either type. */
static inline const void *weights_at(const void *w, int64_t i, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)w + i) : (const void *)((const float *)w + i);
}

/* Rows r0.. of one tile (at most ROW_BLOCK of them), for constant row counts: the accumulators in registers. */
static inline __attribute__((always_inline)) void gemm_rows(const float *xr, int64_t in, const void *wtile,
                                                            float *yr, int64_t stride_y, int64_t rows,
                                                            int accumulate, int bf16) {
    switch (rows >= ROW_BLOCK ? ROW_BLOCK : rows) {
    case 8: gemm_tile(xr, in, wtile, yr, stride_y, 8, accumulate, bf16); break;
    case 7: gemm_tile(xr, in, wtile, yr, stride_y, 7, accumulate, bf16); break;
    case 6: gemm_tile(xr, in, wtile, yr, stride_y, 6, accumulate, bf16); break;
    case 5: gemm_tile(xr, in, wtile, yr, stride_y, 5, accumulate, bf16); break;
    case 4: gemm_tile(xr, in, wtile, yr, stride_y, 4, accumulate, bf16); break;
    case 3: gemm_tile(xr, in, wtile, yr, stride_y, 3, accumulate, bf16); break;
    case 2: gemm_tile(xr, in, wtile, yr, stride_y, 2, accumulate, bf16); break;
    default: gemm_tile(xr, in, wtile, yr, stride_y, 1, accumulate, bf16); break;
    }
}

/* The full tiles of gemm, for a constant `bf16` (each weight type its own loop). */
static inline __attribute__((always_inline)) void gemm_tiles(const float *x, int64_t rows, int64_t in,
                                                             const void *wt, int64_t tiles, float *y,
                                                             int64_t stride_y, int accumulate, int threads,
                                                             int bf16) {
    int parallel = threads > 1 && rows * in * tiles * TILE >= PARALLEL_MACS;
#pragma omp parallel for num_threads(threads) if (parallel) collapse(2)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK)
            gemm_rows(x + r0 * in, in, weights_at(wt, t * in * TILE, bf16), y + r0 * stride_y + t * TILE, stride_y,
                      rows - r0, accumulate, bf16);
}

/* This thread's float32 scratch of at least `floats` (kept for the thread's life; NULL if memory ran out). */
static float *thread_scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t size = 0;
    if (floats > size) {
        free(buffer);
        buffer = malloc(sizeof(float) * floats);
        size = buffer ? floats : 0;
    }
    return buffer;
}

/* bfloat16 tiles for more rows than one block: each tile widened once into the thread's scratch and its row
 * blocks run from there (widening it again for every block cost more than the bytes it saves; the floats are
 * the same). */
static void gemm_tiles_widened(const float *x, int64_t rows, int64_t in, const uint16_t *wt, int64_t tiles,
                               float *y, int64_t stride_y, int accumulate, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *wtile = wt + t * in * TILE;
        float *wide = thread_scratch(in * TILE);
        if (wide)
            for (int64_t i = 0; i < in * TILE; i += LANES) *(vec *)(wide + i) = load_weights(wtile, i, 1);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            float *yr = y + r0 * stride_y + t * TILE;
            if (wide)
                gemm_rows(x + r0 * in, in, wide, yr, stride_y, rows - r0, accumulate, 0);
            else
                gemm_rows(x + r0 * in, in, wtile, yr, stride_y, rows - r0, accumulate, 1);
        }
    }
}

/* y (+)= x @ W (+ bias): x [rows, in] contiguous, y rows `stride_y` apart; wt: W [in, out] packed by tiles of
 * TILE columns, each [in][TILE] contiguous, then the last out % TILE columns as [in][out % TILE] (cpu_stack.py
 * packs them): a tile's weights stream from memory in order. bf16: wt holds bfloat16 (the weights are bfloat16
 * values: half the bytes to stream, the same sums), else float32. */
static void gemm(const float *x, int64_t rows, int64_t in, const void *wt, const float *bias, int64_t out,
                 float *y, int64_t stride_y, int accumulate, int threads, int bf16) {
    const int64_t tiles = out / TILE;
    if (bf16 && rows > ROW_BLOCK && tiles >= threads && rows * in * tiles * TILE >= PARALLEL_MACS)
        gemm_tiles_widened(x, rows, in, wt, tiles, y, stride_y, accumulate, threads);
    else if (bf16)
        gemm_tiles(x, rows, in, wt, tiles, y, stride_y, accumulate, threads, 1);
    else
        gemm_tiles(x, rows, in, wt, tiles, y, stride_y, accumulate, threads, 0);
    if (tiles * TILE < out)
        gemm_tail(x, in, weights_at(wt, tiles * in * TILE, bf16), out - tiles * TILE, y + tiles * TILE, stride_y,
                  (int)rows, accumulate, bf16);
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++) y[r * stride_y + o] += bias[o];
}

/* One layer's weights, as cpu_stack.py lays them out (pointers; NULL where the model has none). */
enum { IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS,
       WEIGHTS_PER_LAYER };

/* The model, as cpu_stack.py's StackModel holds it. embed: [vocab, hidden], each token's row the residual stream's
 * start; weights: [layers][WEIGHTS_PER_LAYER] pointers; caches: [layers][2] pointers to k and v ([kv_heads, blocks,
 * block_size, dim], contiguous; kv_stride_*: their strides); cos_table and sin_table: [positions, dim] rows
 * `stride_rope` apart (the sin signed); final_norm, then lm_head [hidden, vocab] packed as the projections are.
 * bf16: the packed projections and LM head hold bfloat16 (the norms and biases float32). */
struct stack_model {
    const float *embed;
    const int64_t *weights;
    const int64_t *caches;
    const float *cos_table, *sin_table;
    const float *final_norm;
    const void *lm_head;
    int64_t hidden, intermediate, vocab, stride_rope;
    int64_t kv_stride_h, kv_stride_b, kv_stride_t;
    int layers, heads, kv_heads, dim, block_size, bf16;
    float eps, scale;
};

/* A forward's tokens and sequences, as cpu_stack.py's StackStep packs them. ids: the tokens; positions: each
 * one's position (its rotary rows); token_index: its flat cache slot; logits_rows: the rows that need logits
 * (each < tokens); tables [seqs, table_width] .. lengths: the sequences as paged_attention_f32 reads them (every
 * token one of theirs). */
struct stack_step {
    const int64_t *ids, *positions, *token_index, *logits_rows;
    const int32_t *tables, *starts, *offsets, *lengths;
    int64_t tokens, num_logits, table_width;
    int seqs;
};

/* decode_stack_f32's argument (cpu_stack.py's StackCall): the model, the step, where its logits go ([num_logits,
 * vocab]), the threads; with `steps` (NULL: none) greedy drafting, each sequence's tokens into drafted [seqs,
 * max_steps] and their confidences into confidence (the same shape). */
struct stack_call {
    struct stack_model model;
    struct stack_step step;
    float *logits;
    int threads;
    const int32_t *steps;
    int64_t *drafted;
    float *confidence;
    int64_t max_steps;
};

/* The step's forward through every layer, then the final norm of its logits rows and the LM head into logits.
 * Returns 0, -1 when scratch memory ran out, -2 for more logits rows than tokens. */
static int stack_forward(const struct stack_model *m, const struct stack_step *s, float *logits, int threads) {
    const int64_t hidden = m->hidden, intermediate = m->intermediate, tokens = s->tokens;
    const int dim = m->dim, heads = m->heads, kv_heads = m->kv_heads, bf16 = m->bf16;
    const float eps = m->eps;
    int64_t q_width = (int64_t)heads * dim, qkv_width = q_width + 2 * (int64_t)kv_heads * dim;
    size_t floats = (size_t)tokens * (2 * hidden + 2 * dim + qkv_width + 2 * q_width + 3 * intermediate);
    if (s->num_logits > tokens) return -2;
    float *x = malloc(sizeof(float) * floats);
    if (!x) return -1;
    float *h = x + tokens * hidden, *cos = h + tokens * hidden, *signed_sin = cos + tokens * dim;
    float *qkv = signed_sin + tokens * dim, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *gate_up = attn + tokens * q_width, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(x + t * hidden, m->embed + s->ids[t] * hidden, sizeof(float) * hidden);
        memcpy(cos + t * dim, m->cos_table + s->positions[t] * m->stride_rope, sizeof(float) * dim);
        memcpy(signed_sin + t * dim, m->sin_table + s->positions[t] * m->stride_rope, sizeof(float) * dim);
    }
    for (int l = 0; l < m->layers; l++) {
        const float *const *w = (const float *const *)(m->weights + (int64_t)l * WEIGHTS_PER_LAYER);
        float *k_cache = (float *)m->caches[2 * l], *v_cache = (float *)m->caches[2 * l + 1];
        add_rms_norm_f32(x, hidden, NULL, 0, w[IN_NORM], h, NULL, tokens, hidden, eps, 1);
        gemm(h, tokens, hidden, w[QKV], w[QKV_BIAS], qkv_width, qkv, qkv_width, 0, threads, bf16);
        rope_write_kv_f32(qkv, qkv_width, cos, signed_sin, dim, s->token_index, q, k_cache, v_cache, m->kv_stride_h,
                          w[Q_NORM], w[K_NORM], eps, tokens, heads, kv_heads, dim, 1);
        if (paged_attention_f32(q, q_width, dim, k_cache, v_cache, m->kv_stride_h, m->kv_stride_b, m->kv_stride_t,
                                attn, q_width, dim, s->tables, s->table_width, s->starts, s->offsets, s->lengths,
                                s->seqs, heads, kv_heads, dim, m->block_size, m->scale, threads) != 0) {
            free(x);
            return -1;
        }
        gemm(attn, tokens, q_width, w[O], w[O_BIAS], hidden, x, hidden, 1, threads, bf16);
        add_rms_norm_f32(x, hidden, NULL, 0, w[POST_NORM], h, NULL, tokens, hidden, eps, 1);
        gemm(h, tokens, hidden, w[GATE_UP], w[GATE_UP_BIAS], 2 * intermediate, gate_up, 2 * intermediate, 0,
             threads, bf16);
        for (int64_t t = 0; t < tokens; t++) {
            const float *g = gate_up + t * 2 * intermediate, *u = g + intermediate;
            float *a = act + t * intermediate;
            for (int64_t j = 0; j < intermediate; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        gemm(act, tokens, intermediate, w[DOWN], w[DOWN_BIAS], hidden, x, hidden, 1, threads, bf16);
    }
    /* The final norm of the rows that need logits, then the LM head (lm_head: [hidden, vocab]). */
    for (int64_t r = 0; r < s->num_logits; r++)
        add_rms_norm_f32(x + s->logits_rows[r] * hidden, hidden, NULL, 0, m->final_norm, h + r * hidden, NULL, 1,
                         hidden, eps, 1);
    gemm(h, s->num_logits, hidden, m->lm_head, NULL, m->vocab, logits, m->vocab, 0, threads, bf16);
    free(x);
    return 0;
}

/* The largest logit's index, as torch.argmax picks it (the first of equal maxima; a NaN above every number), and
 * softmax's probability there, 1 / sum(exp(l - max)): the drafter's confidence. */
static int64_t greedy_token(const float *row, int64_t vocab, float *confidence) {
    int64_t best = 0;
    float top = row[0];
    for (int64_t v = 1; v < vocab && !isnan(top); v++)
        if (isnan(row[v]) || row[v] > top) {
            best = v;
            top = row[v];
        }
    float sum = 0.0f;
    for (int64_t v = 0; v < vocab; v++) sum += expf(row[v] - top);
    *confidence = 1.0f / sum;
    return best;
}

/* The call's forward, and with `steps` greedy drafting: each sequence's logits row (logits_rows: every sequence's
 * last token, num_logits = seqs) gives its argmax, which the next forward feeds at the next position, until
 * sequence s holds steps[s] tokens in drafted[s][..] (rows max_steps apart) and their confidences; its last token
 * is not written. The block tables must hold every position written. One call for a window that took k forwards
 * and argmaxes from Python, each a few hundred microseconds of dispatch and lists. Returns as stack_forward. */
int decode_stack_f32(const struct stack_call *call) {
    const struct stack_model *m = &call->model;
    const struct stack_step *first = &call->step;
    const int seqs = first->seqs;
    const int64_t table_width = first->table_width, vocab = m->vocab, max_steps = call->max_steps;
    float *logits = call->logits, *confidence = call->confidence;
    int64_t *drafted = call->drafted;
    int status = stack_forward(m, first, logits, call->threads);
    if (status != 0 || !call->steps) return status;
    if (first->num_logits != seqs) return -2;
    /* The live sequences of a step: their rows (ids, positions, cache slots, logits rows), then their tables,
     * starts, offsets and query lengths (1), and which sequence each is. */
    int64_t *rows = malloc(sizeof(int64_t) * 4 * seqs);
    int32_t *live = malloc(sizeof(int32_t) * ((size_t)seqs * (table_width + 5)));
    if (!rows || !live) {
        free(rows);
        free(live);
        return -1;
    }
    int32_t *next_tables = live + seqs, *next_starts = next_tables + seqs * table_width;
    int32_t *next_offsets = next_starts + seqs, *next_lengths = next_offsets + seqs, *ends = next_lengths + seqs;
    struct stack_step next = {.ids = rows, .positions = rows + seqs, .token_index = rows + 2 * seqs,
                              .logits_rows = rows + 3 * seqs, .tables = next_tables, .starts = next_starts,
                              .offsets = next_offsets, .lengths = next_lengths, .table_width = table_width};
    for (int s = 0; s < seqs; s++) {
        ends[s] = first->starts[s] + first->lengths[s];
        drafted[s * max_steps] = greedy_token(logits + (int64_t)s * vocab, vocab, confidence + s * max_steps);
    }
    for (int64_t j = 1; j < max_steps && status == 0; j++) {
        int n = 0;
        for (int s = 0; s < seqs; s++) {
            if (call->steps[s] <= j) continue;
            const int32_t *table = first->tables + (int64_t)s * table_width;
            int32_t position = ends[s]++;
            rows[n] = drafted[s * max_steps + j - 1];
            rows[seqs + n] = position;
            rows[2 * seqs + n] = (int64_t)table[position / m->block_size] * m->block_size + position % m->block_size;
            rows[3 * seqs + n] = n;
            memcpy(next_tables + (int64_t)n * table_width, table, sizeof(int32_t) * table_width);
            next_starts[n] = position;
            next_offsets[n] = n;
            next_lengths[n] = 1;
            live[n++] = s;
        }
        if (n == 0) break;
        next.tokens = next.num_logits = next.seqs = n;
        status = stack_forward(m, &next, logits, call->threads);
        for (int i = 0; i < n && status == 0; i++)
            drafted[live[i] * max_steps + j] = greedy_token(logits + (int64_t)i * vocab, vocab,
                                                            confidence + live[i] * max_steps + j);
    }
    free(rows);
    free(live);
    return status;
}
