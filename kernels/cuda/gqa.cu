// Grouped-query attention, causal (see Op::GqaAttention): one block per
// (query row, head). Query row i (position start + i) of head h attends to
// positions 0..=start+i of kv head h / (heads / kv_heads).
//
// The block walks the positions in chunks of blockDim.x, one position per
// thread: each thread takes its score (a dot product in order, as the CPU
// reference does), and the chunk joins a running softmax in F32 (online:
// what was summed under an older, smaller maximum is rescaled). Thread d
// owns output column d and accumulates the chunk's weighted values in
// position order. The block needs at least as many threads as head_dim,
// up to 1024. Dynamic shared memory: blockDim.x weights, then the query.
extern "C" __global__ void __launch_bounds__(1024)
gqa_attention(const float* q, u64 q_stride, const float* k, u64 k_stride, const float* v,
              u64 v_stride, float* out, u64 out_stride, u64 n, u64 start, u64 heads,
              u64 kv_heads, u64 hd, float scale, int bf16) {
    extern __shared__ float smem[];
    float* w = smem;
    float* qs = smem + blockDim.x;
    __shared__ float red[32];
    const u64 group = heads / kv_heads;
    for (u64 item = blockIdx.x; item < n * heads; item += gridDim.x) {
        const u64 i = item / heads, h = item % heads;
        const u64 kvh = h / group;
        const u64 len = start + i + 1;
        const float* kh = k + kvh * hd;
        const float* vh = v + kvh * hd;
        __syncthreads();  // everyone is done with the previous item's query
        for (u64 d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[i * q_stride + h * hd + d];
        __syncthreads();
        float m = neg_inf();  // running maximum of the scores
        float l = 0.0f;       // running Σ exp(score − m)
        float o = 0.0f;       // running Σ exp(score − m) · v[threadIdx.x]
        for (u64 base = 0; base < len; base += blockDim.x) {
            const u64 t = base + threadIdx.x;
            float s = neg_inf();
            if (t < len) {
                const float* kt = kh + t * k_stride;
                float acc = 0.0f;
                for (u64 d = 0; d < hd; ++d) acc += qs[d] * kt[d];
                s = acc * scale;
            }
            // Position `base` is always seen, so the chunk's maximum is finite.
            const float m_new = fmaxf(m, block_max(s, red));
            const float p = t < len ? expf(s - m_new) : 0.0f;
            // block_max's barriers come after every thread's reads of the
            // previous chunk's weights; block_sum's make these visible.
            w[threadIdx.x] = p;
            const float chunk_sum = block_sum(p, red);
            const float rescale = expf(m - m_new);  // 0 on the first chunk
            l = l * rescale + chunk_sum;
            m = m_new;
            if (threadIdx.x < hd) {
                o *= rescale;
                const u64 count = umin64(blockDim.x, len - base);
                for (u64 j = 0; j < count; ++j) o += w[j] * vh[(base + j) * v_stride + threadIdx.x];
            }
        }
        if (threadIdx.x < hd) {
            const float r = o / l;
            out[i * out_stride + h * hd + threadIdx.x] = bf16 ? round_bf16(r) : r;
        }
    }
}
