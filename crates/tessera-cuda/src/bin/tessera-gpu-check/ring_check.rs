//! `ring`: ring attention's kernels (context parallelism, `cp=ring`) against the CPU kernels
//! on random inputs, f32 and bf16.
//!
//! 1. The block attention (`AttentionSpec::ring`): queries and keys at the global positions
//!    of a device's cp coordinate and a ring step, forward (output and log-sum-exp) and
//!    backward with and without the log-sum-exp's cotangent (the seventh input), causal and
//!    not, zig-zag chunks and contiguous ones, a sliding window and ALiBi, GQA; rings of 2
//!    and 4 devices at the coordinates and steps a ring's devices run.
//! 2. The merges: `AttentionMerge` of three pairs (one masking some rows: log-sum-exp −∞),
//!    its backward, `RingMerge` with 4 and with 7 inputs (a ring's last merge).
//!
//! 3. Tensor parallelism past the KV heads (`AttentionSpec::kv_whole`, the same unfused
//!    path): q some of 8 query heads, k/v both KV heads, forward and backward on devices of
//!    a tensor axis of 4 and 8.
//!
//! One `ring_op` line per case and output; a failure is pushed to `fails`.

use crate::{rel_err, uniform};
use candle_core::{Device, Tensor};
use std::sync::Arc;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::{MeshPos, ShardOf};
use tessera_ir::{
    Alibi, AttentionSpec, DType, Op, RingBackward, RingBlock, RingMerge, Shape, TensorMeta,
};
use tessera_runtime::{Backend, CpuBackend};

/// Batch, local sequence (even: zig-zag halves), query heads, kv heads, head dim.
const B: usize = 2;
const S: usize = 12;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 16;

/// Runs the ring checks, printing one JSON line per case and output.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let mut c = Cases {
        cpu: CpuBackend::new(0),
        gpu: CudaBackend::new(gpu.clone()),
        st: 0x0123_4567_89AB_CDEFu64,
        fails,
    };
    for dtype in [DType::F32, DType::BF16] {
        blocks(&mut c, dtype);
        merges(&mut c, dtype);
        kv_whole(&mut c, dtype);
    }
}

struct Cases<'a> {
    cpu: CpuBackend,
    gpu: CudaBackend,
    st: u64,
    fails: &'a mut Vec<String>,
}

fn bound(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta { shape: Shape::from(dims), dtype }
}

impl Cases<'_> {
    /// Uniform values in [-1, 1) scaled by `scale`, in `dtype`.
    fn rand(&mut self, dims: &[usize], scale: f32, dtype: DType) -> Tensor {
        let v: Vec<f32> =
            uniform(&mut self.st, dims.iter().product()).iter().map(|x| x * scale).collect();
        let t = Tensor::from_vec(v, dims, &Device::Cpu).expect("a host tensor");
        t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype)).expect("a cast")
    }

    fn line(&mut self, case: &str, op: &str, dtype: DType, err: Result<f64, String>) {
        let b = bound(dtype);
        let (ok, detail) = match &err {
            Ok(e) if e.is_finite() => (*e <= b, format!("\"rel_err\":{e:e},\"bound\":{b:e}")),
            Ok(e) => (false, format!("\"rel_err\":\"{e}\",\"bound\":{b:e}")),
            Err(e) => (false, format!("\"error\":{e:?}")),
        };
        println!(
            "{{\"check\":\"ring_op\",\"case\":{case:?},\"op\":{op:?},\"dtype\":\"{dtype:?}\",{detail},\"ok\":{ok}}}"
        );
        if !ok {
            self.fails.push(format!("ring {op} [{case}] {dtype:?}: {detail}"));
        }
    }

    /// `op` on both backends at `at`; one line per output (named by `names`); the CPU's
    /// results (None when either backend failed, recorded).
    fn case(
        &mut self,
        case: &str,
        op: &Op,
        x: &[&Tensor],
        out: &[TensorMeta],
        names: &[&str],
        at: &MeshPos,
    ) -> Option<Vec<Tensor>> {
        let dtype = out[0].dtype;
        let want = match self.cpu.execute(op, x, out, at) {
            Ok(w) => w,
            Err(e) => {
                self.line(case, op.name(), dtype, Err(format!("CPU: {e}")));
                return None;
            }
        };
        let got = (|| -> tessera_runtime::Result<Vec<Tensor>> {
            let dev: Vec<CudaTensor> = x
                .iter()
                .map(|t| self.gpu.upload_as(t, Purpose::Scratch))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&CudaTensor> = dev.iter().collect();
            let g = self.gpu.execute(op, &refs, out, at)?;
            g.iter().map(|t| self.gpu.download(t)).collect()
        })();
        let got = match got {
            Ok(g) => g,
            Err(e) => {
                self.line(case, op.name(), dtype, Err(format!("GPU: {e}")));
                return None;
            }
        };
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let name = format!("{}.{}", op.name(), names.get(k).copied().unwrap_or("?"));
            let err = if g.dims() != w.dims() || g.dtype() != w.dtype() {
                Err(format!(
                    "GPU {:?} {:?}, CPU {:?} {:?}",
                    g.dims(),
                    g.dtype(),
                    w.dims(),
                    w.dtype()
                ))
            } else {
                Ok(rel_err(g, w).unwrap_or(f64::INFINITY))
            };
            self.line(case, &name, dtype, err);
        }
        Some(want)
    }
}

