// ---- Generation ops (infer.rs): KV-cache write, position selection, quantised matmuls ----
// The index tensors (cache starts, selected positions) are checked on the host before these
// kernels run (the CPU kernel's errors), so every index they read is in range.

// Copies one element of `size` bytes (1, 2, 4 or 8) from element si of src to element di of dst.
__device__ __forceinline__ void kv_copy_elem(const void* src, i64 si, void* dst, i64 di, int size) {
    switch (size) {
        case 8: ((u64*)dst)[di] = ((const u64*)src)[si]; break;
        case 4: ((unsigned int*)dst)[di] = ((const unsigned int*)src)[si]; break;
        case 2: ((unsigned short*)dst)[di] = ((const unsigned short*)src)[si]; break;
        default: ((unsigned char*)dst)[di] = ((const unsigned char*)src)[si];
    }
}

// The KV cache's write, in place: element i of x [B, S, row] (read through lx) goes to
// cache [B, C, row] (written through lc) at row b, position start[b] + i's position.
// n = B·S·row.
extern "C" __global__ void cache_write(const void* x, Layout lx, void* cache, Layout lc, const i64* start,
                                       i64 s, i64 c, i64 row, int size, i64 n) {
    const i64 per = s * row;
    GRID_STRIDE(i, n) {
        i64 b = i / per;
        i64 r = i - b * per;  // position in the step · row + element
        i64 dst = (b * c + start[b]) * row + r;
        kv_copy_elem(x, at(lx, i), cache, at(lc, dst), size);
    }
}

// y [B, 1, inner] = x [B, S, inner] (read through lx) at position index[b] of each row b.
// n = B·inner.
extern "C" __global__ void select_positions(const void* x, Layout lx, const i64* index, void* y, i64 s,
                                            i64 inner, int size, i64 n) {
    GRID_STRIDE(i, n) {
        i64 b = i / inner;
        i64 r = i - b * inner;
        kv_copy_elem(x, at(lx, (b * s + index[b]) * inner + r), y, i, size);
    }
}

// ---- weight-only quantised matmul: y [M, N] = x [M, K] · dequant(w [N, rb] u8, scales [N, groups])ᵀ ----
// int8: byte f of a row is feature f, q + 128; int4: byte t holds feature 2t in its low nibble
// and 2t + 1 in its high one, each q + 8. Feature f's scale is scales[row, f / g]. x (f32, bf16
// or f16, dense rows of K) is read as f32; the sums are f32 and y is rounded once to its dtype.

// Feature f of a weight row, minus the offset.
__device__ __forceinline__ float qcode(const unsigned char* row, i64 f, int bits) {
    if (bits == 8) return (float)((int)row[f] - 128);
    unsigned int b = row[f >> 1];
    return (float)((int)((f & 1) ? (b >> 4) : (b & 15u)) - 8);
}

// Eight consecutive x values from element `off` (16-byte aligned for half types, and for f32
// at a multiple of 4 elements) as f32.
__device__ __forceinline__ void qm_load8(const void* x, int code, i64 off, float v[8]) {
    if (code == 0) {
        const float4* p = (const float4*)((const float*)x + off);
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 a = *(const uint4*)((const unsigned short*)x + off);
        unsigned int u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            v[2 * q] = half_to_f32((unsigned short)(u[q] & 0xffffu), code);
            v[2 * q + 1] = half_to_f32((unsigned short)(u[q] >> 16), code);
        }
    }
}

// The few-rows (decode) path: a warp per output feature, which reads its weight row once for
// the R rows of x, 16 bytes per lane per step (16 int8 or 32 int4 features). `vec` (rows of a
// multiple of 16 bytes, 16-byte aligned weight and x): those vector loads; otherwise feature by
// feature. A chunk inside one group is scaled once, one that crosses groups feature by feature.
template <int R, int BITS>
__device__ __forceinline__ void qmm_skinny_body(const void* x, int cx, const unsigned char* w, const float* sc,
                                                void* y, int cy, i64 n, i64 k, i64 rb, i64 groups, i64 g,
                                                int vec) {
    const int FPC = BITS == 8 ? 16 : 32;  // features per 16-byte chunk
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < n; j += warps) {
        const unsigned char* wr = w + j * rb;
        const float* sr = sc + j * groups;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        if (vec) {
            for (i64 o = (i64)lane * 16; o < rb; o += 512) {
                uint4 c = *(const uint4*)(wr + o);
                unsigned int u[4] = {c.x, c.y, c.z, c.w};
                float wv[FPC];
#pragma unroll
                for (int q = 0; q < 16; ++q) {
                    unsigned int byte = (u[q >> 2] >> (8 * (q & 3))) & 0xffu;
                    if constexpr (BITS == 8) {
                        wv[q] = (float)((int)byte - 128);
                    } else {
                        wv[2 * q] = (float)((int)(byte & 15u) - 8);
                        wv[2 * q + 1] = (float)((int)(byte >> 4) - 8);
                    }
                }
                const i64 f0 = BITS == 8 ? o : 2 * o;
                const unsigned int gu = (unsigned int)g;
                float s = sr[(unsigned int)f0 / gu];
                if ((unsigned int)f0 / gu != (unsigned int)(f0 + FPC - 1) / gu) {
#pragma unroll
                    for (int q = 0; q < FPC; ++q) wv[q] *= sr[(unsigned int)(f0 + q) / gu];
                    s = 1.f;
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float part = 0.f;
#pragma unroll
                    for (int q = 0; q < FPC; q += 8) {
                        float xv[8];
                        qm_load8(x, cx, r * k + f0 + q, xv);
#pragma unroll
                        for (int e = 0; e < 8; ++e) part = fmaf(xv[e], wv[q + e], part);
                    }
                    acc[r] = fmaf(s, part, acc[r]);
                }
            }
        } else {
            for (i64 f = lane; f < k; f += 32) {
                float wv = qcode(wr, f, BITS) * sr[(unsigned int)f / (unsigned int)g];
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = fmaf(ldf(x, cx, r * k + f), wv, acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) stf(y, cy, r * n + j, v);
        }
    }
}

