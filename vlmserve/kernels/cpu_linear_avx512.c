/*
 * bfloat16 linear layers for x86-64 CPUs with AVX-512 BF16 (vdpbf16ps): built as its own shared
 * object with its own -m flags (kernels/cpu.py), so that machines with AVX2 only still build and
 * load cpu_linear.c.
 *
 * Why: cpu_linear.c widens bf16 weights to fp32 in registers and multiplies with 8-wide FMAs; on a
 * CPU with AVX-512 BF16 one vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 sums,
 * reading the weights as they are. Measured on a 2-core AMD EPYC Zen 4 (issue 18): the AVX2 kernel
 * took 4.5x torch's time (oneDNN, which uses AVX-512 BF16) on [32, 1536] x [17920, 1536].
 *
 * y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); x, w, b, y bf16 as uint16_t, row-major contiguous.
 * Arithmetic: each product of two bf16 values is exact in fp32; vdpbf16ps adds the pair's two
 * products and the running sum in fp32 (round to nearest even; denormal inputs and results
 * flushed to zero, which no bf16 weight or activation of a real model comes near); the bias is
 * added in fp32 and the result rounded once to bf16. So only the summation order (and the
 * flushing) differs from torch's bf16 F.linear: within one bf16 step of the fp32 product.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

/* A tile: NR weight rows x MR activation rows, NR * MR accumulators (of the 32 registers; a
 * multiple of 4, reduced four at a time). 3 x 8 against 4 x 4 on the Zen 4 machine (2 threads,
 * [rows, 1536] x [151936, 1536], ms): 8 rows 22.9 -> 16.6 (the weights stream past once, not
 * twice), 16 rows 32.7 -> 31.4, 32 rows 52.1 -> 49.7; 6 x 4 was level with 3 x 8 from 16 rows on
 * and slower below. */
#ifndef NR
#define NR 3
#endif
#ifndef MR
#define MR 8
#endif
_Static_assert(NR * MR % 4 == 0 && NR * MR + NR + 1 <= 32, "tile: accumulators in fours, all in registers");
#define NR1 8 /* weight rows in flight for one activation row (decode of one sequence) */
#define MB 64 /* activation rows per block: MB x K bf16 stays in L2 while the weights stream past */
/*
 * PREFETCH: while a thread computes with some weight rows it requests the next ones into L2
 * (_MM_HINT_T1), one cache line per row and 32-element step. The hardware prefetchers alone fetch
 * only as far ahead as the loads run, so each new set of rows waited on memory; with several
 * activation rows the next rows are also not needed until the whole row tile loop is done, time
 * enough to bring them in. Measured on the Zen 4 machine of docs/benchmarks.md (2 threads, ms,
 * before -> after): [1, 1536] x [151936, 1536] 12.9 -> 10.6; 2 rows 20.9 -> 12.8; 8 rows
 * 27.0 -> 21.8; 16 rows 36.8 -> 31.5; 32 rows 57.3 -> 51.8 (torch's oneDNN: 55.4 at 32 rows).
 */

static inline __m512bh load32(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }

/* The sums of four accumulators' lanes, as one vector: fewer shuffles than four reductions. */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* per 128-bit lane: [a0 0+2, a1 0+2, a0 1+3, a1 1+3], then the same for a2, a3 */
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* per 128-bit lane: [a0, a1, a2, a3] partial sums; then the four lanes added */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* f rounded to bf16 (nearest even; NaN: torch's one quiet NaN, 0x7fc0), in the upper half of
 * each 32-bit lane (the lower half: carry bits) */
static inline __m512i bf16_upper(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

static inline __m256i f32x16_bf16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_upper(f), 16));
}

#define LOG2E 1.44269504088896341f

/* 2^x (x >= -126 taken as -126), a degree-6 polynomial of the fraction: within ~1e-7 relative */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    /* 2^f = e^(f ln 2): Taylor terms (ln 2)^k / k! */
    __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The last, partial chunk of a weight row: lanes past K read as zero (and are never touched). */
static inline __m512bh load32_masked(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)p);
}

/* Dot products of NR weight rows with MR activation rows (xp: MR rows of Kp, zero past K). With
 * `next` (the first row of the next NR weight rows, contiguous) those rows are requested into L2
 * meanwhile, a cache line of each on the steps k / 32 = phase (mod period): see PREFETCH. */
