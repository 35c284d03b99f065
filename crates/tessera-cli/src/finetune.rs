//! Fine-tuning flags: `--freeze GLOB`, `--lora SPEC`, `--init-adapter DIR` (on `train`,
//! `plan` and `profile`), and what a LoRA run writes: a PEFT adapter (`--save-adapter`) or the
//! base with the adapter merged in (`--merge-into`).
//!
//! QLoRA (`--quantize-base int4|int8` with `--lora`): the frozen base's linear weights held
//! as generation's `--quantize` holds them (`tessera_models::qlora`), quantised from the float
//! checkpoint as they are read ([`Quantizing`]).
//!
//! The graph side is `tessera_models::lora` (the rewrite and the freezing); this file reads
//! and writes PEFT's files:
//! - `adapter_config.json`: PEFT's `LoraConfig` (`peft_type: "LORA"`, `r`, `lora_alpha`,
//!   `lora_dropout`, `target_modules`, ...);
//! - `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` `[r, in]` and
//!   `...lora_B.weight` `[out, r]`.

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_ir::Graph;
use tessera_models::lora::{self, LoraSpec};
use tessera_models::{ForwardModel, Quantize};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::collective::Placement;
use tessera_runtime::generate::QuantizedLeaf;
use tessera_runtime::mapped::ShardSource;

/// PEFT's prefix of every adapter tensor name (`PeftModel` → `LoraModel` → the base model).
pub const PEFT_PREFIX: &str = "base_model.model.";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The fine-tuning flags every command that builds a training step takes.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct FinetuneArgs {
    /// Freeze the parameters whose Hugging Face name matches GLOB (`*` any run of characters,
    /// `?` one; repeatable): no gradient, no optimizer state, no gradient all-reduce.
    #[arg(long, value_name = "GLOB")]
    pub freeze: Vec<String>,
    /// LoRA adapters beside the target linears, everything else frozen:
    /// `r=8,alpha=16,dropout=0,targets=q_proj,v_proj` (PEFT's defaults where omitted).
    #[arg(long, value_name = "SPEC")]
    pub lora: Option<String>,
    /// Start LoRA's A and B from a PEFT adapter directory (its adapter_config.json gives the
    /// rank, alpha and targets unless --lora does; they must agree).
    #[arg(long, value_name = "DIR")]
    pub init_adapter: Option<PathBuf>,
    /// QLoRA: hold the frozen base's linear weights quantised, as `generate --quantize` does
    /// (int4: one scale per 128 input features; int8: one per output channel), under LoRA
    /// adapters that train in the run's dtype. Needs --lora (and, to train, --init DIR).
    #[arg(long, value_name = "BITS", value_parser = crate::generate_cmd::parse_quantize)]
    pub quantize_base: Option<Quantize>,
}

/// A PEFT adapter read from disk: its LoRA settings and tensors by our names
/// (`<module>.lora_A.weight`), as f32.
pub struct Adapter {
    pub dir: PathBuf,
    pub spec: LoraSpec,
    pub tensors: HashMap<String, Tensor>,
}

/// The parsed flags: what the forward graph is rewritten with.
#[derive(Default)]
pub struct FineTune {
    pub freeze: Vec<String>,
    pub lora: Option<LoraSpec>,
    pub adapter: Option<Adapter>,
    /// QLoRA's quantised base.
    pub quantize_base: Option<Quantize>,
}

impl FinetuneArgs {
    pub fn resolve(&self) -> Result<FineTune> {
        let given = self
            .lora
            .as_deref()
            .map(LoraSpec::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--lora: {e}"))?;
        let adapter = self.init_adapter.as_deref().map(read_adapter).transpose()?;
        let lora = match (&given, &adapter) {
            (Some(g), Some(a)) => {
                let same = g.rank == a.spec.rank
                    && g.alpha == a.spec.alpha
                    && sorted(&g.targets) == sorted(&a.spec.targets);
                if !same {
                    bail!(
                        "--lora {} differs from the adapter in {} (r={}, alpha={}, targets={}): \
                         drop --lora to take the adapter's settings",
                        self.lora.as_deref().unwrap_or_default(),
                        a.dir.display(),
                        a.spec.rank,
                        a.spec.alpha,
                        a.spec.targets.join(",")
                    );
                }
                Some(g.clone())
            }
            (Some(g), None) => Some(g.clone()),
            (None, Some(a)) => Some(a.spec.clone()),
            (None, None) => None,
        };
        if let (Some(q), None) = (self.quantize_base, &lora) {
            bail!(
                "--quantize-base {} holds the frozen base of a LoRA run quantised (QLoRA): give \
                 --lora too",
                q.name()
            );
        }
        Ok(FineTune {
            freeze: self.freeze.clone(),
            lora,
            adapter,
            quantize_base: self.quantize_base,
        })
    }
}

fn sorted(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v
}

impl FineTune {
    /// Whether the flags change nothing.
    pub fn is_none(&self) -> bool {
        self.freeze.is_empty() && self.lora.is_none()
    }

