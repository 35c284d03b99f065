//! `vision`: the vision ops' kernels (convolution, GroupNorm, pooling, upsampling) against the
//! CPU kernels.
//!
//! 1. Every op, forward and backward, on random f32 inputs at configurations covering the
//!    kernels' paths (stride, padding, dilation, groups and depthwise, 1×1 kernels read in
//!    place, batches over the 4-image column chunk, non-square and odd sizes, both
//!    `count_include_pad`, several upsampling factors, GroupNorm with one to C groups): one
//!    `vision_kernel` line per op, configuration and output. Max pooling (ties included) and
//!    the gathers that sum in the CPU's order are held to exact equality.
//! 2. The weight gradients and GroupNorm's backward run twice: bit-identical (`vision_deterministic`).
//! 3. Two training steps of the ONNX ResNet and UNet fixtures (`tessera-cli`'s), f32 and bf16,
//!    every op on both backends from the same inputs (`vision_step`, worst error per op kind),
//!    and one on the GPU alone with its memory books (`vision_memory`).

use crate::{rel_err, uniform, Both};
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{Conv2dSpec, DType, Op, Pool2dSpec, Shape, TensorMeta, TrainingGraph};
use tessera_runtime::{Backend, CpuBackend, LrSchedule, StepBatch, Trainer};

/// The per-op bound (relative error against the CPU kernel).
const BOUND: f64 = 1e-5;

/// Runs the vision checks, printing one JSON line per op and pushing failures to `fails`.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let mut c = Cases { gpu: CudaBackend::new(gpu.clone()), st: 0x5EED_0FC0_4E5E_ED01u64, fails };
    convolutions(&mut c);
    group_norms(&mut c);
    pools(&mut c);
    upsamples(&mut c);
    determinism(&mut c);
    for (model, bytes) in FIXTURES {
        for dtype in [DType::F32, DType::BF16] {
            training_step(gpu, model, bytes, dtype, fails);
        }
    }
    memory(gpu, "resnet", FIXTURES[0].1, fails);
}

/// The ONNX fixtures of `tessera-cli`'s importer tests, built into the binary (it runs away
/// from the source tree).
const FIXTURES: [(&str, &[u8]); 2] = [
    ("resnet", include_bytes!("../../../../tessera-cli/tests/fixtures/onnx/resnet/model.onnx")),
    ("unet", include_bytes!("../../../../tessera-cli/tests/fixtures/onnx/unet/model.onnx")),
];

/// A JSON string (Rust's debug quoting: quotes and control characters escaped).
fn js(s: &str) -> String {
    format!("{s:?}")
}

/// A JSON number, or a string for what JSON cannot hold (inf, NaN).
fn jn(x: f64) -> String {
    if x.is_finite() {
        format!("{x:e}")
    } else {
        js(&x.to_string())
    }
}

struct Cases<'a> {
    gpu: CudaBackend,
    st: u64,
    fails: &'a mut Vec<String>,
}