static inline void tile(const uint16_t *const w[NR], const uint16_t *xp, int64_t K, int64_t Kp, float out[NR][MR],
                        const uint16_t *next, int64_t phase, int64_t period) {
    const int64_t kfull = K & ~(int64_t)31;
    __m512 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_ps();
    int64_t prefetch_k = next ? 32 * phase : K; /* the next step that requests lines of `next` */
    for (int64_t k = 0; k < kfull; k += 32) {
        __m512bh wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = load32(w[r] + k);
        if (k == prefetch_k) {
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T1);
            prefetch_k += 32 * period;
        }
        for (int m = 0; m < MR; m++) {
            const __m512bh xv = load32(xp + m * Kp + k);
            for (int r = 0; r < NR; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    if (kfull < K) {
        const __mmask32 mask = (__mmask32)((1u << (K - kfull)) - 1u);
        __m512bh wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = load32_masked(w[r] + kfull, mask);
        for (int m = 0; m < MR; m++) {
            const __m512bh xv = load32(xp + m * Kp + kfull);
            for (int r = 0; r < NR; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    /* out and acc are both NR x MR, row-major: reduced four accumulators at a time */
    const __m512 *a = &acc[0][0];
    float *o = &out[0][0];
    for (int i = 0; i < NR * MR; i += 4) _mm_storeu_ps(o + i, reduce4(a[i], a[i + 1], a[i + 2], a[i + 3]));
}

/* One activation row: NR1 weight rows streamed at once keep enough loads in flight to run at
 * memory bandwidth. xp: one row of Kp, zero past K. */
static void linear_row(const uint16_t *xp, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t N, int64_t K) {
    const int64_t kfull = K & ~(int64_t)31;
    const __mmask32 mask = (__mmask32)((1u << (K - kfull)) - 1u);
    const int64_t tiles = (N + NR1 - 1) / NR1;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR1;
        const int nr = (int)(N - n0 < NR1 ? N - n0 : NR1);
        const uint16_t *wr[NR1];
        /* rows past N (last tile) repeat the last row: computed, never stored */
        for (int r = 0; r < NR1; r++) wr[r] = w + (n0 + (r < nr ? r : nr - 1)) * K;
        __m512 acc[NR1];
        for (int r = 0; r < NR1; r++) acc[r] = _mm512_setzero_ps();
        const uint16_t *next = n0 + 2 * NR1 <= N ? w + (n0 + NR1) * K : NULL; /* see PREFETCH */
        for (int64_t k = 0; k < kfull; k += 32) {
            const __m512bh xv = load32(xp + k);
            if (next)
                for (int r = 0; r < NR1; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T1);
            for (int r = 0; r < NR1; r++) acc[r] = _mm512_dpbf16_ps(acc[r], load32(wr[r] + k), xv);
        }
        if (kfull < K) {
            const __m512bh xv = load32(xp + kfull);
            for (int r = 0; r < NR1; r++) acc[r] = _mm512_dpbf16_ps(acc[r], load32_masked(wr[r] + kfull, mask), xv);
        }
        float s[NR1];
        _mm_storeu_ps(s, reduce4(acc[0], acc[1], acc[2], acc[3]));
        _mm_storeu_ps(s + 4, reduce4(acc[4], acc[5], acc[6], acc[7]));
        for (int r = 0; r < nr; r++) y[n0 + r] = f32_to_bf16(s[r] + (b ? bf16_to_f32(b[n0 + r]) : 0.0f));
    }
}

void vlm_linear_bf16_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                            int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    /* x copied once into rows of Kp (K rounded up to 32), zero-padded, and MR-row padding at the
     * end: the inner loops then need no masks on x and no partial tiles of rows. */
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    const int64_t Mp = (M + MR - 1) / MR * MR;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, (size_t)(Mp * Kp * sizeof(uint16_t)));
    memset(xp, 0, (size_t)(Mp * Kp * sizeof(uint16_t)));
    for (int64_t m = 0; m < M; m++) memcpy(xp + m * Kp, x + m * K, (size_t)(K * sizeof(uint16_t)));
    if (M == 1) {
        linear_row(xp, w, b, y, N, K);
        free(xp);
        return;
    }
    const int64_t tiles = (N + NR - 1) / NR;
    for (int64_t mb = 0; mb < M; mb += MB) {
        const int64_t mend = mb + MB < M ? mb + MB : M;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            const uint16_t *wr[NR];
            for (int r = 0; r < NR; r++) wr[r] = w + (n0 + (r < nr ? r : nr - 1)) * K;
            float bias[NR] = {0};
            if (b)
                for (int r = 0; r < nr; r++) bias[r] = bf16_to_f32(b[n0 + r]);
            for (int64_t m0 = mb; m0 < mend; m0 += MR) {
                const int mr = (int)(mend - m0 < MR ? mend - m0 : MR);
                float out[NR][MR];
                /* the next weight rows requested once, spread over the row tiles: the i-th of
                 * `tiles_m` requests every tiles_m-th line from the i-th on. All of them in the
                 * first row tile (before) asked for too many lines at once. On the Zen 4 machine,
                 * 2 threads, x [151936, 1536]: 32 rows 49.3 -> 47.8 ms (torch 49.5), 16 rows
                 * 30.2 -> 29.4; x [17920, 1536]: 32 rows 5.64 -> 5.38; 8 rows (one row tile) level. */
                const uint16_t *next = n0 + 2 * NR <= N ? w + (n0 + NR) * K : NULL;
                const int64_t tiles_m = (mend - mb + MR - 1) / MR;
                tile(wr, xp + m0 * Kp, K, Kp, out, next, (m0 - mb) / MR, tiles_m);
                for (int m = 0; m < mr; m++)
                    for (int r = 0; r < nr; r++) y[(m0 + m) * N + n0 + r] = f32_to_bf16(out[r][m] + bias[r]);
            }
        }
    }
    free(xp);
}

/*
 * Paged decode attention, bf16, with AVX-512 BF16: the same contract as vlm_decode_attention in
 * cpu_linear.c (one query token per sequence over its seq_len cached tokens, read in place by
 * block table; online softmax in fp32, chunks of ATT_CHUNK tokens; query head h reads KV head
 * h / group), for head_dim a multiple of 32 (<= ATT_MAX_DIM) and bf16 throughout. What differs:
 * - scores: each K row is read as bf16 and multiplied with the group's unscaled bf16 query rows by
 *   vdpbf16ps (exact products, fp32 sums), times `scale` once in fp32 (the AVX2 kernel scales the
 *   query in fp32 first and widens every K row);
 * - the weighted sum: the chunk's V rows are widened to fp32 once, then each head adds its weights
 *   times them 32 elements at a time with its sums in registers across the chunk (the AVX2 kernel
 *   loads and stores every head's sums per token).
 * Measured on the Zen 4 machine (2 threads, 32 sequences x 450 tokens, 12 heads, 2 KV heads,
 * head_dim 128, through ctypes): 1.30 ms, the AVX2 kernel 1.85 ms. (The sums across a chunk were
 * first one chain per 16 lanes: FMA latency made that slower than the AVX2 kernel, 3.6 ms.)
 */
#include <math.h>

#define ATT_CHUNK 32
#define ATT_MAX_GROUP 16
#define ATT_MAX_DIM 256

/* q_stride: elements from one sequence's query row to the next (its heads contiguous) */
static void decode_attention_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                                    const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out,
                                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t v_offset = num_blocks * block_size * token_stride;
    const int64_t row_bytes = head_dim * 2;
    const float scale2 = scale * LOG2E;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            float acc[ATT_MAX_GROUP][ATT_MAX_DIM] __attribute__((aligned(64)));
            float vf[ATT_CHUNK][ATT_MAX_DIM] __attribute__((aligned(64)));
            float p[ATT_MAX_GROUP][ATT_CHUNK], m[ATT_MAX_GROUP], l[ATT_MAX_GROUP], corr[ATT_MAX_GROUP];
            int64_t rows[ATT_CHUNK];
            const uint16_t *qs = q + s * q_stride + kvh * group * head_dim; /* the group's rows */
            for (int64_t g = 0; g < group; g++) {
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            const int64_t len = seq_lens[s];
            for (int64_t t0 = 0; t0 < len; t0 += ATT_CHUNK) {
                const int64_t n = len - t0 < ATT_CHUNK ? len - t0 : ATT_CHUNK;
                /* this chunk's rows, and the next chunk's requested meanwhile (the first chunk's
                 * too): in a decode step the cache comes from memory, each layer's weights having
                 * streamed past it; requested only as they are needed, the 2B's 400-token
                 * attention took ~100 us a layer inside the fused decode against ~55 on its own */
                const int64_t ahead_end = t0 + 2 * ATT_CHUNK < len ? t0 + 2 * ATT_CHUNK : len;
                for (int64_t t = t0 == 0 ? 0 : t0 + ATT_CHUNK; t < ahead_end; t++) {
                    const int64_t block = block_tables[s * max_blocks + t / block_size];
                    const int64_t row = ((block * block_size) + t % block_size) * token_stride + kvh * head_dim;
                    const char *k_row = (const char *)(cache + row), *v_row = (const char *)(cache + v_offset + row);
                    for (int64_t b = 0; b < row_bytes; b += 64) {
                        _mm_prefetch(k_row + b, _MM_HINT_T0);
                        _mm_prefetch(v_row + b, _MM_HINT_T1);
                    }
                }
                for (int64_t j = 0; j < n; j++) {
                    const int64_t t = t0 + j;
                    const int64_t block = block_tables[s * max_blocks + t / block_size];
                    rows[j] = ((block * block_size) + t % block_size) * token_stride + kvh * head_dim;
                }
                /* scores: every head of the group against each K row, read once as bf16; four
                 * heads at a time (independent sums, reduced together) */
                for (int64_t j = 0; j < n; j++) {
                    const uint16_t *k_row = cache + rows[j];
                    for (int64_t g0 = 0; g0 < group; g0 += 4) {
                        __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                        const int64_t ng = group - g0 < 4 ? group - g0 : 4;
                        for (int64_t d = 0; d < head_dim; d += 32) {
                            const __m512bh kv = load32(k_row + d);
                            for (int64_t i = 0; i < ng; i++)
                                dot[i] = _mm512_dpbf16_ps(dot[i], load32(qs + (g0 + i) * head_dim + d), kv);
                        }
                        float four[4];
                        _mm_storeu_ps(four, reduce4(dot[0], dot[1], dot[2], dot[3]));
                        for (int64_t i = 0; i < ng; i++) p[g0 + i][j] = four[i] * scale2;
                    }
                }
                /* online softmax, once per chunk, in base 2 (the scores carry scale log2 e), a head's
                 * 32 scores as two vectors; the rescaling of the sums is applied below */
                const __mmask16 lo = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
                const __mmask16 hi = n >= 32 ? (__mmask16)0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
                for (int64_t g = 0; g < group; g++) {
                    __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lo, p[g]);
                    __m512 b = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), hi, p[g] + 16);
                    const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
                    const float m_new = chunk_max > m[g] ? chunk_max : m[g];
                    corr[g] = exp2f(m[g] - m_new);
                    const __m512 mn = _mm512_set1_ps(m_new);
                    a = _mm512_maskz_mov_ps(lo, exp2_ps(_mm512_sub_ps(a, mn)));
                    b = _mm512_maskz_mov_ps(hi, exp2_ps(_mm512_sub_ps(b, mn)));
                    _mm512_storeu_ps(p[g], a);
                    _mm512_storeu_ps(p[g] + 16, b);
                    l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(_mm512_add_ps(a, b));
                    m[g] = m_new;
                }
                /* the chunk's V rows widened to fp32 once */
                for (int64_t j = 0; j < n; j++) {
                    const uint16_t *v_row = cache + v_offset + rows[j];
                    for (int64_t d = 0; d < head_dim; d += 16) _mm512_store_ps(vf[j] + d, bf16x16_f32(v_row + d));
                }
                /* acc = acc * correction + p V, 32 elements of a head at a time held in registers,
                 * tokens four ways apart (eight independent sums: FMA latency, not a chain) */
                for (int64_t g = 0; g < group; g++) {
                    const __m512 c = _mm512_set1_ps(corr[g]);
                    for (int64_t d = 0; d < head_dim; d += 32) {
                        __m512 lo[4], hi[4];
                        lo[0] = _mm512_mul_ps(_mm512_load_ps(acc[g] + d), c);
                        hi[0] = _mm512_mul_ps(_mm512_load_ps(acc[g] + d + 16), c);
                        for (int i = 1; i < 4; i++) lo[i] = hi[i] = _mm512_setzero_ps();
                        int64_t j = 0;
                        for (; j + 4 <= n; j += 4)
                            for (int i = 0; i < 4; i++) {
                                const __m512 pj = _mm512_set1_ps(p[g][j + i]);
                                lo[i] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j + i] + d), lo[i]);
                                hi[i] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j + i] + d + 16), hi[i]);
                            }
                        for (; j < n; j++) {
                            const __m512 pj = _mm512_set1_ps(p[g][j]);
                            lo[0] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j] + d), lo[0]);
                            hi[0] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j] + d + 16), hi[0]);
                        }
                        _mm512_store_ps(acc[g] + d, _mm512_add_ps(_mm512_add_ps(lo[0], lo[1]), _mm512_add_ps(lo[2], lo[3])));
                        _mm512_store_ps(acc[g] + d + 16, _mm512_add_ps(_mm512_add_ps(hi[0], hi[1]), _mm512_add_ps(hi[2], hi[3])));
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                uint16_t *o = out + (s * num_heads + kvh * group + g) * head_dim;
                const float inv = 1.0f / l[g];
                for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[g][d] * inv);
            }
        }
    }
}

