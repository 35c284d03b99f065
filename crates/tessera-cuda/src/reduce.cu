// Reductions, layer/RMS norms and the two-stage reductions of Tessera's CUDA kernels (appended
// to kernels.cu by the crate, module `source`: it uses the helpers there).

// ---- reductions: one block per output element; `lo` addresses the kept dims (by output
// index), `lr` the reduced ones (by reduced index). ----
__device__ double block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) part[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nw) ? part[threadIdx.x] : 0.0;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __shared__ double result;
    if (threadIdx.x == 0) result = v;
    __syncthreads();
    double r = result;
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) part[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nw) ? part[threadIdx.x] : -INFINITY;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    __shared__ float result;
    if (threadIdx.x == 0) result = v;
    __syncthreads();
    float r = result;
    __syncthreads();
    return r;
}

// op: 0 sum, 1 mean, 2 max, 3 sum of squares.
extern "C" __global__ void reduce(int op, const void* x, int cx, Layout lo, Layout lr, i64 r, void* y, int cy) {
    i64 o = blockIdx.x;
    i64 base = at(lo, o);
    if (op == 2) {
        float m = -INFINITY;
        bool nan = false;
        for (i64 k = threadIdx.x; k < r; k += blockDim.x) {
            float v = ldf(x, cx, base + at(lr, k));
            nan |= isnan(v);
            m = fmaxf(m, v);
        }
        nan = __syncthreads_or(nan);
        m = block_max(m);
        if (threadIdx.x == 0) stf(y, cy, o, nan ? NAN : m);
        return;
    }
    double s = 0.0;
    for (i64 k = threadIdx.x; k < r; k += blockDim.x) {
        double v = ldf(x, cx, base + at(lr, k));
        s += op == 3 ? v * v : v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) stf(y, cy, o, (float)(op == 1 ? s / (double)r : s));
}

// dx in x's shape: dy is read through `ld` (broadcast over the reduced dims); max routes the
// gradient to the elements equal to the row's max `ym` (read like dy).
extern "C" __global__ void reduce_backward(int op, const void* x, int cx, const void* dy, int cd, Layout ld,
                                           const float* ym, i64 r, void* dx, int cdx, i64 n) {
    GRID_STRIDE(i, n) {
        float g = ldf(dy, cd, at(ld, i));
        float v;
        switch (op) {
            case 0: v = g; break;
            case 1: v = g / (float)r; break;
            case 2: v = ldf(x, cx, i) == ym[at(ld, i)] ? g : 0.0f; break;
            default: v = 2.0f * ldf(x, cx, i) * g;
        }
        stf(dx, cdx, i, v);
    }
}

// ---- row kernels: one block per row of the last dim ----
extern "C" __global__ void softmax(const float* x, float* y, i64 cols) {
    const float* xr = x + blockIdx.x * cols;
    float* yr = y + blockIdx.x * cols;
    float m = -INFINITY;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m);
    double s = 0.0;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - m);
    s = block_sum(s);
    float inv = (float)(1.0 / s);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
}

extern "C" __global__ void softmax_backward(const float* y, const float* dy, float* dx, i64 cols) {
    const float* yr = y + blockIdx.x * cols;
    const float* gr = dy + blockIdx.x * cols;
    double s = 0.0;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += (double)yr[j] * gr[j];
    float d = (float)block_sum(s);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) dx[blockIdx.x * cols + j] = yr[j] * (gr[j] - d);
}

// Layer norm (bias may be null: RMS norm when `rms`). Saves nothing: the backward recomputes.
// Operands in their own dtypes (codes c): x, the weight w, the bias b (null: RMS norm), y.
struct NormCodes {
    int x, w, b, y, dy;
};

// The norms' fast path: the row in registers (eight columns per 16-byte load, at most
// NORM_VEC groups of eight per thread), read from global memory once. It takes rows of a
// multiple of 8 columns, up to 8·NORM_VEC·blockDim.x, with every operand 16-byte aligned and
// of a float type; the arithmetic per element is the scalar path's.
#define NORM_VEC 4
__device__ __forceinline__ bool norm_vec_ok(const void* p, int code, i64 cols, int nv = NORM_VEC) {
    return !p || ((code == 0 || code == 2 || code == 3) && (((u64)p) & 15u) == 0 && (cols & 7) == 0 &&
                  cols <= 8 * nv * (i64)blockDim.x);
}

