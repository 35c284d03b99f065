//! Parameter initialisation, decided by each parameter's role in the graph rather than by
//! model-specific code: norm weights start at 1, biases and norm shifts at 0, matrices and
//! embeddings from N(0, 0.02²) — with the GPT-2 paper's 1/√(2·layers) scaling for the
//! projections that write into the residual stream.
//!
//! Values come from a counter-based generator keyed by (seed, parameter name, element index),
//! so a parameter's initial value does not depend on creation order or, later, on which device
//! holds which shard.

use crate::tensor::from_vec;
use crate::Result;
use candle_core::Tensor;
use std::collections::HashMap;
use tessera_ir::dist::{global_index, row_major_strides, MeshPos, ShardOf};
use tessera_ir::{Graph, Op, TensorId};

/// Standard deviation of matrices and embeddings (GPT-2, BERT, LLaMA reference inits).
pub const INIT_STD: f64 = 0.02;

/// Suffixes of the weights that project back into the residual stream.
const RESIDUAL_PROJECTIONS: [&str; 5] = [
    "attn.c_proj.weight",
    "mlp.c_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "output.dense.weight",
];

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitRule {
    Zeros,
    Ones,
    Normal {
        std: f64,
    },
    /// U(−bound, bound): a LoRA `A` as PEFT draws it (`kaiming_uniform_(a=√5)`, whose bound
    /// is 1/√fan_in).
    Uniform {
        bound: f64,
    },
}

/// A LoRA parameter's rule by its name (`<module>.lora_A.weight [r, in]`: PEFT's kaiming
/// uniform; `.lora_B.weight`: zeros, so the adapted model starts as the base), if it is one.
fn lora_rule(name: &str, dims: &[usize]) -> Option<InitRule> {
    if name.ends_with(".lora_A.weight") && dims.len() == 2 {
        return Some(InitRule::Uniform { bound: 1.0 / (dims[1].max(1) as f64).sqrt() });
    }
    name.ends_with(".lora_B.weight").then_some(InitRule::Zeros)
}

/// A uniform in (−1, 1] for element `i` of the stream `key`.
fn symmetric_unit(seed: u64, key: u64, i: u64) -> f64 {
    let base = mix(seed ^ mix(key ^ 0x10aa)).wrapping_add(i);
    2.0 * unit(mix(base)) - 1.0
}

/// The rule for each parameter of `graph`, in `graph.parameters()` order.
pub fn init_rules(graph: &Graph) -> Vec<(TensorId, InitRule)> {
    let num_blocks = graph.nodes.iter().filter_map(|n| n.block).max().map_or(1, |b| b as u64 + 1);
    let consumers = graph.consumers();
    graph
        .parameters()
        .into_iter()
        .map(|p| {
            let norm_slot = consumers[p.index()].iter().find_map(|&n| {
                let node = graph.node(n);
                match node.op {
                    Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::GroupNorm { .. } => {
                        node.inputs.iter().position(|&t| t == p)
                    }
                    _ => None,
                }
            });
            let name = graph.tensor_scope(p);
            if let Some(rule) = lora_rule(name, graph.shape(p).dims()) {
                return (p, rule);
            }
            let rule = match norm_slot {
                Some(1) => InitRule::Ones,
                Some(_) => InitRule::Zeros,
                None if graph.shape(p).rank() < 2 => InitRule::Zeros,
                None if RESIDUAL_PROJECTIONS.iter().any(|s| name.ends_with(s)) => {
                    InitRule::Normal { std: INIT_STD / (2.0 * num_blocks as f64).sqrt() }
                }
                None => InitRule::Normal { std: INIT_STD },
            };
            (p, rule)
        })
        .collect()
}

use rayon::prelude::*;
use tessera_ir::rng::splitmix64 as mix;

/// FNV-1a of a parameter name: a stable key independent of graph order.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x1000_0000_01b3))
}

