/*
 * Paged decode attention for CPUs: one query token per sequence attends over its context,
 * read in place from the paged KV cache (no gather copy). Built at first use by
 * iterserve/kernels/cpu_build.py (cc -O3 -march=native -fopenmp) and called through ctypes.
 *
 * Layouts (element strides, C order):
 *   q, out       [num_seqs, num_heads, head_dim]; rows of q are q_seq_stride apart
 *                (q is a view into the fused qkv projection), heads and dims contiguous
 *   key_cache,   [num_kv_heads, num_blocks, block_size, head_dim], contiguous
 *   value_cache
 *   block_tables [num_seqs, block_table_stride] int64
 *   seq_lens     [num_seqs] int64, context length including this iteration's token
 *
 * One work item is (sequence, KV head): the group = num_heads / num_kv_heads query heads that
 * share a KV head (grouped-query attention) read each key and value row once. Three passes
 * over the context, block by block: scores (q . k * scale), a float32 softmax, then the
 * probability-weighted sum of values. Accumulation is float32 whatever the storage dtype.
 * bfloat16 on CPUs with AVX512-BF16 computes q . k and p . v with vdpbf16ps on the stored
 * bfloat16 directly (item_bf16_avx512); other CPUs and float32 run portable C that the
 * compiler vectorizes.
 *
 * The OpenMP runtime is the one torch already loaded (same soname, libgomp.so.1), so the
 * kernel shares torch's intra-op thread pool instead of competing with it.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define MAX_GROUP 64

typedef struct {
    const void *q, *key_cache, *value_cache;
    void *out;
    const int64_t *block_tables, *seq_lens;
    int64_t q_seq_stride, block_table_stride, num_heads, num_kv_heads, head_dim, block_size;
    int64_t kv_head_stride, group, max_len;
    float scale;
    int q_bf16; /* int8 caches: q and out are bfloat16, else float32 */
} params_t;

/* scratch per thread: scores [group, max_len], then q and accumulators [group, head_dim] and a
 * row [head_dim], all float32 */
typedef void (*item_fn)(const params_t *p, float *scratch, int64_t seq, int64_t kv_head);

/* Softmax of each of the group rows of scores (row stride max_len) in place, unnormalised;
 * inv_sum[g] gets 1 / the row's sum. */
static void softmax_rows(float *scores, const params_t *p, int64_t len, float *inv_sum) {
    for (int64_t g = 0; g < p->group; g++) {
        float *row = scores + g * p->max_len, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) m = row[t] > m ? row[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            row[t] = exp_nonpositive(row[t] - m);
            sum += row[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
}

static inline void load_f32(float *dst, const float *src, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static inline void load_bf16(float *dst, const uint16_t *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void store_f32(float *dst, const float *src, int64_t n, float mul) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] * mul;
}

static inline void store_bf16(uint16_t *dst, const float *src, int64_t n, float mul) {
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i] * mul);
}

