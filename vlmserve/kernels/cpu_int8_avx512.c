/*
 * Weight-only int8 linear layers for decode on x86-64 CPUs with AVX-512 BF16, bf16 activations:
 * built as its own shared object with its own -m flags (kernels/int8.py), like cpu_linear_avx512.c.
 *
 * y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] (+ b[N]); x bf16 (uint16_t); q int8; scale, b
 * fp32; y fp32, or bf16 (out_bf16: each fp32 result rounded once to nearest even, as torch's
 * .to(bfloat16) rounds it; one call instead of a conversion op per layer: ~1 ms of a 2B int8
 * decode step); row-major contiguous. With several activation rows each int8 weight is widened to bf16,
 * which holds every integer in [-128, 127] exactly, and multiplied with vdpbf16ps (exact bf16
 * products, fp32 sums); with one row (linear_row) it is widened to fp32 and multiplied with FMAs
 * against the activations widened to fp32. Either way the same values cpu_int8.c computes from
 * the same bf16 activations, summed in another order. The per-channel scale multiplies the fp32
 * sum once.
 *
 * Why not AVX-512 VNNI (vpdpbusd): it multiplies 8-bit integers by 8-bit integers, so the
 * activations would have to be quantized too (W8A8), another model's arithmetic. Why this kernel:
 * cpu_int8.c turns compute-bound past a few rows on its int8 -> fp32 widening and 8-wide FMAs
 * (see kernels/int8.py); here one row of weights is widened once per tile of 4 weight rows and
 * then serves every activation row with 32-wide dot products.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

#define NR 4  /* weight rows per tile */
#define MR 4  /* activation rows per tile: 16 accumulators */
#define NR1 4 /* weight rows in flight for one activation row */

