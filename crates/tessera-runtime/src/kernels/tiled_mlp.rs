//! The tiled MLP ([`tessera_ir::Op::TiledMlp`]) on the CPU, composed from the matmul and
//! elementwise kernels chunk by chunk: each chunk's `[c, F]` intermediates are made, used and
//! dropped before the next chunk starts, never more of them alive at once than the op's
//! declared workspace counts (forward: the up projection(s) and the product; backward: those
//! and the gradients between them). The weights' gradients are accumulated by the GEMM in
//! place, chunk after chunk in a fixed order (deterministic); `dx` and `y` are written a
//! chunk of rows at a time.

use super::elementwise::{binary, expect_f32, unary, unary_backward};
use super::matmul::{all_threads, gemm_f32, matmul, MatMut, MatRef};
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use tessera_ir::ops::{BinaryOp, MlpSpec};
use tessera_ir::{DType, Shape, TensorMeta};

const OP: &str = "tiled_mlp";

fn meta(rows: usize, cols: usize) -> TensorMeta {
    TensorMeta::new(Shape::from(vec![rows, cols]), DType::F32)
}

/// `(rows, D, F)` of `[x, weights..]`, every operand f32.
fn dims(x: &[&Tensor], spec: &MlpSpec) -> Result<(usize, usize, usize)> {
    if x.len() < spec.num_inputs() {
        return Err(RuntimeError::Binding(format!(
            "{OP}: expects {} inputs, got {}",
            spec.num_inputs(),
            x.len()
        )));
    }
    for t in &x[..spec.num_inputs()] {
        expect_f32(t, OP, "operand")?;
    }
    let d = x[0].dims().last().copied().unwrap_or(0);
    let f = x[1].dims().get(spec.ffn_dim_of_up()).copied().unwrap_or(0);
    Ok((x[0].elem_count() / d.max(1), d, f))
}

/// `input · W` in the layout's terms, `[c, out]`.
fn proj(spec: &MlpSpec, input: &Tensor, w: &Tensor, out: usize) -> Result<Tensor> {
    matmul(input, w, false, !spec.conv1d, &meta(input.dims()[0], out))
}

/// `grad · Wᵀ` in the layout's terms (the gradient reaching a projection's input).
fn proj_back(spec: &MlpSpec, grad: &Tensor, w: &Tensor, out: usize) -> Result<Tensor> {
    matmul(grad, w, false, spec.conv1d, &meta(grad.dims()[0], out))
}

/// `dw (+)=` the weight gradient of a projection from its input `[c, in]` and the gradient of
/// its output `[c, out]`, in the weight's stored layout.
fn weight_grad(
    spec: &MlpSpec,
    dw: &mut [f32],
    input: &Tensor,
    grad: &Tensor,
    accumulate: bool,
) -> Result<()> {
    let (c, p, q) = (input.dims()[0], input.dims()[1], grad.dims()[1]);
    let (xi, gi) = (read::<f32>(input)?, read::<f32>(grad)?);
    let im = MatRef { ptr: xi.as_ptr(), rs: p as isize, cs: 1 };
    let gm = MatRef { ptr: gi.as_ptr(), rs: q as isize, cs: 1 };
    // Conv1D `[in, out]` = inputᵀ·grad; nn.Linear `[out, in]` = gradᵀ·input.
    let (m, n, lhs, rhs) = if spec.conv1d { (p, q, im.t(), gm) } else { (q, p, gm.t(), im) };
    if dw.len() != m * n {
        return Err(RuntimeError::Binding(format!("{OP}: a weight gradient of {m}×{n}")));
    }
    let dst = MatMut { ptr: dw.as_mut_ptr(), rs: n as isize, cs: 1 };
    // SAFETY: input holds c·p elements, grad c·q, dw m·n (checked); dw is exclusively borrowed
    // and overlaps neither operand.
    unsafe { gemm_f32(m, n, c, dst, accumulate, lhs, rhs, 1.0, all_threads()) };
    Ok(())
}

/// Rows `r0..r1` of `[rows, d]` `x` as a contiguous `[r1 − r0, d]` tensor.
fn chunk(x: &Tensor, r0: usize, r1: usize) -> Result<Tensor> {
    contiguous(&x.narrow(0, r0, r1 - r0)?)
}

