/* The vector types of the CPU kernels (fused_layers.c, paged_attention.c, decode_stack.c), and the one order in
 * which they add a vector's lanes.
 *
 * A vec is LANES floats, one AVX-512 register (the compiler splits it where the CPU's vectors are narrower),
 * loaded and stored unaligned. Every sum of a vector's lanes runs the same fixed tree (lanes_total), so a
 * row's result never depends on the rows around it or on how a loop was split.
 */
#ifndef MINEDRAFT_VEC_H
#define MINEDRAFT_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)))); /* unaligned loads */
/* LANES bfloat16 weights, and their bits widened to float32's width (decode_stack.c's load_weights). */
typedef uint16_t bf16_vec __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef uint32_t bits_vec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* The sum of lane[0 .. LANES), added in a fixed tree (halves, then quarters, ...); lane is overwritten. */
static inline float lanes_total(float lane[LANES]) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

/* The sum of a vector's lanes, in lanes_total's tree. */
static inline float vec_total(vec v) {
    float lane[LANES];
    memcpy(lane, &v, sizeof lane);
    return lanes_total(lane);
}

#endif
