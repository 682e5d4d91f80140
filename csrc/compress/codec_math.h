/* Per-element math of commlib.compress's block quantizers (int8, int4, fp8 e4m3/e5m2): one
 * definition for the CPU fast path (csrc/compress/codecs.c, built by gcc) and the CUDA kernels
 * (csrc/compress.cu, built by nvcc/NVRTC). The format is the torch definition of
 * commlib/compress (the spec, docs in commlib/compress/codec.py); tests/test_compress_c.py checks
 * the host build against it bit for bit.
 *
 * Per block of float32 values x_i (every input is widened to float32 exactly):
 *   a = max |x_i|, s = a / QMAX, s_st = s in the scale dtype (RNE), s_st = NaN when a block value
 *   or s_st is not finite, s_q = float32(s_st); codes = ZERO when s_q is NaN or 0, else
 *   quantize(x_i / s_q). Decode: dequantize(q) * s_q, rounded once to the output dtype (after one
 *   float32 add to the output's value when accumulating).
 *
 * All float32 IEEE arithmetic in round-to-nearest-even, no FMA (the host build has
 * -ffp-contract=off; nothing here has a multiply feeding an add). Everything is CL_HD and free of
 * library calls, like reduce_math.h, whose float16/bfloat16 conversions are reused. */
#ifndef COMMLIB_CODEC_MATH_H
#define COMMLIB_CODEC_MATH_H

#include "../reduce_math.h"

#ifdef __CUDACC_RTC__
typedef unsigned char cl_u8;
#else
typedef uint8_t cl_u8;
#endif

/* Codec kinds, shared with commlib/compress/_fast.py and commlib/compress/cuda.py. */
enum { CL_INT8 = 0, CL_INT4 = 1, CL_E4M3 = 2, CL_E5M2 = 3, CL_NKINDS = 4 };

/* QMAX of each kind: the largest code magnitude (int8, int4) or the format's largest finite
 * value (fp8: float8_e4m3fn 448, float8_e5m2 57344). */
CL_HD float cl_qmax(int kind) {
    switch (kind) {
    case CL_INT8: return 127.0f;
    case CL_INT4: return 7.0f;
    case CL_E4M3: return 448.0f;
    default: return 57344.0f;
    }
}

/* The code of a zero (and of every value of a block whose scale is NaN or 0): int4 stores the
 * nibble q + 8. */
CL_HD cl_u32 cl_zero_code(int kind) { return kind == CL_INT4 ? 8u : 0u; }

/* ----- the scale ------------------------------------------------------------------------------ */
/* |x| as bits: for non-negative floats the integer order is the value order, and NaN's bits are
 * above +inf's, so the block's absmax is an integer max and "the block has a non-finite value"
 * is "the max is >= 0x7f800000" (no NaN-propagating float max needed). */
CL_HD cl_u32 cl_abs_bits(float x) { return cl_f32_bits(x) & 0x7fffffffu; }

/* The stored scale of a block whose absmax has bits `abits`: float32 bits, or float16 bits in the
 * low 16 when `scale_f16`. Non-finite block or scale -> the canonical quiet NaN (0x7fc00000 /
 * 0x7e00). */
CL_HD cl_u32 cl_scale_store(cl_u32 abits, float qmax, int scale_f16) {
    if (abits >= 0x7f800000u)
        return scale_f16 ? 0x7e00u : 0x7fc00000u;
    float s = cl_bits_f32(abits) / qmax;
    if (!scale_f16)
        return cl_f32_bits(s); /* a finite / qmax >= 7: finite */
    cl_u16 h = cl_f32_to_f16(s);
    return (h & 0x7c00u) == 0x7c00u ? 0x7e00u : h; /* overflowed to inf -> NaN */
}

/* float32(s_st): the scale the codes are divided by and multiplied with. */
CL_HD float cl_scale_load(cl_u32 stored, int scale_f16) {
    return scale_f16 ? cl_f16_to_f32((cl_u16)stored) : cl_bits_f32(stored);
}

/* 1 when a block with this scale stores ZERO codes (and decodes to 0 or NaN). */
CL_HD int cl_scale_zero_codes(float s_q) { return s_q != s_q || s_q == 0.0f; }

