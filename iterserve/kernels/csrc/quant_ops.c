/*
 * The per-token steps around an int8 GEMM (W8A8: int8 weights per output channel, int8
 * activations per token, int32 accumulation), each one pass over its rows:
 *
 * - quantize_rows_int8_bf16: x [num_rows, k] bfloat16, times smooth [k] float32 when given
 *   (SmoothQuant's 1 / s per input channel), -> q and scale float32 per row, symmetric:
 *   scale = max|x| / 127, q = round_half_even(x * (127 / max|x|)) in [-127, 127] (a row of
 *   zeros: scale 0, q 0), stored as uint8 q + 128 (zero point 128: oneDNN's VNNI kernels
 *   multiply unsigned activations by signed weights; signed ones fall back to a reference
 *   GEMM hundreds of times slower on CPUs without AMX);
 * - dequantize_rows_bf16: out [num_rows, n] bfloat16 = acc * row scale (+ bias), acc the GEMM's
 *   float32 output with the weight scales already applied;
 * - rms_norm_quantize_bf16: RMSNorm (with the residual add) straight into quantize_rows' q and
 *   scale: the normalised row never goes to memory as bfloat16 (the input of q, k, v and of
 *   gate and up);
 * - silu_and_mul_quantize_bf16: a gate_up GEMM's float32 output, rescaled, through SwiGLU's
 *   silu(gate) * up, straight into the down projection's q and scale: three passes in one.
 *
 * Each rounds as its unfused chain does (the torch references in
 * iterserve/kernels/quantized_linear.py, layer_ops.c's bfloat16 ops; compiled with
 * -ffp-contract=off): a fused kernel gives the bytes its chain gives. Rows are parallel over
 * torch's OpenMP pool.
 */
#include <stdlib.h>

#include "common.h"

/* float -> bfloat16, round to nearest even, NaN -> 0x7fc0: float_to_bf16 without a branch,
 * so the loops around it vectorize. */
static inline uint16_t to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

/* One row: its smoothed values' max |x| -> scale, then q + 128. SMOOTH: multiply by smooth. */
#define QUANTIZE_ROW(LOAD)                                                                     \
    do {                                                                                       \
        float amax = 0.0f;                                                                     \
        _Pragma("omp simd reduction(max : amax)")                                              \
        for (int64_t i = 0; i < k; i++) {                                                      \
            const float v = fabsf(LOAD);                                                       \
            amax = v > amax ? v : amax;                                                        \
        }                                                                                      \
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;                                  \
        scale[r] = amax / 127.0f;                                                              \
        _Pragma("omp simd")                                                                    \
        for (int64_t i = 0; i < k; i++) {                                                      \
            float v = __builtin_rintf((LOAD) * inv);                                           \
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);                             \
            qr[i] = (uint8_t)(int32_t)(v + 128.0f);                                            \
        }                                                                                      \
    } while (0)

void quantize_rows_int8_bf16(uint8_t *q, float *scale, const uint16_t *x, int64_t x_stride,
                             const float *smooth, int64_t num_rows, int64_t k, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (num_rows * k > 65536)")
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint8_t *qr = q + r * k;
        if (smooth)
            QUANTIZE_ROW(bf16_to_float(xr[i]) * smooth[i]);
        else
            QUANTIZE_ROW(bf16_to_float(xr[i]));
    }
}

void dequantize_rows_bf16(uint16_t *out, const float *acc, const float *scale,
                          const uint16_t *bias, int64_t num_rows, int64_t n, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (num_rows * n > 65536)")
    for (int64_t r = 0; r < num_rows; r++) {
        const float *ar = acc + r * n;
        uint16_t *o = out + r * n;
        const float s = scale[r];
        if (bias) {
            _Pragma("omp simd")
            for (int64_t i = 0; i < n; i++) {
                const float rounded = bf16_to_float(to_bf16(ar[i] * s));
                o[i] = to_bf16(rounded + bf16_to_float(bias[i]));
            }
        } else {
            _Pragma("omp simd")
            for (int64_t i = 0; i < n; i++) o[i] = to_bf16(ar[i] * s);
        }
    }
}

/* Fills buf [k] with row r's values before quantization (a fused kernel's first part). */
typedef void (*fill_fn)(const void *args, int64_t r, float *buf);

/* The fused kernels' frame: rows in parallel (above threshold elements), each thread one
 * float32 scratch row that fill fills, then quantize_rows_int8_bf16's row (times smooth when
 * given) into q [num_rows, k] and scale. Returns 0, or -1 when a thread's scratch could not be
 * allocated (its rows are left unwritten). */
