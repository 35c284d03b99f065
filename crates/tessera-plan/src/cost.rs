//! The cost model, in seconds. Compute is a roofline with a per-kernel overhead, or, on a
//! device whose kernels `tessera calibrate --device cuda` measured, the measured time of the
//! op's kind at its size ([`tessera_profile::kernels`]); collectives are alpha-beta over the
//! link of their mesh axis with ring formulas. The same functions price
//! strategies for the ILP and walk lowered Programs for the final prediction.
//!
//! Constants and their sources are in `cluster.rs` (device presets) and BENCHMARKS.md.

use crate::tiers::{HostTier, NvmeTier};
use crate::{AxisLink, DeviceSpec};
use tessera_ir::Tier;
use tessera_ir::{Collective, CommStep, DType, Op, TensorMeta};
use tessera_profile::kernels::kernel_work;

/// Non-tensor-core (SIMT) FP32 throughput as a fraction of the dense matmul peak: H100 SXM
/// 67 of 495 TFLOP/s (TF32 dense), A100 19.5 of 156 — both ≈ 1/7.5. Elementwise kernels are
/// memory-bound anyway; this only matters for reductions and attention's softmax.
const GPU_VECTOR_FRACTION: f64 = 1.0 / 7.5;

#[derive(Clone, Debug)]
pub struct CostModel {
    pub device: DeviceSpec,
    is_cpu: bool,
    /// The device's share of its host (offloaded optimizer steps, host↔device copies).
    pub host: HostTier,
    /// The device's share of the host's NVMe, if any.
    pub nvme: Option<NvmeTier>,
    /// Routing imbalance of a mixture of experts: the busiest expert's tokens over the
    /// balanced share (`k · n / E` of a group's `n` tokens), ≥ 1 ([`CostModel::expert_share`]).
    /// 1 (the default) is balanced routing, the regime published MoE throughput is measured
    /// in (Megatron-LM's MoE README: `--moe-router-force-load-balancing` exists "for
    /// benchmarking purposes only", its example run is to be timed after 500 iterations, once
    /// the early imbalance is gone; NVIDIA's Megatron-MoE-ModelZoo reports Qwen3-235B at 295
    /// TFLOP/s per H100 forced balanced against 237 dropless).
    pub moe_imbalance: f64,
}

impl CostModel {
    /// The device alone, with a desktop host tier (see [`CostModel::for_cluster`]).
    pub fn new(device: DeviceSpec) -> CostModel {
        let is_cpu = device.name.eq_ignore_ascii_case("cpu");
        CostModel { device, is_cpu, host: HostTier::preset("", 1), nvme: None, moe_imbalance: 1.0 }
    }

    /// The model with routing imbalance `f` (see [`CostModel::moe_imbalance`]).
    pub fn with_moe_imbalance(mut self, f: f64) -> CostModel {
        self.moe_imbalance = f;
        self
    }

    /// The share of an expert matmul's capacity rows the busiest expert fills, in a graph with
    /// routed experts (`None` without): `min(1, f · k · n / (E · C))` for `E` experts of
    /// capacity `C` per group of `n` tokens each choosing `k`, `f` the imbalance. The Program
    /// holds every capacity row (its memory and its all-to-alls are the capacity's), but a
    /// grouped GEMM runs the rows routed to it, and the busiest expert sets the pace of the
    /// devices that wait for it: every expert is priced at the busiest one's rows.
    pub fn expert_share(&self, g: &tessera_ir::Graph) -> Option<f64> {
        let slots = g.nodes.iter().find(|n| matches!(n.op, Op::MoeSlots { .. }))?;
        let Op::MoeSlots { experts, capacity } = slots.op else { return None };
        let d = g.meta(slots.inputs[0]).shape.dims().to_vec();
        let (n, k) = match d.as_slice() {
            [.., n, k] => (*n, *k),
            _ => return None,
        };
        let busiest = self.moe_imbalance.max(1.0) * (k * n) as f64 / experts.max(1) as f64;
        Some((busiest / capacity.max(1) as f64).min(1.0))
    }

    /// [`CostModel::op_time`] of a node of a graph whose experts fill `expert_share` of their
    /// capacity rows ([`CostModel::expert_share`]): an expert matmul (a batched matmul of two
    /// rank-3 operands, which only the experts' `[E, rows, ·]` products are in a model with
    /// experts: linear layers have 2-D weights) runs that share of its work, never less than
    /// reading its smaller operand (the weights, when few tokens reach them).
    pub fn node_time(
        &self,
        op: &Op,
        x: &[&TensorMeta],
        y: &[&TensorMeta],
        expert_share: Option<f64>,
    ) -> f64 {
        let full = self.op_time(op, x, y);
        let Some(share) = expert_share else { return full };
        let expert = matches!(op, Op::MatMul { .. })
            && x.len() == 2
            && x.iter().all(|m| m.shape.rank() == 3);
        if !expert || share >= 1.0 {
            return full;
        }
        let fixed = match &self.device.kernels {
            Some(k) => k.gap_s,
            None => self.device.kernel_overhead_s,
        };
        let d = &self.device;
        let floor = x.iter().map(|m| m.size_bytes()).min().unwrap_or(0) as f64
            / (d.memory_bandwidth * d.memory_efficiency);
        let work = (full - fixed).max(0.0);
        fixed + (work * share).max(floor.min(work))
    }