/* The portable work item for storage type T. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE)                                                      \
    static void NAME(const params_t *p, float *scores, int64_t s, int64_t h) {                 \
        const int64_t D = p->head_dim, G = p->group, bs = p->block_size;                       \
        const int64_t len = p->seq_lens[s];                                                    \
        const int64_t *table = p->block_tables + s * p->block_table_stride;                    \
        const T *kh = (const T *)p->key_cache + h * p->kv_head_stride;                         \
        const T *vh = (const T *)p->value_cache + h * p->kv_head_stride;                       \
        float *qf = scores + G * p->max_len, *acc = qf + G * D, *row = acc + G * D;            \
        float inv_sum[MAX_GROUP];                                                              \
        for (int64_t g = 0; g < G; g++)                                                        \
            LOAD(qf + g * D, (const T *)p->q + s * p->q_seq_stride + (h * G + g) * D, D);      \
        for (int64_t t0 = 0; t0 < len; t0 += bs) {                                             \
            const T *kb = kh + table[t0 / bs] * bs * D;                                        \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                   \
            for (int64_t t = 0; t < n; t++) {                                                  \
                LOAD(row, kb + t * D, D);                                                      \
                for (int64_t g = 0; g < G; g++) {                                              \
                    const float *qg = qf + g * D;                                              \
                    float dot = 0.0f;                                                          \
                    _Pragma("omp simd reduction(+ : dot)")                                     \
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];                     \
                    scores[g * p->max_len + t0 + t] = dot * p->scale;                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        softmax_rows(scores, p, len, inv_sum);                                                 \
        memset(acc, 0, (size_t)(G * D) * sizeof(float));                                      \
        for (int64_t t0 = 0; t0 < len; t0 += bs) {                                             \
            const T *vb = vh + table[t0 / bs] * bs * D;                                        \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                   \
            for (int64_t t = 0; t < n; t++) {                                                  \
                LOAD(row, vb + t * D, D);                                                      \
                for (int64_t g = 0; g < G; g++) {                                              \
                    float *ag = acc + g * D;                                                   \
                    const float w = scores[g * p->max_len + t0 + t];                           \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < D; d++) ag[d] += w * row[d];                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t g = 0; g < G; g++)                                                        \
            STORE((T *)p->out + (s * p->num_heads + h * G + g) * D, acc + g * D, D, inv_sum[g]); \
    }

DEFINE_ITEM(item_f32, float, load_f32, store_f32)
DEFINE_ITEM(item_bf16, uint16_t, load_bf16, store_bf16)

/* An int8 cache row (reshape_and_cache_int8): head_dim int8 values, then their float32 scale. */
static inline float row_scale(const int8_t *row, int64_t D) {
    float scale;
    memcpy(&scale, row + D, sizeof(scale));
    return scale;
}

/* The portable work item over an int8 cache (q and out float32 or bfloat16, p->q_bf16):
 * q . k on the int8 values, times the row's scale; p . v likewise. */
static void item_int8(const params_t *p, float *scores, int64_t s, int64_t h) {
    const int64_t D = p->head_dim, G = p->group, bs = p->block_size, R = D + 4;
    const int64_t len = p->seq_lens[s];
    const int64_t *table = p->block_tables + s * p->block_table_stride;
    const int8_t *kh = (const int8_t *)p->key_cache + h * p->kv_head_stride;
    const int8_t *vh = (const int8_t *)p->value_cache + h * p->kv_head_stride;
    float *qf = scores + G * p->max_len, *acc = qf + G * D, *row = acc + G * D;
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = s * p->q_seq_stride + (h * G + g) * D;
        if (p->q_bf16)
            load_bf16(qf + g * D, (const uint16_t *)p->q + at, D);
        else
            load_f32(qf + g * D, (const float *)p->q + at, D);
    }
    for (int64_t t = 0; t < len; t++) {
        const int8_t *k = kh + (table[t / bs] * bs + t % bs) * R;
        for (int64_t d = 0; d < D; d++) row[d] = (float)k[d];
        const float ks = row_scale(k, D) * p->scale;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];
            scores[g * p->max_len + t] = dot * ks;
        }
    }
    softmax_rows(scores, p, len, inv_sum);
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        const int8_t *v = vh + (table[t / bs] * bs + t % bs) * R;
        for (int64_t d = 0; d < D; d++) row[d] = (float)v[d];
        const float vs = row_scale(v, D);
        for (int64_t g = 0; g < G; g++) {
            float *ag = acc + g * D;
            const float w = scores[g * p->max_len + t] * vs;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ag[d] += w * row[d];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = (s * p->num_heads + h * G + g) * D;
        if (p->q_bf16)
            store_bf16((uint16_t *)p->out + at, acc + g * D, D, inv_sum[g]);
        else
            store_f32((float *)p->out + at, acc + g * D, D, inv_sum[g]);
    }
}

