// ---- Mixture-of-experts routing (moe.rs): top-k, gathers and scatters along the last dim,
// slot assignment under a capacity, dispatch, the weighted combine and the slot dot products ----
// f32 values and i64 indices, contiguous operands (the backend upcasts half ones and densifies
// views first). Each kernel is the CPU kernel's arithmetic (tessera-runtime's kernels/moe.rs):
// sums run in f64 in the CPU's order (every product summed is of two floats, exact in f64, so a
// contracted multiply-add rounds as the CPU's multiply then add), and there are no float
// atomics: every result is deterministic and the CPU's bits. Indices outside their range (the
// CPU reports them) read as nothing here: a gather gives 0, a scatter or slot skips them.
// `per` is the assignments of one routing group (n·k), `rows` the rows of one group's buffer
// (E·C); a slot of assignment `a` is row `(a / per) · rows + slot` of the whole buffer.

// Whether (a, i) comes before (b, j) in top-k's order: NaN above every number, then larger
// first, equal values (-0 == +0 too) by the lower index — the CPU's stable sort.
__device__ __forceinline__ bool moe_before(float a, i64 i, float b, i64 j) {
    const bool an = isnan(a), bn = isnan(b);
    if (an != bn) return an;
    if (!an && a != b) return a > b;
    return i < j;
}

// x [rows, n] → vals, idx [rows, k]: a thread per row, k selection passes, pass j taking the
// first element (in the order above) after pass j-1's pick.
extern "C" __global__ void moe_top_k(const float* x, float* vals, i64* idx, i64 rows, i64 n, i64 k) {
    GRID_STRIDE(r, rows) {
        const float* row = x + r * n;
        float pv = 0.0f;
        i64 pi = -1;
        for (i64 j = 0; j < k; ++j) {
            float bv = 0.0f;
            i64 bi = -1;
            for (i64 i = 0; i < n; ++i) {
                const float v = row[i];
                if (pi >= 0 && !moe_before(pv, pi, v, i)) continue;
                if (bi < 0 || moe_before(v, i, bv, bi)) {
                    bi = i;
                    bv = v;
                }
            }
            vals[r * k + j] = bv;
            idx[r * k + j] = bi;
            pv = bv;
            pi = bi;
        }
    }
}

// x [rows, n], idx [rows, k] → y [rows, k] (`total` = rows·k).
extern "C" __global__ void moe_take_along(const float* x, const i64* idx, float* y, i64 n, i64 k, i64 total) {
    GRID_STRIDE(a, total) {
        const i64 i = idx[a];
        y[a] = (i >= 0 && i < n) ? x[(a / k) * n + i] : 0.0f;
    }
}

// idx, src [rows, k] → y [rows, size] (`total` = rows·size): a thread per output element sums
// the sources aimed at it in order, in f64.
extern "C" __global__ void moe_scatter_along(const i64* idx, const float* src, float* y, i64 k, i64 size,
                                             i64 total) {
    GRID_STRIDE(o, total) {
        const i64 r = o / size, c = o % size;
        double acc = 0.0;
        for (i64 j = 0; j < k; ++j)
            if (idx[r * k + j] == c) acc += (double)src[r * k + j];
        y[o] = (float)acc;
    }
}

// Expert indices [groups, per] → slots [groups, per], which the backend fills with -1 first: a
// thread per (group, expert) walks its group's assignments in row-major order, so expert e's
// c-th assignment gets slot e·cap + c, or -1 once c ≥ cap (the CPU's serial pass, split by
// expert: each expert's count depends on its own assignments only).
extern "C" __global__ void moe_slots(const i64* idx, i64* slots, i64 groups, i64 per, i64 experts, i64 cap) {
    GRID_STRIDE(t, groups * experts) {
        const i64 g = t / experts, e = t % experts;
        const i64* gi = idx + g * per;
        i64* gs = slots + g * per;
        i64 used = 0;
        for (i64 a = 0; a < per; ++a) {
            if (gi[a] != e) continue;
            gs[a] = used < cap ? e * cap + used : -1;
            ++used;
        }
    }
}

// The inverse of the slot map: owner [groups·rows] (all ones first) gets, per filled buffer row,
// its assignment. An integer minimum, so a row claimed twice (slots not from moe_slots, which
// the CPU reports) deterministically keeps its first assignment.
extern "C" __global__ void moe_dispatch_owner(const i64* slots, u64* owner, i64 per, i64 rows, i64 total) {
    GRID_STRIDE(a, total) {
        const i64 s = slots[a];
        if (s >= 0 && s < rows) atomicMin(owner + (a / per) * rows + s, (u64)a);
    }
}

// buf [groups·rows, h] (`total` elements): each row its owner's token row [a / k] of x [.., h],
// times its weight w[a] when `w` is given; zero where no assignment owns the row.
extern "C" __global__ void moe_dispatch(const float* x, const float* w, const u64* owner, float* buf, i64 k, i64 h,
                                        i64 total) {
    GRID_STRIDE(o, total) {
        const u64 a = owner[o / h];
        float v = 0.0f;
        if (a != ~0ull) {
            v = x[((i64)a / k) * h + o % h];
            if (w) v = __fmul_rn(w[a], v);
        }
        buf[o] = v;
    }
}

// out [tokens, h] (`total` elements) from y [groups·rows, h]: each element sums its token's k
// choices in order, in f64, each times its weight when `w` is given; dropped ones add nothing.
extern "C" __global__ void moe_combine(const float* y, const i64* slots, const float* w, float* out, i64 per,
                                       i64 rows, i64 k, i64 h, i64 total) {
    GRID_STRIDE(o, total) {
        const i64 t = o / h, c = o % h;
        double acc = 0.0;
        for (i64 j = 0; j < k; ++j) {
            const i64 a = t * k + j, s = slots[a];
            if (s < 0 || s >= rows) continue;
            const double cf = w ? (double)w[a] : 1.0;
            acc += cf * (double)y[((a / per) * rows + s) * h + c];
        }
        out[o] = (float)acc;
    }
}

// out [tokens, k] (`total` = tokens·k): assignment a's buffer row dotted with its token's row of
// x, in f64 in order from -0 (Rust's f64 `sum`), so an all -0 dot keeps its sign as on the CPU;
// 0 for a dropped assignment.
extern "C" __global__ void moe_slot_dot(const float* buf, const float* x, const i64* slots, float* out, i64 per,
                                        i64 rows, i64 k, i64 h, i64 total) {
    GRID_STRIDE(a, total) {
        const i64 s = slots[a];
        float r = 0.0f;
        if (s >= 0 && s < rows) {
            const float* b = buf + ((a / per) * rows + s) * h;
            const float* xr = x + (a / k) * h;
            double d = -0.0;
            for (i64 c = 0; c < h; ++c) d += (double)b[c] * (double)xr[c];
            r = (float)d;
        }
        out[a] = r;
    }
}