    /// The cluster's device with its host and NVMe tiers.
    pub fn for_cluster(cluster: &crate::Cluster) -> CostModel {
        CostModel {
            host: cluster.host,
            nvme: cluster.nvme,
            ..CostModel::new(cluster.device.clone())
        }
    }

    /// Time of a node that runs in `tier` (see [`tessera_ir::Node::tier`]): the device's
    /// roofline ([`CostModel::op_time`]); on the host, AdamW at the host's optimizer throughput
    /// and anything else at its memory bandwidth.
    pub fn op_time_in(&self, tier: Tier, op: &Op, x: &[&TensorMeta], y: &[&TensorMeta]) -> f64 {
        if tier == Tier::Device {
            return self.op_time(op, x, y);
        }
        if op.is_leaf() && !matches!(op, Op::Fill { .. }) {
            return 0.0;
        }
        match op {
            Op::Reshape(_) | Op::Expand(_) | Op::Reshard(_) | Op::Transfer { .. } => 0.0,
            Op::AdamW(_) => {
                x.first().map_or(0.0, |p| p.numel() as f64 / self.host.adam_params_per_s)
            }
            _ => op.bytes_accessed(x, y) as f64 / self.host.memory_bandwidth,
        }
    }

    /// Time of moving `bytes` from tier `from` to tier `to`: the host link between device and
    /// host (latency + bytes / bandwidth), the NVMe's read or write bandwidth below the host
    /// (a device↔NVMe move is staged through the host: both legs).
    pub fn transfer_time(&self, from: Tier, to: Tier, bytes: u64) -> f64 {
        let b = bytes as f64;
        let pcie = |b: f64| self.host.link.latency_s + b / self.host.link.bandwidth;
        let nvme = self.nvme.unwrap_or_else(|| NvmeTier::with_capacity(1));
        match (from, to) {
            (a, b2) if a == b2 => 0.0,
            (Tier::Device, Tier::Host) | (Tier::Host, Tier::Device) => pcie(b),
            (Tier::Nvme, Tier::Host) => b / nvme.read_bandwidth,
            (Tier::Host, Tier::Nvme) => b / nvme.write_bandwidth,
            (Tier::Nvme, Tier::Device) => b / nvme.read_bandwidth + pcie(b),
            (Tier::Device, Tier::Nvme) => pcie(b) + b / nvme.write_bandwidth,
            _ => 0.0,
        }
    }

    /// The host's AdamW over `elems` parameters plus the copies that bring their gradient
    /// (`grad_bytes`) down and the updated weight (`weight_bytes`) back: the ILP's estimate of
    /// an offloaded parameter's optimizer step.
    pub fn offloaded_step_time(&self, elems: usize, grad_bytes: u64, weight_bytes: u64) -> f64 {
        elems as f64 / self.host.adam_params_per_s
            + self.transfer_time(Tier::Device, Tier::Host, grad_bytes)
            + self.transfer_time(Tier::Host, Tier::Device, weight_bytes)
    }

    /// Time of one kernel on local metas: max(compute, memory) + launch overhead. Views and
    /// leaves cost nothing; collectives are priced by [`CostModel::reshard_time`].
    pub fn op_time(&self, op: &Op, x: &[&TensorMeta], y: &[&TensorMeta]) -> f64 {
        // A measured kernel, where the device was calibrated and met this kind (fills
        // included: the runtime launches a kernel for them).
        if let Some(k) = &self.device.kernels {
            if let Some(secs) = kernel_work(op, x, y).and_then(|w| k.device_seconds(&w)) {
                return secs + k.gap_s;
            }
        }
        if op.is_leaf() || matches!(op, Op::Reshape(_) | Op::Expand(_) | Op::Reshard(_)) {
            return 0.0;
        }
        let flops = op.flops(x, y);
        let bytes = op.bytes_accessed(x, y) as f64;
        let dtype = x.first().or(y.first()).map_or(DType::F32, |m| m.dtype);
        let d = &self.device;
        let peak = d.peak_flops(dtype) * d.matmul_efficiency;
        let vector = if self.is_cpu { peak } else { d.fp32_flops * GPU_VECTOR_FRACTION };
        let compute = flops.matmul as f64 / peak + flops.other as f64 / vector;
        let memory = bytes / (d.memory_bandwidth * d.memory_efficiency);
        compute.max(memory) + d.kernel_overhead_s
    }