#ifdef HAVE_AVX512_BF16
/* exp_nonpositive on 16 lanes; vscalefps applies 2^n without building the exponent bits. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 r = _mm512_set1_ps(1.5353362e-4f);
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.3398874e-3f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(9.6180346e-3f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(5.5503341e-2f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(2.4022651e-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(6.9314718e-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(r, n);
}

/* softmax_rows with 16-lane vectors (masked tail). */
static void softmax_rows_avx512(float *scores, const params_t *p, int64_t len, float *inv_sum) {
    for (int64_t g = 0; g < p->group; g++) {
        float *row = scores + g * p->max_len;
        __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 k = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, row + t));
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 k = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            const __m512 x = _mm512_maskz_loadu_ps(k, row + t);
            const __m512 e = exp512_nonpositive(_mm512_sub_ps(x, mx));
            _mm512_mask_storeu_ps(row + t, k, e);
            sum = _mm512_mask_add_ps(sum, k, sum, e);
        }
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* Sums of 16 vectors: lane j of the result is the sum of the 16 lanes of x[j]. A transposing
 * tree (unpack, then 128-bit lane shuffles; 45 instructions) instead of 16 horizontal sums. */
static inline __m512 sum16(const __m512 x[16]) {
    __m512 y[8], z[4];
    for (int i = 0; i < 8; i++)  /* lanes: [x0a x1a x0b x1b] per 128 bits */
        y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* [x0 x1 x2 x3] per 128 bits, each a partial sum */
        const __m512d a = _mm512_castps_pd(y[2 * i]), b = _mm512_castps_pd(y[2 * i + 1]);
        z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* bfloat16 with AVX512-BF16, group <= 8 query heads per KV head, NV = head_dim / 16 float32
 * vectors per row (head_dim 64 or 128), block_size a power of two.
 *   q . k: vdpbf16ps over pairs of bfloat16 (q and k as stored) into 16 float32 lanes per
 *     token, 16 tokens at a time, then one transposing sum (sum16) gives their 16 scores.
 *   p . v: probabilities rounded to bfloat16 (as the torch backend's probs.to(q.dtype));
 *     two tokens' value rows interleaved (vpunpck*wd) so that one vdpbf16ps adds
 *     p[t] v[t][d] + p[t+1] v[t+1][d]. The interleave permutes dims within 128-bit lanes;
 *     the accumulators are put back in order once at the end. */
static inline __attribute__((always_inline)) void item_bf16_avx512(
    const params_t *p, float *scores, int64_t s, int64_t h, const int64_t G, const int64_t NV) {
    const int64_t D = NV * 16, bs = p->block_size, shift = __builtin_ctzll((uint64_t)bs);
    const int64_t len = p->seq_lens[s], stride = p->max_len;
    const int64_t *table = p->block_tables + s * p->block_table_stride;
    const uint16_t *kh = (const uint16_t *)p->key_cache + h * p->kv_head_stride;
    const uint16_t *vh = (const uint16_t *)p->value_cache + h * p->kv_head_stride;
    const uint16_t *qs = (const uint16_t *)p->q + s * p->q_seq_stride + h * G * D;
    /* probabilities in bfloat16, [group, max_len + 2] (even length, zero padded) */
    uint16_t *probs = (uint16_t *)(scores + G * stride + 2 * G * D + D);
    const int64_t probs_stride = stride + 2;
    float inv_sum[8];
#define SLOT(t) (table[(t) >> shift] * bs + ((t) & (bs - 1)))
    /* Rows are asked for 32 tokens ahead of use: a block is too short a stream for the
     * hardware prefetcher, and a chunk's loads come in one burst. */
#define PREFETCH(base, first, last)                                                            \
    for (int64_t j = (first); j < (last) && j < len; j++)                                      \
        for (int64_t c = 0; c < D * 2; c += 64)                                                \
            _mm_prefetch((const char *)((base) + SLOT(j) * D) + c, _MM_HINT_T0);
    PREFETCH(kh, 0, 32);
    __m512bh qv[8][4];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV / 2; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(qs + g * D + 32 * c);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const uint16_t *rows[16];
        for (int64_t j = 0; j < 16; j++) rows[j] = kh + SLOT(t0 + (j < n ? j : 0)) * D;
        PREFETCH(kh, t0 + 32, t0 + 48);
        for (int64_t g = 0; g < G; g++) {
            __m512 dot[16];
            for (int64_t j = 0; j < 16; j++) {
                dot[j] = _mm512_setzero_ps();
                for (int64_t c = 0; c < NV / 2; c++)
                    dot[j] = _mm512_dpbf16_ps(dot[j], qv[g][c],
                                              (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
            }
            const __m512 sc = _mm512_mul_ps(sum16(dot), _mm512_set1_ps(p->scale));
            _mm512_mask_storeu_ps(scores + g * stride + t0, first_lanes(n), sc);
        }
    }
    PREFETCH(vh, 0, 32);
    softmax_rows_avx512(scores, p, len, inv_sum);
    for (int64_t g = 0; g < G; g++) {
        uint16_t *pg = probs + g * probs_stride;
        for (int64_t t = 0; t < len; t += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(first_lanes(len - t), scores + g * stride + t);
            _mm256_mask_storeu_epi16(pg + t, first_lanes(len - t), (__m256i)_mm512_cvtneps_pbh(v));
        }
        pg[len] = 0;  /* the odd token's partner */
    }
    __m512 acc_lo[8][4], acc_hi[8][4];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV / 2; c++)
            acc_lo[g][c] = acc_hi[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 2) {
        PREFETCH(vh, t + 32, t + 34);
        const uint16_t *r0 = vh + SLOT(t) * D;
        const uint16_t *r1 = t + 1 < len ? vh + SLOT(t + 1) * D : r0;  /* its p is 0 */
        __m512i lo[4], hi[4];
        for (int64_t c = 0; c < NV / 2; c++) {
            const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
            lo[c] = _mm512_unpacklo_epi16(a, b);
            hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t g = 0; g < G; g++) {
            int32_t pair;
            memcpy(&pair, probs + g * probs_stride + t, sizeof(pair));
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
            for (int64_t c = 0; c < NV / 2; c++) {
                acc_lo[g][c] = _mm512_dpbf16_ps(acc_lo[g][c], (__m512bh)lo[c], pp);
                acc_hi[g][c] = _mm512_dpbf16_ps(acc_hi[g][c], (__m512bh)hi[c], pp);
            }
        }
    }
#undef SLOT
#undef PREFETCH
    /* lo holds dims 8j + 0..3 of each 128-bit lane j, hi dims 8j + 4..7: interleave back */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second =
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t g = 0; g < G; g++) {
        float tmp[128];
        for (int64_t c = 0; c < NV / 2; c++) {
            _mm512_storeu_ps(tmp + 32 * c,
                             _mm512_permutex2var_ps(acc_lo[g][c], first, acc_hi[g][c]));
            _mm512_storeu_ps(tmp + 32 * c + 16,
                             _mm512_permutex2var_ps(acc_lo[g][c], second, acc_hi[g][c]));
        }
        store_bf16((uint16_t *)p->out + (s * p->num_heads + h * G + g) * D, tmp, D, inv_sum[g]);
    }
}

/* Specialised for a compile-time group size and head_dim (64 or 128): accumulators stay in
 * registers and the head loops unroll. */
#define SPECIALISE(G, NV)                                                                      \
    static void item_bf16_avx512_##G##_##NV(const params_t *p, float *sc, int64_t s, int64_t h) { \
        item_bf16_avx512(p, sc, s, h, G, NV);                                                  \
    }
