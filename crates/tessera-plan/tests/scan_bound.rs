//! The micro-batch scan skips counts that a smaller count's miss rules out
//! (`tessera_plan::search::Miss`): the bound it skips by must never exceed the least peak the
//! search itself reaches at the larger count, or a count that fits would be skipped. Checked
//! on real Programs — GPT-2 and LLaMA, data, tensor and sequence parallelism, ZeRO 0 to 3 —
//! against `search::min_peak` at every larger count, and the resting floors against each miss's
//! own resting bytes; and what the bounds skip without a lowering.

use crate::common;

use common::{builder, problem};
use tessera_plan::search::{self, AxisRule, Candidate};
use tessera_plan::{Cluster, Mesh};

#[test]
fn a_miss_never_rules_out_a_count_that_reaches_under_its_bound() {
    let cluster = Cluster::parse("4xH100").unwrap();
    let batch = 16;
    let counts = [1usize, 2, 4, 8, 16];
    let mut checked = 0;
    for preset in ["gpt2-tiny", "llama-tiny"] {
        let b = builder(preset, 64);
        for (shape, rule, zero) in [
            (vec![4], AxisRule::Free, 0u8),
            (vec![4], AxisRule::Free, 3),
            (vec![4, 1], AxisRule::Megatron { sp: false, cp: false }, 0),
            (vec![2, 2], AxisRule::Megatron { sp: true, cp: false }, 1),
            (vec![2, 2], AxisRule::Free, 2),
        ] {
            let axes: Vec<&str> = ["dp", "tp"][..shape.len()].to_vec();
            let mesh = Mesh::new(&cluster, &shape, &axes).unwrap();
            let cand = |m: usize| Candidate {
                mesh: mesh.clone(),
                rule: rule.clone(),
                zero,
                micro_batches: m,
                offload: None,
            };
            let case = format!("{preset} {shape:?} {rule:?} zero {zero}");
            let least: Vec<Option<u64>> = counts
                .iter()
                .map(|&m| search::min_peak(&problem(&b, batch, &cluster), &cand(m)).unwrap())
                .collect();
            for (i, &m) in counts.iter().enumerate() {
                let Some(peak) = least[i] else { continue };
                // One byte under the least: the candidate misses and says how.
                let p = problem(&b, batch, &cluster);
                let out =
                    search::evaluate_within(&p, &cand(m), Some(peak - 1), f64::INFINITY).unwrap();
                let Some(miss) = out.miss else {
                    // A layout the ILP did not rank most frugal fitted: no miss to bound by.
                    assert!(out.fit.is_some(), "{case} mb {m}: neither a fit nor a miss");
                    continue;
                };
                assert_eq!(miss.micro_batches, m);
                assert_eq!(miss.least_peak, peak, "{case} mb {m}: the miss's least peak");
                let even = search::resting_floor(&p, batch / m, mesh.num_devices()).unwrap();
                assert!(even <= miss.resting, "{case} mb {m}: floor {even} > {}", miss.resting);
                // The scan's floor: the larger of the even spread and the layouts' own.
                let layout = search::layout_floor(&p, &cand(m)).unwrap();
                assert!(layout <= miss.resting, "{case} mb {m}: layout floor {layout}");
                let floor = even.max(layout);
                for (j, &later) in counts.iter().enumerate().skip(i + 1) {
                    let Some(reached) = least[j] else { continue };
                    let bound = miss.bound(later, floor);
                    assert!(
                        bound <= reached,
                        "{case}: the miss at mb {m} bounds mb {later} by {bound} B, but it \
                         reaches {reached} B"
                    );
                    // The budget under which the scan would skip `later`: it misses there.
                    assert!(!miss.rules_out(later, floor, reached));
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} pairs checked");
}

/// The resting floor counts AdamW state only for trained parameters: under LoRA the frozen base
/// rests at its own bytes, the adapters with their moments and f32 masters (counted here from
/// the graph's parameters independently: their own bytes, and 12 bytes of state for the
/// trained bf16 ones).
#[test]
fn the_resting_floor_of_a_lora_model_counts_no_state_for_its_frozen_base() {
    use tessera_ir::{DType, Op};
    use tessera_models::{build, lora, BuildOptions, ModelConfig};
    let cfg = ModelConfig::preset("llama-tiny").unwrap().without_dropout();
    let spec = lora::LoraSpec::parse("r=4").unwrap();
    let b = move |mb: usize| {
        let m = build(&cfg, &BuildOptions::new(mb, 32, DType::BF16))
            .map_err(|e| tessera_plan::PlanError::Invalid(e.to_string()))?;
        let (m, _) = lora::apply_lora(m, &spec)
            .map_err(|e| tessera_plan::PlanError::Invalid(e.to_string()))?;
        Ok(tessera_plan::search::Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let g = b(1).unwrap().graph;
    // Bytes at rest: a frozen parameter its own (bf16, or f32 for the norms, which mixed
    // precision holds in f32); a trained one also its moments, and an f32 master
    // when it is half precision.
    let (mut frozen, mut trained) = (0u64, 0u64);
    for n in &g.nodes {
        if let Op::Parameter { frozen: f, .. } = n.op {
            for &t in &n.outputs {
                let (elems, size) = (g.meta(t).numel(), g.meta(t).dtype.size_bytes());
                match f {
                    true => frozen += size * elems,
                    false => trained += (size + if size == 4 { 8 } else { 12 }) * elems,
                }
            }
        }
    }
    assert!(frozen > 0 && trained > 0, "LoRA: {frozen} frozen, {trained} trained bytes");
    let cluster = Cluster::parse("4xH100").unwrap();
    let floor = search::resting_floor(&problem(&b, 8, &cluster), 2, 4).unwrap();
    assert_eq!(floor, (frozen + trained) / 4);
}

/// Below ZeRO-3 on a free mesh, a candidate whose fastest layout cannot beat the bound is
/// skipped before its most frugal layout is checkpointed, and says so (`cannot_win`, which ends
/// the micro-batch scan). The skip must only drop losers: under a bound just above the
/// candidate's own fastest fit it still finds that fit, the same plan as with no bound.
#[test]
fn a_candidate_that_cannot_win_says_so_and_one_that_can_still_fits() {
    let cluster = Cluster::parse("4xH100").unwrap();
    let batch = 16;
    let mut checked = 0;
    for preset in ["gpt2-tiny", "llama-tiny"] {
        let b = builder(preset, 64);
        for (shape, zero) in [(vec![4], 0u8), (vec![4], 1), (vec![2, 2], 2)] {
            let axes: Vec<&str> = ["dp", "tp"][..shape.len()].to_vec();
            let mesh = Mesh::new(&cluster, &shape, &axes).unwrap();
            let cand = Candidate {
                mesh: mesh.clone(),
                rule: AxisRule::Free,
                zero,
                micro_batches: 1,
                offload: None,
            };
            let case = format!("{preset} {shape:?} zero {zero}");
            let least = search::min_peak(&problem(&b, batch, &cluster), &cand).unwrap().unwrap();
            // At the least peak only recomputation fits: the sharding-only plan misses.
            let budget = Some(least);
            let free = search::evaluate_within(
                &problem(&b, batch, &cluster),
                &cand,
                budget,
                f64::INFINITY,
            )
            .unwrap();
            assert!(!free.cannot_win, "{case}: no bound, yet it cannot win");
            let fit = free.fit.unwrap_or_else(|| panic!("{case}: nothing fits its least peak"));
            assert!(fit.lowered.time.recompute_s > 0.0, "{case}: fits without recomputation");
            let t = fit.step_time_s();

            // Memory aside, its fastest layout (lowered as it is): no plan of it is faster.
            let fastest =
                search::evaluate_within(&problem(&b, batch, &cluster), &cand, None, f64::INFINITY)
                    .unwrap()
                    .fit
                    .unwrap_or_else(|| panic!("{case}: no plan without a budget"))
                    .step_time_s();
            assert!(fastest <= t, "{case}: the fastest layout {fastest} s, the fit {t} s");
            // A bound under it, though within the ILP's cut (1.5x) of it: skipped, and said so.
            let out = search::evaluate_within(
                &problem(&b, batch, &cluster),
                &cand,
                budget,
                fastest * 0.8,
            )
            .unwrap();
            assert!(out.cannot_win && out.fit.is_none(), "{case}: a losing bound was not skipped");

            // Just above its own fit: the same fit.
            let out =
                search::evaluate_within(&problem(&b, batch, &cluster), &cand, budget, t * 1.001)
                    .unwrap();
            assert!(!out.cannot_win, "{case}: a winner was skipped");
            let again = out.fit.unwrap_or_else(|| panic!("{case}: the fit was lost"));
            assert_eq!(again.step_time_s(), t, "{case}");
            assert_eq!(again.peak_bytes(), fit.peak_bytes(), "{case}");
            checked += 1;
        }
    }
    assert_eq!(checked, 6);
}

/// The layout floor (`search::layout_floor`) is a floor of what every layout rests at: on a
/// one-layout Megatron mesh without ZeRO it is that layout's parameters and AdamW state, all
/// but the inputs of the lowered Program's resting bytes; elsewhere no more than the plain
/// layout rests at (it divides ZeRO's state by every axis the parameter leaves free, where
/// the lowering may shard over fewer: a norm replicated on the tensor axis has no gradient
/// pending there). Under ZeRO-1 and -2 (replicated parameters) and hybrid sharding (whole
/// copies per replica group) it exceeds the even spread the micro-batch scan had.
#[test]
fn the_layout_floor_is_under_every_layouts_resting_bytes() {
    let cluster = Cluster::parse("4xH100").unwrap();
    let batch = 16;
    let b = builder("llama-tiny", 64);
    let inputs = {
        // Token ids and labels (the lowered Program's other resting bytes), whole.
        let g = b(batch).unwrap().graph;
        g.nodes
            .iter()
            .filter(|n| matches!(n.op, tessera_ir::Op::Input(_)))
            .map(|n| g.meta(n.outputs[0]).size_bytes())
            .sum::<u64>()
    };
    for (shape, rule, zero) in [
        (vec![4, 1], AxisRule::Megatron { sp: false, cp: false }, 0u8),
        (vec![2, 2], AxisRule::Megatron { sp: true, cp: false }, 1),
        (vec![1, 4], AxisRule::Megatron { sp: false, cp: false }, 2),
        (vec![4], AxisRule::Free, 1),
        (vec![2, 2], AxisRule::Free, 3),
        // Hybrid sharding: ZeRO-3 within the data axis, whole copies over the replica axis.
        (vec![2, 2, 1], AxisRule::Megatron { sp: false, cp: false }, 3),
    ] {
        let mesh = match shape.len() {
            3 => Mesh::new(&cluster, &shape, &["replica", "dp", "tp"]).unwrap().with_replicas(&[0]),
            n => Mesh::new(&cluster, &shape, &["dp", "tp"][..n]).unwrap(),
        };
        let cand = Candidate { mesh, rule: rule.clone(), zero, micro_batches: 1, offload: None };
        let case = format!("{shape:?} {rule:?} zero {zero}");
        let p = problem(&b, batch, &cluster);
        let floor = search::layout_floor(&p, &cand).unwrap();
        let even = search::resting_floor(&p, batch, 4).unwrap();
        let plain = search::evaluate(&p, &cand, None).unwrap().unwrap();
        let resting = plain.lowered.memory.resting_bytes;
        assert!(floor <= resting, "{case}: floor {floor} over the plain layout's {resting}");
        if matches!(rule, AxisRule::Megatron { .. }) && zero == 0 {
            // One layout, nothing sharded by ZeRO: the floor is its state, to the byte but
            // for the inputs, which the data-parallel axis splits (a share of them or all).
            let gap = resting - floor;
            assert!(gap > 0 && gap <= inputs, "{case}: floor {floor}, resting {resting}");
        }
        if zero == 1 || zero == 2 || !cand.mesh.replicas.is_empty() {
            assert!(floor > even, "{case}: the layout floor {floor} adds nothing to {even}");
        }
    }
}

/// A Megatron-style candidate has one layout, so when its most frugal Program misses, that
/// Program's step without recomputation is the least any count of it reaches: over the bound,
/// the candidate says it cannot win (ending the micro-batch scan); under it, it does not.
#[test]
fn a_one_layout_miss_slower_than_the_bound_cannot_win() {
    let cluster = Cluster::parse("4xH100").unwrap();
    let batch = 16;
    let mut checked = 0;
    for preset in ["gpt2-tiny", "llama-tiny"] {
        let b = builder(preset, 64);
        for (shape, sp, zero) in [(vec![4, 1], false, 0u8), (vec![2, 2], true, 3)] {
            let axes: Vec<&str> = ["dp", "tp"][..shape.len()].to_vec();
            let mesh = Mesh::new(&cluster, &shape, &axes).unwrap();
            let cand = Candidate {
                mesh,
                rule: AxisRule::Megatron { sp, cp: false },
                zero,
                micro_batches: 1,
                offload: None,
            };
            let case = format!("{preset} {shape:?} sp {sp} zero {zero}");
            let p = || problem(&b, batch, &cluster);
            let least = search::min_peak(&p(), &cand).unwrap().unwrap();
            // Memory aside, its one layout, without recomputation.
            let plain = search::evaluate(&p(), &cand, None).unwrap().unwrap();
            assert_eq!(plain.lowered.time.recompute_s, 0.0, "{case}");
            let t = plain.step_time_s();
            let budget = Some(least - 1);
            for (bound, loses) in [(t * 0.99, true), (t * 1.01, false)] {
                let out = search::evaluate_within(&p(), &cand, budget, bound).unwrap();
                assert!(out.fit.is_none(), "{case}: a fit under its least peak");
                let miss = out.miss.unwrap_or_else(|| panic!("{case}: no miss under {bound}"));
                assert_eq!(miss.least_peak, least, "{case}");
                assert_eq!(out.cannot_win, loses, "{case}: bound {bound} s, plain step {t} s");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4);
}

/// With a fit elsewhere (a finite bound), a candidate whose layout floor alone misses the
/// budget is not lowered: it is marked hopeless and deferred, and said neither to miss nor to
/// lose. Deferred, it is evaluated in full, and without a bound the search lowers it and
/// reports how it missed (the least peak a pinned config's error names).
#[test]
fn a_layout_floor_over_the_budget_defers_the_candidate() {
    let cluster = Cluster::parse("4xH100").unwrap();
    let batch = 16;
    let b = builder("llama-tiny", 64);
    let mesh = Mesh::new(&cluster, &[4, 1], &["dp", "tp"]).unwrap();
    let cand = Candidate {
        mesh,
        rule: AxisRule::Megatron { sp: false, cp: false },
        zero: 1,
        micro_batches: 2,
        offload: None,
    };
    let p = problem(&b, batch, &cluster);
    let floor = search::layout_floor(&p, &cand).unwrap();
    let budget = Some(floor - 1);
    let out = search::evaluate_within(&p, &cand, budget, 1.0).unwrap();
    assert!(out.fit.is_none() && out.miss.is_none() && !out.cannot_win, "{out:?}");
    assert_eq!(p.state.deferred.lock().unwrap().as_slice(), std::slice::from_ref(&cand));
    // The next count of the same (mesh, rule, ZeRO stage) is deferred as hopeless.
    let next = Candidate { micro_batches: 4, ..cand.clone() };
    let out = search::evaluate_within(&p, &next, budget, 1.0).unwrap();
    assert!(out.fit.is_none() && out.miss.is_none());
    assert_eq!(p.state.deferred.lock().unwrap().len(), 2);
    // Deferred: evaluated in full, and nothing fits.
    assert!(search::evaluate_deferred(&p, &cand, budget).unwrap().is_none());
    // No bound: lowered, and its miss measured (over the floor).
    let fresh = problem(&b, batch, &cluster);
    let out = search::evaluate_within(&fresh, &cand, budget, f64::INFINITY).unwrap();
    let miss = out.miss.expect("a lowered miss");
    assert!(miss.least_peak > floor && miss.resting > floor, "{miss:?}");
    assert!(fresh.state.deferred.lock().unwrap().is_empty());
}
