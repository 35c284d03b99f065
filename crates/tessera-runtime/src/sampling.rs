//! Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k
//! and top-p (nucleus), from a counter-based generator keyed by (seed, row, step) — so every
//! device of a tensor-parallel group, and every rerun, draws the same token.

use serde::Serialize;
use tessera_ir::rng::splitmix64;

/// How tokens are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sampling {
    /// 0: greedy (the largest logit, the lowest id on ties).
    pub temperature: f64,
    /// Keep the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `p` (1: all).
    pub top_p: f64,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl Sampling {
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The token for row `row` at generation step `step` from its `logits`.
    pub fn pick(&self, logits: &[f32], row: usize, step: usize) -> usize {
        if self.greedy() || logits.len() <= 1 {
            return argmax(logits);
        }
        // Candidates by descending logit (ties by id), cut by top-k.
        let mut ids: Vec<usize> = (0..logits.len()).collect();
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.top_k > 0 {
            ids.truncate(self.top_k);
        }
        let t = self.temperature;
        let top = logits[ids[0]] as f64;
        let mut p: Vec<f64> = ids.iter().map(|&i| ((logits[i] as f64 - top) / t).exp()).collect();
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
        if self.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = p
                .iter()
                .position(|&x| {
                    acc += x;
                    acc >= self.top_p
                })
                .map_or(p.len(), |i| i + 1);
            ids.truncate(keep);
            p.truncate(keep);
            let s: f64 = p.iter().sum();
            p.iter_mut().for_each(|x| *x /= s);
        }
        let key = splitmix64(
            self.seed
                ^ splitmix64((row as u64).wrapping_mul(0x9E37_79B9) ^ splitmix64(step as u64)),
        );
        let u = (key >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        for (k, &x) in p.iter().enumerate() {
            acc += x;
            if u < acc {
                return ids[k];
            }
        }
        ids[ids.len() - 1]
    }
}

/// The index of the largest value (the first on ties; NaN never wins).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}
