//! The reference interpreter's kernels, part 2: embedding, cross-entropy, attention, RoPE,
//! the KV cache, quantised matmul, AdamW and `erf`.

use super::kernels::*;
use super::Value;
use crate::dist::{ShardOf, TableRows};
use crate::ops::optim;
use crate::{AdamWSpec, AttentionSpec, Shape};

/// The lookup on `rows` of the table (the whole table, or the mesh origin's vocabulary shard:
/// ids another shard holds read zeros).
pub(super) fn embedding(
    table: &Value,
    ids: &Value,
    rows: Option<&ShardOf>,
) -> Result<Value, String> {
    ensure!(table.shape.rank() == 2, "table {} must be [num_embeddings, dim]", table.shape);
    let (v, d) = (table.dims()[0], table.dims()[1]);
    let rows = TableRows::of(rows, v, None).map_err(|e| e.to_string())?;
    let mut data = Vec::with_capacity(ids.numel() * d);
    for &id in &ids.data {
        match rows.local(index_in(id, rows.vocab, "id")?) {
            Some(r) => data.extend_from_slice(&table.data[r * d..(r + 1) * d]),
            None => data.resize(data.len() + d, 0.0),
        }
    }
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    Ok(Value { shape: Shape::from(dims), data })
}

pub(super) fn embedding_backward(
    ids: &Value,
    dy: &Value,
    num_embeddings: usize,
    rows: Option<&ShardOf>,
) -> Result<Value, String> {
    let rows = TableRows::of(rows, num_embeddings, None).map_err(|e| e.to_string())?;
    let d = last_dim(dy)?;
    ensure!(
        dy.numel() == ids.numel() * d,
        "dy {} must be ids' shape {} plus one dim",
        dy.shape,
        ids.shape
    );
    let mut out = vec![0.0; num_embeddings * d];
    for (k, &id) in ids.data.iter().enumerate() {
        if let Some(r) = rows.local(index_in(id, rows.vocab, "id")?) {
            axpy(&mut out[r * d..(r + 1) * d], 1.0, &dy.data[k * d..(k + 1) * d]);
        }
    }
    Ok(Value { shape: Shape::from(vec![num_embeddings, d]), data: out })
}

/// The class of a target row, or `None` when it is ignored.
pub(super) fn target_class(
    t: f64,
    classes: usize,
    ignore_index: Option<i64>,
) -> Result<Option<usize>, String> {
    if ignore_index.is_some_and(|ig| t == ig as f64) {
        return Ok(None);
    }
    index_in(t, classes, "target").map(Some)
}

pub(super) fn check_logits(logits: &Value, targets: &Value) -> Result<usize, String> {
    let v = last_dim(logits)?;
    let ld = logits.dims();
    ensure!(
        ld.len() >= 2 && &ld[..ld.len() - 1] == targets.dims(),
        "logits {} must be targets' shape {} plus a class dim",
        logits.shape,
        targets.shape
    );
    Ok(v)
}

pub(super) fn logsumexp(row: &[f64]) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

/// The mean (or, `sum`, the sum) over the non-ignored rows. With `classes` (the mesh
/// origin's share of the vocabulary) and each row's log-sum-exp over every class in `lse`:
/// that shard's part of the loss (see [`crate::Op::CrossEntropy`]).
pub(super) fn cross_entropy(
    logits: &Value,
    targets: &Value,
    lse: Option<&Value>,
    ignore_index: Option<i64>,
    sum: bool,
    classes: Option<&ShardOf>,
) -> Result<Vec<Value>, String> {
    let v = check_logits(logits, targets)?;
    let rows = TableRows::of(classes, v, None).map_err(|e| e.to_string())?;
    if let Some(l) = lse {
        ensure!(l.shape == targets.shape, "logsumexp {} must have targets' shape", l.shape);
    }
    let mut out_lse = vec![0.0; targets.numel()];
    let (mut total, mut count) = (0.0, 0usize);
    for (r, (&t, l)) in targets.data.iter().zip(&mut out_lse).enumerate() {
        let row = &logits.data[r * v..(r + 1) * v];
        *l = match lse {
            Some(g) => g.data[r],
            None => logsumexp(row),
        };
        if let Some(c) = target_class(t, rows.vocab, ignore_index)? {
            if rows.first == 0 {
                total += *l;
            }
            if let Some(k) = rows.local(c) {
                total -= row[k];
            }
            count += 1;
        }
    }
    let denominator = if sum { 1 } else { count.max(1) };
    Ok(vec![
        Value::scalar(total / denominator as f64),
        Value { shape: targets.shape.clone(), data: out_lse },
    ])
}

