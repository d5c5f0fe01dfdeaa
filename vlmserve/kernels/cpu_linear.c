/*
 * bfloat16 linear layers for x86-64 CPUs with AVX2 and FMA.
 *
 * Why hand-written: on CPUs without AVX512-BF16/AMX, torch's bf16 matrix products fall back to
 * a generic kernel that runs at about 20 GFLOP/s whatever the batch size (measured on a 2-core
 * AMD EPYC: fp32 GEMM reaches 135 GFLOP/s there), and its bf16 matrix-vector product reads
 * weights at about 20 GB/s. Decode steps are matrix-vector products over every weight, so that
 * bounds the whole engine. This file does the same arithmetic as torch's bf16 path (bf16
 * inputs widened exactly to fp32, fp32 accumulation, one round-to-nearest-even to bf16 at the
 * end, bias added before rounding), with the weights widened in registers as they stream in.
 *
 * y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); x, w, b, y bf16 as uint16_t, all row-major contiguous.
 * Large M goes through fp32 GEMM in torch instead (see kernels/cpu.py): there the work is
 * compute-bound and MKL's blocking beats a simple kernel.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

#define NR 4 /* weight rows per tile */
#define MR 2 /* activation rows per tile */

static inline __m256 load8_bf16(const uint16_t *p) {
    /* bf16 -> fp32 is exact: the 16 bits become the top half of the float. */
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void vlm_bf16_to_f32(const uint16_t *src, float *dst, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i += 8) {
        if (i + 8 <= n) {
            _mm256_storeu_ps(dst + i, load8_bf16(src + i));
        } else {
            for (int64_t j = i; j < n; j++) dst[j] = bf16_to_f32(src[j]);
        }
    }
}

/* Dot products of NR weight rows (fp32, in a thread-local buffer) with MR activation rows. */
static inline void tile_dots(const float *wf, const float *x, int64_t K, int64_t k8, int nr, int mr,
                             float out[NR][MR]) {
    __m256 acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 w0 = _mm256_loadu_ps(wf + 0 * K + k), w1 = _mm256_loadu_ps(wf + 1 * K + k);
        __m256 w2 = _mm256_loadu_ps(wf + 2 * K + k), w3 = _mm256_loadu_ps(wf + 3 * K + k);
        for (int m = 0; m < MR; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            acc[0][m] = _mm256_fmadd_ps(w0, xv, acc[0][m]);
            acc[1][m] = _mm256_fmadd_ps(w1, xv, acc[1][m]);
            acc[2][m] = _mm256_fmadd_ps(w2, xv, acc[2][m]);
            acc[3][m] = _mm256_fmadd_ps(w3, xv, acc[3][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            float s = hsum(acc[r][m]);
            for (int64_t k = k8; k < K; k++) s += wf[r * K + k] * x[m * K + k];
            out[r][m] = s;
        }
}

/* One activation row (decode): stream each weight row once, widening in registers; four rows
 * in flight keep enough loads outstanding to run at memory bandwidth.
 *
 * PREFETCH: meanwhile the next rows are requested into L2 (the hardware prefetchers alone fetch
 * only as far ahead as the loads run, so each new set of rows waited on memory). AVX2 code on the
 * Zen 4 machine of docs/benchmarks.md, 2 threads: [1, 1536] x [151936, 1536] 19.4 -> 14.6 ms,
 * [1, 1536] x [17920, 1536] 1.91 -> 0.83 ms; with more rows (compute-bound) 0-10 % less. */
static void linear_row_bf16(const float *xf, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t N,
                            int64_t K) {
    const int64_t k8 = K & ~(int64_t)7;
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        if (nr == NR) {
            const uint16_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            /* the next NR rows (contiguous) requested meanwhile: see PREFETCH above */
            const char *next = n0 + 2 * NR <= N ? (const char *)(w + (n0 + NR) * K) : NULL;
            for (int64_t k = 0; k < k8; k += 8) {
                if (next && (k & 31) == 0)
                    for (int r = 0; r < NR; r++) _mm_prefetch(next + 2 * (r * K + k), _MM_HINT_T1);
                __m256 xv = _mm256_loadu_ps(xf + k);
                a0 = _mm256_fmadd_ps(load8_bf16(w0 + k), xv, a0);
                a1 = _mm256_fmadd_ps(load8_bf16(w1 + k), xv, a1);
                a2 = _mm256_fmadd_ps(load8_bf16(w2 + k), xv, a2);
                a3 = _mm256_fmadd_ps(load8_bf16(w3 + k), xv, a3);
            }
            float s[NR] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int r = 0; r < NR; r++) {
                for (int64_t k = k8; k < K; k++) s[r] += bf16_to_f32(w[(n0 + r) * K + k]) * xf[k];
                y[n0 + r] = f32_to_bf16(s[r] + (b ? bf16_to_f32(b[n0 + r]) : 0.0f));
            }
        } else {
            for (int r = 0; r < nr; r++) {
                const uint16_t *wr = w + (n0 + r) * K;
                __m256 a = _mm256_setzero_ps();
                for (int64_t k = 0; k < k8; k += 8) a = _mm256_fmadd_ps(load8_bf16(wr + k), _mm256_loadu_ps(xf + k), a);
                float s = hsum(a);
                for (int64_t k = k8; k < K; k++) s += bf16_to_f32(wr[k]) * xf[k];
                y[n0 + r] = f32_to_bf16(s + (b ? bf16_to_f32(b[n0 + r]) : 0.0f));
            }
        }
    }
}

