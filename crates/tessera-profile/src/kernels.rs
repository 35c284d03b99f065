//! Measured kernel speeds: what one op of the Program costs on a device whose kernels were
//! timed by the runtime itself (`tessera calibrate --device cuda`), rather than what a roofline
//! with constant efficiencies says.
//!
//! The calibration times every op of real training steps with a pair of CUDA events and the
//! host's own time inside the op's dispatch, and keys each sample the way the cost model will
//! look it up ([`kernel_work`]): the op kind, and for the compute-bound kinds the dtype (and
//! attention's head dim and mask), with the work the IR counts for it — FLOPs for matrix
//! products and attention, bytes moved for everything else. [`KernelTable::from_samples`]
//! turns the samples into a curve of seconds against work per key; the cost model reads a
//! time off the curve (log-log interpolation between measured points, the largest point's
//! rate beyond it, the smallest point's time below it: a kernel never gets faster than its
//! launch). Keys the calibration did not meet fall back to the roofline.
//!
//! Besides the device's time, each op costs the host its dispatch ([`KernelTable::host_s`]):
//! a GPU step is issued by one host thread into an in-order queue, so the step takes the
//! longer of the two where the host falls behind. The planner replays that queue
//! (`tessera-plan`'s step-time walk); `gap_s` is what is left between kernels when neither
//! waits (launch latency), fitted from the calibration's own steps.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tessera_ir::{DType, Op, TensorMeta};

/// How an op's work is measured for its curve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Work {
    /// FLOPs as the IR counts them (`Op::flops`): matrix products and attention.
    Flops,
    /// Bytes read and written (`Op::bytes_accessed`): everything else.
    Bytes,
}

/// An op's curve key and its amount of work.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelWork {
    /// `matmul.bf16.nt.a8`, `attention_backward.bf16.d128.causal`, `rms_norm`, ...
    pub key: String,
    pub work: Work,
    pub amount: f64,
}

/// The curve key and work of running `op` on these metas, or `None` for ops that launch no
/// kernel (leaves, views, collectives and transfers, which are priced elsewhere).
pub fn kernel_work(op: &Op, x: &[&TensorMeta], y: &[&TensorMeta]) -> Option<KernelWork> {
    if op.is_leaf() && !matches!(op, Op::Fill { .. }) {
        return None;
    }
    if matches!(
        op,
        Op::Reshape(_)
            | Op::Expand(_)
            | Op::Reshard(_)
            | Op::Send(_)
            | Op::Recv(..)
            | Op::Transfer { .. }
    ) {
        return None;
    }
    let dtype = x.first().or(y.first()).map_or(DType::F32, |m| m.dtype);
    let flops = op.flops(x, y).total() as f64;
    let key = match op {
        // cuBLAS picks its kernels by layout and alignment as much as by size: GPT-2's Conv1D
        // weights multiply transposed where LLaMA's Linear ones do not, and a vocabulary of
        // 50,257 rows leaves no 16-byte alignment; each class gets its own curve.
        Op::MatMul { trans_a, trans_b } => {
            let t = |b: bool| if b { 't' } else { 'n' };
            let aligned = x.iter().all(|m| {
                let d = m.shape.dims();
                d.len() < 2 || d[d.len() - 2..].iter().all(|&n| n % 8 == 0)
            });
            let class = if aligned { "a8" } else { "u" };
            format!("matmul.{}.{}{}.{class}", dtype.name(), t(*trans_a), t(*trans_b))
        }
        Op::QMatMul(_) | Op::QMatMulBackward(_) => format!("{}.{}", op.name(), dtype.name()),
        Op::Attention(spec) | Op::AttentionBackward(spec) => {
            let d = x.first().and_then(|q| q.shape.dims().last().copied()).unwrap_or(0);
            let mask = if spec.causal { "causal" } else { "full" };
            format!("{}.{}.d{d}.{mask}", op.name(), dtype.name())
        }
        Op::Conv2d(_) | Op::Conv2dBackwardInput { .. } | Op::Conv2dBackwardWeight { .. } => {
            format!("{}.{}", op.name(), dtype.name())
        }
        _ => {
            let bytes = op.bytes_accessed(x, y) as f64;
            return Some(KernelWork {
                key: op.name().to_string(),
                work: Work::Bytes,
                amount: bytes,
            });
        }
    };
    Some(KernelWork { key, work: Work::Flops, amount: flops })
}

/// One op's measurement: its key and work, the device's time and the host's.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSample {
    /// The op kind (`Op::name`): the host's dispatch cost is per kind.
    pub kind: String,
    /// `None` for ops that launch no kernel (views): they cost the host only.
    pub work: Option<KernelWork>,
    pub device_s: f64,
    pub host_s: f64,
}

