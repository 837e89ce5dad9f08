// Row-wise and elementwise ops over strided F32 matrices (a matrix is a
// pointer to its first element, `rows`, `cols` and a row stride in floats).
// Each follows the CPU reference named in its comment, operation for
// operation; `bf16` set means the BF16 path, which rounds the output.

// Grid-stride loop over the elements of a rows × cols matrix.
#define FOR_EACH_ELEMENT(e, rows, cols)                                                   \
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < (rows) * (cols);          \
         e += gridDim.x * (u64)blockDim.x)

// elementwise.rs `rms_norm`: out = w · (x · 1/sqrt(mean(x²) + eps)); one
// block per row. In place (out == x) is fine: each thread reads the
// elements it writes, and only after the block's sum is complete.
extern "C" __global__ void rms_norm(const float* x, u64 x_stride, const float* w, float* out,
                                    u64 out_stride, u64 rows, u64 cols, float eps, int bf16) {
    __shared__ float red[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * x_stride;
        float* o = out + r * out_stride;
        float ss = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
        ss = block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = w[c] * (xr[c] * inv);
            o[c] = bf16 ? round_bf16(v) : v;
        }
    }
}

// elementwise.rs `rope`, in place, one block per row; the row is copied to
// shared memory first because the interleaved layout writes elements that
// other threads still have to read. Row r uses table row r / rows_per_position.
// Up to 1024 threads (one per rotary pair): the bound makes the compiler fit them.
extern "C" __global__ void __launch_bounds__(1024)
rope(float* x, u64 x_stride, u64 rows, u64 cols, const float* cos_t, u64 cos_stride,
     const float* sin_t, u64 sin_stride, u64 rows_per_position, int interleaved, int bf16) {
    extern __shared__ float tmp[];
    const u64 half = cols / 2;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* xr = x + r * x_stride;
        const u64 p = r / rows_per_position;
        __syncthreads();  // the previous row's readers are done with tmp
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) tmp[c] = xr[c];
        __syncthreads();
        for (u64 i = threadIdx.x; i < half; i += blockDim.x) {
            const float a = interleaved ? tmp[2 * i] : tmp[i];
            const float b = interleaved ? tmp[2 * i + 1] : tmp[i + half];
            const float co = cos_t[p * cos_stride + i], si = sin_t[p * sin_stride + i];
            float v0 = a * co - b * si;
            float v1 = b * co + a * si;
            if (bf16) {
                v0 = round_bf16(v0);
                v1 = round_bf16(v1);
            }
            xr[i] = v0;
            xr[i + half] = v1;
        }
    }
}

// elementwise.rs `silu_mul`: gate = gate / (1 + e^-gate) · up, in place.
extern "C" __global__ void silu_mul(float* gate, u64 gate_stride, const float* up, u64 up_stride,
                                    u64 rows, u64 cols, int bf16) {
    FOR_EACH_ELEMENT(e, rows, cols) {
        const u64 r = e / cols, c = e % cols;
        const float g = gate[r * gate_stride + c];
        const float v = g / (1.0f + expf(-g)) * up[r * up_stride + c];
        gate[r * gate_stride + c] = bf16 ? round_bf16(v) : v;
    }
}

// h += delta (the residual add).
extern "C" __global__ void add_rows(float* h, u64 h_stride, const float* delta, u64 delta_stride,
                               u64 rows, u64 cols, int bf16) {
    FOR_EACH_ELEMENT(e, rows, cols) {
        const u64 r = e / cols, c = e % cols;
        const float v = h[r * h_stride + c] + delta[r * delta_stride + c];
        h[r * h_stride + c] = bf16 ? round_bf16(v) : v;
    }
}

extern "C" __global__ void round_rows(float* x, u64 stride, u64 rows, u64 cols) {
    FOR_EACH_ELEMENT(e, rows, cols) {
        const u64 r = e / cols, c = e % cols;
        x[r * stride + c] = round_bf16(x[r * stride + c]);
    }
}

extern "C" __global__ void zero_rows(float* x, u64 stride, u64 rows, u64 cols) {
    FOR_EACH_ELEMENT(e, rows, cols) {
        x[(e / cols) * stride + e % cols] = 0.0f;
    }
}

// dst[i] = src[idx[i]] for `count` rows. A kernel cannot fail its launch
// once queued, so an index past src's rows (which the emulated device
// reports as an error) fills its row with NaN: it shows up downstream
// instead of passing stale memory on.
extern "C" __global__ void gather_rows(const float* src, u64 src_stride, u64 src_rows,
                                       const u32* idx, u64 count, float* dst, u64 dst_stride,
                                       u64 cols) {
    FOR_EACH_ELEMENT(e, count, cols) {
        const u64 i = e / cols, c = e % cols;
        const u64 row = idx[i];
        dst[i * dst_stride + c] = row < src_rows ? src[row * src_stride + c] : quiet_nan();
    }
}

// dst[idx[i]] += scales[i] · src[i]; the indices are distinct, so no two
// threads add into one element. An index past dst's rows is skipped (see
// gather_rows for why it cannot fail).
extern "C" __global__ void scatter_add_rows(const float* src, u64 src_stride, const u32* idx,
                                            const float* scales, u64 count, float* dst,
                                            u64 dst_stride, u64 dst_rows, u64 cols) {
    FOR_EACH_ELEMENT(e, count, cols) {
        const u64 i = e / cols, c = e % cols;
        const u64 row = idx[i];
        if (row < dst_rows) {
            dst[row * dst_stride + c] += scales[i] * src[i * src_stride + c];
        }
    }
}

// Rows first_row .. first_row + table_rows of an embedding table: each token
// whose id falls there gets its row decoded into out (linear.rs
// `decode_row`: FP8 values times their block's scale); other tokens' rows
// are left alone.
extern "C" __global__ void embedding(const u8* table, const float* scales, u64 table_rows,
                                     u64 cols, int fmt, u64 b0, u64 b1, u64 first_row,
                                     const u32* ids, u64 count, float* out, u64 out_stride,
                                     int bf16) {
    FOR_EACH_ELEMENT(e, count, cols) {
        const u64 i = e / cols, c = e % cols;
        const u64 id = ids[i];
        if (id < first_row || id - first_row >= table_rows) continue;
        const u64 r = id - first_row;
        float v = load_weight_any(fmt, table, r * cols + c);
        if (fmt == FMT_FP8) {
            const u64 col_blocks = (cols + b1 - 1) / b1;
            v *= scales[(r / b0) * col_blocks + c / b1];
        }
        out[i * out_stride + c] = bf16 ? round_bf16(v) : v;
    }
}