/* ----- int8 / int4 ---------------------------------------------------------------------------- */
/* clamp(y, -q, q): y is never NaN here (a NaN scale means ZERO codes); -0 stays -0. */
CL_HD float cl_clampf(float y, float q) { return y < -q ? -q : (y > q ? q : y); }

/* Round half to even of |y| <= 2^22: adding and removing 1.5 * 2^23 leaves the integer that the
 * addition's own RNE rounding chose (what torch.round does; no rintf, no library). IEEE
 * compilers keep both additions (folding (y + c) - c needs -ffast-math, which is never used). */
CL_HD float cl_round_even(float y) {
    float t = y + 12582912.0f;
    return t - 12582912.0f;
}

/* int8: clamp(round_half_even(y), -127, 127) as the two's complement byte. Clamping first is the
 * same (the bounds are integers and rounding is monotone). */
CL_HD cl_u32 cl_q_int8(float y) { return (cl_u32)(int)cl_round_even(cl_clampf(y, 127.0f)) & 0xffu; }

/* int4: clamp(round_half_even(y), -7, 7) + 8, a nibble in 1..15. */
CL_HD cl_u32 cl_q_int4(float y) { return (cl_u32)((int)cl_round_even(cl_clampf(y, 7.0f)) + 8); }

/* ----- fp8 ------------------------------------------------------------------------------------ */
/* float32 -> float8_e4m3fn, round to nearest even, subnormals included: PyTorch's
 * c10::detail::fp8e4m3fn_from_fp32_value, step for step. |f| >= 480 (and NaN) -> 0x7f (NaN; the
 * format has no inf); the codec clamps to +-448 first. */
CL_HD cl_u32 cl_f32_to_e4m3(float f) {
    cl_u32 u = cl_f32_bits(f);
    cl_u32 sign = u & 0x80000000u;
    u ^= sign;
    cl_u32 r;
    if (u >= (1087u << 20)) {
        r = 0x7fu;
    } else if (u < (121u << 23)) { /* below 2^-6: the float add rounds to a multiple of 2^-9 */
        r = cl_f32_bits(cl_bits_f32(u) + cl_bits_f32(141u << 23)) - (141u << 23);
    } else {
        cl_u32 odd = (u >> 20) & 1u;
        r = (u + (cl_u32)((7 - 127) * (1 << 23)) + 0x7ffffu + odd) >> 20;
    }
    return (r | (sign >> 24)) & 0xffu;
}

/* float32 -> float8_e5m2 (c10::detail::fp8e5m2_from_fp32_value): >= 65536 -> inf 0x7c, NaN ->
 * 0x7f. */
CL_HD cl_u32 cl_f32_to_e5m2(float f) {
    cl_u32 u = cl_f32_bits(f);
    cl_u32 sign = u & 0x80000000u;
    u ^= sign;
    cl_u32 r;
    if (u >= (143u << 23)) {
        r = u > 0x7f800000u ? 0x7fu : 0x7cu;
    } else if (u < (113u << 23)) { /* below 2^-14: the float add rounds to a multiple of 2^-16 */
        r = cl_f32_bits(cl_bits_f32(u) + cl_bits_f32(134u << 23)) - (134u << 23);
    } else {
        cl_u32 odd = (u >> 21) & 1u;
        r = (u + (cl_u32)((15 - 127) * (1 << 23)) + 0xfffffu + odd) >> 21;
    }
    return (r | (sign >> 24)) & 0xffu;
}

/* fp8 -> float32, exact. e4m3: the magnitude m = byte & 0x7f: normal values are the byte's bits
 * moved into float32's fields and rebiased; subnormals (exponent 0) are m * 2^-9, exact. e4m3fn: 0x7f / 0xff are NaN (returned as the canonical 0x7fc00000, signed);
 * e5m2: exponent 31 is inf (mantissa 0) or NaN. */