#[allow(clippy::too_many_arguments)]
pub(super) fn cross_entropy_backward(
    logits: &Value,
    targets: &Value,
    lse: &Value,
    dloss: &Value,
    ignore_index: Option<i64>,
    sum: bool,
    classes: Option<&ShardOf>,
) -> Result<Value, String> {
    let v = check_logits(logits, targets)?;
    let rows = TableRows::of(classes, v, None).map_err(|e| e.to_string())?;
    ensure!(lse.shape == targets.shape, "logsumexp {} must have targets' shape", lse.shape);
    ensure!(dloss.numel() == 1, "dloss must be a scalar, got {}", dloss.shape);
    let mut picked = Vec::with_capacity(targets.numel());
    for &t in &targets.data {
        picked.push(target_class(t, rows.vocab, ignore_index)?);
    }
    let count = picked.iter().filter(|c| c.is_some()).count();
    let g = dloss.data[0] / if sum { 1 } else { count.max(1) } as f64;
    let mut out = vec![0.0; logits.numel()];
    for (r, c) in picked.into_iter().enumerate() {
        let Some(c) = c else { continue };
        let row = &logits.data[r * v..(r + 1) * v];
        let orow = &mut out[r * v..(r + 1) * v];
        for (o, &l) in orow.iter_mut().zip(row) {
            *o = g * (l - lse.data[r]).exp();
        }
        if let Some(k) = rows.local(c) {
            orow[k] -= g;
        }
    }
    Ok(Value { shape: logits.shape.clone(), data: out })
}

/// `log Σ exp` over the last dim.
pub(super) fn logsumexp_rows(x: &Value) -> Result<Value, String> {
    let v = last_dim(x)?;
    let dims = x.dims();
    let shape = Shape::from(dims[..dims.len() - 1].to_vec());
    let data = if v == 0 {
        vec![f64::NEG_INFINITY; shape.numel() as usize]
    } else {
        x.data.chunks(v).map(logsumexp).collect()
    };
    Ok(Value { shape, data })
}

// ---- attention and rope ----------------------------------------------------------------------

/// Dims of a q/k/v operand and the attention geometry.
struct AttnDims {
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    /// Per local query head, the KV head it reads.
    kv_of: Vec<usize>,
    /// Ring attention: the global positions of the queries and of the keys.
    ring: Option<(Vec<i64>, Vec<i64>)>,
}

impl AttnDims {
    fn new(q: &Value, k: &Value, v: &Value, spec: &AttentionSpec) -> Result<AttnDims, String> {
        let (&[b, s, h, d], &[bk, t, hkv, dk]) = (q.dims(), k.dims()) else {
            return Err(format!(
                "q {} and k {} must be [batch, seq, heads, head_dim]",
                q.shape, k.shape
            ));
        };
        ensure!(v.shape == k.shape, "v {} must match k {}", v.shape, k.shape);
        ensure!(
            bk == b && dk == d,
            "k {} must share batch and head_dim with q {}",
            k.shape,
            q.shape
        );
        let kv_of = spec.kv_heads_of(h, hkv, None).map_err(|e| e.to_string())?;
        let ring = spec.ring.map(|r| r.positions(s, t, None));
        Ok(AttnDims { b, s, t, h, hkv, d, kv_of, ring })
    }
    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.s + i) * self.h + h) * self.d
    }
    fn kv_at(&self, b: usize, j: usize, h: usize) -> usize {
        ((b * self.t + j) * self.hkv + self.kv_of[h]) * self.d
    }
    fn lse_at(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.h + h) * self.s + i
    }
    /// The position of query `i` of row `b`: `start[b] + i` with a start input, else the
    /// last S of T positions.
    fn pos(&self, start: Option<&Value>, b: usize, i: usize) -> i64 {
        match (start, &self.ring) {
            (Some(st), _) => st.data[b] as i64 + i as i64,
            (None, Some((q, _))) => q[i],
            (None, None) => i as i64 + self.t as i64 - self.s as i64,
        }
    }
    /// The position of key `j`.
    fn key_pos(&self, j: usize) -> i64 {
        self.ring.as_ref().map_or(j as i64, |(_, k)| k[j])
    }
    /// Whether the query at position `p` may attend to key `j`.
    fn visible(&self, spec: &AttentionSpec, p: i64, j: usize) -> bool {
        let j = self.key_pos(j);
        (!spec.causal || j <= p) && spec.window.is_none_or(|w| j > p - w as i64)
    }
}

