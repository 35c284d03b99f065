//! CPU kernels, one module per op family (mirroring `tessera_ir::ops`), dispatched by an
//! exhaustive match: a new IR op does not compile until it has a kernel here.
//!
//! Conventions shared by every kernel:
//! - inputs may be non-contiguous (views made by `Expand`); kernels call
//!   [`crate::tensor::contiguous`] before reading slices;
//! - outputs are fresh contiguous tensors of exactly the IR's output metas, except where the
//!   IR declares an alias (`Reshape`, `Expand` share storage; `AdamW` updates in place);
//! - no kernel allocates a temporary larger than its declared workspace
//!   (`Op::workspace_bytes`) beyond O(rows) scratch, so the heap follows the Program;
//! - arithmetic is f32 with f32 (or wider) accumulation; integer inputs are i64. bf16 matrix
//!   products run on bf16 operands where the CPU has AMX-BF16 or AVX512_BF16 ([`gemm_bf16`],
//!   `gemm_amx`, still f32 accumulation); binary and unary ops (and their backward),
//!   reductions, dropout and the cross-entropy read bf16 operands in place and round once;
//!   everything else that computes on half precision is upcast by the backend ([`convert`]);
//! - an output the kernel writes whole is allocated uninitialised (`strided::fresh`), not
//!   zeroed first.

mod attention;
mod attention_merge;
mod convert;
mod elementwise;
mod embedding;
#[cfg(target_arch = "x86_64")]
mod gemm_amx;
mod gemm_bf16;
mod infer;
mod inplace;
mod layout;
mod linear_loss;
mod loss;
mod matmul;
mod moe;
mod norm;
mod optim;
#[cfg(target_arch = "x86_64")]
mod pack_avx512;
mod quant;
mod reduce;
pub mod simd;
mod strided;
mod tiled_mlp;
mod vision;

pub use attention::{attention_backward_within, attention_within};
pub use convert::to_dtype as convert_dtype;
pub use gemm_bf16::{gemm_bf16_dense, Bf16Kernel};
pub use loss::check_targets;

use crate::{Result, RuntimeError};
use candle_core::Tensor;
use tessera_ir::dist::{MeshPos, TableRows};
use tessera_ir::{Op, TensorMeta};

/// Runs one op on the only device of a 1-device mesh. `out` are the IR's output metas
/// (shapes, dtypes) for this node.
pub fn execute(op: &Op, x: &[&Tensor], out: &[TensorMeta]) -> Result<Vec<Tensor>> {
    execute_at(op, x, out, &MeshPos::single())
}