/*
 * Weight rows are split across threads. Each thread widens NR rows at a time into a small fp32
 * buffer (read once from memory), then runs every activation row against them: the weights are
 * streamed exactly once whatever M is. x is widened once up front (M x K fp32, small).
 */
void vlm_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                     int64_t K) {
    float *xf = (float *)aligned_alloc(64, (size_t)((M + MR) * K * sizeof(float) + 64));
    vlm_bf16_to_f32(x, xf, M * K);
    memset(xf + M * K, 0, (size_t)(MR * K * sizeof(float))); /* padding rows for the last tile */
    if (M == 1) {
        linear_row_bf16(xf, w, b, y, N, K);
        free(xf);
        return;
    }
    const int64_t k8 = K & ~(int64_t)7;
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel
    {
        float *wf = (float *)aligned_alloc(64, (size_t)(NR * K * sizeof(float) + 64));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            if (n0 + 2 * NR <= N) /* the next tile's rows (contiguous) requested into L2 meanwhile */
                for (int64_t off = 0; off < NR * K * 2; off += 64)
                    _mm_prefetch((const char *)(w + (n0 + NR) * K) + off, _MM_HINT_T1);
            for (int r = 0; r < NR; r++) {
                if (r < nr) {
                    const uint16_t *src = w + (n0 + r) * K;
                    int64_t k = 0;
                    for (; k < k8; k += 8) _mm256_storeu_ps(wf + r * K + k, load8_bf16(src + k));
                    for (; k < K; k++) wf[r * K + k] = bf16_to_f32(src[k]);
                } else {
                    memset(wf + r * K, 0, (size_t)(K * sizeof(float)));
                }
            }
            float bias[NR] = {0, 0, 0, 0};
            if (b)
                for (int r = 0; r < nr; r++) bias[r] = bf16_to_f32(b[n0 + r]);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = (int)(M - m0 < MR ? M - m0 : MR);
                float out[NR][MR];
                tile_dots(wf, xf + m0 * K, K, k8, nr, mr, out);
                for (int m = 0; m < mr; m++)
                    for (int r = 0; r < nr; r++) y[(m0 + m) * N + n0 + r] = f32_to_bf16(out[r][m] + bias[r]);
            }
        }
        free(wf);
    }
    free(xf);
}