void vlm_decode_attention_avx512(const uint16_t *q, const uint16_t *cache, const int64_t *block_tables,
                                 const int64_t *seq_lens, uint16_t *out, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                 int64_t max_blocks, float scale) {
    decode_attention_avx512(q, num_heads * head_dim, cache, block_tables, seq_lens, out, num_seqs, num_heads,
                            num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale);
}

/*
 * Prefill attention (flash attention: scores, softmax and the weighted sum of V block by block,
 * never the whole [q_len, kv_len] matrix) with AVX-512 BF16: both products by vdpbf16ps. K and V
 * are first packed per KV head so that one 64-byte load feeds a product: K as [key block][d pair]
 * [FK keys][2] (a query's two dims broadcast against 16 keys' same two dims), V as [key block]
 * [key pair][d][2] (a row's two probabilities broadcast against two keys' values of 16 dims).
 * Arithmetic, as torch's CPU flash kernel for bf16: q.k exact products summed in fp32, the
 * softmax in fp32 with its sum over the fp32 probabilities, the probabilities rounded to bf16
 * for the product with V (fp32 sums), the output divided by the sum and rounded once to bf16.
 * exp is 2^x of the scores scaled by log2(e): a degree-6 polynomial on [-0.5, 0.5] and vscalefps
 * (relative error ~1.2e-7, far below the bf16 rounding of the probabilities).
 *
 * The softmax of a block reduces the 8 rows' maxima and sums together (reduce8) and rescales by
 * one vector exp, not 8 horizontal reductions of 4 steps and a scalar exp2f per row and block;
 * blocks of 128 keys, not 64, halve the rescaling of the partial outputs; the scale is folded
 * into the exponent's fmsub. Alone the softmax took ~3.2 ms of the 2B vision call's ~20 (2
 * threads, Zen 4): it was latency, not arithmetic.
 */
