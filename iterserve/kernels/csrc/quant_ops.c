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
 *   float32 output with the weight scales already applied.
 *
 * Both round as their torch references in iterserve/kernels/quantized_linear.py do (compiled
 * with -ffp-contract=off). Rows are parallel over torch's OpenMP pool.
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
