//! What the GPU checks train on (the check binary and `nccl_check`): a model preset's training
//! graph and fixed pseudo-random token batches, so every check draws the same data.

use tessera_ir::{build_training_graph, DType, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};

/// The training graph of preset `model` at `batch` × `seq` in `dtype`.
pub fn training_graph(
    model: &str,
    batch: usize,
    seq: usize,
    dtype: DType,
) -> Result<TrainingGraph, String> {
    let cfg = ModelConfig::resolve(model).map_err(|e| e.to_string())?;
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).map_err(|e| e.to_string())?;
    build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).map_err(|e| e.to_string())
}

/// The vocabulary size of language-model preset `model`.
pub fn vocab(model: &str) -> Result<usize, String> {
    let cfg = ModelConfig::resolve(model).map_err(|e| e.to_string())?;
    cfg.vocab_size().ok_or_else(|| format!("{model} is not a language model"))
}

/// `n` fixed pseudo-random token batches (inputs, next-token targets), cycled by the checks
/// (the loss must fall as they are learnt).
pub fn token_batches(
    vocab: usize,
    batch: usize,
    seq: usize,
    n: usize,
) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % vocab.max(1) as u64) as i64
    };
    (0..n)
        .map(|_| {
            let t: Vec<i64> = (0..batch * (seq + 1)).map(|_| next()).collect();
            let (mut inp, mut tgt) = (Vec::new(), Vec::new());
            for r in 0..batch {
                let row = &t[r * (seq + 1)..(r + 1) * (seq + 1)];
                inp.extend_from_slice(&row[..seq]);
                tgt.extend_from_slice(&row[1..]);
            }
            (inp, tgt)
        })
        .collect()
}
