// ---- Vision ops (vision.rs): convolution, GroupNorm, pooling, upsampling ----
// NCHW, f32, contiguous operands (the backend upcasts half ones and densifies views first).
// Each kernel is the CPU kernel's arithmetic (tessera-runtime's kernels/vision.rs), summing in
// the CPU's order wherever it accumulates, so pooling, upsampling and col2im give the CPU's
// bits. Every kernel that writes an input gradient gathers (a thread per input element, the
// outputs that read it in row-major order): no atomics, so every result is deterministic.
// Index arithmetic is 32-bit when the launch's elements fit (`I` = int), 64-bit otherwise.

// A convolution's geometry (`ConvGeom` in vision.rs): x [n, c, h, w], weight [o, c/groups, kh,
// kw], y [n, o, ho, wo]; s*, p*, d* are the stride, padding and dilation per spatial dim.
struct ConvGeom {
    i64 n, c, h, w, o, kh, kw, ho, wo, groups, sh, sw, ph, pw, dh, dw;
};

// A pooling's geometry (`PoolGeom` in vision.rs): `planes` = N·C planes of h × w in, ho × wo out.
struct PoolGeom {
    i64 planes, h, w, ho, wo, kh, kw, sh, sw, ph, pw, include_pad;
};

#define VISION_SMALL(n) ((n) < 2147483647LL)

// im2col of `imgs` images from `x` (the first image's start): col [imgs, c·kh·kw, ho·wo], row r =
// (channel, ky, kx), zero where the tap falls in the padding (CPU `Geom::im2col`).
template <typename I>
__device__ __forceinline__ void im2col_body(const float* __restrict__ x, float* __restrict__ col, const ConvGeom& g,
                                            i64 n) {
    const I h = (I)g.h, w = (I)g.w, kh = (I)g.kh, kw = (I)g.kw, wo = (I)g.wo, p = (I)(g.ho * g.wo);
    const I rows = (I)g.c * kh * kw;
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I pos = i % p, r = (i / p) % rows, b = i / (p * rows);
        const I ci = r / (kh * kw), ky = (r / kw) % kh, kx = r % kw;
        const I iy = (pos / wo) * (I)g.sh + ky * (I)g.dh - (I)g.ph;
        const I ix = (pos % wo) * (I)g.sw + kx * (I)g.dw - (I)g.pw;
        float v = 0.0f;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = x[((b * (I)g.c + ci) * h + iy) * w + ix];
        col[i] = v;
    }
}
extern "C" __global__ void vision_im2col(const float* x, float* col, i64 imgs, ConvGeom g) {
    i64 n = imgs * g.c * g.kh * g.kw * g.ho * g.wo;
    if (VISION_SMALL(n) && VISION_SMALL(imgs * g.c * g.h * g.w)) im2col_body<int>(x, col, g, n);
    else im2col_body<i64>(x, col, g, n);
}

// col2im as a gather: dx [imgs, c, h, w] of `imgs` images from their column gradients `col`
// [imgs, c·kh·kw, ho·wo]; each element sums its taps in the CPU's order (ky, then kx, rising).
template <typename I>
__device__ __forceinline__ void col2im_body(const float* __restrict__ col, float* __restrict__ dx, const ConvGeom& g,
                                            i64 n) {
    const I h = (I)g.h, w = (I)g.w, kh = (I)g.kh, kw = (I)g.kw, ho = (I)g.ho, wo = (I)g.wo;
    const I sh = (I)g.sh, sw = (I)g.sw, p = ho * wo;
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ix = i % w, iy = (i / w) % h, plane = i / (h * w);  // plane = image·c + channel
        const float* cp = col + plane * kh * kw * p;
        float s = 0.0f;
        for (I ky = 0; ky < kh; ++ky) {
            const I ty = iy + (I)g.ph - ky * (I)g.dh;
            if (ty < 0 || ty % sh != 0 || ty / sh >= ho) continue;
            const I oy = ty / sh;
            for (I kx = 0; kx < kw; ++kx) {
                const I tx = ix + (I)g.pw - kx * (I)g.dw;
                if (tx < 0 || tx % sw != 0 || tx / sw >= wo) continue;
                s += cp[(ky * kw + kx) * p + oy * wo + tx / sw];
            }
        }
        dx[i] = s;
    }
}
extern "C" __global__ void vision_col2im(const float* col, float* dx, i64 imgs, ConvGeom g) {
    i64 n = imgs * g.c * g.h * g.w;
    if (VISION_SMALL(n) && VISION_SMALL(imgs * g.c * g.kh * g.kw * g.ho * g.wo)) col2im_body<int>(col, dx, g, n);
    else col2im_body<i64>(col, dx, g, n);
}

