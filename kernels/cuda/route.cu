// The MoE router's top-k (router.rs `route`), one block per token row.
//
// The block computes the expert scores in parallel; thread 0 then makes
// the selection serially, as the CPU does, over integer sort keys: a key
// orders as f32::total_cmp with NaN read as -inf, and the scans below take
// the first (lowest-index) maximum, so ties go to the lower index exactly as
// the CPU's stable sort has them.
//
// Shared memory (dynamic): scores[n], choice[n], keys[n] (int), group
// keys[n_group] (int).

// The sort key of v (see cpu/elementwise.rs `sort_key`); every key is above
// INT_MIN, which marks a value already taken.
__device__ __forceinline__ int sort_key(float v) {
    if (v != v) v = neg_inf();
    const int b = __float_as_int(v);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

#define TAKEN ((int)0x80000000)

// Index of the largest key in keys[0..n), the lowest index among equals.
__device__ u64 argmax_key(const int* keys, u64 n) {
    u64 best = 0;
    for (u64 i = 1; i < n; ++i) {
        if (keys[i] > keys[best]) best = i;
    }
    return best;
}

// Thread 0's part: the selection for one row, from its scores and choices.
__device__ void select_experts(const float* scores, float* choice, int* keys, int* group_keys, u64 n,
                               u64 top_k, u64 n_group, u64 topk_group, int norm_topk_prob,
                               float routed_scaling_factor, u32* out_ids, float* out_w) {
    if (n_group > 1 && topk_group < n_group) {
        // Each group scores the sum of its two best choices (one when it
        // has one expert); the best topk_group groups are kept and every
        // other expert's choice is 0 (not -inf, as transformers has it).
        const u64 per = n / n_group;
        for (u64 g = 0; g < n_group; ++g) {
            int* k = keys + g * per;
            for (u64 e = 0; e < per; ++e) k[e] = sort_key(choice[g * per + e]);
            const u64 first = argmax_key(k, per);
            // Rust's f32 sum starts from -0.0, which leaves its first term as it is.
            float s = choice[g * per + first];
            if (per > 1) {
                k[first] = TAKEN;
                s += choice[g * per + argmax_key(k, per)];
            }
            group_keys[g] = sort_key(s);
        }
        for (u64 j = 0; j < topk_group; ++j) group_keys[argmax_key(group_keys, n_group)] = TAKEN;
        for (u64 g = 0; g < n_group; ++g) {
            if (group_keys[g] != TAKEN) {
                for (u64 e = 0; e < per; ++e) choice[g * per + e] = 0.0f;
            }
        }
    }
    for (u64 e = 0; e < n; ++e) keys[e] = sort_key(choice[e]);
    float sum = -0.0f;
    for (u64 j = 0; j < top_k; ++j) {
        const u64 e = argmax_key(keys, n);
        keys[e] = TAKEN;
        out_ids[j] = (u32)e;
        out_w[j] = scores[e];
        sum += scores[e];
    }
    // Weights from the unbiased scores, normalised if asked, then scaled.
    sum += 1e-20f;
    for (u64 j = 0; j < top_k; ++j) {
        const float w = norm_topk_prob ? out_w[j] / sum : out_w[j];
        out_w[j] = w * routed_scaling_factor;
    }
}

extern "C" __global__ void route(const float* logits, u64 logits_stride, u64 rows, const float* bias,
                                 int has_bias, u64 n, u64 top_k, u64 n_group, u64 topk_group,
                                 int norm_topk_prob, float routed_scaling_factor, int softmax,
                                 u32* ids, float* weights, u64 weights_stride) {
    extern __shared__ float sh[];
    __shared__ float red[32];
    float* scores = sh;
    float* choice = sh + n;
    int* keys = (int*)(sh + 2 * n);
    int* group_keys = keys + n;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* l = logits + r * logits_stride;
        __syncthreads();  // thread 0 is done with the previous row's arrays
        if (softmax) {
            // elementwise.rs `softmax`: e^(x - max), then times 1/sum.
            float m = neg_inf();
            for (u64 e = threadIdx.x; e < n; e += blockDim.x) m = fmaxf(m, l[e]);
            m = block_max(m, red);
            float s = 0.0f;
            for (u64 e = threadIdx.x; e < n; e += blockDim.x) {
                scores[e] = expf(l[e] - m);
                s += scores[e];
            }
            const float inv = 1.0f / block_sum(s, red);
            for (u64 e = threadIdx.x; e < n; e += blockDim.x) scores[e] *= inv;
        } else {
            for (u64 e = threadIdx.x; e < n; e += blockDim.x) scores[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        // The correction bias steers the selection only.
        for (u64 e = threadIdx.x; e < n; e += blockDim.x) {
            choice[e] = has_bias ? scores[e] + bias[e] : scores[e];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            select_experts(scores, choice, keys, group_keys, n, top_k, n_group, topk_group,
                           norm_topk_prob, routed_scaling_factor, ids + r * top_k,
                           weights + r * weights_stride);
        }
    }
}
