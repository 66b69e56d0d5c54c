/*
 * Elementwise layer ops of a Llama decoder layer for CPUs, each one pass over its rows instead
 * of torch's chain of small ops (each a dispatch, a temporary and an OpenMP fork): RMSNorm
 * with the residual add, SiLU-and-multiply, rotary embedding in place, and the KV-cache write.
 *
 * Every op has a float32 and a bfloat16 version. The bfloat16 versions round every
 * intermediate that Hugging Face's modules keep in bfloat16 (the residual sum, the normalised
 * row before the weight, SiLU before the multiply, the rotary products), so they compute what
 * the torch reference computes, not a more precise variant of it. Compiled with
 * -ffp-contract=off for the same reason. Rows are parallel over torch's OpenMP pool.
 *
 * Strides are in elements; a row stride lets q, k and v be views into the fused qkv output.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define F32_LOAD(p, i) ((p)[i])
#define F32_STORE(x) (x)
#define F32_ROUND(x) (x)
#define BF16_LOAD(p, i) bf16_to_float((p)[i])
#define BF16_STORE(x) float_to_bf16(x)
#define BF16_ROUND(x) round_bf16(x)

/* out[t] = weight * normalise(x[t] (+ residual[t])), and residual[t] = the sum when given.
 * x, out: [num_tokens, hidden] (x rows x_stride apart, out contiguous); residual: contiguous
 * or NULL; weight: [hidden]. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                           \
    void NAME(T *out, const T *x, int64_t x_stride, T *residual, const T *weight,              \
              int64_t num_tokens, int64_t hidden, float eps, int num_threads) {                \
        _Pragma("omp parallel for num_threads(num_threads) if (num_tokens > 1)")               \
        for (int64_t t = 0; t < num_tokens; t++) {                                             \
            const T *xr = x + t * x_stride;                                                    \
            T *res = residual ? residual + t * hidden : NULL;                                  \
            T *o = out + t * hidden;                                                           \
            if (res) {                                                                         \
                _Pragma("omp simd")                                                            \
                for (int64_t i = 0; i < hidden; i++)                                           \
                    res[i] = STORE(LOAD(xr, i) + LOAD(res, i));                                \
            }                                                                                  \
            const T *src = res ? res : xr;                                                     \
            float sum_sq = 0.0f;                                                               \
            _Pragma("omp simd reduction(+ : sum_sq)")                                          \
            for (int64_t i = 0; i < hidden; i++) sum_sq += LOAD(src, i) * LOAD(src, i);        \
            const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);                  \
            _Pragma("omp simd")                                                                \
            for (int64_t i = 0; i < hidden; i++)                                               \
                o[i] = STORE(LOAD(weight, i) * ROUND(LOAD(src, i) * inv_rms));                 \
        }                                                                                      \
    }

/* out [num_tokens, inter] = silu(gate) * up, gate_up [num_tokens, 2 * inter] (gate first). */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                       \
    void NAME(T *out, const T *gate_up, int64_t num_tokens, int64_t inter, int num_threads) {  \
        _Pragma("omp parallel for num_threads(num_threads) if (num_tokens * inter > 16384)")   \
        for (int64_t t = 0; t < num_tokens; t++) {                                             \
            const T *g = gate_up + t * 2 * inter, *u = g + inter;                              \
            T *o = out + t * inter;                                                            \
            _Pragma("omp simd")                                                                \
            for (int64_t i = 0; i < inter; i++) {                                              \
                const float v = LOAD(g, i);                                                    \
                o[i] = STORE(ROUND(v / (1.0f + exp_any(-v))) * LOAD(u, i));                \
            }                                                                                  \
        }                                                                                      \
    }