/// The position of cp coordinate `c` on a ring of `cp` devices (mesh axis 0).
fn ring_pos(cp: usize, c: usize) -> MeshPos {
    MeshPos { shape: vec![cp], rank: c, coords: vec![c] }
}

/// Block attentions, forward and both backwards, at the (coordinate, step) pairs listed.
fn blocks(c: &mut Cases, dtype: DType) {
    let base = AttentionSpec::causal(D);
    let masks: [(&str, AttentionSpec, bool); 5] = [
        ("causal", base.clone(), false),
        ("causal-zigzag", base.clone(), true),
        ("bidirectional", AttentionSpec { causal: false, ..base.clone() }, false),
        ("window5-zigzag", AttentionSpec { window: Some(5), ..base.clone() }, true),
        (
            "alibi-zigzag",
            AttentionSpec { alibi: Some(Alibi { heads: H, shard: None }), ..base.clone() },
            true,
        ),
    ];
    // Ring of 2: every device and step; ring of 4: each step, at devices before and after the
    // key block's owner (a causal block that sees all, part or none of the keys).
    let placements: &[(usize, usize, usize)] = &[
        (2, 0, 0),
        (2, 0, 1),
        (2, 1, 0),
        (2, 1, 1),
        (4, 0, 0),
        (4, 1, 1),
        (4, 3, 1),
        (4, 0, 2),
        (4, 2, 3),
        (4, 3, 3),
    ];
    let (xm, km) = (meta(&[B, S, H, D], dtype), meta(&[B, S, HKV, D], dtype));
    let lm = meta(&[B, H, S], DType::F32);
    for (mask, spec, zigzag) in &masks {
        for &(cp, coord, step) in placements {
            let ring = RingBlock { axis: 0, size: cp, step, zigzag: *zigzag };
            let spec = AttentionSpec { ring: Some(ring), ..spec.clone() };
            let at = ring_pos(cp, coord);
            let case = format!("{mask} cp{cp} c{coord} step{step}");
            let (q, k, v) = (
                c.rand(&[B, S, H, D], 1.0, dtype),
                c.rand(&[B, S, HKV, D], 1.0, dtype),
                c.rand(&[B, S, HKV, D], 1.0, dtype),
            );
            let fwd_op = Op::Attention(spec.clone());
            let outs = [xm.clone(), lm.clone()];
            let Some(fwd) = c.case(&case, &fwd_op, &[&q, &k, &v], &outs, &["out", "lse"], &at)
            else {
                continue;
            };
            let dout = c.rand(&[B, S, H, D], 1.0, dtype);
            let dlse = c.rand(&[B, H, S], 0.5, DType::F32);
            let bo = [xm.clone(), km.clone(), km.clone()];
            let bw = Op::AttentionBackward(spec);
            let names = ["dq", "dk", "dv"];
            let x6 = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
            c.case(&case, &bw, &x6, &bo, &names, &at);
            let x7 = [&q, &k, &v, &fwd[0], &fwd[1], &dout, &dlse];
            c.case(&format!("{case} dlse"), &bw, &x7, &bo, &names, &at);
        }
    }
}

