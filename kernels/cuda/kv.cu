// The paged KV pool in device memory (see Op::KvStore, Op::KvGather): laid
// out as the host's KvPool, block b, layer l holding block_size entries of
// entry_dim floats from float ((b · n_layers + l) · block_size) · entry_dim;
// position p of a sequence is slot p % block_size of block table[p /
// block_size]. Plain copies, one thread per float (grid stride), so the
// threads of a warp copy neighbouring floats of one entry.
//
// Block ids are device data that validation cannot see. An id at or past
// pool_blocks is never followed: kv_store skips that entry, kv_gather fills
// that output row with NaN (as gather_rows does), so a bad table shows in
// what is computed from it instead of reading another sequence's cache.
// There is no error flag to raise on this backend; the emulated device
// reports the same table as a fault.

// Float offset into the pool of position p of `layer`, or ~0 when the
// position's block id is past the pool.
__device__ __forceinline__ u64 kv_entry(const u32* table, u64 pool_blocks, u64 n_layers,
                                        u64 block_size, u64 entry_dim, u64 layer, u64 p) {
    const u64 block = table[p / block_size];
    if (block >= pool_blocks) return ~0ull;
    return ((block * n_layers + layer) * block_size + p % block_size) * entry_dim;
}

// pool[position start + i of layer] = entries[i], for i < n.
extern "C" __global__ void kv_store(const float* entries, u64 entries_stride, u64 n, float* pool,
                                    u64 pool_blocks, u64 n_layers, u64 block_size,
                                    u64 entry_dim, const u32* table, u64 layer, u64 start) {
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n * entry_dim;
         e += gridDim.x * (u64)blockDim.x) {
        const u64 i = e / entry_dim, c = e % entry_dim;
        const u64 at = kv_entry(table, pool_blocks, n_layers, block_size, entry_dim, layer, start + i);
        if (at == ~0ull) continue;
        pool[at + c] = entries[i * entries_stride + c];
    }
}

// out[p] = pool[position p of layer], for p < len.
extern "C" __global__ void kv_gather(const float* pool, u64 pool_blocks, u64 n_layers,
                                     u64 block_size, u64 entry_dim, const u32* table, u64 layer,
                                     float* out, u64 out_stride, u64 len) {
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < len * entry_dim;
         e += gridDim.x * (u64)blockDim.x) {
        const u64 p = e / entry_dim, c = e % entry_dim;
        const u64 at = kv_entry(table, pool_blocks, n_layers, block_size, entry_dim, layer, p);
        out[p * out_stride + c] = at == ~0ull ? quiet_nan() : pool[at + c];
    }
}
