//! Vision and diffusion ops on NCHW tensors (PyTorch / ONNX layout): 2-D convolution,
//! GroupNorm, max and average pooling, nearest-neighbour upsampling — shape inference, FLOPs,
//! workspace and VJPs.
//!
//! - `Conv2d` has no bias (an importer adds one as a broadcast `Binary` add). Its VJP is two
//!   ops: the backward-data op `Conv2dBackwardInput` (inputs `[w, dy]`, the input's spatial
//!   size carried in the op, so `x` itself need not be kept for it) and the backward-filter op
//!   `Conv2dBackwardWeight` (inputs `[x, dy]`, the kernel size carried in the op). Forward and
//!   both backward ops count `2·N·O·Ho·Wo·(C/g)·kh·kw` matmul FLOPs; a CPU kernel lowers them to
//!   GEMMs over an im2col buffer of at most [`CONV_IMAGES_PER_CHUNK`] images, its declared
//!   workspace.
//! - `GroupNorm` normalises each group of `C/groups` channels (and every spatial position) of
//!   each sample, biased variance, then applies a per-channel affine; like `LayerNorm` its
//!   backward recomputes the statistics from `x` (the forward saves only its inputs).
//! - `MaxPool2d` saves its input; its backward recomputes each window's argmax (the first
//!   maximum in row-major window order on ties, as PyTorch) and routes the gradient there.
//!   `AvgPool2d` and `Upsample2d` save nothing: their backward ops read only `dy`.
//! - Padding is symmetric (`padding[i]` on both sides of spatial dim `i`); pooling uses floor
//!   division for the output size (PyTorch's `ceil_mode=False`) and requires
//!   `padding ≤ kernel/2` (PyTorch's rule: no window lies wholly in the padding).

use super::{expect_float, expect_inputs, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};
use serde::{Deserialize, Serialize};

/// Images whose im2col columns a CPU convolution kernel holds at once (its workspace).
pub const CONV_IMAGES_PER_CHUNK: usize = 4;

/// Geometry of a 2-D convolution, as PyTorch's `nn.Conv2d` (symmetric zero padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Conv2dSpec {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    /// Channel groups: input channels C and output channels O both divisible by it; the
    /// weight is `[O, C/groups, kh, kw]`.
    pub groups: usize,
}

