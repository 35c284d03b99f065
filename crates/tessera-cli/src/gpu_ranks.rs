//! Which GPU each rank of a `--device cuda` run opens: GPU i for rank i where there are
//! enough GPUs; where there are fewer GPUs than ranks, ranks share them round-robin (rank i on
//! GPU i mod count), each with its own `Gpu::open` (its own stream, kernels and allocator, so
//! each rank's memory books are its own). A launched process (`mpirun`, `torchrun`) counts by
//! its local rank, the rank among the processes of its node.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// The GPU of a rank whose index on its node is `local` (a thread's rank, or a launched
/// process's local rank), over `count` GPUs.
pub fn ordinal(local: usize, count: usize) -> usize {
    local % count.max(1)
}

/// Opens the GPU of rank `rank` (a thread of this process, or the launcher's process: its local
/// rank then).
#[cfg(feature = "cuda")]
pub fn open(rank: usize) -> anyhow::Result<std::sync::Arc<tessera_cuda::Gpu>> {
    use anyhow::{bail, Context};
    let launched = tessera_comm::discover().ok().flatten();
    let local = launched.and_then(|env| env.local_rank).unwrap_or(rank);
    let count = tessera_cuda::Gpu::count().context("--device cuda")?;
    if count == 0 {
        bail!(
            "--device cuda: the NVIDIA driver sees no GPU (check CUDA_VISIBLE_DEVICES and \
             nvidia-smi), or use the CPU (drop --device cuda)"
        );
    }
    let gpu = ordinal(local, count);
    tessera_cuda::Gpu::open(gpu).with_context(|| format!("--device cuda: rank {rank} on GPU {gpu}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_their_own_gpu_or_share_round_robin() {
        // Enough GPUs: rank i on GPU i.
        assert_eq!((0..4).map(|r| ordinal(r, 8)).collect::<Vec<_>>(), [0, 1, 2, 3]);
        // Fewer: round-robin, every GPU used, at most ⌈ranks / GPUs⌉ ranks on one.
        assert_eq!((0..4).map(|r| ordinal(r, 1)).collect::<Vec<_>>(), [0, 0, 0, 0]);
        assert_eq!((0..6).map(|r| ordinal(r, 4)).collect::<Vec<_>>(), [0, 1, 2, 3, 0, 1]);
        // No GPU counted: GPU 0 (opening it then names the problem).
        assert_eq!(ordinal(3, 0), 0);
    }
}