CL_HD float cl_e4m3_to_f32(cl_u32 b) {
    cl_u32 m = b & 0x7fu, sign = (b & 0x80u) << 24;
    cl_u32 bits;
    if (m == 0x7fu)
        bits = 0x7fc00000u;
    else if (m < 8u)
        bits = cl_f32_bits((float)(int)m * 0.001953125f); /* 2^-9 */
    else
        bits = (m << 20) + (120u << 23);
    return cl_bits_f32(bits | sign);
}

/* e5m2 is float16 with the low 8 mantissa bits cut: its value is the float16 of bits b << 8
 * (what c10's fp8e5m2_to_fp32_value does). */
CL_HD float cl_e5m2_to_f32(cl_u32 b) { return cl_f16_to_f32((cl_u16)(b << 8)); }

/* fp8: the bit pattern of clamp(y, -FMAX, FMAX) converted RNE. */
CL_HD cl_u32 cl_q_e4m3(float y) { return cl_f32_to_e4m3(cl_clampf(y, 448.0f)); }
CL_HD cl_u32 cl_q_e5m2(float y) { return cl_f32_to_e5m2(cl_clampf(y, 57344.0f)); }

/* ----- per kind ------------------------------------------------------------------------------- */
/* The code of y = x / s_q (int4: the nibble). */
CL_HD cl_u32 cl_quantize(int kind, float y) {
    switch (kind) {
    case CL_INT8: return cl_q_int8(y);
    case CL_INT4: return cl_q_int4(y);
    case CL_E4M3: return cl_q_e4m3(y);
    default: return cl_q_e5m2(y);
    }
}

/* The value of a code, before the scale (int4: of the nibble). */
CL_HD float cl_dequantize(int kind, cl_u32 code) {
    switch (kind) {
    case CL_INT8: return (float)(int)(signed char)(cl_u8)code;
    case CL_INT4: return (float)((int)code - 8);
    case CL_E4M3: return cl_e4m3_to_f32(code);
    default: return cl_e5m2_to_f32(code);
    }
}

/* Element i's code from the payload (int4: element 2k in the low nibble of byte k, 2k+1 in the
 * high one). */
CL_HD cl_u32 cl_code_at(int kind, const cl_u8 *payload, size_t i) {
    if (kind == CL_INT4)
        return (i & 1) ? (cl_u32)(payload[i >> 1] >> 4) : (cl_u32)(payload[i >> 1] & 0x0fu);
    return payload[i];
}

/* Writes element i's code (int4: its nibble) into the payload. int4 for a writer that goes in
 * element order: an even element writes its byte with the high nibble 8 (the padding of an odd
 * n), the odd element after it replaces that nibble (the CUDA kernels write whole bytes). */
CL_HD void cl_put_code(int kind, cl_u8 *payload, size_t i, cl_u32 code) {
    if (kind != CL_INT4)
        payload[i] = (cl_u8)code;
    else if (i & 1)
        payload[i >> 1] = (cl_u8)((payload[i >> 1] & 0x0fu) | (code << 4));
    else
        payload[i >> 1] = (cl_u8)(code | 0x80u);
}

/* ----- input and output dtypes (CL_F32 / CL_F16 / CL_BF16 of reduce_math.h) ------------------ */
CL_HD float cl_load_as_f32(int dtype, const void *p, size_t i) {
    if (dtype == CL_F32)
        return ((const float *)p)[i];
    cl_u16 h = ((const cl_u16 *)p)[i];
    return dtype == CL_F16 ? cl_f16_to_f32(h) : cl_bf16_to_f32(h);
}

CL_HD void cl_store_from_f32(int dtype, void *p, size_t i, float v) {
    if (dtype == CL_F32)
        ((float *)p)[i] = v;
    else
        ((cl_u16 *)p)[i] = dtype == CL_F16 ? cl_f32_to_f16(v) : cl_f32_to_bf16(v);
}

/* out_i = cast(v) or, accumulating, cast(float32(out_i) + v): one float32 add, one rounding. */
CL_HD void cl_put(int dtype, void *p, size_t i, float v, int accumulate) {
    if (accumulate)
        v = cl_load_as_f32(dtype, p, i) + v;
    cl_store_from_f32(dtype, p, i, v);
}

#endif
