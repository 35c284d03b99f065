//! Vision and diffusion operators on activations (NCHW, as PyTorch exports them): `Conv`,
//! `MaxPool`, `AveragePool`, `GlobalAveragePool`, `InstanceNormalization` (how opset 17 writes
//! `nn.GroupNorm`: a reshape to `[N, groups, -1]` around it) and nearest `Resize` by integer
//! factors — each onto the IR's vision ops.

use crate::attrs;
use crate::error::Result;
use crate::import::{Importer, Value};
use onnx_protobuf::NodeProto;
use tessera_ir::{Conv2dSpec, Shape, TensorId};

/// `[top, left, bottom, right]` pads as the IR's symmetric `[h, w]`.
fn symmetric_pads(node: &NodeProto) -> std::result::Result<[usize; 2], String> {
    let p = attrs::ints(node, "pads").unwrap_or_else(|| vec![0; 4]);
    match p.as_slice() {
        &[t, l, b, r] if t == b && l == r && t >= 0 && l >= 0 => Ok([t as usize, l as usize]),
        _ => Err(format!("pads {p:?} are not symmetric (only symmetric padding is supported)")),
    }
}

fn pair(node: &NodeProto, name: &str, default: usize) -> std::result::Result<[usize; 2], String> {
    match attrs::ints(node, name).as_deref() {
        None => Ok([default; 2]),
        Some(&[a, b]) if a > 0 && b > 0 => Ok([a as usize, b as usize]),
        Some(v) => Err(format!("{name} {v:?}: two positive values expected (2-D only)")),
    }
}