// ---- GroupNorm: one block per (sample, group) of `len` = cg·s elements (cg channels of s
// positions), statistics in f64 in two passes (mean, then the biased variance), as the CPU. ----
__device__ __forceinline__ void group_stats(const float* xg, i64 len, double eps, double* mean, double* rstd) {
    double s = 0.0;
    for (i64 i = threadIdx.x; i < len; i += blockDim.x) s += (double)xg[i];
    const double m = block_sum(s) / (double)len;
    double s2 = 0.0;
    for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
        double c = (double)xg[i] - m;
        s2 += c * c;
    }
    const double var = block_sum(s2) / (double)len;
    *mean = m;
    *rstd = 1.0 / sqrt(var + eps);
}

extern "C" __global__ void vision_group_norm(const float* x, const float* w, const float* b, float* y, i64 groups,
                                             i64 cg, i64 s, double eps) {
    const i64 k = blockIdx.x, len = cg * s;
    const float* xg = x + k * len;
    float* yg = y + k * len;
    double mean, rstd;
    group_stats(xg, len, eps, &mean, &rstd);
    const i64 c0 = (k % groups) * cg;
    for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
        const i64 c = c0 + i / s;
        const double a = rstd * (double)w[c], sh = (double)b[c];
        yg[i] = (float)(((double)xg[i] - mean) * a + sh);
    }
}

// dx of each group, and its channels' partial (Σ dy·x̂, Σ dy) into `part` [n, c, 2] (f64), which
// `vision_group_norm_dwdb` sums over the samples in order. With g = dy·w[c]:
// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)).
extern "C" __global__ void vision_group_norm_backward(const float* x, const float* w, const float* dy, float* dx,
                                                      double* part, i64 groups, i64 cg, i64 s, double eps) {
    const i64 k = blockIdx.x, len = cg * s;
    const float* xg = x + k * len;
    const float* gg = dy + k * len;
    float* dg = dx + k * len;
    double mean, rstd;
    group_stats(xg, len, eps, &mean, &rstd);
    const i64 c0 = (k % groups) * cg;
    double sum_g = 0.0, sum_gx = 0.0;
    for (i64 j = 0; j < cg; ++j) {
        double pw = 0.0, pb = 0.0;
        for (i64 i = j * s + threadIdx.x; i < (j + 1) * s; i += blockDim.x) {
            const double d = (double)gg[i], xhat = ((double)xg[i] - mean) * rstd;
            pw += d * xhat;
            pb += d;
        }
        pw = block_sum(pw);
        pb = block_sum(pb);
        const double wj = (double)w[c0 + j];
        sum_g += pb * wj;
        sum_gx += pw * wj;
        if (threadIdx.x == 0) {
            part[(k * cg + j) * 2] = pw;
            part[(k * cg + j) * 2 + 1] = pb;
        }
    }
    const double mean_g = sum_g / (double)len, mean_gx = sum_gx / (double)len;
    for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
        const double wj = (double)w[c0 + i / s];
        const double xhat = ((double)xg[i] - mean) * rstd;
        dg[i] = (float)(rstd * ((double)gg[i] * wj - mean_g - xhat * mean_gx));
    }
}

// dw[c] = Σ_n part[n, c, 0], db[c] = Σ_n part[n, c, 1], samples in order (the CPU's sum).
extern "C" __global__ void vision_group_norm_dwdb(const double* part, float* dw, float* db, i64 n, i64 c) {
    GRID_STRIDE(ch, c) {
        double sw = 0.0, sb = 0.0;
        for (i64 k = 0; k < n; ++k) {
            sw += part[(k * c + ch) * 2];
            sb += part[(k * c + ch) * 2 + 1];
        }
        dw[ch] = (float)sw;
        db[ch] = (float)sb;
    }
}

// ---- pooling: the window of output (oy, ox) clipped to the input (CPU `window`) ----
template <typename I>
__device__ __forceinline__ void pool_window(const PoolGeom& g, I oy, I ox, I* y0, I* y1, I* x0, I* x1) {
    const I ys = oy * (I)g.sh - (I)g.ph, xs = ox * (I)g.sw - (I)g.pw;
    const I ye = min(ys + (I)g.kh, (I)g.h), xe = min(xs + (I)g.kw, (I)g.w);
    *y0 = max(ys, (I)0);
    *y1 = max(ye, (I)0);
    *x0 = max(xs, (I)0);
    *x1 = max(xe, (I)0);
}

