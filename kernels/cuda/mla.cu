// MLA attention, both forms: one block per (query, head).
//
// Scores are recomputed rather than stored, so the context length is not
// bounded by shared memory: one pass finds the maximum, one the softmax sum,
// and a last one turns each chunk of blockDim.x scores into weights in
// shared memory that every thread applies to its own output column, in
// position order, as the CPU accumulates them (`o += w · v`). The block
// needs at least as many threads as output columns: up to 1024, which the
// launch bounds make the compiler fit.

// score(t) = (qa · ka_t + qb · kb_t) · scale, each dot product in order.
struct Keys {
    const float* qa;
    const float* ka;
    u64 ka_stride;
    u64 da;
    const float* qb;
    const float* kb;
    u64 kb_stride;
    u64 db;
    float scale;
};

__device__ __forceinline__ float score(const Keys& k, u64 t) {
    const float* ka = k.ka + t * k.ka_stride;
    const float* kb = k.kb + t * k.kb_stride;
    float a = 0.0f, b = 0.0f;
    for (u64 i = 0; i < k.da; ++i) a += k.qa[i] * ka[i];
    for (u64 i = 0; i < k.db; ++i) b += k.qb[i] * kb[i];
    return (a + b) * k.scale;
}

// out[d] = Σ_t softmax(score)_t · v_t[d] over t in 0..ctx, d in 0..dv.
// `w` is blockDim.x floats of shared memory, `red` 32.
__device__ void attend(const Keys& k, u64 ctx, const float* v, u64 v_stride, u64 dv, float* out,
                       int bf16, float* w, float* red) {
    float m = neg_inf();
    for (u64 t = threadIdx.x; t < ctx; t += blockDim.x) m = fmaxf(m, score(k, t));
    m = block_max(m, red);
    float s = 0.0f;
    for (u64 t = threadIdx.x; t < ctx; t += blockDim.x) s += expf(score(k, t) - m);
    const float inv = 1.0f / block_sum(s, red);
    float o = 0.0f;
    for (u64 base = 0; base < ctx; base += blockDim.x) {
        const u64 t = base + threadIdx.x;
        __syncthreads();  // everyone is done with the previous chunk's weights
        w[threadIdx.x] = t < ctx ? expf(score(k, t) - m) * inv : 0.0f;
        __syncthreads();
        if (threadIdx.x < dv) {
            const u64 len = umin64(blockDim.x, ctx - base);
            for (u64 j = 0; j < len; ++j) o += w[j] * v[(base + j) * v_stride + threadIdx.x];
        }
    }
    if (threadIdx.x < dv) out[threadIdx.x] = bf16 ? round_bf16(o) : o;
}

// The expanded (prefill) form, causal: query i (position start + i) of head
// h attends over positions 0..=start+i with k_nope and v from kv's rows and
// the shared rope key from the latents' columns dc.. (see Op::MlaPrefill).
extern "C" __global__ void __launch_bounds__(1024)
mla_prefill(const float* q, u64 q_stride, const float* kv, u64 kv_stride, const float* latents,
            u64 latents_stride, float* out, u64 out_stride, u64 n, u64 start, u64 heads, u64 dn,
            u64 dr, u64 dv, u64 dc, float scale, int bf16) {
    extern __shared__ float w[];
    __shared__ float red[32];
    for (u64 item = blockIdx.x; item < n * heads; item += gridDim.x) {
        const u64 i = item / heads, h = item % heads;
        const float* qh = q + i * q_stride + h * (dn + dr);
        const float* kvh = kv + h * (dn + dv);
        Keys k = {qh, kvh, kv_stride, dn, qh + dn, latents + dc, latents_stride, dr, scale};
        attend(k, start + i + 1, kvh + dn, kv_stride, dv, out + i * out_stride + h * dv, bf16, w, red);
    }
}

// The absorbed (decode) form for one token: head h attends over every
// latent with q_latent·c_t + q_pe·k_pe_t, and its output is the weighted
// sum of the latents c_t (see Op::MlaDecode).
extern "C" __global__ void __launch_bounds__(1024)
mla_decode(const float* q_latent, u64 ql_stride, const float* q_pe, u64 qp_stride,
           const float* latents, u64 latents_stride, u64 ctx, float* out, u64 out_stride,
           u64 heads, u64 dc, u64 dr, float scale, int bf16) {
    extern __shared__ float w[];
    __shared__ float red[32];
    for (u64 h = blockIdx.x; h < heads; h += gridDim.x) {
        Keys k = {q_latent + h * ql_stride, latents, latents_stride, dc,
                  q_pe + h * qp_stride, latents + dc, latents_stride, dr, scale};
        attend(k, ctx, latents, latents_stride, dc, out + h * out_stride, bf16, w, red);
    }
}