// A row's mean (0 for RMS norm) and 1/σ from its NORM_VEC groups of eight in registers.
template <int NV>
__device__ __forceinline__ void norm_stats_vec(const float (&xv)[NV][8], int groups, i64 cols, float eps,
                                               int rms, float* mean, float* rstd) {
    double s = 0.0, s2 = 0.0;
    if (!rms) {
#pragma unroll
        for (int q = 0; q < NV; ++q)
            if ((int)threadIdx.x + q * (int)blockDim.x < groups)
#pragma unroll
                for (int k = 0; k < 8; ++k) s += xv[q][k];
    }
    const float m = rms ? 0.0f : (float)(block_sum(s) / (double)cols);
#pragma unroll
    for (int q = 0; q < NV; ++q)
        if ((int)threadIdx.x + q * (int)blockDim.x < groups)
#pragma unroll
            for (int k = 0; k < 8; ++k) { double d = xv[q][k] - m; s2 += d * d; }
    *mean = m;
    *rstd = (float)(1.0 / sqrt(block_sum(s2) / (double)cols + (double)eps));
}

__device__ __forceinline__ void norm_forward_vec(const void* x, const void* w, const void* b, void* y, NormCodes c,
                                                 i64 cols, float eps, int rms) {
    const i64 r0 = (i64)blockIdx.x * cols;
    const int groups = (int)(cols >> 3);
    float xv[NORM_VEC][8];
#pragma unroll
    for (int q = 0; q < NORM_VEC; ++q) {
        const int gi = (int)threadIdx.x + q * (int)blockDim.x;
        if (gi < groups) ld8(x, c.x, r0 + 8 * gi, xv[q]);
    }
    float mean, rstd;
    norm_stats_vec(xv, groups, cols, eps, rms, &mean, &rstd);
#pragma unroll
    for (int q = 0; q < NORM_VEC; ++q) {
        const int gi = (int)threadIdx.x + q * (int)blockDim.x;
        if (gi >= groups) continue;
        float wv[8], bv[8], o[8];
        ld8(w, c.w, 8 * gi, wv);
        if (b) ld8(b, c.b, 8 * gi, bv);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float v = (xv[q][k] - mean) * rstd * wv[k];
            o[k] = b ? v + bv[k] : v;
        }
        st8(y, c.y, r0 + 8 * gi, o);
    }
}

extern "C" __global__ void norm_forward(const void* x, const void* w, const void* b, void* y, NormCodes c, i64 cols,
                                        float eps, int rms) {
    if (norm_vec_ok(x, c.x, cols) && norm_vec_ok(w, c.w, cols) && norm_vec_ok(b, c.b, cols) &&
        norm_vec_ok(y, c.y, cols)) {
        norm_forward_vec(x, w, b, y, c, cols, eps, rms);
        return;
    }
    const i64 r0 = (i64)blockIdx.x * cols;
    double s = 0.0, s2 = 0.0;
    if (!rms)
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += ldf(x, c.x, r0 + j);
    float mean = rms ? 0.0f : (float)(block_sum(s) / (double)cols);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) { double d = ldf(x, c.x, r0 + j) - mean; s2 += d * d; }
    float rstd = (float)(1.0 / sqrt(block_sum(s2) / (double)cols + (double)eps));
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = (ldf(x, c.x, r0 + j) - mean) * rstd * ldf(w, c.w, j);
        stf(y, c.y, r0 + j, b ? v + ldf(b, c.b, j) : v);
    }
}