impl Default for Conv2dSpec {
    fn default() -> Conv2dSpec {
        Conv2dSpec { stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

impl Conv2dSpec {
    /// Whether a kernel of this size reads the input as its own im2col columns (1×1, stride 1,
    /// no padding): no column buffer, no workspace.
    pub fn is_pointwise(&self, kernel_hw: [usize; 2]) -> bool {
        kernel_hw == [1, 1] && self.stride == [1, 1] && self.padding == [0, 0]
    }

    /// Output spatial size `(H + 2p − d·(k − 1) − 1)/s + 1` per dim, or why there is none.
    pub fn out_hw(&self, in_hw: [usize; 2], kernel_hw: [usize; 2]) -> Result<[usize; 2], String> {
        let mut out = [0; 2];
        for i in 0..2 {
            if self.stride[i] == 0 || self.dilation[i] == 0 || kernel_hw[i] == 0 {
                return Err(format!(
                    "stride {:?}, dilation {:?} and kernel {:?} must be positive",
                    self.stride, self.dilation, kernel_hw
                ));
            }
            let padded = in_hw[i] + 2 * self.padding[i];
            let span = self.dilation[i] * (kernel_hw[i] - 1) + 1;
            if span > padded {
                return Err(format!(
                    "the dilated kernel {kernel_hw:?} (spans {span}) is larger than the padded \
                     input {in_hw:?} + 2·{:?} in spatial dim {i}",
                    self.padding
                ));
            }
            out[i] = (padded - span) / self.stride[i] + 1;
        }
        Ok(out)
    }
}

/// Window geometry of a 2-D pooling op (symmetric zero padding, floor division).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pool2dSpec {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Pool2dSpec {
    /// Output spatial size `(H + 2p − k)/s + 1` per dim, or why there is none.
    pub fn out_hw(&self, in_hw: [usize; 2]) -> Result<[usize; 2], String> {
        let mut out = [0; 2];
        for i in 0..2 {
            let (k, s, p) = (self.kernel[i], self.stride[i], self.padding[i]);
            if k == 0 || s == 0 {
                return Err(format!(
                    "kernel {:?} and stride {:?} must be positive",
                    self.kernel, self.stride
                ));
            }
            if 2 * p > k {
                return Err(format!(
                    "padding {:?} must be at most half the kernel {:?} (no window may lie wholly \
                     in the padding)",
                    self.padding, self.kernel
                ));
            }
            if k > in_hw[i] + 2 * p {
                return Err(format!(
                    "the kernel {:?} is larger than the padded input {in_hw:?} + 2·{:?} in \
                     spatial dim {i}",
                    self.kernel, self.padding
                ));
            }
            out[i] = (in_hw[i] + 2 * p - k) / s + 1;
        }
        Ok(out)
    }
}

/// `[N, C, H, W]` of a 4-D operand.
fn nchw(m: &TensorMeta, what: &str) -> Result<[usize; 4], String> {
    match m.shape.dims() {
        &[n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(format!("{what} {m} must be 4-D [N, C, H, W]")),
    }
}

fn meta4(d: [usize; 4], dtype: DType) -> TensorMeta {
    TensorMeta { shape: Shape::from(d.to_vec()), dtype }
}

fn same_dtype(a: &TensorMeta, b: &TensorMeta, what: &str) -> Result<(), String> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(format!("{what}: dtypes differ ({} vs {})", a.dtype, b.dtype))
    }
}

/// Checks `w [O, C/g, kh, kw]` against `C` input channels; returns `(O, [kh, kw])`.
fn check_weight(
    w: &TensorMeta,
    c: usize,
    spec: &Conv2dSpec,
) -> Result<(usize, [usize; 2]), String> {
    let [o, cg, kh, kw] = nchw(w, "weight").map_err(|_| {
        format!("weight {w} must be 4-D [out_channels, in_channels/groups, kh, kw]")
    })?;
    let g = spec.groups;
    if g == 0 {
        return Err("groups must be positive".into());
    }
    if !c.is_multiple_of(g) {
        return Err(format!("input channels {c} are not divisible by groups {g}"));
    }
    if !o.is_multiple_of(g) {
        return Err(format!("output channels {o} (weight dim 0) are not divisible by groups {g}"));
    }
    if cg != c / g {
        return Err(format!("weight {w} dim 1 must be in_channels/groups = {c}/{g} = {}", c / g));
    }
    Ok((o, [kh, kw]))
}

// ---- convolution ---------------------------------------------------------------------------

pub(crate) fn infer_conv(x: &[&TensorMeta], spec: &Conv2dSpec) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "x")?;
    same_dtype(x[0], x[1], "conv2d x and weight")?;
    let [n, c, h, w] = nchw(x[0], "x")?;
    let (o, k) = check_weight(x[1], c, spec)?;
    let [ho, wo] = spec.out_hw([h, w], k)?;
    Ok(vec![meta4([n, o, ho, wo], x[0].dtype)])
}

pub(crate) fn infer_conv_backward_input(
    x: &[&TensorMeta],
    spec: &Conv2dSpec,
    input_hw: [usize; 2],
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[1], "dy")?;
    let [o, cg, kh, kw] = nchw(x[0], "weight")?;
    let [n, od, ho, wo] = nchw(x[1], "dy")?;
    let c = cg * spec.groups;
    check_weight(x[0], c, spec)?;
    if od != o {
        return Err(format!("dy {} has {od} channels, the weight {} has {o} outputs", x[1], x[0]));
    }
    let want = spec.out_hw(input_hw, [kh, kw])?;
    if want != [ho, wo] {
        return Err(format!(
            "dy {} must have the forward's output size {want:?} for an input of {input_hw:?}",
            x[1]
        ));
    }
    Ok(vec![meta4([n, c, input_hw[0], input_hw[1]], x[1].dtype)])
}

