//! QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): the frozen
//! base's linear weights held quantised, as generation's `--quantize` holds them (int8 per
//! output channel, int4 in groups of [`crate::INT4_GROUP`]; [`tessera_ir::QuantSpec`]), under
//! LoRA adapters that train in the model's dtype.
//!
//! [`quantize_base`] rewrites a built forward graph (after [`crate::lora::apply_lora`]): every
//! frozen rank-2 parameter `<module>.weight` whose only uses are as a linear's weight
//! (`y = x · Wᵀ`) becomes a `u8` parameter of the same name and f32 scales
//! `<module>.weight_scale`, and its products become [`tessera_ir::Op::QMatMul`]. The
//! quantised matmul's VJP gives x's gradient from the dequantised weight
//! ([`tessera_ir::Op::QMatMulBackward`]) and none to the weight, so everything downstream
//! (autodiff, the planner, the memory model) counts the base at its stored bytes, with no
//! gradient and no optimizer state.
//!
//! Kept in the model's dtype, as bitsandbytes keeps them: `lm_head` (the output projection is
//! small beside the base and sensitive; `llm_int8_skip_modules`' default), embeddings and
//! norms (not linears), and a weight read other than as a linear's (a tied head).

use crate::{ForwardModel, ModelError, Quantize, QuantizedWeight, Result};
use tessera_ir::{Builder, DType, Graph, Op, ScopeId, TensorId};

/// Whether parameter node `p`'s weight can be held quantised: frozen, rank 2, named
/// `<module>.weight` (not `lm_head`), and read only as the weight of `x · Wᵀ` products.
fn quantizable(g: &Graph, node: &tessera_ir::Node, uses: &[tessera_ir::NodeId]) -> bool {
    let Op::Parameter { meta, frozen: true } = &node.op else { return false };
    let w = node.outputs[0];
    let name = g.tensor_scope(w);
    let Some(module) = name.strip_suffix(".weight") else { return false };
    meta.shape.rank() == 2
        && meta.dtype.is_float()
        && module != "lm_head"
        && !module.ends_with(".lm_head")
        && !uses.is_empty()
        && uses.iter().all(|&u| {
            let n = g.node(u);
            matches!(n.op, Op::MatMul { trans_a: false, trans_b: true })
                && n.inputs[1] == w
                && n.inputs[0] != w
        })
}

/// `model` with its frozen linear weights held as `q`; returns the weights quantised (their
/// float source is the checkpoint tensor of the same name). An error if none is.
pub fn quantize_base(
    model: ForwardModel,
    q: Quantize,
) -> Result<(ForwardModel, Vec<QuantizedWeight>)> {
    quantize_with(model, q, false)
}

/// [`quantize_base`] for a forward-only (inference) graph: the linears as there and, with
/// int8, every frozen convolution weight too — `u8` codes `[O, I·kh·kw]` with one f32 scale
/// per output channel (the linears' int8 format, one group a row), dequantised into the
/// model's dtype just before its `Conv2d` (cast, −128, × scale, reshape: a transient of one
/// weight at a time). Not for training: a convolution's input gradient would keep the
/// dequantised weight alive until the backward. int4 leaves the convolutions in float (its
/// nibbles need a kernel to unpack).
pub fn quantize_for_inference(
    model: ForwardModel,
    q: Quantize,
) -> Result<(ForwardModel, Vec<QuantizedWeight>)> {
    quantize_with(model, q, q == Quantize::Int8)
}

/// Whether parameter node `p`'s weight is a frozen 4-D float tensor read only as a
/// convolution's weight.
fn conv_quantizable(g: &Graph, node: &tessera_ir::Node, uses: &[tessera_ir::NodeId]) -> bool {
    let Op::Parameter { meta, frozen: true } = &node.op else { return false };
    let w = node.outputs[0];
    meta.shape.rank() == 4
        && meta.dtype.is_float()
        && g.tensor_scope(w).ends_with(".weight")
        && !uses.is_empty()
        && uses.iter().all(|&u| {
            let n = g.node(u);
            matches!(n.op, Op::Conv2d(_)) && n.inputs.get(1) == Some(&w) && n.inputs[0] != w
        })
}

/// The int8 codes and scales of conv weight `w` (`[O, I, kh, kw]` in `dtype`) and its
/// dequantisation: returns (codes, scales, the dequantised weight).
fn dequantized_conv(
    b: &mut Builder,
    name: &str,
    dims: &[usize],
    dtype: DType,
) -> tessera_ir::Result<(TensorId, TensorId, TensorId, tessera_ir::QuantSpec)> {
    let o = dims[0];
    let k: usize = dims[1..].iter().product();
    let spec = tessera_ir::QuantSpec { bits: 8, group: k };
    let codes = b.frozen_parameter(name, [o, spec.row_bytes(k)], DType::U8);
    let scales = b.frozen_parameter(&format!("{name}_scale"), [o, 1], DType::F32);
    let q = b.cast(codes, dtype)?;
    let zero = b.scalar_like(-f64::from(spec.offset()), q)?;
    let q = b.add(q, zero)?;
    let s = if dtype == DType::F32 { scales } else { b.cast(scales, dtype)? };
    let w = b.mul(q, s)?;
    Ok((codes, scales, b.reshape(w, dims.to_vec())?, spec))
}

