//! The most memory-frugal layout of a candidate, lowered under the most frugal checkpointing
//! its policy allows: whether anything of the candidate fits, and, when nothing does, how it
//! missed — its least peak, its resting bytes and its step without recomputation — for the
//! bounds that spare the search further lowerings ([`Miss`], [`super::Outcome::cannot_win`],
//! [`super::SearchState::hopeless`]).

use super::space::Space;
use super::{chen_schedule, Candidate, CkptSearch, Fit, Forward, LeastPeak, Miss, Search};
use crate::ilp::{self, Problem};
use crate::lower::{finish, lower_unfinished, Fidelity, Lowered};
use crate::{Mesh, Result};
use tessera_ir::{Checkpointing, CkptMode};

/// Whether a candidate fits when nothing does without checkpointing (or a fixed schedule was
/// asked for): its ILP's most memory-frugal layout under the most frugal checkpointing the
/// policy allows ([`frugal_fit`]). One lowering answers for the whole candidate, where walking
/// the slacks would lower each of their layouts for nothing. On a miss the candidate's least
/// peak is recorded ([`SearchState::least`]), and when the state resting before a step alone
/// misses the budget, its (mesh, rule, ZeRO stage) is marked hopeless. `Err` on a miss, with
/// how it missed when a layout was lowered ([`Miss`]) and the layout's step time without
/// recomputation.
pub(super) fn frugal_candidate(
    p: &Search<'_>,
    cand: &Candidate,
    problem: &Problem,
    space: &Space,
    fwd: &Forward,
    budget: f64,
    bound: f64,
) -> Result<std::result::Result<Fit, Missed>> {
    let Some(sol) = ilp::min_peak(problem, &p.problem.knobs.solve)? else {
        return Ok(Err(Missed { miss: None, plain_s: None }));
    };
    let strategies = space.assignment(&sol.picks);
    let lopts = super::plain_options(p, cand);
    let u =
        lower_unfinished(&fwd.graph, fwd.loss, &strategies, &cand.mesh, &lopts, Fidelity::Priced)?;
    match frugal_fit(p, &u, &cand.mesh, budget, bound)? {
        Frugal::Fits(l) => Ok(Ok((strategies, *l, sol.objective))),
        Frugal::Misses { resting, least, exact, plain_s } => {
            let mb = cand.micro_batches.max(1);
            let miss = Miss { micro_batches: mb, least_peak: least.0, resting };
            if exact {
                let least =
                    LeastPeak { peak_bytes: least.0, candidate: cand.clone(), ckpt: least.1 };
                LeastPeak::record(&p.state.least, least);
            }
            if resting as f64 > budget {
                if let Ok(mut h) = p.state.hopeless.lock() {
                    h.push((cand.mesh.clone(), cand.rule.clone(), cand.zero));
                }
            }
            Ok(Err(Missed { miss: Some(miss), plain_s }))
        }
    }
}

/// How a candidate's most frugal layout missed: the [`Miss`] when a layout was lowered, and
/// its step time without recomputation when it was lowered so.
pub(super) struct Missed {
    pub(super) miss: Option<Miss>,
    pub(super) plain_s: Option<f64>,
}

/// The checkpointing that keeps the least under a policy: full recompute for the joint search.
fn frugal_checkpointing(policy: &CkptSearch, num_blocks: u32) -> Checkpointing {
    match policy {
        CkptSearch::Off => Checkpointing::default(),
        CkptSearch::Uniform(m) => Checkpointing::uniform(num_blocks, *m),
        CkptSearch::Chen => chen_schedule(num_blocks),
        CkptSearch::Joint => Checkpointing::uniform(num_blocks, CkptMode::Full),
    }
}

/// How a candidate's most memory-frugal layout fares under a budget.
pub(super) enum Frugal {
    Fits(Box<Lowered>),
    /// Nothing the policy accepts fits: the bytes resting before a step (parameters, optimizer
    /// state, inputs), and the least peak reached, with the checkpointing that reaches it —
    /// `exact` when it is the least peak itself, else a floor of it (see [`frugal_fit`]) —
    /// and the layout's step time without recomputation, where it was lowered so.
    Misses {
        resting: u64,
        least: (u64, Checkpointing),
        exact: bool,
        plain_s: Option<f64>,
    },
}

/// The most frugal layout `u` under the policy: the fixed schedule if one was asked for, else
/// for the joint search what [`crate::ckpt::choose_or_resting`] finds — the plain Program,
/// full recompute, or (when the plain step could still win) the DP's mix — with, on a miss,
/// the lower of the plain and the fully recomputed peaks (the plain one on a tie; recomputing
/// does not always lower the peak: the recomputed values are live while a block runs
/// backward). The DP ([`crate::ckpt::choose_after`]) reuses both lowerings.
pub(super) fn frugal_fit(
    p: &Search<'_>,
    u: &crate::lower::Unfinished,
    mesh: &Mesh,
    budget: f64,
    bound: f64,
) -> Result<Frugal> {
    let nb = tessera_ir::remat::num_blocks(&u.training.graph);
    let fits = |l: &Lowered| l.memory.peak_bytes as f64 <= budget;
    let finish = |ckpt: &Checkpointing| finish(u, ckpt, mesh, &p.problem.cost);
    let miss = |l: &Lowered, ckpt, plain_s| Frugal::Misses {
        resting: l.memory.resting_bytes,
        least: (l.memory.peak_bytes, ckpt),
        exact: true,
        plain_s,
    };
    if !matches!(p.problem.ckpt, CkptSearch::Joint) || nb == 0 {
        let ckpt = frugal_checkpointing(&p.problem.ckpt, nb);
        let l = finish(&ckpt)?;
        let plain_s = (ckpt == Checkpointing::default()).then_some(l.time.step_time_s);
        return Ok(if fits(&l) { Frugal::Fits(Box::new(l)) } else { miss(&l, ckpt, plain_s) });
    }
    let plain = Checkpointing::uniform(nb, CkptMode::None);
    let none = finish(&plain)?;
    if fits(&none) {
        return Ok(Frugal::Fits(Box::new(none)));
    }
    let resting = none.memory.resting_bytes;
    let plain_s = Some(none.time.step_time_s);
    if bound.is_finite() && resting as f64 > budget {
        // The state resting before a step misses the budget under every checkpointing. With a
        // fit elsewhere (a finite bound) the least peak is never reported, so the fully
        // recomputed lowering, which would only refine it, is spared; the miss says the
        // resting bytes, a floor of the least peak (every Program holds them at its start),
        // so the counts it rules out stay soundly ruled out.
        return Ok(Frugal::Misses { resting, least: (resting, plain), exact: false, plain_s });
    }
    let recompute = Checkpointing::uniform(nb, CkptMode::Full);
    let full = finish(&recompute)?;
    if !fits(&full) {
        return Ok(match none.memory.peak_bytes <= full.memory.peak_bytes {
            true => miss(&none, plain, plain_s),
            false => miss(&full, recompute, plain_s),
        });
    }
    // Full recompute fits, so the choice always finds a plan: full itself at worst (the DP's
    // per-block model can miss where blocks share what they hold — an offloaded parameter
    // prefetched during the block before — and then every choice it verifies misses).
    match crate::ckpt::choose_after(u, mesh, &p.problem.cost, budget as u64, bound, none, full)? {
        Ok(l) => Ok(Frugal::Fits(Box::new(l))),
        Err(_) => Ok(Frugal::Fits(Box::new(finish(&recompute)?))),
    }
}
