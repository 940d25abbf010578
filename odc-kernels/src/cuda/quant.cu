// ODC block-scaled quantise / dequantise kernels for device memory.
//
// Compiled at run time by NVRTC (see quant.rs), as a program of its own.
// Self-contained like kernels.cu: no CUDA header, and every conversion is
// spelled out as odc-kernels/src/cpu/quant/mod.rs defines it, so a device
// result is bit-identical to the host one (NaN payloads aside):
//
//   scale = amax / qmax over the block's finite |x| (0 for an all-zero
//           block; at least the smallest normal f32 otherwise), inv = 1 / scale
//   fp8:  code = torch's float8_e4m3fn cast of clamp(x * inv, -448, 448);
//         non-finite x -> 0x7f | sign(x)
//   int8: code = round_half_even(clamp(x * inv, -127, 127)); non-finite x -> -128
//   value(code) * scale, then acc + factor * that (multiplies, then an add)
//
// Every operation is an explicitly rounded intrinsic (__fmul_rn, __fadd_rn,
// __fdiv_rn), never contracted into an FMA; the options add --fmad=false.
//
// Shape: every kernel gives each block of `block` elements to one warp
// (lanes stride through it; in quantise a shuffle reduction finds amax), and
// warps stride over the blocks. Launch with whole warps (blockDim.x a
// multiple of 32).
//
// Entry points (C linkage, names checked by the tests):
//   odc_quantise_<fmt>(const float* src, u8* codes, float* scales, u64 n, u32 block)
//   odc_dequantise_accumulate_<fmt>(float* acc, const u8* codes, const float* scales,
//                                   u64 n, u32 block, float factor)
//   odc_dequantise_<fmt>_to_<dst>(const u8* codes, const float* scales, dst* out, u64 n, u32 block)
//   odc_zero_non_finite(float* x, u64 n)   (error feedback's last step)
// with <fmt> in {fp8, int8} and <dst> in {f32, bf16}. The bf16 format has no
// kernels here: it is kernels.cu's f32 <-> bf16 cast and accumulate.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long long u64;

struct bf16 { u16 bits; };

#define FP8 0
#define INT8 1

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7fffffffu) < 0x7f800000u; }

// torch's float8_e4m3fn cast (c10 fp8e4m3fn_from_fp32_value): round to
// nearest even, subnormals kept, NaN for magnitudes that round past 448.
__device__ __forceinline__ u32 fp8_from_f32(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = bits & 0x80000000u;
    u32 abs = bits ^ sign;
    u32 code;
    if (abs >= (1087u << 20)) {
        code = 0x7fu;
    } else if (abs < (121u << 23)) {
        // Adding 2^14 rounds at the subnormal step 2^-9.
        u32 sum = __float_as_uint(__fadd_rn(__uint_as_float(abs), __uint_as_float(141u << 23)));
        code = sum - (141u << 23);
    } else {
        u32 odd = (abs >> 20) & 1u;
        code = (abs + (u32)(((7u - 127u) << 23) + 0x7ffffu) + odd) >> 20;
    }
    return code | (sign >> 24);
}

// The exact value of an fp8 code; quiet NaN with the code's sign for S.1111.111.
// Never forms a subnormal f32.
__device__ __forceinline__ float fp8_value(u32 code) {
    u32 sign = (code & 0x80u) << 24;
    u32 abs = code & 0x7fu;
    float v;
    if (abs == 0x7fu) {
        v = __uint_as_float(0x7fc00000u);
    } else if (abs < 8u) {
        v = __fmul_rn((float)abs, 0.001953125f);  // mantissa * 2^-9
    } else {
        v = __uint_as_float((abs << 20) + (120u << 23));
    }
    return __uint_as_float(__float_as_uint(v) | sign);
}

__device__ __forceinline__ float int8_value(u32 code) {
    int c = (int)(i8)(u8)code;
    return c == -128 ? __uint_as_float(0x7fc00000u) : (float)c;
}

template <int F> __device__ __forceinline__ float value(u8 code);
template <> __device__ __forceinline__ float value<FP8>(u8 code) { return fp8_value(code); }
template <> __device__ __forceinline__ float value<INT8>(u8 code) { return int8_value(code); }

template <int F> __device__ __forceinline__ float qmax();
template <> __device__ __forceinline__ float qmax<FP8>() { return 448.0f; }
template <> __device__ __forceinline__ float qmax<INT8>() { return 127.0f; }

template <int F> __device__ __forceinline__ u8 encode(float x, float inv);

template <> __device__ __forceinline__ u8 encode<FP8>(float x, float inv) {
    if (!is_finite(x)) return (u8)(0x7fu | ((__float_as_uint(x) >> 24) & 0x80u));
    float v = fminf(fmaxf(__fmul_rn(x, inv), -448.0f), 448.0f);
    return (u8)fp8_from_f32(v);
}

template <> __device__ __forceinline__ u8 encode<INT8>(float x, float inv) {
    if (!is_finite(x)) return (u8)0x80u;
    float v = fminf(fmaxf(__fmul_rn(x, inv), -127.0f), 127.0f);
    return (u8)(i8)__float2int_rn(v);  // round half to even
}