/* Rotary embedding (half-split layout) of q [num_tokens, num_heads, head_dim] and
 * k [num_tokens, num_kv_heads, head_dim] in place; cos, sin: [max_position, head_dim] in T.
 * Returns the number of positions outside [0, max_position) (those tokens are left as they
 * are: the caller raises). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                             \
    static void NAME##_heads(T *x, int64_t num_heads, int64_t head_dim, const T *c,            \
                             const T *s) {                                                     \
        const int64_t half = head_dim / 2;                                                     \
        for (int64_t h = 0; h < num_heads; h++) {                                              \
            T *xh = x + h * head_dim;                                                          \
            for (int64_t i = 0; i < half; i++) {                                               \
                const float x1 = LOAD(xh, i), x2 = LOAD(xh, i + half);                         \
                const float c1 = LOAD(c, i), s1 = LOAD(s, i);                                  \
                const float c2 = LOAD(c, i + half), s2 = LOAD(s, i + half);                    \
                xh[i] = STORE(ROUND(x1 * c1) + ROUND(-x2 * s1));                               \
                xh[i + half] = STORE(ROUND(x2 * c2) + ROUND(x1 * s2));                         \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const int64_t *positions,    \
                 const T *cos, const T *sin, int64_t num_tokens, int64_t num_heads,            \
                 int64_t num_kv_heads, int64_t head_dim, int64_t max_position,                 \
                 int num_threads) {                                                            \
        int64_t bad = 0;                                                                       \
        _Pragma("omp parallel for num_threads(num_threads) if (num_tokens > 4) reduction(+:bad)") \
        for (int64_t t = 0; t < num_tokens; t++) {                                             \
            const int64_t pos = positions[t];                                                  \
            if (pos < 0 || pos >= max_position) {                                              \
                bad++;                                                                         \
                continue;                                                                      \
            }                                                                                  \
            const T *c = cos + pos * head_dim, *s = sin + pos * head_dim;                      \
            NAME##_heads(q + t * q_stride, num_heads, head_dim, c, s);                         \
            NAME##_heads(k + t * k_stride, num_kv_heads, head_dim, c, s);                      \
        }                                                                                      \
        return bad;                                                                            \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, BF16_LOAD, BF16_STORE, BF16_ROUND)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, BF16_LOAD, BF16_STORE, BF16_ROUND)
DEFINE_ROTARY(rotary_embedding_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_ROTARY(rotary_embedding_bf16, uint16_t, BF16_LOAD, BF16_STORE, BF16_ROUND)

/* Write each token's key and value rows into its cache slot: key, value [num_tokens,
 * num_kv_heads, head_dim] (token rows kv_stride apart); caches [num_kv_heads, num_slots,
 * head_dim] (num_slots = num_blocks * block_size); any dtype of elem_size bytes. A negative
 * slot skips the token. Returns the number of slots >= num_slots (skipped too: the caller
 * raises). */
int64_t reshape_and_cache(const char *key, const char *value, int64_t kv_stride, char *key_cache,
                          char *value_cache, const int64_t *slot_mapping, int64_t num_tokens,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                          int64_t elem_size) {
    const size_t row = (size_t)(head_dim * elem_size);
    int64_t num_bad = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
            num_bad++;
            continue;
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const size_t src = (size_t)((t * kv_stride + h * head_dim) * elem_size);
            const size_t dst = (size_t)((h * num_slots + slot) * head_dim * elem_size);
            memcpy(key_cache + dst, key + src, row);
            memcpy(value_cache + dst, value + src, row);
        }
    }
    return num_bad;
}

/* reshape_and_cache into an int8 cache: each (token, KV head) row of head_dim values is stored
 * as head_dim int8 values followed by its float32 scale (row_bytes = head_dim + 4): scale =
 * max |x| / 127, q = round-half-even(x * (127 / max |x|)), as the torch reference
 * quantize_kv_rows computes it (a zero row has scale 0 and zeros). key and value are float32
 * or bfloat16 (is_bf16), rows kv_stride elements apart; tokens in parallel. Returns the count
 * of slots past the cache. */
static void quantize_row(int8_t *dst, const float *x, int64_t head_dim) {
    float absmax = 0.0f;
    int nan = 0;
#pragma omp simd reduction(max : absmax) reduction(| : nan)
    for (int64_t d = 0; d < head_dim; d++) {
        absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
        nan |= x[d] != x[d];
    }
    if (nan) absmax = NAN; /* as torch's amax: the scale is NaN, the row reads back NaN */
    const float scale = absmax / 127.0f, inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    /* NaN (a NaN value, or inf * 0 in a row holding inf): 0; past +-127 (inv overflowing for
     * a denormal row): +-127. As the reference's nan_to_num and clamp. */
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) {
        const float v = x[d] * inv, c = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
        dst[d] = v == v ? (int8_t)__builtin_rintf(c) : 0;
    }
    memcpy(dst + head_dim, &scale, sizeof(scale));
}

static void load_row(float *x, const char *src, int64_t head_dim, int is_bf16) {
    if (is_bf16) {
        const uint16_t *b = (const uint16_t *)src;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) x[d] = bf16_to_float(b[d]);
    } else {
        memcpy(x, src, (size_t)head_dim * sizeof(float));
    }
}