// The outputs whose windows hold input (iy, ix): rows oy0..=oy1, columns ox0..=ox1 (empty when
// a bound passes the other).
template <typename I>
__device__ __forceinline__ void pool_readers(const PoolGeom& g, I iy, I ix, I* oy0, I* oy1, I* ox0, I* ox1) {
    const I sh = (I)g.sh, sw = (I)g.sw;
    const I ny = iy + (I)g.ph - (I)g.kh + 1, nx = ix + (I)g.pw - (I)g.kw + 1;
    *oy0 = ny <= 0 ? (I)0 : (ny + sh - 1) / sh;
    *ox0 = nx <= 0 ? (I)0 : (nx + sw - 1) / sw;
    *oy1 = min((iy + (I)g.ph) / sh, (I)g.ho - 1);
    *ox1 = min((ix + (I)g.pw) / sw, (I)g.wo - 1);
}

// The window's first maximum in row-major order (a NaN, the first one, wins); -1 when empty.
template <typename I>
__device__ __forceinline__ I window_argmax(const float* plane, const PoolGeom& g, I oy, I ox) {
    I y0, y1, x0, x1;
    pool_window<I>(g, oy, ox, &y0, &y1, &x0, &x1);
    I best = -1;
    float bv = 0.0f;
    for (I iy = y0; iy < y1; ++iy)
        for (I ix = x0; ix < x1; ++ix) {
            const I i = iy * (I)g.w + ix;
            const float v = plane[i];
            if (best < 0 || (!isnan(bv) && (v > bv || isnan(v)))) {
                best = i;
                bv = v;
            }
        }
    return best;
}

template <typename I>
__device__ __forceinline__ void max_pool_body(const float* __restrict__ x, float* __restrict__ y, const PoolGeom& g,
                                              i64 n) {
    const I ho = (I)g.ho, wo = (I)g.wo, plane_in = (I)(g.h * g.w);
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ox = i % wo, oy = (i / wo) % ho, pl = i / (ho * wo);
        const float* xp = x + pl * plane_in;
        const I a = window_argmax<I>(xp, g, oy, ox);
        y[i] = a < 0 ? -INFINITY : xp[a];
    }
}
extern "C" __global__ void vision_max_pool(const float* x, float* y, PoolGeom g) {
    i64 n = g.planes * g.ho * g.wo;
    if (VISION_SMALL(g.planes * g.h * g.w) && VISION_SMALL(n)) max_pool_body<int>(x, y, g, n);
    else max_pool_body<i64>(x, y, g, n);
}

// dx: each input element sums dy over the outputs whose window's first maximum it is, in the
// outputs' row-major order (the order the CPU adds them).
template <typename I>
__device__ __forceinline__ void max_pool_backward_body(const float* __restrict__ x, const float* __restrict__ dy,
                                                       float* __restrict__ dx, const PoolGeom& g, i64 n) {
    const I h = (I)g.h, w = (I)g.w, ho = (I)g.ho, wo = (I)g.wo;
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ix = i % w, iy = (i / w) % h, pl = i / (h * w);
        const float* xp = x + pl * h * w;
        const float* dp = dy + pl * ho * wo;
        I oy0, oy1, ox0, ox1;
        pool_readers<I>(g, iy, ix, &oy0, &oy1, &ox0, &ox1);
        const I self = iy * w + ix;
        float s = 0.0f;
        for (I oy = oy0; oy <= oy1; ++oy)
            for (I ox = ox0; ox <= ox1; ++ox)
                if (window_argmax<I>(xp, g, oy, ox) == self) s += dp[oy * wo + ox];
        dx[i] = s;
    }
}
extern "C" __global__ void vision_max_pool_backward(const float* x, const float* dy, float* dx, PoolGeom g) {
    i64 n = g.planes * g.h * g.w;
    if (VISION_SMALL(n) && VISION_SMALL(g.planes * g.ho * g.wo)) max_pool_backward_body<int>(x, dy, dx, g, n);
    else max_pool_backward_body<i64>(x, dy, dx, g, n);
}

// The CPU's divisor: the whole kernel (count_include_pad) or the window's elements in the input.
template <typename I>
__device__ __forceinline__ float pool_divisor(const PoolGeom& g, I rows, I cols) {
    return g.include_pad ? (float)(g.kh * g.kw) : (float)(rows * cols);
}

