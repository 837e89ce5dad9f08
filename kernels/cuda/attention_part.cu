// Partial attention with its log-sum-exp, and the merge of two partial
// results (see Op::MlaPrefillPart, Op::GqaAttentionPart, Op::AttentionMerge):
// Pass-KV context parallelism attends each rank's queries to one range of
// keys at a time and merges the pieces into the whole causal attention.
//
// The partial kernels follow gqa.cu's structure: one block per (query row,
// head); the keys the row sees are walked in chunks of blockDim.x, one key
// per thread, and each chunk joins a running softmax in F32 (online: what
// was summed under an older, smaller maximum is rescaled). Thread d owns
// output column d. What differs from the whole-context kernels: the keys
// lie at positions key_start.., so a row sees only the first
// min(keys, start + i + 1 − key_start) of them (maybe none: zeros and −∞);
// the output is normalised in F32 and never rounded, since the merge goes
// on in F32; and thread 0 writes ln Σ exp(score) = m + ln l.
//
// BF16 rounds the inputs of the scores, the query (as it is staged in
// shared memory) and each key element as it is read, which is what the
// CPU's BF16 path feeds its score GEMM; the values are weighed as given.

__device__ __forceinline__ float bf16_if(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

// How many of `keys` keys at positions key_start.. a query at `position` sees.
__device__ __forceinline__ u64 keys_seen(u64 position, u64 key_start, u64 keys) {
    const u64 end = position + 1;
    return end > key_start ? umin64(end - key_start, keys) : 0;
}

// out[d] = Σ_t softmax(score)_t · v_t[d] over t in 0..len, d in 0..dv, and
// *lse = ln Σ_t exp(score_t). `w` is blockDim.x floats of shared memory,
// `red` 32; `len` is the same for every thread of the block.
template <typename Score>
__device__ void attend_part(const Score& score, u64 len, const float* v, u64 v_stride, u64 dv,
                            float* out, float* lse, float* w, float* red) {
    float m = neg_inf();  // running maximum of the scores
    float l = 0.0f;       // running Σ exp(score − m)
    float o = 0.0f;       // running Σ exp(score − m) · v[threadIdx.x]
    for (u64 base = 0; base < len; base += blockDim.x) {
        const u64 t = base + threadIdx.x;
        const float s = t < len ? score(t) : neg_inf();
        // Key `base` is always seen, so the chunk's maximum is finite.
        const float m_new = fmaxf(m, block_max(s, red));
        const float p = t < len ? expf(s - m_new) : 0.0f;
        // block_max's barriers come after every thread's reads of the
        // previous chunk's weights; block_sum's make these visible.
        w[threadIdx.x] = p;
        const float chunk_sum = block_sum(p, red);
        const float rescale = expf(m - m_new);  // 0 on the first chunk
        l = l * rescale + chunk_sum;
        m = m_new;
        if (threadIdx.x < dv) {
            o *= rescale;
            const u64 count = umin64(blockDim.x, len - base);
            for (u64 j = 0; j < count; ++j) o += w[j] * v[(base + j) * v_stride + threadIdx.x];
        }
    }
    if (threadIdx.x < dv) out[threadIdx.x] = len > 0 ? o / l : 0.0f;
    if (threadIdx.x == 0) *lse = len > 0 ? m + logf(l) : neg_inf();
}

// MLA's expanded-form score of key t: (q_nope · k_nope_t + q_pe · k_pe_t) · scale,
// each dot product in order, as mla.cu's `score`.
struct MlaPartScore {
    const float* q;  // the staged query, dn + dr floats (rounded for BF16)
    const float* k_nope;
    u64 k_nope_stride;
    const float* k_pe;
    u64 k_pe_stride;
    u64 dn;
    u64 dr;
    float scale;
    int bf16;
    __device__ float operator()(u64 t) const {
        const float* kn = k_nope + t * k_nope_stride;
        const float* kp = k_pe + t * k_pe_stride;
        float a = 0.0f, b = 0.0f;
        for (u64 i = 0; i < dn; ++i) a += q[i] * bf16_if(kn[i], bf16);
        for (u64 i = 0; i < dr; ++i) b += q[dn + i] * bf16_if(kp[i], bf16);
        return (a + b) * scale;
    }
};

// GQA's score of key t: q · k_t in order, scaled, as gqa.cu.
struct GqaPartScore {
    const float* q;  // the staged query, hd floats (rounded for BF16)
    const float* k;
    u64 k_stride;
    u64 hd;
    float scale;
    int bf16;
    __device__ float operator()(u64 t) const {
        const float* kt = k + t * k_stride;
        float acc = 0.0f;
        for (u64 d = 0; d < hd; ++d) acc += q[d] * bf16_if(kt[d], bf16);
        return acc * scale;
    }
};

// Op::MlaPrefillPart. Dynamic shared memory: blockDim.x weights, then the
// query (dn + dr floats). The block needs at least dv threads.
extern "C" __global__ void __launch_bounds__(1024)
mla_prefill_part(const float* q, u64 q_stride, const float* kv, u64 kv_stride, const float* latents,
                 u64 latents_stride, float* out, u64 out_stride, float* lse, u64 lse_stride, u64 n,
                 u64 keys, u64 start, u64 key_start, u64 heads, u64 dn, u64 dr, u64 dv, u64 dc,
                 float scale, int bf16) {
    extern __shared__ float smem[];
    float* w = smem;
    float* qs = smem + blockDim.x;
    __shared__ float red[32];
    for (u64 item = blockIdx.x; item < n * heads; item += gridDim.x) {
        const u64 i = item / heads, h = item % heads;
        __syncthreads();  // everyone is done with the previous item's query
        for (u64 d = threadIdx.x; d < dn + dr; d += blockDim.x) qs[d] = bf16_if(q[i * q_stride + h * (dn + dr) + d], bf16);
        __syncthreads();
        const float* kvh = kv + h * (dn + dv);
        const MlaPartScore score = {qs, kvh, kv_stride, latents + dc, latents_stride, dn, dr, scale, bf16};
        attend_part(score, keys_seen(start + i, key_start, keys), kvh + dn, kv_stride, dv,
                    out + i * out_stride + h * dv, lse + i * lse_stride + h, w, red);
    }
}

// Op::GqaAttentionPart: head h reads kv head h / (heads / kv_heads).
// Dynamic shared memory: blockDim.x weights, then the query (hd floats).
// The block needs at least hd threads.
extern "C" __global__ void __launch_bounds__(1024)
gqa_attention_part(const float* q, u64 q_stride, const float* k, u64 k_stride, const float* v,
                   u64 v_stride, float* out, u64 out_stride, float* lse, u64 lse_stride, u64 n,
                   u64 keys, u64 start, u64 key_start, u64 heads, u64 kv_heads, u64 hd, float scale,
                   int bf16) {
    extern __shared__ float smem[];
    float* w = smem;
    float* qs = smem + blockDim.x;
    __shared__ float red[32];
    const u64 group = heads / kv_heads;
    for (u64 item = blockIdx.x; item < n * heads; item += gridDim.x) {
        const u64 i = item / heads, h = item % heads;
        const u64 kvh = h / group;
        __syncthreads();  // everyone is done with the previous item's query
        for (u64 d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = bf16_if(q[i * q_stride + h * hd + d], bf16);
        __syncthreads();
        const GqaPartScore score = {qs, k + kvh * hd, k_stride, hd, scale, bf16};
        attend_part(score, keys_seen(start + i, key_start, keys), v + kvh * hd, v_stride, hd,
                    out + i * out_stride + h * hd, lse + i * lse_stride + h, w, red);
    }
}

// Op::AttentionMerge: one block per (row, head), threads over its d
// columns. The weights are normalised first, a / (a + b) and b / (a + b),
// and a side whose weight is exactly zero is left out, so that an
// accumulator at −∞ may hold anything; the emulated device (host_ops.rs,
// merge_weights and merged) computes the same in the same order.
extern "C" __global__ void attention_merge(float* out, u64 out_stride, float* lse, u64 lse_stride,
                                           const float* part, u64 part_stride,
                                           const float* part_lse, u64 part_lse_stride, u64 n,
                                           u64 heads, u64 d) {
    for (u64 item = blockIdx.x; item < n * heads; item += gridDim.x) {
        const u64 i = item / heads, h = item % heads;
        float* l = lse + i * lse_stride + h;
        const float la = *l, lb = part_lse[i * part_lse_stride + h];
        __syncthreads();  // every thread has read this lse before thread 0 rewrites it
        const float m = fmaxf(la, lb);
        if (m == neg_inf()) continue;  // the same for the whole block
        const float a = expf(la - m), b = expf(lb - m);
        const float sum = a + b;
        const float wa = a / sum, wb = b / sum;
        float* o = out + i * out_stride + h * d;
        const float* p = part + i * part_stride + h * d;
        for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
            o[c] = wa == 0.0f ? p[c] : wb == 0.0f ? o[c] : wa * o[c] + wb * p[c];
        }
        if (threadIdx.x == 0) *l = m + logf(sum);
    }
}
