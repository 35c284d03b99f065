//! Plans for a small convolutional network (the vision ops' sharding rules end to end): data
//! parallel splits every vision op's batch and all-reduces the weight gradients, and the
//! automatic search and a 4-way data-parallel plan lower without error.

use tessera_ir::{Builder, Conv2dSpec, DType, TrainConfig, UnaryOp};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{plan_auto, plan_fixed, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};

/// conv 3×3 → GroupNorm → SiLU → max pool → grouped strided conv → upsample → 1×1 conv →
/// global average pool → linear → cross-entropy, on `mb` 3×32×32 images.
fn cnn(mb: usize) -> tessera_plan::Result<Forward> {
    let err = |e: tessera_ir::IrError| PlanError::Invalid(e.to_string());
    let mut b = Builder::new();
    let x = b.input("pixels", [mb, 3, 32, 32], DType::F32);
    let labels = b.input("labels", [mb], DType::I64);
    let conv = |stride: usize, padding: usize, groups: usize| Conv2dSpec {
        stride: [stride; 2],
        padding: [padding; 2],
        dilation: [1, 1],
        groups,
    };
    let w1 = b.parameter("stem.weight", [32, 3, 3, 3], DType::F32);
    let gw = b.parameter("gn.weight", [32], DType::F32);
    let gb = b.parameter("gn.bias", [32], DType::F32);
    let w2 = b.parameter("down.weight", [64, 16, 3, 3], DType::F32);
    let w3 = b.parameter("proj.weight", [32, 64, 1, 1], DType::F32);
    let head = b.parameter("head.weight", [32, 10], DType::F32);
    let h = b.conv2d(x, w1, conv(1, 1, 1)).map_err(err)?;
    let h = b.group_norm(h, gw, gb, 8, 1e-5).map_err(err)?;
    let h = b.unary(UnaryOp::Silu, h).map_err(err)?;
    let h = b.max_pool2d(h, [3, 3], [2, 2], [1, 1]).map_err(err)?; // 16×16
    let h = b.conv2d(h, w2, conv(2, 1, 2)).map_err(err)?; // 8×8
    let h = b.upsample_nearest2d(h, [2, 2]).map_err(err)?; // 16×16
    let h = b.conv2d(h, w3, conv(1, 0, 1)).map_err(err)?;
    let h = b.avg_pool2d(h, [16, 16], [1, 1], [0, 0], false).map_err(err)?;
    let h = b.reshape(h, [mb, 32]).map_err(err)?;
    let logits = b.matmul(h, head, false, false).map_err(err)?;
    let loss = b.cross_entropy(logits, labels, None).map_err(err)?;
    Ok(Forward { graph: b.finish(), loss })
}

fn plan(cluster: &str, batch: usize, fixed: Option<&str>) -> Result<Plan, PlanError> {
    let cluster = Cluster::parse(cluster).unwrap();
    let req = Request {
        build: &cnn,
        model: "cnn".into(),
        batch,
        seq: 1,
        dtype: DType::F32,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    match fixed {
        Some(c) => plan_fixed(&req, &ParallelConfig::parse(c)?),
        None => plan_auto(&req),
    }
}

#[test]
fn data_parallel_splits_the_batch_of_every_vision_op() {
    let p = plan("2xH100", 16, Some("dp2")).unwrap();
    for op in ["conv2d", "group_norm", "max_pool2d", "avg_pool2d", "upsample2d"] {
        let s = p.strategies.iter().find(|s| s.op == op).unwrap_or_else(|| panic!("no {op}"));
        assert!(s.inputs[0].starts_with("[S0"), "{op}: {s:?}");
        // Weights (and GroupNorm's affine) replicated.
        for w in &s.inputs[1..] {
            assert!(!w.contains('S'), "{op}: {s:?}");
        }
    }
    assert!(p.collectives.iter().any(|c| c.op == "all_reduce" && c.phase == "optimizer"));
}

#[test]
fn the_search_and_wider_data_parallel_plans_lower() {
    plan("4xH100", 16, Some("dp4")).unwrap();
    let p = plan("4xH100", 16, None).unwrap();
    assert!(!p.strategies.is_empty());
}