pub(crate) fn infer_conv_backward_weight(
    x: &[&TensorMeta],
    spec: &Conv2dSpec,
    kernel_hw: [usize; 2],
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "x")?;
    let [n, c, h, w] = nchw(x[0], "x")?;
    let [nd, o, ho, wo] = nchw(x[1], "dy")?;
    let g = spec.groups;
    if g == 0 || !c.is_multiple_of(g) || !o.is_multiple_of(g) {
        return Err(format!("channels {c} (in) and {o} (out) must be divisible by groups {g}"));
    }
    let want = spec.out_hw([h, w], kernel_hw)?;
    if nd != n || want != [ho, wo] {
        return Err(format!(
            "dy {} must be [{n}, O, {}, {}] for x {} and kernel {kernel_hw:?}",
            x[1], want[0], want[1], x[0]
        ));
    }
    Ok(vec![meta4([o, c / g, kernel_hw[0], kernel_hw[1]], x[1].dtype)])
}

/// `2·N·O·Ho·Wo·(C/g)·kh·kw` from the output (or dy) `[N, O, Ho, Wo]` and the weight.
fn conv_macs2(y: &TensorMeta, w: &TensorMeta) -> Flops {
    let inner: u64 = w.shape.dims()[1..].iter().map(|&d| d as u64).product();
    Flops { matmul: 2 * y.numel() * inner, other: 0 }
}

pub(crate) fn flops_conv(x: &[&TensorMeta], y: &[&TensorMeta]) -> Flops {
    conv_macs2(y[0], x[1])
}
pub(crate) fn flops_conv_backward_input(x: &[&TensorMeta]) -> Flops {
    conv_macs2(x[1], x[0])
}
pub(crate) fn flops_conv_backward_weight(x: &[&TensorMeta], y: &[&TensorMeta]) -> Flops {
    conv_macs2(x[1], y[0])
}

/// The im2col columns of [`CONV_IMAGES_PER_CHUNK`] images in f32: `(C·kh·kw)·(Ho·Wo)` each
/// (none for a pointwise kernel, which reads `x` in place).
fn im2col_bytes(spec: &Conv2dSpec, n: usize, c: usize, k: [usize; 2], out_hw: [usize; 2]) -> u64 {
    if spec.is_pointwise(k) {
        return 0;
    }
    let images = n.min(CONV_IMAGES_PER_CHUNK) as u64;
    images * (c * k[0] * k[1]) as u64 * (out_hw[0] * out_hw[1]) as u64 * DType::F32.size_bytes()
}

/// Forward: `x [N,C,H,W]`, `w [O,C/g,kh,kw]`.
pub(crate) fn workspace_conv(x: &[&TensorMeta], spec: &Conv2dSpec) -> u64 {
    let (xd, wd) = (x[0].shape.dims(), x[1].shape.dims());
    let k = [wd[2], wd[3]];
    let out_hw = spec.out_hw([xd[2], xd[3]], k).unwrap_or([0, 0]);
    im2col_bytes(spec, xd[0], xd[1], k, out_hw)
}

/// Backward-data: `w [O,C/g,kh,kw]`, `dy [N,O,Ho,Wo]`.
pub(crate) fn workspace_conv_backward_input(x: &[&TensorMeta], spec: &Conv2dSpec) -> u64 {
    let (wd, dd) = (x[0].shape.dims(), x[1].shape.dims());
    im2col_bytes(spec, dd[0], wd[1] * spec.groups, [wd[2], wd[3]], [dd[2], dd[3]])
}