// dx per row; each row's mean and rstd go to `stats` [rows, 2] for the weight gradients.
template <int NV>
__device__ __forceinline__ void norm_backward_dx_vec(const void* x, const void* w, const void* dy, void* dx,
                                                     NormCodes k, float* stats, i64 cols, float eps, int rms) {
    const i64 r0 = (i64)blockIdx.x * cols;
    const int groups = (int)(cols >> 3);
    float xv[NV][8], gv[NV][8];
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int gi = (int)threadIdx.x + q * (int)blockDim.x;
        if (gi < groups) {
            ld8(x, k.x, r0 + 8 * gi, xv[q]);
            ld8(dy, k.dy, r0 + 8 * gi, gv[q]);
        }
    }
    float mean, rstd;
    norm_stats_vec(xv, groups, cols, eps, rms, &mean, &rstd);
    // dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w (no mean(g) term for RMS).
    double a = 0.0, c = 0.0;
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int gi = (int)threadIdx.x + q * (int)blockDim.x;
        if (gi >= groups) continue;
        float wv[8];
        ld8(w, k.w, 8 * gi, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float g = gv[q][e] * wv[e];
            float xh = (xv[q][e] - mean) * rstd;
            a += g;
            c += (double)g * xh;
        }
    }
    float mg = rms ? 0.0f : (float)(block_sum(a) / (double)cols);
    float mgx = (float)(block_sum(c) / (double)cols);
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int gi = (int)threadIdx.x + q * (int)blockDim.x;
        if (gi >= groups) continue;
        float wv[8], o[8];
        ld8(w, k.w, 8 * gi, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float g = gv[q][e] * wv[e];
            float xh = (xv[q][e] - mean) * rstd;
            o[e] = rstd * (g - mg - xh * mgx);
        }
        st8(dx, k.y, r0 + 8 * gi, o);
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = rstd;
    }
}

// The backward's dx: the row in registers (up to NV groups of eight per thread) where the
// operands allow, else the scalar path below.
template <int NV>
__device__ __forceinline__ void norm_backward_dx_body(const void* x, const void* w, const void* dy, void* dx,
                                                      NormCodes k, float* stats, i64 cols, float eps, int rms) {
    if (norm_vec_ok(x, k.x, cols, NV) && norm_vec_ok(w, k.w, cols, NV) && norm_vec_ok(dy, k.dy, cols, NV) &&
        norm_vec_ok(dx, k.y, cols, NV)) {
        norm_backward_dx_vec<NV>(x, w, dy, dx, k, stats, cols, eps, rms);
        return;
    }
    const i64 r0 = (i64)blockIdx.x * cols;
    double s = 0.0, s2 = 0.0;
    if (!rms)
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += ldf(x, k.x, r0 + j);
    float mean = rms ? 0.0f : (float)(block_sum(s) / (double)cols);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) { double d = ldf(x, k.x, r0 + j) - mean; s2 += d * d; }
    float rstd = (float)(1.0 / sqrt(block_sum(s2) / (double)cols + (double)eps));
    // dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w (no mean(g) term for RMS).
    double a = 0.0, c = 0.0;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = ldf(dy, k.dy, r0 + j) * ldf(w, k.w, j);
        float xh = (ldf(x, k.x, r0 + j) - mean) * rstd;
        a += g;
        c += (double)g * xh;
    }
    float mg = rms ? 0.0f : (float)(block_sum(a) / (double)cols);
    float mgx = (float)(block_sum(c) / (double)cols);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = ldf(dy, k.dy, r0 + j) * ldf(w, k.w, j);
        float xh = (ldf(x, k.x, r0 + j) - mean) * rstd;
        stf(dx, k.y, r0 + j, rstd * (g - mg - xh * mgx));
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = rstd;
    }
}

extern "C" __global__ void norm_backward_dx(const void* x, const void* w, const void* dy, void* dx, NormCodes k,
                                            float* stats, i64 cols, float eps, int rms) {
    norm_backward_dx_body<NORM_VEC>(x, w, dy, dx, k, stats, cols, eps, rms);
}

// Rows of at most eight columns per thread (2,048 at 256 threads): one group of eight per
// thread holds a quarter of the registers, so four times the blocks share an SM (the row's
// reductions wait on memory; more rows in flight hide it).
extern "C" __global__ void norm_backward_dx1(const void* x, const void* w, const void* dy, void* dx, NormCodes k,
                                             float* stats, i64 cols, float eps, int rms) {
    norm_backward_dx_body<1>(x, w, dy, dx, k, stats, cols, eps, rms);
}

