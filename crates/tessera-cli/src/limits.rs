//! Bounds on the command line's numbers. Every numeric flag of every command has a range, and
//! the parser refuses a value outside it (or a float that is not finite) with the range in the
//! message, before anything is built: no later arithmetic overflows, no duration panics, and
//! no run is spent on a number no one meant. The bounds are far beyond any real run; what
//! depends on other flags (`--warmup` against `--steps`, `--eos` against the vocabulary) is
//! checked where both are known.

use clap::builder::RangedI64ValueParser;

/// Optimizer steps (and the step flags counted in them).
pub const MAX_STEPS: u64 = 1_000_000_000;
/// Sequences per step.
pub const MAX_BATCH: u64 = 1 << 20;
/// Tokens per sequence (and a generation's new tokens).
pub const MAX_SEQ: u64 = 1 << 24;
/// Devices of one run.
pub const MAX_DEVICES: u64 = 1 << 16;
/// Held-out batches.
pub const MAX_EVAL_BATCHES: u64 = 1 << 20;
/// Seconds a collective waits (about 11.6 days).
pub const MAX_COMM_TIMEOUT_S: f64 = 1e6;
/// Peak learning rate.
pub const MAX_LR: f64 = 10.0;
/// AdamW weight decay (usually 0 to 0.1).
pub const MAX_WEIGHT_DECAY: f64 = 10.0;
/// Gradient clipping norm.
pub const MAX_GRAD_NORM: f64 = 1e6;
/// fp16's initial loss scale: far past any that trains (65,536 is usual), and a scale that
/// overflows on purpose (the scaler then halves it) stays finite in f32, as does its inverse.
pub const MAX_LOSS_SCALE: f64 = 1e30;
/// Sampling temperature.
pub const MAX_TEMPERATURE: f64 = 100.0;
/// Sampling's top-k.
pub const MAX_TOP_K: u64 = 1 << 24;

/// A whole number in `lo..=hi`, or the message naming the range. Negative numbers reach it
/// (the flags allow them) to be refused by value rather than as unknown flags.
fn count<T>(lo: u64, hi: u64) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
{
    move |s: &str| {
        let range = format!("{lo}..={hi}");
        let v: i128 = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a whole number: give one in {range}"))?;
        if v < i128::from(lo) || v > i128::from(hi) {
            return Err(format!(
                "{} is not in {range}: give a whole number in that range",
                s.trim()
            ));
        }
        T::try_from(v as u64).map_err(|_| format!("{v} does not fit in this machine's integers"))
    }
}

/// `--steps`, `--save-every`, `--stop-after`, `--loss-scale-window`: 1 to [`MAX_STEPS`].
pub fn steps() -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync {
    count(1, MAX_STEPS)
}

/// `--seed`: any 64-bit unsigned number.
pub fn seed() -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync {
    count(0, u64::MAX)
}

/// `--warmup`: 0 to [`MAX_STEPS`] (and no more than `--steps`, checked with it).
pub fn warmup() -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync {
    count(0, MAX_STEPS)
}

/// `--batch`: 1 to [`MAX_BATCH`].
pub fn batch() -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    count(1, MAX_BATCH)
}

/// `--seq`, `--max-new-tokens`, `--new-tokens`: 1 to [`MAX_SEQ`].
pub fn seq() -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    count(1, MAX_SEQ)
}

/// `--devices`: 1 to [`MAX_DEVICES`].
pub fn devices() -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    count(1, MAX_DEVICES)
}

/// `--eval-batches`: 0 (none) to [`MAX_EVAL_BATCHES`].
pub fn eval_batches() -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    count(0, MAX_EVAL_BATCHES)
}

/// `--top-k`: 0 (all) to [`MAX_TOP_K`].
pub fn top_k() -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    count(0, MAX_TOP_K)
}

/// `--eos`: -1 (never) or a token id (checked against the vocabulary with the model).
pub fn eos() -> RangedI64ValueParser<i64> {
    RangedI64ValueParser::new().range(-1..)
}