    /// The same rewrite for evaluation: LoRA without dropout.
    pub fn for_eval(&self) -> FineTune {
        FineTune {
            freeze: self.freeze.clone(),
            lora: self.lora.clone().map(|l| LoraSpec { dropout: 0.0, ..l }),
            adapter: None,
            quantize_base: self.quantize_base,
        }
    }

    /// `model` rewritten: LoRA adapters (every other parameter frozen), then `--freeze`.
    pub fn apply(&self, model: ForwardModel) -> tessera_models::Result<ForwardModel> {
        let mut model = match &self.lora {
            Some(spec) => lora::apply_lora(model, spec)?.0,
            None => model,
        };
        if !self.freeze.is_empty() {
            lora::freeze(&mut model.builder.graph, &self.freeze)?;
        }
        if let Some(q) = self.quantize_base {
            model = tessera_models::qlora::quantize_base(model, q)?.0;
        }
        Ok(model)
    }

    /// LoRA's starting A and B for a run from base weights (`--init`): the adapter's, or
    /// drawn by the init rules (A uniform, B zero) of `graph` — the LoRA graph — from `seed`.
    pub fn start_tensors(&self, graph: &Graph, seed: u64) -> Result<HashMap<String, Tensor>> {
        if let Some(a) = &self.adapter {
            for p in graph.parameters() {
                let name = graph.tensor_scope(p);
                if !lora::is_lora_name(name) {
                    continue;
                }
                let Some(t) = a.tensors.get(name) else {
                    bail!("--init-adapter {}: no tensor {PEFT_PREFIX}{name}", a.dir.display());
                };
                if t.dims() != graph.shape(p).dims() {
                    bail!(
                        "--init-adapter {}: {name} is {:?}, the model's is {}",
                        a.dir.display(),
                        t.dims(),
                        graph.shape(p)
                    );
                }
            }
            return Ok(a.tensors.clone());
        }
        let rules = tessera_runtime::init::init_rules(graph);
        let mut out = HashMap::new();
        for (p, rule) in rules {
            let name = graph.tensor_scope(p);
            if !lora::is_lora_name(name) {
                continue;
            }
            let dims = graph.shape(p).dims().to_vec();
            let values =
                tessera_runtime::init::init_values(name, dims.iter().product(), rule, seed);
            out.insert(name.to_string(), tessera_runtime::tensor::from_vec(values, &dims)?);
        }
        Ok(out)
    }
}

/// A starting source whose LoRA tensors (small, whole) come first and the base's after.
pub struct Layered {
    pub first: HashMap<String, Tensor>,
    pub rest: Box<dyn ShardSource + Send>,
}

impl ShardSource for Layered {
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> tessera_runtime::Result<Option<Tensor>> {
        match self.first.shard_of(name, placement, mesh, dtype)? {
            Some(t) => Ok(Some(t)),
            None => self.rest.shard_of(name, placement, mesh, dtype),
        }
    }
}

/// What a QLoRA training run refuses, by name, before it loads anything.
pub fn check_qlora_run(args: &crate::train_cmd::TrainArgs, q: Quantize) -> Result<()> {
    let flag = format!("--quantize-base {}", q.name());
    if args.devices > 1 {
        bail!(
            "{flag}: QLoRA trains on one device so far (--devices 1); across devices the \
             quantised base's shards are not yet bound as the plan lays them out (ZeRO-3 \
             measured more than predicted), so multi-device QLoRA is refused"
        );
    }
    if args.init.is_none() {
        bail!(
            "{flag} quantises a trained base as it is read: give the base with --init DIR \
             (a Hugging Face model directory)"
        );
    }
    if args.resume.is_some() {
        bail!("{flag}: resuming a QLoRA run is not supported yet; start it again from --init");
    }
    if args.merge_into.is_some() {
        bail!(
            "{flag}: --merge-into would merge into the quantised base; save the adapter \
             (--save-adapter) and merge it into the float base with a LoRA run's --merge-into"
        );
    }
    Ok(())
}

/// The quantised weights of a QLoRA graph (its `QMatMul`s' weights and scales), each made
/// from the float checkpoint tensor of the weight's name.
pub fn quantized_leaves(graph: &Graph) -> Vec<QuantizedLeaf> {
    let mut out: Vec<QuantizedLeaf> = Vec::new();
    for n in &graph.nodes {
        let tessera_ir::Op::QMatMul(spec) = n.op else { continue };
        let weight = graph.tensor_scope(n.inputs[1]).to_string();
        if out.iter().any(|q| q.weight == weight) {
            continue;
        }
        out.push(QuantizedLeaf {
            source: weight.clone(),
            scales: graph.tensor_scope(n.inputs[2]).to_string(),
            weight,
            transposed: false,
            spec,
        });
    }
    out
}

/// A weight source that quantises the QLoRA base's linear weights as they are read: the
/// whole float tensor from `rest`, quantised (`tessera_runtime::quantize`, what generation's
/// `--quantize` does), then this device's shard of the codes or scales.
pub struct Quantizing {
    /// By the `u8` weight's name and by its scales' name.
    pub leaves: HashMap<String, QuantizedLeaf>,
    pub rest: Box<dyn ShardSource + Send>,
}

impl Quantizing {
    pub fn new(graph: &Graph, rest: Box<dyn ShardSource + Send>) -> Quantizing {
        let leaves = quantized_leaves(graph)
            .into_iter()
            .flat_map(|q| [(q.weight.clone(), q.clone()), (q.scales.clone(), q)])
            .collect();
        Quantizing { leaves, rest }
    }
}

impl ShardSource for Quantizing {
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> tessera_runtime::Result<Option<Tensor>> {
        let Some(q) = self.leaves.get(name) else {
            return self.rest.shard_of(name, placement, mesh, dtype);
        };
        let whole: Placement = vec![Vec::new(); 2];
        let Some(w) = self.rest.shard_of(&q.source, &whole, mesh, candle_core::DType::F32)? else {
            return Ok(None);
        };
        let (codes, scales) = tessera_runtime::quantize::quantize(&w, q.spec)?;
        let t = if name == q.weight { codes } else { scales };
        Ok(Some(tessera_runtime::collective::shard(mesh, &t, placement, name)?))
    }
}

/// The LoRA settings of a PEFT `adapter_config.json`, refusing what the rewrite does not do.
pub fn spec_from_config(doc: &Value, path: &Path) -> Result<LoraSpec> {
    let at = || path.display().to_string();
    let field = |k: &str| doc.get(k).filter(|v| !v.is_null());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => bail!("{}: peft_type is {other:?}; only LORA adapters load", at()),
    }
    let unsupported = [
        ("use_dora", "DoRA"),
        ("use_rslora", "rsLoRA"),
        ("lora_bias", "LoRA-bias"),
        ("fan_in_fan_out", "Conv1D (fan_in_fan_out) layers"),
    ];
    for (key, what) in unsupported {
        if field(key).and_then(Value::as_bool) == Some(true) {
            bail!("{}: {key} is true; {what} adapters are not supported", at());
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if field(key).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
            bail!("{}: {key} is set; per-module ranks or alphas are not supported", at());
        }
    }
    if field("layers_to_transform").is_some() || field("modules_to_save").is_some() {
        bail!("{}: layers_to_transform / modules_to_save are not supported", at());
    }
    if field("bias").and_then(Value::as_str).is_some_and(|b| b != "none") {
        bail!("{}: bias is not \"none\"; bias-training adapters are not supported", at());
    }
    let rank = field("r").and_then(Value::as_u64).context("adapter_config.json has no `r`")?;
    let alpha = field("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let targets: Vec<String> = match field("target_modules") {
        Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(String::from)).collect(),
        Some(Value::String(s)) => bail!(
            "{}: target_modules is the pattern {s:?}; give the adapter a list of module names",
            at()
        ),
        _ => bail!("{}: adapter_config.json has no target_modules", at()),
    };
    let text = format!("r={rank},alpha={alpha},dropout={dropout},targets={}", targets.join(","));
    LoraSpec::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", at()))
}