/// Seconds against work, measured: `[work, seconds]` points sorted by work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelCurve {
    pub work: Work,
    pub points: Vec<[f64; 2]>,
}

impl KernelCurve {
    /// Seconds for `amount` of work: log-log interpolation between the points, the largest
    /// point's rate beyond it, the smallest point's time below it.
    pub fn seconds(&self, amount: f64) -> f64 {
        let p = &self.points;
        let (Some(first), Some(last)) = (p.first(), p.last()) else { return 0.0 };
        if amount <= first[0] {
            return first[1];
        }
        if amount >= last[0] {
            return last[1] * amount / last[0];
        }
        let i = p.partition_point(|q| q[0] <= amount).clamp(1, p.len() - 1);
        let (a, b) = (p[i - 1], p[i]);
        let t = (amount.ln() - a[0].ln()) / (b[0].ln() - a[0].ln());
        (a[1].ln() + t * (b[1].ln() - a[1].ln())).exp()
    }
}

/// A device's measured kernels (see the module docs), stored in its cluster file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelTable {
    /// Curve key ([`kernel_work`]) → seconds against work.
    pub curves: BTreeMap<String, KernelCurve>,
    /// Op kind → the host's mean seconds to dispatch one (allocation, arguments, launches).
    pub host_s: BTreeMap<String, f64>,
    /// The host's seconds per op beyond the backend's dispatch (the executor's own
    /// bookkeeping), fitted so the replay meets the calibration's measured steps.
    #[serde(default)]
    pub host_overhead_s: f64,
    /// Seconds between consecutive kernels when neither the host nor the device waits.
    pub gap_s: f64,
    /// What was measured (models and shapes), for the reader of the file.
    #[serde(default)]
    pub source: String,
}

/// Points whose work is within this factor of each other are merged (averaged).
const MERGE_RATIO: f64 = 1.05;

