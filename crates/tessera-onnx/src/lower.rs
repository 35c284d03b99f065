//! ONNX operators on activations, one by one, as IR operators. Constant inputs become
//! parameters (initialisers) or scalar fills; elementwise operators, slices and splits keep a
//! pending transpose instead of materialising it.

use crate::attrs;
use crate::consts;
use crate::error::{OnnxError, Result};
use crate::import::{Importer, Value};
use crate::tensor::broadcast_shape;
use onnx_protobuf::NodeProto;
use tessera_ir::{BinaryOp, ReduceOp, Shape, TensorId, UnaryOp};

/// Every operator the importer reads: on activations (below) or folded when constant
/// ([`crate::consts`]); the attention and rotary patterns of [`crate::fuse`] are made of
/// these.
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "AveragePool",
    "Cast",
    "Ceil",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "Cos",
    "CumSum",
    "Div",
    "Dropout",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "Gather",
    "GatherND",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "Greater",
    "GreaterOrEqual",
    "Identity",
    "InstanceNormalization",
    "LayerNormalization",
    "Less",
    "LessOrEqual",
    "Log",
    "MatMul",
    "Max",
    "MaxPool",
    "Min",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "Pow",
    "Range",
    "Reciprocal",
    "ReduceMean",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Resize",
    "Shape",
    "Sigmoid",
    "Sin",
    "Size",
    "Slice",
    "Softmax",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "Xor",
];

/// Input `i` of `node`, or the error that it is missing.
fn input(node: &NodeProto, values: &[Option<Value>], i: usize) -> Result<Value> {
    values.get(i).cloned().flatten().ok_or_else(|| OnnxError::Unsupported {
        node: node.name.clone(),
        op: node.op_type.clone(),
        reason: format!("input {i} is missing"),
    })
}

/// An IR tensor with no pending permutation.
fn plain(id: TensorId) -> Value {
    Value::Tensor { id, perm: None }
}

fn is_identity(p: &[usize]) -> bool {
    p.iter().enumerate().all(|(i, &x)| i == x)
}