/*
 * Paged decode attention: one query token per sequence, attending over its seq_len cached tokens,
 * read in place from the KV cache by block table (no gather). Why hand-written: torch's CPU
 * flash-attention kernel takes ~0.9 ms for one query over a few hundred keys (its tiles are
 * sized for long queries), several times a decode step's other non-matmul work together.
 *
 * q:      [num_seqs, num_heads, head_dim]                        (T = bf16 or fp32)
 * cache:  [2, num_blocks, block_size, num_kv_heads, head_dim]    (T)
 * out:    [num_seqs, num_heads, head_dim]                        (T)
 * Scores, softmax and the weighted sum are fp32 (online softmax); query heads h use kv head
 * h / (num_heads / num_kv_heads). Tokens go in chunks: the chunk's K and V rows are prefetched
 * together (its blocks lie anywhere in the cache), each row is widened once for the whole group
 * of query heads, and the softmax state is rescaled once per chunk, not per token. Measured on
 * the Zen 4 machine of docs/benchmarks.md, against the per-token version: one query (12 heads, 2
 * KV heads) over 325 tokens 81 -> 48 us, 32 queries over 400 tokens 3.2 -> 2.1 ms (KV in cache);
 * inside a one-request Qwen2-VL-2B decode step no change beyond the noise (3.3 vs 3.7 ms a step).
 */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float load1(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __m256 load8(const void *base, int64_t i, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)base + i) : _mm256_loadu_ps((const float *)base + i);
}

#define CHUNK 32 /* tokens whose scores are computed before the softmax state is updated once */

/* One cache row of head_dim elements (at element offset `at`) widened to fp32 into row_f. */
static inline void widen_row(float *row_f, const void *cache, int64_t at, int64_t head_dim, int64_t d8, int bf16) {
    for (int64_t d = 0; d < d8; d += 8) _mm256_storeu_ps(row_f + d, load8(cache, at + d, bf16));
    for (int64_t d = d8; d < head_dim; d++) row_f[d] = load1(cache, at + d, bf16);
}

static void decode_attention(const void *q, const void *cache, const int64_t *block_tables, const int64_t *seq_lens,
                             void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale, int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t v_offset = num_blocks * block_size * token_stride;
    const int64_t d8 = head_dim & ~(int64_t)7;
    const int64_t elem = bf16 ? 2 : 4, row_bytes = head_dim * elem;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            /* the group's query heads share each K and V row: widened once per token, used by all */
            float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
            float row_f[MAX_HEAD_DIM], p[MAX_GROUP][CHUNK];
            int64_t rows[CHUNK];
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                for (int64_t d = 0; d < head_dim; d++) {
                    qf[g][d] = load1(q, (s * num_heads + h) * head_dim + d, bf16) * scale;
                    acc[g][d] = 0.0f;
                }
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            const int64_t len = seq_lens[s];
            for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
                const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;
                /* the chunk's K and V rows requested at once (they lie in blocks anywhere in the cache) */
                for (int64_t j = 0; j < n; j++) {
                    const int64_t t = t0 + j;
                    const int64_t block = block_tables[s * max_blocks + t / block_size];
                    rows[j] = ((block * block_size) + t % block_size) * token_stride + kvh * head_dim;
                    const char *k_row = (const char *)cache + rows[j] * elem;
                    const char *v_row = k_row + v_offset * elem;
                    for (int64_t b = 0; b < row_bytes; b += 64) {
                        _mm_prefetch(k_row + b, _MM_HINT_T0);
                        _mm_prefetch(v_row + b, _MM_HINT_T1);
                    }
                }
                /* scores of the chunk's tokens for every head of the group */
                for (int64_t j = 0; j < n; j++) {
                    widen_row(row_f, cache, rows[j], head_dim, d8, bf16);
                    for (int64_t g = 0; g < group; g++) {
                        __m256 dot = _mm256_setzero_ps();
                        for (int64_t d = 0; d < d8; d += 8)
                            dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf[g] + d), _mm256_loadu_ps(row_f + d), dot);
                        float score = hsum(dot);
                        for (int64_t d = d8; d < head_dim; d++) score += qf[g][d] * row_f[d];
                        p[g][j] = score;
                    }
                }
                /* online softmax, once per chunk: rescale what was accumulated if the max grew */
                for (int64_t g = 0; g < group; g++) {
                    float m_new = m[g];
                    for (int64_t j = 0; j < n; j++) m_new = p[g][j] > m_new ? p[g][j] : m_new;
                    const float correction = expf(m[g] - m_new);
                    float sum = 0.0f;
                    for (int64_t j = 0; j < n; j++) {
                        p[g][j] = expf(p[g][j] - m_new);
                        sum += p[g][j];
                    }
                    l[g] = l[g] * correction + sum;
                    m[g] = m_new;
                    if (correction != 1.0f) {
                        const __m256 c8 = _mm256_set1_ps(correction);
                        for (int64_t d = 0; d < d8; d += 8)
                            _mm256_storeu_ps(acc[g] + d, _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), c8));
                        for (int64_t d = d8; d < head_dim; d++) acc[g][d] *= correction;
                    }
                }
                /* acc += p V, each V row widened once */
                for (int64_t j = 0; j < n; j++) {
                    widen_row(row_f, cache, v_offset + rows[j], head_dim, d8, bf16);
                    for (int64_t g = 0; g < group; g++) {
                        const __m256 p8 = _mm256_set1_ps(p[g][j]);
                        for (int64_t d = 0; d < d8; d += 8) {
                            const __m256 a = _mm256_loadu_ps(acc[g] + d);
                            _mm256_storeu_ps(acc[g] + d, _mm256_fmadd_ps(p8, _mm256_loadu_ps(row_f + d), a));
                        }
                        for (int64_t d = d8; d < head_dim; d++) acc[g][d] += p[g][j] * row_f[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t base = (s * num_heads + kvh * group + g) * head_dim;
                const float inv = 1.0f / l[g];
                for (int64_t d = 0; d < head_dim; d++) {
                    const float v = acc[g][d] * inv;
                    if (bf16) ((uint16_t *)out)[base + d] = f32_to_bf16(v);
                    else ((float *)out)[base + d] = v;
                }
            }
        }
    }
}