impl Cases<'_> {
    /// Uniform values in [-1, 1) scaled by `scale` and shifted by `shift`.
    fn rand(&mut self, dims: &[usize], scale: f32, shift: f32) -> Tensor {
        let v: Vec<f32> = uniform(&mut self.st, dims.iter().product())
            .iter()
            .map(|x| x * scale + shift)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).expect("a host tensor")
    }

    /// Values in {-1, 0, 1}: pooling windows full of ties.
    fn ties(&mut self, dims: &[usize]) -> Tensor {
        let v: Vec<f32> = uniform(&mut self.st, dims.iter().product())
            .iter()
            .map(|x| (x * 1.5).round())
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).expect("a host tensor")
    }

    fn fail_line(&mut self, op: &str, config: &str, what: String) {
        println!(
            "{{\"check\":\"vision_kernel\",\"op\":{},\"config\":{},\"error\":{},\"ok\":false}}",
            js(op),
            js(config),
            js(&what)
        );
        self.fails.push(format!("vision {op} [{config}]: {what}"));
    }

    /// `op` on the GPU, downloaded.
    fn on_gpu(
        &self,
        op: &Op,
        x: &[Tensor],
        out: &[TensorMeta],
    ) -> tessera_runtime::Result<Vec<Tensor>> {
        let dev: Vec<CudaTensor> =
            x.iter().map(|t| self.gpu.upload_as(t, Purpose::Scratch)).collect::<Result<_, _>>()?;
        let refs: Vec<&CudaTensor> = dev.iter().collect();
        let got = self.gpu.execute(op, &refs, out, &MeshPos::single())?;
        got.iter().map(|t| self.gpu.download(t)).collect()
    }

    /// Runs `op` on both backends; prints a line per output (named by `outputs` when several)
    /// held to `bound`; returns the GPU's results (None on an error, recorded).
    fn case(&mut self, op: &Op, config: &str, x: &[Tensor], bound: f64) -> Option<Vec<Tensor>> {
        let metas: Vec<TensorMeta> = x
            .iter()
            .map(|t| TensorMeta { shape: Shape::from(t.dims()), dtype: DType::F32 })
            .collect();
        let out = match op.infer(&metas.iter().collect::<Vec<_>>()) {
            Ok(o) => o,
            Err(e) => {
                self.fail_line(op.name(), config, format!("shape inference: {e}"));
                return None;
            }
        };
        let refs: Vec<&Tensor> = x.iter().collect();
        let want = match tessera_runtime::kernels::execute(op, &refs, &out) {
            Ok(w) => w,
            Err(e) => {
                self.fail_line(op.name(), config, format!("CPU kernel: {e}"));
                return None;
            }
        };
        let got = match self.on_gpu(op, x, &out) {
            Ok(g) => g,
            Err(e) => {
                self.fail_line(op.name(), config, format!("GPU: {e}"));
                return None;
            }
        };
        let names: &[&str] = match op {
            Op::GroupNormBackward { .. } => &["dx", "dweight", "dbias"],
            _ => &[""],
        };
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let name = match names.get(k) {
                Some(n) if !n.is_empty() => format!("{}.{n}", op.name()),
                _ => op.name().to_string(),
            };
            let err = if g.dims() != w.dims() {
                f64::INFINITY
            } else {
                rel_err(g, w).unwrap_or(f64::INFINITY)
            };
            let ok = err <= bound;
            println!(
                "{{\"check\":\"vision_kernel\",\"op\":{},\"config\":{},\"rel_err\":{},\"bound\":{},\"ok\":{ok}}}",
                js(&name),
                js(config),
                jn(err),
                jn(bound)
            );
            if !ok {
                self.fails.push(format!(
                    "vision {name} [{config}]: rel err {} (bound {bound:e})",
                    jn(err)
                ));
            }
        }
        Some(got)
    }
}

/// x dims, weight dims, stride, padding, dilation, groups.
type ConvCase = ([usize; 4], [usize; 4], [usize; 2], [usize; 2], [usize; 2], usize);

