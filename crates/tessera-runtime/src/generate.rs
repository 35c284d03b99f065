//! Generation on one device of a tensor-parallel group: the planner's prefill and decode
//! Programs, executed over one set of weights and KV caches.
//!
//! Both Programs hold the same parameters and caches (resident leaves): they are bound once
//! and shared — the same tensors, no copy — by the two executors, so a device holds one copy
//! of its weights and caches. Each executor's accountant charges them, so each one's peak is
//! exactly what the memory simulation predicts for its Program, and the device's peak is the
//! larger of the two.
//!
//! A step: the prefill writes every prompt's keys and values into the caches and returns the
//! logits at each prompt's last token; each decode step feeds the token just chosen at its
//! row's next position. Prompts of different lengths share the step: a shorter one is padded,
//! its padding written into cache slots its later tokens overwrite before any query can see
//! them (a query at position `p` sees slots `≤ p`).

use crate::collective::{shard, DeviceMesh, ReshardRunner};
use crate::mapped::ShardSource;
use crate::sampling::Sampling;
use crate::tensor::{candle_dtype, check_meta, from_vec};
use crate::{Backend, Executor, Result, RuntimeError};
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::time::Instant;
use tessera_ir::{LeafLayout, Op, Program, QuantSpec, TensorId};

/// One step Program of this device and where its logits are.
#[derive(Clone, Debug)]
pub struct StepProgram {
    pub program: Program,
    pub layout: LeafLayout,
    /// The whole `[B, 1, V]` f32 logits.
    pub logits: TensorId,
}

/// A quantised weight: the `u8` parameter `weight` and f32 `scales`, made from the float
/// checkpoint tensor `source` (`[N, K]`, or `[K, N]` when `transposed`).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedLeaf {
    pub weight: String,
    pub scales: String,
    pub source: String,
    pub transposed: bool,
    pub spec: QuantSpec,
}

/// What one generation produced on this device.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    /// Per prompt, its new tokens (cut after the end-of-sequence token when one is given).
    pub new_tokens: Vec<Vec<i64>>,
    /// Seconds from the start to the first new tokens (the prefill and its sampling).
    pub time_to_first_token_s: f64,
    /// Seconds of the decode steps.
    pub decode_s: f64,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Measured peaks of the prefill and decode Programs (bytes).
    pub prefill_peak_bytes: u64,
    pub decode_peak_bytes: u64,
    /// With [`Generator::keep_logits`]: per step, per prompt, the logits its token was chosen
    /// from.
    pub step_logits: Vec<Vec<Vec<f32>>>,
}

/// A device's generator: the prefill and decode executors over shared weights and caches.
pub struct Generator<B: Backend> {
    prefill: Executor<B>,
    decode: Executor<B>,
    prefill_spec: StepProgram,
    decode_spec: StepProgram,
    mesh: DeviceMesh,
    /// Rows, prompt positions of the prefill, and cache positions.
    batch: usize,
    prompt: usize,
    capacity: usize,
    prefill_peak: u64,
    decode_peak: u64,
    keep_logits: bool,
}

