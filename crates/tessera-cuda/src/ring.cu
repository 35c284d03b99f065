// Ring attention's log-sum-exp merges (the CPU's `kernels/attention_merge.rs`): per row
// (b, s, h) of n (out [B,S,H,D], lse [B,H,S]) pairs, L = log Σ_r exp(lse_r),
// w_r = exp(lse_r − L) (0 for a pair that masked the row, lse_r = −∞), o = Σ_r w_r·o_r.
// The pairs' addresses come by value in the launch's parameters (`struct MergePtrs`, module
// `ring`): no upload. f32 throughout. Appended to the other kernels by the crate (module
// `source`): it uses `block_sum`.

#define MERGE_MAX_PAIRS 32

struct MergePtrs {
    const float* os[MERGE_MAX_PAIRS];
    const float* ls[MERGE_MAX_PAIRS];
    float* dos[MERGE_MAX_PAIRS];
    float* dls[MERGE_MAX_PAIRS];
};

// The weights of the n pairs at lse index `li` into w (one thread; the CPU's `weights`).
__device__ void merge_weights(const MergePtrs& t, int n, i64 li, float* w) {
    float m = -INFINITY;
    for (int r = 0; r < n; ++r) m = fmaxf(m, t.ls[r][li]);
    if (m == -INFINITY) {
        for (int r = 0; r < n; ++r) w[r] = 0.0f;
        return;
    }
    float sum = 0.0f;
    for (int r = 0; r < n; ++r) sum += expf(t.ls[r][li] - m);
    for (int r = 0; r < n; ++r) w[r] = expf(t.ls[r][li] - m) / sum;
}

// One block per row (b, s, h): row index `row` = (b·S + s)·H + h; its lse index.
__device__ __forceinline__ i64 merge_lse_at(i64 row, i64 s, i64 h) {
    i64 bi = row / (s * h), si = (row / h) % s, hi = row % h;
    return (bi * h + hi) * s + si;
}

// `Op::AttentionMerge`: out = Σ_r w_r·o_r.
extern "C" __global__ void attn_merge(int n, float* out, i64 s, i64 h, i64 d, MergePtrs t) {
    __shared__ float w[MERGE_MAX_PAIRS];
    i64 row = blockIdx.x;
    if (threadIdx.x == 0) merge_weights(t, n, merge_lse_at(row, s, h), w);
    __syncthreads();
    for (i64 e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < n; ++r)
            if (w[r] != 0.0f) acc += w[r] * t.os[r][row * d + e];
        out[row * d + e] = acc;
    }
}

// `Op::AttentionMergeBackward`: do_r = w_r·dout, dlse_r = w_r·(Σ_e dout·o_r − Σ_e dout·o)
// with o the merged output (recomputed here), both 0 where w_r = 0.
extern "C" __global__ void attn_merge_backward(int n, const float* dout, i64 s, i64 h, i64 d, MergePtrs t) {
    __shared__ float w[MERGE_MAX_PAIRS];
    __shared__ float dots[MERGE_MAX_PAIRS + 1];
    i64 row = blockIdx.x, li = merge_lse_at(row, s, h);
    if (threadIdx.x == 0) merge_weights(t, n, li, w);
    __syncthreads();
    const float* g = dout + row * d;
    // Σ_e dout·o (o merged as `attn_merge` does), then Σ_e dout·o_r per pair.
    double whole = 0.0;
    for (i64 e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int r = 0; r < n; ++r)
            if (w[r] != 0.0f) o += w[r] * t.os[r][row * d + e];
        whole += (double)g[e] * o;
    }
    whole = block_sum(whole);
    if (threadIdx.x == 0) dots[n] = (float)whole;
    for (int r = 0; r < n; ++r) {
        double dot = 0.0;
        if (w[r] != 0.0f)
            for (i64 e = threadIdx.x; e < d; e += blockDim.x) dot += (double)g[e] * t.os[r][row * d + e];
        dot = block_sum(dot);
        if (threadIdx.x == 0) dots[r] = (float)dot;
    }
    __syncthreads();
    for (int r = 0; r < n; ++r) {
        float* dor = t.dos[r] + row * d;
        for (i64 e = threadIdx.x; e < d; e += blockDim.x) dor[e] = w[r] != 0.0f ? w[r] * g[e] : 0.0f;
        if (threadIdx.x == 0) t.dls[r][li] = w[r] != 0.0f ? w[r] * (dots[r] - dots[n]) : 0.0f;
    }
}

// `Op::RingMerge`'s log-sum-exp: log(exp(a) + exp(b)) per element (−∞ when both are).
extern "C" __global__ void ring_lse(const float* a, const float* b, float* out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float m = fmaxf(a[i], b[i]);
        out[i] = m == -INFINITY ? m : m + logf(expf(a[i] - m) + expf(b[i] - m));
    }
}