/// Reads a PEFT adapter directory.
pub fn read_adapter(dir: &Path) -> Result<Adapter> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {} (a PEFT adapter directory)", cfg_path.display()))?;
    let doc: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", cfg_path.display()))?;
    let spec = spec_from_config(&doc, &cfg_path)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let raw = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .with_context(|| format!("reading {}", path.display()))?;
    let mut tensors = HashMap::new();
    for (key, t) in raw {
        let name = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
        // Older PEFT files may keep the adapter's name: `lora_A.default.weight`.
        let name = name.replace(".lora_A.default.weight", ".lora_A.weight");
        let name = name.replace(".lora_B.default.weight", ".lora_B.weight");
        if !lora::is_lora_name(&name) {
            bail!("{}: tensor {key} is not a LoRA A or B weight", path.display());
        }
        let t = t.to_dtype(candle_core::DType::F32)?;
        let values = tessera_runtime::tensor::to_f64_vec(&t)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!("{}: tensor {key} holds a non-finite value at element {i}", path.display());
        }
        tensors.insert(name, t);
    }
    Ok(Adapter { dir: dir.to_path_buf(), spec, tensors })
}

/// PEFT's `adapter_config.json` for `spec` on the base model `base`.
pub fn adapter_config(spec: &LoraSpec, base: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        // PEFT's `lora_alpha` is an int where it can be.
        "lora_alpha": if spec.alpha.fract() == 0.0 && spec.alpha < 1e15 {
            json!(spec.alpha as i64)
        } else {
            json!(spec.alpha)
        },
        "lora_dropout": spec.dropout,
        "target_modules": spec.targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null
    })
}