#define FQ 8   /* query rows per tile: the softmax reduces them together (reduce8) */
#define FK 128 /* keys per block */
#define FV (FK / 16)
_Static_assert(FQ == 8 && FK % 64 == 0, "reduce8 takes 8 rows; qk4 scores 64 keys at a time");
#define FD_MAX 256
static inline __attribute__((always_inline)) __m512 combine(__m512 a, __m512 b, const int add) {
    return add ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b);
}

/* The 16 lanes of each of 8 vectors reduced (sum or max) at once: out[0] holds rows 0-3, out[1]
 * rows 4-7, row r's result in all four lanes of 128-bit lane r % 4 (lane_of picks it out). */
static inline __attribute__((always_inline)) void reduce8(const __m512 v[8], __m512 out[2], const int add) {
    __m512 t[4];
    for (int i = 0; i < 4; i++) /* [a lanes 0, 1 | b lanes 0, 1] with [a 2, 3 | b 2, 3]: 8 each */
        t[i] = combine(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                       _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE), add);
    for (int i = 0; i < 2; i++) { /* 4 each, one row per 128-bit lane; then within lanes */
        __m512 u = combine(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD), add);
        u = combine(u, _mm512_permute_ps(u, 0x4E), add);
        out[i] = combine(u, _mm512_permute_ps(u, 0xB1), add);
    }
}

static inline __m512 lane_of(const __m512 v[2], int r) {
    return _mm512_permutexvar_ps(_mm512_set1_epi32(4 * (r % 4)), v[r / 4]);
}

/* unscaled scores of 4 query rows (pairs of dims as uint32) against 64 packed keys (a block's
 * rows of FK: sstride) */
static inline __attribute__((always_inline)) void qk4(const uint32_t *q0, int64_t qstride, const uint16_t *kb,
                                                      int64_t dpairs, float *s, int64_t sstride) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < dpairs; dp++) {
        const uint16_t *kp = kb + dp * FK * 2;
        __m512bh k0 = (__m512bh)_mm512_load_si512(kp), k1 = (__m512bh)_mm512_load_si512(kp + 32);
        __m512bh k2 = (__m512bh)_mm512_load_si512(kp + 64), k3 = (__m512bh)_mm512_load_si512(kp + 96);
        for (int r = 0; r < 4; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q0[r * qstride + dp]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(s + r * sstride + c * 16, acc[r][c]);
}

/* o[r][d0 .. d0 + 16 NC) = o * alpha[r] + sum over the block's key pairs of p pair x v pair, 4 rows;
 * NC <= 5 (20 sums, 5 values and a broadcast in registers) */
static inline __attribute__((always_inline)) void pv4(const uint32_t *p0, const uint16_t *vb, int64_t dim,
                                                      int64_t d0, float *o0, const float *alpha, const int NC) {
    __m512 acc[4][5];
    for (int r = 0; r < 4; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o0 + r * FD_MAX + d0 + c * 16), a);
    }
    for (int64_t t = 0; t < FK / 2; t++) {
        const uint16_t *vp = vb + (t * dim + d0) * 2;
        __m512bh v[5];
        for (int c = 0; c < NC; c++) v[c] = (__m512bh)_mm512_load_si512(vp + c * 32);
        for (int r = 0; r < 4; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p0[r * (FK / 2) + t]);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(o0 + r * FD_MAX + d0 + c * 16, acc[r][c]);
}

/*
 * out[i, h] = softmax(scale q[i, h] . k[j, g]) v[j, g] over keys j (g = h's KV head; with
 * causal_offset >= 0 only j <= causal_offset + i). q [q_len, num_heads, dim], k and v
 * [kv_len, num_kv_heads, dim], out [q_len, num_heads, dim], bf16; each with its own stride
 * between tokens (in elements), heads contiguous. dim even, at most 256 (V is packed with dims
 * rounded up to 16: zeros past dim). Returns 0, or -1 (nothing done) when the packed K and V
 * find no memory.
 */