void vlm_decode_attention(const void *q, const void *cache, const int64_t *block_tables, const int64_t *seq_lens,
                          void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale, int64_t bf16) {
    decode_attention(q, cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, num_blocks,
                     block_size, max_blocks, scale, (int)bf16);
}

/*
 * Element-wise layers between the matrix products (bf16 only): RMSNorm after a residual add,
 * rotary embedding. Why: torch runs each as 6-9 small ops (20-30 us per call in a one-request
 * decode step), and the vision towers' fp32 rotary spends most of its time in torch's bf16 <->
 * fp32 copies. Each rounds where the torch expressions of models/layers.py round (every bf16
 * op's fp32 result to bf16, nearest even), so the results are the same bits except where a
 * sum's order differs (the RMSNorm mean). (SwiGLU and quick_gelu stay torch's: a scalar expf
 * here was slower than torch's vectorized exp.)
 */

/* sum[m] = x[m] + delta[m], then out[m] = w * bf16(sum * rsqrt(mean(sum^2) + eps)): add_rms_norm_rows
 * in bf16.h (shared with cpu_linear_avx512.c's fused decode, so both give the same bits). */
void vlm_add_rms_norm_bf16(const uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *sum, uint16_t *out,
                           int64_t M, int64_t H, float eps) {
    add_rms_norm_rows(x, delta, w, sum, out, M, H, eps);
}

/* RMSNorm of each head in place on x [M, heads, D] (rows `stride` elements apart, heads
 * contiguous: views of a fused qkv output), w [D] (bf16.h's rms_norm_heads). */
void vlm_rms_norm_heads_bf16(uint16_t *x, int64_t stride, const uint16_t *w, int64_t M, int64_t heads, int64_t D,
                             float eps) {
    rms_norm_heads(x, stride, w, M, heads, D, eps);
}

/* Rotate-half rotary embedding in place on q [M, nq, D] and k [M, nk, D] (rows `q_stride` /
 * `k_stride` elements apart, heads contiguous); cos, sin [M, D]:
 * x[i] <- x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
 * cos_bf16: cos, sin are bf16 and each product rounds to bf16 as torch's bf16 ops do (the
 * decoders); otherwise they are fp32 and the arithmetic is fp32 throughout, one rounding to bf16
 * at the end, as the reference computes the vision towers' rotary. Built without FMA contraction
 * (-std=c11), so each product and the sum round as torch's separate ops do. */
