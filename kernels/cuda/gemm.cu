// y = x · Wᵀ over a weight in its stored format (see linear.rs `matmul`).
//
// One warp computes one output column r (one weight row) for a tile of
// GEMM_TILE input rows: its lanes stride over the columns of each scale
// block, so the weight row is read once per tile and coalesced; warps of a
// block share the x tile through the cache. FP8 products are post-scaled as
// on the CPU: each 128-wide (block[1]) column block is accumulated over the
// raw FP8 values, multiplied by its scale once, and the blocks summed in
// order. Other formats are one block of `cols` with scale 1.

#define GEMM_TILE 8

template <int FMT>
__device__ void gemm(const u8* w, const float* scales, u64 rows, u64 cols, u64 b0, u64 b1,
                     const float* x, u64 x_stride, float* y, u64 y_stride, u64 n,
                     int round_x, int round_y) {
    const u32 lane = threadIdx.x & 31u;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u64 warps = (gridDim.x * (u64)blockDim.x) >> 5;
    const u64 tiles = (n + GEMM_TILE - 1) / GEMM_TILE;
    const u64 block_cols = FMT == FMT_FP8 ? b1 : (cols > 0 ? cols : 1);
    const u64 col_blocks = (cols + block_cols - 1) / block_cols;
    // Every lane of a warp takes the same items, so the shuffles below see
    // the whole warp.
    for (u64 item = warp; item < rows * tiles; item += warps) {
        const u64 r = item % rows;
        const u64 i0 = (item / rows) * GEMM_TILE;
        const u64 m = umin64(GEMM_TILE, n - i0);
        const float* xt = x + i0 * x_stride;
        float acc[GEMM_TILE];
#pragma unroll
        for (int i = 0; i < GEMM_TILE; ++i) acc[i] = 0.0f;
        for (u64 cb = 0; cb < col_blocks; ++cb) {
            const u64 c1 = umin64(cols, (cb + 1) * block_cols);
            float part[GEMM_TILE];
#pragma unroll
            for (int i = 0; i < GEMM_TILE; ++i) part[i] = 0.0f;
            for (u64 c = cb * block_cols + lane; c < c1; c += 32) {
                const float wv = load_weight<FMT>(w, r * cols + c);
#pragma unroll
                for (int i = 0; i < GEMM_TILE; ++i) {
                    if ((u64)i < m) {
                        float xv = xt[i * x_stride + c];
                        // The BF16 path multiplies BF16 activations.
                        if (round_x) xv = round_bf16(xv);
                        part[i] += wv * xv;
                    }
                }
            }
            const float s = FMT == FMT_FP8 ? scales[(r / b0) * col_blocks + cb] : 1.0f;
#pragma unroll
            for (int i = 0; i < GEMM_TILE; ++i) acc[i] += warp_sum(part[i]) * s;
        }
        if (lane == 0) {
            for (u64 i = 0; i < m; ++i) {
                y[(i0 + i) * y_stride + r] = round_y ? round_bf16(acc[i]) : acc[i];
            }
        }
    }
}

#define GEMM_ENTRY(NAME, FMT)                                                                       \
    extern "C" __global__ void NAME(const u8* w, const float* scales, u64 rows, u64 cols, u64 b0,    \
                                    u64 b1, const float* x, u64 x_stride, float* y, u64 y_stride,  \
                                    u64 n, int round_x, int round_y) {                             \
        gemm<FMT>(w, scales, rows, cols, b0, b1, x, x_stride, y, y_stride, n, round_x, round_y);   \
    }

GEMM_ENTRY(gemm_f32, FMT_F32)
GEMM_ENTRY(gemm_bf16, FMT_BF16)
GEMM_ENTRY(gemm_f16, FMT_F16)
GEMM_ENTRY(gemm_fp8, FMT_FP8)

// `count` independent products in one launch (MLA's absorbed decode: one per
// head). Batch b's weight data and scales lie b·w_step and b·scales_step
// bytes on, its x and y b·x_step and b·y_step floats on; every warp takes its
// share of each batch in turn, so no batch waits for another's warps.
#define GEMM_BATCHED_ENTRY(NAME, FMT)                                                               \
    extern "C" __global__ void NAME(const u8* w, const float* scales, u64 rows, u64 cols, u64 b0,    \
                                    u64 b1, const float* x, u64 x_stride, float* y, u64 y_stride,  \
                                    u64 n, int round_x, int round_y, u64 count, u64 w_step,        \
                                    u64 scales_step, u64 x_step, u64 y_step) {                     \
        for (u64 b = 0; b < count; ++b) {                                                          \
            const float* sb = (const float*)((const u8*)scales + b * scales_step);                 \
            gemm<FMT>(w + b * w_step, sb, rows, cols, b0, b1, x + b * x_step, x_stride,            \
                      y + b * y_step, y_stride, n, round_x, round_y);                               \
        }                                                                                          \
    }

GEMM_BATCHED_ENTRY(gemm_batched_f32, FMT_F32)
GEMM_BATCHED_ENTRY(gemm_batched_bf16, FMT_BF16)
GEMM_BATCHED_ENTRY(gemm_batched_f16, FMT_F16)
GEMM_BATCHED_ENTRY(gemm_batched_fp8, FMT_FP8)