int vlm_prefill_attention_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                  int64_t q_len, int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                  int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t out_stride,
                                  float scale, int64_t causal_offset) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t nkb = (kv_len + FK - 1) / FK;
    const int64_t dimp = (dim + 15) / 16 * 16;
    const int64_t k_elems = FK * dim, v_elems = FK * dimp; /* per packed block */
    uint16_t *kp = aligned_alloc(64, (size_t)(num_kv_heads * nkb * k_elems * 2));
    uint16_t *vp = aligned_alloc(64, (size_t)(num_kv_heads * nkb * v_elems * 2));
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -1;
    }
    const int64_t nqt = (q_len + FQ - 1) / FQ;
    const float scale2 = scale * LOG2E;
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t b = 0; b < nkb; b++) {
                /* as 32-bit words: K's (dim 2i, 2i + 1) of each key, V's (key 2t, 2t + 1) of each dim
                 * (element by element this took 1.0 ms of the 2B vision call, word by word 0.65) */
                uint32_t *kd = (uint32_t *)(kp + (g * nkb + b) * k_elems);
                uint32_t *vd = (uint32_t *)(vp + (g * nkb + b) * v_elems);
                for (int64_t jj = 0; jj < FK; jj++) {
                    const int64_t j = b * FK + jj;
                    for (int64_t i = 0; i < dim / 2; i++) {
                        uint32_t pair = 0;
                        if (j < kv_len) memcpy(&pair, k + j * k_stride + g * dim + 2 * i, 4);
                        kd[i * FK + jj] = pair;
                    }
                }
                for (int64_t t = 0; t < FK / 2; t++) {
                    const int64_t j = b * FK + 2 * t;
                    uint32_t *row = vd + t * dimp;
                    for (int64_t d = 0; d < dimp; d++) row[d] = 0;
                    if (j < kv_len) {
                        const uint16_t *v0 = v + j * v_stride + g * dim;
                        for (int64_t d = 0; d < dim; d++) row[d] = v0[d];
                    }
                    if (j + 1 < kv_len) {
                        const uint16_t *v1 = v + (j + 1) * v_stride + g * dim;
                        for (int64_t d = 0; d < dim; d++) row[d] |= (uint32_t)v1[d] << 16;
                    }
                }
            }
        /* tiles longest first (causal: the last query rows see the most keys) */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t ti = 0; ti < nqt; ti++)
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t i0 = (nqt - 1 - ti) * FQ, g = h / group;
                uint32_t qt[FQ][FD_MAX / 2] __attribute__((aligned(64)));
                float s[FQ][FK] __attribute__((aligned(64)));
                uint32_t pb[FQ][FK / 2] __attribute__((aligned(64)));
                float o[FQ][FD_MAX] __attribute__((aligned(64)));
                float alpha[FQ], scratch[32] __attribute__((aligned(64)));
                for (int r = 0; r < FQ; r++) {
                    const int64_t i = i0 + r < q_len ? i0 + r : q_len - 1;
                    memcpy(qt[r], q + i * q_stride + h * dim, (size_t)dim * 2);
                    for (int64_t d = 0; d < dimp; d++) o[r][d] = 0.0f;
                }
                /* each row's running maximum (of scaled scores) and sum, laid out as reduce8's */
                __m512 m[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
                __m512 l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                const __m512 sc2 = _mm512_set1_ps(scale2);
                int64_t last = kv_len; /* keys this tile needs: [0, last) */
                if (causal_offset >= 0) {
                    const int64_t seen = causal_offset + (i0 + FQ < q_len ? i0 + FQ : q_len);
                    last = seen < kv_len ? seen : kv_len;
                }
                for (int64_t b = 0; b * FK < last; b++) {
                    const uint16_t *kb = kp + (g * nkb + b) * k_elems, *vb = vp + (g * nkb + b) * v_elems;
                    for (int half = 0; half < FK / 64; half++) {
                        qk4(qt[0], FD_MAX / 2, kb + half * 128, dim / 2, s[0] + half * 64, FK);
                        qk4(qt[4], FD_MAX / 2, kb + half * 128, dim / 2, s[4] + half * 64, FK);
                    }
                    /* keys past the end, or (causal) past a row's position, are masked */
                    int64_t visible[FQ];
                    int all_visible = 1;
                    for (int r = 0; r < FQ; r++) {
                        visible[r] = kv_len - b * FK;
                        if (causal_offset >= 0) {
                            const int64_t row = i0 + r < q_len ? i0 + r : q_len - 1;
                            const int64_t v_row = causal_offset + row + 1 - b * FK;
                            visible[r] = v_row < visible[r] ? v_row : visible[r];
                        }
                        all_visible &= visible[r] >= FK;
                    }
                    __m512 v8[FQ];
                    for (int r = 0; r < FQ; r++) { /* each row's maximum, 16 lanes */
                        __m512 mx = _mm512_set1_ps(-INFINITY);
                        for (int c = 0; c < FV; c++) {
                            const int64_t n = visible[r] - c * 16;
                            const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                            mx = _mm512_mask_max_ps(mx, keep, mx, _mm512_load_ps(s[r] + c * 16));
                        }
                        v8[r] = mx;
                    }
                    __m512 block_max[2], alpha2[2];
                    reduce8(v8, block_max, 0);
                    for (int i = 0; i < 2; i++) {
                        /* a fully masked row keeps its maximum (every row sees key 0, in block 0); in
                         * block 0, alpha is 0 by the mask, not by what vscalefps makes of -inf - -inf */
                        const __m512 m_new = _mm512_max_ps(m[i], _mm512_mul_ps(block_max[i], sc2));
                        const __mmask16 seen = _mm512_cmp_ps_mask(m[i], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                        alpha2[i] = _mm512_maskz_mov_ps(seen, exp2_ps(_mm512_sub_ps(m[i], m_new)));
                        m[i] = m_new;
                        _mm512_store_ps(scratch + 16 * i, alpha2[i]);
                    }
                    for (int r = 0; r < FQ; r++) alpha[r] = scratch[4 * r];
                    for (int r = 0; r < FQ; r++) {
                        const __m512 mn = lane_of(m, r);
                        __m512 p[FV], sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
                        for (int c = 0; c < FV; c++) {
                            p[c] = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(s[r] + c * 16), sc2, mn));
                            if (!all_visible) {
                                const int64_t n = visible[r] - c * 16;
                                const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                                p[c] = _mm512_maskz_mov_ps(keep, p[c]);
                            }
                            if (c % 2) sum1 = _mm512_add_ps(sum1, p[c]);
                            else sum = _mm512_add_ps(sum, p[c]);
                        }
                        v8[r] = _mm512_add_ps(sum, sum1);
                        for (int c = 0; c < FV; c += 2)
                            _mm512_store_si512(pb[r] + c * 8, (__m512i)_mm512_cvtne2ps_pbh(p[c + 1], p[c]));
                    }
                    __m512 block_sum[2];
                    reduce8(v8, block_sum, 1);
                    for (int i = 0; i < 2; i++) l[i] = _mm512_fmadd_ps(l[i], alpha2[i], block_sum[i]);
                    /* dims 16 x NC at a time, 4 groups per pass but 5 for the last 5 (head_dim 80:
                     * one pass, not 4 + 1; the 2B's vision attention 2-3 % faster) */
                    for (int r0 = 0; r0 < FQ; r0 += 4)
                        for (int64_t d0 = 0; d0 < dimp;) {
                            const int64_t groups = (dimp - d0) / 16;
                            switch (groups == 5 ? 5 : groups < 4 ? groups : 4) {
                            case 5: pv4(pb[r0], vb, dimp, d0, o[r0], alpha + r0, 5); d0 += 80; break;
                            case 4: pv4(pb[r0], vb, dimp, d0, o[r0], alpha + r0, 4); d0 += 64; break;
                            case 3: pv4(pb[r0], vb, dimp, d0, o[r0], alpha + r0, 3); d0 += 48; break;
                            case 2: pv4(pb[r0], vb, dimp, d0, o[r0], alpha + r0, 2); d0 += 32; break;
                            default: pv4(pb[r0], vb, dimp, d0, o[r0], alpha + r0, 1); d0 += 16; break;
                            }
                        }
                }
                _mm512_store_ps(scratch, l[0]);
                _mm512_store_ps(scratch + 16, l[1]);
                for (int r = 0; r < FQ && i0 + r < q_len; r++) {
                    uint16_t *orow = out + (i0 + r) * out_stride + h * dim;
                    const float inv = 1.0f / scratch[4 * r];
                    const __m512 iv = _mm512_set1_ps(inv);
                    int64_t d = 0;
                    for (; d + 16 <= dim; d += 16)
                        _mm256_storeu_si256((__m256i *)(orow + d), f32x16_bf16(_mm512_mul_ps(_mm512_load_ps(o[r] + d), iv)));
                    for (; d < dim; d++) orow[d] = f32_to_bf16(o[r][d] * inv);
                }
            }
    }
    free(kp);
    free(vp);
    return 0;
}

