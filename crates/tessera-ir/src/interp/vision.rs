//! The reference interpreter's vision kernels (NCHW): convolution and its two backward ops,
//! GroupNorm, max / average pooling and nearest upsampling, as plain loops in `f64`.
//!
//! The convolution and its backward ops share one loop nest, [`conv_taps`], which visits
//! every (input element, weight element, output element) triple of the product: the forward
//! accumulates `y += x·w`, the backward-data `dx += w·dy`, the backward-filter `dw += x·dy` —
//! adjoint by construction.

use super::Value;
use crate::{Conv2dSpec, Pool2dSpec, Shape};

fn dims4(v: &Value, what: &str) -> Result<[usize; 4], String> {
    match v.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        _ => Err(format!("{what} {} must be 4-D [N, C, H, W]", v.shape)),
    }
}

/// Input dims `[N, C, H, W]`, weight dims `[O, C/g, kh, kw]` and output dims
/// `[N, O, Ho, Wo]` of one convolution.
struct ConvGeom {
    x: [usize; 4],
    w: [usize; 4],
    y: [usize; 4],
}

impl ConvGeom {
    fn new(x: [usize; 4], w: [usize; 4], spec: &Conv2dSpec) -> Result<ConvGeom, String> {
        let g = spec.groups;
        ensure!(
            g > 0 && x[1] == w[1] * g && w[0].is_multiple_of(g),
            "x {x:?} and weight {w:?} do not fit groups {g}"
        );
        let [ho, wo] = spec.out_hw([x[2], x[3]], [w[2], w[3]])?;
        Ok(ConvGeom { x, w, y: [x[0], w[0], ho, wo] })
    }
}

