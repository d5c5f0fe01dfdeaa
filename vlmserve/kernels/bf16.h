/*
 * bfloat16 <-> fp32, exact one way and rounded once the other, as torch converts: included by the
 * CPU kernels (each built as its own shared object, kernels/cpu.py hashes this file with them).
 */
#ifndef VLMSERVE_BF16_H
#define VLMSERVE_BF16_H

#include <math.h>
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

/* The rotary kernels' loop over tokens (cpu_linear.c's scalar rotate and cpu_linear_avx512.c's):
 * each token's q heads then k heads rotated by `rotate` with the token's cos, sin rows (bf16 or
 * fp32 items), tokens split among the threads. */
typedef void (*rotate_heads_fn)(uint16_t *x, const void *c, const void *s, int64_t heads, int64_t D, int cos_bf16);

static inline void rotary_tokens(rotate_heads_fn rotate, uint16_t *q, uint16_t *k, int64_t q_stride,
                                 int64_t k_stride, const void *cos, const void *sin, int64_t M, int64_t nq,
                                 int64_t nk, int64_t D, int64_t cos_bf16) {
    const int64_t item = cos_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const char *c = (const char *)cos + m * D * item, *s = (const char *)sin + m * D * item;
        rotate(q + m * q_stride, c, s, nq, D, (int)cos_bf16);
        rotate(k + m * k_stride, c, s, nk, D, (int)cos_bf16);
    }
}

/* RMSNorm after a residual add, one row of H (bf16): sum = x + delta (skipped when delta is NULL:
 * sum is x; sum may be x itself), out = w * bf16(sum * rsqrt(mean(sum^2) + eps)); out may be x.
 * Rounded where torch's bf16 ops of models/layers.py round; the mean's sum in eight interleaved
 * parts. One source for cpu_linear.c's kernels and cpu_linear_avx512.c's fused decode: the same
 * bits from both (built without FMA contraction, -std=c11). */
static inline void add_rms_norm_row(const uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *sum,
                                    uint16_t *out, int64_t H, float eps) {
    uint16_t *s_row = delta ? sum : (uint16_t *)x;
    float acc[8] = {0};
    for (int64_t i = 0; i < H; i++) {
        float s = bf16_to_f32(x[i]);
        if (delta) {
            s_row[i] = f32_to_bf16(s + bf16_to_f32(delta[i]));
            s = bf16_to_f32(s_row[i]);
        }
        acc[i & 7] += s * s;
    }
    const float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float r = 1.0f / sqrtf(total / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(s_row[i]) * r));
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
    }
}

/* add_rms_norm_row on rows [M, H] (x, delta, sum and out contiguous). */
static inline void add_rms_norm_rows(const uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *sum,
                                     uint16_t *out, int64_t M, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++)
        add_rms_norm_row(x + m * H, delta ? delta + m * H : NULL, w, delta ? sum + m * H : NULL, out + m * H, H, eps);
}

/* RMSNorm of each head in place: x [M, heads, D] with rows `stride` elements apart and heads
 * contiguous (views of a fused qkv output), w [D]: Qwen3's q_norm and k_norm. */
static inline void rms_norm_heads(uint16_t *x, int64_t stride, const uint16_t *w, int64_t M, int64_t heads,
                                  int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + m * stride + h * D;
            add_rms_norm_row(row, NULL, w, NULL, row, D, eps);
        }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 -> 16 fp32, exact (the AVX-512 kernels). */
static inline __m512 bf16x16_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#endif
