// Flash attention (FlashAttention-2's scheme) on tensor cores: bf16 q, k, v and dO, f32
// accumulation, `mma.sync.m16n8k16` (sm_80 and later; the backend uses these kernels only
// there). Appended to the other kernels by the crate (module `source`): it uses `Attn`,
// `attn_pos`, `attn_visible` and the bf16 conversions from there.
//
// Layouts: q, out, dO [B,S,H,D]; k, v [B,T,Hkv,D] (GQA: query head h reads kv head
// h / (H/Hkv)); lse and delta [B,H,S] f32. The forward saves what the CPU kernel saves (the
// output and the log-sum-exp of the scaled, biased scores); the backward recomputes the
// probabilities tile by tile. Neither materialises an S×T matrix. Tiles reach shared memory
// by `cp.async` into two stages, the next tile landing while the current one is computed on.
//
// Fragment layouts of m16n8k16 (lane = 4·g + t): A (16×16, row-major) registers hold
// (row g, k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); B (16×8)
// holds (k 2t..2t+1, n g), (k 2t+8.., n g); C (16×8 f32) holds (row g, n 2t, 2t+1) and
// (row g+8, n 2t, 2t+1). A C tile of scores is therefore, two n-tiles at a time, the A
// operand of the next product with no shuffle (FlashAttention-2's register reuse).

typedef unsigned short bf16_t;

#define FA_BC 64      // keys per forward tile
#define FA_BR 128     // query rows per forward block (16 per warp)
#define FA_BCB 128    // keys per backward block (16 per warp)
#define FA_BRB 32     // query rows per backward tile
#define FA_THREADS 256     // backward block (8 warps)
#define FA_THREADS_FWD 256 // forward block (8 warps)
#define FA_LOG2E 1.4426950408889634f

__device__ __forceinline__ unsigned fa_ld32(const bf16_t* p) { return *(const unsigned*)p; }
__device__ __forceinline__ unsigned fa_pack(bf16_t lo, bf16_t hi) { return (unsigned)lo | ((unsigned)hi << 16); }
// Two floats rounded to nearest-even bf16 in one instruction (`cvt.rn.bf16x2.f32`, sm_80): the
// integer rounding's bits for every non-NaN value, at a fraction of its integer work.
__device__ __forceinline__ unsigned fa_pack_f(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return fa_pack(f32_to_bf16(lo), f32_to_bf16(hi));
#endif
}

// 2^x in one SFU instruction (FlashAttention's exp2 with log2(e) folded into the scale); 0 at −∞.
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// p[0] += x, p[1] += y in global memory: one vector reduction on sm_90, else two.
__device__ __forceinline__ void fa_red2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// c += a·b on tensor cores.
__device__ __forceinline__ void fa_mma(float* c, const unsigned* a, const unsigned* b) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

// B fragments of two adjacent n-tiles from a row-major [k][n] tile in shared memory (rows
// `ld` elements apart): `ldmatrix.x4.trans` of the four 8×8 blocks (k 0-7 | 8-15) × (n 0-7 |
// 8-15) at `tile` (k0, n0). b[0..2] is n-tile n0's (k 0-7, k 8-15), b[2..4] n-tile n0+8's.
// Lane l addresses row l%8 of block l/8 (k offset 8·(l/8 & 1), n offset 8·(l/16)).
__device__ __forceinline__ unsigned fa_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void fa_ldsm_t(const bf16_t* tile, int ld, unsigned* b) {
    const int lane = threadIdx.x & 31, blk = lane >> 3;
    const bf16_t* p = tile + ((blk & 1) * 8 + (lane & 7)) * ld + (blk >> 1) * 8;
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(fa_smem_addr(p)));
#else
    b[0] = b[1] = b[2] = b[3] = 0u;
    __trap();
#endif
}

// Fragments from a row-major tile in shared memory by `ldmatrix.x4` (no transpose): one
// instruction for what four or eight 32-bit shared loads fetched.
// fa_ldsm_b: B fragments of two adjacent n-tiles from an [n][k] tile (K rows for Q·Kᵀ): at
// `tile` (n0, k0), b[0..2] is n-tile n0's (k 0-7, k 8-15), b[2..4] n-tile n0+8's. Matrix i
// covers rows n0 + 8·(i >> 1), columns k0 + 8·(i & 1).
__device__ __forceinline__ void fa_ldsm_x4(const bf16_t* p, unsigned* r) {
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem_addr(p)));
#else
    r[0] = r[1] = r[2] = r[3] = 0u;
    __trap();
#endif
}
__device__ __forceinline__ void fa_ldsm_b(const bf16_t* tile, int ld, unsigned* b) {
    const int lane = threadIdx.x & 31, blk = lane >> 3;
    fa_ldsm_x4(tile + ((blk >> 1) * 8 + (lane & 7)) * ld + (blk & 1) * 8, b);
}
// fa_ldsm_a: the A fragment (16×16) at `tile` (m0, k0) of an [m][k] tile: (row g, k 2t..),
// (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..). Matrix i covers rows
// m0 + 8·(i & 1), columns k0 + 8·(i >> 1).
__device__ __forceinline__ void fa_ldsm_a(const bf16_t* tile, int ld, unsigned* a) {
    const int lane = threadIdx.x & 31, blk = lane >> 3;
    fa_ldsm_x4(tile + ((blk & 1) * 8 + (lane & 7)) * ld + (blk >> 1) * 8, a);
}