// R (1, 2, 4 or 8) rows of x; the host splits more rows into such blocks.
extern "C" __global__ void qmatmul_skinny(const void* x, int cx, const unsigned char* w, const float* sc, void* y,
                                          int cy, int rows, int bits, i64 n, i64 k, i64 rb, i64 groups, i64 g,
                                          int vec) {
#define QMM_CASE(R)                                                                        \
    case R:                                                                                \
        if (bits == 8) qmm_skinny_body<R, 8>(x, cx, w, sc, y, cy, n, k, rb, groups, g, vec); \
        else qmm_skinny_body<R, 4>(x, cx, w, sc, y, cy, n, k, rb, groups, g, vec);           \
        break;
    switch (rows) {
        QMM_CASE(1)
        QMM_CASE(2)
        QMM_CASE(4)
        QMM_CASE(8)
        default: break;
    }
#undef QMM_CASE
}

// The many-rows (prefill) path: 64×64 output tiles, 256 threads of 4×4 outputs each; per step
// of 32 features the x tile and the dequantised weight tile (scale·(q − offset) in f32, as the
// CPU's tiles) are staged in shared memory. Each weight is read once per 64 rows of x.
#define QT_M 64
#define QT_N 64
#define QT_K 32
extern "C" __global__ void qmatmul_tiled(const void* x, int cx, const unsigned char* w, const float* sc, void* y,
                                         int cy, i64 m, i64 n, i64 k, i64 rb, i64 groups, i64 g, int bits) {
    __shared__ float xs[QT_K][QT_M + 1];  // +1: the staging stores hit distinct banks
    __shared__ float ws[QT_K][QT_N + 1];
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const i64 m0 = (i64)blockIdx.y * QT_M, n0 = (i64)blockIdx.x * QT_N;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) acc[i][jj] = 0.f;
    for (i64 k0 = 0; k0 < k; k0 += QT_K) {
        // 64 rows × 32 features of each: consecutive threads read consecutive features.
        for (int e = tid; e < QT_M * QT_K; e += 256) {
            const int r = e / QT_K, kk = e % QT_K;
            const i64 f = k0 + kk;
            const i64 xm = m0 + r, wn = n0 + r;
            xs[kk][r] = (xm < m && f < k) ? ldf(x, cx, xm * k + f) : 0.f;
            ws[kk][r] = (wn < n && f < k) ? sc[wn * groups + (unsigned int)f / (unsigned int)g] * qcode(w + wn * rb, f, bits) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < QT_K; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) b[jj] = ws[kk][tx + 16 * jj];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) acc[i][jj] = fmaf(a[i], b[jj], acc[i][jj]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const i64 row = m0 + ty + 16 * i;
        if (row >= m) continue;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const i64 col = n0 + tx + 16 * jj;
            if (col < n) stf(y, cy, row * n + col, acc[i][jj]);
        }
    }
}

// The input gradient of the quantised matmul: dx [M, K] = dy [M, N] · dequant(w [N, rb], scales)
// (tessera-runtime's `qmatmul_backward`). 64×64 tiles of dx, 256 threads of 4×4 outputs each;
// per step of 32 weight rows the dy tile and the dequantised weight tile (scale·(q − offset) in
// f32, as the CPU's tiles) are staged in shared memory, so no workspace is needed. dy (f32,
// bf16 or f16, dense rows of N) is read as f32; the sums are f32 and dx is rounded once.
extern "C" __global__ void qmatmul_backward_tiled(const void* dy, int cdy, const unsigned char* w, const float* sc,
                                                  void* dx, int cdx, i64 m, i64 n, i64 k, i64 rb, i64 groups,
                                                  i64 g, int bits) {
    __shared__ float ys[QT_K][QT_M + 1];  // [weight row][row of dy]
    __shared__ float ws[QT_K][QT_N + 1];  // [weight row][feature]
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const i64 m0 = (i64)blockIdx.y * QT_M, f0 = (i64)blockIdx.x * QT_N;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) acc[i][jj] = 0.f;
    for (i64 j0 = 0; j0 < n; j0 += QT_K) {
        for (int e = tid; e < QT_M * QT_K; e += 256) {
            // 64 rows of dy × 32 of its columns: consecutive threads read consecutive columns.
            const int r = e / QT_K, jj = e % QT_K;
            const i64 ym = m0 + r, yj = j0 + jj;
            ys[jj][r] = (ym < m && yj < n) ? ldf(dy, cdy, ym * n + yj) : 0.f;
            // 32 weight rows × 64 features: consecutive threads read consecutive features.
            const int wr = e / QT_N, kk = e % QT_N;
            const i64 wn = j0 + wr, f = f0 + kk;
            ws[wr][kk] = (wn < n && f < k) ? sc[wn * groups + (unsigned int)f / (unsigned int)g] * qcode(w + wn * rb, f, bits) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int jj = 0; jj < QT_K; ++jj) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = ys[jj][ty + 16 * i];
#pragma unroll
            for (int c = 0; c < 4; ++c) b[c] = ws[jj][tx + 16 * c];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(a[i], b[c], acc[i][c]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const i64 row = m0 + ty + 16 * i;
        if (row >= m) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const i64 col = f0 + tx + 16 * c;
            if (col < k) stf(dx, cdx, row * k + col, acc[i][c]);
        }
    }
}
#undef QT_M
#undef QT_N
#undef QT_K
