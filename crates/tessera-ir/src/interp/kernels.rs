//! The reference interpreter's kernels, part 1: index helpers, elementwise ops, matmul,
//! reductions, softmax, layout ops and norms (plain loops over row-major `f64`).

use super::nn::erfc;
use super::Value;
use crate::ops::elementwise::dropout_keep;
use crate::ops::reduce::reduced_shape;
use crate::{BinaryOp, DType, ReduceOp, Shape, UnaryOp};
use std::borrow::Cow;

// ---- index helpers ---------------------------------------------------------------------------

pub(super) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

pub(super) fn strides(dims: &[usize]) -> Vec<usize> {
    Shape::from(dims).strides()
}

/// `Σ_k idx_k·strides[k]` for every multi-index `idx` of `dims`, in row-major order.
pub(super) fn strided_offsets(dims: &[usize], strides: &[usize]) -> Vec<usize> {
    let n = numel(dims);
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx = vec![0; dims.len()];
    let mut off = 0;
    for _ in 0..n {
        out.push(off);
        for k in (0..dims.len()).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < dims[k] {
                break;
            }
            off -= strides[k] * dims[k];
            idx[k] = 0;
        }
    }
    out
}

/// Strides that read a row-major tensor of shape `from` as if broadcast to `to` (0 along
/// stretched and missing dims). `None` when `from` does not broadcast to `to`.
pub(super) fn broadcast_strides(from: &[usize], to: &[usize]) -> Option<Vec<usize>> {
    if from.len() > to.len() {
        return None;
    }
    let lead = to.len() - from.len();
    let own = strides(from);
    let mut out = vec![0; to.len()];
    for (k, &d) in from.iter().enumerate() {
        if d == to[lead + k] {
            out[lead + k] = if d == 1 { 0 } else { own[k] };
        } else if d != 1 {
            return None;
        }
    }
    Some(out)
}

/// For every element of `to`, the flat index of the element of `from` it reads.
pub(super) fn broadcast_offsets(from: &[usize], to: &[usize]) -> Result<Vec<usize>, String> {
    let st = broadcast_strides(from, to)
        .ok_or_else(|| format!("{from:?} does not broadcast to {to:?}"))?;
    Ok(strided_offsets(to, &st))
}

pub(super) fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    Shape::broadcast(&Shape::from(a), &Shape::from(b))
        .map(|s| s.0.into_vec())
        .ok_or_else(|| format!("shapes {a:?} and {b:?} do not broadcast"))
}

/// (outer, size, inner) of `dims` around dim `d`.
pub(super) fn split_at(dims: &[usize], d: usize) -> (usize, usize, usize) {
    (numel(&dims[..d]), dims[d], numel(&dims[d + 1..]))
}

pub(super) fn check_dim(dims: &[usize], d: usize) -> Result<(), String> {
    ensure!(d < dims.len(), "dim {d} out of range for rank {}", dims.len());
    Ok(())
}

/// A whole number in `0..bound`, as an index.
pub(super) fn index_in(x: f64, bound: usize, what: &str) -> Result<usize, String> {
    ensure!(
        x.fract() == 0.0 && x >= 0.0 && x < bound as f64,
        "{what} {x} is not an index in 0..{bound}"
    );
    Ok(x as usize)
}

pub(super) fn map(x: &Value, f: impl Fn(f64) -> f64) -> Value {
    Value { shape: x.shape.clone(), data: x.data.iter().map(|&v| f(v)).collect() }
}

pub(super) fn zip(a: &Value, b: &Value, f: impl Fn(f64, f64) -> f64) -> Value {
    Value {
        shape: a.shape.clone(),
        data: a.data.iter().zip(&b.data).map(|(&p, &q)| f(p, q)).collect(),
    }
}

pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(p, q)| p * q).sum()
}

/// `acc += c·x`.
pub(super) fn axpy(acc: &mut [f64], c: f64, x: &[f64]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += c * v;
    }
}

// ---- elementwise -----------------------------------------------------------------------------

