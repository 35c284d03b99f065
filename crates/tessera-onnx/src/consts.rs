//! Constant folding: ONNX operators evaluated on [`Const`] inputs at import time.
//!
//! `torch.onnx.export` with dynamic axes writes the shape arithmetic of a model as nodes
//! (`Shape → Gather → Unsqueeze → Concat → Reshape`), and builds masks, position ids and rotary
//! tables from it. Once `--batch` and `--seq` bind the dynamic axes, all of that is constant:
//! it is folded here, and only the computation on activations becomes IR.

use crate::attrs;
use crate::tensor::{broadcast_index, broadcast_shape, strides, Const, Elem};
use onnx_protobuf::NodeProto;

/// Why a constant evaluation failed (the importer adds the node).
pub type Fold<T> = std::result::Result<T, String>;

/// The most elements a folded constant may hold (2 GiB of f64): masks grow with seq², and a
/// file's mask at a sequence far beyond what fits is refused, not allowed to exhaust memory.
pub const MAX_FOLD_ELEMENTS: usize = 1 << 28;

fn guard(shape: &[usize]) -> Fold<()> {
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match n {
        Some(n) if n <= MAX_FOLD_ELEMENTS => Ok(()),
        _ => Err(format!(
            "folding it would hold a constant of shape {shape:?}, more than 2^28 elements (an \
             attention mask at this sequence length); profile or plan at a shorter --seq"
        )),
    }
}