fn binding(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

/// The placement of leaf `t` (whole when the layout does not list it).
fn placement(spec: &StepProgram, t: TensorId) -> Vec<Vec<usize>> {
    spec.layout
        .placements
        .get(&t)
        .cloned()
        .unwrap_or_else(|| vec![Vec::new(); spec.program.graph.shape(t).rank()])
}

impl<B: Backend> Generator<B> {
    /// Binds the weights of `source` (quantising `quantized` ones as they are read, each
    /// device reading only the rows of its shard) and zeroed caches into both Programs.
    /// `runner` is the device's communicator (`None` on one device).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        prefill: StepProgram,
        decode: StepProgram,
        backends: (B, B),
        runner: Option<Box<dyn ReshardRunner>>,
        mesh: DeviceMesh,
        budget: Option<u64>,
        source: &dyn ShardSource,
        quantized: &[QuantizedLeaf],
    ) -> Result<Generator<B>> {
        let shape = |s: &StepProgram, name: &str| -> Result<Vec<usize>> {
            let t = s
                .program
                .graph
                .find_leaf(name)
                .ok_or_else(|| binding(format!("the generation step has no input {name}")))?;
            Ok(s.program.graph.shape(t).dims().to_vec())
        };
        let ids = shape(&prefill, "input_ids")?;
        let (batch, prompt) = (ids[0], ids[1]);
        let capacity = prefill
            .program
            .graph
            .nodes
            .iter()
            .find_map(|n| match &n.op {
                Op::KvCache(m) => Some(m.shape.dim(1)),
                _ => None,
            })
            .ok_or_else(|| binding("the generation step has no KV cache".into()))?;
        let mut pre =
            Executor::new(prefill.program.clone(), backends.0, budget).at_position(mesh.clone());
        let dec =
            Executor::new(decode.program.clone(), backends.1, budget).at_position(mesh.clone());
        pre.put_collectives(runner);
        let mut g = Generator {
            prefill: pre,
            decode: dec,
            prefill_spec: prefill,
            decode_spec: decode,
            mesh,
            batch,
            prompt,
            capacity,
            prefill_peak: 0,
            decode_peak: 0,
            keep_logits: false,
        };
        g.bind_resident(source, quantized)?;
        Ok(g)
    }

    /// Binds every parameter and cache of the prefill Program, and the same tensors into the
    /// decode Program (which must hold the same leaves, shaped alike).
    fn bind_resident(
        &mut self,
        source: &dyn ShardSource,
        quantized: &[QuantizedLeaf],
    ) -> Result<()> {
        let values = resident_values(&self.prefill_spec, &self.mesh, source, quantized)?;
        let pg = &self.prefill_spec.program.graph;
        let dg = &self.decode_spec.program.graph;
        for (t, value) in values {
            let name = pg.tensor_scope(t).to_string();
            let dt = dg.find_leaf(&name).ok_or_else(|| {
                binding(format!("the decode step has no {name} (the prefill does)"))
            })?;
            check_meta(&value, dg.meta(dt), &name)?;
            // One copy on the device, shared by both Programs.
            let on_device = self.prefill.backend().upload(&value)?;
            self.prefill.bind_value(t, on_device.clone())?;
            self.decode.bind_value(dt, on_device)?;
        }
        Ok(())
    }

    /// The device's communicator (`None` on one device), for calls outside the Programs.
    pub fn communicator(&mut self) -> Option<&mut dyn tessera_comm::Communicator> {
        let exec =
            if self.prefill.collectives().is_some() { &mut self.prefill } else { &mut self.decode };
        exec.collectives_mut().map(|r| r.communicator())
    }

    /// Keeps each step's logits in [`Generated::step_logits`].
    pub fn keep_logits(&mut self, on: bool) {
        self.keep_logits = on;
    }

    /// Binds the step inputs of `which` (its `input_ids [B,S]`, `cache_start`, `position_ids`,
    /// `last_index`), runs it, and returns the logits `[B, V]`.
    fn run_step(
        &mut self,
        prefill: bool,
        ids: Vec<i64>,
        start: Vec<i64>,
        last: Vec<i64>,
    ) -> Result<Vec<Vec<f32>>> {
        // The device's communicator goes with the Program that runs.
        let (spec, exec) = if prefill {
            let r = self.decode.take_collectives();
            if r.is_some() {
                self.prefill.put_collectives(r);
            }
            (&self.prefill_spec, &mut self.prefill)
        } else {
            let r = self.prefill.take_collectives();
            if r.is_some() {
                self.decode.put_collectives(r);
            }
            (&self.decode_spec, &mut self.decode)
        };
        let g = &spec.program.graph;
        let b = self.batch;
        let s = ids.len() / b.max(1);
        let positions: Vec<i64> = (0..b * s).map(|k| start[k / s] + (k % s) as i64).collect();
        let values: [(&str, Vec<i64>, Vec<usize>); 4] = [
            ("input_ids", ids, vec![b, s]),
            ("cache_start", start, vec![b]),
            ("position_ids", positions, vec![b, s]),
            ("last_index", last, vec![b]),
        ];
        for (name, v, dims) in values {
            let t = g
                .find_leaf(name)
                .ok_or_else(|| binding(format!("the step has no input {name}")))?;
            let global = from_vec(v, &dims)?;
            let local = shard(&self.mesh, &global, &placement(spec, t), name)?;
            exec.bind(t, local)?;
        }
        exec.run()?;
        let logits = exec
            .fetch(spec.logits)?
            .ok_or_else(|| binding("the step's logits are not kept".into()))?
            .to_dtype(DType::F32)?;
        let peak = exec.accountant().peak_bytes();
        if prefill {
            self.prefill_peak = self.prefill_peak.max(peak);
        } else {
            self.decode_peak = self.decode_peak.max(peak);
        }
        let dims = logits.dims().to_vec();
        let v = *dims.last().unwrap_or(&0);
        let flat = logits.flatten_all()?.to_vec1::<f32>()?;
        Ok(flat.chunks(v.max(1)).map(<[f32]>::to_vec).collect())
    }

    /// Generates up to `max_new` tokens for each prompt (at most the Programs' rows, each at
    /// most their prompt length); `on_step(step, tokens)` sees each step's new token per row.
    pub fn generate(
        &mut self,
        prompts: &[Vec<i64>],
        max_new: usize,
        sampling: &Sampling,
        eos: Option<i64>,
        mut on_step: impl FnMut(usize, &[i64]),
    ) -> Result<Generated> {
        let (b, p, cap) = (self.batch, self.prompt, self.capacity);
        if prompts.is_empty() || prompts.len() > b {
            return Err(binding(format!("{} prompts for a step of {b} rows", prompts.len())));
        }
        if let Some((i, long)) =
            prompts.iter().enumerate().find(|(_, q)| q.is_empty() || q.len() > p)
        {
            return Err(binding(format!(
                "prompt {i} has {} tokens; the prefill takes 1 to {p}",
                long.len()
            )));
        }
        if let Some(long) = prompts.iter().map(Vec::len).max().filter(|&l| l + max_new > cap + 1) {
            return Err(binding(format!(
                "a {long}-token prompt and {max_new} new tokens need {} cache positions; the \
                 cache holds {cap}",
                long + max_new - 1
            )));
        }
        let t0 = Instant::now();
        // Rows past the prompts repeat the last one (their tokens are dropped).
        let row = |r: usize| &prompts[r.min(prompts.len() - 1)];
        let lens: Vec<usize> = (0..b).map(|r| row(r).len()).collect();
        let mut ids = vec![0i64; b * p];
        for r in 0..b {
            ids[r * p..r * p + lens[r]].copy_from_slice(row(r));
        }
        let last: Vec<i64> = lens.iter().map(|&l| l as i64 - 1).collect();
        let logits = self.run_step(true, ids, vec![0; b], last)?;
        let mut next: Vec<i64> = (0..b).map(|r| sampling.pick(&logits[r], r, 0) as i64).collect();
        let mut kept = Vec::new();
        if self.keep_logits {
            kept.push(logits[..prompts.len()].to_vec());
        }
        let mut out =
            Generated { time_to_first_token_s: t0.elapsed().as_secs_f64(), ..Default::default() };
        let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let t1 = Instant::now();
        for step in 0..max_new {
            for r in 0..b {
                if !done[r] {
                    tokens[r].push(next[r]);
                    done[r] = eos == Some(next[r]);
                }
            }
            on_step(step, &next[..prompts.len()]);
            if step + 1 == max_new || done[..prompts.len()].iter().all(|&d| d) {
                break;
            }
            let start: Vec<i64> = lens.iter().map(|&l| (l + step) as i64).collect();
            let logits = self.run_step(false, next.clone(), start, vec![0; b])?;
            next = (0..b).map(|r| sampling.pick(&logits[r], r, step + 1) as i64).collect();
            if self.keep_logits {
                kept.push(logits[..prompts.len()].to_vec());
            }
            out.decode_steps += 1;
        }
        out.decode_s = t1.elapsed().as_secs_f64();
        tokens.truncate(prompts.len());
        out.new_tokens = tokens;
        out.prefill_peak_bytes = self.prefill_peak;
        out.decode_peak_bytes = self.decode_peak;
        out.step_logits = kept;
        Ok(out)
    }
}