// Asynchronous global → shared copies (`cp.async`, sm_80): the loads of the next tile are in
// flight while the current one is computed on, and no register round trip serialises them.
// 16 bytes (`cg`, through L2) or 4; `pred` false fills the destination with zeros.
__device__ __forceinline__ void fa_cp16(void* dst, const void* src, bool pred) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_addr(dst)), "l"(src),
                 "r"(pred ? 16 : 0));
#else
    __trap();
#endif
}
__device__ __forceinline__ void fa_cp4(void* dst, const void* src, bool pred) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(fa_smem_addr(dst)), "l"(src),
                 "r"(pred ? 4 : 0));
#else
    __trap();
#endif
}
// Closes the group of copies issued so far / waits until every group has landed (this
// thread's; a barrier then makes them everyone's).
__device__ __forceinline__ void fa_cp_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
__device__ __forceinline__ void fa_cp_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Issues the copies of rows [0, ROWS) of a [ROWS][D+8] shared tile from global rows
// `row_stride` elements apart; rows from `valid` on are zero. A block of THREADS threads, the
// loop unrolled so that every copy is in flight at once (D is a multiple of 8).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void fa_tile_async(bf16_t* dst, const bf16_t* src, i64 valid, i64 row_stride) {
    constexpr int chunks = D / 8, total = ROWS * chunks;
#pragma unroll
    for (int i = 0; i < (total + THREADS - 1) / THREADS; ++i) {
        const int c = (int)threadIdx.x + i * THREADS;
        if (total % THREADS == 0 || c < total) {
            const int r = c / chunks, k = c % chunks;
            const bool in = r < valid;
            fa_cp16(dst + r * (D + 8) + k * 8, in ? src + (i64)r * row_stride + k * 8 : src, in);
        }
    }
}

// Issues the copies of the key tile at j0 (K then V rows [j0, j0 + ROWS) of kv row stride
// `kvs`) into a stage of two [ROWS][D+8] tiles.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void fa_kv_async(bf16_t* stage, const bf16_t* kb, const bf16_t* vb, i64 j0, i64 t, i64 kvs) {
    const i64 valid = t - j0 < ROWS ? t - j0 : ROWS;
    fa_tile_async<D, ROWS, THREADS>(stage, kb + j0 * kvs, valid, kvs);
    fa_tile_async<D, ROWS, THREADS>(stage + ROWS * (D + 8), vb + j0 * kvs, valid, kvs);
}

// The visible keys [lo, hi) of query row i (none for a row past the end).
__device__ __forceinline__ void fa_range(const Attn& a, const i64* start, i64 b, i64 i, i64* p, i64* lo, i64* hi) {
    if (i >= a.s) {
        *p = 0; *lo = 0; *hi = 0;
        return;
    }
    *p = attn_pos(a, start, b, i);
    attn_visible(a, *p, lo, hi);
}