/// The merges: three pairs (the third masking every other query row), their backward, and
/// the ring merges of two pairs with 4 and 7 inputs.
fn merges(c: &mut Cases, dtype: DType) {
    let at = MeshPos::single();
    let (xm, lm) = (meta(&[B, S, H, D], dtype), meta(&[B, H, S], DType::F32));
    let mut pairs = Vec::new();
    for r in 0..3 {
        let o = c.rand(&[B, S, H, D], 1.0, dtype);
        let mut l = c.rand(&[B, H, S], 3.0, DType::F32);
        if r == 2 {
            let mask: Vec<f32> =
                (0..B * H * S).map(|i| if i % 2 == 0 { f32::NEG_INFINITY } else { 0.0 }).collect();
            let mask = Tensor::from_vec(mask, &[B, H, S], &Device::Cpu).expect("a host tensor");
            l = (l + mask).expect("an add");
        }
        pairs.push(o);
        pairs.push(l);
    }
    // Rows every pair masks: the merge's output 0 and its gradients 0.
    let all_masked = Tensor::full(f32::NEG_INFINITY, &[B, H, S], &Device::Cpu).expect("a fill");
    let refs: Vec<&Tensor> = pairs.iter().collect();
    let merge = Op::AttentionMerge;
    c.case("3 pairs", &merge, &refs, std::slice::from_ref(&xm), &["out"], &at);
    let masked = [&pairs[0], &all_masked, &pairs[2], &all_masked];
    c.case("all masked", &merge, &masked, std::slice::from_ref(&xm), &["out"], &at);
    let dout = c.rand(&[B, S, H, D], 1.0, dtype);
    let mut xb = refs.clone();
    xb.push(&dout);
    let names = ["do0", "dlse0", "do1", "dlse1", "do2", "dlse2"];
    let grads: Vec<TensorMeta> = (0..3).flat_map(|_| [xm.clone(), lm.clone()]).collect();
    c.case("3 pairs", &Op::AttentionMergeBackward, &xb, &grads, &names, &at);
    let rm = Op::RingMerge(RingMerge { backward: None });
    let outs = [xm.clone(), lm.clone()];
    c.case("2 pairs", &rm, &refs[..4], &outs, &["out", "lse"], &at);
    c.case("masked pair", &rm, &refs[2..6], &outs, &["out", "lse"], &at);
    // A ring's last merge carries its q, k, v (read by its VJP only).
    let spec = AttentionSpec {
        ring: Some(RingBlock { axis: 0, size: 2, step: 0, zigzag: false }),
        ..AttentionSpec::causal(D)
    };
    let last =
        Op::RingMerge(RingMerge { backward: Some(RingBackward { attention: spec, first_tag: 0 }) });
    let (q, k, v) = (
        c.rand(&[B, S, H, D], 1.0, dtype),
        c.rand(&[B, S, HKV, D], 1.0, dtype),
        c.rand(&[B, S, HKV, D], 1.0, dtype),
    );
    let x7 = [refs[0], refs[1], refs[2], refs[3], &q, &k, &v];
    c.case("last merge", &last, &x7, &outs, &["out", "lse"], &at);
}

/// Tensor parallelism past the KV heads: 8 query heads over a tensor axis (mesh axis 1) of
/// `n` devices, k/v holding both KV heads whole.
fn kv_whole(c: &mut Cases, dtype: DType) {
    let (h, hkv) = (8, 2);
    for n in [4, 8] {
        let local = h / n;
        let placement = vec![vec![], vec![], vec![1], vec![]];
        let spec = AttentionSpec {
            kv_whole: Some(ShardOf { global: vec![B, S, h, D], placement, micro_batch: 0 }),
            ..AttentionSpec::causal(D)
        };
        for r in [0, n / 2, n - 1] {
            let Ok(at) = MeshPos::new(&[1, n], r) else { continue };
            let case = format!("kv_whole tp{n} r{r}");
            let q = c.rand(&[B, S, local, D], 1.0, dtype);
            let (k, v) = (c.rand(&[B, S, hkv, D], 1.0, dtype), c.rand(&[B, S, hkv, D], 1.0, dtype));
            let (xm, km) = (meta(&[B, S, local, D], dtype), meta(&[B, S, hkv, D], dtype));
            let outs = [xm.clone(), meta(&[B, local, S], DType::F32)];
            let fwd_op = Op::Attention(spec.clone());
            let Some(fwd) = c.case(&case, &fwd_op, &[&q, &k, &v], &outs, &["out", "lse"], &at)
            else {
                continue;
            };
            let dout = c.rand(&[B, S, local, D], 1.0, dtype);
            let x6 = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
            let bo = [xm, km.clone(), km];
            let bw = Op::AttentionBackward(spec.clone());
            c.case(&case, &bw, &x6, &bo, &["dq", "dk", "dv"], &at);
        }
    }
}
