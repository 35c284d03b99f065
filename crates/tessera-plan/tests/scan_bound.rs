//! The micro-batch scan skips counts that a smaller count's miss rules out
//! (`tessera_plan::search::Miss`): the bound it skips by must never exceed the least peak the
//! search itself reaches at the larger count, or a count that fits would be skipped. Checked
//! on real Programs — GPT-2 and LLaMA, data, tensor and sequence parallelism, ZeRO 0 to 3 —
//! against `search::min_peak` at every larger count, and the resting floor against each miss's
//! own resting bytes.

mod common;

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
                let floor = search::resting_floor(&p, batch / m, mesh.num_devices()).unwrap();
                assert!(floor <= miss.resting, "{case} mb {m}: floor {floor} > {}", miss.resting);
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