    /// The host's time to dispatch `op` where the device's kernels were measured (the step
    /// is then replayed as the host issues it: [`crate::lower::StepTime::issue_wait_s`]), else
    /// `None`: an uncalibrated device is modelled as never waiting on its host.
    pub fn issue_time(&self, op: &Op) -> Option<f64> {
        self.device.kernels.as_ref().map(|k| k.host_seconds(op.name()))
    }

    /// Time of the AdamW update of `elems` elements of a `dtype` parameter (the kernel lowering
    /// emits: parameter, gradient, m, v and, below f32, the master copy, read and written).
    pub fn optimizer_step_time(&self, elems: usize, dtype: DType) -> f64 {
        if elems == 0 {
            return 0.0;
        }
        let shape = tessera_ir::Shape::new(vec![elems]);
        let param = TensorMeta::new(shape.clone(), dtype);
        let state = TensorMeta::new(shape, DType::F32);
        let scalar = TensorMeta::new(tessera_ir::Shape::scalar(), DType::F32);
        let step = TensorMeta::new(tessera_ir::Shape::scalar(), DType::I64);
        let mut x = vec![&param, &param, &state, &state, &scalar, &step, &scalar];
        if dtype != DType::F32 {
            x.push(&state);
        }
        let spec = tessera_ir::AdamWSpec {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: None,
            grad_scale: false,
        };
        let op = Op::AdamW(spec);
        // The metas above are well-formed by construction (a unit test checks the time is
        // positive), so inference cannot fail.
        let y = op.infer(&x).unwrap_or_default();
        self.op_time(&op, &x, &y.iter().collect::<Vec<_>>())
    }

    /// Time of a sequence of collective steps starting from a local tensor `input`.
    pub fn reshard_time(&self, links: &[AxisLink], steps: &[CommStep], input: &TensorMeta) -> f64 {
        let mut shape = input.shape.clone();
        let mut t = 0.0;
        for s in steps {
            let bytes = TensorMeta::new(shape.clone(), input.dtype).size_bytes();
            t += collective_time(links[s.axis], s.size, s.op, bytes);
            shape = match s.apply(&shape) {
                Ok(s) => s,
                Err(_) => return f64::INFINITY,
            };
        }
        t
    }
}

/// One collective over `n` devices on `link`, where each device holds `bytes` before it
/// (ring algorithms; see DESIGN §4):
///
/// | collective | time |
/// |---|---|
/// | all-gather | (n−1)·α + (n−1)·B/bw (the output is n·B) |
/// | reduce-scatter | (n−1)·α + (n−1)/n·B/bw |
/// | all-reduce | 2(n−1)·α + 2(n−1)/n·B/bw |
/// | all-to-all | (n−1)·α + (n−1)/n·B/bw |
/// | shard (local slice) | 0 |
pub fn collective_time(link: AxisLink, n: usize, op: Collective, bytes: u64) -> f64 {
    crate::reshard::collective_time(op, n, bytes as f64, &link)
}

/// Gradient synchronisation and ZeRO gathers are coalesced into buckets (PyTorch DDP's 25 MiB
/// default): latency is paid per bucket, not per tensor.
pub const BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

/// [`collective_time`] with the latency shared across a bucket: the bandwidth term in full, the
/// latency term for the fraction of a bucket these bytes fill.
pub fn bucketed_time(link: AxisLink, n: usize, op: Collective, bytes: u64) -> f64 {
    let full = collective_time(link, n, op, bytes);
    let latency = collective_time(link, n, op, 0);
    let share = (bytes as f64 / BUCKET_BYTES).min(1.0);
    full - latency + latency * share
}

