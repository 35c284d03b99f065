//! Reference semantics of the tiled MLP ([`crate::Op::TiledMlp`]): chunk by chunk, the
//! reference matmuls and elementwise rules of the unfused ops it replaces, so the fused op
//! equals them by construction here and the kernels are tested against it.

use super::kernels::{matmul, unary, unary_derivative, zip};
use super::Value;
use crate::ops::MlpSpec;
use crate::Shape;

/// `input · W` as the layout stores `W` (`[out, in]`, or `[in, out]` for `Conv1D`).
fn proj(spec: &MlpSpec, input: &Value, w: &Value) -> Result<Value, String> {
    matmul(input, w, false, !spec.conv1d)
}

/// The gradient reaching a projection's input: `grad · Wᵀ` in the layout's terms.
fn proj_back(spec: &MlpSpec, grad: &Value, w: &Value) -> Result<Value, String> {
    matmul(grad, w, false, spec.conv1d)
}

/// The gradient of a projection's weight, in its stored layout.
fn weight_grad(spec: &MlpSpec, input: &Value, grad: &Value) -> Result<Value, String> {
    if spec.conv1d {
        matmul(input, grad, true, false)
    } else {
        matmul(grad, input, true, false)
    }
}

/// Rows `r0..r1` of `v` read as `[rows, width]`.
fn rows(v: &Value, width: usize, r0: usize, r1: usize) -> Value {
    Value::new(Shape::from(vec![r1 - r0, width]), v.data[r0 * width..r1 * width].to_vec())
}

fn add_into(acc: &mut [f64], v: &[f64]) {
    for (a, b) in acc.iter_mut().zip(v) {
        *a += b;
    }
}

/// One chunk's forward intermediates: the (biased) up projection `h`, the second up
/// projection `u` (gated), and the product `g` the down projection reads.
struct Chunk {
    h: Value,
    u: Option<Value>,
    g: Value,
}

fn chunk_forward(spec: &MlpSpec, xc: &Value, x: &[&Value]) -> Result<Chunk, String> {
    let mut h = proj(spec, xc, x[1])?;
    if let Some(b) = spec.bias_at() {
        let f = x[b].numel();
        for row in h.data.chunks_mut(f.max(1)) {
            add_into(row, &x[b].data);
        }
    }
    let a = super::kernels::map(&h, |v| unary(spec.act, v));
    let (u, g) = match spec.up() {
        Some(i) => {
            let u = proj(spec, xc, x[i])?;
            let g = zip(&a, &u, |p, q| p * q);
            (Some(u), g)
        }
        None => (None, a),
    };
    Ok(Chunk { h, u, g })
}

/// `(rows, D)` of x.
fn rows_of(x: &Value) -> Result<(usize, usize), String> {
    let d = *x.shape.dims().last().ok_or("x needs a feature dim")?;
    Ok((x.numel() / d.max(1), d))
}

/// `y`, chunk by chunk.
pub(super) fn forward(x: &[&Value], spec: &MlpSpec) -> Result<Value, String> {
    let (n, d) = rows_of(x[0])?;
    let mut y = Vec::with_capacity(x[0].numel());
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + spec.chunk_rows.max(1)).min(n);
        let xc = rows(x[0], d, r0, r1);
        let c = chunk_forward(spec, &xc, x)?;
        y.extend_from_slice(&proj(spec, &c.g, x[spec.down()])?.data);
        r0 = r1;
    }
    Ok(Value { shape: x[0].shape.clone(), data: y })
}

/// The gradient of each forward input, each chunk recomputed, weight gradients summed in
/// chunk order.
pub(super) fn backward(x: &[&Value], spec: &MlpSpec) -> Result<Vec<Value>, String> {
    let k = spec.num_inputs();
    let (n, d) = rows_of(x[0])?;
    let dy = x[k];
    let mut dx = Vec::with_capacity(x[0].numel());
    let mut grads: Vec<Vec<f64>> = x[1..k].iter().map(|w| vec![0.0; w.numel()]).collect();
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + spec.chunk_rows.max(1)).min(n);
        let xc = rows(x[0], d, r0, r1);
        let dyc = rows(dy, d, r0, r1);
        let c = chunk_forward(spec, &xc, x)?;
        let down = spec.down();
        add_into(&mut grads[down - 1], &weight_grad(spec, &c.g, &dyc)?.data);
        let dg = proj_back(spec, &dyc, x[down])?;
        let (dh, dxc) = match (&c.u, spec.up()) {
            (Some(u), Some(i)) => {
                let a = super::kernels::map(&c.h, |v| unary(spec.act, v));
                let du = zip(&dg, &a, |p, q| p * q);
                add_into(&mut grads[i - 1], &weight_grad(spec, &xc, &du)?.data);
                let mut dxc = proj_back(spec, &du, x[i])?;
                let da = zip(&dg, u, |p, q| p * q);
                let dh = zip(&da, &c.h, |p, q| p * unary_derivative(spec.act, q));
                add_into(&mut dxc.data, &proj_back(spec, &dh, x[1])?.data);
                (dh, dxc)
            }
            _ => {
                let dh = zip(&dg, &c.h, |p, q| p * unary_derivative(spec.act, q));
                let dxc = proj_back(spec, &dh, x[1])?;
                (dh, dxc)
            }
        };
        add_into(&mut grads[0], &weight_grad(spec, &xc, &dh)?.data);
        if let Some(b) = spec.bias_at() {
            let f = x[b].numel().max(1);
            for row in dh.data.chunks(f) {
                add_into(&mut grads[b - 1], row);
            }
        }
        dx.extend_from_slice(&dxc.data);
        r0 = r1;
    }
    let mut out = vec![Value { shape: x[0].shape.clone(), data: dx }];
    for (w, g) in x[1..k].iter().zip(grads) {
        out.push(Value { shape: w.shape.clone(), data: g });
    }
    Ok(out)
}
