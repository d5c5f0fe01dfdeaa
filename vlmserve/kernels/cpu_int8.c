/*
 * Weight-only int8 linear layers for decode (few activation rows) on x86-64 CPUs with AVX2 and FMA.
 *
 * y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] (+ b[N]); x, scale, b, y fp32; q int8; all row-major
 * contiguous. Each weight row is read from memory once, widened int8 -> int32 -> fp32 in
 * registers and multiplied into every activation row; the per-channel scale is applied once to
 * the fp32 sum (exact to fp32 rounding: scale * sum(x * q) == sum(x * q * scale) up to the
 * summation's rounding). Callers widen bf16 activations to fp32 and round the result back.
 *
 * Why hand-written (measured on a 2-core AMD EPYC Zen 4, see kernels/int8.py): torch's
 * _weight_int8pack_mm reads int8 weights at about half the speed its own bf16 linear reads bf16
 * ones, so it gains nothing over bf16 for decode; dequantizing to bf16 per call costs more than
 * the product. Prefill (many rows) goes through torch's GEMM on dequantized weights instead.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"

#define NR 4 /* weight rows per tile */
#define MR 2 /* activation rows per pass over a tile (NR x MR accumulators + NR weights: 12 of 16 ymm) */

static inline __m256 load8_i8(const int8_t *p) {
    /* 8 int8 -> 8 fp32, exact. */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Dot products of NR weight rows with up to MR activation rows. */
static inline void tile(const int8_t *w, const float *x, int64_t K, int nr, int mr, float out[NR][MR]) {
    const int64_t k8 = K & ~(int64_t)7;
    __m256 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm256_setzero_ps();
    if (nr == NR && mr == MR) {
        for (int64_t k = 0; k < k8; k += 8) {
            const __m256 w0 = load8_i8(w + k), w1 = load8_i8(w + K + k), w2 = load8_i8(w + 2 * K + k),
                         w3 = load8_i8(w + 3 * K + k);
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + K + k);
            acc[0][0] = _mm256_fmadd_ps(w0, x0, acc[0][0]);
            acc[1][0] = _mm256_fmadd_ps(w1, x0, acc[1][0]);
            acc[2][0] = _mm256_fmadd_ps(w2, x0, acc[2][0]);
            acc[3][0] = _mm256_fmadd_ps(w3, x0, acc[3][0]);
            acc[0][1] = _mm256_fmadd_ps(w0, x1, acc[0][1]);
            acc[1][1] = _mm256_fmadd_ps(w1, x1, acc[1][1]);
            acc[2][1] = _mm256_fmadd_ps(w2, x1, acc[2][1]);
            acc[3][1] = _mm256_fmadd_ps(w3, x1, acc[3][1]);
        }
    } else if (nr == NR && mr == 1) {
        /* decode of one sequence: four weight rows in flight keep the loads streaming */
        for (int64_t k = 0; k < k8; k += 8) {
            const __m256 xv = _mm256_loadu_ps(x + k);
            acc[0][0] = _mm256_fmadd_ps(load8_i8(w + k), xv, acc[0][0]);
            acc[1][0] = _mm256_fmadd_ps(load8_i8(w + K + k), xv, acc[1][0]);
            acc[2][0] = _mm256_fmadd_ps(load8_i8(w + 2 * K + k), xv, acc[2][0]);
            acc[3][0] = _mm256_fmadd_ps(load8_i8(w + 3 * K + k), xv, acc[3][0]);
        }
    } else {
        for (int64_t k = 0; k < k8; k += 8)
            for (int r = 0; r < nr; r++) {
                const __m256 wv = load8_i8(w + r * K + k);
                for (int m = 0; m < mr; m++) acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
            }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            float s = hsum(acc[r][m]);
            for (int64_t k = k8; k < K; k++) s += (float)w[r * K + k] * x[m * K + k];
            out[r][m] = s;
        }
}

