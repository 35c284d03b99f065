//! `tessera eval`: the mean next-token cross-entropy of a checkpoint (a directory with
//! `config.json` and safetensors weights with Hugging Face names) over given token ids, with
//! the per-position logits on request — the parity check against `transformers`.

use crate::profile_cmd::{print_stdout, write_atomic, OutputFormat};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use tessera_ir::{DType, Program};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::checkpoint::load_hf_weights;
use tessera_runtime::tensor::{from_vec, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Directory with config.json and model.safetensors (or a sharded index).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Comma-separated token ids; the loss predicts ids[1..] from ids[..n-1].
    #[arg(long)]
    pub tokens: String,
    /// Write the per-position logits ([n-1, vocab], JSON) to this file.
    #[arg(long)]
    pub logits: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

fn parse_tokens(s: &str) -> Result<Vec<i64>> {
    let ids: Vec<i64> = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<i64>().with_context(|| format!("`{t}` in --tokens is not a token id")))
        .collect::<Result<_>>()?;
    if ids.len() < 2 {
        bail!("--tokens needs at least two ids (the loss predicts each id from those before it)");
    }
    Ok(ids)
}

pub fn run(args: &EvalArgs) -> Result<()> {
    let ids = parse_tokens(&args.tokens)?;
    let cfg = ModelConfig::from_path(&args.model_dir)?.without_dropout();
    let vocab = cfg.vocab_size().context("eval needs a language model (one with a vocabulary)")?;
    if let Some((pos, id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        bail!("token id {id} at position {pos} is outside the model's vocabulary of {vocab}");
    }
    let n = ids.len() - 1;
    let model = build(&cfg, &BuildOptions { batch: 1, seq: n, dtype: DType::F32 })?;
    let (loss, logits) = (model.loss, model.logits);
    let find = |name: &str| model.inputs.iter().find(|i| i.name == name).map(|i| i.tensor);
    let (Some(input_ids), Some(labels), None) =
        (find("input_ids"), find("labels"), find("num_targets"))
    else {
        bail!(
            "eval computes the next-token loss of causal language models (gpt2, llama, \
             mistral, qwen2); a masked LM's held-out loss is in `tessera train`'s report \
             (eval_loss)"
        );
    };
    let graph = model.builder.finish();
    let weights = load_hf_weights(&args.model_dir, &graph)?;
    let program = Program::lower_graph(graph, vec![loss, logits], &[]);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (t, value) in weights {
        exec.bind(t, value)?;
    }
    exec.bind(input_ids, from_vec(ids[..n].to_vec(), &[1, n])?)?;
    exec.bind(labels, from_vec(ids[1..].to_vec(), &[1, n])?)?;
    exec.run()?;
    let loss_value = to_f64_vec(exec.get(loss).context("loss was not kept")?)?[0];

    if let Some(path) = &args.logits {
        let flat = to_f64_vec(exec.get(logits).context("logits were not kept")?)?;
        let rows: Vec<&[f64]> = flat.chunks(vocab).collect();
        let doc = json!({"shape": [n, vocab], "tokens": ids, "logits": rows});
        write_atomic(path, serde_json::to_string(&doc)?.as_bytes())?;
    }
    match args.format {
        OutputFormat::Json => print_stdout(&format!("{}\n", json!({"loss": loss_value})))?,
        OutputFormat::Table => print_stdout(&format!(
            "{}: mean next-token cross-entropy {loss_value:.6} over {n} predictions\n",
            cfg.name()
        ))?,
    }
    Ok(())
}