impl Importer<'_> {
    /// The vision operators; `None` for any other operator.
    pub(crate) fn lower_vision(
        &mut self,
        node: &NodeProto,
        values: &[Option<Value>],
    ) -> Result<Option<Value>> {
        let op = node.op_type.as_str();
        if !matches!(
            op,
            "Conv"
                | "MaxPool"
                | "AveragePool"
                | "GlobalAveragePool"
                | "InstanceNormalization"
                | "Resize"
        ) {
            return Ok(None);
        }
        let auto_pad =
            attrs::attr(node, "auto_pad").map(|a| String::from_utf8_lossy(&a.s).into_owned());
        if auto_pad.as_deref().is_some_and(|p| p != "NOTSET") {
            return Err(self.unsupported(node, "auto_pad (export with explicit pads)"));
        }
        let Some(x) = values.first().cloned().flatten() else {
            return Err(self.unsupported(node, "no input"));
        };
        let x = self.tensor(&x, &node.name, op)?;
        let rank = self.b.shape(x).rank();
        if rank != 4 && op != "InstanceNormalization" {
            return Err(self.unsupported(node, format!("a rank-{rank} input (2-D NCHW only)")));
        }
        let bad = |im: &Self, r: String| im.unsupported(node, r);
        let ir = |im: &Self, e| im.err_ir(node, e);
        let y = match op {
            "Conv" => {
                let w_value = values
                    .get(1)
                    .cloned()
                    .flatten()
                    .ok_or_else(|| bad(self, "no weight".into()))?;
                let w = self.tensor(&w_value, &node.name, op)?;
                let spec = Conv2dSpec {
                    stride: pair(node, "strides", 1).map_err(|r| bad(self, r))?,
                    padding: symmetric_pads(node).map_err(|r| bad(self, r))?,
                    dilation: pair(node, "dilations", 1).map_err(|r| bad(self, r))?,
                    groups: attrs::int(node, "group", 1).max(1) as usize,
                };
                let y = self.b.conv2d(x, w, spec).map_err(|e| ir(self, e))?;
                match values.get(2).cloned().flatten() {
                    Some(bias) => {
                        let bias = self.tensor(&bias, &node.name, op)?;
                        let o = self.b.shape(bias).numel() as usize;
                        let bias = self.b.reshape(bias, [o, 1, 1]).map_err(|e| ir(self, e))?;
                        self.b.add(y, bias).map_err(|e| ir(self, e))?
                    }
                    None => y,
                }
            }
            "MaxPool" | "AveragePool" => {
                if attrs::int(node, "ceil_mode", 0) != 0 {
                    return Err(bad(self, "ceil_mode=1 (floor mode only)".into()));
                }
                if pair(node, "dilations", 1).map_err(|r| bad(self, r))? != [1, 1] {
                    return Err(bad(self, "dilated pooling".into()));
                }
                if node.output.get(1).is_some_and(|o| !o.is_empty() && self.readers(o) > 0) {
                    return Err(bad(self, "MaxPool's indices output is used".into()));
                }
                let kernel = pair(node, "kernel_shape", 0).map_err(|r| bad(self, r))?;
                let stride = pair(node, "strides", 1).map_err(|r| bad(self, r))?;
                let padding = symmetric_pads(node).map_err(|r| bad(self, r))?;
                if op == "MaxPool" {
                    self.b.max_pool2d(x, kernel, stride, padding).map_err(|e| ir(self, e))?
                } else {
                    let include = attrs::int(node, "count_include_pad", 0) != 0;
                    self.b
                        .avg_pool2d(x, kernel, stride, padding, include)
                        .map_err(|e| ir(self, e))?
                }
            }
            "GlobalAveragePool" => {
                let d = self.b.shape(x).dims().to_vec();
                self.b.avg_pool2d(x, [d[2], d[3]], [1, 1], [0, 0], true).map_err(|e| ir(self, e))?
            }
            "InstanceNormalization" => {
                let c = self.b.shape(x).dims().get(1).copied().unwrap_or(0);
                let eps = attrs::float(node, "epsilon", 1e-5);
                let scale = self.affine(node, values.get(1).cloned().flatten(), c)?;
                let shift = self.affine(node, values.get(2).cloned().flatten(), c)?;
                self.b.group_norm(x, scale, shift, c, eps).map_err(|e| ir(self, e))?
            }
            _ => self.resize(node, x, values)?,
        };
        Ok(Some(Value::Tensor { id: y, perm: None }))
    }

    /// An InstanceNormalization scale or bias `[C]`: a weight, or a constant of one value
    /// (what `nn.GroupNorm`'s export passes: ones and zeros) as a fill.
    fn affine(&mut self, node: &NodeProto, v: Option<Value>, c: usize) -> Result<TensorId> {
        let v = v.ok_or_else(|| self.unsupported(node, "no scale or bias"))?;
        if let Value::Const(k) = &v {
            let first = k.f(0);
            if k.numel() == c && (0..c).all(|i| k.f(i) == first) {
                let dtype = self.dtype;
                return self
                    .b
                    .fill(first, Shape::from(vec![c]), dtype)
                    .map_err(|e| self.err_ir(node, e));
            }
        }
        self.tensor(&v, &node.name, &node.op_type)
    }

    /// Nearest `Resize` by integer factors on H and W (`scales` or `sizes`).
    fn resize(
        &mut self,
        node: &NodeProto,
        x: TensorId,
        values: &[Option<Value>],
    ) -> Result<TensorId> {
        let mode = attrs::attr(node, "mode").map(|a| String::from_utf8_lossy(&a.s).into_owned());
        if mode.as_deref() != Some("nearest") {
            return Err(self.unsupported(node, format!("mode {mode:?} (nearest only)")));
        }
        let ctm = attrs::attr(node, "coordinate_transformation_mode")
            .map_or("half_pixel".to_string(), |a| String::from_utf8_lossy(&a.s).into_owned());
        let nearest = attrs::attr(node, "nearest_mode")
            .map_or("round_prefer_floor".to_string(), |a| {
                String::from_utf8_lossy(&a.s).into_owned()
            });
        // With integer factors, asymmetric+floor is PyTorch's `nearest` exactly.
        if ctm != "asymmetric" || nearest != "floor" {
            return Err(self.unsupported(
                node,
                format!("coordinate_transformation_mode {ctm} with nearest_mode {nearest} (PyTorch's nearest: asymmetric, floor)"),
            ));
        }
        let d = self.b.shape(x).dims().to_vec();
        let get = |im: &mut Self, i: usize| -> Result<Option<Vec<f64>>> {
            match values.get(i).cloned().flatten() {
                Some(v) => Ok(im.as_const(&v)?.map(|c| c.to_f64())),
                None => Ok(None),
            }
        };
        let factors: Vec<f64> = match (get(self, 2)?, get(self, 3)?) {
            (Some(s), _) if !s.is_empty() => s,
            (_, Some(sizes)) if sizes.len() == 4 => {
                sizes.iter().zip(&d).map(|(&o, &i)| o / i as f64).collect()
            }
            _ => return Err(self.unsupported(node, "scales or sizes computed from activations")),
        };
        let int = |f: f64| (f >= 1.0 && f.fract() == 0.0).then_some(f as usize);
        match factors.as_slice() {
            &[n, c, h, w] if n == 1.0 && c == 1.0 => {
                match (int(h), int(w)) {
                    (Some(h), Some(w)) => {
                        self.b.upsample_nearest2d(x, [h, w]).map_err(|e| self.err_ir(node, e))
                    }
                    _ => Err(self
                        .unsupported(node, format!("scale factors {h}, {w} (integers ≥ 1 only)"))),
                }
            }
            f => Err(self.unsupported(node, format!("scales {f:?} (H and W of NCHW only)"))),
        }
    }
}
