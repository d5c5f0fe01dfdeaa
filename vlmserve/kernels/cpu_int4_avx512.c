/*
 * 4-bit weights (AWQ and GPTQ checkpoints, kept packed) for decode on x86-64 CPUs with AVX-512 BF16,
 * bf16 activations: built as its own shared object with its own -m flags (kernels/int4.py), like
 * cpu_int8_avx512.c. The weights' layout and `desc` are cpu_int4.c's (see there).
 *
 * y[M, N] = x[M, K] @ W^T (+ b[N]); x bf16 (uint16_t), b fp32, y fp32 or bf16 (out_bf16: each fp32
 * result rounded once to nearest even). The 4-bit fields go to bf16 with one shift and one
 * vpternlogd per 16 outputs x 2 inputs: a field q in the low 7 mantissa bits under the exponent of
 * 128 (0x4300 | q) is the bf16 value 128 + q, exactly. vdpbf16ps sums x * (128 + q) over a group
 * in fp32; subtracting (128 + zero) * sum(x) over the group and multiplying by the scale gives the
 * group's part of y. (The 128 * sum(x) cancelled costs about 4 of fp32's 24 bits, far below the
 * activations' own bf16 rounding.)
 *
 * The signature is cpu_int8_avx512.c's vlm_linear_int8_avx512 with `desc` in the weights' place,
 * so that the fused decode step (cpu_linear_avx512.c) calls either by its address.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

#define MR 8 /* activation rows per pass over a block */
#define TERNLOG_A_AND_B_OR_C 0xEA

static inline __m512bh field_pairs(__m512i v) {
    return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x000F000F), _mm512_set1_epi32(0x43004300),
                                               TERNLOG_A_AND_B_OR_C);
}

static inline __m512bh pair_of(const uint16_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* Per row and group, the sum of the group's activations (fp32, in order). */
static float *group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t S) {
    const int64_t G = K / S;
    float *sums = (float *)malloc((size_t)(M * G) * sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * S; k < (g + 1) * S; k++) s += bf16_to_f32(x[m * K + k]);
            sums[m * G + g] = s;
        }
    return sums;
}

static inline void store16(void *y, int64_t i, __m512 v, int64_t nr, int bf16) {
    float out[16];
    _mm512_storeu_ps(out, v);
    for (int64_t l = 0; l < nr; l++) {
        if (bf16) ((uint16_t *)y)[i + l] = f32_to_bf16(out[l]);
        else ((float *)y)[i + l] = out[l];
    }
}

/* One group's products for one activation row: eight independent sums (two 64-byte vectors of
 * weights at a time, four input pairs each) so that the dot products do not wait on each other. */
static inline __m512 group_row(const uint32_t *w, const uint16_t *x, int64_t octets) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t o = 0; o < octets; o += 2) {
        const __m512i v0 = _mm512_loadu_si512((const void *)(w + o * 16));
        const __m512i v1 = _mm512_loadu_si512((const void *)(w + o * 16 + 16));
        for (int j = 0; j < 4; j++) {
            acc[j] = _mm512_dpbf16_ps(acc[j], field_pairs(_mm512_srli_epi32(v0, 4 * j)), pair_of(x + 8 * o + 2 * j));
            acc[4 + j] =
                _mm512_dpbf16_ps(acc[4 + j], field_pairs(_mm512_srli_epi32(v1, 4 * j)), pair_of(x + 8 * o + 8 + 2 * j));
        }
    }
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                         _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
}

/* A group's scales and its zero points plus 128 (the fields' bias in field_pairs), for 16 outputs:
 * the group adds scale * (sum(x * (128 + q)) - (128 + zero) * sum(x)). */
static inline void group_params(const float *p, __m512 *scale, __m512 *zero128) {
    *scale = _mm512_loadu_ps(p);
    *zero128 = _mm512_add_ps(_mm512_loadu_ps(p + 16), _mm512_set1_ps(128.0f));
}