/// Backward-filter: `x [N,C,H,W]`, `dy [N,O,Ho,Wo]`.
pub(crate) fn workspace_conv_backward_weight(
    x: &[&TensorMeta],
    spec: &Conv2dSpec,
    kernel_hw: [usize; 2],
) -> u64 {
    let (xd, dd) = (x[0].shape.dims(), x[1].shape.dims());
    im2col_bytes(spec, xd[0], xd[1], kernel_hw, [dd[2], dd[3]])
}

/// dx = Conv2dBackwardInput(w, dy), dw = Conv2dBackwardWeight(x, dy).
pub(crate) fn vjp_conv(cx: &mut VjpCtx<'_>, spec: &Conv2dSpec) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let (x, w) = (cx.x(0), cx.x(1));
    let xd = cx.b.graph.shape(x).dims().to_vec();
    let wd = cx.b.graph.shape(w).dims().to_vec();
    let mut grads = vec![None, None];
    if cx.needs[0] {
        let op = Op::Conv2dBackwardInput { spec: *spec, input_hw: [xd[2], xd[3]] };
        grads[0] = Some(Grad::Full(cx.b.push1(op, &[w, dy])?));
    }
    if cx.needs[1] {
        let op = Op::Conv2dBackwardWeight { spec: *spec, kernel_hw: [wd[2], wd[3]] };
        grads[1] = Some(Grad::Full(cx.b.push1(op, &[x, dy])?));
    }
    Ok(grads)
}

// ---- group norm ----------------------------------------------------------------------------

/// Checks `x [N, C, ..]` and a per-channel `[C]` tensor.
fn check_group_affine(
    x: &TensorMeta,
    w: &TensorMeta,
    groups: usize,
    what: &str,
) -> Result<(), String> {
    expect_float(x, "x")?;
    if x.shape.rank() < 2 {
        return Err(format!("x {x} must be [N, C, ..] (at least 2-D)"));
    }
    let c = x.shape.dim(1);
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(format!("channels {c} of x {x} are not divisible by groups {groups}"));
    }
    if w.shape.dims() != [c] {
        return Err(format!("{what} {w} must be [{c}] (one per channel of x {x})"));
    }
    Ok(())
}

pub(crate) fn infer_group_norm(
    x: &[&TensorMeta],
    groups: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_group_affine(x[0], x[1], groups, "weight")?;
    check_group_affine(x[0], x[2], groups, "bias")?;
    Ok(vec![x[0].clone()])
}

pub(crate) fn infer_group_norm_backward(
    x: &[&TensorMeta],
    groups: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_group_affine(x[0], x[1], groups, "weight")?;
    if x[2].shape != x[0].shape {
        return Err(format!("dy {} must have x's shape {}", x[2], x[0].shape));
    }
    let w = TensorMeta { shape: x[1].shape.clone(), dtype: x[1].dtype };
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: x[2].dtype }, w.clone(), w])
}

/// As LayerNorm: mean, centre, square, variance, normalise, scale, shift.
pub(crate) fn flops_group_norm(x: &[&TensorMeta]) -> Flops {
    Flops::other(8 * x[0].numel())
}
pub(crate) fn flops_group_norm_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(14 * x[0].numel())
}

pub(crate) fn vjp_group_norm(
    cx: &mut VjpCtx<'_>,
    groups: usize,
    eps: f64,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let g = cx.b.push(Op::GroupNormBackward { groups, eps }, &[cx.x(0), cx.x(1), dy])?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}

// ---- pooling -------------------------------------------------------------------------------

pub(crate) fn infer_pool(x: &[&TensorMeta], pool: &Pool2dSpec) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "x")?;
    let [n, c, h, w] = nchw(x[0], "x")?;
    let [ho, wo] = pool.out_hw([h, w])?;
    Ok(vec![meta4([n, c, ho, wo], x[0].dtype)])
}

