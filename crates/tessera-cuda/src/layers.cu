// Embedding, fused cross-entropy, AdamW, rotary embeddings and the unfused attention of
// Tessera's CUDA kernels (appended after reduce.cu by the crate, module `source`).

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

// ---- fused softmax cross-entropy. The logits hold classes [first, first + v) of `vocab`
// (all of them, or a tensor-parallel device's share: the vocabulary-parallel loss). Targets
// are bounded before any is indexed by; `cross_entropy_targets` counts them and records the
// first bad one in the backend's fault word (module `fault`). ----

// The log-sum-exp of the v logits from r0 (double, every thread; -inf for an empty or all
// -inf row). A block per row.
__device__ __forceinline__ double row_logsumexp(const void* x, int cx, i64 r0, i64 v) {
    float m = -INFINITY;
    double s = 0.0;
    if ((v & 7) == 0 && out8_ok(x, cx)) {
        // The row by 16-byte loads (eight logits each).
        for (i64 j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
            float lv[8];
            ld8(x, cx, r0 + j, lv);
#pragma unroll
            for (int e = 0; e < 8; ++e) m = fmaxf(m, lv[e]);
        }
        m = block_max(m);
        for (i64 j = 8 * threadIdx.x; j < v; j += 8 * blockDim.x) {
            float lv[8];
            ld8(x, cx, r0 + j, lv);
#pragma unroll
            for (int e = 0; e < 8; ++e) s += exp((double)(lv[e] - m));
        }
    } else {
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ldf(x, cx, r0 + j));
        m = block_max(m);
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) s += exp((double)(ldf(x, cx, r0 + j) - m));
    }
    s = block_sum(s);
    return m == -INFINITY ? -INFINITY : (double)m + log(s);
}

extern "C" __global__ void logsumexp_rows(const void* x, int cx, float* y, i64 v) {
    const double l = row_logsumexp(x, cx, (i64)blockIdx.x * v, v);
    if (threadIdx.x == 0) y[blockIdx.x] = (float)l;
}

// Per row: its log-sum-exp (computed, or `given`: over every class, the vocabulary-parallel
// forward) into lse, and its loss part into nll: 0 when ignored, NaN for a bad target, else
// the log-sum-exp where this shard holds class 0 minus the target's logit where it holds it.
extern "C" __global__ void cross_entropy_rows(const void* logits, int cl, const i64* targets, const float* given,
                                              float* lse, double* nll, i64 v, i64 first, i64 vocab, i64 ignore,
                                              int has_ignore) {
    const i64 r = blockIdx.x, r0 = r * v;
    const double l = given ? (double)given[r] : row_logsumexp(logits, cl, r0, v);
    if (threadIdx.x == 0) {
        lse[r] = (float)l;
        const i64 t = targets[r];
        double part = 0.0;
        if (!(has_ignore && t == ignore)) {
            if (t < 0 || t >= vocab) {
                part = NAN;
            } else {
                if (first == 0) part = l;
                const i64 k = t - first;
                if (k >= 0 && k < v) part -= (double)ldf(logits, cl, r0 + k);
            }
        }
        nll[r] = part;
    }
}

// One block over the targets: counts the non-ignored ones (the mean's divisor: at least 1, 1
// with `sum`) and records the first outside [0, vocab) in `fault` unless an earlier op did:
// [op, flat position, target, vocab, has_ignore, ignore]. The forward (`nll` set) writes the
// loss Σ nll / divisor (NaN with a bad target); the backward, the divisor into `div`.
extern "C" __global__ void cross_entropy_targets(const i64* targets, i64 rows, i64 vocab, i64 ignore, int has_ignore,
                                                 int sum, int op, i64* fault, const double* nll, float* loss,
                                                 double* div) {
    __shared__ long long bad;
    if (threadIdx.x == 0) bad = rows;
    __syncthreads();
    double count = 0.0, s = 0.0;
    long long mine = rows;
    for (i64 i = threadIdx.x; i < rows; i += blockDim.x) {
        const i64 t = targets[i];
        if (has_ignore && t == ignore) continue;
        if (t < 0 || t >= vocab) {
            if (i < mine) mine = i;
            continue;
        }
        count += 1.0;
        if (nll) s += nll[i];
    }
    if (mine < rows) atomicMin(&bad, mine);
    count = block_sum(count);  // its barriers publish `bad`
    if (nll) s = block_sum(s);
    if (threadIdx.x != 0) return;
    const double d = sum ? 1.0 : fmax(count, 1.0);
    if (bad < rows && fault[0] == 0) {
        fault[1] = bad;
        fault[2] = targets[bad];
        fault[3] = vocab;
        fault[4] = has_ignore;
        fault[5] = ignore;
        fault[0] = op;
    }
    if (loss) loss[0] = bad < rows ? NAN : (float)(s / d);
    if (div) div[0] = d;
}