/*
 * Activations between an MLP's two products, bf16, rounding where torch's bf16 ops round (each
 * op's fp32 result to bf16, nearest even): kind 0 quick_gelu, x * bf16(sigmoid(bf16(1.702 x)))
 * (the vision towers); kind 1 SwiGLU on rows [gate | up] of 2n, bf16(silu(gate)) * up. torch runs
 * them as 2-3 ops over the whole [rows, n] tensor, each a pass through memory. exp by exp2_ps:
 * the fp32 results may differ from torch's by an ulp or so, which the rounding to bf16 hides but
 * for a value within that of a rounding boundary.
 */
/* f rounded to bf16 and widened back: the low half cleared, no narrowing and widening (the
 * activations' intermediate roundings; vpmovdw alone is two operations on Zen 4) */
static inline __m512 round_bf16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_upper(f), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __m512 load_bf16_masked(const uint16_t *p, __mmask16 mask) {
    const __m256i v = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)mask, p)); /* AVX-512 BW, not VL */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

void vlm_activation_bf16_avx512(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int64_t x_stride,
                                int64_t kind) {
    const __m512 one = _mm512_set1_ps(1.0f), neg_log2e = _mm512_set1_ps(-LOG2E);
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t m = 0; m < rows; m++) {
        const uint16_t *xr = x + m * x_stride;
        uint16_t *orow = out + m * n;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 a = load_bf16_masked(xr + j, mask);
            __m512 y;
            if (kind == 0) {
                const __m512 t = round_bf16(_mm512_mul_ps(a, _mm512_set1_ps(1.702f)));
                const __m512 s = round_bf16(_mm512_div_ps(one, _mm512_add_ps(one, exp2_ps(_mm512_mul_ps(t, neg_log2e)))));
                y = _mm512_mul_ps(a, s);
            } else {
                const __m512 s = round_bf16(_mm512_div_ps(a, _mm512_add_ps(one, exp2_ps(_mm512_mul_ps(a, neg_log2e)))));
                y = _mm512_mul_ps(s, load_bf16_masked(xr + n + j, mask));
            }
            _mm512_mask_storeu_epi16(orow + j, (__mmask32)mask, _mm512_castsi256_si512(f32x16_bf16(y)));
        }
    }
}

/*
 * vlm_rotary_qk_bf16 (cpu_linear.c) 16 lanes at a time: the same products and sums, rounded in
 * the same places (cos_bf16: each product to bf16, as torch's bf16 ops; else fp32 throughout and
 * one rounding at the end), so the same results bit for bit (a NaN as torch's 0x7fc0). Built without FMA contraction
 * (-std=c11): each product rounds before the sum, as torch's separate ops do. Qwen2-VL-2B's
 * vision rotary ([1024, 16 + 16 heads, 80], fp32 cos/sin) took 1.6 ms a layer in the scalar loop.
 */
static inline __m512 load_table(const void *p, int64_t i, __mmask16 mask, int bf16) {
    return bf16 ? load_bf16_masked((const uint16_t *)p + i, mask) : _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

static void rotate_heads_avx512(uint16_t *x, const void *c, const void *s, int64_t heads, int64_t D, int bf16) {
    const int64_t half = D / 2;
    for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 mask = half - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - j)) - 1);
        const __m512 c0 = load_table(c, j, mask, bf16), s0 = load_table(s, j, mask, bf16);
        const __m512 c1 = load_table(c, j + half, mask, bf16), s1 = load_table(s, j + half, mask, bf16);
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *lo = x + h * D + j, *hi = lo + half;
            const __m512 a = load_bf16_masked(lo, mask), b = load_bf16_masked(hi, mask);
            __m512 a_c = _mm512_mul_ps(a, c0), b_s = _mm512_mul_ps(b, s0);
            __m512 b_c = _mm512_mul_ps(b, c1), a_s = _mm512_mul_ps(a, s1);
            if (bf16) {
                a_c = round_bf16(a_c), b_s = round_bf16(b_s), b_c = round_bf16(b_c), a_s = round_bf16(a_s);
            }
            /* a c - b s: the scalar kernel's a c + (-b) s, equal in IEEE arithmetic */
            _mm512_mask_storeu_epi16(lo, (__mmask32)mask, _mm512_castsi256_si512(f32x16_bf16(_mm512_sub_ps(a_c, b_s))));
            _mm512_mask_storeu_epi16(hi, (__mmask32)mask, _mm512_castsi256_si512(f32x16_bf16(_mm512_add_ps(b_c, a_s))));
        }
    }
}