const CONVS: &[ConvCase] = &[
    // 3×3, stride 1, padding 1, odd non-square images.
    ([2, 3, 9, 7], [5, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1),
    // Stride 2 over odd sizes; six images: a chunk of four and a tail of two.
    ([6, 4, 11, 13], [6, 4, 3, 3], [2, 2], [1, 1], [1, 1], 1),
    // A non-square kernel with per-dim stride, padding and dilation.
    ([2, 4, 10, 9], [4, 4, 5, 3], [2, 1], [2, 1], [1, 2], 1),
    // Two groups, dilation 2 (groups batched per image in the tail chunk).
    ([5, 6, 12, 10], [4, 3, 3, 3], [1, 1], [2, 2], [2, 2], 2),
    // Depthwise, and depthwise with a channel multiplier of 2 at stride 2.
    ([3, 8, 9, 9], [8, 1, 3, 3], [1, 1], [1, 1], [1, 1], 8),
    ([2, 4, 8, 7], [8, 1, 3, 3], [2, 2], [1, 1], [1, 1], 4),
    // 1×1: read in place (ungrouped and grouped), and strided (through columns).
    ([5, 8, 6, 5], [12, 8, 1, 1], [1, 1], [0, 0], [1, 1], 1),
    ([5, 8, 6, 5], [12, 4, 1, 1], [1, 1], [0, 0], [1, 1], 2),
    ([2, 6, 7, 7], [4, 6, 1, 1], [2, 2], [0, 0], [1, 1], 1),
    // A 7×7 stride-2 stem on three channels, and a ResNet-sized 3×3 layer.
    ([6, 3, 32, 32], [16, 3, 7, 7], [2, 2], [3, 3], [1, 1], 1),
    ([8, 64, 28, 28], [64, 64, 3, 3], [1, 1], [1, 1], [1, 1], 1),
];

fn conv_config(c: &ConvCase) -> String {
    let (x, w, s, p, d, g) = c;
    format!("x{x:?} w{w:?} stride{s:?} pad{p:?} dil{d:?} groups{g}")
}

fn convolutions(c: &mut Cases) {
    for case in CONVS {
        let &(xd, wd, stride, padding, dilation, groups) = case;
        let spec = Conv2dSpec { stride, padding, dilation, groups };
        let config = conv_config(case);
        let (x, w) = (c.rand(&xd, 1.0, 0.0), c.rand(&wd, 1.0, 0.0));
        let Some(y) = c.case(&Op::Conv2d(spec), &config, &[x.clone(), w.clone()], BOUND) else {
            continue;
        };
        let dy = c.rand(y[0].dims(), 1.0, 0.0);
        let op = Op::Conv2dBackwardInput { spec, input_hw: [xd[2], xd[3]] };
        c.case(&op, &config, &[w, dy.clone()], BOUND);
        let op = Op::Conv2dBackwardWeight { spec, kernel_hw: [wd[2], wd[3]] };
        c.case(&op, &config, &[x, dy], BOUND);
    }
}

fn group_norms(c: &mut Cases) {
    let cases: &[(&[usize], usize)] = &[
        (&[2, 6, 5, 7], 3),
        (&[3, 8, 4, 4], 1),
        (&[2, 8, 3, 3], 8),
        (&[4, 32, 16, 16], 8),
        (&[1, 64, 33, 17], 32),
        (&[2, 4, 10], 2),
        (&[5, 6], 3),
    ];
    for &(dims, groups) in cases {
        let config = format!("x{dims:?} groups{groups}");
        let ch = [dims[1]];
        let x = c.rand(dims, 2.0, 0.5);
        let (w, b) = (c.rand(&ch, 0.5, 1.0), c.rand(&ch, 1.0, 0.0));
        let eps = 1e-5;
        c.case(&Op::GroupNorm { groups, eps }, &config, &[x.clone(), w.clone(), b], BOUND);
        let dy = c.rand(dims, 1.0, 0.0);
        c.case(&Op::GroupNormBackward { groups, eps }, &config, &[x, w, dy], BOUND);
    }
}

/// x dims, kernel, stride, padding.
type PoolCase = ([usize; 4], [usize; 2], [usize; 2], [usize; 2]);

const POOLS: &[PoolCase] = &[
    ([2, 3, 8, 8], [2, 2], [2, 2], [0, 0]),
    ([2, 3, 9, 7], [3, 3], [2, 2], [1, 1]),
    ([2, 4, 9, 7], [3, 3], [1, 1], [1, 1]),
    ([3, 2, 10, 9], [3, 2], [1, 2], [1, 1]),
    ([2, 2, 5, 5], [5, 5], [1, 1], [2, 2]),
    ([2, 4, 7, 7], [7, 7], [1, 1], [0, 0]),
];

fn pools(c: &mut Cases) {
    for &(xd, kernel, stride, padding) in POOLS {
        let pool = Pool2dSpec { kernel, stride, padding };
        let config = format!("x{xd:?} kernel{kernel:?} stride{stride:?} pad{padding:?}");
        // Max pooling: random values, then values full of ties; exact.
        for (what, x) in [("random", c.rand(&xd, 1.0, 0.0)), ("ties", c.ties(&xd))] {
            let config = format!("{config} {what}");
            let Some(y) = c.case(&Op::MaxPool2d(pool), &config, std::slice::from_ref(&x), 0.0)
            else {
                continue;
            };
            let dy = c.rand(y[0].dims(), 1.0, 0.0);
            c.case(&Op::MaxPool2dBackward(pool), &config, &[x, dy], 0.0);
        }
        for count_include_pad in [true, false] {
            let config = format!("{config} count_include_pad={count_include_pad}");
            let x = c.rand(&xd, 1.0, 0.0);
            let op = Op::AvgPool2d { pool, count_include_pad };
            let Some(y) = c.case(&op, &config, &[x], BOUND) else { continue };
            let dy = c.rand(y[0].dims(), 1.0, 0.0);
            let op = Op::AvgPool2dBackward { pool, count_include_pad, input_hw: [xd[2], xd[3]] };
            c.case(&op, &config, &[dy], BOUND);
        }
    }
}

fn upsamples(c: &mut Cases) {
    for scale in [[2, 2], [3, 1], [1, 2], [2, 3]] {
        let xd = [2, 3, 5, 4];
        let config = format!("nearest x{xd:?} scale{scale:?}");
        let x = c.rand(&xd, 1.0, 0.0);
        let Some(y) = c.case(&Op::Upsample2d { scale }, &config, &[x], BOUND) else { continue };
        let dy = c.rand(y[0].dims(), 1.0, 0.0);
        c.case(&Op::Upsample2dBackward { scale }, &config, &[dy], BOUND);
    }
}

/// The weight gradients (convolution, GroupNorm) twice on the GPU: the same bits.
fn determinism(c: &mut Cases) {
    let spec = Conv2dSpec { padding: [1, 1], ..Default::default() };
    let (x, dy) = (c.rand(&[8, 64, 28, 28], 1.0, 0.0), c.rand(&[8, 64, 28, 28], 1.0, 0.0));
    let w = c.rand(&[64], 0.5, 1.0);
    let runs: [(Op, Vec<Tensor>); 2] = [
        (Op::Conv2dBackwardWeight { spec, kernel_hw: [3, 3] }, vec![x.clone(), dy.clone()]),
        (Op::GroupNormBackward { groups: 8, eps: 1e-5 }, vec![x, w, dy]),
    ];
    for (op, inputs) in runs {
        let metas: Vec<TensorMeta> = inputs
            .iter()
            .map(|t| TensorMeta { shape: Shape::from(t.dims()), dtype: DType::F32 })
            .collect();
        let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap_or_default();
        let bits = |r: tessera_runtime::Result<Vec<Tensor>>| -> Option<Vec<Vec<u32>>> {
            let ts = r.ok()?;
            ts.iter()
                .map(|t| {
                    Some(
                        t.flatten_all()
                            .ok()?
                            .to_vec1::<f32>()
                            .ok()?
                            .iter()
                            .map(|v| v.to_bits())
                            .collect(),
                    )
                })
                .collect()
        };
        let (a, b) = (bits(c.on_gpu(&op, &inputs, &out)), bits(c.on_gpu(&op, &inputs, &out)));
        let ok = a.is_some() && a == b;
        println!(
            "{{\"check\":\"vision_deterministic\",\"op\":{},\"identical\":{ok},\"ok\":{ok}}}",
            js(op.name())
        );
        if !ok {
            c.fails.push(format!("vision {}: two GPU runs differ (or failed)", op.name()));
        }
    }
}

// ---- training steps of the ONNX fixtures ----------------------------------------------------

/// Images per step: a chunk of four columns and a tail.
const BATCH: usize = 6;

/// The training graph of ONNX fixture `model` (bytes of its `model.onnx`) at `batch` in `dtype`,
/// as `tessera train --model model.onnx` builds it.
pub(crate) fn onnx_graph(
    model: &str,
    bytes: &[u8],
    batch: usize,
    dtype: DType,
) -> Result<TrainingGraph, String> {
    use tessera_models::{build, BuildOptions, ModelConfig, OnnxConfig};
    let dir = std::env::temp_dir().join(format!("tessera-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{model}.onnx"));
    std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let cfg = OnnxConfig::open(&path).map(ModelConfig::Onnx).map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&dir);
    let fm = build(&cfg?, &BuildOptions { batch, seq: 1, dtype }).map_err(|e| e.to_string())?;
    let tc = tessera_ir::TrainConfig::default();
    tessera_ir::build_training_graph(fm.builder, fm.loss, &tc).map_err(|e| e.to_string())
}