/// Per local head, the ALiBi slope (0 without ALiBi).
pub(super) fn head_slopes(spec: &AttentionSpec, heads: usize) -> Result<Vec<f64>, String> {
    match &spec.alibi {
        Some(a) => a.local_slopes(heads, None).map_err(|e| e.to_string()),
        None => Ok(vec![0.0; heads]),
    }
}

pub(super) fn attention(
    q: &Value,
    k: &Value,
    v: &Value,
    start: Option<&Value>,
    spec: &AttentionSpec,
) -> Result<Vec<Value>, String> {
    let a = AttnDims::new(q, k, v, spec)?;
    if let Some(st) = start {
        ensure!(st.dims() == [a.b], "start {} must be [batch]", st.shape);
    }
    let slopes = head_slopes(spec, a.h)?;
    let mut out = vec![0.0; q.numel()];
    let mut lse = vec![0.0; a.b * a.h * a.s];
    let mut scores = vec![f64::NEG_INFINITY; a.t];
    for b in 0..a.b {
        for h in 0..a.h {
            for i in 0..a.s {
                let qo = a.q_at(b, i, h);
                let qi = &q.data[qo..qo + a.d];
                let p = a.pos(start, b, i);
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = if a.visible(spec, p, j) {
                        let ko = a.kv_at(b, j, h);
                        spec.scale * dot(qi, &k.data[ko..ko + a.d])
                            + slopes[h] * (a.key_pos(j) - p) as f64
                    } else {
                        f64::NEG_INFINITY
                    };
                }
                let l = logsumexp(&scores);
                lse[a.lse_at(b, h, i)] = l;
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let orow = &mut out[qo..qo + a.d];
                for (j, &s) in scores.iter().enumerate() {
                    if s != f64::NEG_INFINITY {
                        let vo = a.kv_at(b, j, h);
                        axpy(orow, (s - l).exp(), &v.data[vo..vo + a.d]);
                    }
                }
            }
        }
    }
    Ok(vec![
        Value { shape: q.shape.clone(), data: out },
        Value { shape: Shape::from(vec![a.b, a.h, a.s]), data: lse },
    ])
}