/// Evaluates `node` on constant inputs (`None` for an omitted optional input). `Ok(None)`:
/// the operator is not one this module folds.
pub fn eval(node: &NodeProto, x: &[Option<&Const>]) -> Fold<Option<Vec<Const>>> {
    let arg = |i: usize| -> Fold<&Const> {
        x.get(i).copied().flatten().ok_or_else(|| format!("input {i} is missing"))
    };
    let one = |c: Const| Ok(Some(vec![c]));
    match node.op_type.as_str() {
        "Identity" => one(arg(0)?.clone()),
        "Neg" => one(unary(arg(0)?, |v| -v)),
        "Abs" => one(unary(arg(0)?, f64::abs)),
        "Sqrt" => one(float_unary(arg(0)?, f64::sqrt)),
        "Reciprocal" => one(float_unary(arg(0)?, |v| 1.0 / v)),
        "Exp" => one(float_unary(arg(0)?, f64::exp)),
        "Log" => one(float_unary(arg(0)?, f64::ln)),
        "Cos" => one(float_unary(arg(0)?, f64::cos)),
        "Sin" => one(float_unary(arg(0)?, f64::sin)),
        "Tanh" => one(float_unary(arg(0)?, f64::tanh)),
        "Sigmoid" => one(float_unary(arg(0)?, |v| 1.0 / (1.0 + (-v).exp()))),
        "Relu" => one(unary(arg(0)?, |v| v.max(0.0))),
        "Floor" => one(unary(arg(0)?, f64::floor)),
        "Ceil" => one(unary(arg(0)?, f64::ceil)),
        "Not" => one(logic(arg(0)?, arg(0)?, |a, _| !a)?),
        "Add" => one(arith(arg(0)?, arg(1)?, |a, b| a + b, |a, b| a.wrapping_add(b))?),
        "Sub" => one(arith(arg(0)?, arg(1)?, |a, b| a - b, |a, b| a.wrapping_sub(b))?),
        "Mul" => one(arith(arg(0)?, arg(1)?, |a, b| a * b, |a, b| a.wrapping_mul(b))?),
        "Div" => one(arith(arg(0)?, arg(1)?, |a, b| a / b, |a, b| a.checked_div(b).unwrap_or(0))?),
        "Mod" => one(arith(arg(0)?, arg(1)?, |a, b| a % b, |a, b| a.checked_rem(b).unwrap_or(0))?),
        "Max" | "Min" if x.len() != 2 => Err(format!("{} of {} inputs", node.op_type, x.len())),
        "Max" => one(arith(arg(0)?, arg(1)?, f64::max, i64::max)?),
        "Min" => one(arith(arg(0)?, arg(1)?, f64::min, i64::min)?),
        "Pow" => {
            let (a, b) = (arg(0)?, arg(1)?);
            let out = zip(a, b, |p, q| p.powf(q))?;
            one(if a.elem == Elem::Float { out } else { to_int(out) })
        }
        "Equal" => one(compare(arg(0)?, arg(1)?, |a, b| a == b)?),
        "Less" => one(compare(arg(0)?, arg(1)?, |a, b| a < b)?),
        "LessOrEqual" => one(compare(arg(0)?, arg(1)?, |a, b| a <= b)?),
        "Greater" => one(compare(arg(0)?, arg(1)?, |a, b| a > b)?),
        "GreaterOrEqual" => one(compare(arg(0)?, arg(1)?, |a, b| a >= b)?),
        "And" => one(logic(arg(0)?, arg(1)?, |a, b| a && b)?),
        "Or" => one(logic(arg(0)?, arg(1)?, |a, b| a || b)?),
        "Xor" => one(logic(arg(0)?, arg(1)?, |a, b| a != b)?),
        "Where" => one(where_(arg(0)?, arg(1)?, arg(2)?)?),
        "Cast" => one(cast(arg(0)?, attrs::int(node, "to", 1))?),
        "Gather" => one(gather(arg(0)?, arg(1)?, attrs::int(node, "axis", 0))?),
        "GatherND" => one(gather_nd(arg(0)?, arg(1)?, attrs::int(node, "batch_dims", 0))?),
        "Unsqueeze" => {
            let axes = axes_of(node, x.get(1).copied().flatten())?.ok_or("no axes")?;
            let c = arg(0)?;
            one(c.reshaped(unsqueeze_shape(&c.shape, &axes)?))
        }
        "Squeeze" => {
            let c = arg(0)?;
            let axes = axes_of(node, x.get(1).copied().flatten())?;
            one(c.reshaped(squeeze_shape(&c.shape, axes.as_deref())?))
        }
        "Flatten" => {
            let c = arg(0)?;
            let a = attrs::axis_in(attrs::int(node, "axis", 1), c.shape.len() + 1)?;
            let outer = c.shape[..a].iter().product();
            one(c.reshaped(vec![outer, c.numel() / outer.max(1)]))
        }
        "Concat" => {
            let parts = (0..x.len()).map(arg).collect::<Fold<Vec<_>>>()?;
            one(concat(&parts, attrs::int(node, "axis", 0))?)
        }
        "Slice" => one(slice(arg(0)?, &x[1..])?),
        "Reshape" => {
            let c = arg(0)?;
            guard(&c.shape)?;
            let shape =
                reshape_target(&c.shape, &arg(1)?.to_i64(), attrs::int(node, "allowzero", 0))?;
            one(c.reshaped(shape))
        }
        "Expand" => one(expand(arg(0)?, &arg(1)?.to_i64())?),
        "Transpose" => {
            let c = arg(0)?;
            let perm = attrs::ints(node, "perm")
                .map(|p| p.iter().map(|&v| v as usize).collect::<Vec<_>>())
                .unwrap_or_else(|| (0..c.shape.len()).rev().collect());
            one(transpose(c, &perm)?)
        }
        "Range" => one(range(arg(0)?, arg(1)?, arg(2)?)?),
        "ConstantOfShape" => {
            let shape = dims_of(&arg(0)?.to_i64())?;
            let fill = match attrs::tensor(node, "value") {
                Some(t) => crate::tensor::decode(t, std::path::Path::new("."))
                    .map_err(|e| e.to_string())?,
                None => Const::floats(vec![1], vec![0.0]),
            };
            one(Const::filled(&fill, shape))
        }
        "Trilu" => {
            let k = x.get(1).copied().flatten().map_or(0, |c| c.i(0));
            one(trilu(arg(0)?, k, attrs::int(node, "upper", 1) != 0)?)
        }
        "CumSum" => one(cumsum(
            arg(0)?,
            arg(1)?.i(0),
            attrs::int(node, "exclusive", 0) != 0,
            attrs::int(node, "reverse", 0) != 0,
        )?),
        "MatMul" => one(matmul(arg(0)?, arg(1)?)?),
        _ => Ok(None),
    }
}

