//! Dropout on the GPU with the CPU's mask, bit for bit: each element's keep bit hashes its
//! index in the single-device tensor. Unsharded that is the flat index (`dropout`); for a
//! shard of a tensor-parallel plan (`Op::Dropout`'s `shard`) the kernel maps the local flat
//! index to the global one (`dropout_sharded`), so every plan draws the single-device mask.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, elementwise_ops, launch, Arg};
use crate::source::float_code;
use crate::tensor::{CudaTensor, Layout};
use tessera_ir::dist::{MeshPos, ShardOf};
use tessera_ir::{DType, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

/// Inputs `x, seed` (an i64 scalar) → `y`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    be: &CudaBackend,
    x: &[&CudaTensor],
    prob: f64,
    stream: u64,
    shard: Option<&ShardOf>,
    at: &MeshPos,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    if x[1].dtype() != DType::I64 || x[1].numel() != 1 {
        return Err(bad(format!("dropout: the seed must be an i64 scalar, got {}", x[1].meta())));
    }
    if !(0.0..1.0).contains(&prob) {
        return Err(bad(format!("dropout: probability {prob} must be in [0, 1)")));
    }
    let y = be.out_f32(out, p)?;
    let n = y.numel();
    let threshold = (prob * (1u64 << 53) as f64).ceil() as u64;
    let scale = (1.0 / (1.0 - prob)) as f32;
    let lx = x[0].layout()?;
    let mut cfg = elementwise_ops(n, &[(x[0].base(), lx, x[0].dtype())], (y.ptr(), y.dtype()));
    let mut args = vec![
        Arg::Ptr(x[0].base()),
        Arg::Layout(lx),
        Arg::I32(float_code("dropout", x[0].dtype())?),
        Arg::Ptr(y.ptr()),
        Arg::I32(float_code("dropout", y.dtype())?),
        Arg::Ptr(x[1].ptr()),
        Arg::U64(stream),
        Arg::U64(threshold),
        Arg::F32(scale),
    ];
    let name = match shard {
        None => "dropout",
        Some(s) => {
            let gmap = index_map(y.dims(), s, at)?;
            // The kernel's eight-at-a-time path needs the map's innermost run to hold whole
            // groups of eight; otherwise a thread per element.
            if !runs_of_eight(&gmap) {
                cfg = elementwise(n);
            }
            args.push(Arg::Layout(gmap));
            "dropout_sharded"
        }
    };
    args.push(Arg::I64(n as i64));
    launch(be.gpu(), name, cfg, &args)?;
    Ok(y)
}

/// The sharded kernel's map from a flat output index to the element's index in the
/// single-device tensor, which keys its mask bit: the local dims with the global tensor's
/// strides from the shard's first element ([`ShardOf::index_map`]), read as the kernels read
/// a [`Layout`] (`at` in `kernels.cu`, [`Layout::offset_of`] here).
fn index_map(dims: &[usize], s: &ShardOf, at: &MeshPos) -> Result<Layout> {
    if s.global.len() != dims.len() {
        return Err(bad(format!(
            "dropout: the mask's shard of {:?} has {} dims, the tensor {dims:?} has {}; the \
             planner's lowering must give the shard of this tensor",
            s.global,
            s.global.len(),
            dims.len()
        )));
    }
    if dims.len() > crate::tensor::MAXD {
        return Err(bad(format!(
            "dropout: a tensor of {} dims (the CUDA kernels address at most {})",
            dims.len(),
            crate::tensor::MAXD
        )));
    }
    let (base, strides) = s.index_map(Some(at))?;
    let mut l = Layout { ndim: dims.len() as i32, offset: base as i64, ..Default::default() };
    for (i, (&d, &st)) in dims.iter().zip(&strides).enumerate() {
        l.dims[i] = d as i64;
        l.strides[i] = st as i64;
    }
    Ok(l)
}

/// Whether the collapsed map steps by its innermost stride within every aligned group of
/// eight (`run8` in the kernel): one dim, or an innermost dim a multiple of 8 long.
fn runs_of_eight(map: &Layout) -> bool {
    let c = map.collapsed();
    c.ndim <= 1 || c.dims[c.ndim as usize - 1] % 8 == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_ir::dist::{global_index, row_major_strides};

    /// The map the kernel reads (collapsed, as launched) gives every local element the global
    /// index the CPU kernel keys its mask by, on every device of the mesh.
    #[test]
    fn the_kernels_map_is_the_cpus_global_index() {
        // (global shape, placement, mesh, micro-batch, whether the map runs in eights)
        type Case = (Vec<usize>, Vec<Vec<usize>>, Vec<usize>, usize, bool);
        let cases: [Case; 4] = [
            (vec![4, 6, 16], vec![vec![0], vec![], vec![]], vec![2], 1, true),
            (vec![4, 6, 16], vec![vec![], vec![], vec![1]], vec![2, 2], 0, true),
            (vec![4, 6, 16], vec![vec![0], vec![1], vec![]], vec![2, 3], 2, true),
            (vec![4, 6, 16], vec![vec![], vec![], vec![0, 1]], vec![2, 2], 0, false),
        ];
        for (global, placement, mesh, mb, run8) in cases {
            let size: usize = mesh.iter().product();
            let shard =
                ShardOf { global: global.clone(), placement: placement.clone(), micro_batch: mb };
            for rank in 0..size {
                let at = MeshPos::new(&mesh, rank).unwrap();
                let local: Vec<usize> = global
                    .iter()
                    .zip(&placement)
                    .map(|(&g, axes)| g / at.chunk(axes).unwrap().0)
                    .collect();
                let map = index_map(&local, &shard, &at).unwrap();
                assert_eq!(runs_of_eight(&map), run8, "{placement:?}");
                let launched = map.collapsed();
                let (base, strides) = shard.index_map(Some(&at)).unwrap();
                let lstrides = row_major_strides(&local);
                let n: usize = local.iter().product();
                for i in 0..n as u64 {
                    let want = global_index(i, &lstrides, base, &strides);
                    assert_eq!(launched.offset_of(i as i64) as u64, want, "rank {rank} index {i}");
                }
            }
        }
        let bad = ShardOf { global: vec![4, 6], placement: vec![vec![], vec![]], micro_batch: 0 };
        assert!(index_map(&[4, 6, 1], &bad, &MeshPos::single()).is_err());
    }
}