/// Checks `dy` against the pooled size of an `[N, C, input_hw]` input; returns dx's meta.
fn pool_grad(
    dy: &TensorMeta,
    pool: &Pool2dSpec,
    input_hw: [usize; 2],
) -> Result<TensorMeta, String> {
    expect_float(dy, "dy")?;
    let [n, c, ho, wo] = nchw(dy, "dy")?;
    let want = pool.out_hw(input_hw)?;
    if want != [ho, wo] {
        return Err(format!(
            "dy {dy} must have the pooled size {want:?} of an input of {input_hw:?}"
        ));
    }
    Ok(meta4([n, c, input_hw[0], input_hw[1]], dy.dtype))
}

/// Inputs `[x, dy]`.
pub(crate) fn infer_max_pool_backward(
    x: &[&TensorMeta],
    pool: &Pool2dSpec,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    let [n, c, h, w] = nchw(x[0], "x")?;
    let dx = pool_grad(x[1], pool, [h, w])?;
    if dx.shape.dims()[..2] != [n, c] {
        return Err(format!("dy {} must share N and C with x {}", x[1], x[0]));
    }
    Ok(vec![dx])
}

/// Inputs `[dy]`.
pub(crate) fn infer_avg_pool_backward(
    x: &[&TensorMeta],
    pool: &Pool2dSpec,
    input_hw: [usize; 2],
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    Ok(vec![pool_grad(x[0], pool, input_hw)?])
}

/// One comparison or add per window element of every output.
pub(crate) fn flops_pool(y: &TensorMeta, pool: &Pool2dSpec) -> Flops {
    Flops::other(y.numel() * (pool.kernel[0] * pool.kernel[1]) as u64)
}

pub(crate) fn vjp_max_pool(cx: &mut VjpCtx<'_>, pool: &Pool2dSpec) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let dx = cx.b.push1(Op::MaxPool2dBackward(*pool), &[cx.x(0), dy])?;
    Ok(vec![Some(Grad::Full(dx))])
}

pub(crate) fn vjp_avg_pool(
    cx: &mut VjpCtx<'_>,
    pool: &Pool2dSpec,
    count_include_pad: bool,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let d = cx.b.graph.shape(cx.x(0)).dims().to_vec();
    let op = Op::AvgPool2dBackward { pool: *pool, count_include_pad, input_hw: [d[2], d[3]] };
    Ok(vec![Some(Grad::Full(cx.b.push1(op, &[dy])?))])
}

// ---- upsampling ----------------------------------------------------------------------------

pub(crate) fn infer_upsample(
    x: &[&TensorMeta],
    scale: [usize; 2],
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "x")?;
    let [n, c, h, w] = nchw(x[0], "x")?;
    if scale[0] == 0 || scale[1] == 0 {
        return Err(format!("scale factors {scale:?} must be positive integers"));
    }
    Ok(vec![meta4([n, c, h * scale[0], w * scale[1]], x[0].dtype)])
}

pub(crate) fn infer_upsample_backward(
    x: &[&TensorMeta],
    scale: [usize; 2],
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "dy")?;
    let [n, c, h, w] = nchw(x[0], "dy")?;
    if scale[0] == 0 || scale[1] == 0 || !h.is_multiple_of(scale[0]) || !w.is_multiple_of(scale[1])
    {
        return Err(format!(
            "dy {} spatial size must be a multiple of the scale factors {scale:?}",
            x[0]
        ));
    }
    Ok(vec![meta4([n, c, h / scale[0], w / scale[1]], x[0].dtype)])
}

/// One add per element of dy.
pub(crate) fn flops_upsample_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(x[0].numel())
}

pub(crate) fn vjp_upsample(cx: &mut VjpCtx<'_>, scale: [usize; 2]) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    Ok(vec![Some(Grad::Full(cx.b.push1(Op::Upsample2dBackward { scale }, &[dy])?))])
}