/// p = exp(s − lse), dP = dout·v, D = dout·out (less `dlse` with a seventh input),
/// dS = p·(dP − D); dq = scale·Σ_j dS·k_j, dk_j += scale·dS·q, dv_j += p·dout.
pub(super) fn attention_backward(x: &[&Value], spec: &AttentionSpec) -> Result<Vec<Value>, String> {
    let (q, k, v, out, lse, dout) = (x[0], x[1], x[2], x[3], x[4], x[5]);
    let dlse = x.get(6).copied();
    if let Some(g) = dlse {
        ensure!(g.shape == lse.shape, "dlogsumexp {} must match logsumexp", g.shape);
    }
    let a = AttnDims::new(q, k, v, spec)?;
    ensure!(out.shape == q.shape && dout.shape == q.shape, "out and dout must have q's shape");
    ensure!(lse.dims() == [a.b, a.h, a.s], "logsumexp {} must be [B,H,S]", lse.shape);
    let slopes = head_slopes(spec, a.h)?;
    let mut dq = vec![0.0; q.numel()];
    let mut dk = vec![0.0; k.numel()];
    let mut dv = vec![0.0; v.numel()];
    for b in 0..a.b {
        for (h, &slope) in slopes.iter().enumerate() {
            for i in 0..a.s {
                let l = lse.data[a.lse_at(b, h, i)];
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let qo = a.q_at(b, i, h);
                let qi = &q.data[qo..qo + a.d];
                let gi = &dout.data[qo..qo + a.d];
                let big_d = dot(gi, &out.data[qo..qo + a.d])
                    - dlse.map_or(0.0, |g| g.data[a.lse_at(b, h, i)]);
                let pos = a.pos(None, b, i);
                for j in 0..a.t {
                    if !a.visible(spec, pos, j) {
                        continue;
                    }
                    let ko = a.kv_at(b, j, h);
                    let kj = &k.data[ko..ko + a.d];
                    let bias = slope * (a.key_pos(j) - pos) as f64;
                    let p = (spec.scale * dot(qi, kj) + bias - l).exp();
                    let dp = dot(gi, &v.data[ko..ko + a.d]);
                    let ds = p * (dp - big_d);
                    axpy(&mut dq[qo..qo + a.d], spec.scale * ds, kj);
                    axpy(&mut dk[ko..ko + a.d], spec.scale * ds, qi);
                    axpy(&mut dv[ko..ko + a.d], p, gi);
                }
            }
        }
    }
    Ok(vec![
        Value { shape: q.shape.clone(), data: dq },
        Value { shape: k.shape.clone(), data: dk },
        Value { shape: v.shape.clone(), data: dv },
    ])
}

/// The merge weights `w_r = exp(lse_r − L)` of every pair at lse index `at`.
fn merge_weights(lses: &[&Value], at: usize) -> Vec<f64> {
    let l = logsumexp(&lses.iter().map(|v| v.data[at]).collect::<Vec<_>>());
    lses.iter().map(|v| if l == f64::NEG_INFINITY { 0.0 } else { (v.data[at] - l).exp() }).collect()
}

/// An attention merge's outputs, log-sum-exps and `[B,S,H,D]`.
type MergePairs<'a> = (Vec<&'a Value>, Vec<&'a Value>, [usize; 4]);

/// The (out, logsumexp) pairs of an attention merge, checked: `[B,S,H,D]` and `[B,H,S]`.
fn merge_pairs<'a>(x: &[&'a Value]) -> Result<MergePairs<'a>, String> {
    ensure!(
        x.len() >= 2 && x.len().is_multiple_of(2),
        "attention_merge takes pairs, got {}",
        x.len()
    );
    let os: Vec<&Value> = x.iter().step_by(2).copied().collect();
    let ls: Vec<&Value> = x.iter().skip(1).step_by(2).copied().collect();
    let &[b, s, h, d] = os[0].dims() else {
        return Err(format!("out {} must be [B,S,H,D]", os[0].shape));
    };
    for (o, l) in os.iter().zip(&ls) {
        ensure!(o.dims() == [b, s, h, d] && l.dims() == [b, h, s], "merge operands differ");
    }
    Ok((os, ls, [b, s, h, d]))
}

pub(super) fn attention_merge(x: &[&Value]) -> Result<Value, String> {
    let (os, ls, [b, s, h, d]) = merge_pairs(x)?;
    let mut out = vec![0.0; os[0].numel()];
    for (bi, si, hi) in rows_bsh(b, s, h) {
        let w = merge_weights(&ls, (bi * h + hi) * s + si);
        let o = ((bi * s + si) * h + hi) * d;
        for (r, &wr) in w.iter().enumerate() {
            axpy(&mut out[o..o + d], wr, &os[r].data[o..o + d]);
        }
    }
    Ok(Value { shape: os[0].shape.clone(), data: out })
}

/// [`crate::Op::RingMerge`]'s forward: the two pairs' merge and `log(exp(l_run) + exp(l_s))`
/// (inputs past the pairs only feed its backward).
pub(super) fn ring_merge(x: &[&Value]) -> Result<Vec<Value>, String> {
    let o = attention_merge(x)?;
    let (l0, l1) = (x[1], x[3]);
    let data = l0.data.iter().zip(&l1.data).map(|(&a, &b)| logsumexp(&[a, b])).collect();
    Ok(vec![o, Value { shape: l0.shape.clone(), data }])
}

