//! A transformer block's MLP fused and computed in sequence chunks ([`Op::TiledMlp`], ALST's
//! "tiled MLP"): `x [.., D]` through the up projection(s), the activation (and, gated, the
//! product with the second projection) and the down projection, `chunk_rows` rows (tokens) at
//! a time, so no `[rows, F]` intermediate exists beyond one chunk — at long context the MLP's
//! `[S, F]` tensors (F = 3.5·D in Llama) are what peaks, above all when a checkpointed block is
//! recomputed in the backward. The backward recomputes each chunk's intermediates from `x`
//! and the weights and accumulates the weights' gradients chunk after chunk. One chunk's
//! intermediates are the op's declared workspace, charged by the accountant and the profiler
//! alike.
//!
//! Two shapes of MLP ([`MlpSpec`]):
//! - gated (SwiGLU, Llama): `y = (act(x·W_gateᵀ) ⊙ x·W_upᵀ)·W_downᵀ`, weights as `nn.Linear`
//!   (`[out, in]`): inputs `[x, w_gate [F, D], w_up [F, D], w_down [D, F]]`;
//! - plain (GPT-2's `c_fc`, GELU, `c_proj`): `y = act(x·W_fc + b_fc)·W_proj`, weights as
//!   GPT-2's `Conv1D` (`[in, out]`): inputs `[x, w_fc [D, F], b_fc [F], w_proj [F, D]]`.
//!
//! The down projection's bias (GPT-2's `c_proj.bias`) stays outside, an `Add` after the op,
//! as it does after the unfused matmul (under tensor parallelism the op's output is a pending
//! sum and the bias is added once, after its reduction).

use super::elementwise::unary_flops_per_element;
use super::{expect_float, expect_inputs, Flops, Op, UnaryOp};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, TensorMeta};
use serde::{Deserialize, Serialize};

/// What the fused MLP computes and how it is stored; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MlpSpec {
    /// The activation (`Silu` for SwiGLU, `GeluTanh` for GPT-2).
    pub act: UnaryOp,
    /// `act(x·W_gate) ⊙ x·W_up` (a second up projection) instead of `act(x·W_fc)`.
    pub gated: bool,
    /// Weights stored `[in, out]` (GPT-2's `Conv1D`) instead of `[out, in]` (`nn.Linear`).
    pub conv1d: bool,
    /// The up projection has a bias `[F]` (plain MLPs only).
    pub bias: bool,
    /// Rows (tokens) per chunk.
    pub chunk_rows: usize,
}

impl MlpSpec {
    /// The forward op's input count: `x`, the up weight(s), the bias, the down weight.
    pub fn num_inputs(&self) -> usize {
        3 + self.gated as usize + self.bias as usize
    }

    /// Index of the second up projection's weight (gated only).
    pub fn up(&self) -> Option<usize> {
        self.gated.then_some(2)
    }

    /// Index of the up projection's bias.
    pub fn bias_at(&self) -> Option<usize> {
        self.bias.then_some(2 + self.gated as usize)
    }

    /// Index of the down projection's weight.
    pub fn down(&self) -> usize {
        self.num_inputs() - 1
    }

    /// Dim of each weight that holds `F` (the intermediate features): the column- and
    /// row-parallel split of tensor parallelism.
    pub fn ffn_dim_of_up(&self) -> usize {
        if self.conv1d {
            1
        } else {
            0
        }
    }

    /// Dim of the down weight that holds `F`.
    pub fn ffn_dim_of_down(&self) -> usize {
        1 - self.ffn_dim_of_up()
    }
}