/// A finite number in `lo..=hi` (`lo` excluded when `open`), or the message naming the range
/// and an example (`what`).
fn float(s: &str, lo: f64, open: bool, hi: f64, what: &str) -> Result<f64, String> {
    let range = format!("{}{lo}, {hi}]", if open { "(" } else { "[" });
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number: give {what}"))?;
    let above = if open { v > lo } else { v >= lo };
    if !(v.is_finite() && above && v <= hi) {
        return Err(format!("{} is not a finite number in {range}: give {what}", s.trim()));
    }
    Ok(v)
}

/// `--lr`: in (0, [`MAX_LR`]].
pub fn lr(s: &str) -> Result<f64, String> {
    float(s, 0.0, true, MAX_LR, "a learning rate like 1e-3")
}

/// `--weight-decay`: in [0, [`MAX_WEIGHT_DECAY`]].
pub fn weight_decay(s: &str) -> Result<f64, String> {
    float(s, 0.0, false, MAX_WEIGHT_DECAY, "an AdamW weight decay like 0.1 (0: none)")
}

/// `--max-grad-norm`: in [0, [`MAX_GRAD_NORM`]].
pub fn max_grad_norm(s: &str) -> Result<f64, String> {
    float(s, 0.0, false, MAX_GRAD_NORM, "a clipping norm like 1.0 (0: no clipping)")
}

/// `--comm-timeout`: seconds in (0, [`MAX_COMM_TIMEOUT_S`]].
pub fn comm_timeout(s: &str) -> Result<f64, String> {
    float(s, 0.0, true, MAX_COMM_TIMEOUT_S, "seconds like 30")
}

/// `--loss-scale`: in (0, [`MAX_LOSS_SCALE`]].
pub fn loss_scale(s: &str) -> Result<f64, String> {
    float(s, 0.0, true, MAX_LOSS_SCALE, "an initial loss scale like 65536")
}

/// `--temperature`: in [0, [`MAX_TEMPERATURE`]].
pub fn temperature(s: &str) -> Result<f64, String> {
    float(s, 0.0, false, MAX_TEMPERATURE, "a temperature like 0.8 (0: greedy)")
}

/// `--top-p`: in (0, 1].
pub fn top_p(s: &str) -> Result<f64, String> {
    float(s, 0.0, true, 1.0, "a probability like 0.9 (1: all tokens)")
}

/// `--tokens IDS`: comma-separated token ids, every item one (an empty item, as in `1,,2` or
/// a trailing comma, is refused rather than skipped: it is often a lost id).
pub fn token_ids(s: &str) -> anyhow::Result<Vec<i64>> {
    s.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                anyhow::bail!(
                    "--tokens `{s}`: item {} is empty; give comma-separated token ids like 1,2,3",
                    i + 1
                );
            }
            t.parse::<i64>().map_err(|_| {
                anyhow::anyhow!(
                    "--tokens `{s}`: `{t}` is not a token id; give comma-separated integers like \
                     1,2,3"
                )
            })
        })
        .collect()
}

/// The positions a generation's KV cache holds: the prompt's `prompt` tokens and the
/// `new_tokens` generated after it (the last one is never fed back), refused past the model's
/// position table (`n_positions` or `max_position_embeddings`) naming both numbers and the
/// flags that set them (`prompt_flag`, `new_flag`).
pub fn kv_capacity(
    cfg: &tessera_models::ModelConfig,
    prompt: usize,
    new_tokens: usize,
    prompt_flag: &str,
    new_flag: &str,
) -> anyhow::Result<usize> {
    let need = prompt.checked_add(new_tokens.max(1) - 1);
    let max = cfg.max_seq();
    match (need, max) {
        (Some(n), Some(max)) if n <= max => Ok(n),
        (Some(n), None) => Ok(n),
        (_, max) => {
            let field = match cfg {
                tessera_models::ModelConfig::Gpt2(_) => "n_positions",
                tessera_models::ModelConfig::Bert(_) => "max_position_embeddings",
                _ => "its fixed sequence length",
            };
            let within = max.map_or(String::new(), |m| {
                format!("; {} holds at most {m} positions ({field})", cfg.name())
            });
            anyhow::bail!(
                "a prompt of {prompt} tokens ({prompt_flag}) and {new_tokens} new tokens \
                 ({new_flag}) need {} positions{within}: shorten the prompt or lower {new_flag}",
                need.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string())
            )
        }
    }
}

