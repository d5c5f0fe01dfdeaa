/*
 * bfloat16 <-> fp32, exact one way and rounded once the other, as torch converts: included by the
 * CPU kernels (each built as its own shared object, kernels/cpu.py hashes this file with them).
 */
#ifndef VLMSERVE_BF16_H
#define VLMSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 -> 16 fp32, exact (the AVX-512 kernels). */
static inline __m512 bf16x16_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#endif