fn unary(c: &Const, f: impl Fn(f64) -> f64) -> Const {
    if c.is_int() {
        let v = c.to_i64().into_iter().map(|a| f(a as f64) as i64).collect();
        Const::ints(c.shape.clone(), v).with_elem(c.elem)
    } else {
        Const::floats(c.shape.clone(), c.to_f64().into_iter().map(f).collect())
    }
}

fn float_unary(c: &Const, f: impl Fn(f64) -> f64) -> Const {
    Const::floats(c.shape.clone(), c.to_f64().into_iter().map(f).collect())
}

/// Elementwise with broadcasting, computed in f64.
fn zip(a: &Const, b: &Const, f: impl Fn(f64, f64) -> f64) -> Fold<Const> {
    let (x, y, out) = both(a, b)?;
    let (xs, ys) = (x.to_f64(), y.to_f64());
    Ok(Const::floats(out, xs.into_iter().zip(ys).map(|(p, q)| f(p, q)).collect()))
}

/// Both operands as views broadcast to their common shape.
fn both(a: &Const, b: &Const) -> Fold<(Const, Const, Vec<usize>)> {
    let out = broadcast_shape(&a.shape, &b.shape)
        .ok_or_else(|| format!("shapes {:?} and {:?} do not broadcast", a.shape, b.shape))?;
    guard(&out)?;
    let x = a.broadcast_to(&out).ok_or("does not broadcast")?;
    let y = b.broadcast_to(&out).ok_or("does not broadcast")?;
    Ok((x, y, out))
}

fn to_int(c: Const) -> Const {
    Const::ints(c.shape.clone(), c.to_i64())
}

fn arith(
    a: &Const,
    b: &Const,
    f: impl Fn(f64, f64) -> f64,
    g: impl Fn(i64, i64) -> i64,
) -> Fold<Const> {
    if a.elem == Elem::Float || b.elem == Elem::Float {
        return zip(a, b, f);
    }
    let (x, y, out) = both(a, b)?;
    let (xs, ys) = (x.to_i64(), y.to_i64());
    Ok(Const::ints(out, xs.into_iter().zip(ys).map(|(p, q)| g(p, q)).collect()))
}

fn compare(a: &Const, b: &Const, f: impl Fn(f64, f64) -> bool) -> Fold<Const> {
    let (x, y, out) = both(a, b)?;
    let (xs, ys) = (x.to_f64(), y.to_f64());
    Ok(Const::bools(out, xs.into_iter().zip(ys).map(|(p, q)| f(p, q)).collect()))
}

fn logic(a: &Const, b: &Const, f: impl Fn(bool, bool) -> bool) -> Fold<Const> {
    compare(a, b, |p, q| f(p != 0.0, q != 0.0))
}

fn where_(c: &Const, a: &Const, b: &Const) -> Fold<Const> {
    let ab = broadcast_shape(&a.shape, &b.shape).ok_or("branches do not broadcast")?;
    let out = broadcast_shape(&c.shape, &ab).ok_or("condition does not broadcast")?;
    guard(&out)?;
    let view = |t: &Const| t.broadcast_to(&out).ok_or_else(|| "does not broadcast".to_string());
    let (cv, av, bv) = (view(c)?.to_i64(), view(a)?, view(b)?);
    if a.elem == Elem::Float || b.elem == Elem::Float {
        let (x, y) = (av.to_f64(), bv.to_f64());
        let v = cv.iter().zip(x.into_iter().zip(y)).map(|(&k, (p, q))| if k != 0 { p } else { q });
        Ok(Const::floats(out, v.collect()))
    } else {
        let (x, y) = (av.to_i64(), bv.to_i64());
        let v = cv.iter().zip(x.into_iter().zip(y)).map(|(&k, (p, q))| if k != 0 { p } else { q });
        Ok(Const::ints(out, v.collect()).with_elem(a.elem))
    }
}