pub(super) fn attention_merge_backward(x: &[&Value]) -> Result<Vec<Value>, String> {
    let (dout, pairs) = x.split_last().ok_or("attention_merge_backward takes inputs")?;
    let (os, ls, [b, s, h, d]) = merge_pairs(pairs)?;
    ensure!(dout.shape == os[0].shape, "dout {} must match out", dout.shape);
    let merged = attention_merge(pairs)?;
    let mut dos: Vec<Vec<f64>> = vec![vec![0.0; dout.numel()]; os.len()];
    let mut dls: Vec<Vec<f64>> = vec![vec![0.0; b * h * s]; os.len()];
    for (bi, si, hi) in rows_bsh(b, s, h) {
        let li = (bi * h + hi) * s + si;
        let w = merge_weights(&ls, li);
        let o = ((bi * s + si) * h + hi) * d;
        let g = &dout.data[o..o + d];
        let whole = dot(g, &merged.data[o..o + d]);
        for (r, &wr) in w.iter().enumerate() {
            axpy(&mut dos[r][o..o + d], wr, g);
            dls[r][li] = wr * (dot(g, &os[r].data[o..o + d]) - whole);
        }
    }
    Ok(dos
        .into_iter()
        .zip(dls)
        .flat_map(|(o, l)| {
            [
                Value { shape: dout.shape.clone(), data: o },
                Value { shape: Shape::from(vec![b, h, s]), data: l },
            ]
        })
        .collect())
}

/// Every (b, s, h) of a `[B,S,H,·]` tensor.
fn rows_bsh(b: usize, s: usize, h: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..b).flat_map(move |bi| (0..s).flat_map(move |si| (0..h).map(move |hi| (bi, si, hi))))
}