// dlogits = dloss / divisor · (softmax − onehot(target)) over this shard's columns, from the
// log-sum-exp over every class; 0 on ignored rows. A bad target matches no column.
extern "C" __global__ void cross_entropy_backward(const void* logits, int cl, const i64* targets, const float* lse,
                                                  const float* dloss, const double* div, void* dx, int cdx, i64 v,
                                                  i64 first, i64 ignore, int has_ignore, i64 n) {
    const float g = (float)((double)dloss[0] / div[0]);
    if ((v & 7) == 0 && out8_ok(logits, cl) && out8_ok(dx, cdx)) {
        // Eight logits of one row per thread: one division per eight, 16-byte loads and stores.
        GRID_STRIDE(gi, n >> 3) {
            const i64 i = gi << 3, r = i / v, j = i - r * v, t = targets[r];
            float o[8];
            if (has_ignore && t == ignore) {
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = 0.0f;
            } else {
                float lv[8];
                ld8(logits, cl, i, lv);
                const float l = lse[r];
                const i64 k = t - first;
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = g * (expf(lv[e] - l) - (j + e == k ? 1.0f : 0.0f));
            }
            st8(dx, cdx, i, o);
        }
        return;
    }
    GRID_STRIDE(i, n) {
        i64 r = i / v, j = i % v;
        i64 t = targets[r];
        if (has_ignore && t == ignore) {
            stf(dx, cdx, i, 0.0f);
        } else {
            float p = expf(ldf(logits, cl, i) - lse[r]);
            stf(dx, cdx, i, g * (p - (j == t - first ? 1.0f : 0.0f)));
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
                                 double beta1, double beta2, double eps_d, double wd_d, double max_norm, i64 n,
                                 const i64* fault) {
    // A bad cross-entropy target this step (the backend's fault word, module `fault`): the
    // update is not applied; the host reports the target at its next synchronisation.
    if (fault && fault[0] != 0) return;
    double scale = scale_p ? load_as(scale_p, scale_code, 0) : 1.0;
    double norm = load_as(norm_p, norm_code, 0) * scale;
    if (scale_p && !isfinite(norm)) return;  // an overflowed fp16 step: nothing is written
    double step = load_as(step_p, step_code, 0);
    double clip_d = (max_norm >= 0.0 ? fmin(max_norm / (norm + 1e-6), 1.0) : 1.0) * scale;
    float clip = (float)clip_d, b1 = (float)beta1, b2 = (float)beta2;
    float inv_bc1 = (float)(1.0 / (1.0 - pow(beta1, step)));
    float inv_bc2 = (float)(1.0 / (1.0 - pow(beta2, step)));
    float eps = (float)eps_d, lr = (float)load_as(lr_p, lr_code, 0), wd = (float)wd_d;
    // One element's update: w, m and v in place, from the raw gradient g.
#define ADAMW_ELEM(w, g, mi, vi)                                          \
    {                                                                     \
        float g_ = clip * (g);                                            \
        mi = b1 * (mi) + (1.0f - b1) * g_;                                \
        vi = b2 * (vi) + (1.0f - b2) * g_ * g_;                           \
        float mh_ = (mi) * inv_bc1, vh_ = (vi) * inv_bc2;                 \
        w = (w) - lr * (mh_ / (sqrtf(vh_) + eps) + wd * (w));             \
    }
#define ADAMW1(i)                                                         \
    {                                                                     \
        float w = master ? master[i] : ldf(param, p_code, i);             \
        float mi = m[i], vi = v[i];                                       \
        ADAMW_ELEM(w, ldf(grad, g_code, i), mi, vi);                      \
        m[i] = mi;                                                        \
        v[i] = vi;                                                        \
        if (master) master[i] = w;                                        \
        stf(param, p_code, i, w);                                         \
    }
    // Eight elements per thread by 16-byte loads where every array is aligned.
    const bool vec = out8_ok(param, p_code) && out8_ok(grad, g_code) && out8_ok(m, 0) && out8_ok(v, 0) &&
                     (!master || out8_ok(master, 0));
    if (vec) {
#define ADAMW8(i)                                                         \
        {                                                                 \
            float w[8], g[8], mi[8], vi[8];                               \
            if (master) ld8(master, 0, i, w); else ld8(param, p_code, i, w); \
            ld8(grad, g_code, i, g);                                      \
            ld8(m, 0, i, mi);                                             \
            ld8(v, 0, i, vi);                                             \
            _Pragma("unroll") for (int k = 0; k < 8; ++k) ADAMW_ELEM(w[k], g[k], mi[k], vi[k]); \
            st8(m, 0, i, mi);                                             \
            st8(v, 0, i, vi);                                             \
            if (master) st8(master, 0, i, w);                             \
            st8(param, p_code, i, w);                                     \
        }
        DENSE8(n, ADAMW8, ADAMW1)
#undef ADAMW8
    } else {
        GRID_STRIDE(i, n) ADAMW1(i)
    }
#undef ADAMW1
#undef ADAMW_ELEM
}

// ---- rotary embeddings: x [B,S,H,D], pos [B*S] (or null: s index), half-split pairs ----
// One block per token (b, s): its angles (in double, as the CPU kernel computes them) once
// into shared memory, then every head's pairs. ROPE_MAX_HALF bounds the head dim (the
// backend checks).
#define ROPE_MAX_HALF 512
// One block per token when positions are given; else one per sequence position, over the
// `batch` rows that share its angles.
__device__ __forceinline__ void rope_token(const void* x, int cx, const float* cs, void* y, int cy, i64 base, i64 h,
                                           int half, i64 d) {
    // Eight pairs per thread by 16-byte loads where the halves and both tensors allow.
    if ((half & 7) == 0 && out8_ok(x, cx) && out8_ok(y, cy)) {
        const int per = half >> 3;
        for (int i = threadIdx.x; i < (int)h * per; i += blockDim.x) {
            const int hh = i / per, k = (i - hh * per) * 8;
            const i64 o = base + (i64)hh * d + k;
            float x1[8], x2[8], y1[8], y2[8];
            ld8(x, cx, o, x1);
            ld8(x, cx, o + half, x2);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float c = cs[k + e], sn = cs[half + k + e];
                y1[e] = x1[e] * c - x2[e] * sn;
                y2[e] = x2[e] * c + x1[e] * sn;
            }
            st8(y, cy, o, y1);
            st8(y, cy, o + half, y2);
        }
        return;
    }
    for (int i = threadIdx.x; i < (int)h * half; i += blockDim.x) {
        const int hh = i / half, k = i - hh * half;
        const i64 o = base + (i64)hh * d + k;
        const float c = cs[k], sn = cs[half + k];
        float x1 = ldf(x, cx, o), x2 = ldf(x, cx, o + half);
        stf(y, cy, o, x1 * c - x2 * sn);
        stf(y, cy, o + half, x2 * c + x1 * sn);
    }
}

// The inverse frequencies by value, in the launch's parameters (no upload).
struct RopeFreq {
    float f[ROPE_MAX_HALF];
};

extern "C" __global__ void rope(const void* x, int cx, const i64* pos, void* y, int cy, i64 s, i64 h, i64 d,
                                float sign, i64 batch, RopeFreq inv_freq) {
    __shared__ float cs[2 * ROPE_MAX_HALF];
    const i64 blk = blockIdx.x;  // b*S + si with positions, else si
    const int half = (int)(d / 2);
    const i64 p = pos ? pos[blk] : blk % s;
    // The angles in double, as the CPU kernel computes them, once per block.
    for (int k = threadIdx.x; k < half; k += blockDim.x) {
        double ang = (double)sign * (double)p * (double)inv_freq.f[k];
        cs[k] = (float)cos(ang);
        cs[half + k] = (float)sin(ang);
    }
    __syncthreads();
    if (pos) {
        rope_token(x, cx, cs, y, cy, blk * h * d, h, half, d);
        return;
    }
    for (i64 b = 0; b < batch; ++b) rope_token(x, cx, cs, y, cy, (b * s + blk) * h * d, h, half, d);
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

// Ring attention (`AttentionSpec::ring`): queries and keys at global positions, from the
// device's cp coordinate `qc`, the key block owner's `kc`, the ring's `size` and the zig-zag
// chunking (`RingBlock::positions_of`; `on` 0: not a ring). Passed by value: no upload.
struct RingPos {
    i64 on, qc, kc, size, zigzag;
};

// The global position of local row i of `len` rows held by cp coordinate c.
__device__ __forceinline__ i64 ring_at(const RingPos& r, i64 c, i64 len, i64 i) {
    if (!r.zigzag) return c * len + i;
    i64 half = len / 2;
    return i < half ? c * half + i : (2 * r.size - 1 - c) * half + i - half;
}

__device__ __forceinline__ i64 ring_pos(const Attn& a, const i64* start, const RingPos& r, i64 b, i64 i) {
    return r.on && !start ? ring_at(r, r.qc, a.s, i) : attn_pos(a, start, b, i);
}

__device__ __forceinline__ i64 ring_key(const Attn& a, const RingPos& r, i64 j) {
    return r.on ? ring_at(r, r.kc, a.t, j) : j;
}

// How many keys sit at positions below p (their positions increase with j).
__device__ __forceinline__ i64 ring_keys_before(const Attn& a, const RingPos& r, i64 p) {
    i64 lo = 0, hi = a.t;
    while (lo < hi) {
        i64 m = (lo + hi) / 2;
        if (ring_at(r, r.kc, a.t, m) < p) lo = m + 1; else hi = m;
    }
    return lo;
}

// The keys `lo..hi` visible to the query at position p (the CPU's `Geom::visible`).
__device__ __forceinline__ void ring_visible(const Attn& a, const RingPos& r, i64 p, i64* lo, i64* hi) {
    if (!r.on) {
        attn_visible(a, p, lo, hi);
        return;
    }
    i64 h = a.causal ? ring_keys_before(a, r, p + 1) : a.t;
    i64 l = a.window > 0 ? ring_keys_before(a, r, p - a.window + 1) : 0;
    *lo = l;
    *hi = h > l ? h : l;
}

// D_i = Σ_e dO·O per query row ([B,H,S]), for the backward's dS = P ⊙ (dP − D); minus the
// log-sum-exp's cotangent `dlse` [B,H,S] where ring attention's merge read it (else null).
extern "C" __global__ void attention_delta(const float* out, const float* dout, float* delta, Attn a,
                                           const float* dlse) {
    i64 i = blockIdx.x, hh = blockIdx.y, b = blockIdx.z;
    i64 off = ((b * a.s + i) * a.h + hh) * a.d;
    double s = 0.0;
    for (i64 e = threadIdx.x; e < a.d; e += blockDim.x) s += (double)out[off + e] * dout[off + e];
    s = block_sum(s);
    i64 r = (b * a.h + hh) * a.s + i;
    if (threadIdx.x == 0) delta[r] = dlse ? (float)s - dlse[r] : (float)s;
}

// ---- attention through cuBLAS: per batch element b, the scores [H,S,T] come from a GEMM
// (already scaled); these row kernels apply the masks and ALiBi and do the softmax parts. ----
extern "C" __global__ void attn_softmax(float* sc, const i64* start, const float* slopes, Attn a, i64 b,
                                        float* lse, RingPos rp) {
    i64 i = blockIdx.x, hh = blockIdx.y;
    float* row = sc + (hh * a.s + i) * a.t;
    i64 p = ring_pos(a, start, rp, b, i);
    i64 lo, hi;
    ring_visible(a, rp, p, &lo, &hi);
    float slope = slopes ? slopes[hh] : 0.0f;
    float m = -INFINITY;
    for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, row[j] + slope * (float)(ring_key(a, rp, j) - p));
    m = block_max(m);
    double s = 0.0;
    for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) s += expf(row[j] + slope * (float)(ring_key(a, rp, j) - p) - m);
    s = block_sum(s);
    float inv = s > 0.0 ? (float)(1.0 / s) : 0.0f;
    for (i64 j = threadIdx.x; j < a.t; j += blockDim.x)
        row[j] = (j >= lo && j < hi) ? expf(row[j] + slope * (float)(ring_key(a, rp, j) - p) - m) * inv : 0.0f;
    if (threadIdx.x == 0) lse[(b * a.h + hh) * a.s + i] = hi > lo ? (float)((double)m + log(s)) : -INFINITY;
}

// Backward rows: `sc` holds the scaled scores, `dp` dO·Vᵀ; writes P into sc and
// dS = P ⊙ (dP − D) into dp (zero on a row whose log-sum-exp is −∞: it saw no key).
extern "C" __global__ void attn_grad_scores(float* sc, float* dp, const float* lse, const float* delta,
                                            const i64* start, const float* slopes, Attn a, i64 b,
                                            RingPos rp) {
    i64 i = blockIdx.x, hh = blockIdx.y;
    i64 r = (hh * a.s + i) * a.t;
    i64 p = ring_pos(a, start, rp, b, i);
    i64 lo, hi;
    ring_visible(a, rp, p, &lo, &hi);
    float slope = slopes ? slopes[hh] : 0.0f;
    float l = lse[(b * a.h + hh) * a.s + i];
    float dd = delta[(b * a.h + hh) * a.s + i];
    if (l == -INFINITY) hi = lo;
    for (i64 j = threadIdx.x; j < a.t; j += blockDim.x) {
        float pj = (j >= lo && j < hi) ? expf(sc[r + j] + slope * (float)(ring_key(a, rp, j) - p) - l) : 0.0f;
        sc[r + j] = pj;
        dp[r + j] = pj * (dp[r + j] - dd);
    }
}
