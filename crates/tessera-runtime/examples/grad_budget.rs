//! One training step's forward and backward from given weights and a given batch, in fp32 or
//! bf16, on the CPU: the Tessera side of `scripts/bf16_grad_budget.py` (the per-parameter
//! error budget of bf16 against fp32, Tessera's against PyTorch autocast's).
//!
//! ```sh
//! grad_budget MODEL_DIR IN.safetensors OUT.safetensors fp32|bf16 [scope-prefix ...]
//! ```
//!
//! MODEL_DIR is a Hugging Face directory (`bf16_spread --dump-only` writes one per seed); IN
//! holds `input_ids` and `labels` (i64, `[batch, seq]`; the labels are the next tokens, as a
//! training batch's targets are). The model is built at IN's batch and sequence in the given
//! dtype, exactly as training builds it (the parameters in that dtype, the weights rounded to
//! it); OUT gets `loss`, `logits`, `grad.<Hugging Face name>` for every trainable parameter
//! (each in the dtype Tessera computes it in), and `act.<scope>#<k>` for every graph tensor
//! whose scope starts with one of the given prefixes (intermediate activations, for going
//! down to the op).

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use tessera_ir::{gradients, DType, Program, TensorId};
use tessera_models::{build, BuildOptions, InputKind, ModelConfig};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::tensor::candle_dtype;
use tessera_runtime::{CpuBackend, Executor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn miss(what: String) -> Box<dyn std::error::Error> {
    what.into()
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err(
            "usage: grad_budget MODEL_DIR IN.safetensors OUT.safetensors fp32|bf16 [prefix ...]"
                .into(),
        );
    }
    let dir = PathBuf::from(&args[0]);
    let dtype = match args[3].as_str() {
        "fp32" => DType::F32,
        "bf16" => DType::BF16,
        other => return Err(format!("dtype {other}: fp32 or bf16").into()),
    };
    let prefixes = &args[4..];
    let given = candle_core::safetensors::load(&args[1], &Device::Cpu)?;
    let ids = given.get("input_ids").ok_or_else(|| miss("no input_ids".into()))?;
    let (batch, seq) = ids.dims2()?;
    let cfg = ModelConfig::from_path(&dir)?.without_dropout();
    let mut model = build(&cfg, &BuildOptions { batch, seq, dtype })?;
    let trainable = model.builder.graph.trainable_parameters();
    let grads = gradients(&mut model.builder, model.loss, &trainable)?;
    let graph = model.builder.finish();

    let mut kept = vec![model.logits, model.loss];
    let mut named: Vec<(String, TensorId)> =
        vec![("logits".into(), model.logits), ("loss".into(), model.loss)];
    for (&p, g) in trainable.iter().zip(&grads) {
        let g = g.ok_or_else(|| miss(format!("{}: no gradient", graph.tensor_scope(p))))?;
        kept.push(g);
        named.push((format!("grad.{}", graph.tensor_scope(p)), g));
    }
    if !prefixes.is_empty() {
        let mut count: HashMap<String, usize> = HashMap::new();
        for k in 0..graph.tensors.len() {
            let t = TensorId(k as u32);
            let scope = graph.tensor_scope(t).to_string();
            if prefixes.iter().any(|p| scope.starts_with(p.as_str())) && !kept.contains(&t) {
                let n = count.entry(scope.clone()).or_default();
                named.push((format!("act.{scope}#{n}"), t));
                *n += 1;
                kept.push(t);
            }
        }
    }
    let grad_ids: Vec<TensorId> = grads.iter().flatten().copied().collect();
    let weights = open_weights(&dir, &graph)?;
    let mut values = Vec::new();
    for p in graph.parameters() {
        let name = graph.tensor_scope(p);
        let whole = vec![Vec::new(); graph.shape(p).rank()];
        let d = candle_dtype(graph.meta(p).dtype);
        let v = weights.shard_of(name, &whole, &DeviceMesh::single(), d)?;
        values.push((p, v.ok_or_else(|| miss(format!("no weight {name}")))?));
    }
    let labels = given.get("labels").ok_or_else(|| miss("no labels".into()))?;
    for input in &model.inputs {
        let shape = graph.shape(input.tensor).dims().to_vec();
        let d = candle_dtype(graph.meta(input.tensor).dtype);
        let v = match input.kind {
            InputKind::TokenIds { .. } => ids.reshape(shape.as_slice())?,
            InputKind::Labels { .. } => labels.reshape(shape.as_slice())?,
            InputKind::TargetCount => {
                Tensor::new((batch * seq) as f32, &Device::Cpu)?.to_dtype(d)?
            }
            _ => Tensor::zeros(shape.as_slice(), d, &Device::Cpu)?,
        };
        values.push((input.tensor, v.contiguous()?));
    }
    let program = Program::lower_graph(graph, kept, &grad_ids);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (t, v) in values {
        exec.bind(t, v)?;
    }
    exec.run()?;
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in named {
        let v = exec.get(t).ok_or_else(|| miss(format!("{name} was not kept")))?;
        out.insert(name, v.clone());
    }
    candle_core::safetensors::save(&out, &args[2])?;
    Ok(())
}
