//! Kernels written and compiled but not yet run on a GPU: the backend refuses them unless
//! [`ENV`] is `1`, so no run trains on numerics nobody has checked. An op leaves [`kernels`]
//! when a GPU run of its `tessera-gpu-check` stage (and `scripts/gpu-check.sh`'s shared-GPU
//! and CLI stages) has passed.

use tessera_ir::Op;

/// The environment variable that lets kernels not yet run on a GPU run ([`kernels`]);
/// `scripts/gpu-check.sh` sets it, to check them.
pub const ENV: &str = "TESSERA_CUDA_UNVERIFIED";

/// Kernels written and compiled (NVRTC, ptxas for sm_90) but never yet run on a GPU: refused
/// unless [`ENV`] is `1`, so no run trains on unchecked numerics. Each leaves this
/// list when a GPU run of its `tessera-gpu-check` stage passes.
pub(crate) fn kernels(op: &Op, inputs: usize) -> Option<&'static str> {
    match op {
        Op::TopK { .. }
        | Op::TakeAlong
        | Op::ScatterAlong { .. }
        | Op::MoeSlots { .. }
        | Op::MoeDispatch { .. }
        | Op::MoeCombine
        | Op::MoeSlotDot => Some("the mixture-of-experts routing kernels"),
        Op::AttentionMerge | Op::AttentionMergeBackward | Op::RingMerge(_) => {
            Some("ring attention's kernels")
        }
        Op::Attention(spec) | Op::AttentionBackward(spec) if spec.ring.is_some() => {
            Some("ring attention's kernels")
        }
        Op::AttentionBackward(_) if inputs == 7 => Some("ring attention's kernels"),
        Op::Attention(spec) | Op::AttentionBackward(spec) if spec.kv_whole.is_some() => {
            Some("the attention kernels past the KV heads (tp > KV heads)")
        }
        Op::QMatMulBackward(_) => Some("the quantised matmul's backward kernels (QLoRA)"),
        _ => None,
    }
}

pub(crate) fn allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var(ENV).is_ok_and(|v| v == "1"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_ir::{AttentionSpec, QuantSpec};

    /// The MoE routing, ring attention, past-the-KV-heads and QLoRA-backward ops are held
    /// back; the ops already checked on a GPU (plain attention, its 6-input backward, the
    /// quantised forward) are not.
    #[test]
    fn only_the_ops_not_yet_run_on_a_gpu_are_held_back() {
        let plain = AttentionSpec::causal(16);
        let q = QuantSpec { bits: 8, group: 32 };
        assert!(kernels(&Op::MoeCombine, 3).is_some());
        assert!(kernels(&Op::AttentionMerge, 4).is_some());
        assert!(kernels(&Op::AttentionBackward(plain.clone()), 7).is_some());
        assert!(kernels(&Op::QMatMulBackward(q), 3).is_some());
        assert!(kernels(&Op::Attention(plain.clone()), 3).is_none());
        assert!(kernels(&Op::AttentionBackward(plain), 6).is_none());
        assert!(kernels(&Op::QMatMul(q), 3).is_none());
        assert!(kernels(&Op::Cast(tessera_ir::DType::BF16), 1).is_none());
    }
}