/// This device's values of `step`'s resident leaves: each parameter's shard read from
/// `source` (quantised ones made from their float rows as they are read) and each KV cache
/// zeroed.
pub fn resident_values(
    step: &StepProgram,
    mesh: &DeviceMesh,
    source: &dyn ShardSource,
    quantized: &[QuantizedLeaf],
) -> Result<Vec<(TensorId, Tensor)>> {
    let qs: HashMap<&str, &QuantizedLeaf> =
        quantized.iter().flat_map(|q| [(q.weight.as_str(), q), (q.scales.as_str(), q)]).collect();
    let mut made: HashMap<String, Tensor> = HashMap::new();
    let g = &step.program.graph;
    let mut out = Vec::new();
    for n in g.nodes.iter().filter(|n| matches!(n.op, Op::Parameter { .. } | Op::KvCache(_))) {
        let t = n.outputs[0];
        let name = g.tensor_scope(t).to_string();
        let meta = g.meta(t);
        let value = match (&n.op, qs.get(name.as_str())) {
            (Op::KvCache(_), _) => Tensor::zeros(
                meta.shape.dims(),
                candle_dtype(meta.dtype),
                &candle_core::Device::Cpu,
            )?,
            (_, Some(q)) => {
                if !made.contains_key(&name) {
                    let (w, s) = quantized_shard(step, mesh, source, q)?;
                    made.insert(q.weight.clone(), w);
                    made.insert(q.scales.clone(), s);
                }
                made[&name].clone()
            }
            _ => source
                .shard_of(&name, &placement(step, t), mesh, candle_dtype(meta.dtype))?
                .ok_or_else(|| binding(format!("the weights have no tensor {name}")))?,
        };
        check_meta(&value, meta, &name)?;
        out.push((t, value));
    }
    Ok(out)
}