int64_t reshape_and_cache_int8(const char *key, const char *value, int64_t kv_stride,
                               int8_t *key_cache, int8_t *value_cache,
                               const int64_t *slot_mapping, int64_t num_tokens,
                               int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int is_bf16, int num_threads) {
    const int64_t elem = is_bf16 ? 2 : 4, row_bytes = head_dim + 4;
    int64_t num_bad = 0;
#pragma omp parallel for num_threads(num_threads) if (num_tokens > 8) reduction(+ : num_bad)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
            num_bad++;
            continue;
        }
        float x[512];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t src = (t * kv_stride + h * head_dim) * elem;
            const int64_t dst = (h * num_slots + slot) * row_bytes;
            load_row(x, key + src, head_dim, is_bf16);
            quantize_row(key_cache + dst, x, head_dim);
            load_row(x, value + src, head_dim, is_bf16);
            quantize_row(value_cache + dst, x, head_dim);
        }
    }
    return num_bad;
}

/* quantize_row's rows back to values: out[r] = q[r] * scale[r], rows of head_dim int8 then
 * the float32 scale (row_bytes apart), out float32 or bfloat16 (is_bf16) contiguous. */
void dequantize_kv_rows(char *out, const int8_t *rows, int64_t num_rows, int64_t head_dim,
                        int is_bf16, int num_threads) {
    const int64_t row_bytes = head_dim + 4;
#pragma omp parallel for num_threads(num_threads) if (num_rows > 64)
    for (int64_t r = 0; r < num_rows; r++) {
        const int8_t *q = rows + r * row_bytes;
        float scale;
        memcpy(&scale, q + head_dim, sizeof(scale));
        if (is_bf16) {
            uint16_t *o = (uint16_t *)out + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] = float_to_bf16((float)q[d] * scale);
        } else {
            float *o = (float *)out + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] = (float)q[d] * scale;
        }
    }
}

/* out[r] = the index of the largest of the n values of row r (rows row_stride apart): the
 * first one on ties, the first NaN if any (torch.argmax's rules). Greedy sampling reads the
 * logits in their own dtype: no float32 copy of [num_seqs, vocab]. Two vectorizable passes:
 * the row's maximum (and whether it holds a NaN), then the first position holding it, found
 * 64 values at a time. */
#define ARGMAX_CHUNK 64
#define DEFINE_ARGMAX_ROWS(NAME, T, LOAD)                                                      \
    static int64_t NAME##_first(const T *row, int64_t n, float target, int is_nan) {           \
        for (int64_t c = 0; c < n; c += ARGMAX_CHUNK) {                                        \
            const int64_t end = c + ARGMAX_CHUNK < n ? c + ARGMAX_CHUNK : n;                   \
            int found = 0;                                                                     \
            _Pragma("omp simd reduction(| : found)")                                           \
            for (int64_t i = c; i < end; i++) {                                                \
                const float v = LOAD(row, i);                                                  \
                found |= is_nan ? v != v : v == target;                                        \
            }                                                                                  \
            if (found)                                                                         \
                for (int64_t i = c; i < end; i++) {                                            \
                    const float v = LOAD(row, i);                                              \
                    if (is_nan ? v != v : v == target) return i;                               \
                }                                                                              \
        }                                                                                      \
        return 0; /* unreachable: the target is in the row */                                 \
    }                                                                                          \
    void NAME(int64_t *out, const T *x, int64_t num_rows, int64_t n, int64_t row_stride,       \
              int num_threads) {                                                               \
        _Pragma("omp parallel for num_threads(num_threads) if (num_rows > 1)")                 \
        for (int64_t r = 0; r < num_rows; r++) {                                               \
            const T *row = x + r * row_stride;                                                 \
            float best = -INFINITY;                                                            \
            int has_nan = 0;                                                                   \
            _Pragma("omp simd reduction(max : best) reduction(| : has_nan)")                   \
            for (int64_t i = 0; i < n; i++) {                                                  \
                const float v = LOAD(row, i);                                                  \
                best = v > best ? v : best;                                                    \
                has_nan |= v != v;                                                             \
            }                                                                                  \
            out[r] = NAME##_first(row, n, best, has_nan);                                      \
        }                                                                                      \
    }

DEFINE_ARGMAX_ROWS(argmax_rows_f32, float, F32_LOAD)
DEFINE_ARGMAX_ROWS(argmax_rows_bf16, uint16_t, BF16_LOAD)
