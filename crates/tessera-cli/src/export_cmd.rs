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
    /// Output directory for the Hugging Face model (written atomically, with a
    /// `tessera-export.json` marker). It must not exist, be empty, or hold a previous export:
    /// a checkpoint, other files, the checkpoint being exported, the working directory or a
    /// directory holding any of them are refused.
    #[arg(long)]
    pub hf: PathBuf,
    /// Also replace a directory holding nothing but `config.json` and `model.safetensors`
    /// without the export marker (an older Tessera's export, or `save_pretrained`'s). Never
    /// a checkpoint, other files, or a directory holding the checkpoint or the working
    /// directory.
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
