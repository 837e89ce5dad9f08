// Helpers shared by every kernel of the CUDA device backend.
//
// The kernels are compiled by NVRTC at device open, without the CUDA
// headers (a driver-only machine has none), so everything they need is
// written out here: BF16 rounding, the weight-format decoders, warp and
// block reductions. The Rust side concatenates the .cu files in this
// folder, common.cu first, into one program.
//
// Compiled with --fmad=false: a product followed by an add stays two
// roundings, as in the CPU reference, so F32 products are exact F32 products
// and rotary embedding is bit-exact with the CPU's.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Weight formats, as the Rust side numbers them.
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_FP8 3

__device__ __forceinline__ u64 umin64(u64 a, u64 b) { return a < b ? a : b; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Round to the nearest BF16 value, ties to even, and back to F32: bit-exact
// with half::bf16::from_f32(x).to_f32() (NaN stays NaN, made quiet).
__device__ __forceinline__ float round_bf16(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return __uint_as_float(((b >> 16) | 0x40u) << 16);
    }
    u32 h = b >> 16;
    // Round up when the dropped half is above one half, or exactly one half
    // with an odd kept part (0x17fff = the round bit's neighbours and the
    // lowest kept bit).
    if ((b & 0x8000u) != 0 && (b & 0x17fffu) != 0) {
        h += 1;
    }
    return __uint_as_float(h << 16);
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float((u32)v << 16); }

// IEEE half to F32, exactly (every half is an F32), as half::f16::to_f32.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    if (exp == 0x1fu) {
        // Infinity, or NaN made quiet.
        return __uint_as_float(sign | 0x7f800000u | (man != 0 ? 0x400000u : 0u) | (man << 13));
    }
    if (exp == 0) {
        // Zero or subnormal: man · 2^-24, exact in F32.
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// FP8 E4M3FN to F32, exactly (see fp8.rs): bias 7, subnormals m/8 · 2^-6,
// S.1111.111 is NaN, no infinities.
__device__ __forceinline__ float e4m3_to_f32(u8 c) {
    u32 sign = (u32)(c & 0x80u) << 24;
    u32 exp = (c >> 3) & 0xfu;
    u32 man = c & 7u;
    if (exp == 0xfu && man == 7u) {
        return __uint_as_float(sign | 0x7fc00000u);
    }
    if (exp == 0) {
        float v = (float)man * 0.001953125f;  // man · 2^-9
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Element `i` of a weight in format FMT, decoded without its scale.
template <int FMT>
__device__ __forceinline__ float load_weight(const u8* data, u64 i) {
    if (FMT == FMT_F32) {
        return ((const float*)data)[i];
    } else if (FMT == FMT_BF16) {
        return bf16_to_f32(((const u16*)data)[i]);
    } else if (FMT == FMT_F16) {
        return f16_to_f32(((const u16*)data)[i]);
    } else {
        return e4m3_to_f32(data[i]);
    }
}

// The same with the format chosen at run time (for kernels that decode
// little, such as the embedding lookup).
__device__ __forceinline__ float load_weight_any(int fmt, const u8* data, u64 i) {
    switch (fmt) {
        case FMT_F32: return load_weight<FMT_F32>(data, i);
        case FMT_BF16: return load_weight<FMT_BF16>(data, i);
        case FMT_F16: return load_weight<FMT_F16>(data, i);
        default: return load_weight<FMT_FP8>(data, i);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32), returned to every
// thread. `red` is 32 floats of shared memory; the leading barrier lets a
// block call this again right after a previous call.
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? red[lane] : 0.0f);
}

// Maximum over the block, NaN ignored (as f32::max and fmaxf do).
__device__ float block_max(float v, float* red) {
    v = warp_max(v);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? red[lane] : neg_inf());
}