/* R rows of x (from row m0) against one block of 16 outputs: R x 2 independent sums per group. R is
 * a constant at every call, so each call compiles to its own unrolled loop. */
static inline __attribute__((always_inline)) void rows_tile(const uint32_t *wb, const float *pb, const uint16_t *x,
                                                            const float *xsum, void *y, int64_t m0, __m512 bias,
                                                            int64_t K, int64_t N, int64_t G, int64_t S, int64_t n0,
                                                            int64_t nr, int bf16, const int R) {
    __m512 total[MR];
    for (int m = 0; m < R; m++) total[m] = bias;
    for (int64_t g = 0; g < G; g++) {
        __m512 acc[MR][2];
        for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t o = g * S / 8; o < (g + 1) * S / 8; o++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wb + o * 16));
            for (int j = 0; j < 4; j++) {
                const __m512bh w = field_pairs(_mm512_srli_epi32(v, 4 * j));
                for (int m = 0; m < R; m++)
                    acc[m][j & 1] = _mm512_dpbf16_ps(acc[m][j & 1], w, pair_of(x + m * K + 8 * o + 2 * j));
            }
        }
        __m512 scale, zero;
        group_params(pb + g * 32, &scale, &zero);
        for (int m = 0; m < R; m++) {
            const __m512 a = _mm512_add_ps(acc[m][0], acc[m][1]);
            total[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero, _mm512_set1_ps(xsum[m * G + g]), a), total[m]);
        }
    }
    for (int m = 0; m < R; m++) store16(y, (m0 + m) * N + n0, total[m], nr, bf16);
}

void vlm_linear_int4_avx512(const uint16_t *x, const int64_t *desc, const float *unused, const float *b, void *y,
                            int64_t M, int64_t N, int64_t K, int64_t out_bf16) {
    (void)unused;
    const uint32_t *qw = (const uint32_t *)(uintptr_t)desc[0];
    const float *params = (const float *)(uintptr_t)desc[1];
    const int64_t S = desc[2], G = K / S, K8 = K / 8, NB = (N + 15) / 16;
    const int bf16 = (int)out_bf16;
    if (M <= 0 || N <= 0) return;
    float *xsum = group_sums(x, M, K, S);
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < NB; blk++) {
        const uint32_t *wb = qw + blk * K8 * 16;
        const float *pb = params + blk * G * 32;
        const int64_t n0 = blk * 16, nr = N - n0 < 16 ? N - n0 : 16;
        __m512 bias = _mm512_setzero_ps();
        if (b) bias = _mm512_maskz_loadu_ps((__mmask16)((1u << nr) - 1), b + n0);
        if (M == 1) {
            __m512 total = bias;
            for (int64_t g = 0; g < G; g++) {
                const __m512 acc = group_row(wb + g * S / 8 * 16, x + g * S, S / 8);
                __m512 scale, zero;
                group_params(pb + g * 32, &scale, &zero);
                total = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero, _mm512_set1_ps(xsum[g]), acc), total);
            }
            store16(y, n0, total, nr, bf16);
            continue;
        }
        for (int64_t m0 = 0; m0 < M;) {
            /* whole tiles of MR rows, then the rest in tiles of 4, 2 and 1 (no row computed twice) */
            const int64_t left = M - m0;
            const int rows = left >= MR ? MR : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (rows == MR) rows_tile(wb, pb, x + m0 * K, xsum + m0 * G, y, m0, bias, K, N, G, S, n0, nr, bf16, MR);
            else if (rows == 4) rows_tile(wb, pb, x + m0 * K, xsum + m0 * G, y, m0, bias, K, N, G, S, n0, nr, bf16, 4);
            else if (rows == 2) rows_tile(wb, pb, x + m0 * K, xsum + m0 * G, y, m0, bias, K, N, G, S, n0, nr, bf16, 2);
            else rows_tile(wb, pb, x + m0 * K, xsum + m0 * G, y, m0, bias, K, N, G, S, n0, nr, bf16, 1);
            m0 += rows;
        }
    }
    free(xsum);
}
