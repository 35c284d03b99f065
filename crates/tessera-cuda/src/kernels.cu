// Tessera's CUDA kernels, compiled at run time by NVRTC (crate tessera-cuda, module `source`).
// Conventions: every float kernel computes in f32 (accumulating in f64 where the CPU kernel
// does). Elementwise kernels read and write f32, bf16 or f16 directly (a type code per
// operand: `ldf`/`stf`), computing in f32 and rounding the result once, which is what the CPU
// backend's upcast-compute-round gives, bit for bit; the others take f32 operands (the backend
// upcasts half ones first, as the CPU backend does).
// Tensors are addressed through a `Layout` (dims and element strides, up to 8 dims), so
// broadcast views (stride 0) and permuted or sliced views need no copy.

#define MAXD 8
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
typedef long long i64;
typedef unsigned long long u64;

struct Layout {
    int ndim;
    int small;  // every dim and the element count below 2^31: 32-bit index arithmetic
    i64 offset;
    i64 dims[MAXD];
    i64 strides[MAXD];
};

// Element offset of flat row-major index `i` of `out_dims` read through `l`. The backend
// collapses layouts first (adjacent dims that step alike merge), so a dense or fully broadcast
// operand is one dim and costs no division.
__device__ __forceinline__ i64 at(const Layout& l, i64 i) {
    if (l.ndim == 1) return l.offset + i * l.strides[0];
    i64 off = l.offset;
    if (l.small) {
        unsigned u = (unsigned)i;
        for (int d = l.ndim - 1; d >= 0; --d) {
            unsigned n = (unsigned)l.dims[d];
            off += (i64)(u % n) * l.strides[d];
            u /= n;
        }
        return off;
    }
    for (int d = l.ndim - 1; d >= 0; --d) {
        i64 n = l.dims[d];
        off += (i % n) * l.strides[d];
        i /= n;
    }
    return off;
}

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// ---- type codes (the backend's `TypeCode`) ----
// 0 f32, 1 f64, 2 f16, 3 bf16, 4 i64, 5 u8
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ double load_as(const void* p, int code, i64 i) {
    switch (code) {
        case 0: return (double)((const float*)p)[i];
        case 1: return ((const double*)p)[i];
        case 2: return (double)f16_to_f32(((const unsigned short*)p)[i]);
        case 3: return (double)bf16_to_f32(((const unsigned short*)p)[i]);
        case 4: return (double)((const i64*)p)[i];
        default: return (double)((const unsigned char*)p)[i];
    }
}

// Stores with the CPU's conversion rules: floats round to nearest, float to int truncates,
// to bool (u8 with `to_bool`) is x != 0.
__device__ __forceinline__ void store_as(void* p, int code, i64 i, double v, int to_bool) {
    switch (code) {
        case 0: ((float*)p)[i] = (float)v; break;
        case 1: ((double*)p)[i] = v; break;
        case 2: ((unsigned short*)p)[i] = f32_to_f16((float)v); break;
        case 3: ((unsigned short*)p)[i] = f32_to_bf16((float)v); break;
        case 4: ((i64*)p)[i] = (i64)v; break;
        default:
            ((unsigned char*)p)[i] = to_bool ? (unsigned char)(v != 0.0) : (unsigned char)(i64)v;
    }
}