/// Step `k`'s batch for `model`: random 1×8×8 images with class labels (ResNet) or clean
/// targets (UNet, a denoiser).
pub(crate) fn onnx_batch(model: &str, k: u64, batch: usize) -> tessera_runtime::Result<StepBatch> {
    let mut st = 0x0BAD_CAFE_F00D_0001u64 ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let dims = [batch, 1, 8, 8];
    let pixels = uniform(&mut st, batch * 64);
    if model == "resnet" {
        let labels =
            uniform(&mut st, batch).iter().map(|v| ((v + 1.0) * 5.0) as i64 % 10).collect();
        StepBatch::images(pixels, dims, labels)
    } else {
        StepBatch::denoise(pixels, uniform(&mut st, batch * 64), dims)
    }
}

/// Two steps of `model` in `dtype`, every op on both backends from the same inputs.
fn training_step(gpu: &Arc<Gpu>, model: &str, bytes: &[u8], dtype: DType, fails: &mut Vec<String>) {
    let mut fail = |what: String| {
        println!(
            "{{\"check\":\"vision_step\",\"model\":{},\"dtype\":\"{dtype:?}\",\"error\":{},\"ok\":false}}",
            js(model),
            js(&what)
        );
        fails.push(format!("vision step {model} {dtype:?}: {what}"));
    };
    let graph = match onnx_graph(model, bytes, BATCH, dtype) {
        Ok(g) => g,
        Err(e) => return fail(format!("training graph: {e}")),
    };
    let worst = Arc::new(Mutex::new(BTreeMap::new()));
    let both =
        Both { cpu: CpuBackend::new(0), gpu: CudaBackend::new(gpu.clone()), worst: worst.clone() };
    let mut t = match Trainer::single(graph, both, LrSchedule::Constant { lr: 1e-3 }, 7, None) {
        Ok(t) => t,
        Err(e) => return fail(format!("trainer: {e}")),
    };
    for k in 0..2 {
        if let Err(e) = onnx_batch(model, k, BATCH).and_then(|b| t.step_batch(&b)) {
            return fail(format!("step {k}: {e}"));
        }
    }
    let bound = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
    let worst = worst.lock().map(|w| w.clone()).unwrap_or_default();
    for (op, (err, calls)) in worst {
        let ok = err <= bound;
        println!(
            "{{\"check\":\"vision_step\",\"model\":{},\"dtype\":\"{dtype:?}\",\"op\":{},\"calls\":{calls},\"rel_err\":{},\"bound\":{bound},\"ok\":{ok}}}",
            js(model),
            js(&op),
            jn(err)
        );
        if !ok {
            fails.push(format!("vision step {model} {dtype:?} {op}: rel err {}", jn(err)));
        }
    }
}