/// `train`'s numbers that bound each other: `--stop-after` within `--steps`, and AdamW's
/// per-step shrink factor `1 - lr·wd` above 0 (at `lr·wd ≥ 1` every decayed weight flips sign
/// and grows each step, and the run ends in NaN that looks like a learning-rate problem).
pub fn check_train(
    steps: u64,
    stop_after: Option<u64>,
    lr: f64,
    weight_decay: f64,
) -> anyhow::Result<()> {
    if let Some(k) = stop_after.filter(|&k| k > steps) {
        anyhow::bail!(
            "--stop-after {k} is past the run's last step (--steps {steps}): give --stop-after \
             {steps} or less, or raise --steps"
        );
    }
    if lr * weight_decay >= 1.0 {
        anyhow::bail!(
            "--weight-decay {weight_decay} with --lr {lr}: AdamW multiplies every decayed weight \
             by 1 - lr × weight decay = {} each step, which makes the weights flip sign and grow \
             to NaN; lower --weight-decay (usually 0 to 0.1) so that lr × weight decay < 1",
            1.0 - lr * weight_decay
        );
    }
    Ok(())
}

/// Under an address-space limit (`ulimit -v`) too small for a run's `need` bytes (`devices`
/// for the simulated devices, `held` already held), the refusal naming the limit and `fix`
/// (what else makes the run smaller): an allocation past the limit would abort the process.
pub fn check_address_space(need: u64, devices: u64, held: u64, fix: &str) -> anyhow::Result<()> {
    use crate::format::bytes;
    let (Some(limit), Some(room)) =
        (tessera_runtime::host::address_space_limit(), tessera_runtime::host::address_space_room())
    else {
        return Ok(());
    };
    if need <= room {
        return Ok(());
    }
    anyhow::bail!(
        "this run needs about {} of memory (the simulated devices at their predicted peaks, \
         {}, plus {} this process holds) but its address-space limit (ulimit -v) of {} leaves \
         {} to map: raise the limit (ulimit -v), or {fix}",
        bytes(need),
        bytes(devices),
        bytes(held),
        bytes(limit),
        bytes(room)
    )
}

/// Before `generate` on the CPU allocates: its devices in this process at their predicted
/// peak (`devices` bytes together) must fit in the host memory available, under an
/// address-space limit too; past it the kernel kills the process or an allocation aborts it.
pub fn check_generation_memory(devices: u64) -> anyhow::Result<()> {
    use crate::format::bytes;
    let fix = "generate on fewer prompts, with fewer --max-new-tokens, --quantize int8 or a \
               smaller --dtype";
    let Some(available) = tessera_runtime::host::available_memory() else { return Ok(()) };
    let held = tessera_runtime::alloc::current_bytes();
    let need = devices.saturating_add(held);
    if need > available {
        check_address_space(need, devices, held, fix)?;
        anyhow::bail!(
            "this generation needs about {} of host memory (its devices at their predicted \
             peak, {}, plus {} this process holds) but the machine has {} available: {fix}, \
             or free memory",
            bytes(need),
            bytes(devices),
            bytes(held),
            bytes(available)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_refuse_what_is_not_finite_or_out_of_range() {
        for bad in ["nan", "inf", "-inf", "1e20", "0", "-1", "x", ""] {
            let e = comm_timeout(bad).unwrap_err();
            assert!(e.contains("give seconds like 30"), "{bad}: {e}");
        }
        assert!(comm_timeout("1e20").unwrap_err().contains("(0, 1000000]"));
        assert_eq!(comm_timeout("30"), Ok(30.0));
        assert_eq!(weight_decay("0"), Ok(0.0));
        assert!(weight_decay("1e39").unwrap_err().contains("[0, 10]"));
        assert_eq!(top_p("1"), Ok(1.0));
        assert!(top_p("1.5").is_err());
    }

    #[test]
    fn token_lists_refuse_empty_items() {
        assert_eq!(token_ids("1, 2,3").unwrap(), vec![1, 2, 3]);
        for bad in ["1,,2", "1,2,", ",1", ""] {
            let e = token_ids(bad).unwrap_err().to_string();
            assert!(e.contains("is empty"), "{bad}: {e}");
        }
        assert!(token_ids("1,x").unwrap_err().to_string().contains("`x` is not a token id"));
    }
}
