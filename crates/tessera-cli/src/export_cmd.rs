//! `tessera export`: gather a checkpoint (a sharded one from `train --devices N --save`, or a
//! single-device one) into a Hugging Face model directory — `config.json` and
//! `model.safetensors` with global tensors under their HF names — that `transformers` loads
//! with `from_pretrained`.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use tessera_runtime::checkpoint::load_checkpoint;
use tessera_runtime::dist_checkpoint::export_hf;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Checkpoint directory written by `tessera train --save`.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Output directory for the Hugging Face model (written atomically). It must not exist,
    /// be empty, or hold a previous export; a checkpoint or other files there are refused.
    #[arg(long)]
    pub hf: PathBuf,
    /// Replace whatever `--hf` holds (a checkpoint's optimizer state and shards included).
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let ckpt = load_checkpoint(&args.checkpoint)
        .with_context(|| format!("reading checkpoint {}", args.checkpoint.display()))?;
    export_hf(&ckpt, &args.hf, args.force)
        .with_context(|| format!("exporting to {}", args.hf.display()))?;
    eprintln!(
        "exported {} ({} tensors, step {}) to {}",
        args.checkpoint.display(),
        ckpt.params.len(),
        ckpt.manifest.step,
        args.hf.display()
    );
    Ok(())
}