#define SPECIALISE_GROUPS(NV)                                                                  \
    SPECIALISE(1, NV) SPECIALISE(2, NV) SPECIALISE(3, NV) SPECIALISE(4, NV)                    \
    SPECIALISE(5, NV) SPECIALISE(6, NV) SPECIALISE(7, NV) SPECIALISE(8, NV)
SPECIALISE_GROUPS(4)
SPECIALISE_GROUPS(8)
#define GROUPS(NV)                                                                             \
    {item_bf16_avx512_1_##NV, item_bf16_avx512_2_##NV, item_bf16_avx512_3_##NV,               \
     item_bf16_avx512_4_##NV, item_bf16_avx512_5_##NV, item_bf16_avx512_6_##NV,               \
     item_bf16_avx512_7_##NV, item_bf16_avx512_8_##NV}
static const item_fn AVX512_ITEMS[2][8] = {GROUPS(4), GROUPS(8)};
#endif

#ifdef HAVE_AVX512_BF16
/* 16 int8 values as 16 float32 lanes. */
static inline __m512 load_int8_ps(const int8_t *src) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
}

/* int8 caches with AVX-512, group <= 8, NV = head_dim / 16 (4 or 8), block_size a power of two.
 * Rows are converted to float32 once and used by every query head of the group:
 *   q . k: the group's dot products per token into a [group][16] tile of vectors, then one
 *     transposing sum (sum16) per head gives 16 scores, times the rows' scales.
 *   p . v: each probability times its row's scale, then one FMA per 16 dims and head.
 * A row is head_dim + 4 bytes: the cache reads half the bytes of bfloat16. */