fn cast(c: &Const, to: i64) -> Fold<Const> {
    let to =
        i32::try_from(to).ok().and_then(crate::tensor::elem_of).ok_or("unsupported cast type")?;
    Ok(match to {
        Elem::Float => Const::floats(c.shape.clone(), c.to_f64()),
        Elem::Int => Const::ints(c.shape.clone(), c.to_i64()),
        Elem::Bool => Const::bools(c.shape.clone(), c.to_f64().iter().map(|&v| v != 0.0).collect()),
    })
}

fn gather(c: &Const, idx: &Const, axis: i64) -> Fold<Const> {
    let a = attrs::axis_in(axis, c.shape.len())?;
    let st = strides(&c.shape);
    let n = c.shape[a] as i64;
    let (outer, inner): (usize, usize) =
        (c.shape[..a].iter().product(), c.shape[a + 1..].iter().product());
    let ids = idx
        .to_i64()
        .into_iter()
        .map(|i| {
            let i = if i < 0 { i + n } else { i };
            (0..n).contains(&i).then_some(i as usize).ok_or(format!("index {i} outside 0..{n}"))
        })
        .collect::<Fold<Vec<usize>>>()?;
    guard(&[outer, ids.len(), inner])?;
    let mut flat = Vec::with_capacity(outer * ids.len() * inner);
    for o in 0..outer {
        for &i in &ids {
            for k in 0..inner {
                flat.push(o * st[a] * c.shape[a] + i * st[a] + k);
            }
        }
    }
    let mut shape = c.shape[..a].to_vec();
    shape.extend(&idx.shape);
    shape.extend(&c.shape[a + 1..]);
    Ok(c.gather_flat(shape, flat.into_iter()))
}

/// ONNX `GatherND`: index tuples of the last axis of `idx` into `c`, after `b` batch axes
/// the two share.
fn gather_nd(c: &Const, idx: &Const, b: i64) -> Fold<Const> {
    let (r, q) = (c.shape.len(), idx.shape.len());
    let b = usize::try_from(b).map_err(|_| format!("batch_dims {b} is negative"))?;
    let k = *idx.shape.last().ok_or("GatherND of scalar indices")?;
    if b >= r.min(q) || b + k > r || idx.shape[..b] != c.shape[..b] {
        return Err(format!(
            "indices {:?} (batch_dims {b}) do not index data {:?}",
            idx.shape, c.shape
        ));
    }
    let st = strides(&c.shape);
    let lead = &idx.shape[..q - 1];
    let tuples = lead.iter().product::<usize>();
    let inner: usize = c.shape[b + k..].iter().product();
    guard(&[tuples, inner])?;
    let ids = idx.to_i64();
    let lead_st = strides(lead);
    let mut flat = Vec::with_capacity(tuples * inner);
    for j in 0..tuples {
        let mut off = 0usize;
        for d in 0..b {
            off += (j / lead_st[d]) % lead[d] * st[d];
        }
        for t in 0..k {
            let n = c.shape[b + t] as i64;
            let i = ids[j * k + t];
            let i = if i < 0 { i + n } else { i };
            if !(0..n).contains(&i) {
                return Err(format!("index {i} outside 0..{n}"));
            }
            off += i as usize * st[b + t];
        }
        flat.extend(off..off + inner);
    }
    let mut shape = lead.to_vec();
    shape.extend(&c.shape[b + k..]);
    Ok(c.gather_flat(shape, flat.into_iter()))
}

/// `axes` from the second input (opset ≥ 13) or the attribute (older opsets).
pub fn axes_of(node: &NodeProto, input: Option<&Const>) -> Fold<Option<Vec<i64>>> {
    Ok(match input {
        Some(c) => Some(c.to_i64()),
        None => attrs::ints(node, "axes"),
    })
}

pub fn unsqueeze_shape(shape: &[usize], axes: &[i64]) -> Fold<Vec<usize>> {
    let rank = shape.len() + axes.len();
    let mut at: Vec<usize> = axes.iter().map(|&a| attrs::axis_in(a, rank)).collect::<Fold<_>>()?;
    at.sort_unstable();
    let mut out = Vec::with_capacity(rank);
    let mut src = shape.iter();
    for d in 0..rank {
        if at.contains(&d) {
            out.push(1);
        } else {
            out.push(*src.next().ok_or("too many axes")?);
        }
    }
    Ok(out)
}