static inline float round_if(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static void rotate_heads(uint16_t *x, const void *c, const void *s, int64_t heads, int64_t D, int cos_bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
            const float a_c = round_if(a * load1(c, i, cos_bf16), cos_bf16);
            const float b_s = round_if(-b * load1(s, i, cos_bf16), cos_bf16);
            const float b_c = round_if(b * load1(c, i + half, cos_bf16), cos_bf16);
            const float a_s = round_if(a * load1(s, i + half, cos_bf16), cos_bf16);
            v[i] = f32_to_bf16(a_c + b_s);
            v[i + half] = f32_to_bf16(b_c + a_s);
        }
    }
}

void vlm_rotary_qk_bf16(uint16_t *q, uint16_t *k, int64_t q_stride, int64_t k_stride, const void *cos,
                        const void *sin, int64_t M, int64_t nq, int64_t nk, int64_t D, int64_t cos_bf16) {
    rotary_tokens(rotate_heads, q, k, q_stride, k_stride, cos, sin, M, nq, nk, D, cos_bf16);
}

/*
 * Greedy sampling's argmax over rows of bf16 logits, as torch.argmax of their fp32 values: the
 * first index of the largest, a NaN (either sign) counting as the largest. Why: torch needs the
 * logits widened to fp32 first (its bf16 argmax is 4x slower still) and then takes 2.2 ms over
 * [32, 151936] on the Zen 4 machine; the widening took 1.2 ms more. Each value becomes an int16
 * key ordered as the values (-0 and +0 equal, NaN above +inf), 16 at a time with AVX2 (written
 * as plain C, gcc's vectorised loop was slower than torch: 3.5 ms).
 */
static inline int16_t order_key(uint16_t b) {
    const int16_t magnitude = (int16_t)(b & 0x7fff);
    if (magnitude > 0x7f80) return INT16_MAX; /* NaN */
    return (b & 0x8000) ? (int16_t)-magnitude : magnitude;
}

/* order_key of 16 values */
static inline __m256i order_keys(__m256i v) {
    const __m256i magnitude = _mm256_and_si256(v, _mm256_set1_epi16(0x7fff));
    const __m256i nan = _mm256_cmpgt_epi16(magnitude, _mm256_set1_epi16(0x7f80));
    /* negated where the sign bit is set (v < 0 as int16; -0 gives 0) */
    return _mm256_blendv_epi8(_mm256_sign_epi16(magnitude, v), _mm256_set1_epi16(INT16_MAX), nan);
}

void vlm_argmax_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= 262144)
    for (int64_t m = 0; m < rows; m++) {
        const uint16_t *row = x + m * n;
        const int64_t n16 = n / 16 * 16;
        __m256i top = _mm256_set1_epi16(INT16_MIN);
        for (int64_t j = 0; j < n16; j += 16)
            top = _mm256_max_epi16(top, order_keys(_mm256_loadu_si256((const __m256i *)(row + j))));
        int16_t lanes[16], best = INT16_MIN;
        _mm256_storeu_si256((__m256i *)lanes, top);
        for (int i = 0; i < 16; i++) best = lanes[i] > best ? lanes[i] : best;
        for (int64_t j = n16; j < n; j++) best = order_key(row[j]) > best ? order_key(row[j]) : best;
        /* the first index holding it */
        int64_t at = -1;
        const __m256i want = _mm256_set1_epi16(best);
        for (int64_t j = 0; j < n16 && at < 0; j += 16) {
            const __m256i hit = _mm256_cmpeq_epi16(order_keys(_mm256_loadu_si256((const __m256i *)(row + j))), want);
            const unsigned bits = (unsigned)_mm256_movemask_epi8(hit);
            if (bits) at = j + __builtin_ctz(bits) / 2;
        }
        for (int64_t j = n16; j < n && at < 0; j++)
            if (order_key(row[j]) == best) at = j;
        out[m] = at;
    }
}

/*
 * The k largest values of chosen rows of bf16 or fp32 logits, in descending order with their
 * indices (ties: the earlier index first), for the sampler's top-k and top-p candidates. Why:
 * torch.topk over [32, 151936] fp32 took 3.7-5 ms on one core of the Zen 4 machine (and needs
 * the bf16 logits widened first), where one pass over the bf16 row that rarely stops costs about
 * what the argmax above does. The order is that of order_key (NaN above +inf, -0 equal to +0), as
 * torch orders them. Values that beat the k-th best so far go into a buffer of 2k; when it is
 * full, a selection keeps its k best and raises the bar (O(k) a time, about ln(n / k) times a
 * row); a vector compare against the bar skips the values that cannot enter.
 */