/// Predicted time of one step, from walking the Program with the cost model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTime {
    pub forward_compute_s: f64,
    pub backward_compute_s: f64,
    pub optimizer_compute_s: f64,
    /// Forward work re-run in the backward pass (activation checkpointing): compute and the
    /// collectives it repeats.
    pub recompute_s: f64,
    /// `recompute_s` by block index.
    pub recompute_by_block_s: Vec<f64>,
    /// Collectives on the critical path (tensor/sequence parallel activations).
    pub blocking_comm_s: f64,
    /// Collectives on parameters and gradients (data parallel, ZeRO), which run beside the
    /// compute of their pass.
    pub overlapped_comm_s: f64,
    /// The part of `overlapped_comm_s` issued in the forward pass (parameter gathers), which
    /// only the forward compute hides; the rest hides behind the backward pass and its
    /// recomputation.
    pub overlapped_forward_comm_s: f64,
    /// The part of `overlapped_comm_s` that the compute does not hide.
    pub exposed_comm_s: f64,
    pub step_time_s: f64,
    /// Compute seconds per op kind (`matmul`, `attention`, `adamw`, ..), all phases.
    pub compute_by_op_s: std::collections::BTreeMap<&'static str, f64>,
    /// Offload: seconds of copies between tiers (host link, NVMe) over the step.
    pub transfer_s: f64,
    /// Offload: seconds of host work (the offloaded chunks' AdamW, their norm terms).
    pub host_compute_s: f64,
    /// Offload: what copies and host work add to the step beyond the device's own time (the
    /// rest runs beside the device's compute).
    pub offload_exposed_s: f64,
    /// Offload: bytes moved between tiers in one step.
    pub moved_bytes: u64,
    /// On a calibrated GPU: how long the device waits for the host to issue the step's
    /// kernels (the in-order launch queue replayed with each op's measured host and device
    /// time); 0 on devices without measured kernels.
    pub issue_wait_s: f64,
}

impl StepTime {
    /// The share of the copies and host work of an offloaded step that runs beside the
    /// device's compute (1: all hidden; `None` without offload).
    pub fn offload_hidden_fraction(&self) -> Option<f64> {
        let work = self.transfer_s + self.host_compute_s;
        (work > 0.0).then(|| (1.0 - self.offload_exposed_s / work).clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One MoE layer's slots and an expert matmul: `E` experts of capacity `c`, groups of `n`
    /// tokens choosing `k`.
    fn routed(n: usize, k: usize, e: usize, c: usize) -> tessera_ir::Graph {
        let mut b = tessera_ir::Builder::new();
        let idx = b.input("idx", [2, n, k], DType::I64);
        b.moe_slots(idx, e, c).expect("slots");
        b.finish()
    }

    #[test]
    fn expert_matmuls_run_the_busiest_experts_rows() {
        let m = CostModel::new(crate::cluster::device_preset("H100").expect("preset"));
        // Dropless: 64 tokens, top-2 of 8: 16 rows per expert of 64 (a quarter), balanced.
        let g = routed(64, 2, 8, 64);
        assert_eq!(m.expert_share(&g), Some(0.25));
        assert_eq!(m.clone().with_moe_imbalance(2.0).expert_share(&g), Some(0.5));
        // Never more than the capacity holds: capacity factor 1 at imbalance 1.5.
        let g1 = routed(64, 2, 8, 16);
        assert_eq!(m.clone().with_moe_imbalance(1.5).expert_share(&g1), Some(1.0));
        // A graph without experts has no share; a dense matmul is priced as it was.
        let mut b = tessera_ir::Builder::new();
        b.input("x", [4, 4], DType::F32);
        assert_eq!(m.expert_share(&b.finish()), None);
        let big = TensorMeta::new(tessera_ir::Shape::new(vec![8, 4096, 4096]), DType::BF16);
        let w = TensorMeta::new(tessera_ir::Shape::new(vec![8, 4096, 4096]), DType::BF16);
        let op = Op::MatMul { trans_a: false, trans_b: true };
        let full = m.op_time(&op, &[&big, &w], &[&big]);
        assert_eq!(m.node_time(&op, &[&big, &w], &[&big], None), full);
        // A quarter of the rows: about a quarter of the time (the weights' read a floor).
        let quarter = m.node_time(&op, &[&big, &w], &[&big], Some(0.25));
        let overhead = m.device.kernel_overhead_s;
        assert!((quarter - overhead - 0.25 * (full - overhead)).abs() < 1e-12, "{quarter} {full}");
        // A 2-D weight is a dense layer's: not an expert matmul.
        let w2 = TensorMeta::new(tessera_ir::Shape::new(vec![4096, 4096]), DType::BF16);
        let dense = m.op_time(&op, &[&big, &w2], &[&big]);
        assert_eq!(m.node_time(&op, &[&big, &w2], &[&big], Some(0.25)), dense);
    }

    #[test]
    fn optimizer_step_is_memory_bound_and_scales_with_elements() {
        let m = CostModel::new(crate::cluster::device_preset("H100").expect("preset"));
        let small = m.optimizer_step_time(1 << 20, DType::F32);
        let big = m.optimizer_step_time(1 << 30, DType::F32);
        // 2^30 f32 elements: param, grad, m, v read + param, m, v written = 28 bytes each.
        let floor = 28.0 * (1u64 << 30) as f64 / m.device.memory_bandwidth;
        assert!(big >= floor && big < 2.0 * floor, "{big} vs {floor}");
        assert!(small > 0.0 && small < big / 100.0);
        // A bf16 weight also carries an f32 master copy.
        assert!(m.optimizer_step_time(1 << 30, DType::BF16) > big * 0.9);
    }
}