impl Importer<'_> {
    /// Lowers `node` whose inputs are `values` (at least one a tensor).
    pub(crate) fn lower(
        &mut self,
        node: &NodeProto,
        values: &[Option<Value>],
    ) -> Result<Vec<Value>> {
        if let Some(v) = self.lower_vision(node, values)? {
            return Ok(vec![v]);
        }
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "Identity" | "Dropout" | "Cast" | "Neg" | "Sqrt" | "Exp" | "Log" | "Tanh"
            | "Sigmoid" | "Relu" | "Reciprocal" | "Gelu" | "Add" | "Sub" | "Mul" | "Div"
            | "Max" | "Min" | "Pow" => self.lower_elementwise(node, values),
            "MatMul" | "Gemm" => self.lower_linear(node, values),
            "Transpose" | "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Expand" => {
                self.lower_layout(node, values)
            }
            "Slice" | "Split" | "Concat" => self.lower_slicing(node, values),
            "Softmax" | "LayerNormalization" | "ReduceMean" | "ReduceSum" => {
                self.lower_nn(node, values)
            }
            "Gather" => t(self.gather(node, &arg(0)?, &arg(1)?)?),
            "Erf" => Err(self.unsupported(
                node,
                "Erf is imported as part of GELU, x · 0.5 · (1 + erf(x / √2)), and here it is not",
            )),
            op if SUPPORTED_OPS.contains(&op) => Err(self.unsupported(
                node,
                format!(
                    "{op} is folded when its inputs are constants, but here it reads activations"
                ),
            )),
            op => Err(OnnxError::UnsupportedOp {
                op: op.to_string(),
                node: node.name.clone(),
                used_by: self.used_by(self.index_of(node)),
                supported: SUPPORTED_OPS.join(", "),
            }),
        }
    }

    /// Unary and binary elementwise operators, casts and identities.
    fn lower_elementwise(
        &mut self,
        node: &NodeProto,
        values: &[Option<Value>],
    ) -> Result<Vec<Value>> {
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "Identity" | "Dropout" | "Cast" => {
                let x = arg(0)?;
                if node.op_type == "Cast" {
                    let to = attrs::int(node, "to", 1) as i32;
                    if crate::tensor::elem_of(to) != Some(crate::Elem::Float) {
                        return Err(
                            self.unsupported(node, "a cast of activations to a non-float type")
                        );
                    }
                }
                let mut out = vec![x];
                if node.op_type == "Dropout" && node.output.len() > 1 {
                    return Err(self.unsupported(node, "a Dropout whose mask output is used"));
                }
                out.truncate(1);
                Ok(out)
            }
            "Neg" | "Sqrt" | "Exp" | "Log" | "Tanh" | "Sigmoid" | "Relu" => {
                let op = match node.op_type.as_str() {
                    "Neg" => UnaryOp::Neg,
                    "Sqrt" => UnaryOp::Sqrt,
                    "Exp" => UnaryOp::Exp,
                    "Log" => UnaryOp::Log,
                    "Tanh" => UnaryOp::Tanh,
                    "Sigmoid" => UnaryOp::Sigmoid,
                    _ => UnaryOp::Relu,
                };
                t(self.elementwise1(node, &arg(0)?, |b, x| b.unary(op, x))?)
            }
            // Opset 20's Gelu: exact (erf) or, with approximate="tanh", the tanh form.
            "Gelu" => {
                let op = match crate::attrs::string(node, "approximate").as_deref() {
                    None | Some("none") => UnaryOp::Gelu,
                    Some("tanh") => UnaryOp::GeluTanh,
                    Some(other) => {
                        return Err(self.unsupported(
                            node,
                            format!("Gelu with approximate=\"{other}\" (none and tanh are read)"),
                        ))
                    }
                };
                t(self.elementwise1(node, &arg(0)?, |b, x| b.unary(op, x))?)
            }
            "Reciprocal" => t(self.elementwise1(node, &arg(0)?, |b, x| {
                let one = b.scalar_like(1.0, x)?;
                b.div(one, x)
            })?),
            "Add" | "Sub" | "Mul" | "Div" | "Max" | "Min" => {
                if values.len() != 2 {
                    return Err(self.unsupported(
                        node,
                        format!("{} of {} inputs (two are read)", node.op_type, values.len()),
                    ));
                }
                let op = match node.op_type.as_str() {
                    "Add" => BinaryOp::Add,
                    "Sub" => BinaryOp::Sub,
                    "Mul" => BinaryOp::Mul,
                    "Div" => BinaryOp::Div,
                    "Max" => BinaryOp::Max,
                    _ => BinaryOp::Min,
                };
                t(self.binary(node, op, &arg(0)?, &arg(1)?)?)
            }
            "Pow" => {
                let e = self.const_input(&node.input[1])?.and_then(|c| c.scalar());
                let Some(e) = e else {
                    return Err(
                        self.unsupported(node, "a power whose exponent is not a constant scalar")
                    );
                };
                if e.fract() != 0.0 && !self.never_negative(&node.input[0]) {
                    return Err(OnnxError::NegativeBase {
                        path: self.m.path.display().to_string(),
                        node: crate::validate::describe(node, self.index_of(node)),
                        base: node.input[0].clone(),
                        exponent: e,
                    });
                }
                let x = arg(0)?;
                let out = self.elementwise1(node, &x, |b, x| match e {
                    1.0 => Ok(x),
                    2.0 => b.mul(x, x),
                    3.0 => {
                        let x2 = b.mul(x, x)?;
                        b.mul(x2, x)
                    }
                    0.5 => b.unary(UnaryOp::Sqrt, x),
                    -0.5 => b.unary(UnaryOp::Rsqrt, x),
                    -1.0 => {
                        let one = b.scalar_like(1.0, x)?;
                        b.div(one, x)
                    }
                    _ => Err(tessera_ir::IrError::Graph(format!(
                        "exponent {e} is not supported (1, 2, 3, ±0.5, -1 are)"
                    ))),
                })?;
                t(out)
            }
            _ => unreachable!("lower_elementwise dispatches only its own operators"),
        }
    }

    /// `MatMul` and `Gemm`.
    fn lower_linear(&mut self, node: &NodeProto, values: &[Option<Value>]) -> Result<Vec<Value>> {
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "MatMul" => t(plain(self.matmul(node, &arg(0)?, &arg(1)?, false, false)?)),
            "Gemm" => {
                let (ta, tb) =
                    (attrs::int(node, "transA", 0) != 0, attrs::int(node, "transB", 0) != 0);
                let mut y = self.matmul(node, &arg(0)?, &arg(1)?, ta, tb)?;
                let alpha = attrs::float(node, "alpha", 1.0);
                if alpha != 1.0 {
                    y = self.b.scale(y, alpha).map_err(|e| self.err_ir(node, e))?;
                }
                if let Some(c) = values.get(2).cloned().flatten() {
                    let mut c = self.tensor(&c, &node.name, &node.op_type)?;
                    let beta = attrs::float(node, "beta", 1.0);
                    if beta != 1.0 {
                        c = self.b.scale(c, beta).map_err(|e| self.err_ir(node, e))?;
                    }
                    y = self.b.add(y, c).map_err(|e| self.err_ir(node, e))?;
                }
                t(plain(y))
            }
            _ => unreachable!("lower_linear dispatches only its own operators"),
        }
    }

    /// Transposes, reshapes and expands.
    fn lower_layout(&mut self, node: &NodeProto, values: &[Option<Value>]) -> Result<Vec<Value>> {
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "Transpose" => {
                let x = arg(0)?;
                let rank = self.shape_of(&x)?.len();
                let p: Vec<usize> = match attrs::ints(node, "perm") {
                    Some(p) if p.len() == rank && crate::validate::is_permutation(&p) => {
                        p.iter().map(|&v| v as usize).collect()
                    }
                    Some(p) => {
                        return Err(self.unsupported(
                            node,
                            format!(
                                "perm {p:?} is not a permutation of the input's {rank} axes; \
                                 re-export the model (onnx.checker.check_model with \
                                 full_check=True rejects it too)"
                            ),
                        ))
                    }
                    None => (0..rank).rev().collect(),
                };
                let (id, old) = match x {
                    Value::Tensor { id, perm } => (id, perm),
                    other => (self.tensor(&other, &node.name, &node.op_type)?, None),
                };
                let composed: Vec<usize> = match old {
                    Some(o) => p.iter().map(|&i| o[i]).collect(),
                    None => p,
                };
                t(Value::Tensor { id, perm: (!is_identity(&composed)).then_some(composed) })
            }
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
                let x = arg(0)?;
                let shape = self.shape_of(&x)?;
                let target = match node.op_type.as_str() {
                    "Reshape" => {
                        let Some(s) = self.const_input(&node.input[1])? else {
                            return Err(self.unsupported(
                                node,
                                "a reshape to a shape computed from activations",
                            ));
                        };
                        consts::reshape_target(
                            &shape,
                            &s.to_i64(),
                            attrs::int(node, "allowzero", 0),
                        )
                    }
                    "Flatten" => {
                        attrs::axis_in(attrs::int(node, "axis", 1), shape.len() + 1).map(|a| {
                            let outer: usize = shape[..a].iter().product();
                            vec![outer, shape.iter().product::<usize>() / outer.max(1)]
                        })
                    }
                    op => {
                        let axes_in = match node.input.get(1) {
                            Some(a) if !a.is_empty() => self.const_input(a)?,
                            _ => None,
                        };
                        let axes = consts::axes_of(node, axes_in.as_deref())
                            .map_err(|r| self.unsupported(node, r))?;
                        if op == "Squeeze" {
                            consts::squeeze_shape(&shape, axes.as_deref())
                        } else {
                            axes.ok_or_else(|| "no axes".to_string())
                                .and_then(|a| consts::unsqueeze_shape(&shape, &a))
                        }
                    }
                }
                .map_err(|r| self.unsupported(node, r))?;
                let id = self.tensor(&x, &node.name, &node.op_type)?;
                t(plain(self.b.reshape(id, Shape::from(target)).map_err(|e| self.err_ir(node, e))?))
            }
            "Expand" => {
                let x = arg(0)?;
                let shape = self.shape_of(&x)?;
                let Some(s) = self.const_input(&node.input[1])? else {
                    return Err(
                        self.unsupported(node, "an expand to a shape computed from activations")
                    );
                };
                let out = consts::expand_shape(&shape, &s.to_i64())
                    .map_err(|r| self.unsupported(node, r))?;
                let id = self.tensor(&x, &node.name, &node.op_type)?;
                if out == shape {
                    return t(plain(id));
                }
                let id = if out.len() > shape.len() {
                    let mut padded = vec![1; out.len() - shape.len()];
                    padded.extend(&shape);
                    self.b.reshape(id, Shape::from(padded)).map_err(|e| self.err_ir(node, e))?
                } else {
                    id
                };
                t(plain(self.b.expand(id, Shape::from(out)).map_err(|e| self.err_ir(node, e))?))
            }
            _ => unreachable!("lower_layout dispatches only its own operators"),
        }
    }

    /// Slices, splits and concatenations.
    fn lower_slicing(&mut self, node: &NodeProto, values: &[Option<Value>]) -> Result<Vec<Value>> {
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "Slice" => {
                let x = arg(0)?;
                let shape = self.shape_of(&x)?;
                let mut rest = Vec::new();
                for name in node.input.iter().skip(1) {
                    rest.push(self.const_input(name)?);
                }
                let refs: Vec<Option<&crate::tensor::Const>> =
                    rest.iter().map(|c| c.as_deref()).collect();
                let p =
                    consts::slice_params(&shape, &refs).map_err(|r| self.unsupported(node, r))?;
                let mut out = x;
                for (axis, &(start, step, len)) in p.iter().enumerate() {
                    if (start, len) == (0, shape[axis]) && step == 1 {
                        continue;
                    }
                    if step != 1 {
                        return Err(self.unsupported(node, "a slice with a step other than 1"));
                    }
                    out = self.slice(node, &out, axis, start, start + len)?;
                }
                t(out)
            }
            "Split" => {
                let x = arg(0)?;
                let shape = self.shape_of(&x)?;
                let a = attrs::axis_in(attrs::int(node, "axis", 0), shape.len())
                    .map_err(|r| self.unsupported(node, r))?;
                let sizes: Vec<usize> = match node.input.get(1).filter(|s| !s.is_empty()) {
                    Some(s) => match self.const_input(s)? {
                        Some(c) => {
                            consts::dims_of(&c.to_i64()).map_err(|r| self.unsupported(node, r))?
                        }
                        None => {
                            return Err(
                                self.unsupported(node, "split sizes computed from activations")
                            )
                        }
                    },
                    None => match attrs::ints(node, "split") {
                        Some(s) => consts::dims_of(&s).map_err(|r| self.unsupported(node, r))?,
                        None => {
                            let n = node.output.len();
                            vec![shape[a].div_ceil(n); n]
                        }
                    },
                };
                let mut start = 0;
                let mut outs = Vec::new();
                for len in sizes {
                    let end = (start + len).min(shape[a]);
                    outs.push(self.slice(node, &x, a, start, end)?);
                    start = end;
                }
                Ok(outs)
            }
            "Concat" => {
                let first = self.shape_of(&arg(0)?)?;
                let a = attrs::axis_in(attrs::int(node, "axis", 0), first.len())
                    .map_err(|r| self.unsupported(node, r))?;
                let mut ids = Vec::new();
                for v in values.iter().flatten() {
                    ids.push(self.tensor(v, &node.name, &node.op_type)?);
                }
                t(plain(self.b.concat(&ids, a).map_err(|e| self.err_ir(node, e))?))
            }
            _ => unreachable!("lower_slicing dispatches only its own operators"),
        }
    }

    /// Softmax, layer norm and the mean and sum reductions.
    fn lower_nn(&mut self, node: &NodeProto, values: &[Option<Value>]) -> Result<Vec<Value>> {
        let arg = |i: usize| input(node, values, i);
        let t = |v: Value| Ok(vec![v]);
        match node.op_type.as_str() {
            "Softmax" => {
                let x = arg(0)?;
                let rank = self.shape_of(&x)?.len() as i64;
                let axis = attrs::int(node, "axis", -1);
                if axis != -1 && axis != rank - 1 {
                    return Err(
                        self.unsupported(node, "a softmax over an axis other than the last")
                    );
                }
                let id = self.tensor(&x, &node.name, &node.op_type)?;
                t(plain(self.b.softmax(id).map_err(|e| self.err_ir(node, e))?))
            }
            "LayerNormalization" => {
                let x = arg(0)?;
                let rank = self.shape_of(&x)?.len() as i64;
                let axis = attrs::int(node, "axis", -1);
                if axis != -1 && axis != rank - 1 {
                    return Err(self.unsupported(node, "a layer norm over more than the last axis"));
                }
                if node.output.iter().skip(1).any(|o| !o.is_empty() && self.readers(o) > 0) {
                    return Err(self.unsupported(
                        node,
                        "a layer norm whose mean or inverse deviation is used",
                    ));
                }
                let eps = attrs::float(node, "epsilon", 1e-5);
                let xi = self.tensor(&x, &node.name, &node.op_type)?;
                let w = self.tensor(&arg(1)?, &node.name, &node.op_type)?;
                let bias = match values.get(2).cloned().flatten() {
                    Some(b) => self.tensor(&b, &node.name, &node.op_type)?,
                    None => {
                        let d = self.b.shape(w).clone();
                        let dtype = self.dtype;
                        self.b.fill(0.0, d, dtype).map_err(|e| self.err_ir(node, e))?
                    }
                };
                t(plain(self.b.layer_norm(xi, w, bias, eps).map_err(|e| self.err_ir(node, e))?))
            }
            "ReduceMean" | "ReduceSum" => {
                let x = arg(0)?;
                let rank = self.shape_of(&x)?.len();
                let axes_in = match node.input.get(1) {
                    Some(a) if !a.is_empty() => self.const_input(a)?,
                    _ => None,
                };
                let axes = consts::axes_of(node, axes_in.as_deref())
                    .map_err(|r| self.unsupported(node, r))?;
                let dims: Vec<usize> = match axes {
                    Some(a) if !a.is_empty() => a
                        .iter()
                        .map(|&v| attrs::axis_in(v, rank).map_err(|r| self.unsupported(node, r)))
                        .collect::<Result<_>>()?,
                    _ if attrs::int(node, "noop_with_empty_axes", 0) != 0 => return t(x),
                    _ => (0..rank).collect(),
                };
                let keep = attrs::int(node, "keepdims", 1) != 0;
                let op = if node.op_type == "ReduceMean" { ReduceOp::Mean } else { ReduceOp::Sum };
                let id = self.tensor(&x, &node.name, &node.op_type)?;
                t(plain(self.b.reduce(op, id, &dims, keep).map_err(|e| self.err_ir(node, e))?))
            }
            _ => unreachable!("lower_nn dispatches only its own operators"),
        }
    }

    /// A unary elementwise op, applied under a pending permutation.
    fn elementwise1(
        &mut self,
        node: &NodeProto,
        x: &Value,
        f: impl FnOnce(&mut tessera_ir::Builder, TensorId) -> tessera_ir::Result<TensorId>,
    ) -> Result<Value> {
        let (id, perm) = match x {
            Value::Tensor { id, perm } => (*id, perm.clone()),
            other => (self.tensor(other, &node.name, &node.op_type)?, None),
        };
        let y = f(&mut self.b, id).map_err(|e| self.err_ir(node, e))?;
        Ok(Value::Tensor { id: y, perm })
    }

    fn binary(&mut self, node: &NodeProto, op: BinaryOp, a: &Value, b: &Value) -> Result<Value> {
        let (sa, sb) = (self.shape_of(a)?, self.shape_of(b)?);
        if broadcast_shape(&sa, &sb).is_none() {
            return Err(
                self.unsupported(node, format!("shapes {sa:?} and {sb:?} do not broadcast"))
            );
        }
        // Same pending permutation on both, or a scalar beside one: stay permuted.
        let scalar = |s: &[usize]| s.iter().all(|&d| d == 1);
        let keep = match (a, b) {
            (Value::Tensor { perm: Some(p), .. }, Value::Tensor { perm: Some(q), .. })
                if p == q && sa == sb =>
            {
                Some(p.clone())
            }
            (Value::Tensor { perm: Some(p), .. }, _) if scalar(&sb) && sb.len() <= sa.len() => {
                Some(p.clone())
            }
            (_, Value::Tensor { perm: Some(p), .. }) if scalar(&sa) && sa.len() <= sb.len() => {
                Some(p.clone())
            }
            _ => None,
        };
        let phys = |im: &mut Self, v: &Value| -> Result<TensorId> {
            match (v, &keep) {
                (Value::Tensor { id, perm: Some(_) }, Some(_)) => Ok(*id),
                (v, Some(_)) => {
                    // A scalar: drop its rank-1 dims to a plain scalar.
                    let t = im.tensor(v, &node.name, &node.op_type)?;
                    im.b.reshape(t, Shape::scalar()).map_err(|e| im.err_ir(node, e))
                }
                (v, None) => im.tensor(v, &node.name, &node.op_type),
            }
        };
        let (x, y) = (phys(self, a)?, phys(self, b)?);
        let z = self.b.binary(op, x, y).map_err(|e| self.err_ir(node, e))?;
        Ok(Value::Tensor { id: z, perm: keep })
    }

    /// `[.., m, k] x [.., k, n]`, reading a pending swap of the last two axes as a transpose
    /// flag; `ta`/`tb` are the operator's own flags (Gemm).
    fn matmul(
        &mut self,
        node: &NodeProto,
        a: &Value,
        b: &Value,
        ta: bool,
        tb: bool,
    ) -> Result<TensorId> {
        let operand = |im: &mut Self, v: &Value, flag: bool| -> Result<(TensorId, bool)> {
            if let Value::Tensor { id, perm: Some(p) } = v {
                let r = p.len();
                let swapped =
                    r >= 2 && p[r - 2] == r - 1 && p[r - 1] == r - 2 && is_identity(&p[..r - 2]);
                if swapped {
                    return Ok((*id, !flag));
                }
            }
            Ok((im.tensor(v, &node.name, &node.op_type)?, flag))
        };
        let (x, fa) = operand(self, a, ta)?;
        let (w, fb) = operand(self, b, tb)?;
        if self.b.shape(x).rank() < 2 || self.b.shape(w).rank() < 2 {
            return Err(self.unsupported(node, "a matmul of a vector (rank 1)"));
        }
        self.b.matmul(x, w, fa, fb).map_err(|e| self.err_ir(node, e))
    }

    /// `x[.., start:end, ..]` along logical `axis`, under a pending permutation.
    fn slice(
        &mut self,
        node: &NodeProto,
        x: &Value,
        axis: usize,
        start: usize,
        end: usize,
    ) -> Result<Value> {
        let (id, perm) = match x {
            Value::Tensor { id, perm } => (*id, perm.clone()),
            other => (self.tensor(other, &node.name, &node.op_type)?, None),
        };
        let phys = perm.as_ref().map_or(axis, |p| p[axis]);
        let y = self.b.slice(id, phys, start, end).map_err(|e| self.err_ir(node, e))?;
        Ok(Value::Tensor { id: y, perm })
    }

    /// `Gather`: an embedding lookup (a weight table indexed by token ids), or constant
    /// indices that pick a contiguous range (positions `0..S`) or one index.
    fn gather(&mut self, node: &NodeProto, data: &Value, idx: &Value) -> Result<Value> {
        let axis = attrs::int(node, "axis", 0);
        let shape = self.shape_of(data)?;
        let a = attrs::axis_in(axis, shape.len()).map_err(|r| self.unsupported(node, r))?;
        if let Some(ids) = self.as_const(idx)? {
            let n = shape[a] as i64;
            let v: Vec<i64> = ids.to_i64().iter().map(|&i| if i < 0 { i + n } else { i }).collect();
            if v.iter().any(|&i| !(0..n).contains(&i)) {
                return Err(self.unsupported(node, format!("an index outside 0..{n}")));
            }
            // Every row of the indices the same contiguous range.
            let row = *ids.shape.last().unwrap_or(&1);
            let first = v.first().copied().unwrap_or(0);
            let contiguous = v
                .chunks(row.max(1))
                .all(|r| r.iter().enumerate().all(|(k, &i)| i == first + k as i64));
            if !contiguous {
                return Err(self.unsupported(
                    node,
                    "constant indices that are not one contiguous range per row",
                ));
            }
            let s = self.slice(node, data, a, first as usize, first as usize + row)?;
            // The sliced axis is replaced by the indices' shape.
            let mut out: Vec<usize> = shape[..a].to_vec();
            let lead = ids.shape.len().saturating_sub(1);
            let ids_shape = if ids.shape.is_empty() { vec![] } else { ids.shape.clone() };
            out.extend(ids_shape.iter().take(lead).map(|_| 1));
            if !ids.shape.is_empty() {
                out.push(row);
            }
            out.extend(&shape[a + 1..]);
            let id = self.tensor(&s, &node.name, &node.op_type)?;
            let id =
                self.b.reshape(id, Shape::from(out.clone())).map_err(|e| self.err_ir(node, e))?;
            // Broadcast over the indices' leading axes (each row the same range).
            let mut full: Vec<usize> = shape[..a].to_vec();
            full.extend(&ids_shape);
            full.extend(&shape[a + 1..]);
            let id = if full != out {
                self.b.expand(id, Shape::from(full)).map_err(|e| self.err_ir(node, e))?
            } else {
                id
            };
            return Ok(Value::Tensor { id, perm: None });
        }
        if a != 0 || shape.len() != 2 {
            return Err(
                self.unsupported(node, "a gather by activations other than a [V, D] table's rows")
            );
        }
        let table = self.tensor(data, &node.name, &node.op_type)?;
        let ids = self.tensor(idx, &node.name, &node.op_type)?;
        Ok(Value::Tensor {
            id: self.b.embedding(table, ids).map_err(|e| self.err_ir(node, e))?,
            perm: None,
        })
    }
}
