// ODC accumulate and cast kernels for device memory.
//
// Compiled at run time by NVRTC (see mod.rs). Self-contained on purpose: no
// CUDA header is included, so the source compiles with any NVRTC, and the
// bf16 / f16 conversions are spelled out bit by bit exactly as
// odc-kernels/src/cpu/reference.rs defines them, so a GPU result is
// bit-identical to the CPU one (NaN payloads aside: the GPU produces the
// canonical NaN where IEEE 754 leaves the payload open).
//
// Numerics: `acc + scale * x` is __fmul_rn then __fadd_rn in f32 (explicit
// round-to-nearest intrinsics are never contracted into an FMA), then one
// narrowing to the accumulator's dtype, to nearest, ties to even.
//
// Shape: one launch per landing slot; grid-stride loops; when every operand
// is aligned to its pack, each thread moves up to 16 bytes per operand per
// load (float4, or 8 x bf16), with a scalar tail.
//
// Entry points (C linkage, names checked by the tests):
//   odc_accumulate_<acc>_<x>(acc*, const x*, n, scale)   acc[i] = acc[i] + scale * x[i]
//   odc_cast_<src>_to_<dst>(const src*, dst*, n)          dst[i] = narrow(widen(src[i]))
// with <acc>, <x>, <src>, <dst> in {f32, bf16, f16}; casts only between
// different dtypes (a same-dtype cast is a byte copy).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// ---- widening: exact -------------------------------------------------------

__device__ __forceinline__ float widen(float x) { return x; }

// The top half of an f32: a pure shift, so even a signaling NaN stays as is.
__device__ __forceinline__ float widen(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }

__device__ __forceinline__ float widen(f16 x) {
    u32 h = x.bits;
    u32 sign = (h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    u32 magnitude;
    if (exp == 0) {
        // Zero or subnormal: man * 2^-24 is exact in f32.
        magnitude = man == 0 ? 0u : __float_as_uint(__fmul_rn((float)man, __uint_as_float(0x33800000u)));
    } else if (exp == 0x1f) {
        magnitude = man == 0 ? 0x7f800000u : (0x7fc00000u | (man << 13));
    } else {
        magnitude = ((exp + 127u - 15u) << 23) | (man << 13);
    }
    return __uint_as_float(sign | magnitude);
}

// ---- narrowing: round to nearest, ties to even; NaN stays NaN --------------

template <typename T> __device__ __forceinline__ T narrow(float x);

template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }

template <> __device__ __forceinline__ bf16 narrow<bf16>(float x) {
    u32 bits = __float_as_uint(x);
    bf16 out;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        // Quiet bit set so the truncated payload cannot read as infinity.
        out.bits = (u16)((bits >> 16) | 0x0040u);
        return out;
    }
    u32 lower = bits & 0xffffu;
    u32 upper = bits >> 16;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) {
        upper += 1u;  // may carry into the exponent: rounds to infinity
    }
    out.bits = (u16)upper;
    return out;
}

template <> __device__ __forceinline__ f16 narrow<f16>(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 16) & 0x8000u;
    int exp = (int)((bits >> 23) & 0xffu);
    u32 man = bits & 0x7fffffu;
    f16 out;
    if (exp == 0xff) {
        out.bits = (u16)(sign | (man == 0 ? 0x7c00u : (0x7e00u | (man >> 13))));
        return out;
    }
    int e = exp - 127;
    if (e > 15) {
        out.bits = (u16)(sign | 0x7c00u);
        return out;
    }
    u32 kept, shift;
    if (e >= -14) {
        kept = (((u32)(e + 15)) << 23) | man;
        shift = 13;
    } else if (e >= -25) {
        // Subnormal: the value in units of 2^-24 is (1.man) * 2^(e+24).
        kept = man | 0x800000u;
        shift = (u32)(-e - 1);
    } else {
        out.bits = (u16)sign;
        return out;
    }
    u32 res = kept >> shift;
    u32 rest = kept & ((1u << shift) - 1u);
    u32 half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (res & 1u))) {
        res += 1u;  // a carry bumps the exponent, or 65520 to infinity
    }
    out.bits = (u16)(sign | res);
    return out;
}

// ---- packs: up to 16 bytes per operand per load ----------------------------

