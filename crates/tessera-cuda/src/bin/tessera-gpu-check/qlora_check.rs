//! `qlora`: the quantised matmul's input gradient (`QMatMulBackward`, QLoRA's `dy ·
//! dequant(W)`) on the GPU against the CPU kernel.
//!
//! `qlora_op`: random codes, scales and dy, every quantisation the IR allows (int8 per output
//! channel and in groups, int4 in groups of 128, 32, 48 and odd groups that split a byte),
//! decode-sized (1 to 16 rows) and prefill-sized (up to 2048 rows) dy, 2-d and 3-d, in f32 and
//! bf16, the shapes off the kernel's 64×64 tiles and its 32-row steps. The CPU backend is the
//! reference (bf16: its upcast-compute-round). The end-to-end QLoRA run against the CPU is
//! `scripts/gpu-check.sh`'s `qlora-cli` stage.

use crate::infer_check::{guarded, json_str, s, R};
use candle_core::{Device, Tensor};
use std::sync::Arc;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{DType, Op, QuantSpec, Shape, TensorMeta};
use tessera_runtime::{Backend, CpuBackend};

/// (bits, K input features, group, N output features, dy's leading dims).
type Case = (u8, usize, usize, usize, &'static [usize]);

const CASES: &[Case] = &[
    // Decode-sized.
    (8, 256, 256, 96, &[1]),
    (4, 256, 128, 96, &[1]),
    (8, 1024, 1024, 130, &[3]),
    (4, 1024, 128, 200, &[8]),
    (4, 96, 48, 50, &[2, 1]),
    (8, 100, 25, 40, &[5]),
    (4, 36, 6, 10, &[16]),
    (4, 18, 3, 7, &[4]),
    // Prefill-sized: rows and features off the 64×64 tiles, N off the 32-row steps.
    (8, 256, 256, 96, &[2, 20]),
    (4, 512, 128, 130, &[100]),
    (4, 96, 32, 65, &[70]),
    (4, 18, 3, 33, &[33]),
    (8, 100, 25, 70, &[4, 17]),
    (4, 1024, 128, 1024, &[4, 512]),
    (8, 2048, 2048, 768, &[1, 2048]),
];

/// Runs the `qlora` checks, one JSON line per case, failures into `fails`.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let gpu = CudaBackend::new(gpu.clone());
    let cpu = CpuBackend::new(0);
    let mut st = 0x0B1A_5EED_0000_0049u64;
    let mut z = 0x9E37_79B9_7F4A_7C15u64;
    for &(bits, k, group, n, lead) in CASES {
        let q = QuantSpec { bits, group };
        let rb = q.row_bytes(k);
        let codes: Vec<u8> = (0..n * rb)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                (z >> 56) as u8
            })
            .collect();
        let scales: Vec<f32> = crate::uniform(&mut st, n * (k / group))
            .iter()
            .map(|u| 0.001 + 0.02 * (u + 1.0))
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let mut dims = lead.to_vec();
            dims.push(n);
            let dy = crate::uniform(&mut st, dims.iter().product());
            let case = format!("int{bits} K={k} group={group} N={n} dy={dims:?} {dtype:?}");
            guarded("qlora_op", &case, fails, || {
                let w = Tensor::from_vec(codes.clone(), (n, rb), &Device::Cpu).map_err(s)?;
                let sc =
                    Tensor::from_vec(scales.clone(), (n, k / group), &Device::Cpu).map_err(s)?;
                let dy = Tensor::from_vec(dy, dims.as_slice(), &Device::Cpu)
                    .and_then(|t| t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype)))
                    .map_err(s)?;
                one(&cpu, &gpu, q, [&dy, &w, &sc], dtype, &case)
            });
        }
    }
}

/// One case: the op on both backends, a `qlora_op` line; an error when the bound fails.
fn one(
    cpu: &CpuBackend,
    gpu: &CudaBackend,
    q: QuantSpec,
    x: [&Tensor; 3],
    dtype: DType,
    case: &str,
) -> R<()> {
    let op = Op::QMatMulBackward(q);
    let metas: Vec<TensorMeta> = x
        .iter()
        .map(|t| TensorMeta {
            shape: Shape::from(t.dims()),
            dtype: tessera_runtime::tensor::ir_dtype(t.dtype()).unwrap_or(DType::F32),
        })
        .collect();
    let out = op.infer(&metas.iter().collect::<Vec<_>>()).map_err(s)?;
    let at = MeshPos::single();
    let want = cpu.execute(&op, &x, &out, &at).map_err(s)?;
    let up: Vec<_> = x
        .iter()
        .map(|t| gpu.upload_as(t, Purpose::Scratch))
        .collect::<Result<_, _>>()
        .map_err(s)?;
    let refs: Vec<_> = up.iter().collect();
    let got = gpu.execute(&op, &refs, &out, &at).map_err(s)?;
    if got[0].dims() != out[0].shape.dims() || got[0].dtype() != out[0].dtype {
        return Err(format!("the GPU gave {} for {}", got[0].meta(), out[0]));
    }
    let got = gpu.download(&got[0]).map_err(s)?;
    let err = crate::rel_err(&got, &want[0]).map_err(s)?;
    let bound = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    if err > bound {
        // `guarded` prints the failure line.
        return Err(format!("rel err {err:e} (bound {bound})"));
    }
    println!(
        "{{\"check\":\"qlora_op\",\"case\":{},\"rel_err\":{err:e},\"bound\":{bound},\"ok\":true}}",
        json_str(case)
    );
    Ok(())
}
