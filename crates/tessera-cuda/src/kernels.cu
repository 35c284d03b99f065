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


// ---- the dense fast path of the elementwise kernels: eight elements per thread through
// 16-byte loads and stores (a bf16 kernel reading two bytes per thread keeps too few bytes in
// flight to reach the memory's bandwidth). An operand qualifies when it is f32, bf16 or f16,
// 16-byte aligned at its first element, and either dense (one dim of stride 1) or a row
// repeated down the rows (dims [R, C], strides [0, 1], C a multiple of 8: a bias). The
// arithmetic is the scalar path's, element by element, so the results are the same bits. ----
__device__ __forceinline__ bool vec8_ok(const void* p, const Layout& l, int code) {
    if (code != 0 && code != 2 && code != 3) return false;
    bool dense = l.ndim == 1 && l.strides[0] == 1;
    bool rows = l.ndim == 2 && l.strides[0] == 0 && l.strides[1] == 1 && (l.dims[1] & 7) == 0;
    if (!dense && !rows) return false;
    u64 addr = (u64)p + (u64)l.offset * (code == 0 ? 4u : 2u);
    return (addr & 15u) == 0;
}
__device__ __forceinline__ bool out8_ok(const void* y, int code) {
    return (code == 0 || code == 2 || code == 3) && (((u64)y) & 15u) == 0;
}
// The element offset of flat index i (a multiple of 8) of an operand `vec8_ok` accepted.
__device__ __forceinline__ i64 at8(const Layout& l, i64 i) {
    return l.offset + (l.ndim == 1 ? i : i % l.dims[1]);
}
__device__ __forceinline__ float half_to_f32(unsigned short h, int code) {
    return code == 3 ? bf16_to_f32(h) : f16_to_f32(h);
}
__device__ __forceinline__ unsigned short f32_to_half(float f, int code) {
    return code == 3 ? f32_to_bf16(f) : f32_to_f16(f);
}
__device__ __forceinline__ void ld8(const void* p, int code, i64 j, float v[8]) {
    if (code == 0) {
        float4 a = *(const float4*)((const float*)p + j), b = *(const float4*)((const float*)p + j + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    uint4 u = *(const uint4*)((const unsigned short*)p + j);
    unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = half_to_f32((unsigned short)(w[k] & 0xffffu), code);
        v[2 * k + 1] = half_to_f32((unsigned short)(w[k] >> 16), code);
    }
}
__device__ __forceinline__ void st8(void* p, int code, i64 j, const float v[8]) {
    if (code == 0) {
        *(float4*)((float*)p + j) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4*)((float*)p + j + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        w[k] = (unsigned)f32_to_half(v[2 * k], code) | ((unsigned)f32_to_half(v[2 * k + 1], code) << 16);
    *(uint4*)((unsigned short*)p + j) = make_uint4(w[0], w[1], w[2], w[3]);
}
// Over the groups of eight of n elements, then the n % 8 left, one per thread: `body8(i)`
// handles elements i..i+8, `body1(i)` element i.
#define DENSE8(n, body8, body1)                                                                   \
    {                                                                                             \
        i64 groups_ = (n) >> 3;                                                                   \
        GRID_STRIDE(g_, groups_) { body8(g_ << 3); }                                              \
        i64 t_ = (groups_ << 3) + (i64)blockIdx.x * blockDim.x + threadIdx.x;                     \
        if (t_ < (n)) { body1(t_); }                                                              \
    }

extern "C" __global__ void cast(const void* x, Layout lx, int from, void* y, int to, int to_bool, i64 n) {
    // Between f32, f16 and bf16, f32 holds every value exactly: no detour through double.
    if ((from == 0 || from == 2 || from == 3) && (to == 0 || to == 2 || to == 3)) {
        if (vec8_ok(x, lx, from) && out8_ok(y, to)) {
#define CAST8(i) { float v[8]; ld8(x, from, at8(lx, i), v); st8(y, to, i, v); }
#define CAST1(i) stf(y, to, i, ldf(x, from, at8(lx, i)));
            DENSE8(n, CAST8, CAST1)
#undef CAST8
#undef CAST1
            return;
        }
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
        case 10: return sigmoidf_(v);
        case 11: return sinf(v);
        default: return cosf(v);
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
        case 10: { float s = sigmoidf_(v); return g * s * (1.0f - s); }
        case 11: return g * cosf(v);
        default: return -g * sinf(v);
    }
}

// The dense paths with the op as a template argument where it is a constant (the activations
// of real models), so the switch folds away instead of being taken per element; `op` is the
// runtime code otherwise. The arithmetic is the same.
template <int OP>
__device__ __forceinline__ void unary_dense(int op, const void* x, Layout lx, int cx, void* y, int cy, i64 n) {
    const int o = OP < 0 ? op : OP;
#define UN8(i) { float v[8]; ld8(x, cx, at8(lx, i), v); _Pragma("unroll") for (int k = 0; k < 8; ++k) v[k] = unary_f(o, v[k]); st8(y, cy, i, v); }
#define UN1(i) stf(y, cy, i, unary_f(o, ldf(x, cx, at8(lx, i))));
    DENSE8(n, UN8, UN1)
#undef UN8
#undef UN1
}

template <int OP>
__device__ __forceinline__ void unary_backward_dense(int op, const void* x, Layout lx, int cx, const void* dy,
                                                     Layout ld, int cd, void* y, int cy, i64 n) {
    const int o = OP < 0 ? op : OP;
#define UB8(i) { float v[8], g[8]; ld8(x, cx, at8(lx, i), v); ld8(dy, cd, at8(ld, i), g); \
                 _Pragma("unroll") for (int k = 0; k < 8; ++k) v[k] = unary_grad(o, v[k], g[k]); st8(y, cy, i, v); }
#define UB1(i) stf(y, cy, i, unary_grad(o, ldf(x, cx, at8(lx, i)), ldf(dy, cd, at8(ld, i))));
    DENSE8(n, UB8, UB1)
#undef UB8
#undef UB1
}

extern "C" __global__ void unary(int op, const void* x, Layout lx, int cx, void* y, int cy, i64 n) {
    if (vec8_ok(x, lx, cx) && out8_ok(y, cy)) {
        switch (op) {
            case 7: unary_dense<7>(op, x, lx, cx, y, cy, n); break;  // GELU (tanh)
            case 8: unary_dense<8>(op, x, lx, cx, y, cy, n); break;  // SiLU
            default: unary_dense<-1>(op, x, lx, cx, y, cy, n);
        }
        return;
    }
    GRID_STRIDE(i, n) { stf(y, cy, i, unary_f(op, ldf(x, cx, at(lx, i)))); }
}

extern "C" __global__ void unary_backward(int op, const void* x, Layout lx, int cx, const void* dy, Layout ld, int cd,
                                          void* y, int cy, i64 n) {
    if (vec8_ok(x, lx, cx) && vec8_ok(dy, ld, cd) && out8_ok(y, cy)) {
        switch (op) {
            case 7: unary_backward_dense<7>(op, x, lx, cx, dy, ld, cd, y, cy, n); break;
            case 8: unary_backward_dense<8>(op, x, lx, cx, dy, ld, cd, y, cy, n); break;
            default: unary_backward_dense<-1>(op, x, lx, cx, dy, ld, cd, y, cy, n);
        }
        return;
    }
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

template <int OP>
__device__ __forceinline__ void binary_dense(int op, const void* a, Layout la, int ca, const void* b, Layout lb,
                                             int cb, void* y, int cy, i64 n) {
    const int o = OP < 0 ? op : OP;
#define BI8(i) { float p[8], q[8]; ld8(a, ca, at8(la, i), p); ld8(b, cb, at8(lb, i), q); \
                 _Pragma("unroll") for (int k = 0; k < 8; ++k) p[k] = binary_f(o, p[k], q[k]); st8(y, cy, i, p); }
#define BI1(i) stf(y, cy, i, binary_f(o, ldf(a, ca, at8(la, i)), ldf(b, cb, at8(lb, i))));
    DENSE8(n, BI8, BI1)
#undef BI8
#undef BI1
}

extern "C" __global__ void binary(int op, const void* a, Layout la, int ca, const void* b, Layout lb, int cb, void* y,
                                  int cy, i64 n) {
    if (vec8_ok(a, la, ca) && vec8_ok(b, lb, cb) && out8_ok(y, cy)) {
        switch (op) {  // as unary's: the common ops with the switch folded
            case 0: binary_dense<0>(op, a, la, ca, b, lb, cb, y, cy, n); break;
            case 2: binary_dense<2>(op, a, la, ca, b, lb, cb, y, cy, n); break;
            default: binary_dense<-1>(op, a, la, ca, b, lb, cb, y, cy, n);
        }
        return;
    }
    GRID_STRIDE(i, n) { stf(y, cy, i, binary_f(op, ldf(a, ca, at(la, i)), ldf(b, cb, at(lb, i)))); }
}

__device__ __forceinline__ float binary_grad(int op, int wrt, float p, float q, float g) {
    switch (op) {
        case 0: return g;
        case 1: return wrt == 0 ? g : -g;
        case 2: return wrt == 0 ? g * q : g * p;
        case 3: return wrt == 0 ? g / q : -g * p / (q * q);
        case 4: return ((p >= q) == (wrt == 0)) ? g : 0.0f;
        default: return ((p <= q) == (wrt == 0)) ? g : 0.0f;
    }
}

// The gradient w.r.t. operand `wrt` in the broadcast shape.
extern "C" __global__ void binary_backward(int op, int wrt, const void* a, Layout la, int ca, const void* b, Layout lb,
                                           int cb, const void* dy, Layout ld, int cd, void* y, int cy, i64 n) {
    if (vec8_ok(a, la, ca) && vec8_ok(b, lb, cb) && vec8_ok(dy, ld, cd) && out8_ok(y, cy)) {
#define BB8(i) { float p[8], q[8], g[8]; ld8(a, ca, at8(la, i), p); ld8(b, cb, at8(lb, i), q); ld8(dy, cd, at8(ld, i), g); \
                 _Pragma("unroll") for (int k = 0; k < 8; ++k) p[k] = binary_grad(op, wrt, p[k], q[k], g[k]); st8(y, cy, i, p); }
#define BB1(i) stf(y, cy, i, binary_grad(op, wrt, ldf(a, ca, at8(la, i)), ldf(b, cb, at8(lb, i)), ldf(dy, cd, at8(ld, i))));
        DENSE8(n, BB8, BB1)
#undef BB8
#undef BB1
        return;
    }
    GRID_STRIDE(i, n) {
        stf(y, cy, i, binary_grad(op, wrt, ldf(a, ca, at(la, i)), ldf(b, cb, at(lb, i)), ldf(dy, cd, at(ld, i))));
    }
}