/// This device's shard of quantised weight `q`: the float rows its output features take
/// (whole input features: an int8 scale covers a whole row), quantised, then cut to its
/// input features (row-parallel layers).
fn quantized_shard(
    step: &StepProgram,
    mesh: &DeviceMesh,
    source: &dyn ShardSource,
    q: &QuantizedLeaf,
) -> Result<(Tensor, Tensor)> {
    let g = &step.program.graph;
    let leaf = |name: &str| g.find_leaf(name).ok_or_else(|| binding(format!("no leaf {name}")));
    let (wt, st) = (leaf(&q.weight)?, leaf(&q.scales)?);
    let wp = placement(step, wt);
    let rows = wp.first().cloned().unwrap_or_default();
    // The float weight's placement splitting only its output features.
    let float_p = if q.transposed { vec![Vec::new(), rows] } else { vec![rows, Vec::new()] };
    let w = source
        .shard_of(&q.source, &float_p, mesh, DType::F32)?
        .ok_or_else(|| binding(format!("the weights have no tensor {}", q.source)))?;
    let w = if q.transposed { w.t()?.contiguous()? } else { w };
    let (codes, scales) = crate::quantize::quantize(&w, q.spec)?;
    let cols = |p: &[Vec<usize>]| vec![Vec::new(), p.get(1).cloned().unwrap_or_default()];
    let codes = shard(mesh, &codes, &cols(&wp), &q.weight)?;
    let scales = shard(mesh, &scales, &cols(&placement(step, st)), &q.scales)?;
    Ok((codes, scales))
}