pub(super) const SQRT_2: f64 = std::f64::consts::SQRT_2;
/// √(2/π), GPT-2's tanh-GELU constant.
pub(super) const GELU_TANH_C: f64 = 0.797_884_560_802_865_4;
/// 1/√(2π).
pub(super) const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// 1/√π.
pub(super) const INV_SQRT_PI: f64 = 0.564_189_583_547_756_3;

pub(super) fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Φ(x), the standard normal CDF.
pub(super) fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / SQRT_2)
}

pub(super) fn unary(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Gelu => x * normal_cdf(x),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + (GELU_TANH_C * (x + 0.044715 * x * x * x)).tanh()),
        UnaryOp::Silu => x * sigmoid(x),
        UnaryOp::Relu => {
            if x > 0.0 {
                x
            } else {
                0.0
            }
        }
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
    }
}

/// f'(x).
pub(super) fn unary_derivative(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Neg => -1.0,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => 1.0 / x,
        UnaryOp::Sqrt => 0.5 / x.sqrt(),
        UnaryOp::Rsqrt => -0.5 / (x * x.sqrt()),
        UnaryOp::Tanh => {
            let t = x.tanh();
            1.0 - t * t
        }
        UnaryOp::Gelu => normal_cdf(x) + x * INV_SQRT_2PI * (-0.5 * x * x).exp(),
        UnaryOp::GeluTanh => {
            let t = (GELU_TANH_C * (x + 0.044715 * x * x * x)).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_TANH_C * (1.0 + 3.0 * 0.044715 * x * x)
        }
        UnaryOp::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        UnaryOp::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Sigmoid => {
            let s = sigmoid(x);
            s * (1.0 - s)
        }
        UnaryOp::Sin => x.cos(),
        UnaryOp::Cos => -x.sin(),
    }
}

pub(super) fn binary(b: BinaryOp, p: f64, q: f64) -> f64 {
    match b {
        BinaryOp::Add => p + q,
        BinaryOp::Sub => p - q,
        BinaryOp::Mul => p * q,
        BinaryOp::Div => p / q,
        // NaN propagates (f64::max would drop it).
        BinaryOp::Max => {
            if p >= q || p.is_nan() {
                p
            } else {
                q
            }
        }
        BinaryOp::Min => {
            if p <= q || p.is_nan() {
                p
            } else {
                q
            }
        }
    }
}

/// `f(a, b)` elementwise with NumPy broadcasting.
pub(super) fn broadcast_binary(
    a: &Value,
    b: &Value,
    f: impl Fn(f64, f64) -> f64,
) -> Result<Value, String> {
    if a.shape == b.shape {
        return Ok(zip(a, b, f));
    }
    let out = broadcast_shape(a.dims(), b.dims())?;
    let ia = broadcast_offsets(a.dims(), &out)?;
    let ib = broadcast_offsets(b.dims(), &out)?;
    let data = ia.iter().zip(&ib).map(|(&i, &j)| f(a.data[i], b.data[j])).collect();
    Ok(Value { shape: Shape::from(out), data })
}

pub(super) fn binary_backward(
    op: BinaryOp,
    wrt: u8,
    a: &Value,
    b: &Value,
    dy: &Value,
) -> Result<Value, String> {
    let out = broadcast_shape(a.dims(), b.dims())?;
    ensure!(dy.dims() == out.as_slice(), "dy {} must have the broadcast shape {out:?}", dy.shape);
    ensure!(wrt < 2, "wrt must be 0 or 1, got {wrt}");
    let ia = broadcast_offsets(a.dims(), &out)?;
    let ib = broadcast_offsets(b.dims(), &out)?;
    let grad = |p: f64, q: f64, g: f64| -> f64 {
        match (op, wrt) {
            (BinaryOp::Add, _) | (BinaryOp::Sub, 0) => g,
            (BinaryOp::Sub, _) => -g,
            (BinaryOp::Mul, 0) => g * q,
            (BinaryOp::Mul, _) => g * p,
            (BinaryOp::Div, 0) => g / q,
            (BinaryOp::Div, _) => -g * p / (q * q),
            (BinaryOp::Max, 0) => {
                if p >= q {
                    g
                } else {
                    0.0
                }
            }
            (BinaryOp::Max, _) => {
                if p >= q {
                    0.0
                } else {
                    g
                }
            }
            (BinaryOp::Min, 0) => {
                if p <= q {
                    g
                } else {
                    0.0
                }
            }
            (BinaryOp::Min, _) => {
                if p <= q {
                    0.0
                } else {
                    g
                }
            }
        }
    };
    let data = (0..dy.numel()).map(|k| grad(a.data[ia[k]], b.data[ib[k]], dy.data[k])).collect();
    Ok(Value { shape: Shape::from(out), data })
}