/// Writes a PEFT adapter directory from trained parameters by our names (only the LoRA ones
/// are written), as f32.
pub fn write_adapter(
    dir: &Path,
    spec: &LoraSpec,
    base: &str,
    params: &HashMap<String, Tensor>,
) -> Result<()> {
    let mut tensors = HashMap::new();
    for (name, t) in params.iter().filter(|(n, _)| lora::is_lora_name(n)) {
        tensors.insert(format!("{PEFT_PREFIX}{name}"), t.to_dtype(candle_core::DType::F32)?);
    }
    if tensors.is_empty() {
        bail!("no LoRA parameters to write to {}: train with --lora", dir.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(&adapter_config(spec, base))?;
    std::fs::write(dir.join(ADAPTER_CONFIG), text + "\n")
        .with_context(|| format!("writing {}", dir.join(ADAPTER_CONFIG).display()))?;
    candle_core::safetensors::save(&tensors, dir.join(ADAPTER_WEIGHTS))
        .with_context(|| format!("writing {}", dir.join(ADAPTER_WEIGHTS).display()))?;
    Ok(())
}

/// The base weights with every adapter merged in (`W + (alpha/r)·B·A`) and the LoRA tensors
/// removed: what `--merge-into` exports.
pub fn merge(spec: &LoraSpec, params: &mut HashMap<String, Tensor>) -> Result<usize> {
    let modules: Vec<String> =
        params.keys().filter_map(|n| n.strip_suffix(".lora_A.weight").map(String::from)).collect();
    for m in &modules {
        let a = params.remove(&lora::lora_a_name(m)).context("lora_A")?;
        let b = params
            .remove(&lora::lora_b_name(m))
            .with_context(|| format!("{m}: a lora_A without its lora_B"))?;
        let key = format!("{m}.weight");
        let w = params.get(&key).with_context(|| format!("{m}: no base weight {key}"))?;
        let dtype = w.dtype();
        let f32 = candle_core::DType::F32;
        let delta = (b.to_dtype(f32)?.matmul(&a.to_dtype(f32)?)? * spec.scaling())?;
        let merged = (w.to_dtype(f32)? + delta)?.to_dtype(dtype)?;
        params.insert(key, merged);
    }
    Ok(modules.len())
}

/// After a LoRA run (rank 0): the adapter (`--save-adapter`) and the merged model
/// (`--merge-into`), read back from the checkpoint `--save` wrote at the last step.
pub fn after_run(ctx: &crate::train_prepare::RunContext) -> Result<()> {
    let args = &ctx.args;
    if args.save_adapter.is_none() && args.merge_into.is_none() {
        return Ok(());
    }
    let Some(saved) = &args.save else { return Ok(()) };
    let spec = args.finetune.resolve()?.lora.context("--save-adapter needs --lora")?;
    let ckpt = tessera_runtime::checkpoint::load_checkpoint(saved)
        .with_context(|| format!("reading back {} for the adapter", saved.display()))?;
    let base = args.init.as_ref().map_or(args.model.clone(), |d| d.display().to_string());
    if let Some(dir) = &args.save_adapter {
        write_adapter(dir, &spec, &base, &ckpt.params).context("--save-adapter")?;
    }
    if let Some(dir) = &args.merge_into {
        let mut merged = ckpt;
        merge(&spec, &mut merged.params).context("--merge-into")?;
        tessera_runtime::dist_checkpoint::export_hf(&merged, dir, true).context("--merge-into")?;
    }
    Ok(())
}
