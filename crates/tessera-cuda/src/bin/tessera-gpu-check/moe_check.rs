//! `moe`: the mixture-of-experts routing kernels against the CPU kernels.
//!
//! 1. Every routing op (top-k, take/scatter along the last dim, slots, dispatch and combine with
//!    and without weights, slot dot products) on random inputs at several shapes (no group dim,
//!    one and two), k = 1 and 2, capacity factors that drop tokens and dropless routing, router
//!    logits with ties, f32 and bf16 (the backend's upcast path): one `moe_op` line per op,
//!    case and output. Indices, slots, top-k and the gathers are held to exact equality; the
//!    sums (f64 on both sides, in the same order) to 1e-6 in f32, one bf16 rounding in bf16.
//!    Top-k and the combine also read a strided (transposed) operand on the GPU.
//! 2. Two training steps of the tiny MoE presets, f32 and bf16, every op on both backends from
//!    the same inputs (`check_kernels`' `kernel` lines).

use crate::{check_kernels, rel_err, uniform};
use candle_core::{Device, Tensor};
use std::sync::Arc;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{DType, Op, TensorMeta};
use tessera_runtime::{Backend, CpuBackend, Result};

/// The MoE presets whose training steps run on both backends.
pub const MODELS: [&str; 3] = ["mixtral-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"];

/// Runs the MoE checks, printing one JSON line per op and pushing failures to `fails`.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let mut c = Cases {
        cpu: CpuBackend::new(0),
        gpu: CudaBackend::new(gpu.clone()),
        st: 0x0E0E_5EED_1234_9876u64,
        fails,
    };
    let cases = [
        Config { groups: &[], n: 16, e: 4, k: 1, factor: Some(1.0), h: 8, ties: false },
        Config { groups: &[2], n: 33, e: 8, k: 2, factor: Some(1.0), h: 24, ties: false },
        Config { groups: &[2], n: 33, e: 8, k: 2, factor: None, h: 24, ties: false },
        Config { groups: &[3], n: 64, e: 16, k: 2, factor: Some(0.5), h: 40, ties: false },
        Config { groups: &[2], n: 20, e: 6, k: 2, factor: Some(1.25), h: 16, ties: true },
        Config { groups: &[1, 2], n: 10, e: 4, k: 2, factor: Some(1.0), h: 8, ties: true },
        Config { groups: &[], n: 300, e: 8, k: 1, factor: None, h: 72, ties: false },
    ];
    for dtype in [DType::F32, DType::BF16] {
        for cfg in &cases {
            c.case(cfg, dtype);
        }
    }
    for model in MODELS {
        for dtype in [DType::F32, DType::BF16] {
            check_kernels(gpu, model, dtype, c.fails);
        }
    }
}

/// One routing configuration: group dims, tokens per group, experts, k, the capacity factor
/// (`None`: dropless), hidden size, and whether the router logits are full of ties.
struct Config {
    groups: &'static [usize],
    n: usize,
    e: usize,
    k: usize,
    factor: Option<f64>,
    h: usize,
    ties: bool,
}

struct Cases<'a> {
    cpu: CpuBackend,
    gpu: CudaBackend,
    st: u64,
    fails: &'a mut Vec<String>,
}

fn meta(t: &Tensor) -> TensorMeta {
    tessera_runtime::tensor::meta_of(t).expect("a supported dtype")
}

/// Bitwise equality of two results as f64 (NaN equal to NaN): 0 or 1.
fn mismatch(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let same =
        a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x == y || (x.is_nan() && y.is_nan()));
    Ok(if same { 0.0 } else { 1.0 })
}