pub(super) fn cast(to: DType, x: f64) -> f64 {
    match to {
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 => x,
        DType::I32 | DType::I64 => x.trunc(),
        DType::U8 => x.trunc().clamp(0.0, 255.0),
        DType::Bool => {
            if x != 0.0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

pub(super) fn dropout(
    x: &Value,
    seed: &Value,
    p: f64,
    stream: u64,
    shard: Option<&crate::dist::ShardOf>,
) -> Result<Value, String> {
    ensure!(seed.numel() == 1, "seed must be a scalar, got {}", seed.shape);
    ensure!((0.0..1.0).contains(&p), "dropout probability {p} must be in [0, 1)");
    let seed = seed.data[0] as i64 as u64;
    let scale = 1.0 / (1.0 - p);
    // The interpreter is one device at the mesh origin (coordinate 0 on every axis).
    let dims = x.shape.dims().to_vec();
    let (base, strides) = match shard {
        Some(s) => s.index_map(None).map_err(|e| e.to_string())?,
        None => (0, crate::dist::row_major_strides(&dims)),
    };
    let local = crate::dist::row_major_strides(&dims);
    let data = x
        .data
        .iter()
        .enumerate()
        .map(|(k, &v)| {
            let g = crate::dist::global_index(k as u64, &local, base, &strides);
            if dropout_keep(seed, stream, g, p) {
                v * scale
            } else {
                0.0
            }
        })
        .collect();
    Ok(Value { shape: x.shape.clone(), data })
}

// ---- matmul ----------------------------------------------------------------------------------

/// Swaps the last two dims of every matrix of a `[.., r, c]` buffer.
pub(super) fn transpose_last2(data: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; data.len()];
    if r * c == 0 {
        return out;
    }
    for (src, dst) in data.chunks(r * c).zip(out.chunks_mut(r * c)) {
        for i in 0..r {
            for j in 0..c {
                dst[j * r + i] = src[i * c + j];
            }
        }
    }
    out
}

pub(super) fn matmul(a: &Value, b: &Value, ta: bool, tb: bool) -> Result<Value, String> {
    let (ad, bd) = (a.dims(), b.dims());
    ensure!(ad.len() >= 2 && bd.len() >= 2, "operands {} and {} need 2 dims", a.shape, b.shape);
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    ensure!(k == k2, "inner dims {k} vs {k2}");
    let (batch_a, batch_b) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
    let batch = broadcast_shape(batch_a, batch_b)?;
    // Canonical layouts: A as [.., m, k], B as [.., k, n], each matrix row-major.
    let a_c: Cow<'_, [f64]> =
        if ta { Cow::Owned(transpose_last2(&a.data, ar, ac)) } else { Cow::Borrowed(&a.data) };
    let b_c: Cow<'_, [f64]> =
        if tb { Cow::Owned(transpose_last2(&b.data, br, bc)) } else { Cow::Borrowed(&b.data) };
    let off_a = broadcast_offsets(batch_a, &batch)?;
    let off_b = broadcast_offsets(batch_b, &batch)?;
    let mut out = vec![0.0; numel(&batch) * m * n];
    if m * n > 0 {
        for ((&oa, &ob), c) in off_a.iter().zip(&off_b).zip(out.chunks_mut(m * n)) {
            let am = &a_c[oa * m * k..(oa + 1) * m * k];
            let bm = &b_c[ob * k * n..(ob + 1) * k * n];
            for i in 0..m {
                let crow = &mut c[i * n..(i + 1) * n];
                for p in 0..k {
                    axpy(crow, am[i * k + p], &bm[p * n..(p + 1) * n]);
                }
            }
        }
    }
    let mut dims = batch;
    dims.extend([m, n]);
    Ok(Value { shape: Shape::from(dims), data: out })
}

// ---- reductions ------------------------------------------------------------------------------

pub(super) fn check_reduce_dims(x: &Value, dims: &[usize]) -> Result<(), String> {
    for (i, &d) in dims.iter().enumerate() {
        check_dim(x.dims(), d)?;
        ensure!(!dims[..i].contains(&d), "reduce dim {d} given twice");
    }
    Ok(())
}

/// For every element of `x`, the flat index of the output element it reduces into.
pub(super) fn reduce_map(xd: &[usize], dims: &[usize]) -> Vec<usize> {
    let mut st = vec![0; xd.len()];
    let mut acc = 1;
    for i in (0..xd.len()).rev() {
        if !dims.contains(&i) {
            st[i] = acc;
            acc *= xd[i];
        }
    }
    strided_offsets(xd, &st)
}

/// For each output of a max-reduction, the flat index of its first maximal input (NaN wins).
pub(super) fn argmax(x: &Value, map: &[usize], n_out: usize) -> Vec<Option<usize>> {
    let mut best: Vec<Option<usize>> = vec![None; n_out];
    for (i, &o) in map.iter().enumerate() {
        let v = x.data[i];
        let better = match best[o] {
            None => true,
            Some(j) => {
                let b = x.data[j];
                !b.is_nan() && (v > b || v.is_nan())
            }
        };
        if better {
            best[o] = Some(i);
        }
    }
    best
}

pub(super) fn reduce(
    x: &Value,
    op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Value, String> {
    check_reduce_dims(x, dims)?;
    let shape = reduced_shape(&x.shape, dims, keepdim);
    let n_out = shape.numel() as usize;
    let map = reduce_map(x.dims(), dims);
    let count: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let mut out = vec![0.0; n_out];
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (&o, &v) in map.iter().zip(&x.data) {
                out[o] += v;
            }
            if op == ReduceOp::Mean {
                for v in &mut out {
                    *v /= count as f64;
                }
            }
        }
        ReduceOp::SumSquares => {
            for (&o, &v) in map.iter().zip(&x.data) {
                out[o] += v * v;
            }
        }
        ReduceOp::Max => {
            for (o, i) in argmax(x, &map, n_out).into_iter().enumerate() {
                out[o] = i.map_or(f64::NEG_INFINITY, |i| x.data[i]);
            }
        }
    }
    Ok(Value { shape, data: out })
}

pub(super) fn reduce_backward(
    x: &Value,
    dy: &Value,
    op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Value, String> {
    check_reduce_dims(x, dims)?;
    let shape = reduced_shape(&x.shape, dims, keepdim);
    ensure!(dy.shape == shape, "dy {} must have the reduced shape {shape}", dy.shape);
    let map = reduce_map(x.dims(), dims);
    let count: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let data = match op {
        ReduceOp::Sum => map.iter().map(|&o| dy.data[o]).collect(),
        ReduceOp::Mean => map.iter().map(|&o| dy.data[o] / count as f64).collect(),
        ReduceOp::SumSquares => {
            map.iter().zip(&x.data).map(|(&o, &v)| 2.0 * v * dy.data[o]).collect()
        }
        ReduceOp::Max => {
            let mut dx = vec![0.0; x.numel()];
            for (o, i) in argmax(x, &map, dy.numel()).into_iter().enumerate() {
                if let Some(i) = i {
                    dx[i] = dy.data[o];
                }
            }
            dx
        }
    };
    Ok(Value { shape: x.shape.clone(), data })
}

/// The size of the last dim (softmax, norms and losses work on its rows); rank 0 is an error.
pub(super) fn last_dim(x: &Value) -> Result<usize, String> {
    ensure!(x.shape.rank() > 0, "needs at least one dim, got {}", x.shape);
    Ok(x.shape.last())
}

pub(super) fn softmax(x: &Value) -> Result<Value, String> {
    let d = last_dim(x)?;
    let mut out = x.data.clone();
    if d > 0 {
        for row in out.chunks_mut(d) {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut s = 0.0;
            for v in row.iter_mut() {
                *v = (*v - m).exp();
                s += *v;
            }
            for v in row.iter_mut() {
                *v /= s;
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

pub(super) fn softmax_backward(y: &Value, dy: &Value) -> Result<Value, String> {
    ensure!(y.shape == dy.shape, "y {} and dy {} differ", y.shape, dy.shape);
    let d = last_dim(y)?;
    let mut out = vec![0.0; y.numel()];
    if d > 0 {
        for ((yr, gr), or) in y.data.chunks(d).zip(dy.data.chunks(d)).zip(out.chunks_mut(d)) {
            let s = dot(yr, gr);
            for ((o, &yv), &g) in or.iter_mut().zip(yr).zip(gr) {
                *o = yv * (g - s);
            }
        }
    }
    Ok(Value { shape: y.shape.clone(), data: out })
}

// ---- layout ----------------------------------------------------------------------------------

pub(super) fn permute(x: &Value, perm: &[usize]) -> Result<Value, String> {
    let xd = x.dims();
    let mut seen = vec![false; xd.len()];
    ensure!(
        perm.len() == xd.len()
            && perm.iter().all(|&p| p < xd.len() && !std::mem::replace(&mut seen[p], true)),
        "{perm:?} is not a permutation of {} dims",
        xd.len()
    );
    let st = strides(xd);
    let dims: Vec<usize> = perm.iter().map(|&p| xd[p]).collect();
    let gather: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let data = strided_offsets(&dims, &gather).into_iter().map(|i| x.data[i]).collect();
    Ok(Value { shape: Shape::from(dims), data })
}

pub(super) fn slice(x: &Value, dim: usize, start: usize, end: usize) -> Result<Value, String> {
    check_dim(x.dims(), dim)?;
    let (outer, size, inner) = split_at(x.dims(), dim);
    ensure!(start <= end && end <= size, "slice {start}..{end} out of range for size {size}");
    let mut data = Vec::with_capacity(outer * (end - start) * inner);
    for o in 0..outer {
        data.extend_from_slice(&x.data[(o * size + start) * inner..(o * size + end) * inner]);
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = end - start;
    Ok(Value { shape: Shape::from(dims), data })
}

pub(super) fn pad(x: &Value, dim: usize, before: usize, after: usize) -> Result<Value, String> {
    check_dim(x.dims(), dim)?;
    let (outer, size, inner) = split_at(x.dims(), dim);
    let total = before + size + after;
    let mut data = vec![0.0; outer * total * inner];
    for o in 0..outer {
        let dst = (o * total + before) * inner;
        data[dst..dst + size * inner]
            .copy_from_slice(&x.data[o * size * inner..(o + 1) * size * inner]);
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = total;
    Ok(Value { shape: Shape::from(dims), data })
}

pub(super) fn concat(xs: &[&Value], dim: usize) -> Result<Value, String> {
    let first = xs[0].dims();
    check_dim(first, dim)?;
    for v in xs {
        let d = v.dims();
        ensure!(
            d.len() == first.len() && (0..d.len()).all(|i| i == dim || d[i] == first[i]),
            "{} does not match {:?} outside dim {dim}",
            v.shape,
            first
        );
    }
    let (outer, _, inner) = split_at(first, dim);
    let total: usize = xs.iter().map(|v| v.dims()[dim]).sum();
    let mut data = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for v in xs {
            let chunk = v.dims()[dim] * inner;
            data.extend_from_slice(&v.data[o * chunk..(o + 1) * chunk]);
        }
    }
    let mut dims = first.to_vec();
    dims[dim] = total;
    Ok(Value { shape: Shape::from(dims), data })
}

pub(super) fn expand(x: &Value, to: &Shape) -> Result<Value, String> {
    let data = broadcast_offsets(x.dims(), to.dims())?.into_iter().map(|i| x.data[i]).collect();
    Ok(Value { shape: to.clone(), data })
}

// ---- normalisation ---------------------------------------------------------------------------

pub(super) fn check_affine(x: &Value, w: &Value, what: &str) -> Result<usize, String> {
    let d = last_dim(x)?;
    ensure!(w.dims() == [d], "{what} {} must be [{d}]", w.shape);
    Ok(d)
}

/// (mean, 1/sqrt(var + eps)) of one row, biased variance.
pub(super) fn row_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

pub(super) fn layer_norm(x: &Value, w: &Value, b: &Value, eps: f64) -> Result<Value, String> {
    let d = check_affine(x, w, "weight")?;
    check_affine(x, b, "bias")?;
    let mut out = vec![0.0; x.numel()];
    if d > 0 {
        for (xr, or) in x.data.chunks(d).zip(out.chunks_mut(d)) {
            let (mean, rstd) = row_stats(xr, eps);
            for i in 0..d {
                or[i] = (xr[i] - mean) * rstd * w.data[i] + b.data[i];
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

/// With x̂ = (x − mean)·rstd and g = dy·w: dx = rstd·(g − mean(g) − x̂·mean(g·x̂)),
/// dw = Σ_rows dy·x̂, db = Σ_rows dy.
pub(super) fn layer_norm_backward(
    x: &Value,
    w: &Value,
    dy: &Value,
    eps: f64,
) -> Result<Vec<Value>, String> {
    let d = check_affine(x, w, "weight")?;
    ensure!(dy.shape == x.shape, "dy {} must have x's shape {}", dy.shape, x.shape);
    let mut dx = vec![0.0; x.numel()];
    let mut dw = vec![0.0; d];
    let mut db = vec![0.0; d];
    if d > 0 {
        let mut xhat = vec![0.0; d];
        let mut g = vec![0.0; d];
        for ((xr, gr), dxr) in x.data.chunks(d).zip(dy.data.chunks(d)).zip(dx.chunks_mut(d)) {
            let (mean, rstd) = row_stats(xr, eps);
            for i in 0..d {
                xhat[i] = (xr[i] - mean) * rstd;
                g[i] = gr[i] * w.data[i];
                dw[i] += gr[i] * xhat[i];
                db[i] += gr[i];
            }
            let mean_g = g.iter().sum::<f64>() / d as f64;
            let mean_gx = dot(&g, &xhat) / d as f64;
            for i in 0..d {
                dxr[i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx);
            }
        }
    }
    Ok(vec![
        Value { shape: x.shape.clone(), data: dx },
        Value { shape: w.shape.clone(), data: dw },
        Value { shape: w.shape.clone(), data: db },
    ])
}

/// 1/sqrt(mean(x²) + eps) of one row.
pub(super) fn rms_rstd(row: &[f64], eps: f64) -> f64 {
    1.0 / (row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + eps).sqrt()
}

pub(super) fn rms_norm(x: &Value, w: &Value, eps: f64) -> Result<Value, String> {
    let d = check_affine(x, w, "weight")?;
    let mut out = vec![0.0; x.numel()];
    if d > 0 {
        for (xr, or) in x.data.chunks(d).zip(out.chunks_mut(d)) {
            let r = rms_rstd(xr, eps);
            for i in 0..d {
                or[i] = xr[i] * r * w.data[i];
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

/// With r = 1/sqrt(mean(x²) + eps) and g = dy·w: dx = r·g − x·r³·mean(g·x), dw = Σ_rows dy·x·r.
pub(super) fn rms_norm_backward(
    x: &Value,
    w: &Value,
    dy: &Value,
    eps: f64,
) -> Result<Vec<Value>, String> {
    let d = check_affine(x, w, "weight")?;
    ensure!(dy.shape == x.shape, "dy {} must have x's shape {}", dy.shape, x.shape);
    let mut dx = vec![0.0; x.numel()];
    let mut dw = vec![0.0; d];
    if d > 0 {
        let mut g = vec![0.0; d];
        for ((xr, gr), dxr) in x.data.chunks(d).zip(dy.data.chunks(d)).zip(dx.chunks_mut(d)) {
            let r = rms_rstd(xr, eps);
            for i in 0..d {
                g[i] = gr[i] * w.data[i];
                dw[i] += gr[i] * xr[i] * r;
            }
            let mean_gx = dot(&g, xr) / d as f64;
            for i in 0..d {
                dxr[i] = r * g[i] - xr[i] * r * r * r * mean_gx;
            }
        }
    }
    Ok(vec![Value { shape: x.shape.clone(), data: dx }, Value { shape: w.shape.clone(), data: dw }])
}

// ---- embedding and loss ----------------------------------------------------------------------