typedef struct {
    int32_t key;
    int64_t index;
} ranked;

/* a ranks before b: a larger key, or the same key at an earlier index */
static inline int before(ranked a, ranked b) { return a.key > b.key || (a.key == b.key && a.index < b.index); }

/* Reorders items[0, n) so that its k best come first (in no order); k < n. */
static void select_best(ranked *items, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const ranked pivot = items[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(items[i], pivot)) i++;
            while (before(pivot, items[j])) j--;
            if (i <= j) {
                const ranked t = items[i];
                items[i++] = items[j];
                items[j--] = t;
            }
        }
        /* [lo, j] rank no later than the pivot, [i, hi] no earlier */
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

static inline int32_t order_key32(uint32_t b) {
    const int32_t magnitude = (int32_t)(b & 0x7fffffffu);
    if (magnitude > 0x7f800000) return INT32_MAX; /* NaN */
    return (b & 0x80000000u) ? -magnitude : magnitude;
}

static int by_rank(const void *a, const void *b) {
    const ranked x = *(const ranked *)a, y = *(const ranked *)b;
    return before(x, y) ? -1 : (before(y, x) ? 1 : 0);
}

typedef struct {
    ranked *items;
    int64_t size, k, full; /* full: the bar holds (k items have been kept) */
    int32_t bar;           /* the k-th best key kept so far: a value must beat it to enter */
} candidates;

static inline void offer(candidates *c, int32_t key, int64_t index) {
    if (c->full && key <= c->bar) return; /* an equal key comes later: it ranks after */
    c->items[c->size++] = (ranked){key, index};
    if (c->size == 2 * c->k) {
        select_best(c->items, c->size, c->k);
        c->size = c->k;
        c->full = 1;
        int32_t bar = INT32_MAX;
        for (int64_t i = 0; i < c->k; i++) bar = c->items[i].key < bar ? c->items[i].key : bar;
        c->bar = bar;
    }
}

/* Whether token j is allowed by a bitmask row (bit j % 32 of word j / 32 set; no mask: all). */
static inline int allowed(const int32_t *mask, int64_t j) { return !mask || ((uint32_t)mask[j >> 5] >> (j & 31)) & 1u; }

/* x: rows of n values (bf16 when is_bf16, else fp32), row_stride elements apart; rows[i] the row
 * of output i (r of them); values [r, k] fp32 and indices [r, k] int64 out. k <= n. With
 * bitmask (words of 32 tokens, mask_stride words a row; structured outputs' masks), output i
 * takes only the tokens allowed by bitmask row mask_rows[i] (-1: every token), as if the others
 * were -inf; past the allowed tokens its values are -inf (index 0). A masked value's key is the
 * least an int can hold, below every value's (-inf's included): it never enters. */