void vlm_rotary_qk_avx512(uint16_t *q, uint16_t *k, int64_t q_stride, int64_t k_stride, const void *cos,
                          const void *sin, int64_t M, int64_t nq, int64_t nk, int64_t D, int64_t cos_bf16) {
    rotary_tokens(rotate_heads_avx512, q, k, q_stride, k_stride, cos, sin, M, nq, nk, D, cos_bf16);
}

/*
 * y[M, N] = x[M, K] w^T (+ b[N]), bf16, with w in the layout oneDNN reorders bf16 linear weights
 * into (models/prepack.py): blocks of 64 output rows, each [K / 2][64][2], i.e. element (n, k) at
 * (n / 64) 64 K + (k / 2) 128 + (n % 64) 2 + k % 2 (N a multiple of 64, K even; prepack.py checks
 * the layout on the machine before it uses this). So one weight matrix serves both oneDNN's
 * prefill products (no reorder per call) and these few-row products: for each pair of k, one
 * 64-byte load holds 16 outputs' pairs, and one vdpbf16ps adds x's broadcast pair times them into
 * 16 fp32 sums (no horizontal sums at the end, and the weights stream from memory in order).
 * Arithmetic as vlm_linear_bf16_avx512: exact products, fp32 sums (in another order), the bias
 * added in fp32, one rounding to bf16. x [M, K] contiguous.
 */
#define PMR 6    /* activation rows per pass: 4 x PMR sums, 4 weight vectors and a broadcast */
#define PKC 512  /* pairs of k per chunk when rows take several passes: the block's chunk stays in L2 */

static inline __attribute__((always_inline)) void packed_rows(const uint32_t *x32, int64_t kpairs_x,
                                                              const uint16_t *wb, int64_t kp0, int64_t kp1,
                                                              float *sums, const int mr) {
    __m512 acc[PMR][4];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_load_ps(sums + r * 64 + c * 16);
    for (int64_t kp = kp0; kp < kp1; kp++) {
        const uint16_t *wp = wb + kp * 128;
        const __m512bh w0 = (__m512bh)_mm512_load_si512(wp), w1 = (__m512bh)_mm512_load_si512(wp + 32);
        const __m512bh w2 = (__m512bh)_mm512_load_si512(wp + 64), w3 = (__m512bh)_mm512_load_si512(wp + 96);
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x32[r * kpairs_x + kp]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(sums + r * 64 + c * 16, acc[r][c]);
}

/* The product on a thread team's sums (omp_get_max_threads() x packed_sums_floats(M) floats,
 * 64-byte aligned); the shape and alignment checked by the caller. */
static inline int64_t packed_sums_floats(int64_t M) { return M * 64 + 64; }

static void packed_product(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                           int64_t K, float *sums) {
    const int64_t kpairs = K / 2, blocks = N / 64;
    const uint32_t *x32 = (const uint32_t *)x; /* K even: row m's pair kp is x32[m K / 2 + kp] */
    const int64_t chunk = M <= PMR ? kpairs : PKC;
#pragma omp parallel
    {
        /* each thread's sums of one block: M rows x 64 (the loads and stores of a pass's 4 x PMR) */
        float *s = sums + (int64_t)omp_get_thread_num() * packed_sums_floats(M);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint16_t *wb = w + nb * 64 * K;
            for (int64_t i = 0; i < M * 64; i++) s[i] = 0.0f;
            for (int64_t kp0 = 0; kp0 < kpairs; kp0 += chunk) {
                const int64_t kp1 = kp0 + chunk < kpairs ? kp0 + chunk : kpairs;
                for (int64_t m0 = 0; m0 < M; m0 += PMR) {
                    const uint32_t *xr = x32 + m0 * kpairs;
                    float *sr = s + m0 * 64;
                    switch (M - m0 < PMR ? M - m0 : PMR) {
                    case 1: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 1); break;
                    case 2: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 2); break;
                    case 3: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 3); break;
                    case 4: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 4); break;
                    case 5: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 5); break;
                    default: packed_rows(xr, kpairs, wb, kp0, kp1, sr, 6); break;
                    }
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int c = 0; c < 4; c++) {
                    const int64_t n0 = nb * 64 + c * 16;
                    __m512 v = _mm512_load_ps(s + m * 64 + c * 16);
                    if (b) v = _mm512_add_ps(v, load_bf16_masked(b + n0, 0xffff));
                    _mm256_storeu_si256((__m256i *)(y + m * N + n0), f32x16_bf16(v));
                }
        }
    }
}

static inline int packed_shape_ok(const uint16_t *w, int64_t N, int64_t K) {
    return N % 64 == 0 && K % 2 == 0 && ((uintptr_t)w & 63) == 0;
}

int vlm_linear_packed_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                             int64_t N, int64_t K) {
    if (!packed_shape_ok(w, N, K)) return -1;
    if (M <= 0 || N <= 0) return 0;
    float *sums = aligned_alloc(64, (size_t)omp_get_max_threads() * (size_t)packed_sums_floats(M) * sizeof(float));
    if (sums == NULL) return -2;
    packed_product(x, w, b, y, M, N, K, sums);
    free(sums);
    return 0;
}