static inline __attribute__((always_inline)) void item_int8_avx512(
    const params_t *p, float *scores, int64_t s, int64_t h, const int64_t G, const int64_t NV) {
    const int64_t D = NV * 16, R = D + 4, bs = p->block_size;
    const int64_t shift = __builtin_ctzll((uint64_t)bs);
    const int64_t len = p->seq_lens[s], stride = p->max_len;
    const int64_t *table = p->block_tables + s * p->block_table_stride;
    const int8_t *kh = (const int8_t *)p->key_cache + h * p->kv_head_stride;
    const int8_t *vh = (const int8_t *)p->value_cache + h * p->kv_head_stride;
    float inv_sum[8];
#define SLOT(t) (table[(t) >> shift] * bs + ((t) & (bs - 1)))
#define PREFETCH(base, first, last)                                                            \
    for (int64_t j = (first); j < (last) && j < len; j++)                                      \
        for (int64_t c = 0; c < R; c += 64)                                                    \
            _mm_prefetch((const char *)((base) + SLOT(j) * R) + c, _MM_HINT_T0);
    PREFETCH(kh, 0, 32);
    __m512 qv[8][8];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV; c++) {
            const int64_t at = s * p->q_seq_stride + (h * G + g) * D + 16 * c;
            qv[g][c] = p->q_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                       _mm256_loadu_si256((const __m256i *)((const uint16_t *)p->q + at))), 16))
                                 : _mm512_loadu_ps((const float *)p->q + at);
        }
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        PREFETCH(kh, t0 + 32, t0 + 48);
        __m512 dot[8][16];
        float row_scales[16];
        for (int64_t j = 0; j < 16; j++) {
            const int8_t *r = kh + SLOT(t0 + (j < n ? j : 0)) * R;
            row_scales[j] = row_scale(r, D);
            __m512 k[8];
            for (int64_t c = 0; c < NV; c++) k[c] = load_int8_ps(r + 16 * c);
            for (int64_t g = 0; g < G; g++) {
                __m512 d = _mm512_mul_ps(qv[g][0], k[0]);
                for (int64_t c = 1; c < NV; c++) d = _mm512_fmadd_ps(qv[g][c], k[c], d);
                dot[g][j] = d;
            }
        }
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(row_scales), _mm512_set1_ps(p->scale));
        for (int64_t g = 0; g < G; g++)
            _mm512_mask_storeu_ps(scores + g * stride + t0, first_lanes(n),
                                  _mm512_mul_ps(sum16(dot[g]), scale));
    }
    PREFETCH(vh, 0, 32);
    softmax_rows_avx512(scores, p, len, inv_sum);
    __m512 acc[8][8];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < NV; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        PREFETCH(vh, t + 32, t + 33);
        const int8_t *r = vh + SLOT(t) * R;
        const float vs = row_scale(r, D);
        __m512 v[8];
        for (int64_t c = 0; c < NV; c++) v[c] = load_int8_ps(r + 16 * c);
        for (int64_t g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(scores[g * stride + t] * vs);
            for (int64_t c = 0; c < NV; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
#undef SLOT
#undef PREFETCH
    for (int64_t g = 0; g < G; g++) {
        float tmp[128];
        for (int64_t c = 0; c < NV; c++) _mm512_storeu_ps(tmp + 16 * c, acc[g][c]);
        const int64_t at = (s * p->num_heads + h * G + g) * D;
        if (p->q_bf16)
            store_bf16((uint16_t *)p->out + at, tmp, D, inv_sum[g]);
        else
            store_f32((float *)p->out + at, tmp, D, inv_sum[g]);
    }
}

#define SPECIALISE_INT8(G, NV)                                                                 \
    static void item_int8_avx512_##G##_##NV(const params_t *p, float *sc, int64_t s, int64_t h) { \
        item_int8_avx512(p, sc, s, h, G, NV);                                                  \
    }