/// Runs one op on the device at `at` in its mesh (which picks the device's slice of a sharded
/// dropout mask).
pub fn execute_at(op: &Op, x: &[&Tensor], out: &[TensorMeta], at: &MeshPos) -> Result<Vec<Tensor>> {
    let one = |t: Tensor| Ok(vec![t]);
    match op {
        Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => Err(
            RuntimeError::Binding(format!("{} is a leaf: bind it, do not execute it", op.name())),
        ),
        Op::Fill { value, meta } => one(elementwise::fill(*value, meta)?),
        Op::Unary(u) => one(elementwise::unary(*u, x[0])?),
        Op::UnaryBackward(u) => one(elementwise::unary_backward(*u, x[0], x[1])?),
        Op::Binary(b) => one(elementwise::binary(*b, x[0], x[1], &out[0])?),
        Op::BinaryBackward { op, wrt } => {
            one(elementwise::binary_backward(*op, *wrt, x[0], x[1], x[2], &out[0])?)
        }
        Op::Cast(d) => one(elementwise::cast(x[0], *d)?),
        Op::Dropout { p, stream, shard } => {
            let map = match shard {
                Some(s) => Some(s.index_map(Some(at))?),
                None => None,
            };
            one(elementwise::dropout(x[0], x[1], *p, *stream, map)?)
        }
        Op::MatMul { trans_a, trans_b } => {
            one(matmul::matmul(x[0], x[1], *trans_a, *trans_b, &out[0])?)
        }
        Op::Reduce { op, dims, keepdim } => {
            one(reduce::reduce(*op, dims, *keepdim, x[0], &out[0])?)
        }
        Op::ReduceBackward { op, dims, keepdim } => {
            one(reduce::reduce_backward(*op, dims, *keepdim, x[0], x[1], &out[0])?)
        }
        Op::Softmax => one(reduce::softmax(x[0])?),
        Op::SoftmaxBackward => one(reduce::softmax_backward(x[0], x[1])?),
        Op::Reshape(s) => one(layout::reshape(x[0], s)?),
        Op::Permute(p) => one(layout::permute(x[0], p)?),
        Op::Slice { dim, start, end } => one(layout::slice(x[0], *dim, *start, *end)?),
        Op::Pad { dim, before, after } => one(layout::pad(x[0], *dim, *before, *after)?),
        Op::Concat { dim } => one(layout::concat(x, *dim)?),
        Op::Expand(s) => one(layout::expand(x[0], s)?),
        Op::LayerNorm { eps } => one(norm::layer_norm(x[0], x[1], x[2], *eps)?),
        Op::LayerNormBackward { eps } => norm::layer_norm_backward(x[0], x[1], x[2], *eps),
        Op::RmsNorm { eps } => one(norm::rms_norm(x[0], x[1], *eps)?),
        Op::RmsNormBackward { eps } => norm::rms_norm_backward(x[0], x[1], x[2], *eps),
        Op::Embedding { rows } => {
            let table_rows =
                TableRows::of(rows.as_ref(), x[0].dims().first().copied().unwrap_or(0), Some(at))?;
            one(embedding::embedding(x[0], x[1], &table_rows)?)
        }
        Op::EmbeddingBackward { num_embeddings, rows } => {
            let table_rows = TableRows::of(rows.as_ref(), *num_embeddings, Some(at))?;
            one(embedding::embedding_backward(x[0], x[1], *num_embeddings, &table_rows)?)
        }
        Op::CrossEntropy { ignore_index, sum, classes } => {
            let v = x[0].dims().last().copied().unwrap_or(0);
            let rows = TableRows::of(classes.as_ref(), v, Some(at))?;
            loss::cross_entropy(x[0], x[1], x.get(2).copied(), *ignore_index, *sum, &rows)
        }
        Op::CrossEntropyBackward { ignore_index, sum, classes } => {
            let v = x[0].dims().last().copied().unwrap_or(0);
            let rows = TableRows::of(classes.as_ref(), v, Some(at))?;
            let (ig, s) = (*ignore_index, *sum);
            one(loss::cross_entropy_backward(x[0], x[1], x[2], x[3], ig, s, &rows)?)
        }
        Op::LogSumExp => one(loss::logsumexp_rows(x[0])?),
        Op::LinearCrossEntropy { chunk_rows, ignore_index } => {
            linear_loss::linear_cross_entropy(x[0], x[1], x[2], *chunk_rows, *ignore_index)
        }
        Op::LinearCrossEntropyBackward { chunk_rows, ignore_index } => {
            linear_loss::linear_cross_entropy_backward(x, *chunk_rows, *ignore_index)
        }
        Op::TiledMlp(spec) => one(tiled_mlp::tiled_mlp(x, spec)?),
        Op::TiledMlpBackward(spec) => tiled_mlp::tiled_mlp_backward(x, spec),
        Op::Attention(spec) => attention::attention(x[0], x[1], x[2], x.get(3).copied(), spec, at),
        Op::AttentionBackward(spec) => attention::attention_backward(x, spec, at),
        Op::AttentionMerge => one(attention_merge::merge(x)?),
        Op::AttentionMergeBackward => attention_merge::merge_backward(x),
        Op::RingMerge(_) => attention_merge::ring_merge(x),
        Op::Rope { inv_freq, inverse } => {
            one(attention::rope(x[0], x.get(1).copied(), inv_freq, *inverse)?)
        }
        Op::CacheWrite => one(infer::cache_write(x[0], x[1], x[2])?),
        Op::SelectPositions => one(infer::select_positions(x[0], x[1])?),
        Op::QMatMul(q) => one(quant::qmatmul(x[0], x[1], x[2], *q)?),
        Op::QMatMulBackward(q) => one(quant::qmatmul_backward(x[0], x[1], x[2], *q)?),
        Op::AdamW(spec) => optim::adamw(spec, x),
        Op::TopK { k } => moe::top_k(x[0], *k),
        Op::TakeAlong => one(moe::take_along(x[0], x[1])?),
        Op::ScatterAlong { size } => one(moe::scatter_along(x[0], x[1], *size)?),
        Op::MoeSlots { experts, capacity } => one(moe::moe_slots(x[0], *experts, *capacity)?),
        Op::MoeDispatch { experts, capacity } => {
            one(moe::moe_dispatch(x[0], x[1], x.get(2).copied(), *experts, *capacity)?)
        }
        Op::MoeCombine => one(moe::moe_combine(x[0], x[1], x.get(2).copied())?),
        Op::MoeSlotDot => one(moe::moe_slot_dot(x[0], x[1], x[2])?),
        Op::Conv2d(spec) => one(vision::conv2d(x[0], x[1], spec, &out[0])?),
        Op::Conv2dBackwardInput { spec, .. } => {
            one(vision::conv2d_backward_input(x[0], x[1], spec, &out[0])?)
        }
        Op::Conv2dBackwardWeight { spec, .. } => {
            one(vision::conv2d_backward_weight(x[0], x[1], spec, &out[0])?)
        }
        Op::GroupNorm { groups, eps } => one(vision::group_norm(x[0], x[1], x[2], *groups, *eps)?),
        Op::GroupNormBackward { groups, eps } => {
            vision::group_norm_backward(x[0], x[1], x[2], *groups, *eps)
        }
        Op::MaxPool2d(pool) => one(vision::max_pool2d(x[0], pool, &out[0])?),
        Op::MaxPool2dBackward(pool) => one(vision::max_pool2d_backward(x[0], x[1], pool, &out[0])?),
        Op::AvgPool2d { pool, count_include_pad } => {
            one(vision::avg_pool2d(x[0], pool, *count_include_pad, &out[0])?)
        }
        Op::AvgPool2dBackward { pool, count_include_pad, .. } => {
            one(vision::avg_pool2d_backward(x[0], pool, *count_include_pad, &out[0])?)
        }
        Op::Upsample2d { scale } => one(vision::upsample2d(x[0], *scale, &out[0])?),
        Op::Upsample2dBackward { scale } => {
            one(vision::upsample2d_backward(x[0], *scale, &out[0])?)
        }
        // A move between memory tiers is a real copy into a buffer of the destination tier
        // (on the CPU both tiers are this process's memory; the executor charges each to its
        // tier's accountant).
        Op::Transfer { .. } => one(x[0].copy()?),
        // Groups of one device move nothing; larger ones need the SPMD runtime's communicator.
        Op::Reshard(spec) if spec.forward.iter().all(|s| s.size == 1) => one(x[0].clone()),
        Op::Send(_) | Op::Recv(..) => Err(RuntimeError::Binding(
            "a transfer between pipeline stages needs a communicator: run the plan with the SPMD \
             runtime (`tessera train --devices N`)"
                .into(),
        )),
        Op::Reshard(_) => Err(RuntimeError::Binding(
            "a reshard over several devices needs a communicator: run the plan with the SPMD \
             runtime (`tessera train --devices N`)"
                .into(),
        )),
    }
}