/// Two steps of `model` on the GPU alone: the profiler's prediction, the accountant's peak
/// (both charge each convolution's declared workspace) and the allocator's Program peak (the
/// columns are scratch, reported beside: at most the workspace less).
fn memory(gpu: &Arc<Gpu>, model: &str, bytes: &[u8], fails: &mut Vec<String>) {
    let mut fail = |what: String| {
        println!(
            "{{\"check\":\"vision_memory\",\"model\":{},\"error\":{},\"ok\":false}}",
            js(model),
            js(&what)
        );
        fails.push(format!("vision memory {model}: {what}"));
    };
    let graph = match onnx_graph(model, bytes, BATCH, DType::F32) {
        Ok(g) => g,
        Err(e) => return fail(format!("training graph: {e}")),
    };
    gpu.empty_cache();
    let backend = CudaBackend::new(gpu.clone());
    let mut t = match Trainer::single(graph, backend, LrSchedule::Constant { lr: 1e-3 }, 7, None) {
        Ok(t) => t,
        Err(e) => return fail(format!("trainer: {e}")),
    };
    let predicted = tessera_profile::simulate_memory(t.program()).report.peak_bytes;
    let mut step = |k: u64| onnx_batch(model, k, BATCH).and_then(|b| t.step_batch(&b));
    if let Err(e) = step(0).and_then(|_| gpu.synchronize()) {
        return fail(format!("warm-up step: {e}"));
    }
    gpu.reset_peaks();
    let st = match step(1) {
        Ok(s) => s,
        Err(e) => return fail(format!("step: {e}")),
    };
    if let Err(e) = gpu.synchronize() {
        return fail(format!("sync: {e}"));
    }
    let m = gpu.memory();
    let (program, scratch) = (m.program.peak, m.scratch.peak);
    let equal = program == st.peak_bytes;
    // The convolutions' columns are their declared workspace, held as Program memory: the
    // three books agree to the byte.
    let ok = predicted == st.peak_bytes && equal;
    println!(
        "{{\"check\":\"vision_memory\",\"model\":{},\"batch\":{BATCH},\"predicted_peak\":{predicted},\"accountant_peak\":{},\"allocator_program_peak\":{program},\"allocator_scratch_peak\":{scratch},\"program_equals_accountant\":{equal},\"ok\":{ok}}}",
        js(model),
        st.peak_bytes
    );
    if !ok {
        fails.push(format!(
            "vision memory {model}: predicted {predicted}, accountant {}, allocator program {program}",
            st.peak_bytes
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixtures' training graphs build, and step on the CPU with the check's batches.
    #[test]
    fn the_onnx_fixtures_train_on_the_cpu() {
        for (model, bytes) in FIXTURES {
            for dtype in [DType::F32, DType::BF16] {
                let g = onnx_graph(model, bytes, BATCH, dtype).expect("training graph");
                let mut t = Trainer::single(
                    g,
                    CpuBackend::new(0),
                    LrSchedule::Constant { lr: 1e-3 },
                    7,
                    None,
                )
                .expect("trainer");
                for k in 0..2 {
                    let st = t.step_batch(&onnx_batch(model, k, BATCH).unwrap()).expect("step");
                    assert!(st.loss.is_finite(), "{model} {dtype:?} step {k}: {}", st.loss);
                }
            }
        }
    }
}