/*
 * A whole Qwen2 or Qwen3 decoder (Qwen2-VL, Qwen2.5-VL; Qwen3-VL dense) for a decode step, in one
 * call: M sequences' one new token each, through every layer and the final norm. Why: a one-request step of Qwen2-VL-2B
 * spent ~16 ms of its ~75 ms between the weight products (on the Zen 4 machine of
 * docs/benchmarks.md): per layer ~12 torch ops and ctypes calls, each 10-90 us there because the
 * weights streaming past (93 MB a layer) leave the interpreter's and torch's code and data cold in
 * every cache. Here the same kernels run back to back: the products, Qwen3's per-head q/k norms,
 * rotary, the KV write, paged decode attention, SwiGLU and the RMSNorms (the residual add fused
 * into the next norm, as torch's bf16 add rounds): the same bits as the layer-by-layer path.
 *
 * layers: DECODE_FIELDS addresses per layer: input_layernorm [H], post_attention_layernorm [H], the
 * layer's KV cache [2, num_blocks, block_size, kv heads, D], q_norm [D] and k_norm [D] (Qwen3;
 * 0 and 0 for Qwen2, which has none); then qkv_proj ([q + 2 kv, H]),
 * o_proj ([H, q]), gate_up_proj ([2 I, H]) and down_proj ([H, I]), four fields each: {0, the weight
 * in oneDNN's layout (vlm_linear_packed_avx512), 0, a bf16 bias or 0} or {vlm_linear_int8_avx512's
 * address (cpu_int8_avx512.c, its own shared object), int8 weight, fp32 scales, fp32 bias or 0}.
 * x [M, H]: the embeddings, overwritten by the residual stream; out [M, H]: the final norm of the
 * last layer's output. cos, sin [M, D] bf16; slots [M] (a negative slot writes no K/V);
 * block_tables [M, max_blocks], seq_lens [M] (with the new token). Returns 0, -1 where a shape or
 * alignment is not the kernels' (checked before anything is written), -2 without memory.
 */
#define DECODE_FIELDS 21
#define DECODE_PRODUCTS 5 /* the first product's field */

typedef void (*int8_product_fn)(const uint16_t *x, const int8_t *q, const float *scale, const float *b, void *y,
                                int64_t M, int64_t N, int64_t K, int64_t out_bf16);

/* y [M, N] bf16 = x [M, K] times the product described by p (four fields: see above) */
static void decode_product(const int64_t *p, const uint16_t *x, uint16_t *y, int64_t M, int64_t N, int64_t K,
                           float *sums) {
    if (p[0] == 0)
        packed_product(x, (const uint16_t *)p[1], (const uint16_t *)p[3], y, M, N, K, sums);
    else
        ((int8_product_fn)(uintptr_t)p[0])(x, (const int8_t *)p[1], (const float *)p[2], (const float *)p[3], y, M,
                                           N, K, 1);
}

static int decode_product_ok(const int64_t *p, int64_t N, int64_t K) {
    return p[0] != 0 || packed_shape_ok((const uint16_t *)p[1], N, K);
}

int vlm_decode_step_avx512(uint16_t *x, uint16_t *out, const int64_t *layers, int64_t num_layers,
                            const uint16_t *final_norm, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                            const int64_t *block_tables, const int64_t *seq_lens, int64_t M, int64_t H, int64_t I,
                            int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t num_blocks,
                            int64_t block_size, int64_t max_blocks, float eps, float scale) {
    const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D, n_qkv = q_size + 2 * kv_size;
    if (M <= 0 || num_layers <= 0 || D % 32 || D > ATT_MAX_DIM || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > ATT_MAX_GROUP || H % 2 || I % 2)
        return -1;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *p = layers + DECODE_FIELDS * l;
        const int64_t *products = p + DECODE_PRODUCTS;
        if (!decode_product_ok(products, n_qkv, H) || !decode_product_ok(products + 4, H, q_size) ||
            !decode_product_ok(products + 8, 2 * I, H) || !decode_product_ok(products + 12, H, I) ||
            (p[3] == 0) != (p[4] == 0))
            return -1;
    }
    const size_t elems = (size_t)(M * (H + n_qkv + q_size + H + 3 * I));
    uint16_t *buf = aligned_alloc(64, (elems * sizeof(uint16_t) + 63) & ~(size_t)63);
    float *sums = aligned_alloc(64, (size_t)omp_get_max_threads() * (size_t)packed_sums_floats(M) * sizeof(float));
    if (buf == NULL || sums == NULL) {
        free(buf);
        free(sums);
        return -2;
    }
    uint16_t *h = buf, *qkv = h + M * H, *attn = qkv + M * n_qkv, *o = attn + M * q_size, *gu = o + M * H;
    uint16_t *act = gu + M * 2 * I;
    const int64_t v_offset = num_blocks * block_size * kv_size;
    add_rms_norm_rows(x, NULL, (const uint16_t *)layers[0], NULL, h, M, H, eps);
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *p = layers + DECODE_FIELDS * l;
        const int64_t *products = p + DECODE_PRODUCTS;
        uint16_t *cache = (uint16_t *)p[2];
        decode_product(products, h, qkv, M, n_qkv, H, sums);
        if (p[3]) {
            rms_norm_heads(qkv, n_qkv, (const uint16_t *)p[3], M, num_heads, D, eps);
            rms_norm_heads(qkv + q_size, n_qkv, (const uint16_t *)p[4], M, num_kv_heads, D, eps);
        }
        vlm_rotary_qk_avx512(qkv, qkv + q_size, n_qkv, n_qkv, cos, sin, M, num_heads, num_kv_heads, D, 1);
        for (int64_t m = 0; m < M; m++) {
            if (slots[m] < 0) continue;
            const uint16_t *k = qkv + m * n_qkv + q_size;
            memcpy(cache + slots[m] * kv_size, k, (size_t)kv_size * sizeof(uint16_t));
            memcpy(cache + v_offset + slots[m] * kv_size, k + kv_size, (size_t)kv_size * sizeof(uint16_t));
        }
        decode_attention_avx512(qkv, n_qkv, cache, block_tables, seq_lens, attn, M, num_heads, num_kv_heads, D,
                                num_blocks, block_size, max_blocks, scale);
        decode_product(products + 4, attn, o, M, H, q_size, sums);
        add_rms_norm_rows(x, o, (const uint16_t *)p[1], x, h, M, H, eps);
        decode_product(products + 8, h, gu, M, 2 * I, H, sums);
        vlm_activation_bf16_avx512(gu, act, M, I, 2 * I, 1);
        decode_product(products + 12, act, o, M, H, I, sums);
        const int last = l + 1 == num_layers;
        const uint16_t *next_norm = last ? final_norm : (const uint16_t *)layers[DECODE_FIELDS * (l + 1)];
        add_rms_norm_rows(x, o, next_norm, x, last ? out : h, M, H, eps);
    }
    free(buf);
    free(sums);
    return 0;
}