// f32 to bf16, round to nearest even; a NaN stays NaN (quiet), as kernels.cu.
__device__ __forceinline__ bf16 to_bf16(float x) {
    u32 bits = __float_as_uint(x);
    bf16 out;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        out.bits = (u16)((bits >> 16) | 0x0040u);
        return out;
    }
    u32 lower = bits & 0xffffu;
    u32 upper = bits >> 16;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) upper += 1u;
    out.bits = (u16)upper;
    return out;
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = to_bf16(v); }

__device__ __forceinline__ u64 thread_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 thread_count() { return (u64)gridDim.x * blockDim.x; }

template <int F>
__device__ __forceinline__ void quantise(const float* __restrict__ src, u8* __restrict__ codes,
                                         float* __restrict__ scales, u64 n, u32 block) {
    // blockDim.x is a multiple of 32, so every warp is whole and the loop
    // over scale blocks is uniform across its lanes (the shuffles need that).
    u64 warp = thread_index() / 32;
    u64 warps = thread_count() / 32;
    u32 lane = threadIdx.x & 31u;
    u64 nblocks = (n + block - 1) / block;
    for (u64 b = warp; b < nblocks; b += warps) {
        u64 start = b * block;
        u64 end = start + block < n ? start + block : n;
        float amax = 0.0f;
        for (u64 i = start + lane; i < end; i += 32) {
            float a = fabsf(src[i]);
            if (is_finite(a)) amax = fmaxf(amax, a);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        float scale = 0.0f, inv = 0.0f;
        if (amax != 0.0f) {
            scale = fmaxf(__fdiv_rn(amax, qmax<F>()), 1.17549435e-38f);
            inv = __fdiv_rn(1.0f, scale);
        }
        if (lane == 0) scales[b] = scale;
        for (u64 i = start + lane; i < end; i += 32) codes[i] = encode<F>(src[i], inv);
    }
}

// The dequantise kernels walk scale blocks the way quantise does (a warp per
// block, lanes striding through it), so each warp reads its block's scale
// once and no thread divides an index by the block size.
template <int F>
__device__ __forceinline__ void dequantise_accumulate(float* __restrict__ acc, const u8* __restrict__ codes,
                                                      const float* __restrict__ scales, u64 n, u32 block,
                                                      float factor) {
    u64 warp = thread_index() / 32;
    u64 warps = thread_count() / 32;
    u32 lane = threadIdx.x & 31u;
    u64 nblocks = (n + block - 1) / block;
    for (u64 b = warp; b < nblocks; b += warps) {
        float scale = scales[b];
        u64 start = b * block;
        u64 end = start + block < n ? start + block : n;
        for (u64 i = start + lane; i < end; i += 32) {
            float d = __fmul_rn(value<F>(codes[i]), scale);
            acc[i] = __fadd_rn(acc[i], __fmul_rn(factor, d));
        }
    }
}

template <int F, typename D>
__device__ __forceinline__ void dequantise(const u8* __restrict__ codes, const float* __restrict__ scales,
                                           D* __restrict__ out, u64 n, u32 block) {
    u64 warp = thread_index() / 32;
    u64 warps = thread_count() / 32;
    u32 lane = threadIdx.x & 31u;
    u64 nblocks = (n + block - 1) / block;
    for (u64 b = warp; b < nblocks; b += warps) {
        float scale = scales[b];
        u64 start = b * block;
        u64 end = start + block < n ? start + block : n;
        for (u64 i = start + lane; i < end; i += 32) store(&out[i], __fmul_rn(value<F>(codes[i]), scale));
    }
}

// ---- entry points ----------------------------------------------------------

#define ODC_QUANT(FN, F)                                                                               \
    extern "C" __global__ void odc_quantise_##FN(const float* src, u8* codes, float* scales, u64 n,    \
                                                 u32 block) {                                         \
        quantise<F>(src, codes, scales, n, block);                                                     \
    }                                                                                                  \
    extern "C" __global__ void odc_dequantise_accumulate_##FN(float* acc, const u8* codes,            \
                                                              const float* scales, u64 n, u32 block,  \
                                                              float factor) {                         \
        dequantise_accumulate<F>(acc, codes, scales, n, block, factor);                                \
    }                                                                                                  \
    extern "C" __global__ void odc_dequantise_##FN##_to_f32(const u8* codes, const float* scales,      \
                                                            float* out, u64 n, u32 block) {           \
        dequantise<F, float>(codes, scales, out, n, block);                                            \
    }                                                                                                  \
    extern "C" __global__ void odc_dequantise_##FN##_to_bf16(const u8* codes, const float* scales,     \
                                                             bf16* out, u64 n, u32 block) {           \
        dequantise<F, bf16>(codes, scales, out, n, block);                                             \
    }

ODC_QUANT(fp8, FP8)
ODC_QUANT(int8, INT8)

// Error feedback's last step (cpu/quant/feedback.rs): a residual that is not
// finite becomes +0, so one overflowed step does not poison later pushes.
extern "C" __global__ void odc_zero_non_finite(float* x, u64 n) {
    for (u64 i = thread_index(); i < n; i += thread_count()) {
        if (!is_finite(x[i])) x[i] = 0.0f;
    }
}