/// `(rows, D, F)` of the forward inputs, or why they do not fit.
pub(crate) fn dims(x: &[&TensorMeta], spec: &MlpSpec) -> Result<(u64, u64, u64), String> {
    if spec.gated && spec.bias {
        return Err("a gated tiled MLP takes no bias".into());
    }
    if spec.chunk_rows == 0 {
        return Err("chunk_rows must be at least 1".into());
    }
    expect_inputs(x, spec.num_inputs())?;
    for (i, m) in x.iter().enumerate() {
        expect_float(m, "tiled MLP operand")?;
        if m.dtype != x[0].dtype {
            return Err(format!("operand {i} {m} must share x's dtype {}", x[0].dtype));
        }
    }
    let h = x[0].shape.dims();
    let Some(&d) = h.last() else { return Err(format!("x {} needs a feature dim", x[0])) };
    let w_in = x[1].shape.dims();
    if w_in.len() != 2 {
        return Err(format!("up weight {} must be 2-D", x[1]));
    }
    let f = w_in[spec.ffn_dim_of_up()];
    let swap = |a: usize, b: usize| if spec.conv1d { vec![a, b] } else { vec![b, a] };
    if w_in != swap(d, f).as_slice() {
        return Err(format!("up weight {} does not fit x {}", x[1], x[0]));
    }
    if let Some(u) = spec.up() {
        if x[u].shape != x[1].shape {
            return Err(format!("up weight {} must match the gate's {}", x[u], x[1]));
        }
    }
    if let Some(b) = spec.bias_at() {
        if x[b].shape.dims() != [f] {
            return Err(format!("bias {} must be [{f}]", x[b]));
        }
    }
    let down = x[spec.down()].shape.dims();
    if down != swap(f, d).as_slice() {
        return Err(format!("down weight {} does not fit {f} features to {d}", x[spec.down()]));
    }
    Ok((x[0].numel() / d.max(1) as u64, d as u64, f as u64))
}

/// `[x, weights..]` → `[y]` of x's meta.
pub(crate) fn infer(x: &[&TensorMeta], spec: &MlpSpec) -> Result<Vec<TensorMeta>, String> {
    dims(x, spec)?;
    Ok(vec![x[0].clone()])
}

/// `[x, weights.., dy]` → the gradient of each forward input, in order.
pub(crate) fn infer_backward(x: &[&TensorMeta], spec: &MlpSpec) -> Result<Vec<TensorMeta>, String> {
    let n = spec.num_inputs();
    expect_inputs(x, n + 1)?;
    dims(&x[..n], spec)?;
    if x[n] != x[0] {
        return Err(format!("dy {} must match x {}", x[n], x[0]));
    }
    Ok(x[..n].iter().map(|&m| m.clone()).collect())
}

/// The projections' GEMMs (`2·rows·D·F` each) and the activation, product and bias.
pub(crate) fn flops(x: &[&TensorMeta], spec: &MlpSpec) -> Flops {
    let Ok((n, d, f)) = dims(x, spec) else { return Flops::default() };
    let gemms = 2 + spec.gated as u64;
    let other = n * f * (unary_flops_per_element(spec.act) + spec.gated as u64 + spec.bias as u64);
    Flops { matmul: gemms * 2 * n * d * f, other }
}

/// The forward recomputed, then each projection's two gradient GEMMs: three times the
/// forward's GEMMs (the unfused backward's two, plus the recomputation).
pub(crate) fn flops_backward(x: &[&TensorMeta], spec: &MlpSpec) -> Flops {
    let n = spec.num_inputs();
    let Ok((rows, d, f)) = dims(&x[..n], spec) else { return Flops::default() };
    let fwd = flops(&x[..n], spec);
    let act = 2 * unary_flops_per_element(spec.act) + 1;
    let other = fwd.other + rows * f * (act + 2 * spec.gated as u64 + spec.bias as u64);
    Flops { matmul: 3 * fwd.matmul, other: other + rows * d }
}

/// One chunk's `[min(chunk_rows, rows), F]` intermediates in x's dtype: the forward holds the
/// up projection(s) and the activated product (2, gated 3), the backward those and the
/// gradients of the product and of each up projection's output (4, gated 6).
pub(crate) fn workspace_bytes(x: &[&TensorMeta], spec: &MlpSpec, backward: bool) -> u64 {
    let n = spec.num_inputs();
    let Ok((rows, _, f)) = dims(&x[..n], spec) else { return 0 };
    let g = spec.gated as u64;
    let buffers = if backward { 4 + 2 * g } else { 2 + g };
    buffers * rows.min(spec.chunk_rows as u64) * f * x[0].dtype.size_bytes()
}

pub(crate) fn vjp(cx: &mut VjpCtx<'_>, spec: &MlpSpec) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let mut ins: Vec<_> = (0..spec.num_inputs()).map(|i| cx.x(i)).collect();
    ins.push(dy);
    let g = cx.b.push(Op::TiledMlpBackward(*spec), &ins)?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}