// f32, f16 or bf16 (type codes 0, 2, 3) as f32, and back with round-to-nearest-even.
__device__ __forceinline__ float ldf(const void* p, int code, i64 i) {
    if (code == 3) return bf16_to_f32(((const unsigned short*)p)[i]);
    if (code == 2) return f16_to_f32(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}
__device__ __forceinline__ void stf(void* p, int code, i64 i, float v) {
    if (code == 3) ((unsigned short*)p)[i] = f32_to_bf16(v);
    else if (code == 2) ((unsigned short*)p)[i] = f32_to_f16(v);
    else ((float*)p)[i] = v;
}

extern "C" __global__ void cast(const void* x, Layout lx, int from, void* y, int to, int to_bool, i64 n) {
    // Between f32, f16 and bf16, f32 holds every value exactly: no detour through double.
    if ((from == 0 || from == 2 || from == 3) && (to == 0 || to == 2 || to == 3)) {
        GRID_STRIDE(i, n) { stf(y, to, i, ldf(x, from, at(lx, i))); }
        return;
    }
    GRID_STRIDE(i, n) { store_as(y, to, i, load_as(x, from, at(lx, i)), to_bool); }
}

// Strided copy of elements of `size` bytes: y[at(ly, i)] = x[at(lx, i)].
extern "C" __global__ void copy_strided(const void* x, Layout lx, void* y, Layout ly, int size, i64 n) {
    GRID_STRIDE(i, n) {
        i64 s = at(lx, i), d = at(ly, i);
        switch (size) {
            case 1: ((unsigned char*)y)[d] = ((const unsigned char*)x)[s]; break;
            case 2: ((unsigned short*)y)[d] = ((const unsigned short*)x)[s]; break;
            case 4: ((unsigned int*)y)[d] = ((const unsigned int*)x)[s]; break;
            default: ((u64*)y)[d] = ((const u64*)x)[s];
        }
    }
}

extern "C" __global__ void fill_bits(void* y, u64 bits, int size, i64 n) {
    GRID_STRIDE(i, n) {
        switch (size) {
            case 1: ((unsigned char*)y)[i] = (unsigned char)bits; break;
            case 2: ((unsigned short*)y)[i] = (unsigned short)bits; break;
            case 4: ((unsigned int*)y)[i] = (unsigned int)bits; break;
            default: ((u64*)y)[i] = bits;
        }
    }
}

// ---- elementwise (op codes: the backend's exhaustive matches over the IR's enums) ----
__device__ __forceinline__ double normal_cdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float c = 0.7978845608028654f;
    float u = c * (x + 0.044715f * x * x * x);
    float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ __forceinline__ float unary_f(int op, float v) {
    switch (op) {
        case 0: return -v;
        case 1: return expf(v);
        case 2: return logf(v);
        case 3: return sqrtf(v);
        case 4: return 1.0f / sqrtf(v);
        case 5: return tanhf(v);
        case 6: return (float)((double)v * normal_cdf((double)v));
        case 7: return gelu_tanh(v);
        case 8: return v * sigmoidf_(v);
        case 9: return v > 0.0f ? v : 0.0f;
        default: return sigmoidf_(v);
    }
}

__device__ __forceinline__ float unary_grad(int op, float v, float g) {
    switch (op) {
        case 0: return -g;
        case 1: return g * expf(v);
        case 2: return g / v;
        case 3: return g * (0.5f / sqrtf(v));
        case 4: return g * (-0.5f / (v * sqrtf(v)));
        case 5: { float t = tanhf(v); return g * (1.0f - t * t); }
        case 6: {
            double x = v;
            return g * (float)(normal_cdf(x) + x * 0.3989422804014327 * exp(-0.5 * x * x));
        }
        case 7: return g * gelu_tanh_grad(v);
        case 8: { float s = sigmoidf_(v); return g * (s * (1.0f + v * (1.0f - s))); }
        case 9: return v > 0.0f ? g : 0.0f;
        default: { float s = sigmoidf_(v); return g * s * (1.0f - s); }
    }
}

extern "C" __global__ void unary(int op, const void* x, Layout lx, int cx, void* y, int cy, i64 n) {
    GRID_STRIDE(i, n) { stf(y, cy, i, unary_f(op, ldf(x, cx, at(lx, i)))); }
}

extern "C" __global__ void unary_backward(int op, const void* x, Layout lx, int cx, const void* dy, Layout ld, int cd,
                                          void* y, int cy, i64 n) {
    GRID_STRIDE(i, n) { stf(y, cy, i, unary_grad(op, ldf(x, cx, at(lx, i)), ldf(dy, cd, at(ld, i)))); }
}

__device__ __forceinline__ float binary_f(int op, float p, float q) {
    switch (op) {
        case 0: return p + q;
        case 1: return p - q;
        case 2: return p * q;
        case 3: return p / q;
        case 4: return (p >= q || isnan(p)) ? p : q;
        default: return (p <= q || isnan(p)) ? p : q;
    }
}

extern "C" __global__ void binary(int op, const void* a, Layout la, int ca, const void* b, Layout lb, int cb, void* y,
                                  int cy, i64 n) {
    GRID_STRIDE(i, n) { stf(y, cy, i, binary_f(op, ldf(a, ca, at(la, i)), ldf(b, cb, at(lb, i)))); }
}

// The gradient w.r.t. operand `wrt` in the broadcast shape.
extern "C" __global__ void binary_backward(int op, int wrt, const void* a, Layout la, int ca, const void* b, Layout lb,
                                           int cb, const void* dy, Layout ld, int cd, void* y, int cy, i64 n) {
    GRID_STRIDE(i, n) {
        float p = ldf(a, ca, at(la, i)), q = ldf(b, cb, at(lb, i)), g = ldf(dy, cd, at(ld, i)), r;
        switch (op) {
            case 0: r = g; break;
            case 1: r = wrt == 0 ? g : -g; break;
            case 2: r = wrt == 0 ? g * q : g * p; break;
            case 3: r = wrt == 0 ? g / q : -g * p / (q * q); break;
            case 4: r = ((p >= q) == (wrt == 0)) ? g : 0.0f; break;
            default: r = ((p <= q) == (wrt == 0)) ? g : 0.0f;
        }
        stf(y, cy, i, r);
    }
}

// Dropout with the CPU's mask (splitmix-style hash of the element's flat index).
extern "C" __global__ void dropout(const void* x, Layout lx, int cx, void* y, int cy, const i64* seed, u64 stream,
                                   u64 threshold, float scale, i64 n) {
    u64 base = (u64)seed[0] * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull;
    GRID_STRIDE(i, n) {
        u64 z = base + (u64)i;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        stf(y, cy, i, ((z >> 11) >= threshold) ? ldf(x, cx, at(lx, i)) * scale : 0.0f);
    }
}

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

extern "C" __global__ void norm_forward(const void* x, const void* w, const void* b, void* y, NormCodes c, i64 cols,
                                        float eps, int rms) {
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
extern "C" __global__ void norm_backward_dx(const void* x, const void* w, const void* dy, void* dx, NormCodes k,
                                            float* stats, i64 cols, float eps, int rms) {
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

// ---- embedding: the table holds ids [first, first + count) (all of them, or a device's
// vocabulary shard); other ids read zero rows and add nothing to the gradient ----
extern "C" __global__ void embedding(const float* table, const i64* ids, float* y, i64 dim, i64 first, i64 count,
                                     i64 n) {
    GRID_STRIDE(i, n) {
        i64 r = ids[i / dim] - first;
        y[i] = (r >= 0 && r < count) ? table[r * dim + i % dim] : 0.0f;
    }
}

extern "C" __global__ void embedding_backward(const i64* ids, const float* dy, float* dt, i64 dim, i64 first,
                                              i64 count, i64 n) {
    GRID_STRIDE(i, n) {
        i64 r = ids[i / dim] - first;
        if (r >= 0 && r < count) atomicAdd(&dt[r * dim + i % dim], dy[i]);
    }
}

// ---- fused softmax cross-entropy (targets checked on the host) ----
extern "C" __global__ void cross_entropy_rows(const void* logits, int cl, const i64* targets, float* lse, float* nll,
                                              i64 v, i64 ignore, int has_ignore) {
    const i64 r0 = (i64)blockIdx.x * v;
    float m = -INFINITY;
    for (i64 j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ldf(logits, cl, r0 + j));
    m = block_max(m);
    double s = 0.0;
    for (i64 j = threadIdx.x; j < v; j += blockDim.x) s += exp((double)(ldf(logits, cl, r0 + j) - m));
    s = block_sum(s);
    if (threadIdx.x == 0) {
        double l = m == -INFINITY ? -INFINITY : (double)m + log(s);
        lse[blockIdx.x] = (float)l;
        i64 t = targets[blockIdx.x];
        nll[blockIdx.x] = (has_ignore && t == ignore) ? 0.0f : (float)(l - (double)ldf(logits, cl, r0 + t));
    }
}

extern "C" __global__ void sum_to_scalar(const float* x, i64 n, double div, float* y) {
    double s = 0.0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) y[0] = (float)(s / div);
}

extern "C" __global__ void cross_entropy_backward(const void* logits, int cl, const i64* targets, const float* lse,
                                                  const float* dloss, double div, void* dx, int cdx, i64 v,
                                                  i64 ignore, int has_ignore, i64 n) {
    GRID_STRIDE(i, n) {
        i64 r = i / v, j = i % v;
        i64 t = targets[r];
        if (has_ignore && t == ignore) {
            stf(dx, cdx, i, 0.0f);
        } else {
            float g = (float)((double)dloss[0] / div);
            float p = expf(ldf(logits, cl, i) - lse[r]);
            stf(dx, cdx, i, g * (p - (j == t ? 1.0f : 0.0f)));
        }
    }
}

// ---- AdamW, in place (the CPU kernel's update, f32 state; param and gradient f32, bf16 or f16) ----
// The scalars (learning rate, 1-based step, global gradient norm, fp16 loss scale or null)
// are read on the device, so the update queues without a host round trip; the coefficients
// are the CPU kernel's, computed in double and rounded to f32 alike.
extern "C" __global__ void adamw(void* param, int p_code, const void* grad, int g_code, float* m, float* v,
                                 float* master, const void* lr_p, int lr_code, const void* step_p, int step_code,
                                 const void* norm_p, int norm_code, const void* scale_p, int scale_code,
                                 double beta1, double beta2, double eps_d, double wd_d, double max_norm, i64 n) {
    double scale = scale_p ? load_as(scale_p, scale_code, 0) : 1.0;
    double norm = load_as(norm_p, norm_code, 0) * scale;
    if (scale_p && !isfinite(norm)) return;  // an overflowed fp16 step: nothing is written
    double step = load_as(step_p, step_code, 0);
    double clip_d = (max_norm >= 0.0 ? fmin(max_norm / (norm + 1e-6), 1.0) : 1.0) * scale;
    float clip = (float)clip_d, b1 = (float)beta1, b2 = (float)beta2;
    float inv_bc1 = (float)(1.0 / (1.0 - pow(beta1, step)));
    float inv_bc2 = (float)(1.0 / (1.0 - pow(beta2, step)));
    float eps = (float)eps_d, lr = (float)load_as(lr_p, lr_code, 0), wd = (float)wd_d;
    GRID_STRIDE(i, n) {
        float w = master ? master[i] : ldf(param, p_code, i);
        float g = clip * ldf(grad, g_code, i);
        float mi = b1 * m[i] + (1.0f - b1) * g;
        float vi = b2 * v[i] + (1.0f - b2) * g * g;
        float mh = mi * inv_bc1, vh = vi * inv_bc2;
        w = w - lr * (mh / (sqrtf(vh) + eps) + wd * w);
        m[i] = mi;
        v[i] = vi;
        if (master) master[i] = w;
        stf(param, p_code, i, w);
    }
}

// ---- rotary embeddings: x [B,S,H,D], pos [B*S] (or null: s index), half-split pairs ----
// One block per token (b, s): its angles (in double, as the CPU kernel computes them) once
// into shared memory, then every head's pairs. ROPE_MAX_HALF bounds the head dim (the
// backend checks).
#define ROPE_MAX_HALF 512
extern "C" __global__ void rope(const void* x, int cx, const i64* pos, const float* inv_freq, void* y, int cy, i64 s,
                                i64 h, i64 d, float sign) {
    __shared__ float cs[2 * ROPE_MAX_HALF];
    const i64 bs = blockIdx.x;  // b*S + si
    const int half = (int)(d / 2);
    const i64 p = pos ? pos[bs] : bs % s;
    for (int k = threadIdx.x; k < half; k += blockDim.x) {
        double ang = (double)sign * (double)p * (double)inv_freq[k];
        cs[k] = (float)cos(ang);
        cs[half + k] = (float)sin(ang);
    }
    __syncthreads();
    const i64 base = bs * h * d;
    for (int i = threadIdx.x; i < (int)h * half; i += blockDim.x) {
        const int hh = i / half, k = i - hh * half;
        const i64 o = base + (i64)hh * d + k;
        const float c = cs[k], sn = cs[half + k];
        float x1 = ldf(x, cx, o), x2 = ldf(x, cx, o + half);
        stf(y, cy, o, x1 * c - x2 * sn);
        stf(y, cy, o + half, x2 * c + x1 * sn);
    }
}

// ---- attention: q [B,S,H,D], k/v [B,T,Hkv,D]; one block per (query row, head, batch) ----
struct Attn {
    i64 b, s, t, h, hkv, d;
    int causal;
    i64 window;  // 0: none
    float scale;
};

__device__ __forceinline__ i64 attn_pos(const Attn& a, const i64* start, i64 b, i64 i) {
    return start ? start[b] + i : i + a.t - a.s;
}

__device__ __forceinline__ void attn_visible(const Attn& a, i64 p, i64* lo, i64* hi) {
    i64 h = a.causal ? p + 1 : a.t;
    h = h < 0 ? 0 : (h > a.t ? a.t : h);
    i64 l = a.window > 0 ? p - a.window + 1 : 0;
    l = l < 0 ? 0 : (l > a.t ? a.t : l);
    *lo = l;
    *hi = h > l ? h : l;
}

// D_i = Σ_e dO·O per query row ([B,H,S]), for the backward's dS = P ⊙ (dP − D).
extern "C" __global__ void attention_delta(const float* out, const float* dout, float* delta, Attn a) {
    i64 i = blockIdx.x, hh = blockIdx.y, b = blockIdx.z;
    i64 off = ((b * a.s + i) * a.h + hh) * a.d;
    double s = 0.0;
    for (i64 e = threadIdx.x; e < a.d; e += blockDim.x) s += (double)out[off + e] * dout[off + e];
    s = block_sum(s);
    if (threadIdx.x == 0) delta[(b * a.h + hh) * a.s + i] = (float)s;
}

// ---- attention through cuBLAS: per batch element b, the scores [H,S,T] come from a GEMM
// (already scaled); these row kernels apply the masks and ALiBi and do the softmax parts. ----
extern "C" __global__ void attn_softmax(float* sc, const i64* start, const float* slopes, Attn a, i64 b,
                                        float* lse) {
    i64 i = blockIdx.x, hh = blockIdx.y;
    float* row = sc + (hh * a.s + i) * a.t;
    i64 p = attn_pos(a, start, b, i);
    i64 lo, hi;
    attn_visible(a, p, &lo, &hi);
    float slope = slopes ? slopes[hh] : 0.0f;
    float m = -INFINITY;
    for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, row[j] + slope * (float)(j - p));
    m = block_max(m);
    double s = 0.0;
    for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) s += expf(row[j] + slope * (float)(j - p) - m);
    s = block_sum(s);
    float inv = s > 0.0 ? (float)(1.0 / s) : 0.0f;
    for (i64 j = threadIdx.x; j < a.t; j += blockDim.x)
        row[j] = (j >= lo && j < hi) ? expf(row[j] + slope * (float)(j - p) - m) * inv : 0.0f;
    if (threadIdx.x == 0) lse[(b * a.h + hh) * a.s + i] = hi > lo ? (float)((double)m + log(s)) : -INFINITY;
}