#define SPECIALISE_INT8_GROUPS(NV)                                                             \
    SPECIALISE_INT8(1, NV) SPECIALISE_INT8(2, NV) SPECIALISE_INT8(3, NV)                       \
    SPECIALISE_INT8(4, NV) SPECIALISE_INT8(5, NV) SPECIALISE_INT8(6, NV)                       \
    SPECIALISE_INT8(7, NV) SPECIALISE_INT8(8, NV)
SPECIALISE_INT8_GROUPS(4)
SPECIALISE_INT8_GROUPS(8)
#define INT8_GROUPS(NV)                                                                        \
    {item_int8_avx512_1_##NV, item_int8_avx512_2_##NV, item_int8_avx512_3_##NV,               \
     item_int8_avx512_4_##NV, item_int8_avx512_5_##NV, item_int8_avx512_6_##NV,               \
     item_int8_avx512_7_##NV, item_int8_avx512_8_##NV}
static const item_fn AVX512_INT8_ITEMS[2][8] = {INT8_GROUPS(4), INT8_GROUPS(8)};
#endif

static int run(params_t *p, item_fn item, int64_t num_seqs, int num_threads) {
    p->max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        if (p->seq_lens[s] > p->max_len) p->max_len = p->seq_lens[s];
    /* scores, q, accumulators and a row (float32), then bfloat16 probabilities (AVX path) */
    const int64_t per_thread = p->group * p->max_len + 2 * p->group * p->head_dim + p->head_dim +
                               p->group * (p->max_len / 2 + 2);
    float *work = malloc((size_t)(num_threads * per_thread) * sizeof(float));
    if (!work) return -1;
    const int64_t num_items = num_seqs * p->num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++)
        item(p, work + omp_get_thread_num() * per_thread, i / p->num_kv_heads, i % p->num_kv_heads);
    free(work);
    return 0;
}

/* The AVX-512 items find a token's block by shift and mask: other block sizes run portable C. */
#define POWER_OF_TWO(n) ((n) > 0 && ((n) & ((n) - 1)) == 0)

#define ENTRY_ARGS                                                                             \
    void *out, const void *q, int64_t q_seq_stride, const void *key_cache,                     \
        const void *value_cache, const int64_t *block_tables, int64_t block_table_stride,      \
        const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,    \
        int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int num_threads

#define PARAMS                                                                                 \
    {q, key_cache, value_cache, out, block_tables, seq_lens, q_seq_stride, block_table_stride, \
     num_heads, num_kv_heads, head_dim, block_size, num_blocks * block_size * head_dim,       \
     num_heads / num_kv_heads, 0, scale, 0}

/* Entry points. Return 0, or -1 when the scratch buffer could not be allocated; the launcher
 * guarantees num_heads / num_kv_heads <= MAX_GROUP. */
int paged_decode_attention_f32(ENTRY_ARGS) {
    params_t p = PARAMS;
    return run(&p, item_f32, num_seqs, num_threads);
}

int paged_decode_attention_bf16(ENTRY_ARGS) {
    params_t p = PARAMS;
    item_fn item = item_bf16;
#ifdef HAVE_AVX512_BF16
    if ((head_dim == 64 || head_dim == 128) && p.group <= 8 && POWER_OF_TWO(block_size))
        item = AVX512_ITEMS[head_dim == 128][p.group - 1];
#endif
    return run(&p, item, num_seqs, num_threads);
}

/* q and out float32 or bfloat16 (q_bf16), the caches int8 rows of head_dim + 4 bytes
 * (reshape_and_cache_int8). */
int paged_decode_attention_int8(ENTRY_ARGS, int q_bf16) {
    params_t p = PARAMS;
    p.kv_head_stride = num_blocks * block_size * (head_dim + 4);
    p.q_bf16 = q_bf16;
    item_fn item = item_int8;
#ifdef HAVE_AVX512_BF16
    if ((head_dim == 64 || head_dim == 128) && p.group <= 8 && POWER_OF_TWO(block_size))
        item = AVX512_INT8_ITEMS[head_dim == 128][p.group - 1];
#endif
    return run(&p, item, num_seqs, num_threads);
}