/// Calls `f(x_index, w_index, y_index)` for every tap of the convolution that reads an
/// element inside the input (padding contributes zeros and is skipped).
fn conv_taps(g: &ConvGeom, spec: &Conv2dSpec, mut f: impl FnMut(usize, usize, usize)) {
    let [n, c, h, w] = g.x;
    let [o, cg, kh, kw] = g.w;
    let [_, _, ho, wo] = g.y;
    let og = o / spec.groups;
    for b in 0..n {
        for oc in 0..o {
            let group = oc / og;
            for oy in 0..ho {
                for ox in 0..wo {
                    let yi = ((b * o + oc) * ho + oy) * wo + ox;
                    for ci in 0..cg {
                        let ic = group * cg + ci;
                        for ky in 0..kh {
                            let iy = (oy * spec.stride[0] + ky * spec.dilation[0]) as isize
                                - spec.padding[0] as isize;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..kw {
                                let ix = (ox * spec.stride[1] + kx * spec.dilation[1]) as isize
                                    - spec.padding[1] as isize;
                                if ix < 0 || ix >= w as isize {
                                    continue;
                                }
                                let xi = ((b * c + ic) * h + iy as usize) * w + ix as usize;
                                let wi = ((oc * cg + ci) * kh + ky) * kw + kx;
                                f(xi, wi, yi);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn value4(d: [usize; 4], data: Vec<f64>) -> Value {
    Value { shape: Shape::from(d.to_vec()), data }
}

pub(super) fn conv2d(x: &Value, w: &Value, spec: &Conv2dSpec) -> Result<Value, String> {
    let g = ConvGeom::new(dims4(x, "x")?, dims4(w, "weight")?, spec)?;
    let mut y = vec![0.0; g.y.iter().product()];
    conv_taps(&g, spec, |xi, wi, yi| y[yi] += x.data[xi] * w.data[wi]);
    Ok(value4(g.y, y))
}

pub(super) fn conv2d_backward_input(
    w: &Value,
    dy: &Value,
    spec: &Conv2dSpec,
    input_hw: [usize; 2],
) -> Result<Value, String> {
    let (wd, yd) = (dims4(w, "weight")?, dims4(dy, "dy")?);
    let xd = [yd[0], wd[1] * spec.groups, input_hw[0], input_hw[1]];
    let g = ConvGeom::new(xd, wd, spec)?;
    ensure!(g.y == yd, "dy {} must be {:?}", dy.shape, g.y);
    let mut dx = vec![0.0; xd.iter().product()];
    conv_taps(&g, spec, |xi, wi, yi| dx[xi] += w.data[wi] * dy.data[yi]);
    Ok(value4(xd, dx))
}

pub(super) fn conv2d_backward_weight(
    x: &Value,
    dy: &Value,
    spec: &Conv2dSpec,
    kernel_hw: [usize; 2],
) -> Result<Value, String> {
    let (xd, yd) = (dims4(x, "x")?, dims4(dy, "dy")?);
    ensure!(
        spec.groups > 0 && xd[1].is_multiple_of(spec.groups),
        "x {} and groups differ",
        x.shape
    );
    let wd = [yd[1], xd[1] / spec.groups, kernel_hw[0], kernel_hw[1]];
    let g = ConvGeom::new(xd, wd, spec)?;
    ensure!(g.y == yd, "dy {} must be {:?}", dy.shape, g.y);
    let mut dw = vec![0.0; wd.iter().product()];
    conv_taps(&g, spec, |xi, wi, yi| dw[wi] += x.data[xi] * dy.data[yi]);
    Ok(value4(wd, dw))
}

// ---- group norm ----------------------------------------------------------------------------

/// (N, C, spatial size) of `x [N, C, ..]`, checking `w [C]` and the group count.
fn group_dims(x: &Value, w: &Value, groups: usize) -> Result<(usize, usize, usize), String> {
    let d = x.dims();
    ensure!(d.len() >= 2, "x {} must be [N, C, ..]", x.shape);
    let (n, c) = (d[0], d[1]);
    ensure!(
        groups > 0 && c.is_multiple_of(groups),
        "channels {c} not divisible by groups {groups}"
    );
    ensure!(w.dims() == [c], "weight {} must be [{c}]", w.shape);
    Ok((n, c, d[2..].iter().product()))
}

/// (mean, 1/sqrt(var + eps)) of a slice, biased variance.
fn stats(v: &[f64], eps: f64) -> (f64, f64) {
    let m = v.len() as f64;
    let mean = v.iter().sum::<f64>() / m;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / m;
    (mean, 1.0 / (var + eps).sqrt())
}

/// y = (x − mean_g)/sqrt(var_g + eps)·w[c] + b[c], statistics over each sample's group of
/// `C/groups` channels and all their positions.
pub(super) fn group_norm(
    x: &Value,
    w: &Value,
    b: &Value,
    groups: usize,
    eps: f64,
) -> Result<Value, String> {
    let (_, c, s) = group_dims(x, w, groups)?;
    ensure!(b.dims() == [c], "bias {} must be [{c}]", b.shape);
    let len = c / groups * s;
    let mut out = vec![0.0; x.numel()];
    if len > 0 {
        for (k, (xg, og)) in x.data.chunks(len).zip(out.chunks_mut(len)).enumerate() {
            let (mean, rstd) = stats(xg, eps);
            for (i, (o, v)) in og.iter_mut().zip(xg).enumerate() {
                let ch = (k % groups) * (c / groups) + i / s;
                *o = (v - mean) * rstd * w.data[ch] + b.data[ch];
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

/// Per group, with x̂ = (x − mean)·rstd and g = dy·w[c]: dx = rstd·(g − mean(g) −
/// x̂·mean(g·x̂)); dw[c] = Σ dy·x̂ and db[c] = Σ dy over samples and positions.
pub(super) fn group_norm_backward(
    x: &Value,
    w: &Value,
    dy: &Value,
    groups: usize,
    eps: f64,
) -> Result<Vec<Value>, String> {
    let (_, c, s) = group_dims(x, w, groups)?;
    ensure!(dy.shape == x.shape, "dy {} must have x's shape {}", dy.shape, x.shape);
    let len = c / groups * s;
    let mut dx = vec![0.0; x.numel()];
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    if len > 0 {
        let chunks = x.data.chunks(len).zip(dy.data.chunks(len)).zip(dx.chunks_mut(len));
        for (k, ((xg, gg), dxg)) in chunks.enumerate() {
            let (mean, rstd) = stats(xg, eps);
            let ch = |i: usize| (k % groups) * (c / groups) + i / s;
            let xhat: Vec<f64> = xg.iter().map(|v| (v - mean) * rstd).collect();
            let g: Vec<f64> = gg.iter().enumerate().map(|(i, d)| d * w.data[ch(i)]).collect();
            for i in 0..len {
                dw[ch(i)] += gg[i] * xhat[i];
                db[ch(i)] += gg[i];
            }
            let mean_g = g.iter().sum::<f64>() / len as f64;
            let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / len as f64;
            for i in 0..len {
                dxg[i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx);
            }
        }
    }
    Ok(vec![
        Value { shape: x.shape.clone(), data: dx },
        Value { shape: w.shape.clone(), data: dw },
        Value { shape: w.shape.clone(), data: db },
    ])
}

// ---- pooling -------------------------------------------------------------------------------

/// Calls `f(plane, out_index, in_indices)` for every output of a pooling over `[N, C, H, W]`,
/// with the flat indices of the window's elements inside the input, in row-major window order.
fn windows(x: [usize; 4], pool: &Pool2dSpec, mut f: impl FnMut(usize, &[usize])) -> [usize; 4] {
    let [n, c, h, w] = x;
    let [ho, wo] = pool.out_hw([h, w]).unwrap_or([0, 0]);
    let mut idx = Vec::with_capacity(pool.kernel[0] * pool.kernel[1]);
    for plane in 0..n * c {
        for oy in 0..ho {
            for ox in 0..wo {
                idx.clear();
                for ky in 0..pool.kernel[0] {
                    let iy = (oy * pool.stride[0] + ky) as isize - pool.padding[0] as isize;
                    for kx in 0..pool.kernel[1] {
                        let ix = (ox * pool.stride[1] + kx) as isize - pool.padding[1] as isize;
                        if iy >= 0 && iy < h as isize && ix >= 0 && ix < w as isize {
                            idx.push((plane * h + iy as usize) * w + ix as usize);
                        }
                    }
                }
                f((plane * ho + oy) * wo + ox, &idx);
            }
        }
    }
    [n, c, ho, wo]
}

fn check_pool(x: [usize; 4], pool: &Pool2dSpec) -> Result<(), String> {
    pool.out_hw([x[2], x[3]]).map(|_| ())
}

/// The window's first maximal element (a NaN, the first one, wins over numbers).
fn argmax(x: &[f64], idx: &[usize]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for &i in idx {
        best = match best {
            None => Some(i),
            Some(b) if x[b].is_nan() => Some(b),
            Some(b) if x[i] > x[b] || x[i].is_nan() => Some(i),
            keep => keep,
        };
    }
    best
}

pub(super) fn max_pool2d(x: &Value, pool: &Pool2dSpec) -> Result<Value, String> {
    let xd = dims4(x, "x")?;
    check_pool(xd, pool)?;
    let mut out = Vec::new();
    let yd = windows(xd, pool, |_, idx| {
        out.push(argmax(&x.data, idx).map_or(f64::NEG_INFINITY, |i| x.data[i]))
    });
    Ok(value4(yd, out))
}

pub(super) fn max_pool2d_backward(
    x: &Value,
    dy: &Value,
    pool: &Pool2dSpec,
) -> Result<Value, String> {
    let xd = dims4(x, "x")?;
    check_pool(xd, pool)?;
    let mut dx = vec![0.0; x.numel()];
    let mut count = 0;
    let yd = windows(xd, pool, |o, idx| {
        count += 1;
        if let (Some(i), Some(g)) = (argmax(&x.data, idx), dy.data.get(o)) {
            dx[i] += g;
        }
    });
    ensure!(dy.dims() == yd && count == dy.numel(), "dy {} must be {yd:?}", dy.shape);
    Ok(value4(xd, dx))
}

fn divisor(pool: &Pool2dSpec, count_include_pad: bool, in_window: usize) -> f64 {
    if count_include_pad {
        (pool.kernel[0] * pool.kernel[1]) as f64
    } else {
        in_window as f64
    }
}

pub(super) fn avg_pool2d(
    x: &Value,
    pool: &Pool2dSpec,
    count_include_pad: bool,
) -> Result<Value, String> {
    let xd = dims4(x, "x")?;
    check_pool(xd, pool)?;
    let mut out = Vec::new();
    let yd = windows(xd, pool, |_, idx| {
        let s: f64 = idx.iter().map(|&i| x.data[i]).sum();
        out.push(s / divisor(pool, count_include_pad, idx.len()));
    });
    Ok(value4(yd, out))
}

pub(super) fn avg_pool2d_backward(
    dy: &Value,
    pool: &Pool2dSpec,
    count_include_pad: bool,
    input_hw: [usize; 2],
) -> Result<Value, String> {
    let yd = dims4(dy, "dy")?;
    let xd = [yd[0], yd[1], input_hw[0], input_hw[1]];
    check_pool(xd, pool)?;
    let mut dx = vec![0.0; xd.iter().product()];
    let got = windows(xd, pool, |o, idx| {
        let g =
            dy.data.get(o).copied().unwrap_or(0.0) / divisor(pool, count_include_pad, idx.len());
        for &i in idx {
            dx[i] += g;
        }
    });
    ensure!(got == yd, "dy {} must be {got:?}", dy.shape);
    Ok(value4(xd, dx))
}

// ---- upsampling ----------------------------------------------------------------------------

pub(super) fn upsample2d(x: &Value, scale: [usize; 2]) -> Result<Value, String> {
    let [n, c, h, w] = dims4(x, "x")?;
    let (ho, wo) = (h * scale[0], w * scale[1]);
    let mut out = Vec::with_capacity(n * c * ho * wo);
    for plane in 0..n * c {
        for oy in 0..ho {
            for ox in 0..wo {
                out.push(x.data[(plane * h + oy / scale[0]) * w + ox / scale[1]]);
            }
        }
    }
    Ok(value4([n, c, ho, wo], out))
}

pub(super) fn upsample2d_backward(dy: &Value, scale: [usize; 2]) -> Result<Value, String> {
    let [n, c, ho, wo] = dims4(dy, "dy")?;
    ensure!(
        scale[0] > 0 && scale[1] > 0 && ho.is_multiple_of(scale[0]) && wo.is_multiple_of(scale[1]),
        "dy {} is not a multiple of the scale {scale:?}",
        dy.shape
    );
    let (h, w) = (ho / scale[0], wo / scale[1]);
    let mut dx = vec![0.0; n * c * h * w];
    for plane in 0..n * c {
        for oy in 0..ho {
            for ox in 0..wo {
                dx[(plane * h + oy / scale[0]) * w + ox / scale[1]] +=
                    dy.data[(plane * ho + oy) * wo + ox];
            }
        }
    }
    Ok(value4([n, c, h, w], dx))
}

#[cfg(test)]
mod tests {
    //! The reference itself against examples computed by hand.
    use super::super::eval_op;
    use super::*;
    use crate::Op;

    fn spec(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dSpec {
        Conv2dSpec { stride: [stride; 2], padding: [padding; 2], dilation: [dilation; 2], groups }
    }

    fn run(op: Op, x: &[&Value]) -> Vec<f64> {
        eval_op(&op, x).unwrap().remove(0).data
    }

    #[test]
    fn conv2d_by_hand() {
        // x = 1..9 as a 3×3 image, w = [[1, 2], [3, 4]].
        let x = Value::new([1, 1, 3, 3], (1..=9).map(f64::from).collect());
        let w = Value::new([1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        // y[i,j] = x[i,j] + 2x[i,j+1] + 3x[i+1,j] + 4x[i+1,j+1].
        assert_eq!(run(Op::Conv2d(spec(1, 0, 1, 1)), &[&x, &w]), vec![37.0, 47.0, 67.0, 77.0]);
        // Padding 1, stride 2: windows at rows/cols {-1, 0} and {1, 2}.
        assert_eq!(run(Op::Conv2d(spec(2, 1, 1, 1)), &[&x, &w]), vec![4.0, 18.0, 36.0, 77.0]);
        // Dilation 2: the four corners, 1 + 2·3 + 3·7 + 4·9.
        assert_eq!(run(Op::Conv2d(spec(1, 0, 2, 1)), &[&x, &w]), vec![64.0]);
        // Two groups of one channel: each output channel scales its own input channel.
        let x2 = Value::new([1, 2, 1, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let w2 = Value::new([2, 1, 1, 1], vec![10.0, 100.0]);
        assert_eq!(run(Op::Conv2d(spec(1, 0, 1, 2)), &[&x2, &w2]), vec![10.0, 20.0, 300.0, 400.0]);
    }

    #[test]
    fn conv2d_backward_by_hand() {
        let x = Value::new([1, 1, 3, 3], (1..=9).map(f64::from).collect());
        let w = Value::new([1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let dy = Value::full([1, 1, 2, 2], 1.0);
        // dx: the sum of the weights over every window covering each pixel.
        let op = Op::Conv2dBackwardInput { spec: spec(1, 0, 1, 1), input_hw: [3, 3] };
        assert_eq!(run(op, &[&w, &dy]), vec![1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 3.0, 7.0, 4.0]);
        // dw: the sum of each window position's pixels.
        let op = Op::Conv2dBackwardWeight { spec: spec(1, 0, 1, 1), kernel_hw: [2, 2] };
        assert_eq!(run(op, &[&x, &dy]), vec![12.0, 16.0, 24.0, 28.0]);
    }

    #[test]
    fn pooling_and_upsampling_by_hand() {
        let x = Value::new([1, 1, 3, 3], (1..=9).map(f64::from).collect());
        let pool = Pool2dSpec { kernel: [2, 2], stride: [1, 1], padding: [0, 0] };
        assert_eq!(run(Op::MaxPool2d(pool), &[&x]), vec![5.0, 6.0, 8.0, 9.0]);
        let avg = |count_include_pad| Op::AvgPool2d { pool, count_include_pad };
        assert_eq!(run(avg(true), &[&x]), vec![3.0, 4.0, 6.0, 7.0]);
        // Padding 1, stride 2: the corner windows hold one pixel each.
        let padded = Pool2dSpec { kernel: [2, 2], stride: [2, 2], padding: [1, 1] };
        let op = Op::AvgPool2d { pool: padded, count_include_pad: false };
        assert_eq!(run(op, &[&x]), vec![1.0, 2.5, 5.5, 7.0]);
        let op = Op::AvgPool2d { pool: padded, count_include_pad: true };
        assert_eq!(run(op, &[&x]), vec![0.25, 1.25, 2.75, 7.0]);
        // Ties: the gradient goes to the first maximum in row-major window order only.
        let flat = Value::full([1, 1, 2, 2], 1.0);
        let whole = Pool2dSpec { kernel: [2, 2], stride: [2, 2], padding: [0, 0] };
        let dy = Value::full([1, 1, 1, 1], 1.0);
        assert_eq!(run(Op::MaxPool2dBackward(whole), &[&flat, &dy]), vec![1.0, 0.0, 0.0, 0.0]);
        // Upsampling repeats pixels; its backward sums the blocks.
        let s = Value::new([1, 1, 1, 2], vec![1.0, 2.0]);
        let up = run(Op::Upsample2d { scale: [2, 2] }, &[&s]);
        assert_eq!(up, vec![1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]);
        let dy = Value::new([1, 1, 2, 4], (1..=8).map(f64::from).collect());
        let dx = run(Op::Upsample2dBackward { scale: [2, 2] }, &[&dy]);
        assert_eq!(dx, vec![1.0 + 2.0 + 5.0 + 6.0, 3.0 + 4.0 + 7.0 + 8.0]);
    }

    #[test]
    fn group_norm_by_hand() {
        // Two groups of one channel, two pixels each: [1, 3] and [10, 30] normalise to ±1
        // (up to eps); weight 2 and bias 1 on channel 0, weight 1 and bias 0 on channel 1.
        let x = Value::new([1, 2, 1, 2], vec![1.0, 3.0, 10.0, 30.0]);
        let w = Value::new([2], vec![2.0, 1.0]);
        let b = Value::new([2], vec![1.0, 0.0]);
        let y = run(Op::GroupNorm { groups: 2, eps: 0.0 }, &[&x, &w, &b]);
        assert_eq!(y, vec![-1.0, 3.0, -1.0, 1.0]);
        // One group: mean 11, biased variance ((10² + 8² + 1² + 19²)/4 = 131.5).
        let y = run(Op::GroupNorm { groups: 1, eps: 0.0 }, &[&x, &w, &b]);
        let r = 1.0 / 131.5f64.sqrt();
        let want = [-10.0 * r * 2.0 + 1.0, -8.0 * r * 2.0 + 1.0, -r, 19.0 * r];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{y:?} vs {want:?}");
        }
    }
}