void vlm_topk(const void *x, int64_t row_stride, int64_t is_bf16, const int64_t *rows, int64_t r, int64_t n, int64_t k,
              float *values, int64_t *indices, const int32_t *bitmask, int64_t mask_stride, const int64_t *mask_rows) {
#pragma omp parallel for schedule(dynamic, 1) if (r * n >= 262144)
    for (int64_t m = 0; m < r; m++) {
        candidates c = {malloc((size_t)(2 * k) * sizeof(ranked)), 0, k, 0, INT32_MIN};
        const int32_t *mask = bitmask && mask_rows[m] >= 0 ? bitmask + mask_rows[m] * mask_stride : NULL;
        if (is_bf16) {
            const uint16_t *row = (const uint16_t *)x + rows[m] * row_stride;
            const int64_t n16 = n / 16 * 16;
            const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                       16384, (int16_t)0x8000);
            for (int64_t j = 0; j < n16; j += 16) {
                __m256i keys = order_keys(_mm256_loadu_si256((const __m256i *)(row + j)));
                if (mask) {
                    const int16_t word = (int16_t)((uint32_t)mask[j >> 5] >> (j & 31));
                    const __m256i off = _mm256_cmpeq_epi16(
                        _mm256_and_si256(_mm256_set1_epi16(word), lane_bit), _mm256_setzero_si256());
                    keys = _mm256_blendv_epi8(keys, _mm256_set1_epi16(INT16_MIN), off);
                }
                /* before k are kept, everything but a masked value enters */
                const int16_t bar = c.full ? (int16_t)c.bar : INT16_MIN;
                unsigned bits = (unsigned)_mm256_movemask_epi8(_mm256_cmpgt_epi16(keys, _mm256_set1_epi16(bar)));
                while (bits) {
                    const int lane = __builtin_ctz(bits) / 2;
                    bits &= ~(3u << (2 * lane));
                    offer(&c, order_key(row[j + lane]), j + lane);
                }
            }
            for (int64_t j = n16; j < n; j++)
                if (allowed(mask, j)) offer(&c, order_key(row[j]), j);
        } else {
            const uint32_t *row = (const uint32_t *)x + rows[m] * row_stride;
            const int64_t n8 = n / 8 * 8;
            const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            for (int64_t j = 0; j < n8; j += 8) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + j));
                const __m256i magnitude = _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff));
                const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
                __m256i keys = _mm256_blendv_epi8(_mm256_sign_epi32(magnitude, v), _mm256_set1_epi32(INT32_MAX), nan);
                if (mask) {
                    const int32_t byte = (int32_t)(((uint32_t)mask[j >> 5] >> (j & 31)) & 0xffu);
                    const __m256i off = _mm256_cmpeq_epi32(
                        _mm256_and_si256(_mm256_set1_epi32(byte), lane_bit), _mm256_setzero_si256());
                    keys = _mm256_blendv_epi8(keys, _mm256_set1_epi32(INT32_MIN), off);
                }
                unsigned bits = (unsigned)_mm256_movemask_ps(
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, _mm256_set1_epi32(c.full ? c.bar : INT32_MIN))));
                while (bits) {
                    const int lane = __builtin_ctz(bits);
                    bits &= bits - 1;
                    offer(&c, order_key32(row[j + lane]), j + lane);
                }
            }
            for (int64_t j = n8; j < n; j++)
                if (allowed(mask, j)) offer(&c, order_key32(row[j]), j);
        }
        if (c.size > k) select_best(c.items, c.size, k);
        const int64_t size = c.size < k ? c.size : k;
        qsort(c.items, (size_t)size, sizeof(ranked), by_rank);
        for (int64_t i = 0; i < size; i++) {
            const int64_t j = c.items[i].index;
            indices[m * k + i] = j;
            values[m * k + i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[rows[m] * row_stride + j])
                                        : ((const float *)x)[rows[m] * row_stride + j];
        }
        for (int64_t i = size; i < k; i++) {
            indices[m * k + i] = 0;
            values[m * k + i] = -INFINITY;
        }
        free(c.items);
    }
}

/*
 * Structured outputs' masks applied in place: in rows rows[i] of fp32 logits x (row_stride apart),
 * every token whose bit in bitmask row mask_rows[i] (words of 32 tokens, mask_stride words a row,
 * xgrammar's layout) is 0 gets -inf. Why: xgrammar's CPU kernel took 16 ms over [32, 151936] on the
 * Zen 4 machine; a word whose 32 bits are all set (most of a mid-answer mask) is skipped here.
 */
void vlm_apply_bitmask(float *x, int64_t row_stride, const int64_t *rows, int64_t r, int64_t n, const int32_t *bitmask,
                       int64_t mask_stride, const int64_t *mask_rows) {
#pragma omp parallel for schedule(static) if (r * n >= 262144)
    for (int64_t m = 0; m < r; m++) {
        float *row = x + rows[m] * row_stride;
        const int32_t *mask = bitmask + mask_rows[m] * mask_stride;
        const int64_t words = (n + 31) / 32;
        for (int64_t w = 0; w < words; w++) {
            uint32_t off = ~(uint32_t)mask[w];
            while (off) {
                const int64_t j = w * 32 + __builtin_ctz(off);
                off &= off - 1;
                if (j < n) row[j] = -INFINITY;
            }
        }
    }
}
