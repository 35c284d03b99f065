//! Stacked expert parameters in memory, per-expert tensors on disk.
//!
//! A mixture-of-experts model holds each projection of a layer's experts as one parameter
//! stacked along dim 0 (`…mlp.experts.gate_proj.weight [E, f, d]`), while checkpoints — the
//! Hub's, and every `model.safetensors` Tessera writes — keep one tensor per expert
//! (`…mlp.experts.{e}.gate_proj.weight [f, d]`), so that `transformers` loads them and they
//! load here one to one. The names map by [`tessera_ir::moe::per_expert_name`] and
//! [`tessera_ir::moe::stacked_expert_name`]; this module converts whole tensors
//! ([`to_hub_layout`] before writing, [`from_hub_layout`] after reading) and groups a file's
//! per-expert names for slice reads ([`group_per_expert`]: [`crate::mapped::MappedTensors`]
//! reads each expert as one piece of the stacked tensor).
//!
//! Optimizer state keeps the stacked names (`<stacked>.adam_m`): it is Tessera's own file.

use crate::checkpoint::err;
use crate::Result;
use candle_core::Tensor;
use std::collections::{BTreeMap, HashMap};
use tessera_ir::moe::{per_expert_name, stacked_expert_name};

/// `params` with every stacked expert parameter split into its per-expert tensors (in expert
/// order, where it stood); the others unchanged.
pub fn to_hub_layout(params: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::with_capacity(params.len());
    for (name, t) in params {
        if per_expert_name(name, 0).is_none() || t.rank() == 0 {
            out.push((name.clone(), t.clone()));
            continue;
        }
        for e in 0..t.dim(0)? {
            let hub = per_expert_name(name, e).unwrap_or_else(|| name.clone());
            out.push((hub, t.get(e)?));
        }
    }
    Ok(out)
}

/// Names of a file split into the plain ones and, per stacked parameter, its experts' names in
/// expert order (each `T` travels with its name). Experts must be numbered `0..E` without a
/// gap or a repeat: a checkpoint missing an expert is refused by name.
#[allow(clippy::type_complexity)]
pub fn group_per_expert<T>(
    items: impl IntoIterator<Item = (String, T)>,
) -> Result<(Vec<(String, T)>, Vec<(String, Vec<(String, T)>)>)> {
    let mut plain = Vec::new();
    let mut groups: BTreeMap<String, BTreeMap<usize, (String, T)>> = BTreeMap::new();
    for (name, value) in items {
        match stacked_expert_name(&name) {
            Some((stacked, e)) => {
                let rows = groups.entry(stacked).or_default();
                if rows.contains_key(&e) {
                    return Err(err(format!("expert tensor {name} is given twice")));
                }
                rows.insert(e, (name, value));
            }
            None => plain.push((name, value)),
        }
    }
    let mut stacked = Vec::with_capacity(groups.len());
    for (key, rows) in groups {
        let n = rows.len();
        if let Some(gap) = (0..n).find(|e| !rows.contains_key(e)) {
            let want = per_expert_name(&key, gap).unwrap_or_else(|| key.clone());
            return Err(err(format!(
                "{key}: the checkpoint has {n} experts' tensors but not {want}; experts must \
                 be numbered 0..{n} without gaps"
            )));
        }
        stacked.push((key, rows.into_values().collect()));
    }
    Ok((plain, stacked))
}

/// Tensors by name with every set of per-expert tensors stacked into its parameter.
pub fn from_hub_layout(params: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let (plain, stacked) = group_per_expert(params)?;
    let mut out: HashMap<String, Tensor> = plain.into_iter().collect();
    for (key, rows) in stacked {
        let tensors: Vec<Tensor> = rows.into_iter().map(|(_, t)| t).collect();
        let t = Tensor::stack(&tensors, 0).map_err(|e| {
            err(format!("{key}: its experts' tensors do not stack (shapes or dtypes differ): {e}"))
        })?;
        if out.insert(key.clone(), t).is_some() {
            return Err(err(format!("{key} is given both stacked and per expert")));
        }
    }
    Ok(out)
}