/* Dot products of NR fp32 weight rows (widened once into a thread-local buffer) with MR activation rows. */
static inline void tile_f32(const float *wf, const float *x, int64_t K, int mr, float out[NR][MR]) {
    const int64_t k8 = K & ~(int64_t)7;
    __m256 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(wf + k), w1 = _mm256_loadu_ps(wf + K + k), w2 = _mm256_loadu_ps(wf + 2 * K + k),
                     w3 = _mm256_loadu_ps(wf + 3 * K + k);
        for (int m = 0; m < mr; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * K + k);
            acc[0][m] = _mm256_fmadd_ps(w0, xv, acc[0][m]);
            acc[1][m] = _mm256_fmadd_ps(w1, xv, acc[1][m]);
            acc[2][m] = _mm256_fmadd_ps(w2, xv, acc[2][m]);
            acc[3][m] = _mm256_fmadd_ps(w3, xv, acc[3][m]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < mr; m++) {
            float s = hsum(acc[r][m]);
            for (int64_t k = k8; k < K; k++) s += wf[r * K + k] * x[m * K + k];
            out[r][m] = s;
        }
}

/*
 * Weight rows are split across threads and read from memory once whatever M is. Up to MR rows
 * the int8 weights are widened in registers as they stream (decode of one or two sequences);
 * above, each thread widens NR rows at a time into a small fp32 buffer first, so the widening is
 * not repeated for every pair of activation rows (a batch of decoding sequences).
 */
void vlm_linear_int8(const float *x, const int8_t *q, const float *scale, const float *b, float *y, int64_t M,
                     int64_t N, int64_t K) {
    const int64_t tiles = (N + NR - 1) / NR;
    const int64_t k8 = K & ~(int64_t)7;
#pragma omp parallel
    {
        float *wf = M > MR ? (float *)aligned_alloc(64, (size_t)((NR * K * sizeof(float) + 63) / 64 * 64)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            if (wf && nr == NR) {
                for (int r = 0; r < NR; r++) {
                    const int8_t *src = q + (n0 + r) * K;
                    int64_t k = 0;
                    for (; k < k8; k += 8) _mm256_storeu_ps(wf + r * K + k, load8_i8(src + k));
                    for (; k < K; k++) wf[r * K + k] = (float)src[k];
                }
            }
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = (int)(M - m0 < MR ? M - m0 : MR);
                float out[NR][MR];
                if (wf && nr == NR)
                    tile_f32(wf, x + m0 * K, K, mr, out);
                else
                    tile(q + n0 * K, x + m0 * K, K, nr, mr, out);
                for (int m = 0; m < mr; m++)
                    for (int r = 0; r < nr; r++)
                        y[(m0 + m) * N + n0 + r] = out[r][m] * scale[n0 + r] + (b ? b[n0 + r] : 0.0f);
            }
        }
        free(wf);
    }
}

/* Dequantize (prefill): out[n, k] = q[n, k] * scale[n], as fp32 (bf16 = 0) or rounded once to
 * bf16 (bf16 = 1, round to nearest even), at memory speed (torch's int8 -> float conversions run at
 * a fraction of it here). */
void vlm_dequant_int8(const int8_t *q, const float *scale, void *out, int64_t N, int64_t K, int64_t bf16) {
    const int64_t k8 = K & ~(int64_t)7;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *src = q + n * K;
        const __m256 s = _mm256_set1_ps(scale[n]);
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + n * K;
            const __m256i round = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
            int64_t k = 0;
            for (; k < k8; k += 8) {
                /* finite values only (|q * scale| is bounded): round to nearest even, keep the top half */
                __m256i bits = _mm256_castps_si256(_mm256_mul_ps(load8_i8(src + k), s));
                __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
                bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(round, lsb)), 16);
                __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
                _mm_storeu_si128((__m128i *)(dst + k), packed);
            }
            for (; k < K; k++) dst[k] = f32_to_bf16((float)src[k] * scale[n]);
        } else {
            float *dst = (float *)out + n * K;
            int64_t k = 0;
            for (; k < k8; k += 8) _mm256_storeu_ps(dst + k, _mm256_mul_ps(load8_i8(src + k), s));
            for (; k < K; k++) dst[k] = (float)src[k] * scale[n];
        }
    }
}