pub fn squeeze_shape(shape: &[usize], axes: Option<&[i64]>) -> Fold<Vec<usize>> {
    let drop: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&a| attrs::axis_in(a, shape.len())).collect::<Fold<_>>()?,
        None => (0..shape.len()).filter(|&d| shape[d] == 1).collect(),
    };
    if drop.iter().any(|&d| shape[d] != 1) {
        return Err(format!("cannot squeeze a dimension other than 1 in {shape:?}"));
    }
    Ok((0..shape.len()).filter(|d| !drop.contains(d)).map(|d| shape[d]).collect())
}

fn concat(parts: &[&Const], axis: i64) -> Fold<Const> {
    let first = parts.first().ok_or("no inputs")?;
    let a = attrs::axis_in(axis, first.shape.len())?;
    let outer: usize = first.shape[..a].iter().product();
    let float = parts.iter().any(|p| p.elem == Elem::Float);
    let mut shape = first.shape.clone();
    shape[a] = parts.iter().map(|p| p.shape.get(a).copied().unwrap_or(0)).sum();
    guard(&shape)?;
    if float {
        let vals: Vec<Vec<f64>> = parts.iter().map(|p| p.to_f64()).collect();
        let mut f = Vec::with_capacity(shape.iter().product());
        for o in 0..outer {
            for v in &vals {
                let chunk = v.len() / outer.max(1);
                f.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
            }
        }
        Ok(Const::floats(shape, f))
    } else {
        let vals: Vec<Vec<i64>> = parts.iter().map(|p| p.to_i64()).collect();
        let mut i = Vec::with_capacity(shape.iter().product());
        for o in 0..outer {
            for v in &vals {
                let chunk = v.len() / outer.max(1);
                i.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
            }
        }
        Ok(Const::ints(shape, i).with_elem(first.elem))
    }
}

/// The per-axis (start, end, step) of a `Slice`, clamped as the spec says; returns the
/// output extent per axis.
pub fn slice_params(shape: &[usize], x: &[Option<&Const>]) -> Fold<Vec<(usize, i64, usize)>> {
    let get = |i: usize| x.get(i).copied().flatten().map(Const::to_i64);
    let starts = get(0).ok_or("no starts")?;
    let ends = get(1).ok_or("no ends")?;
    let axes = get(2).unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = get(3).unwrap_or_else(|| vec![1; starts.len()]);
    let mut out: Vec<(usize, i64, usize)> = shape.iter().map(|&n| (0, 1, n)).collect();
    for (k, &start) in starts.iter().enumerate() {
        let a = attrs::axis_in(*axes.get(k).ok_or("axes shorter than starts")?, shape.len())?;
        let n = shape[a] as i64;
        let step = *steps.get(k).ok_or("steps shorter than starts")?;
        if step == 0 {
            return Err("step 0".into());
        }
        let norm = |v: i64| if v < 0 { v + n } else { v };
        let (s, e) = (norm(start), norm(*ends.get(k).ok_or("ends shorter than starts")?));
        let (s, e) = if step > 0 {
            (s.clamp(0, n), e.clamp(0, n))
        } else {
            (s.clamp(0, n - 1), e.clamp(-1, n - 1))
        };
        let len = if step > 0 {
            (e - s + step - 1).max(0) / step
        } else {
            (s - e - step - 1).max(0) / -step
        };
        out[a] = (s as usize, step, len as usize);
    }
    Ok(out)
}

fn slice(c: &Const, rest: &[Option<&Const>]) -> Fold<Const> {
    let p = slice_params(&c.shape, rest)?;
    Ok(c.sliced(&p))
}

pub fn dims_of(v: &[i64]) -> Fold<Vec<usize>> {
    v.iter().map(|&d| usize::try_from(d).map_err(|_| format!("negative dimension {d}"))).collect()
}