/// Uniform in (0, 1] from a 64-bit hash.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// A standard normal for element `i` of the stream `key` (Box–Muller on two hashes).
pub fn normal(seed: u64, key: u64, i: u64) -> f64 {
    let base = mix(seed ^ mix(key)).wrapping_add(i.wrapping_mul(2));
    let u1 = unit(mix(base));
    let u2 = unit(mix(base.wrapping_add(1)));
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Initial value of one parameter as f32 host data.
pub fn init_values(name: &str, numel: usize, rule: InitRule, seed: u64) -> Vec<f32> {
    match rule {
        InitRule::Zeros => vec![0.0; numel],
        InitRule::Ones => vec![1.0; numel],
        InitRule::Normal { std } => {
            let key = name_key(name);
            // Each element is keyed by its index, so drawing in parallel changes nothing.
            (0..numel as u64).into_par_iter().map(|i| (std * normal(seed, key, i)) as f32).collect()
        }
        InitRule::Uniform { bound } => {
            let key = name_key(name);
            (0..numel as u64)
                .into_par_iter()
                .map(|i| (bound * symmetric_unit(seed, key, i)) as f32)
                .collect()
        }
    }
}

/// Creates every parameter of `graph` as an f32 CPU tensor.
pub fn init_parameters(graph: &Graph, seed: u64) -> Result<Vec<(TensorId, Tensor)>> {
    init_rules(graph)
        .into_iter()
        .map(|(p, rule)| {
            let shape = graph.shape(p).dims().to_vec();
            let numel = shape.iter().product();
            let data = init_values(graph.tensor_scope(p), numel, rule, seed);
            Ok((p, from_vec(data, &shape)?))
        })
        .collect()
}

/// The rule of every parameter of `graph` by name. Rules read the parameter's role in the
/// *single-device* graph (a sharded graph may reach a norm through a gather), so callers
/// compute them there and hand them to every device ([`init_shard`]).
pub fn init_rules_by_name(graph: &Graph) -> HashMap<String, InitRule> {
    init_rules(graph).into_iter().map(|(p, r)| (graph.tensor_scope(p).to_string(), r)).collect()
}

/// One device's shard of a parameter's initial value, as an f32 tensor: only the shard's
/// elements are drawn, each keyed by its index in the whole (`global`-shaped) parameter, so
/// the shards of every plan tile exactly the tensor [`init_parameters`] makes on one device
/// and no device ever holds more than its shard.
pub fn init_shard(
    name: &str,
    rule: InitRule,
    global: &[usize],
    placement: &[Vec<usize>],
    at: &MeshPos,
    seed: u64,
) -> Result<Tensor> {
    let shard = ShardOf { global: global.to_vec(), placement: placement.to_vec(), micro_batch: 0 };
    let (base, strides) = shard.index_map(Some(at))?;
    let mut local = global.to_vec();
    for (d, axes) in placement.iter().enumerate() {
        local[d] /= at.chunk(axes)?.0;
    }
    let numel: usize = local.iter().product();
    let data = match rule {
        InitRule::Zeros => vec![0.0; numel],
        InitRule::Ones => vec![1.0; numel],
        // Each element's value is keyed by (seed, name, global index): a shard draws its
        // slice of the whole tensor's values.
        InitRule::Normal { std } => {
            let key = name_key(name);
            keyed(numel, &local, base, &strides, |g| std * normal(seed, key, g))
        }
        InitRule::Uniform { bound } => {
            let key = name_key(name);
            keyed(numel, &local, base, &strides, |g| bound * symmetric_unit(seed, key, g))
        }
    };
    from_vec(data, &local)
}

/// The `numel` values of a local block `local` (its first element at global index `base`, the
/// tensor's row-major `strides`), each `value(global index)`.
fn keyed(
    numel: usize,
    local: &[usize],
    base: u64,
    strides: &[u64],
    value: impl Fn(u64) -> f64 + Sync,
) -> Vec<f32> {
    let lstrides = row_major_strides(local);
    (0..numel as u64)
        .into_par_iter()
        .map(|k| value(global_index(k, &lstrides, base, strides)) as f32)
        .collect()
}