// Backward rows: `sc` holds the scaled scores, `dp` dO·Vᵀ; writes P into sc and
// dS = P ⊙ (dP − D) into dp.
extern "C" __global__ void attn_grad_scores(float* sc, float* dp, const float* lse, const float* delta,
                                            const i64* start, const float* slopes, Attn a, i64 b) {
    i64 i = blockIdx.x, hh = blockIdx.y;
    i64 r = (hh * a.s + i) * a.t;
    i64 p = attn_pos(a, start, b, i);
    i64 lo, hi;
    attn_visible(a, p, &lo, &hi);
    float slope = slopes ? slopes[hh] : 0.0f;
    float l = lse[(b * a.h + hh) * a.s + i];
    float dd = delta[(b * a.h + hh) * a.s + i];
    for (i64 j = threadIdx.x; j < a.t; j += blockDim.x) {
        float pj = (j >= lo && j < hi) ? expf(sc[r + j] + slope * (float)(j - p) - l) : 0.0f;
        sc[r + j] = pj;
        dp[r + j] = pj * (dp[r + j] - dd);
    }
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
    // Four loads in flight per thread (the sum is in double: the order does not show in f32).
    const i64 bd = blockDim.x;
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

// Norm weight (and bias) gradients as column partials: block (32, 8) over 32 columns and
// row chunk blockIdx.y; pw/pb[blockIdx.y * cols + j] (pb may be null).
extern "C" __global__ void norm_dw_partial(const void* x, int cx, const void* dy, int cd, const float* stats, i64 rows,
                                           i64 cols, i64 chunk, double* pw, double* pb) {
    __shared__ double aw[8][33], ab[8][33];
    i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 r0 = (i64)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    double sw = 0.0, sb = 0.0;
    if (j < cols)
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