/* 32 int8 -> 32 bf16, exact. `mask`: the bytes to read (the rest read as zero). */
static inline __m512bh widen32(const int8_t *p, __mmask64 mask) {
    const __m512i v = _mm512_maskz_loadu_epi8(mask, (const void *)p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline void store(void *y, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}

static inline __m512bh load32(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }

static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline __mmask64 tail_mask(int64_t K, int64_t k) {
    const int64_t left = K - k;
    return left >= 32 ? (__mmask64)0xffffffffu : (((__mmask64)1 << left) - 1);
}

/* 16 int8 -> 16 fp32, exact. */
static inline __m512 widen16_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* One activation row (xp: Kp bf16, zero past K): NR1 weight rows streamed, widened in registers.
 * Here each weight is used once, so its widening is the cost: to fp32 and 16-wide FMAs (widen,
 * convert, FMA per 16 weights) rather than on to bf16 for vdpbf16ps (one more conversion per 32).
 * Measured on the Zen 4 machine (2 threads, [1, 1536] x [8960, 1536], weights in cache so that
 * memory does not hide it): 0.363 -> 0.281 ms, i.e. 38 -> 49 GB/s of int8 weights, above what
 * its memory delivers most of the time (33-35 GB/s, bursts to 60). Products are exact either way
 * (int8 x bf16 fits fp32); the sums run in fp32 in another order. */
static void linear_row(const uint16_t *xp, const int8_t *q, const float *scale, const float *b, void *y, int64_t N,
                       int64_t K, int bf16) {
    const int64_t kfull = K & ~(int64_t)31;
    const int64_t tiles = (N + NR1 - 1) / NR1;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR1;
        const int nr = (int)(N - n0 < NR1 ? N - n0 : NR1);
        const int8_t *wr[NR1];
        for (int r = 0; r < NR1; r++) wr[r] = q + (n0 + (r < nr ? r : nr - 1)) * K;
        __m512 acc[NR1];
        for (int r = 0; r < NR1; r++) acc[r] = _mm512_setzero_ps();
        /* the next NR1 weight rows requested into L2 meanwhile, a cache line of each per 64 k: the
         * hardware prefetchers alone fetch only as far ahead as the loads run (cpu_linear_avx512.c,
         * PREFETCH). [1, 1536] x [151936, 1536] int8 on the Zen 4 machine: 13.8 -> 8.6 ms. */
        const int8_t *next = n0 + 2 * NR1 <= N ? q + (n0 + NR1) * K : NULL;
        for (int64_t k = 0; k < kfull; k += 32) {
            const __m512 x0 = bf16x16_f32(xp + k), x1 = bf16x16_f32(xp + k + 16);
            if (next && (k & 63) == 0)
                for (int r = 0; r < NR1; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T1);
            for (int r = 0; r < NR1; r++) {
                acc[r] = _mm512_fmadd_ps(widen16_f32(wr[r] + k), x0, acc[r]);
                acc[r] = _mm512_fmadd_ps(widen16_f32(wr[r] + k + 16), x1, acc[r]);
            }
        }
        if (kfull < K) { /* the last, partial chunk: weight bytes past K read as zero */
            const __mmask64 mask = tail_mask(K, kfull);
            const __m512bh xv = load32(xp + kfull);
            for (int r = 0; r < NR1; r++) acc[r] = _mm512_dpbf16_ps(acc[r], widen32(wr[r] + kfull, mask), xv);
        }
        float s[4];
        _mm_storeu_ps(s, reduce4(acc[0], acc[1], acc[2], acc[3]));
        for (int r = 0; r < nr; r++) store(y, n0 + r, s[r] * scale[n0 + r] + (b ? b[n0 + r] : 0.0f), bf16);
    }
}

void vlm_linear_int8_avx512(const uint16_t *x, const int8_t *q, const float *scale, const float *b, void *y,
                            int64_t M, int64_t N, int64_t K, int64_t out_bf16) {
    const int bf16 = (int)out_bf16;
    if (M <= 0 || N <= 0) return;
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    const int64_t Mp = (M + MR - 1) / MR * MR;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, (size_t)(Mp * Kp * sizeof(uint16_t)));
    memset(xp, 0, (size_t)(Mp * Kp * sizeof(uint16_t)));
    for (int64_t m = 0; m < M; m++) memcpy(xp + m * Kp, x + m * K, (size_t)(K * sizeof(uint16_t)));
    if (M == 1) {
        linear_row(xp, q, scale, b, y, N, K, bf16);
        free(xp);
        return;
    }
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel
    {
        /* the tile's weight rows widened to bf16 once (zero past K), then used by every row of x */
        uint16_t *wb = (uint16_t *)aligned_alloc(64, (size_t)(NR * Kp * sizeof(uint16_t)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            if (n0 + 2 * NR <= N) /* the next tile's rows (contiguous) requested into L2 meanwhile */
                for (int64_t off = 0; off < NR * K; off += 64) _mm_prefetch((const char *)(q + (n0 + NR) * K + off), _MM_HINT_T1);
            for (int r = 0; r < NR; r++) {
                const int8_t *src = q + (n0 + (r < nr ? r : nr - 1)) * K;
                for (int64_t k = 0; k < Kp; k += 32)
                    _mm512_storeu_si512((void *)(wb + r * Kp + k), (__m512i)widen32(src + k, tail_mask(K, k)));
            }
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = (int)(M - m0 < MR ? M - m0 : MR);
                __m512 acc[NR][MR];
                for (int r = 0; r < NR; r++)
                    for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_ps();
                for (int64_t k = 0; k < Kp; k += 32) {
                    __m512bh wv[NR];
                    for (int r = 0; r < NR; r++) wv[r] = load32(wb + r * Kp + k);
                    for (int m = 0; m < MR; m++) {
                        const __m512bh xv = load32(xp + (m0 + m) * Kp + k);
                        for (int r = 0; r < NR; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
                    }
                }
                for (int m = 0; m < mr; m++) {
                    float s[4];
                    _mm_storeu_ps(s, reduce4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
                    for (int r = 0; r < nr; r++)
                        store(y, (m0 + m) * N + n0 + r, s[r] * scale[n0 + r] + (b ? b[n0 + r] : 0.0f), bf16);
                }
            }
        }
        free(wb);
    }
    free(xp);
}