// Dropout with the CPU's mask: a splitmix-style hash of each element's index in the
// single-device tensor. Unsharded (`dropout`) that is the flat index; for a tensor-parallel
// shard (`dropout_sharded`) `gmap` maps the flat output index to it: dims the local dims,
// strides the global tensor's, offset the shard's first element (`ShardOf::index_map`).
template <bool MAPPED>
__device__ __forceinline__ void dropout_body(const void* x, const Layout& lx, int cx, void* y, int cy,
                                             const i64* seed, u64 stream, u64 threshold, float scale,
                                             const Layout& gmap, i64 n) {
    u64 base = (u64)seed[0] * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull;
#define DROP_G(i) (MAPPED ? (u64)at(gmap, i) : (u64)(i))
#define DROP_KEEP(g, keep)                                   \
    {                                                        \
        u64 z = base + (g);                                  \
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;         \
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;         \
        z ^= z >> 31;                                        \
        keep = (z >> 11) >= threshold;                       \
    }
    // Eight elements from a multiple of 8 stay in one innermost run of the map when it is a
    // multiple of 8 long (or the map is one dim): their indices step by its stride.
    const int nd = MAPPED ? gmap.ndim : 1;
    const bool run8 = !MAPPED || nd <= 1 || (gmap.dims[nd - 1] & 7) == 0;
    if (run8 && vec8_ok(x, lx, cx) && out8_ok(y, cy)) {
        const u64 step = !MAPPED ? 1 : (nd == 0 ? 0 : (u64)gmap.strides[nd - 1]);
#define DROP8(i)                                                                             \
        {                                                                                    \
            float v[8];                                                                      \
            ld8(x, cx, at8(lx, i), v);                                                       \
            const u64 g0_ = DROP_G(i);                                                       \
            _Pragma("unroll") for (int e = 0; e < 8; ++e) {                                  \
                bool keep;                                                                   \
                DROP_KEEP(g0_ + (u64)e * step, keep);                                        \
                v[e] = keep ? v[e] * scale : 0.0f;                                           \
            }                                                                                \
            st8(y, cy, i, v);                                                                \
        }
#define DROP1(i) { bool keep; DROP_KEEP(DROP_G(i), keep); stf(y, cy, i, keep ? ldf(x, cx, at8(lx, i)) * scale : 0.0f); }
        DENSE8(n, DROP8, DROP1)
#undef DROP8
#undef DROP1
        return;
    }
    GRID_STRIDE(i, n) {
        bool keep;
        DROP_KEEP(DROP_G(i), keep);
        stf(y, cy, i, keep ? ldf(x, cx, at(lx, i)) * scale : 0.0f);
    }
#undef DROP_KEEP
#undef DROP_G
}

extern "C" __global__ void dropout(const void* x, Layout lx, int cx, void* y, int cy, const i64* seed, u64 stream,
                                   u64 threshold, float scale, i64 n) {
    dropout_body<false>(x, lx, cx, y, cy, seed, stream, threshold, scale, lx, n);
}

extern "C" __global__ void dropout_sharded(const void* x, Layout lx, int cx, void* y, int cy, const i64* seed,
                                           u64 stream, u64 threshold, float scale, Layout gmap, i64 n) {
    dropout_body<true>(x, lx, cx, y, cy, seed, stream, threshold, scale, gmap, n);
}