/// `Reshape`'s target: `0` copies the input's dimension (unless `allowzero`), one `-1` is
/// inferred.
pub fn reshape_target(shape: &[usize], target: &[i64], allowzero: i64) -> Fold<Vec<usize>> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &t) in target.iter().enumerate() {
        match t {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if allowzero == 0 => out.push(*shape.get(i).ok_or("0 beyond the input's rank")?),
            t if t >= 0 => out.push(t as usize),
            _ => return Err(format!("bad reshape target {target:?}")),
        }
    }
    let known: usize = out.iter().product();
    if let Some(i) = infer {
        if known == 0 || !n.is_multiple_of(known) {
            return Err(format!("cannot reshape {shape:?} to {target:?}"));
        }
        out[i] = n / known;
    } else if known != n {
        return Err(format!("cannot reshape {shape:?} ({n} elements) to {out:?}"));
    }
    Ok(out)
}

/// `Expand`'s output shape: a bidirectional broadcast of the input with the target.
pub fn expand_shape(shape: &[usize], target: &[i64]) -> Fold<Vec<usize>> {
    let t = dims_of(target)?;
    broadcast_shape(shape, &t).ok_or_else(|| format!("cannot expand {shape:?} to {t:?}"))
}

fn expand(c: &Const, target: &[i64]) -> Fold<Const> {
    let out = expand_shape(&c.shape, target)?;
    c.broadcast_to(&out).ok_or_else(|| format!("cannot expand {:?} to {out:?}", c.shape))
}

pub fn transpose(c: &Const, perm: &[usize]) -> Fold<Const> {
    let mut seen = perm.to_vec();
    seen.sort_unstable();
    if perm.len() != c.shape.len() || seen.iter().enumerate().any(|(i, &p)| i != p) {
        return Err(format!("perm {perm:?} for rank {}", c.shape.len()));
    }
    Ok(c.permuted(perm))
}

fn range(start: &Const, limit: &Const, delta: &Const) -> Fold<Const> {
    let (s, l, d) = (start.f(0), limit.f(0), delta.f(0));
    if d == 0.0 {
        return Err("delta 0".into());
    }
    let n = ((l - s) / d).ceil().max(0.0) as usize;
    guard(&[n])?;
    let v: Vec<f64> = (0..n).map(|i| s + i as f64 * d).collect();
    Ok(if start.elem == Elem::Float {
        Const::floats(vec![n], v)
    } else {
        Const::ints(vec![n], v.into_iter().map(|x| x as i64).collect())
    })
}

fn trilu(c: &Const, k: i64, upper: bool) -> Fold<Const> {
    let r = c.shape.len();
    if r < 2 {
        return Err("Trilu needs rank ≥ 2".into());
    }
    guard(&c.shape)?;
    let (rows, cols) = (c.shape[r - 2], c.shape[r - 1]);
    let keep = |f: usize| {
        let (i, j) = ((f / cols % rows) as i64, (f % cols) as i64);
        if upper {
            j - i >= k
        } else {
            j - i <= k
        }
    };
    Ok(if c.is_int() {
        let v = c.to_i64().into_iter().enumerate().map(|(f, x)| if keep(f) { x } else { 0 });
        Const::ints(c.shape.clone(), v.collect()).with_elem(c.elem)
    } else {
        let v = c.to_f64().into_iter().enumerate().map(|(f, x)| if keep(f) { x } else { 0.0 });
        Const::floats(c.shape.clone(), v.collect())
    })
}

fn cumsum(c: &Const, axis: i64, exclusive: bool, reverse: bool) -> Fold<Const> {
    let a = attrs::axis_in(axis, c.shape.len())?;
    guard(&c.shape)?;
    let st = strides(&c.shape);
    let n = c.shape[a];
    let mut out = c.to_f64();
    let src = c.to_f64();
    for base in 0..c.numel() {
        if !(base / st[a]).is_multiple_of(n) {
            continue;
        }
        let mut acc = 0.0;
        let order: Vec<usize> = if reverse { (0..n).rev().collect() } else { (0..n).collect() };
        for i in order {
            let f = base + i * st[a];
            if exclusive {
                out[f] = acc;
                acc += src[f];
            } else {
                acc += src[f];
                out[f] = acc;
            }
        }
    }
    Ok(if c.elem == Elem::Float {
        Const::floats(c.shape.clone(), out)
    } else {
        Const::ints(c.shape.clone(), out.into_iter().map(|x| x as i64).collect())
    })
}