// ---- two-stage reductions: partial results in f64 scratch, then one pass combining them ----
__device__ __forceinline__ double combine(int op, double a, double v) {
    if (op == 2) return (isnan(a) || isnan(v)) ? (double)NAN : fmax(a, v);
    return a + (op == 3 ? v * v : v);
}

__device__ __forceinline__ double combine_part(int op, double a, double v) {
    if (op == 2) return (isnan(a) || isnan(v)) ? (double)NAN : fmax(a, v);
    return a + v;
}

// Columns of a contiguous [rows, n] (reducing the leading dims): block (32, 8) covers 32
// columns (coalesced) over row chunk blockIdx.y; part[blockIdx.y * n + j].
extern "C" __global__ void reduce_cols_partial(int op, const void* x, int cx, i64 rows, i64 n, i64 chunk, double* part) {
    __shared__ double acc[8][33];
    i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    double a = op == 2 ? -(double)INFINITY : 0.0;
    if (j < n)
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) a = combine(op, a, (double)ldf(x, cx, r * n + j));
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && j < n) {
        for (int k = 1; k < 8; ++k) a = combine_part(op, a, acc[k][threadIdx.x]);
        part[blockIdx.y * n + j] = a;
    }
}

// Sum-like reductions of few outputs over many elements: block (o, g) covers chunk g of
// output o's reduced elements; part[o * groups + g].
extern "C" __global__ void reduce_partial(int op, const void* x, int cx, Layout lo, Layout lr, i64 r, i64 chunk,
                                          double* part) {
    i64 o = blockIdx.x, g = blockIdx.y;
    i64 base = at(lo, o);
    i64 k0 = g * chunk, k1 = k0 + chunk < r ? k0 + chunk : r;
    double s = 0.0;
    const i64 bd = blockDim.x;
    // A dense run from a 16-byte-aligned start (the host makes chunks a multiple of 8):
    // 16-byte loads, two in flight per thread.
    if (lr.ndim == 1 && lr.strides[0] == 1 && lr.offset == 0 && (k0 & 7) == 0 &&
        vec8_ok((const char*)x, Layout{1, 1, base, {r}, {1}}, cx)) {
        const i64 g1 = k1 >> 3;
        i64 gi = (k0 >> 3) + threadIdx.x;
        for (; gi + bd < g1; gi += 2 * bd) {
            float v[8], w[8];
            ld8(x, cx, base + (gi << 3), v);
            ld8(x, cx, base + ((gi + bd) << 3), w);
#pragma unroll
            for (int e = 0; e < 8; ++e) s = combine(op, s, (double)v[e]);
#pragma unroll
            for (int e = 0; e < 8; ++e) s = combine(op, s, (double)w[e]);
        }
        if (gi < g1) {
            float v[8];
            ld8(x, cx, base + (gi << 3), v);
#pragma unroll
            for (int e = 0; e < 8; ++e) s = combine(op, s, (double)v[e]);
        }
        for (i64 k = (g1 << 3) + threadIdx.x; k < k1; k += bd) s = combine(op, s, (double)ldf(x, cx, base + k));
        s = block_sum(s);
        if (threadIdx.x == 0) part[o * gridDim.y + g] = s;
        return;
    }
    // Four loads in flight per thread (the sum is in double: the order does not show in f32).
    i64 k = k0 + threadIdx.x;
    for (; k + 3 * bd < k1; k += 4 * bd) {
        float v0 = ldf(x, cx, base + at(lr, k)), v1 = ldf(x, cx, base + at(lr, k + bd));
        float v2 = ldf(x, cx, base + at(lr, k + 2 * bd)), v3 = ldf(x, cx, base + at(lr, k + 3 * bd));
        s = combine(op, combine(op, s, (double)v0), (double)v1);
        s = combine(op, combine(op, s, (double)v2), (double)v3);
    }
    for (; k < k1; k += bd) s = combine(op, s, (double)ldf(x, cx, base + at(lr, k)));
    s = block_sum(s);
    if (threadIdx.x == 0) part[o * gridDim.y + g] = s;
}