/// The chunk's up projection with its bias: `h`.
fn up(spec: &MlpSpec, x: &[&Tensor], xc: &Tensor, f: usize) -> Result<Tensor> {
    let h = proj(spec, xc, x[1], f)?;
    match spec.bias_at() {
        Some(b) => binary(BinaryOp::Add, &h, x[b], &meta(xc.dims()[0], f)),
        None => Ok(h),
    }
}

/// `y`, a chunk of rows at a time.
pub fn tiled_mlp(x: &[&Tensor], spec: &MlpSpec) -> Result<Tensor> {
    let (n, d, f) = dims(x, spec)?;
    let xs = contiguous(x[0])?.reshape((n, d))?;
    let mut y = Vec::with_capacity(n * d);
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + spec.chunk_rows.max(1)).min(n);
        let xc = chunk(&xs, r0, r1)?;
        let a = unary(spec.act, &up(spec, x, &xc, f)?)?;
        let g = match spec.up() {
            Some(i) => binary(BinaryOp::Mul, &a, &proj(spec, &xc, x[i], f)?, &meta(r1 - r0, f))?,
            None => a,
        };
        let yc = proj(spec, &g, x[spec.down()], d)?;
        y.extend_from_slice(&read::<f32>(&yc)?);
        r0 = r1;
    }
    from_vec(y, x[0].dims())
}

/// The gradient of each forward input from `[x, weights.., dy]`, each chunk recomputed.
pub fn tiled_mlp_backward(x: &[&Tensor], spec: &MlpSpec) -> Result<Vec<Tensor>> {
    let k = spec.num_inputs();
    let (n, d, f) = dims(x, spec)?;
    expect_f32(x[k], OP, "dy")?;
    if x[k].dims() != x[0].dims() {
        return Err(RuntimeError::Binding(format!("{OP}: dy must have x's shape")));
    }
    let xs = contiguous(x[0])?.reshape((n, d))?;
    let dys = contiguous(x[k])?.reshape((n, d))?;
    let mut dx = Vec::with_capacity(n * d);
    let mut dws: Vec<Vec<f32>> = x[1..k].iter().map(|w| vec![0f32; w.elem_count()]).collect();
    let down = spec.down();
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + spec.chunk_rows.max(1)).min(n);
        let (c, acc) = (r1 - r0, r0 > 0);
        let (xc, dyc) = (chunk(&xs, r0, r1)?, chunk(&dys, r0, r1)?);
        let h = up(spec, x, &xc, f)?;
        let a = unary(spec.act, &h)?;
        let dg = proj_back(spec, &dyc, x[down], f)?;
        let (dh, dx_up) = match spec.up() {
            Some(i) => {
                let u = proj(spec, &xc, x[i], f)?;
                let g = binary(BinaryOp::Mul, &a, &u, &meta(c, f))?;
                weight_grad(spec, &mut dws[down - 1], &g, &dyc, acc)?;
                drop(g);
                let du = binary(BinaryOp::Mul, &dg, &a, &meta(c, f))?;
                drop(a);
                weight_grad(spec, &mut dws[i - 1], &xc, &du, acc)?;
                let da = binary(BinaryOp::Mul, &dg, &u, &meta(c, f))?;
                drop((u, dg));
                let dh = unary_backward(spec.act, &h, &da)?;
                (dh, Some(proj_back(spec, &du, x[i], d)?))
            }
            None => {
                weight_grad(spec, &mut dws[down - 1], &a, &dyc, acc)?;
                drop(a);
                (unary_backward(spec.act, &h, &dg)?, None)
            }
        };
        drop(h);
        weight_grad(spec, &mut dws[0], &xc, &dh, acc)?;
        if let Some(b) = spec.bias_at() {
            let db = &mut dws[b - 1];
            for row in read::<f32>(&dh)?.chunks(f.max(1)) {
                for (o, v) in db.iter_mut().zip(row) {
                    *o += v;
                }
            }
        }
        let gx = proj_back(spec, &dh, x[1], d)?;
        let dxc = match dx_up {
            Some(t) => binary(BinaryOp::Add, &t, &gx, &meta(c, d))?,
            None => gx,
        };
        dx.extend_from_slice(&read::<f32>(&dxc)?);
        r0 = r1;
    }
    let mut out = vec![from_vec(dx, x[0].dims())?];
    for (w, g) in x[1..k].iter().zip(dws) {
        out.push(from_vec(g, w.dims())?);
    }
    Ok(out)
}