// Forward: block (query tile of 128, head, batch); warp w owns rows 16w..16w+15 of the tile.
template <int D>
__device__ __forceinline__ void fa_forward(const bf16_t* q, const bf16_t* k, const bf16_t* v, const i64* start,
                                           const float* slopes, Attn a, bf16_t* out, float* lse) {
    extern __shared__ uint4 fa_smem[];
    const int LD = D + 8, STAGE = 2 * FA_BC * LD;  // a stage: the K tile, then the V tile
    bf16_t* const stages = (bf16_t*)fa_smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 b = blockIdx.z, hh = blockIdx.y, tile0 = (i64)blockIdx.x * FA_BR;
    const i64 kvh = hh / (a.h / a.hkv);
    const i64 qs = a.h * D, kvs = a.hkv * D;
    i64 row[2] = {tile0 + warp * 16 + g, tile0 + warp * 16 + g + 8};
    i64 pos[2], lo[2], hi[2];
    for (int r = 0; r < 2; ++r) fa_range(a, start, b, row[r], &pos[r], &lo[r], &hi[r]);
    // Positions grow with the row: the block's keys run from its first row's lo to its last's hi.
    i64 last = tile0 + FA_BR - 1 < a.s ? tile0 + FA_BR - 1 : a.s - 1, p_, blo, bhi, x_;
    fa_range(a, start, b, tile0, &p_, &blo, &x_);
    fa_range(a, start, b, last, &p_, &x_, &bhi);

    const bf16_t* qb = q + b * a.s * qs + hh * D;
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        int c = kk * 16 + 2 * t;
        qf[kk][0] = row[0] < a.s ? fa_ld32(qb + row[0] * qs + c) : 0u;
        qf[kk][1] = row[1] < a.s ? fa_ld32(qb + row[1] * qs + c) : 0u;
        qf[kk][2] = row[0] < a.s ? fa_ld32(qb + row[0] * qs + c + 8) : 0u;
        qf[kk][3] = row[1] < a.s ? fa_ld32(qb + row[1] * qs + c + 8) : 0u;
    }
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float slope2 = slopes ? slopes[hh] * FA_LOG2E : 0.0f, sl2 = a.scale * FA_LOG2E;
    const bf16_t* kb = k + b * a.t * kvs + kvh * D;
    const bf16_t* vb = v + b * a.t * kvs + kvh * D;

    // Two stages: tile j0 + 64 is copied in while tile j0 is computed on. The one barrier per
    // tile both publishes the landed tile and retires the stage the next copy overwrites.
    i64 j0 = (blo / FA_BC) * FA_BC;
    if (j0 < bhi) fa_kv_async<D, FA_BC, FA_THREADS_FWD>(stages, kb, vb, j0, a.t, kvs);
    fa_cp_commit();
    for (int it = 0; j0 < bhi; j0 += FA_BC, ++it) {
        fa_cp_wait_all();
        __syncthreads();
        const bf16_t* ks = stages + (it & 1) * STAGE;
        const bf16_t* vs = ks + FA_BC * LD;
        if (j0 + FA_BC < bhi) fa_kv_async<D, FA_BC, FA_THREADS_FWD>(stages + ((it + 1) & 1) * STAGE, kb, vb, j0 + FA_BC, a.t, kvs);
        fa_cp_commit();
        // S = Q·Kᵀ (16 rows × 64 keys per warp).
        float s[FA_BC / 8][4];
#pragma unroll
        for (int n = 0; n < FA_BC / 8; n += 2) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            s[n + 1][0] = s[n + 1][1] = s[n + 1][2] = s[n + 1][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned bb[4];
                fa_ldsm_b(ks + n * 8 * LD + kk * 16, LD, bb);
                fa_mma(s[n], qf[kk], bb);
                fa_mma(s[n + 1], qf[kk], bb + 2);
            }
        }
        // Scores in base 2 (scale·log2 e folded in, as FlashAttention does), the ALiBi bias, the
        // mask (in 32 bits, relative to the tile) only where a row misses keys of the tile; the
        // running max.
        int rlo[2], rhi[2];
        float rb[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rlo[r] = (int)fmax(fmin((double)(lo[r] - j0), (double)FA_BC), 0.0);
            rhi[r] = (int)fmax(fmin((double)(hi[r] - j0), (double)FA_BC), 0.0);
            rb[r] = (float)(j0 - pos[r]);
        }
        float mx[2] = {m[0], m[1]};
        if (!slopes && rlo[0] == 0 && rhi[0] == FA_BC && rlo[1] == 0 && rhi[1] == FA_BC) {
#pragma unroll
            for (int n = 0; n < FA_BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[n][e] *= sl2;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
                }
        } else {
#pragma unroll
            for (int n = 0; n < FA_BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int r = e >> 1;
                    int j = n * 8 + 2 * t + (e & 1);
                    float val = (j >= rlo[r] && j < rhi[r]) ? s[n][e] * sl2 + slope2 * ((float)j + rb[r]) : -INFINITY;
                    s[n][e] = val;
                    mx[r] = fmaxf(mx[r], val);
                }
        }
        float alpha[2], ms[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            alpha[r] = mx[r] == -INFINITY ? 1.0f : fa_exp2(m[r] - mx[r]);
            m[r] = mx[r];
            ms[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row that sees nothing yet: 2^−∞ = 0
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < FA_BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = fa_exp2(s[n][e] - ms[e >> 1]);
                s[n][e] = p;
                l[e >> 1] += p;
            }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        // O += P·V, P rounded to bf16 (as FlashAttention does).
#pragma unroll
        for (int kk = 0; kk < FA_BC / 16; ++kk) {
            unsigned pa[4] = {fa_pack_f(s[2 * kk][0], s[2 * kk][1]), fa_pack_f(s[2 * kk][2], s[2 * kk][3]),
                              fa_pack_f(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              fa_pack_f(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bb[4];
                fa_ldsm_t(vs + kk * 16 * LD + n * 8, LD, bb);
                fa_mma(o[n], pa, bb);
                fa_mma(o[n + 1], pa, bb + 2);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    bf16_t* ob = out + b * a.s * qs + hh * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (row[r] >= a.s) continue;
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *(unsigned*)(ob + row[r] * qs + n * 8 + 2 * t) = fa_pack_f(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        // The natural-log lse the CPU kernel saves: m is in base 2.
        if (t == 0) lse[(b * a.h + hh) * a.s + row[r]] = l[r] > 0.0f ? m[r] * 0.6931471805599453f + logf(l[r]) : -INFINITY;
    }
}

// A backward stage: the Q and dO tiles of a query tile ([32][D+8] each), and per query row
// FA_META floats: its lse, its D, j0 − its position (ALiBi's distance) and, as ints, its
// visible keys [lo, hi) within the key tile.
#define FA_QSTAGE(D) (2 * FA_BRB * ((D) + 8))
#define FA_META (5 * FA_BRB)

// Issues the copies of query tile i0 of head hh into a stage and writes its row data.
template <int D>
__device__ __forceinline__ void fa_q_async(bf16_t* qstage, float* meta, const bf16_t* q, const bf16_t* dout,
                                           const float* lse, const float* delta, const Attn& a, i64 b, i64 hh,
                                           i64 i0, i64 j0) {
    const i64 qs = a.h * D, qvalid = a.s - i0 < FA_BRB ? a.s - i0 : FA_BRB;
    fa_tile_async<D, FA_BRB, FA_THREADS>(qstage, q + (b * a.s + i0) * qs + hh * D, qvalid, qs);
    fa_tile_async<D, FA_BRB, FA_THREADS>(qstage + FA_BRB * (D + 8), dout + (b * a.s + i0) * qs + hh * D, qvalid, qs);
    const int c = threadIdx.x;
    if (c < FA_BRB) {
        // Rows past the end read zeros; their key range is empty, so nothing uses them.
        const bool in = c < qvalid;
        const i64 row = (b * a.h + hh) * a.s + i0 + (in ? c : 0);
        fa_cp4(meta + c, lse + row, in);
        fa_cp4(meta + FA_BRB + c, delta + row, in);
        i64 p, lo, hi;
        fa_range(a, 0, b, i0 + c, &p, &lo, &hi);
        meta[2 * FA_BRB + c] = (float)(j0 - p);
        ((int*)meta)[3 * FA_BRB + c] = (int)fmax(fmin((double)(lo - j0), (double)FA_BCB), 0.0);
        ((int*)meta)[4 * FA_BRB + c] = (int)fmax(fmin((double)(hi - j0), (double)FA_BCB), 0.0);
    }
}

// Whether every row of query tile i0 sees every key of the tile at j0 (no mask to apply).
__device__ __forceinline__ bool fa_bwd_full(const Attn& a, i64 b, i64 i0, i64 j0) {
    if (i0 + FA_BRB > a.s || j0 + FA_BCB > a.t) return false;
    i64 p, lo_last, hi_first, x;
    fa_range(a, 0, b, i0, &p, &x, &hi_first);
    fa_range(a, 0, b, i0 + FA_BRB - 1, &p, &lo_last, &x);
    // Positions grow with the row, and with them both ends of the visible range.
    return lo_last <= j0 && hi_first >= j0 + FA_BCB;
}

// Backward: block (key tile of 128, kv head, batch); warp w owns keys 16w..16w+15 of the tile
// and accumulates their dK and dV over every query head of the group and every query tile
// that sees them; dQ goes to an f32 accumulator by atomic adds (dq_acc, zeroed, [B,S,H,D]).
template <int D>
__device__ __forceinline__ void fa_backward(const bf16_t* q, const bf16_t* k, const bf16_t* v, const bf16_t* dout,
                                            const float* lse, const float* delta, const float* slopes, Attn a,
                                            float* dq_acc, bf16_t* dk, bf16_t* dv) {
    extern __shared__ uint4 fa_smem[];
    const int LD = D + 8, LDS = FA_BCB + 8;
    bf16_t* ks = (bf16_t*)fa_smem;
    bf16_t* vs = ks + FA_BCB * LD;
    bf16_t* const qstages = vs + FA_BCB * LD;                // two stages of [Q tile, dO tile]
    bf16_t* dss = qstages + 2 * FA_QSTAGE(D);                // dS of the tile, [query][key]
    float* const mstages = (float*)(dss + FA_BRB * LDS);     // two stages of FA_META floats
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 b = blockIdx.z, kvh = blockIdx.y, j0 = (i64)blockIdx.x * FA_BCB;
    const i64 group = a.h / a.hkv, qs = a.h * D, kvs = a.hkv * D;
    const float sl2 = a.scale * FA_LOG2E;  // scores in base 2
    fa_kv_async<D, FA_BCB, FA_THREADS>(ks, k + b * a.t * kvs + kvh * D, v + b * a.t * kvs + kvh * D, j0, a.t, kvs);
    // The query tiles that see these keys: an interval, as positions grow with the row.
    i64 ifirst = 0, iend = 0;
    for (i64 i0 = 0; i0 < a.s; i0 += FA_BRB) {
        i64 last = i0 + FA_BRB - 1 < a.s ? i0 + FA_BRB - 1 : a.s - 1, p_, lo_f, hi_l, x_;
        fa_range(a, 0, b, i0, &p_, &lo_f, &x_);
        fa_range(a, 0, b, last, &p_, &x_, &hi_l);
        if (hi_l <= j0 || lo_f >= j0 + FA_BCB) continue;  // no row of this tile sees these keys
        if (iend == 0) ifirst = i0;
        iend = i0 + FA_BRB;
    }
    const int ntiles = (int)((iend - ifirst) / FA_BRB), steps = (int)group * ntiles;
    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
    const bf16_t* kw = ks + warp * 16 * LD;  // this warp's 16 keys (A fragments by ldmatrix)
    const bf16_t* vw = vs + warp * 16 * LD;

    // Step `it` is query head kvh·group + it / ntiles, query tile ifirst + 32·(it % ntiles).
    // Two stages: step it + 1's tiles are copied in while step it is computed on; the barrier
    // at the top of a step publishes its tiles and retires the stage the next copy overwrites.
    if (steps > 0) fa_q_async<D>(qstages, mstages, q, dout, lse, delta, a, b, kvh * group, ifirst, j0);
    fa_cp_commit();
    for (int it = 0; it < steps; ++it) {
        const i64 hh = kvh * group + it / ntiles, i0 = ifirst + (i64)(it % ntiles) * FA_BRB;
        const float slope2 = slopes ? slopes[hh] * FA_LOG2E : 0.0f;
        const bool full = !slopes && fa_bwd_full(a, b, i0, j0);
        fa_cp_wait_all();
        __syncthreads();
        const bf16_t* qt = qstages + (it & 1) * FA_QSTAGE(D);
        const bf16_t* dot = qt + FA_BRB * LD;
        const float* ls = mstages + (it & 1) * FA_META;
        const float* dls = ls + FA_BRB;
        const float* qoff = dls + FA_BRB;
        const int* qlo = (const int*)(qoff + FA_BRB);
        const int* qhi = qlo + FA_BRB;
        if (it + 1 < steps) {
            const int nx = it + 1;
            fa_q_async<D>(qstages + (nx & 1) * FA_QSTAGE(D), mstages + (nx & 1) * FA_META, q, dout, lse, delta, a, b,
                          kvh * group + nx / ntiles, ifirst + (i64)(nx % ntiles) * FA_BRB, j0);
        }
        fa_cp_commit();
        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (16 keys × 32 queries per warp).
        float st[FA_BRB / 8][4], dpt[FA_BRB / 8][4];
#pragma unroll
        for (int n = 0; n < FA_BRB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int c = kk * 16;
            unsigned ka[4], va[4];
            fa_ldsm_a(kw + c, LD, ka);
            fa_ldsm_a(vw + c, LD, va);
#pragma unroll
            for (int n = 0; n < FA_BRB / 8; n += 2) {
                unsigned qb[4], db[4];
                fa_ldsm_b(qt + n * 8 * LD + c, LD, qb);
                fa_ldsm_b(dot + n * 8 * LD + c, LD, db);
                fa_mma(st[n], ka, qb);
                fa_mma(st[n + 1], ka, qb + 2);
                fa_mma(dpt[n], va, db);
                fa_mma(dpt[n + 1], va, db + 2);
            }
        }
        // Pᵀ (base 2: lse·log2 e subtracted) and dSᵀ = Pᵀ ⊙ (dPᵀ − D); the mask only where a
        // row of the tile misses a key of it.
#pragma unroll
        for (int n = 0; n < FA_BRB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = n * 8 + 2 * t + (e & 1);
                const int j = warp * 16 + g + 8 * (e >> 1);  // the key, within the tile
                float pv;
                if (full) {
                    pv = fa_exp2(st[n][e] * sl2 - ls[c] * FA_LOG2E);
                } else {
                    pv = (j >= qlo[c] && j < qhi[c])
                             ? fa_exp2(st[n][e] * sl2 + slope2 * ((float)j + qoff[c]) - ls[c] * FA_LOG2E)
                             : 0.0f;
                }
                st[n][e] = pv;
                dpt[n][e] = pv * (dpt[n][e] - dls[c]);
                dss[c * LDS + j] = f32_to_bf16(dpt[n][e]);
            }
        // dV += Pᵀ·dO and dK += dSᵀ·Q (scaled at the end).
#pragma unroll
        for (int kk = 0; kk < FA_BRB / 16; ++kk) {
            unsigned pa[4] = {fa_pack_f(st[2 * kk][0], st[2 * kk][1]), fa_pack_f(st[2 * kk][2], st[2 * kk][3]),
                              fa_pack_f(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              fa_pack_f(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            unsigned sa[4] = {fa_pack_f(dpt[2 * kk][0], dpt[2 * kk][1]), fa_pack_f(dpt[2 * kk][2], dpt[2 * kk][3]),
                              fa_pack_f(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              fa_pack_f(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bd[4], bq[4];
                fa_ldsm_t(dot + kk * 16 * LD + n * 8, LD, bd);
                fa_ldsm_t(qt + kk * 16 * LD + n * 8, LD, bq);
                fa_mma(dva[n], pa, bd);
                fa_mma(dva[n + 1], pa, bd + 2);
                fa_mma(dka[n], sa, bq);
                fa_mma(dka[n + 1], sa, bq + 2);
            }
        }
        __syncthreads();  // dS of every warp is in shared memory
        // dQ (32 queries × D) += dS·K over the 128 keys, in units of 16 queries × 16 columns:
        // unit u is query half u & 1, columns 16·(u >> 1).., spread over the warps.
#pragma unroll
        for (int u = warp; u < D / 8; u += FA_THREADS / 32) {
            const int mt = u & 1, n = (u >> 1) * 2;
            float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
            for (int kk = 0; kk < FA_BCB / 16; ++kk) {
                unsigned sa2[4], bk[4];
                fa_ldsm_a(dss + mt * 16 * LDS + kk * 16, LDS, sa2);
                fa_ldsm_t(ks + kk * 16 * LD + n * 8, LD, bk);
                fa_mma(c[0], sa2, bk);
                fa_mma(c[1], sa2, bk + 2);
            }
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const i64 qa = i0 + mt * 16 + g, col = (n + h2) * 8 + 2 * t;
                if (qa < a.s) fa_red2(dq_acc + (b * a.s + qa) * qs + hh * D + col, c[h2][0], c[h2][1]);
                if (qa + 8 < a.s) fa_red2(dq_acc + (b * a.s + qa + 8) * qs + hh * D + col, c[h2][2], c[h2][3]);
            }
        }
    }
    fa_cp_wait_all();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const i64 j = j0 + warp * 16 + g + 8 * r;
        if (j >= a.t) continue;
        bf16_t* dkr = dk + (b * a.t + j) * kvs + kvh * D + 2 * t;
        bf16_t* dvr = dv + (b * a.t + j) * kvs + kvh * D + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *(unsigned*)(dkr + n * 8) = fa_pack_f(dka[n][2 * r] * a.scale, dka[n][2 * r + 1] * a.scale);
            *(unsigned*)(dvr + n * 8) = fa_pack_f(dva[n][2 * r], dva[n][2 * r + 1]);
        }
    }
}

// One instantiation per supported head dim (the backend's `flash::HEAD_DIMS`).
#define FA_KERNELS(D)                                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS_FWD, (D) <= 64 ? 2 : 1) flash_fwd_##D(                               \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, const i64* start, const float* slopes, Attn a, \
        bf16_t* out, float* lse) {                                                                         \
        fa_forward<D>(q, k, v, start, slopes, a, out, lse);                                               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, (D) <= 64 ? 2 : 1) flash_bwd_##D(                               \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, const bf16_t* dout, const float* lse,          \
        const float* delta, const float* slopes, Attn a, float* dq_acc, bf16_t* dk, bf16_t* dv) {         \
        fa_backward<D>(q, k, v, dout, lse, delta, slopes, a, dq_acc, dk, dv);                             \
    }
FA_KERNELS(32)
FA_KERNELS(64)
FA_KERNELS(128)

// ---- The second backward (`flash_bwd2_*`, chosen at run time by TESSERA_FLASH_BWD=2): the
// FlashAttention-2 scheme (Dao 2023, algorithm 2) with a 2-D warp tiling of every product.
// Block (key tile of FA2_BC = 128, kv head, batch), K and V resident in shared memory; it walks
// the query tiles of FA2_BR = 64 rows that see its keys (every query head of the group), Q and
// dO in two stages by `cp.async`. Warp w = 4·wq + wk (wq 0..1, wk 0..3) computes
//   S = Q·Kᵀ and dP = dO·Vᵀ: queries 32·wq.., keys 32·wk.. (32 × 32, k = D);
//   P and dS = P ⊙ (dP − D) go to shared memory as bf16 ([query][key]);
//   dV += Pᵀ·dO and dK += dSᵀ·Q: keys 32·wk.., dims wq·D/2.. (32 × D/2, k = 64 queries), the
//   accumulators in registers for the whole block;
//   dQ += dS·K: queries 32·wq.., dims wk·D/4.. (32 × D/4, k = 128 keys), added to the f32
//   accumulator in global memory (one thread per element per step: with one key tile, as in
//   the tiny models, the sums are deterministic).
// Every fragment a warp loads serves two or more MMAs (the first kernel's warps each read the
// whole Q and dO tiles for 16 keys). Numerics are the first kernel's: the same base-2
// probabilities from the saved lse, P and dS rounded to bf16 for the products.
#define FA2_BC 128
#define FA2_BR 64
#define FA2_THREADS 256
#define FA2_QSTAGE(D) (2 * FA2_BR * ((D) + 8))
#define FA2_META (5 * FA2_BR)

// The A fragment (16×16, rows m0.., k k0..) of the transpose of a row-major [k][m] tile at
// `tile` (k0, m0): `ldmatrix.x4.trans`, matrix i covering memory rows (k) k0 + 8·(i >> 1),
// columns (m) m0 + 8·(i & 1). Thread (g, t) gets (Tᵀ[g][2t], Tᵀ[g][2t+1]) = (T[2t][g], T[2t+1][g]).
__device__ __forceinline__ void fa_ldsm_at(const bf16_t* tile, int ld, unsigned* a) {
    const int lane = threadIdx.x & 31, blk = lane >> 3;
    const bf16_t* p = tile + ((blk >> 1) * 8 + (lane & 7)) * ld + (blk & 1) * 8;
#if __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(fa_smem_addr(p)));
#else
    a[0] = a[1] = a[2] = a[3] = 0u;
    __trap();
#endif
}

// Issues the copies of query tile i0 of head hh (Q, dO of batch row b at qb, dob; its lse and D
// rows at lseb, deltab) into a stage and writes its rows' data: lse, D, j0 − position (ALiBi's
// distance), visible keys [lo, hi) within the key tile.
template <int D>
__device__ __forceinline__ void fa2_q_async(bf16_t* qstage, float* meta, const bf16_t* qb, const bf16_t* dob,
                                            const float* lseb, const float* deltab, const Attn& a, i64 b, int hh,
                                            int i0, i64 j0) {
    const int qvalid = a.s - i0 < FA2_BR ? (int)(a.s - i0) : FA2_BR;
    const i64 qs = a.h * D, off = (i64)i0 * qs + hh * D;
    fa_tile_async<D, FA2_BR, FA2_THREADS>(qstage, qb + off, qvalid, qs);
    fa_tile_async<D, FA2_BR, FA2_THREADS>(qstage + FA2_BR * (D + 8), dob + off, qvalid, qs);
    const int c = threadIdx.x;
    if (c < FA2_BR) {
        // Rows past the end read zeros; their key range is empty, so nothing uses them.
        const bool in = c < qvalid;
        const i64 row = (i64)hh * a.s + i0 + (in ? c : 0);
        fa_cp4(meta + c, lseb + row, in);
        fa_cp4(meta + FA2_BR + c, deltab + row, in);
        i64 p, lo, hi;
        fa_range(a, 0, b, i0 + c, &p, &lo, &hi);
        meta[2 * FA2_BR + c] = (float)(j0 - p);
        ((int*)meta)[3 * FA2_BR + c] = (int)fmax(fmin((double)(lo - j0), (double)FA2_BC), 0.0);
        ((int*)meta)[4 * FA2_BR + c] = (int)fmax(fmin((double)(hi - j0), (double)FA2_BC), 0.0);
    }
}

// Whether every row of query tile i0 sees every key of the key tile at j0 (no mask to apply).
__device__ __forceinline__ bool fa2_full(const Attn& a, i64 b, i64 i0, i64 j0) {
    if (i0 + FA2_BR > a.s || j0 + FA2_BC > a.t) return false;
    i64 p, lo_last, hi_first, x;
    fa_range(a, 0, b, i0, &p, &x, &hi_first);
    fa_range(a, 0, b, i0 + FA2_BR - 1, &p, &lo_last, &x);
    return lo_last <= j0 && hi_first >= j0 + FA2_BC;
}

template <int D>
__device__ __forceinline__ void fa2_backward(const bf16_t* q, const bf16_t* k, const bf16_t* v, const bf16_t* dout,
                                             const float* lse, const float* delta, const float* slopes, Attn a,
                                             float* dq_acc, bf16_t* dk, bf16_t* dv) {
    extern __shared__ uint4 fa_smem[];
    constexpr int LD = D + 8, LDS = FA2_BC + 8;
    constexpr int DH = D / 2, DQ = D / 4;  // dims per warp: dK and dV, dQ
    bf16_t* ks = (bf16_t*)fa_smem;
    bf16_t* vs = ks + FA2_BC * LD;
    bf16_t* const qstages = vs + FA2_BC * LD;              // two stages of [Q tile, dO tile]
    bf16_t* ps = qstages + 2 * FA2_QSTAGE(D);              // P, [query][key]
    bf16_t* dss = ps + FA2_BR * LDS;                       // dS, [query][key]
    float* const mstages = (float*)(dss + FA2_BR * LDS);   // two stages of FA2_META floats
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wq = warp >> 2, wk = warp & 3;
    const i64 b = blockIdx.z, kvh = blockIdx.y, j0 = (i64)blockIdx.x * FA2_BC;
    const i64 group = a.h / a.hkv, qs = a.h * D, kvs = a.hkv * D;
    const float sl2 = a.scale * FA_LOG2E;  // scores in base 2
    fa_kv_async<D, FA2_BC, FA2_THREADS>(ks, k + b * a.t * kvs + kvh * D, v + b * a.t * kvs + kvh * D, j0, a.t, kvs);
    // The query tiles that see these keys: an interval, as positions grow with the row.
    i64 ifirst = 0, iend = 0;
    for (i64 i0 = 0; i0 < a.s; i0 += FA2_BR) {
        i64 last = i0 + FA2_BR - 1 < a.s ? i0 + FA2_BR - 1 : a.s - 1, p_, lo_f, hi_l, x_;
        fa_range(a, 0, b, i0, &p_, &lo_f, &x_);
        fa_range(a, 0, b, last, &p_, &x_, &hi_l);
        if (hi_l <= j0 || lo_f >= j0 + FA2_BC) continue;  // no row of this tile sees these keys
        if (iend == 0) ifirst = i0;
        iend = i0 + FA2_BR;
    }
    const int ntiles = (int)((iend - ifirst) / FA2_BR), steps = (int)group * ntiles;
    float dka[2][DH / 8][4], dva[2][DH / 8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < DH / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dka[m][n][e] = dva[m][n][e] = 0.0f;

    // Step `it` is query head kvh·group + it / ntiles, query tile ifirst + 64·(it % ntiles).
    // The barrier at the top of a step publishes its tiles (and K, V) and retires the stage the
    // next copy overwrites, and the P and dS tiles the step before read.
    const bf16_t* qb = q + b * a.s * qs;
    const bf16_t* dob = dout + b * a.s * qs;
    const float* lseb = lse + b * a.h * a.s;
    const float* deltab = delta + b * a.h * a.s;
    float* dqb = dq_acc + b * a.s * qs;
    const int h0 = (int)(kvh * group);
    if (steps > 0) fa2_q_async<D>(qstages, mstages, qb, dob, lseb, deltab, a, b, h0, (int)ifirst, j0);
    fa_cp_commit();
    for (int it = 0; it < steps; ++it) {
        const int hh = h0 + it / ntiles, i0 = (int)ifirst + (it % ntiles) * FA2_BR;
        const float slope2 = slopes ? slopes[hh] * FA_LOG2E : 0.0f;
        const bool full = !slopes && fa2_full(a, b, i0, j0);
        fa_cp_wait_all();
        __syncthreads();
        const bf16_t* qt = qstages + (it & 1) * FA2_QSTAGE(D);
        const bf16_t* dot = qt + FA2_BR * LD;
        const float* meta = mstages + (it & 1) * FA2_META;
        if (it + 1 < steps) {
            const int nx = it + 1;
            fa2_q_async<D>(qstages + (nx & 1) * FA2_QSTAGE(D), mstages + (nx & 1) * FA2_META, qb, dob, lseb, deltab,
                           a, b, h0 + nx / ntiles, (int)ifirst + (nx % ntiles) * FA2_BR, j0);
        }
        fa_cp_commit();
        // S = Q·Kᵀ: 32 queries (two m-tiles) × 32 keys (four n-tiles) per warp.
        float sc[2][4][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[m][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned qa[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) fa_ldsm_a(qt + (wq * 32 + m * 16) * LD + kk * 16, LD, qa[m]);
#pragma unroll
            for (int n = 0; n < 4; n += 2) {
                unsigned kb[4];
                fa_ldsm_b(ks + (wk * 32 + n * 8) * LD + kk * 16, LD, kb);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    fa_mma(sc[m][n], qa[m], kb);
                    fa_mma(sc[m][n + 1], qa[m], kb + 2);
                }
            }
        }
        // P (base 2: lse·log2 e subtracted), the mask only where a row of the tile misses a
        // key of it; rounded to bf16 into shared memory.
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = wq * 32 + m * 16 + g + 8 * h;  // the query row, within the tile
                const float l2 = meta[c] * FA_LOG2E;
                const float qoff = meta[2 * FA2_BR + c];
                const int lo = ((const int*)meta)[3 * FA2_BR + c], hi = ((const int*)meta)[4 * FA2_BR + c];
#pragma unroll
                for (int n = 0; n < 4; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = wk * 32 + n * 8 + 2 * t + e;  // the key, within the tile
                        float& s = sc[m][n][2 * h + e];
                        if (full) {
                            s = fa_exp2(s * sl2 - l2);
                        } else {
                            s = (j >= lo && j < hi) ? fa_exp2(s * sl2 + slope2 * ((float)j + qoff) - l2) : 0.0f;
                        }
                    }
                    *(unsigned*)(ps + c * LDS + wk * 32 + n * 8 + 2 * t) =
                        fa_pack_f(sc[m][n][2 * h], sc[m][n][2 * h + 1]);
                }
            }
        // dP = dO·Vᵀ, the same tiling, one query m-tile at a time (the registers of the
        // accumulators, S and dP together are what bound this kernel); dS = P ⊙ (dP − D) into
        // shared memory.
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            float dp[4][4];
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned da[4];
                fa_ldsm_a(dot + (wq * 32 + m * 16) * LD + kk * 16, LD, da);
#pragma unroll
                for (int n = 0; n < 4; n += 2) {
                    unsigned vb[4];
                    fa_ldsm_b(vs + (wk * 32 + n * 8) * LD + kk * 16, LD, vb);
                    fa_mma(dp[n], da, vb);
                    fa_mma(dp[n + 1], da, vb + 2);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = wq * 32 + m * 16 + g + 8 * h;
                const float dd = meta[FA2_BR + c];
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float d0 = sc[m][n][2 * h] * (dp[n][2 * h] - dd);
                    const float d1 = sc[m][n][2 * h + 1] * (dp[n][2 * h + 1] - dd);
                    *(unsigned*)(dss + c * LDS + wk * 32 + n * 8 + 2 * t) = fa_pack_f(d0, d1);
                }
            }
        }
        __syncthreads();  // P and dS of every warp are in shared memory
        // dV += Pᵀ·dO and dK += dSᵀ·Q (scaled at the end): 32 keys × D/2 dims per warp, over
        // the tile's 64 queries.
#pragma unroll
        for (int kk = 0; kk < FA2_BR / 16; ++kk) {
            unsigned pa[2][4], sa[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                fa_ldsm_at(ps + kk * 16 * LDS + wk * 32 + m * 16, LDS, pa[m]);
                fa_ldsm_at(dss + kk * 16 * LDS + wk * 32 + m * 16, LDS, sa[m]);
            }
#pragma unroll
            for (int n = 0; n < DH / 8; n += 2) {
                unsigned bd[4], bq[4];
                fa_ldsm_t(dot + kk * 16 * LD + wq * DH + n * 8, LD, bd);
                fa_ldsm_t(qt + kk * 16 * LD + wq * DH + n * 8, LD, bq);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    fa_mma(dva[m][n], pa[m], bd);
                    fa_mma(dva[m][n + 1], pa[m], bd + 2);
                    fa_mma(dka[m][n], sa[m], bq);
                    fa_mma(dka[m][n + 1], sa[m], bq + 2);
                }
            }
        }
        // dQ += dS·K: 32 queries × D/4 dims per warp, over the 128 keys.
        float dqa[2][DQ / 8][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < DQ / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dqa[m][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < FA2_BC / 16; ++kk) {
            unsigned sa2[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) fa_ldsm_a(dss + (wq * 32 + m * 16) * LDS + kk * 16, LDS, sa2[m]);
#pragma unroll
            for (int n = 0; n < DQ / 8; n += 2) {
                unsigned bk[4];
                fa_ldsm_t(ks + kk * 16 * LD + wk * DQ + n * 8, LD, bk);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    fa_mma(dqa[m][n], sa2[m], bk);
                    fa_mma(dqa[m][n + 1], sa2[m], bk + 2);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int qa = i0 + wq * 32 + m * 16 + g + 8 * h;
                if (qa >= a.s) continue;
                float* dqr = dqb + (i64)qa * qs + hh * D + wk * DQ + 2 * t;
#pragma unroll
                for (int n = 0; n < DQ / 8; ++n) fa_red2(dqr + n * 8, dqa[m][n][2 * h], dqa[m][n][2 * h + 1]);
            }
    }
    fa_cp_wait_all();
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 j = j0 + wk * 32 + m * 16 + g + 8 * h;
            if (j >= a.t) continue;
            bf16_t* dkr = dk + (b * a.t + j) * kvs + kvh * D + wq * DH + 2 * t;
            bf16_t* dvr = dv + (b * a.t + j) * kvs + kvh * D + wq * DH + 2 * t;
#pragma unroll
            for (int n = 0; n < DH / 8; ++n) {
                *(unsigned*)(dkr + n * 8) = fa_pack_f(dka[m][n][2 * h] * a.scale, dka[m][n][2 * h + 1] * a.scale);
                *(unsigned*)(dvr + n * 8) = fa_pack_f(dva[m][n][2 * h], dva[m][n][2 * h + 1]);
            }
        }
}

// Head dims 64 and 128 (the backend's `flash::HEAD_DIMS2`; 32 keeps the first kernel). Head dim
// 64 runs two blocks per SM (128 registers, a few spilled outside the products; 2 × 108.5 KiB of
// shared memory), 128 one (254 registers, no spills).
#define FA2_KERNELS(D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(FA2_THREADS, (D) <= 64 ? 2 : 1) flash_bwd2_##D(                           \
        const bf16_t* q, const bf16_t* k, const bf16_t* v, const bf16_t* dout, const float* lse,          \
        const float* delta, const float* slopes, Attn a, float* dq_acc, bf16_t* dk, bf16_t* dv) {         \
        fa2_backward<D>(q, k, v, dout, lse, delta, slopes, a, dq_acc, dk, dv);                            \
    }
FA2_KERNELS(64)
FA2_KERNELS(128)

// D_i = Σ_e dO·O per query row ([B,H,S]) from bf16 out and dO: one warp per row.
extern "C" __global__ void flash_delta(const bf16_t* out, const bf16_t* dout, float* delta, Attn a) {
    i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // (b·S + i)·H + h
    if (row >= a.b * a.s * a.h) return;
    int lane = threadIdx.x & 31;
    float s = 0.0f;
    for (i64 e = lane; e < a.d; e += 32) s += bf16_to_f32(out[row * a.d + e]) * bf16_to_f32(dout[row * a.d + e]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    i64 hh = row % a.h, bi = row / a.h, i = bi % a.s, b = bi / a.s;
    if (lane == 0) delta[(b * a.h + hh) * a.s + i] = s;
}

// y = x·scale stored as type `code` (dQ from its f32 accumulator).
extern "C" __global__ void scale_store(const float* x, float scale, void* y, int code, i64 n) {
    GRID_STRIDE(i, n) { store_as(y, code, i, (double)(x[i] * scale), 0); }
}