// y[j] = the partials of output j combined (part[j * sj + g * sg], g < groups); mean divides
// by the reduced count r.
extern "C" __global__ void reduce_partials(int op, const double* part, i64 groups, i64 sj, i64 sg, i64 r, void* y,
                                           int cy, i64 n) {
    GRID_STRIDE(j, n) {
        double a = op == 2 ? -(double)INFINITY : 0.0;
        for (i64 g = 0; g < groups; ++g) a = combine_part(op, a, part[j * sj + g * sg]);
        stf(y, cy, j, (float)(op == 1 ? a / (double)r : a));
    }
}

// The same for sums over many partials (the gradient norms' up to 1,024 per output): a block
// per output, its threads striding over the partials (a chain of dependent loads in one
// thread took about 50 µs per output).
extern "C" __global__ void reduce_partials_block(int op, const double* part, i64 groups, i64 sj, i64 sg, i64 r,
                                                 void* y, int cy) {
    const i64 j = blockIdx.x;
    double a = 0.0;
    for (i64 g = threadIdx.x; g < groups; g += blockDim.x) a += part[j * sj + g * sg];
    a = block_sum(a);
    if (threadIdx.x == 0) stf(y, cy, j, (float)(op == 1 ? a / (double)r : a));
}

// Norm weight (and bias) gradients as column partials: block (32, 8) over 32 columns and
// row chunk blockIdx.y; pw/pb[blockIdx.y * cols + j] (pb may be null).
extern "C" __global__ void norm_dw_partial(const void* x, int cx, const void* dy, int cd, const float* stats, i64 rows,
                                           i64 cols, i64 chunk, double* pw, double* pb) {
    __shared__ double aw[8][33], ab[8][33];
    i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    double sw = 0.0, sb = 0.0;
    if (j < cols)
#pragma unroll 4
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
            float g = ldf(dy, cd, r * cols + j);
            sw += (double)g * ((ldf(x, cx, r * cols + j) - stats[2 * r]) * stats[2 * r + 1]);
            sb += g;
        }
    aw[threadIdx.y][threadIdx.x] = sw;
    ab[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        for (int k = 1; k < 8; ++k) {
            sw += aw[k][threadIdx.x];
            sb += ab[k][threadIdx.x];
        }
        pw[blockIdx.y * cols + j] = sw;
        if (pb) pb[blockIdx.y * cols + j] = sb;
    }
}

// The vector path of norm_dw_partial (columns a multiple of 8, x and dy 16-byte aligned):
// block (32, 8) over 256 columns, eight per thread by 16-byte loads (the scalar path's
// two-byte loads kept too few bytes in flight), and row chunk blockIdx.y.
extern "C" __global__ void norm_dw_partial8(const void* x, int cx, const void* dy, int cd, const float* stats,
                                            i64 rows, i64 cols, i64 chunk, double* pw, double* pb) {
    __shared__ double aw[8][256], ab[8][256];
    const i64 c0 = (i64)blockIdx.x * 256 + 8 * threadIdx.x;
    const i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    double sw[8], sb[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) sw[e] = sb[e] = 0.0;
    if (c0 < cols)
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
            float xv[8], gv[8];
            ld8(x, cx, r * cols + c0, xv);
            ld8(dy, cd, r * cols + c0, gv);
            const float m = stats[2 * r], rs = stats[2 * r + 1];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                sw[e] += (double)gv[e] * ((xv[e] - m) * rs);
                sb[e] += gv[e];
            }
        }
    // Slot e·32 + lane holds column 8·lane + e: consecutive lanes, consecutive banks.
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        aw[threadIdx.y][e * 32 + threadIdx.x] = sw[e];
        ab[threadIdx.y][e * 32 + threadIdx.x] = sb[e];
    }
    __syncthreads();
    const int t = threadIdx.y * 32 + threadIdx.x;
    const i64 j = (i64)blockIdx.x * 256 + 8 * (t & 31) + (t >> 5);
    if (j < cols) {
        double a = 0.0, b = 0.0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            a += aw[k][t];
            b += ab[k][t];
        }
        pw[blockIdx.y * cols + j] = a;
        if (pb) pb[blockIdx.y * cols + j] = b;
    }
}