static int quantize_filled_rows(uint8_t *q, float *scale, const float *smooth, int64_t num_rows,
                                int64_t k, int64_t threshold, int num_threads, fill_fn fill,
                                const void *args) {
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) if (num_rows * k > threshold)")
    {
        float *buf = (float *)malloc((size_t)k * sizeof(float));
        if (!buf) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for")
        for (int64_t r = 0; r < num_rows; r++) {
            if (!buf) continue;
            uint8_t *qr = q + r * k;
            fill(args, r, buf);
            if (smooth)
                QUANTIZE_ROW(buf[i] * smooth[i]);
            else
                QUANTIZE_ROW(buf[i]);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

typedef struct {
    const uint16_t *x, *weight;
    uint16_t *residual;
    int64_t x_stride, k;
    float eps;
} rms_args_t;

/* rms_norm_bf16 (layer_ops.c) of row r, residual sum stored back: the bfloat16 outputs. */
static void fill_rms_norm(const void *args, int64_t r, float *buf) {
    const rms_args_t *a = (const rms_args_t *)args;
    const int64_t k = a->k;
    const uint16_t *xr = a->x + r * a->x_stride;
    uint16_t *res = a->residual ? a->residual + r * k : NULL;
    if (res) {
        _Pragma("omp simd")
        for (int64_t i = 0; i < k; i++)
            res[i] = float_to_bf16(bf16_to_float(xr[i]) + bf16_to_float(res[i]));
    }
    const uint16_t *src = res ? res : xr;
    float sum_sq = 0.0f;
    _Pragma("omp simd reduction(+ : sum_sq)")
    for (int64_t i = 0; i < k; i++) sum_sq += bf16_to_float(src[i]) * bf16_to_float(src[i]);
    const float inv_rms = 1.0f / sqrtf(sum_sq / (float)k + a->eps);
    _Pragma("omp simd")
    for (int64_t i = 0; i < k; i++)
        buf[i] = round_bf16(bf16_to_float(a->weight[i]) * round_bf16(bf16_to_float(src[i]) * inv_rms));
}

/* rms_norm_bf16 (layer_ops.c) of x (+ residual, stored back as the sum) then
 * quantize_rows_int8_bf16 of the normalised bfloat16 row (times smooth when given).
 * Returns 0, or -1 when a thread's scratch could not be allocated. */
int rms_norm_quantize_bf16(uint8_t *q, float *scale, const uint16_t *x, int64_t x_stride,
                           uint16_t *residual, const uint16_t *weight, const float *smooth,
                           int64_t num_rows, int64_t k, float eps, int num_threads) {
    const rms_args_t args = {x, weight, residual, x_stride, k, eps};
    return quantize_filled_rows(q, scale, smooth, num_rows, k, 65536, num_threads, fill_rms_norm,
                                &args);
}

typedef struct {
    const float *acc, *acc_scale;
    int64_t inter;
} swiglu_args_t;

/* dequantize_rows_bf16 then silu_and_mul_bf16 (layer_ops.c) of row r: the bfloat16 outputs. */
static void fill_silu_and_mul(const void *args, int64_t r, float *buf) {
    const swiglu_args_t *a = (const swiglu_args_t *)args;
    const int64_t inter = a->inter;
    const float *g = a->acc + r * 2 * inter, *u = g + inter, s = a->acc_scale[r];
    _Pragma("omp simd")
    for (int64_t i = 0; i < inter; i++) {
        const float v = round_bf16(g[i] * s);
        buf[i] = round_bf16(round_bf16(v / (1.0f + exp_any(-v))) * round_bf16(u[i] * s));
    }
}

/* acc [num_rows, 2 * inter] float32 (a gate_up GEMM's output, weight scales applied, gate
 * columns first), acc_scale [num_rows]: dequantize_rows_bf16, then silu_and_mul_bf16
 * (layer_ops.c), then quantize_rows_int8_bf16 (times smooth when given) into q [num_rows,
 * inter] and scale. Returns 0, or -1 when a thread's scratch could not be allocated. */
int silu_and_mul_quantize_bf16(uint8_t *q, float *scale, const float *acc,
                               const float *acc_scale, const float *smooth, int64_t num_rows,
                               int64_t inter, int num_threads) {
    const swiglu_args_t args = {acc, acc_scale, inter};
    return quantize_filled_rows(q, scale, smooth, num_rows, inter, 16384, num_threads,
                                fill_silu_and_mul, &args);
}
