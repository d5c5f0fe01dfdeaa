/*
 * 4-bit weights (AWQ and GPTQ checkpoints, kept packed in memory) on x86-64 CPUs with AVX2 and FMA:
 * the product for fp32 activations and few rows (decode), and the dequantization that prefill's
 * float GEMM reads. cpu_int4_avx512.c is the product for bf16 activations with AVX-512 BF16.
 *
 * The layout both kernels read (models/quant/int4.py writes it once, when the model is loaded), for
 * a layer of N outputs and K inputs in groups of S inputs (G = K / S groups, S % 16 == 0), in blocks
 * of 16 outputs (NB = ceil(N / 16) blocks, rows past N all zero):
 *   qweight uint32 [NB][K / 8][16]: element [b][o][l] holds output n = 16 b + l's inputs 8 o .. 8 o + 7,
 *     input 8 o + 2 j in bits 4 j .. 4 j + 3 and input 8 o + 2 j + 1 in bits 16 + 4 j .. 19 + 4 j
 *     (j = 0..3): one 64-byte vector holds 16 outputs x 8 inputs, and (v >> 4 j) & 0x000f000f is
 *     the pair of inputs (2 j, 2 j + 1) of every output, each in its own 16-bit half;
 *   params float [NB][G][2][16]: [b][g][0][l] the scale, [b][g][1][l] the zero point (an integer
 *     0..15 as a float) of output n = 16 b + l in group g;
 *   w[n][k] = (q[n][k] - zero[n][k / S]) * scale[n][k / S],
 * so that y[m][n] = sum over groups g of scale * (sum_k x[m][k] q[n][k] - zero * sum_k x[m][k]),
 * the inner sums over the group's inputs. A layer is described to the kernels by `desc`, int64
 * [3]: the address of qweight, of params, and S (models/quant/int4.py keeps it).
 *
 * Why hand-written: torch's own int4 CPU product (_weight_int4pack_mm_for_cpu) takes its scales and
 * zeros in bf16, which would round the checkpoints' fp16 scales (11 significant bits to 8) and so
 * change every weight; and the fused decode step (cpu_linear_avx512.c) calls a product by its address.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"

#define MR 2 /* activation rows per pass over a block */

/* 8 lanes' 4-bit fields at `shift` -> fp32, exact. */
static inline __m256 field8(__m256i v, int shift) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xF)));
}

/* Per row and group, the sum of the group's activations (fp32, in order). */
static float *group_sums(const float *x, int64_t M, int64_t K, int64_t S) {
    const int64_t G = K / S;
    float *sums = (float *)malloc((size_t)(M * G) * sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * S; k < (g + 1) * S; k++) s += x[m * K + k];
            sums[m * G + g] = s;
        }
    return sums;
}

/* y[M, N] = x[M, K] @ W^T (+ b); x, b, y fp32, row-major contiguous; W as above. */
void vlm_linear_int4(const float *x, const int64_t *desc, const float *b, float *y, int64_t M, int64_t N,
                     int64_t K) {
    const uint32_t *qw = (const uint32_t *)(uintptr_t)desc[0];
    const float *params = (const float *)(uintptr_t)desc[1];
    const int64_t S = desc[2], G = K / S, K8 = K / 8, NB = (N + 15) / 16;
    if (M <= 0 || N <= 0) return;
    float *xsum = group_sums(x, M, K, S);
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < NB; blk++) {
        const uint32_t *wb = qw + blk * K8 * 16;
        const float *pb = params + blk * G * 32;
        const int64_t n0 = blk * 16, nr = N - n0 < 16 ? N - n0 : 16;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            const float *xr[MR];
            for (int m = 0; m < MR; m++) xr[m] = x + (m0 + (m < mr ? m : 0)) * K;
            __m256 total[MR][2];
            for (int m = 0; m < MR; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                __m256 acc[MR][2];
                for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
                for (int64_t o = g * S / 8; o < (g + 1) * S / 8; o++) {
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + o * 16));
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + o * 16 + 8));
                    for (int j = 0; j < 4; j++) {
                        const __m256 a0 = field8(v0, 4 * j), b0 = field8(v0, 16 + 4 * j);
                        const __m256 a1 = field8(v1, 4 * j), b1 = field8(v1, 16 + 4 * j);
                        for (int m = 0; m < MR; m++) {
                            const __m256 xa = _mm256_broadcast_ss(xr[m] + 8 * o + 2 * j);
                            const __m256 xb = _mm256_broadcast_ss(xr[m] + 8 * o + 2 * j + 1);
                            acc[m][0] = _mm256_fmadd_ps(a0, xa, _mm256_fmadd_ps(b0, xb, acc[m][0]));
                            acc[m][1] = _mm256_fmadd_ps(a1, xa, _mm256_fmadd_ps(b1, xb, acc[m][1]));
                        }
                    }
                }
                const float *p = pb + g * 32;
                for (int h = 0; h < 2; h++) {
                    const __m256 scale = _mm256_loadu_ps(p + 8 * h), zero = _mm256_loadu_ps(p + 16 + 8 * h);
                    for (int m = 0; m < MR; m++) {
                        const __m256 xs = _mm256_set1_ps(xsum[(m0 + (m < mr ? m : 0)) * G + g]);
                        total[m][h] = _mm256_fmadd_ps(scale, _mm256_fnmadd_ps(zero, xs, acc[m][h]), total[m][h]);
                    }
                }
            }
            for (int m = 0; m < mr; m++) {
                float out[16];
                _mm256_storeu_ps(out, total[m][0]);
                _mm256_storeu_ps(out + 8, total[m][1]);
                for (int64_t l = 0; l < nr; l++) y[(m0 + m) * N + n0 + l] = out[l] + (b ? b[n0 + l] : 0.0f);
            }
        }
    }
    free(xsum);
}

/* Rows n0 .. n1 of W (n0 a multiple of 16) -> out [n1 - n0, K], fp32 or bf16 (each value computed
 * exactly in fp32, as (q - zero) * scale, then rounded once to nearest even). */
void vlm_dequant_int4(const int64_t *desc, void *out, int64_t n0, int64_t n1, int64_t K, int64_t out_bf16) {
    const uint32_t *qw = (const uint32_t *)(uintptr_t)desc[0];
    const float *params = (const float *)(uintptr_t)desc[1];
    const int64_t S = desc[2], G = K / S, K8 = K / 8;
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const int64_t blk = n / 16, l = n % 16;
        const uint32_t *wb = qw + blk * K8 * 16;
        const float *pb = params + blk * G * 32;
        float *of = (float *)out + (n - n0) * K;
        uint16_t *ob = (uint16_t *)out + (n - n0) * K;
        for (int64_t o = 0; o < K8; o++) {
            const uint32_t v = wb[o * 16 + l];
            const int64_t g = 8 * o / S;
            const float scale = pb[g * 32 + l], zero = pb[g * 32 + 16 + l];
            for (int j = 0; j < 4; j++) {
                const float w0 = ((float)((v >> (4 * j)) & 0xF) - zero) * scale;
                const float w1 = ((float)((v >> (16 + 4 * j)) & 0xF) - zero) * scale;
                const int64_t k = 8 * o + 2 * j;
                if (out_bf16) {
                    ob[k] = f32_to_bf16(w0);
                    ob[k + 1] = f32_to_bf16(w1);
                } else {
                    of[k] = w0;
                    of[k + 1] = w1;
                }
            }
        }
    }
}