impl Cases<'_> {
    fn rand(&mut self, dims: &[usize], dtype: DType) -> Tensor {
        let v = uniform(&mut self.st, dims.iter().product());
        let t = Tensor::from_vec(v, dims, &Device::Cpu).expect("a host tensor");
        t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype)).expect("a cast")
    }

    /// Logits in {-1, -0.5, 0, 0.5, 1}: rows full of ties.
    fn ties(&mut self, dims: &[usize], dtype: DType) -> Tensor {
        let v: Vec<f32> = uniform(&mut self.st, dims.iter().product())
            .iter()
            .map(|x| (x * 2.0).round() / 2.0)
            .collect();
        let t = Tensor::from_vec(v, dims, &Device::Cpu).expect("a host tensor");
        t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype)).expect("a cast")
    }

    /// `op` on both backends from the same inputs; `strided[i]` uploads input `i` transposed
    /// (its last two dims) and hands the GPU the transposed-back view. Prints a line per
    /// output; returns the CPU's outputs (or none when either side failed).
    fn check(
        &mut self,
        case: &str,
        dtype: DType,
        op: &Op,
        x: &[&Tensor],
        strided: &[bool],
        exact: bool,
    ) -> Option<Vec<Tensor>> {
        let name = op.name();
        let metas: Vec<TensorMeta> = x.iter().map(|t| meta(t)).collect();
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        let res = op.infer(&refs).map_err(|e| e.to_string()).and_then(|out| {
            let want =
                self.cpu.execute(op, x, &out, &MeshPos::single()).map_err(|e| e.to_string())?;
            let got = self.on_gpu(op, x, strided, &out).map_err(|e| e.to_string())?;
            Ok((want, got))
        });
        let (want, got) = match res {
            Ok(r) => r,
            Err(e) => {
                println!(
                    "{{\"check\":\"moe_op\",\"case\":{case:?},\"dtype\":\"{dtype:?}\",\"op\":\"{name}\",\"error\":{e:?},\"ok\":false}}"
                );
                self.fails.push(format!("moe {name} [{case} {dtype:?}]: {e}"));
                return None;
            }
        };
        let bound = if exact {
            0.0
        } else if dtype == DType::F32 {
            1e-6
        } else {
            1e-2
        };
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let err = if exact { mismatch(g, w) } else { rel_err(g, w) }.unwrap_or(f64::INFINITY);
            let ok = err <= bound;
            let err_s = if err.is_finite() { format!("{err:e}") } else { "\"inf\"".into() };
            println!(
                "{{\"check\":\"moe_op\",\"case\":{case:?},\"dtype\":\"{dtype:?}\",\"op\":\"{name}\",\"output\":{i},\"exact\":{exact},\"rel_err\":{err_s},\"bound\":{bound},\"ok\":{ok}}}"
            );
            if !ok {
                self.fails.push(format!("moe {name} [{case} {dtype:?}] output {i}: error {err:e}"));
            }
        }
        Some(want)
    }

    fn on_gpu(
        &self,
        op: &Op,
        x: &[&Tensor],
        strided: &[bool],
        out: &[TensorMeta],
    ) -> Result<Vec<Tensor>> {
        let mut dev: Vec<CudaTensor> = Vec::new();
        for (i, t) in x.iter().enumerate() {
            let r = t.dims().len();
            if strided.get(i).copied().unwrap_or(false) && r >= 2 {
                let tt = t.transpose(r - 2, r - 1)?.contiguous()?;
                let mut perm: Vec<usize> = (0..r).collect();
                perm.swap(r - 2, r - 1);
                dev.push(self.gpu.upload_as(&tt, Purpose::Scratch)?.permuted(&perm)?);
            } else {
                dev.push(self.gpu.upload_as(t, Purpose::Scratch)?);
            }
        }
        let refs: Vec<&CudaTensor> = dev.iter().collect();
        let got = self.gpu.execute(op, &refs, out, &MeshPos::single())?;
        got.iter().map(|t| self.gpu.download(t)).collect()
    }

    /// Every routing op at one configuration.
    fn case(&mut self, cfg: &Config, dtype: DType) {
        let Config { groups, n, e, k, factor, h, ties } = *cfg;
        let cap = tessera_ir::ops::moe::capacity(n, k, e, factor);
        let case = format!(
            "groups {groups:?} n {n} experts {e} k {k} capacity {cap} ({}) h {h}{}",
            factor.map_or("dropless".into(), |f| format!("factor {f}")),
            if ties { " ties" } else { "" }
        );
        let dims = |last: &[usize]| -> Vec<usize> { groups.iter().chain(last).copied().collect() };
        let logits =
            if ties { self.ties(&dims(&[n, e]), dtype) } else { self.rand(&dims(&[n, e]), dtype) };
        let Some(top) = self.check(&case, dtype, &Op::TopK { k }, &[&logits], &[true], true) else {
            return;
        };
        let (vals, idx) = (&top[0], &top[1]);
        self.check(&case, dtype, &Op::TakeAlong, &[&logits, idx], &[true, false], true);
        let src = self.rand(&dims(&[n, k]), dtype);
        self.check(&case, dtype, &Op::ScatterAlong { size: e }, &[idx, &src], &[], false);
        let slots_op = Op::MoeSlots { experts: e, capacity: cap };
        let Some(slots) = self.check(&case, dtype, &slots_op, &[idx], &[], true) else {
            return;
        };
        let slots = &slots[0];
        let x = self.rand(&dims(&[n, h]), dtype);
        let dispatch = Op::MoeDispatch { experts: e, capacity: cap };
        self.check(&case, dtype, &dispatch, &[&x, slots], &[], true);
        self.check(&case, dtype, &dispatch, &[&x, slots, vals], &[], true);
        let y = self.rand(&dims(&[e, cap, h]), dtype);
        self.check(&case, dtype, &Op::MoeCombine, &[&y, slots], &[true], false);
        self.check(&case, dtype, &Op::MoeCombine, &[&y, slots, vals], &[], false);
        self.check(&case, dtype, &Op::MoeSlotDot, &[&y, &x, slots], &[], false);
    }
}