pub(super) fn rope(
    x: &Value,
    positions: Option<&Value>,
    inv_freq: &[f64],
    inverse: bool,
) -> Result<Value, String> {
    let &[b, s, h, d] = x.dims() else {
        return Err(format!("x {} must be [batch, seq, heads, head_dim]", x.shape));
    };
    if let Some(ps) = positions {
        ensure!(ps.dims() == [b, s], "positions {} must be [batch, seq]", ps.shape);
    }
    let half = d / 2;
    ensure!(
        d % 2 == 0 && inv_freq.len() == half,
        "head_dim {d} needs {half} frequencies, got {}",
        inv_freq.len()
    );
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut out = vec![0.0; x.numel()];
    for pos in 0..s {
        for bi in 0..b {
            let at = positions.map_or(pos as f64, |ps| ps.data[bi * s + pos]);
            let (sin, cos): (Vec<f64>, Vec<f64>) =
                inv_freq.iter().map(|f| (sign * at * f).sin_cos()).unzip();
            for hi in 0..h {
                let o = ((bi * s + pos) * h + hi) * d;
                let (xr, or) = (&x.data[o..o + d], &mut out[o..o + d]);
                for i in 0..half {
                    or[i] = xr[i] * cos[i] - xr[i + half] * sin[i];
                    or[i + half] = xr[i + half] * cos[i] + xr[i] * sin[i];
                }
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

// ---- inference -------------------------------------------------------------------------------

pub(super) fn cache_write(cache: &Value, x: &Value, start: &Value) -> Result<Value, String> {
    let (&[b, c, h, d], &[bx, s, hx, dx]) = (cache.dims(), x.dims()) else {
        return Err(format!("cache {} and x {} must be 4-d", cache.shape, x.shape));
    };
    ensure!(b == bx && h == hx && d == dx, "x {} does not fit cache {}", x.shape, cache.shape);
    let mut out = cache.clone();
    let row = h * d;
    for bi in 0..b {
        let st = start.data[bi];
        ensure!(
            st >= 0.0 && st as usize + s <= c,
            "row {bi}: positions {st}..{} beyond the cache's {c}",
            st as usize + s
        );
        for i in 0..s {
            let dst = (bi * c + st as usize + i) * row;
            let src = (bi * s + i) * row;
            out.data[dst..dst + row].copy_from_slice(&x.data[src..src + row]);
        }
    }
    Ok(out)
}

pub(super) fn select_positions(x: &Value, index: &Value) -> Result<Value, String> {
    let dims = x.dims();
    ensure!(dims.len() >= 2, "x {} must be [batch, seq, ..]", x.shape);
    let (b, s) = (dims[0], dims[1]);
    let row: usize = dims[2..].iter().product();
    let mut data = Vec::with_capacity(b * row);
    for bi in 0..b {
        let i = index.data[bi];
        ensure!(i >= 0.0 && (i as usize) < s, "row {bi}: position {i} beyond {s}");
        let o = (bi * s + i as usize) * row;
        data.extend_from_slice(&x.data[o..o + row]);
    }
    let mut out = dims.to_vec();
    out[1] = 1;
    Ok(Value { shape: Shape::from(out), data })
}

/// The dequantised weight `[N, K]` of a [`QuantSpec`] weight and its scales.
pub fn dequantize(w: &Value, scales: &Value, q: crate::QuantSpec, k: usize) -> Vec<f64> {
    let n = w.dims()[0];
    let rb = q.row_bytes(k);
    let groups = k / q.group;
    let mut out = vec![0.0; n * k];
    for r in 0..n {
        for f in 0..k {
            let raw = if q.bits == 8 {
                w.data[r * rb + f] as i64 - 128
            } else {
                let byte = w.data[r * rb + f / 2] as i64;
                let nib = if f % 2 == 0 { byte & 15 } else { byte >> 4 };
                nib - 8
            };
            out[r * k + f] = raw as f64 * scales.data[r * groups + f / q.group];
        }
    }
    out
}

pub(super) fn qmatmul(
    x: &Value,
    w: &Value,
    scales: &Value,
    q: crate::QuantSpec,
) -> Result<Value, String> {
    let k = *x.dims().last().ok_or("x has no features")?;
    let n = w.dims()[0];
    ensure!(w.dims() == [n, q.row_bytes(k)], "weight {} does not fit {k} features", w.shape);
    let wf = dequantize(w, scales, q, k);
    let m = x.numel() / k.max(1);
    let mut data = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            data[i * n + j] = dot(&x.data[i * k..(i + 1) * k], &wf[j * k..(j + 1) * k]);
        }
    }
    let mut out = x.dims().to_vec();
    *out.last_mut().unwrap_or(&mut 0) = n;
    Ok(Value { shape: Shape::from(out), data })
}

/// `dx = dy · dequant(w)`: `[.., N]` → `[.., K]`.
pub(super) fn qmatmul_backward(
    dy: &Value,
    w: &Value,
    scales: &Value,
    q: crate::QuantSpec,
) -> Result<Value, String> {
    let n = *dy.dims().last().ok_or("dy has no features")?;
    ensure!(w.dims().len() == 2 && w.dims()[0] == n, "weight {} has not {n} rows", w.shape);
    let k = w.dims()[1] * 8 / q.bits as usize;
    let wf = dequantize(w, scales, q, k);
    let m = dy.numel() / n.max(1);
    let mut data = vec![0.0; m * k];
    for i in 0..m {
        for j in 0..n {
            let g = dy.data[i * n + j];
            for (d, &wv) in data[i * k..(i + 1) * k].iter_mut().zip(&wf[j * k..(j + 1) * k]) {
                *d += g * wv;
            }
        }
    }
    let mut out = dy.dims().to_vec();
    *out.last_mut().unwrap_or(&mut 0) = k;
    Ok(Value { shape: Shape::from(out), data })
}

// ---- optimizer -------------------------------------------------------------------------------

pub(super) fn adamw(x: &[&Value], spec: &AdamWSpec) -> Result<Vec<Value>, String> {
    let p = x[optim::PARAM];
    for (i, what) in [(optim::GRAD, "grad"), (optim::M, "m"), (optim::V, "v")] {
        ensure!(
            x[i].shape == p.shape,
            "{what} {} must have the parameter's shape {}",
            x[i].shape,
            p.shape
        );
    }
    let (master_at, scale_at) = spec.optional_inputs(x.len());
    let master = master_at.map(|i| x[i]);
    if let Some(mw) = master {
        ensure!(
            mw.shape == p.shape,
            "master {} must have the parameter's shape {}",
            mw.shape,
            p.shape
        );
    }
    for (i, what) in [(optim::LR, "lr"), (optim::STEP, "step"), (optim::GRAD_NORM, "grad_norm")] {
        ensure!(x[i].numel() == 1, "{what} must be a scalar, got {}", x[i].shape);
    }
    if let Some(i) = scale_at {
        ensure!(x[i].numel() == 1, "grad_scale must be a scalar, got {}", x[i].shape);
    }
    let lr = x[optim::LR].data[0];
    let step = x[optim::STEP].data[0];
    if step.is_nan() || step < 1.0 {
        return Err(format!("step {step} must be ≥ 1 (it is 1-based)"));
    }
    let scale = scale_at.map_or(1.0, |i| x[i].data[0]);
    let norm = x[optim::GRAD_NORM].data[0] * scale;
    if scale_at.is_some() && !norm.is_finite() {
        // Overflow under loss scaling: skip the update, every state unchanged.
        let mut outs = vec![p.clone(), x[optim::M].clone(), x[optim::V].clone()];
        outs.extend(master.cloned());
        return Ok(outs);
    }
    let clip = match spec.max_grad_norm {
        Some(max) => (max / (norm + 1e-6)).min(1.0),
        None => 1.0,
    } * scale;
    let bc1 = 1.0 - spec.beta1.powf(step);
    let bc2 = 1.0 - spec.beta2.powf(step);
    let w = master.unwrap_or(p);
    let n = p.numel();
    let (mut w2, mut m2, mut v2) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (grad, m, v) = (&x[optim::GRAD].data, &x[optim::M].data, &x[optim::V].data);
    for (((&wi, &gi), &mi), &vi) in w.data.iter().zip(grad).zip(m).zip(v) {
        let g = clip * gi;
        let m = spec.beta1 * mi + (1.0 - spec.beta1) * g;
        let v = spec.beta2 * vi + (1.0 - spec.beta2) * g * g;
        let (m_hat, v_hat) = (m / bc1, v / bc2);
        w2.push(wi - lr * (m_hat / (v_hat.sqrt() + spec.eps) + spec.weight_decay * wi));
        m2.push(m);
        v2.push(v);
    }
    let shape = p.shape.clone();
    let master2 = master.map(|_| Value { shape: shape.clone(), data: w2.clone() });
    let mut outs = vec![
        Value { shape: shape.clone(), data: w2 },
        Value { shape: shape.clone(), data: m2 },
        Value { shape, data: v2 },
    ];
    outs.extend(master2);
    Ok(outs)
}

// ---- special functions -----------------------------------------------------------------------

/// The error function, to about 1e-15 relative accuracy.
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    let r = if ax < 2.5 { erf_series(ax) } else { 1.0 - erfc_continued_fraction(ax) };
    r.copysign(x)
}

/// The complementary error function 1 − erf(x), accurate in relative terms for large x
/// (where 1 − erf(x) would cancel).
pub fn erfc(x: f64) -> f64 {
    if x.is_nan() {
        x
    } else if x >= 2.5 {
        erfc_continued_fraction(x)
    } else {
        1.0 - erf(x)
    }
}

/// erf(x) = (2/√π)·e^{−x²}·Σ_n 2ⁿ x^{2n+1} / (1·3·…·(2n+1)), for 0 ≤ x < 2.5. Every term is
/// positive, so the sum does not cancel (about 35 terms at x = 2.5).
pub(super) fn erf_series(x: f64) -> f64 {
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    let mut n = 0.0;
    while term > 1e-17 * sum {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
    }
    2.0 * INV_SQRT_PI * (-x2).exp() * sum
}

/// erfc(x) = e^{−x²}/√π · 1/(x + ½/(x + 1/(x + (3/2)/(x + …)))) for x ≥ 2.5, evaluated from
/// 60 levels down (converged to machine precision there).
pub(super) fn erfc_continued_fraction(x: f64) -> f64 {
    if x > 27.3 {
        return 0.0; // below the smallest subnormal
    }
    let mut t = x;
    for n in (1..=60).rev() {
        t = x + 0.5 * n as f64 / t;
    }
    (-x * x).exp() * INV_SQRT_PI / t
}
