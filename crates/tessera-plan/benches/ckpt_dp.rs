//! Speed of the activation-checkpointing DP (`tessera_plan::ckpt_dp`): the acceptance case,
//! 1,000 blocks in 500 slots, well under 1 s; 96 blocks in 4,096 slots (a deep model at a fine
//! grid); and 10 blocks against the exhaustive oracle, the ratio of the two measured in the same
//! run (at 10 blocks the oracle's 59,049 assignments still cost about what the DP's passes do;
//! 12 blocks, printed once, show the 3^L growth). Each case also prints one wall time and the
//! answer's quality, since a fast DP on a grid too coarse to find good modes would be no use;
//! figures go to BENCHMARKS.md.
//!
//! `cargo bench -p tessera-plan --bench ckpt_dp`

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::time::{Duration, Instant};
use tessera_plan::ckpt_dp::{brute_force, solve, BlockCost, Chain, CkptMode};

const MIB: u64 = 1 << 20;

/// Transformer-like blocks a little different each (90..110 % of a nominal size), so the DP
/// cannot win by symmetry, with the budget halfway between the least peak and the peak of
/// keeping everything — the range where the choice matters.
fn make_chain(blocks: u64, act_mib: u64) -> (Chain, u64) {
    let blocks: Vec<_> = (0..blocks)
        .map(|b| {
            let size = 90 + (b * 37 % 21);
            let act = act_mib * MIB * size / 100;
            let fwd_s = 0.003 * size as f64 / 100.0;
            BlockCost {
                kept: [act, act * 2 / 5, act / 16],
                recompute_s: [0.0, fwd_s / 8.0, fwd_s],
                backward_peak: [act + act / 4; 3],
            }
        })
        .collect();
    let n = blocks.len();
    let chain = Chain { blocks, base: 20 << 30, top_extra: 512 * MIB };
    let hi = chain.evaluate(&vec![CkptMode::None; n]).0;
    let lo = chain.min_peak();
    (chain, lo + (hi - lo) / 2)
}

fn secs(f: impl FnOnce()) -> f64 {
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("ckpt_dp");
    group.sample_size(10).warm_up_time(Duration::from_secs(1));

    for (blocks, act_mib, slots) in [(1000, 24, 500), (96, 256, 4096)] {
        let (chain, budget) = make_chain(blocks, act_mib);
        let mut sol = None;
        let t = secs(|| sol = solve(&chain, budget, slots));
        let sol = sol.expect("the chain fits");
        // The same chain on a 16× finer grid: how much the coarse grid gives away.
        let fine = solve(&chain, budget, slots * 16).expect("the chain fits");
        let all_full = chain.evaluate(&vec![CkptMode::Full; chain.blocks.len()]).1;
        println!(
            "{blocks} blocks × {slots} slots: {:.1} ms once (bound 1 s); recompute {:.4} s \
             vs {:.4} s at {} slots and {all_full:.4} s all Full",
            t * 1e3,
            sol.recompute_s,
            fine.recompute_s,
            slots * 16,
        );
        group.bench_function(format!("solve_{blocks}x{slots}"), |b| {
            b.iter(|| solve(black_box(&chain), budget, slots))
        });
    }

    // Ten blocks: the oracle enumerates 59,049 assignments; the DP runs at a fine grid.
    let (chain, budget) = make_chain(10, 256);
    let slots = 4096;
    let t_dp = secs(|| {
        black_box(solve(&chain, budget, slots));
    });
    let t_bf = secs(|| {
        black_box(brute_force(&chain, budget));
    });
    let dp = solve(&chain, budget, slots).expect("fits");
    let bf = brute_force(&chain, budget).expect("fits");
    println!(
        "10 blocks: DP ({slots} slots) {:.3} ms, brute force {:.1} ms once ({:.1}×); recompute \
         {:.5} s vs optimum {:.5} s",
        t_dp * 1e3,
        t_bf * 1e3,
        t_bf / t_dp,
        dp.recompute_s,
        bf.recompute_s
    );
    // Two blocks more multiply the oracle's work by 9 and the DP's by 1.2.
    let (chain12, budget12) = make_chain(12, 256);
    let t_dp12 = secs(|| {
        black_box(solve(&chain12, budget12, slots));
    });
    let t_bf12 = secs(|| {
        black_box(brute_force(&chain12, budget12));
    });
    println!(
        "12 blocks: DP ({slots} slots) {:.3} ms, brute force {:.1} ms once ({:.1}×)",
        t_dp12 * 1e3,
        t_bf12 * 1e3,
        t_bf12 / t_dp12
    );
    group.bench_function(format!("solve_10x{slots}"), |b| {
        b.iter(|| solve(black_box(&chain), budget, slots))
    });
    group.bench_function("brute_force_10", |b| b.iter(|| brute_force(black_box(&chain), budget)));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