impl KernelTable {
    /// The table of `samples`: per key, the mean seconds of each distinct amount of work
    /// (amounts within 5% merged, weighted by calls); per kind, the mean host seconds.
    pub fn from_samples(samples: &[KernelSample], gap_s: f64, source: String) -> KernelTable {
        let mut by_key: BTreeMap<String, (Work, Vec<(f64, f64)>)> = BTreeMap::new();
        let mut host: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        for s in samples {
            let h = host.entry(s.kind.clone()).or_default();
            h.0 += s.host_s;
            h.1 += 1;
            if let Some(w) = s.work.as_ref().filter(|w| w.amount > 0.0 && s.device_s > 0.0) {
                let e = by_key.entry(w.key.clone()).or_insert((w.work, Vec::new()));
                e.1.push((w.amount, s.device_s));
            }
        }
        let curves = by_key
            .into_iter()
            .map(|(key, (work, mut pts))| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                // (sum of work, sum of seconds, count) per merged point.
                let mut merged: Vec<(f64, f64, f64)> = Vec::new();
                for (w, s) in pts {
                    match merged.last_mut() {
                        Some(m) if w <= m.0 / m.2 * MERGE_RATIO => {
                            m.0 += w;
                            m.1 += s;
                            m.2 += 1.0;
                        }
                        _ => merged.push((w, s, 1.0)),
                    }
                }
                let points = merged.iter().map(|m| [m.0 / m.2, m.1 / m.2]).collect();
                (key, KernelCurve { work, points })
            })
            .collect();
        let host_s = host.into_iter().map(|(k, (s, n))| (k, s / n.max(1) as f64)).collect();
        KernelTable { curves, host_s, host_overhead_s: 0.0, gap_s, source }
    }

    /// The device's seconds for an op of this key and work, where the key was measured.
    pub fn device_seconds(&self, w: &KernelWork) -> Option<f64> {
        self.curves.get(&w.key).map(|c| c.seconds(w.amount))
    }

    /// The host's seconds to issue an op of this kind: its measured dispatch (0 where none
    /// was measured) and the executor's overhead.
    pub fn host_seconds(&self, kind: &str) -> f64 {
        self.host_s.get(kind).copied().unwrap_or(0.0) + self.host_overhead_s
    }

    /// Checks every figure is finite and non-negative and every curve sorted with positive
    /// work and time; the error names the first bad entry.
    pub fn validate(&self) -> Result<(), String> {
        for (what, v) in [("gap_s", self.gap_s), ("host_overhead_s", self.host_overhead_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{what} = {v} must be seconds >= 0"));
            }
        }
        for (k, s) in &self.host_s {
            if !(s.is_finite() && *s >= 0.0) {
                return Err(format!("host_s.{k} = {s} must be seconds >= 0"));
            }
        }
        for (k, c) in &self.curves {
            if c.points.is_empty() {
                return Err(format!("curve `{k}` has no points"));
            }
            let mut prev = 0.0;
            for p in &c.points {
                if !(p[0].is_finite() && p[0] > prev && p[1].is_finite() && p[1] > 0.0) {
                    return Err(format!(
                        "curve `{k}`: point {p:?} must have positive finite work above the \
                         previous point's and positive finite seconds"
                    ));
                }
                prev = p[0];
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_ir::Shape;

    fn meta(dims: &[usize], d: DType) -> TensorMeta {
        TensorMeta::new(Shape::from(dims), d)
    }

    #[test]
    fn keys_split_compute_bound_kinds_by_dtype_and_head_dim() {
        let a = meta(&[64, 32], DType::BF16);
        let b = meta(&[32, 16], DType::BF16);
        let y = meta(&[64, 16], DType::BF16);
        let mm = Op::MatMul { trans_a: false, trans_b: false };
        let w = kernel_work(&mm, &[&a, &b], &[&y]).unwrap();
        assert_eq!(w.key, "matmul.bf16.nn.a8");
        assert_eq!(w.work, Work::Flops);
        assert_eq!(w.amount, 2.0 * 64.0 * 32.0 * 16.0);
        // A vocabulary of 50,257 classes: no 16-byte alignment, a curve of its own.
        let (h, v) = (meta(&[64, 32], DType::BF16), meta(&[50257, 32], DType::BF16));
        let head = Op::MatMul { trans_a: false, trans_b: true };
        let w = kernel_work(&head, &[&h, &v], &[&meta(&[64, 50257], DType::BF16)]).unwrap();
        assert_eq!(w.key, "matmul.bf16.nt.u");
        let add = Op::Binary(tessera_ir::BinaryOp::Add);
        let w = kernel_work(&add, &[&y, &y], &[&y]).unwrap();
        assert_eq!((w.key.as_str(), w.work), ("binary", Work::Bytes));
        assert_eq!(w.amount, 3.0 * 64.0 * 16.0 * 2.0);
        assert!(kernel_work(&Op::Reshape(Shape::from(&[1024usize][..])), &[&y], &[&y]).is_none());
    }

    #[test]
    fn a_curve_interpolates_in_log_space_and_keeps_its_ends_honest() {
        let c = KernelCurve { work: Work::Flops, points: vec![[1e6, 1e-5], [1e9, 1e-3]] };
        // Between: log-log linear (10x the work per 10^1.5 ... exact at the geometric middle).
        let mid = c.seconds((1e6f64 * 1e9).sqrt());
        assert!((mid - 1e-4).abs() < 1e-12, "{mid}");
        // Below the smallest point: its time (a launch does not get cheaper).
        assert_eq!(c.seconds(10.0), 1e-5);
        // Beyond the largest: its rate.
        assert!((c.seconds(2e9) - 2e-3).abs() < 1e-15);
    }

    #[test]
    fn samples_merge_by_work_and_average_the_host() {
        let w = |amount| Some(KernelWork { key: "binary".into(), work: Work::Bytes, amount });
        let s = |amount, device_s, host_s| KernelSample {
            kind: "binary".into(),
            work: w(amount),
            device_s,
            host_s,
        };
        let view = KernelSample { kind: "reshape".into(), work: None, device_s: 0.0, host_s: 4e-6 };
        let t = KernelTable::from_samples(
            &[s(1000.0, 2e-6, 1e-5), s(1020.0, 4e-6, 3e-5), s(1e6, 1e-4, 2e-5), view],
            1e-6,
            "test".into(),
        );
        let c = &t.curves["binary"];
        assert_eq!(c.points.len(), 2, "1000 and 1020 bytes are one point");
        assert!((c.points[0][0] - 1010.0).abs() < 1e-9 && (c.points[0][1] - 3e-6).abs() < 1e-18);
        assert!((t.host_seconds("binary") - 2e-5).abs() < 1e-18);
        assert_eq!(t.host_seconds("reshape"), 4e-6);
        assert_eq!(t.host_seconds("never_seen"), 0.0);
        t.validate().unwrap();
        let mut bad = t.clone();
        bad.curves.get_mut("binary").unwrap().points.reverse();
        assert!(bad.validate().unwrap_err().contains("binary"));
    }
}