template <typename A, typename X> struct Width {
    // Elements per pack: 16 bytes of the wider operand.
    static const int value = 16 / (sizeof(A) > sizeof(X) ? sizeof(A) : sizeof(X));
};

template <typename T, int N> struct __align__(sizeof(T) * N) Pack { T v[N]; };

__device__ __forceinline__ bool aligned(const void* p, u64 bytes) { return ((u64)p % bytes) == 0; }

__device__ __forceinline__ u64 thread_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }

__device__ __forceinline__ u64 thread_count() { return (u64)gridDim.x * blockDim.x; }

template <typename A, typename X> __device__ __forceinline__ A add_scaled(A a, X x, float scale) {
    return narrow<A>(__fadd_rn(widen(a), __fmul_rn(scale, widen(x))));
}

template <typename A, typename X>
__device__ __forceinline__ void accumulate(A* __restrict__ acc, const X* __restrict__ x, u64 n, float scale) {
    const int W = Width<A, X>::value;
    u64 start = thread_index();
    u64 stride = thread_count();
    u64 done = 0;
    if (aligned(acc, sizeof(A) * W) && aligned(x, sizeof(X) * W)) {
        u64 packs = n / W;
        Pack<A, W>* pa = reinterpret_cast<Pack<A, W>*>(acc);
        const Pack<X, W>* px = reinterpret_cast<const Pack<X, W>*>(x);
        for (u64 p = start; p < packs; p += stride) {
            Pack<A, W> a = pa[p];
            Pack<X, W> b = px[p];
#pragma unroll
            for (int k = 0; k < W; ++k) a.v[k] = add_scaled(a.v[k], b.v[k], scale);
            pa[p] = a;
        }
        done = packs * W;
    }
    for (u64 i = done + start; i < n; i += stride) acc[i] = add_scaled(acc[i], x[i], scale);
}

template <typename S, typename D>
__device__ __forceinline__ void cast(const S* __restrict__ src, D* __restrict__ dst, u64 n) {
    const int W = Width<S, D>::value;
    u64 start = thread_index();
    u64 stride = thread_count();
    u64 done = 0;
    if (aligned(src, sizeof(S) * W) && aligned(dst, sizeof(D) * W)) {
        u64 packs = n / W;
        const Pack<S, W>* ps = reinterpret_cast<const Pack<S, W>*>(src);
        Pack<D, W>* pd = reinterpret_cast<Pack<D, W>*>(dst);
        for (u64 p = start; p < packs; p += stride) {
            Pack<S, W> s = ps[p];
            Pack<D, W> d;
#pragma unroll
            for (int k = 0; k < W; ++k) d.v[k] = narrow<D>(widen(s.v[k]));
            pd[p] = d;
        }
        done = packs * W;
    }
    for (u64 i = done + start; i < n; i += stride) dst[i] = narrow<D>(widen(src[i]));
}

// ---- entry points ----------------------------------------------------------

#define ODC_ACCUMULATE(AN, A, XN, X)                                                          \
    extern "C" __global__ void odc_accumulate_##AN##_##XN(A* acc, const X* x, u64 n, float scale) { \
        accumulate<A, X>(acc, x, n, scale);                                                   \
    }

ODC_ACCUMULATE(f32, float, f32, float)
ODC_ACCUMULATE(f32, float, bf16, bf16)
ODC_ACCUMULATE(f32, float, f16, f16)
ODC_ACCUMULATE(bf16, bf16, f32, float)
ODC_ACCUMULATE(bf16, bf16, bf16, bf16)
ODC_ACCUMULATE(bf16, bf16, f16, f16)
ODC_ACCUMULATE(f16, f16, f32, float)
ODC_ACCUMULATE(f16, f16, bf16, bf16)
ODC_ACCUMULATE(f16, f16, f16, f16)

#define ODC_CAST(SN, S, DN, D)                                                        \
    extern "C" __global__ void odc_cast_##SN##_to_##DN(const S* src, D* dst, u64 n) { \
        cast<S, D>(src, dst, n);                                                      \
    }

ODC_CAST(f32, float, bf16, bf16)
ODC_CAST(f32, float, f16, f16)
ODC_CAST(bf16, bf16, f32, float)
ODC_CAST(bf16, bf16, f16, f16)
ODC_CAST(f16, f16, f32, float)
ODC_CAST(f16, f16, bf16, bf16)