fn quantize_with(
    model: ForwardModel,
    q: Quantize,
    convs: bool,
) -> Result<(ForwardModel, Vec<QuantizedWeight>)> {
    let ForwardModel { builder, loss, logits, batch, seq, mut inputs } = model;
    let g = builder.finish();
    let internal = |e: tessera_ir::IrError| ModelError::Invalid {
        field: "--quantize-base".into(),
        reason: format!("the quantisation rewrite failed: {e}"),
    };
    let consumers = g.consumers();
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len() + 64, g.tensors.len() + 64));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    // Per quantised weight (by the old tensor): the new u8 weight, its scales and spec.
    let mut held: Vec<Option<(TensorId, TensorId, tessera_ir::QuantSpec)>> =
        vec![None; g.tensors.len()];
    let mut quantized = Vec::new();
    for node in &g.nodes {
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        b.set_phase(node.phase);
        if convs && conv_quantizable(&g, node, &consumers[node.outputs[0].index()]) {
            let w = node.outputs[0];
            let name = g.tensor_scope(w).to_string();
            let (codes, scales, deq, spec) =
                dequantized_conv(&mut b, &name, g.shape(w).dims(), g.meta(w).dtype)
                    .map_err(internal)?;
            map[w.index()] = Some(deq);
            quantized.push(QuantizedWeight {
                weight: codes,
                scales,
                source: name,
                transposed: false,
                spec,
            });
            continue;
        }
        if quantizable(&g, node, &consumers[node.outputs[0].index()]) {
            let w = node.outputs[0];
            let name = g.tensor_scope(w).to_string();
            let (n, k) = (g.shape(w).dim(0), g.shape(w).dim(1));
            let spec = q.spec(k);
            let qw = b.frozen_parameter(&name, [n, spec.row_bytes(k)], DType::U8);
            let scales =
                b.frozen_parameter(&format!("{name}_scale"), [n, k / spec.group], DType::F32);
            held[w.index()] = Some((qw, scales, spec));
            quantized.push(QuantizedWeight {
                weight: qw,
                scales,
                source: name,
                transposed: false,
                spec,
            });
            continue;
        }
        let quantized_weight = match node.op {
            Op::MatMul { trans_a: false, trans_b: true } => held[node.inputs[1].index()],
            _ => None,
        };
        // (A quantised product reads x alone of the old tensors.)
        let read = if quantized_weight.is_some() { &node.inputs[..1] } else { &node.inputs[..] };
        let ins = read
            .iter()
            .map(|&t| {
                map[t.index()].ok_or_else(|| internal(tessera_ir::IrError::Graph("order".into())))
            })
            .collect::<Result<Vec<_>>>()?;
        let outs = match quantized_weight {
            Some((qw, scales, spec)) => {
                vec![b.push1(Op::QMatMul(spec), &[ins[0], qw, scales]).map_err(internal)?]
            }
            None => b.push_like(&g, node, node.op.clone(), &ins).map_err(internal)?.to_vec(),
        };
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
    }
    if quantized.is_empty() {
        return Err(ModelError::Invalid {
            field: "--quantize-base".into(),
            reason: "no frozen linear weight to quantise: QLoRA quantises the frozen base of a \
                     --lora run"
                .into(),
        });
    }
    let remap = |t: TensorId| map[t.index()].expect("every kept tensor is copied");
    for i in &mut inputs {
        i.tensor = remap(i.tensor);
    }
    let model =
        ForwardModel { builder: b, loss: remap(loss), logits: remap(logits), batch, seq, inputs };
    Ok((model, quantized))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::{apply_lora, LoraSpec};

    /// On llama-tiny with LoRA: every decoder linear is quantised (q/k/v/o, gate/up/down),
    /// lm_head and the embeddings stay float, the LoRA adapters are the only trainable
    /// parameters, and the backward pass holds a `QMatMulBackward` per quantised product whose
    /// input needs a gradient.
    #[test]
    fn the_frozen_linears_are_held_quantised_and_only_the_adapters_train() {
        let cfg = crate::ModelConfig::resolve("llama-tiny").unwrap();
        let opts = crate::BuildOptions { batch: 1, seq: 8, dtype: DType::F32 };
        let spec = LoraSpec::parse("r=2,alpha=4,targets=q_proj,v_proj").unwrap();
        let (m, _) = apply_lora(crate::build(&cfg, &opts).unwrap(), &spec).unwrap();
        let (m, quantized) = quantize_base(m, Quantize::Int4).unwrap();
        let t = tessera_ir::build_training_graph(m.builder, m.loss, &Default::default()).unwrap();
        let g = &t.graph;
        let layers = g
            .parameters()
            .iter()
            .filter(|&&p| g.tensor_scope(p).ends_with(".input_layernorm.weight"))
            .count();
        assert_eq!(quantized.len(), 7 * layers);
        assert!(quantized.iter().all(|w| g.meta(w.weight).dtype == DType::U8));
        assert!(quantized.iter().all(|w| !w.source.contains("lm_head")));
        let trained: Vec<&str> = t.params.iter().map(|s| g.tensor_scope(s.param)).collect();
        assert!(trained.iter().all(|n| crate::lora::is_lora_name(n)), "{trained:?}");
        let count = |f: &dyn Fn(&Op) -> bool| g.nodes.iter().filter(|n| f(&n.op)).count();
        assert_eq!(count(&|o| matches!(o, Op::QMatMul(_))), 7 * layers);
        // Every product but the first layer's q, k and v projections, whose input nothing
        // trainable lies below (a frozen embedding and norm).
        assert_eq!(count(&|o| matches!(o, Op::QMatMulBackward(_))), 7 * layers - 3);
        let err = quantize_base(crate::build(&cfg, &opts).unwrap(), Quantize::Int8)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--lora"), "{err}");
    }
}
