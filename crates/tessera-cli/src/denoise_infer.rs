//! `tessera profile --inference` of a diffusion denoiser (diffusers' UNet, DiT): one
//! denoising step — what a sampler runs once per step, at the batch it samples (with
//! classifier-free guidance, twice the pictures) — as a forward-only Program on one device:
//! the weights in the model's dtype, or with `--quantize` every linear layer's weight held as
//! int8 (one scale per output channel) or int4, as generation holds an LLM's
//! ([`tessera_models::qlora::quantize_for_inference`]'s rewrite of `x · Wᵀ` products into
//! [`tessera_ir::Op::QMatMul`]), and with int8 every convolution weight too (int8 codes, one
//! scale per output channel, dequantised into the model's dtype just before its `Conv2d`).
//! Norms and embeddings stay in the model's dtype, and with int4 the convolutions do.
//!
//! The Program is the model's forward pruned to its output (no training loss, no target
//! input), lowered as the runtime runs it, so its simulated peak is the one the runtime's
//! accountant measures (`tests/denoise_inference.rs` checks that on a tiny UNet).

use anyhow::Result;
use tessera_ir::{Builder, DType, Graph, Program, ScopeId, TensorId};
use tessera_models::{build, BuildOptions, ForwardModel, ModelConfig, Quantize};

/// Whether `cfg` is a diffusion denoiser this profile handles.
pub fn is_denoiser(cfg: &ModelConfig) -> bool {
    matches!(cfg, ModelConfig::UNet(_) | ModelConfig::Dit(_))
}

/// One denoising step, lowered: the Program and the forward model it was lowered from (its
/// inputs, with their tensors in the Program's graph).
pub struct DenoiseStep {
    pub program: Program,
    pub output: TensorId,
    pub inputs: Vec<tessera_models::ModelInput>,
    /// The weights held quantised (none without `--quantize`).
    pub quantized: usize,
}

/// The forward of `cfg` at `batch` (`seq` text tokens for a text-conditioned UNet), every
/// parameter frozen, pruned to the model's output and, with `quantize`, its linears (and
/// with int8 its convolutions) held quantised; lowered with the output kept.
pub fn denoise_step(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    dtype: DType,
    quantize: Option<Quantize>,
) -> Result<DenoiseStep> {
    let mut model = build(cfg, &BuildOptions { batch, seq, dtype })?;
    model.builder.graph.freeze_where(|_| true);
    let mut model = prune_to_output(model)?;
    let mut quantized = 0;
    if let Some(q) = quantize {
        let (m, weights) = tessera_models::qlora::quantize_for_inference(model, q)?;
        model = m;
        quantized = weights.len();
    }
    let output = model.logits;
    let inputs = model.inputs.clone();
    let program = Program::lower_graph(model.builder.finish(), vec![output], &[]);
    Ok(DenoiseStep { program, output, inputs, quantized })
}

/// `model` with only the nodes its output (`logits`) depends on: the training loss and the
/// inputs only it reads (the target) are dropped. Its `loss` becomes the output.
fn prune_to_output(model: ForwardModel) -> Result<ForwardModel> {
    let ForwardModel { builder, logits, batch, seq, inputs, .. } = model;
    let g = builder.finish();
    let mut needed = vec![false; g.tensors.len()];
    needed[logits.index()] = true;
    for node in g.nodes.iter().rev() {
        if node.outputs.iter().any(|o| needed[o.index()]) {
            for &i in &node.inputs {
                needed[i.index()] = true;
            }
        }
    }
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len(), g.tensors.len()));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    for node in &g.nodes {
        if !node.outputs.iter().any(|o| needed[o.index()]) {
            continue;
        }
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        b.set_phase(node.phase);
        let ins = node
            .inputs
            .iter()
            .map(|&t| map[t.index()].ok_or_else(|| anyhow::anyhow!("graph not in order")))
            .collect::<Result<Vec<_>>>()?;
        let outs = b.push_like(&g, node, node.op.clone(), &ins)?.to_vec();
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
    }
    let inputs = inputs
        .into_iter()
        .filter_map(|mut i| {
            i.tensor = map[i.tensor.index()]?;
            Some(i)
        })
        .collect();
    let out = map[logits.index()].ok_or_else(|| anyhow::anyhow!("the output was pruned"))?;
    Ok(ForwardModel { builder: b, loss: out, logits: out, batch, seq, inputs })
}

/// What `tessera profile --inference --format json` prints for a denoiser.
pub fn profile_report(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    dtype: DType,
    quantize: Option<Quantize>,
) -> Result<serde_json::Value> {
    let t0 = std::time::Instant::now();
    let step = denoise_step(cfg, batch, seq, dtype, quantize)?;
    let m = tessera_profile::simulate_memory(&step.program).report;
    let flops = tessera_profile::count_flops(&step.program.graph);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let g = step.program.graph();
    let (mut quantized_bytes, mut float_bytes) = (0u64, 0u64);
    for p in g.parameters() {
        let (bytes, name) = (g.meta(p).size_bytes(), g.tensor_scope(p));
        if g.meta(p).dtype == DType::U8 || name.ends_with(".weight_scale") {
            quantized_bytes += bytes;
        } else {
            float_bytes += bytes;
        }
    }
    Ok(serde_json::json!({
        "model": cfg.name(),
        "family": cfg.family(),
        "params": cfg.num_parameters(),
        "batch": batch,
        "text_tokens": matches!(cfg, ModelConfig::UNet(_)).then_some(seq),
        "dtype": dtype.name(),
        "quantize": quantize.map(Quantize::name),
        "quantized_weights": step.quantized,
        "memory": {
            "weights_bytes": m.params_bytes,
            "quantized_weights_bytes": quantized_bytes,
            "float_weights_bytes": float_bytes,
            "inputs_bytes": m.inputs_bytes,
            "activations_bytes": m.peak_bytes.saturating_sub(m.params_bytes + m.inputs_bytes),
            "peak_bytes": m.peak_bytes,
        },
        "flops": {"forward": flops.total},
        "profile_ms": ms,
    }))
}

/// `tessera profile --inference` of a denoiser, as a table.
pub fn profile_table(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    dtype: DType,
    quantize: Option<Quantize>,
) -> Result<String> {
    let r = profile_report(cfg, batch, seq, dtype, quantize)?;
    let m = &r["memory"];
    let b = |k: &str| tessera_plan::units::format_bytes(m[k].as_u64().unwrap_or(0));
    Ok(format!(
        "{} denoising step (forward), batch {}{}, {}{} ({:.1} ms)\n\
         weights      {}  ({} of them quantised)\n\
         inputs       {}\nactivations  {}\npeak         {}\nFLOPs        {:.3e}\n",
        cfg.name(),
        batch,
        if matches!(cfg, ModelConfig::UNet(_)) {
            format!(" × {seq} text tokens")
        } else {
            "".into()
        },
        dtype.name(),
        quantize.map_or(String::new(), |q| match q {
            Quantize::Int8 => ", int8 linear and convolution weights".to_string(),
            _ => format!(", {} linear weights", q.name()),
        }),
        r["profile_ms"].as_f64().unwrap_or(0.0),
        b("weights_bytes"),
        b("quantized_weights_bytes"),
        b("inputs_bytes"),
        b("activations_bytes"),
        b("peak_bytes"),
        r["flops"]["forward"].as_f64().unwrap_or(0.0),
    ))
}
