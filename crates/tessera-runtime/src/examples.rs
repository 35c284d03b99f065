//! Fine-tuning examples from JSON Lines: one object per line, either `{"text": ...}` (the loss
//! counts every token after the first) or `{"prompt": ..., "completion": ...}` (the loss
//! counts the completion's tokens only). Prompt and completion are tokenised apart and
//! joined, as supervised fine-tuning trainers do.
//!
//! Each example is one row of `seq` positions: its first `seq + 1` tokens (longer ones are
//! cut), inputs `tokens[..n-1]` padded with id 0, labels `tokens[1..]` with every label that
//! is a prompt token or padding set to −100, which the loss skips. Models count their targets
//! over the whole step ([`crate::batch::StepBatch::num_targets`]), so the loss is the mean
//! over the step's completion tokens on every plan. The last tenth of the examples (at least
//! one) is held out.

use crate::batch::StepBatch;
use crate::data::{counter_draw, Tokenizer, IGNORED};
use crate::{Result, RuntimeError};
use std::path::Path;

/// One example: its tokens, and the index of the first one the loss counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub tokens: Vec<u32>,
    /// Tokens before this index (the prompt; at least the first token) are never targets.
    pub first_target: usize,
    /// 1-based line in the file, for messages.
    pub line: usize,
}

impl Example {
    /// `(inputs, labels)` of this example's row of `seq` positions.
    pub fn row(&self, seq: usize) -> (Vec<i64>, Vec<i64>) {
        let n = self.tokens.len().min(seq + 1);
        let mut inputs = vec![0i64; seq];
        let mut labels = vec![IGNORED; seq];
        for i in 0..n.saturating_sub(1) {
            inputs[i] = i64::from(self.tokens[i]);
            if i + 1 >= self.first_target {
                labels[i] = i64::from(self.tokens[i + 1]);
            }
        }
        (inputs, labels)
    }
}

/// Fine-tuning examples, split into train and held-out.
#[derive(Clone, Debug)]
pub struct ExampleSet {
    pub train: Vec<Example>,
    pub val: Vec<Example>,
    pub source: String,
}

fn err(msg: String) -> RuntimeError {
    RuntimeError::Data(msg)
}

/// Whether `path` names JSON Lines (`.jsonl`), which [`ExampleSet::load`] reads.
pub fn is_jsonl(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

impl ExampleSet {
    pub fn load(path: &Path, tokenizer: &Tokenizer) -> Result<ExampleSet> {
        let io = |e| err(format!("cannot read examples {}: {e}", path.display()));
        let bytes = crate::data::read_bounded(path, 9, io)?;
        let text = String::from_utf8(bytes).map_err(|e| {
            err(format!("examples {} are not UTF-8 text: {e}; save them as UTF-8", path.display()))
        })?;
        ExampleSet::parse(&text, tokenizer, &path.display().to_string())
    }

    /// Parses JSON Lines text; `source` names it in messages.
    pub fn parse(text: &str, tokenizer: &Tokenizer, source: &str) -> Result<ExampleSet> {
        let mut all = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{source} line {}", i + 1);
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| err(format!("{}: not a JSON object: {e}", at())))?;
            let field = |k: &'static str| v.get(k).map(|x| x.as_str().ok_or(k));
            let (tokens, first_target) = match (field("text"), field("prompt"), field("completion"))
            {
                (Some(Ok(text)), None, None) => (tokenizer.encode(text)?, 1),
                (None, Some(Ok(prompt)), Some(Ok(completion))) => {
                    let mut tokens = tokenizer.encode(prompt)?;
                    let first = tokens.len().max(1);
                    tokens.extend(tokenizer.encode(completion)?);
                    (tokens, first)
                }
                (Some(Err(k)), ..) | (_, Some(Err(k)), _) | (.., Some(Err(k))) => {
                    return Err(err(format!("{}: `{k}` must be a string", at())))
                }
                _ => {
                    return Err(err(format!(
                        "{}: expected {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": \
                         ...}}",
                        at()
                    )))
                }
            };
            if tokens.len() <= first_target {
                return Err(err(format!(
                    "{}: nothing to learn ({} tokens, the first {first_target} not targets); \
                     give it a non-empty completion or text",
                    at(),
                    tokens.len()
                )));
            }
            all.push(Example { tokens, first_target, line: i + 1 });
        }
        if all.len() < 2 {
            return Err(err(format!(
                "{source} has {} examples; training and a held-out split need at least 2",
                all.len()
            )));
        }
        let n_val = (all.len() / 10).max(1);
        let val = all.split_off(all.len() - n_val);
        Ok(ExampleSet { train: all, val, source: source.to_string() })
    }

    /// Checks every example against a model: ids below `vocab`, and at least one target within
    /// `seq` positions (a prompt of `seq` tokens or more leaves the completion outside).
    pub fn validate(&self, vocab: usize, seq: usize) -> Result<()> {
        for e in self.train.iter().chain(&self.val) {
            if let Some(&id) = e.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(err(format!(
                    "{} line {}: token id {id} is outside the model's vocabulary of {vocab}; \
                     use the model's tokenizer (--tokenizer)",
                    self.source, e.line
                )));
            }
            if e.first_target > seq {
                return Err(err(format!(
                    "{} line {}: the prompt is {} tokens, so --seq {seq} leaves no room for \
                     the completion; raise --seq or shorten the prompt",
                    self.source, e.line, e.first_target
                )));
            }
        }
        Ok(())
    }

    fn batch_of(examples: &[&Example], seq: usize) -> Result<StepBatch> {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for e in examples {
            let (i, l) = e.row(seq);
            x.extend(i);
            y.extend(l);
        }
        StepBatch::tokens(x, y, examples.len(), seq)
    }

    /// Training step `step`'s rows: each a uniform draw of the train examples keyed by (seed,
    /// step, row).
    pub fn train_batch(&self, seed: u64, step: u64, batch: usize, seq: usize) -> Result<StepBatch> {
        let n = self.train.len();
        let rows: Vec<&Example> =
            (0..batch).map(|r| &self.train[counter_draw(seed, step, r as u64, n)]).collect();
        ExampleSet::batch_of(&rows, seq)
    }

    /// The held-out examples in order, `batch` per batch, at most `max_batches`; a last partial
    /// batch is filled with rows of no targets (they add nothing to its mean).
    pub fn val_batches(
        &self,
        batch: usize,
        seq: usize,
        max_batches: usize,
    ) -> Result<Vec<StepBatch>> {
        if batch == 0 {
            return Err(err("batch size 0: use --batch of at least 1".into()));
        }
        let empty = Example { tokens: Vec::new(), first_target: 1, line: 0 };
        self.val
            .chunks(batch)
            .take(max_batches)
            .map(|chunk| {
                let mut rows: Vec<&Example> = chunk.iter().collect();
                rows.resize(batch, &empty);
                ExampleSet::batch_of(&rows, seq)
            })
            .collect()
    }
}
