/* Helpers shared by the CPU kernels: bfloat16 conversions and a vectorizable exp. */
#pragma once
#include <math.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if (isnan(f)) return 0x7fc0;
    /* round to nearest even, as torch's float -> bfloat16 conversion does */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* 2^f for f in [-0.5, 0.5]: a degree-6 polynomial, relative error below 2e-7. */
static inline float exp2_fraction(float f) {
    float r = 1.5353362e-4f;
    r = r * f + 1.3398874e-3f;
    r = r * f + 9.6180346e-3f;
    r = r * f + 5.5503341e-2f;
    r = r * f + 2.4022651e-1f;
    r = r * f + 6.9314718e-1f;
    return r * f + 1.0f;
}

/* 2^n for an integral n in [-126, 127], built from the exponent bits. */
static inline float exp2_integer(float n) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)((int32_t)n + 127) << 23;
    return v.f;
}

/* exp(x) for x <= 0 (scores minus their maximum) as 2^n * 2^f; 0 below -87. Branch-free, so
 * the softmax loop vectorizes without libm's vector variants. */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.0f ? -126.0f : t;
    const float n = __builtin_rintf(t);
    return x < -87.0f ? 0.0f : exp2_fraction(t - n) * exp2_integer(n);
}

/* exp(x) for any x, like expf at the ends of the range: +inf past ln(FLT_MAX) (so that
 * x / (1 + exp(-x)) gives -0 for very negative x, as torch's SiLU does) and 0 below -86.
 * n reaches 128 at the top, so the scale is applied as 2 * 2^(n - 1). */
static inline float exp_any(float x) {
    const float xc = x < -86.0f ? -86.0f : (x > 88.7228f ? 88.7228f : x);
    const float t = xc * 1.44269504088896341f;
    const float n = __builtin_rintf(t);
    const float e = (2.0f * exp2_fraction(t - n)) * exp2_integer(n - 1.0f);
    return x > 88.7228f ? INFINITY : (x < -86.0f ? 0.0f : e);
}

/* Round a float32 value to bfloat16 and back: what storing an intermediate in bfloat16 does. */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