template <typename I>
__device__ __forceinline__ void avg_pool_body(const float* __restrict__ x, float* __restrict__ y, const PoolGeom& g,
                                              i64 n) {
    const I ho = (I)g.ho, wo = (I)g.wo, w = (I)g.w, plane_in = (I)(g.h * g.w);
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ox = i % wo, oy = (i / wo) % ho, pl = i / (ho * wo);
        const float* xp = x + pl * plane_in;
        I y0, y1, x0, x1;
        pool_window<I>(g, oy, ox, &y0, &y1, &x0, &x1);
        double s = 0.0;
        for (I iy = y0; iy < y1; ++iy) {
            double r = 0.0;
            for (I ix = x0; ix < x1; ++ix) r += (double)xp[iy * w + ix];
            s += r;
        }
        y[i] = (float)(s / (double)pool_divisor<I>(g, y1 - y0, x1 - x0));
    }
}
extern "C" __global__ void vision_avg_pool(const float* x, float* y, PoolGeom g) {
    i64 n = g.planes * g.ho * g.wo;
    if (VISION_SMALL(g.planes * g.h * g.w) && VISION_SMALL(n)) avg_pool_body<int>(x, y, g, n);
    else avg_pool_body<i64>(x, y, g, n);
}

// dx: each input element sums its share dy/divisor of every output whose window holds it, in
// the outputs' row-major order.
template <typename I>
__device__ __forceinline__ void avg_pool_backward_body(const float* __restrict__ dy, float* __restrict__ dx,
                                                       const PoolGeom& g, i64 n) {
    const I h = (I)g.h, w = (I)g.w, ho = (I)g.ho, wo = (I)g.wo;
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ix = i % w, iy = (i / w) % h, pl = i / (h * w);
        const float* dp = dy + pl * ho * wo;
        I oy0, oy1, ox0, ox1;
        pool_readers<I>(g, iy, ix, &oy0, &oy1, &ox0, &ox1);
        float s = 0.0f;
        for (I oy = oy0; oy <= oy1; ++oy)
            for (I ox = ox0; ox <= ox1; ++ox) {
                I y0, y1, x0, x1;
                pool_window<I>(g, oy, ox, &y0, &y1, &x0, &x1);
                s += dp[oy * wo + ox] / pool_divisor<I>(g, y1 - y0, x1 - x0);
            }
        dx[i] = s;
    }
}
extern "C" __global__ void vision_avg_pool_backward(const float* dy, float* dx, PoolGeom g) {
    i64 n = g.planes * g.h * g.w;
    if (VISION_SMALL(n) && VISION_SMALL(g.planes * g.ho * g.wo)) avg_pool_backward_body<int>(dy, dx, g, n);
    else avg_pool_backward_body<i64>(dy, dx, g, n);
}

// ---- nearest upsampling by integer factors (s0, s1): y [planes, h·s0, w·s1] ----
template <typename I>
__device__ __forceinline__ void upsample_body(const float* __restrict__ x, float* __restrict__ y, i64 h, i64 w,
                                              i64 s0, i64 s1, i64 n) {
    const I wi = (I)w, ho = (I)(h * s0), wo = (I)(w * s1);
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ox = i % wo, oy = (i / wo) % ho, pl = i / (ho * wo);
        y[i] = x[(pl * (I)h + oy / (I)s0) * wi + ox / (I)s1];
    }
}
extern "C" __global__ void vision_upsample(const float* x, float* y, i64 planes, i64 h, i64 w, i64 s0, i64 s1) {
    i64 n = planes * h * s0 * w * s1;
    if (VISION_SMALL(n)) upsample_body<int>(x, y, h, w, s0, s1, n);
    else upsample_body<i64>(x, y, h, w, s0, s1, n);
}

// dx: the sum of each s0 × s1 block of dy, row by row (each row's sum added in turn, as the
// CPU sums).
template <typename I>
__device__ __forceinline__ void upsample_backward_body(const float* __restrict__ dy, float* __restrict__ dx, i64 h,
                                                       i64 w, i64 s0, i64 s1, i64 n) {
    const I hi = (I)h, wi = (I)w, a0 = (I)s0, a1 = (I)s1, wo = (I)(w * s1);
    GRID_STRIDE(t, n) {
        const I i = (I)t;
        const I ix = i % wi, iy = (i / wi) % hi, pl = i / (hi * wi);
        const float* dp = dy + pl * hi * a0 * wo + iy * a0 * wo + ix * a1;
        float s = 0.0f;
        for (I a = 0; a < a0; ++a) {
            float r = 0.0f;
            for (I b = 0; b < a1; ++b) r += dp[a * wo + b];
            s += r;
        }
        dx[i] = s;
    }
}
extern "C" __global__ void vision_upsample_backward(const float* dy, float* dx, i64 planes, i64 h, i64 w, i64 s0,
                                                    i64 s1) {
    i64 n = planes * h * w;
    if (VISION_SMALL(n * s0 * s1)) upsample_backward_body<int>(dy, dx, h, w, s0, s1, n);
    else upsample_backward_body<i64>(dy, dx, h, w, s0, s1, n);
}