fn matmul(a: &Const, b: &Const) -> Fold<Const> {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || rb < 2 {
        return Err("constant MatMul of vectors is not folded".into());
    }
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    if b.shape[rb - 2] != k {
        return Err(format!("MatMul {:?} x {:?}", a.shape, b.shape));
    }
    let batch = broadcast_shape(&a.shape[..ra - 2], &b.shape[..rb - 2])
        .ok_or("batch dims do not broadcast")?;
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    guard(&out_shape)?;
    let ia = broadcast_index(&a.shape[..ra - 2], &batch);
    let ib = broadcast_index(&b.shape[..rb - 2], &batch);
    let mut out = Vec::with_capacity(ia.len() * m * n);
    for (&pa, &pb) in ia.iter().zip(&ib) {
        for i in 0..m {
            for j in 0..n {
                out.push(
                    (0..k).map(|l| a.f(pa * m * k + i * k + l) * b.f(pb * k * n + l * n + j)).sum(),
                );
            }
        }
    }
    let mut shape = batch;
    shape.extend([m, n]);
    Ok(Const::floats(shape, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_follow_the_spec() {
        let c = Const::ints(vec![2, 5], (0..10).collect());
        let s = Const::ints(vec![1], vec![1]);
        let e = Const::ints(vec![1], vec![i64::MAX]);
        let ax = Const::ints(vec![1], vec![-1]);
        let st = Const::ints(vec![1], vec![2]);
        let out = slice(&c, &[Some(&s), Some(&e), Some(&ax), Some(&st)]).unwrap();
        assert_eq!(out.shape, vec![2, 2]);
        assert_eq!(out.to_i64(), vec![1, 3, 6, 8]);
        // Negative step walks backwards from the clamped start.
        let s = Const::ints(vec![1], vec![-1]);
        let e = Const::ints(vec![1], vec![i64::MIN]);
        let st = Const::ints(vec![1], vec![-1]);
        let out = slice(&c, &[Some(&s), Some(&e), Some(&ax), Some(&st)]).unwrap();
        assert_eq!(out.to_i64(), vec![4, 3, 2, 1, 0, 9, 8, 7, 6, 5]);
    }

    #[test]
    fn folding_refuses_constants_beyond_the_bound() {
        // A [2^15, 2^15] mask (sequence 32768): 2^30 elements.
        let big = Const::floats(vec![], vec![0.0]);
        let big = Const::filled(&big, vec![1 << 15, 1 << 15]);
        let err = trilu(&big, 1, true).unwrap_err();
        assert!(err.contains("2^28") && err.contains("--seq"), "{err}");
        let one = Const::floats(vec![1], vec![1.0]);
        assert!(zip(&big, &one, |a, b| a + b).is_err());
    }

    #[test]
    fn gather_transpose_and_trilu() {
        let c = Const::ints(vec![2, 3], vec![0, 1, 2, 3, 4, 5]);
        let g = gather(&c, &Const::ints(vec![2], vec![2, -3]), 1).unwrap();
        assert_eq!((g.shape.clone(), g.to_i64()), (vec![2, 2], vec![2, 0, 5, 3]));
        let t = transpose(&c, &[1, 0]).unwrap();
        assert_eq!(t.to_i64(), vec![0, 3, 1, 4, 2, 5]);
        let ones = Const::ints(vec![3, 3], vec![1; 9]);
        assert_eq!(trilu(&ones, 1, true).unwrap().to_i64(), vec![0, 1, 1, 0, 0, 1, 0, 0, 0]);
        assert_eq!(reshape_target(&[2, 3, 4], &[0, -1], 0).unwrap(), vec![2, 12]);
        assert_eq!(unsqueeze_shape(&[3], &[0, -1]).unwrap(), vec![1, 3, 1]);
    }
}
