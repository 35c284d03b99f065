//! Offload: model state of some chunks kept below the device (host memory or NVMe), as
//! ZeRO-Offload, Gemini and ZeRO-Infinity do, expressed as a plan choice.
//!
//! Parameters are grouped in execution order into [`CHUNKS`] chunks of about equal bytes (a
//! parameter is never split; Gemini's chunks). An [`Offload`] says what of an offloaded chunk
//! leaves the device ([`OffloadKind`]), how many chunks are offloaded (the first `chunks` in
//! execution order: the embedding and early blocks, whose gradients are complete last), and
//! how many of those (the last ones) keep their optimizer state on the NVMe instead of host
//! memory: a tier per chunk, as Gemini and ZeRO-Infinity place them. The lowering turns it
//! into tiers and [`Op::Transfer`](tessera_ir::Op::Transfer) instructions
//! ([`crate::lower`]'s optimizer hooks); the memory simulation and the cost model read those.
//!
//! Config-string form: `offload=opt`, `offload=grads+opt:8/16` (the first 8 of the 16 chunks),
//! `nvme` (every offloaded chunk's state on the NVMe) or `nvme:K` (the last K of them).
//!
//! **Activation offload** (`offload=act`, or beside model state `offload=act+opt`,
//! `offload=act+grads+opt:8/16`): the input each fully checkpointed block keeps for its
//! backward pass rests in host memory — copied down once made in the forward pass (the device
//! copy freed after its last forward reader) and fetched back one block ahead of the block's
//! backward pass, so the copy overlaps the compute of the block before. It is a rewrite of the
//! checkpointed Program ([`crate::lower::act_offload`]) into `Transfer` instructions, so the
//! memory simulation (device and host peaks), the cost model's copies and the runtime read
//! one Program. `offload=act` alone keeps every chunk's model state on the device
//! ([`Offload::chunks`] 0).

use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use tessera_ir::{Graph, Op, Phase, Program, TensorId, Tier};

/// Chunks the parameters are grouped into.
pub const CHUNKS: u32 = 16;

/// What an offloaded chunk keeps below the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadKind {
    /// Optimizer state (AdamW moments, the fp32 master) lives on the host and the host's CPU
    /// runs its AdamW; gradients stay on the device until the optimizer step, then move.
    Opt,
    /// As `Opt`, and each gradient moves to the host as soon as it is complete (during the
    /// backward pass), so the device never holds the chunk's gradients together.
    GradsOpt,
    /// As `GradsOpt`, and the parameters rest on the host too, fetched before each use.
    All,
}

impl OffloadKind {
    pub fn name(self) -> &'static str {
        match self {
            OffloadKind::Opt => "opt",
            OffloadKind::GradsOpt => "grads+opt",
            OffloadKind::All => "all",
        }
    }
    /// Whether gradients leave the device as soon as they are complete.
    pub fn eager_grads(self) -> bool {
        self >= OffloadKind::GradsOpt
    }
}

/// A plan's offload choice (absent: everything on the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Offload {
    pub kind: OffloadKind,
    /// Offloaded chunks: the first `chunks` of [`CHUNKS`] in execution order.
    pub chunks: u32,
    /// Of the offloaded chunks, the last `nvme` keep their optimizer state on the NVMe (read
    /// into host memory for its update and written back) instead of in host memory.
    #[serde(default)]
    pub nvme: u32,
    /// Activation offload: the kept inputs of fully checkpointed blocks rest on the host
    /// (see the module docs). With `chunks` 0 it is the only offload (`kind` is then unused).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub act: bool,
}

impl Offload {
    /// Every chunk.
    pub fn all_chunks(kind: OffloadKind) -> Offload {
        Offload { kind, chunks: CHUNKS, nvme: 0, act: false }
    }

    /// Activation offload alone: every chunk's model state on the device.
    pub fn activations() -> Offload {
        Offload { kind: OffloadKind::Opt, chunks: 0, nvme: 0, act: true }
    }

    /// Whether any chunk's model state leaves the device.
    pub fn moves_state(&self) -> bool {
        self.chunks > 0
    }

    /// Parses the value of `offload=` (lower-cased): `KIND` or `KIND:K/16`, each optionally
    /// after `act+` (written `act_` once the config's `+` joins are undone), or `act` alone.
    pub fn parse_value(raw: &str, value: &str) -> std::result::Result<Offload, String> {
        if value == "act" {
            return Ok(Offload::activations());
        }
        if let Some(rest) = value.strip_prefix("act_").or_else(|| value.strip_prefix("act+")) {
            let state = Offload::parse_value(raw, rest)?;
            if state.act {
                return Err(format!("`{raw}`: write act once, e.g. offload=act+opt"));
            }
            return Ok(Offload { act: true, ..state });
        }
        let (kind, chunks) = match value.split_once(':') {
            Some((k, c)) => (k, Some(c)),
            None => (value, None),
        };
        let kind = match kind {
            "opt" => OffloadKind::Opt,
            "grads+opt" | "grads_opt" => OffloadKind::GradsOpt,
            "all" => OffloadKind::All,
            _ => {
                return Err(format!(
                    "`{raw}`: offload is opt, grads+opt or all, optionally with the chunks \
                     offloaded out of {CHUNKS}, e.g. offload=opt or offload=grads+opt:8/{CHUNKS}, \
                     and act (activations) alone or before them: offload=act, offload=act+opt"
                ))
            }
        };
        let chunks = match chunks {
            None => CHUNKS,
            Some(c) => {
                let bad = || {
                    format!(
                        "`{raw}`: after `:` give K/{CHUNKS}, the chunks offloaded (1 to {CHUNKS}), \
                         e.g. offload={}:8/{CHUNKS}",
                        kind.name()
                    )
                };
                let (k, n) = c.split_once('/').ok_or_else(bad)?;
                let k: u32 = k.parse().map_err(|_| bad())?;
                let n: u32 = n.parse().map_err(|_| bad())?;
                if n != CHUNKS || k == 0 || k > CHUNKS {
                    return Err(bad());
                }
                k
            }
        };
        Ok(Offload { kind, chunks, nvme: 0, act: false })
    }

    /// The parameters of `g`'s offloaded chunks with the tier their optimizer state rests in.
    pub fn offloaded(&self, g: &Graph) -> Vec<(TensorId, Tier)> {
        chunk_of(g).into_iter().filter_map(|(p, c)| self.state_tier(c).map(|t| (p, t))).collect()
    }

    /// The tier chunk `c`'s optimizer state rests in (`None`: on the device).
    pub fn state_tier(&self, c: u32) -> Option<Tier> {
        match c {
            _ if c >= self.chunks => None,
            _ if c + self.nvme.min(self.chunks) >= self.chunks => Some(Tier::Nvme),
            _ => Some(Tier::Host),
        }
    }
}

/// Each parameter of `g` with its chunk (0-based): parameters in creation order, cut into
/// [`CHUNKS`] runs of about equal bytes (a parameter belongs to the chunk its first byte falls
/// in, so a parameter larger than a chunk — GPT-2's embedding — leaves the chunks it spans
/// empty, and the plan lists the chunks that hold parameters).
pub fn chunk_of(g: &Graph) -> Vec<(TensorId, u32)> {
    let params = g.parameters();
    let total: u64 = params.iter().map(|&p| g.meta(p).size_bytes()).sum::<u64>().max(1);
    let mut before = 0u64;
    params
        .into_iter()
        .map(|p| {
            let c = ((before as u128 * CHUNKS as u128) / total as u128) as u32;
            before += g.meta(p).size_bytes();
            (p, c.min(CHUNKS - 1))
        })
        .collect()
}

impl fmt::Display for Offload {
    /// `offload=opt`, `offload=grads+opt:8/16 nvme`, `offload=act`, `offload=act+opt`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("offload=")?;
        if self.act {
            f.write_str("act")?;
            if self.chunks == 0 {
                return Ok(());
            }
            f.write_str("+")?;
        }
        f.write_str(self.kind.name())?;
        if self.chunks != CHUNKS {
            write!(f, ":{}/{CHUNKS}", self.chunks)?;
        }
        match self.nvme {
            0 => {}
            n if n >= self.chunks => f.write_str(" nvme")?,
            n => write!(f, " nvme:{n}")?,
        }
        Ok(())
    }
}

/// Checks a config's offload against what the lowering supports.
pub fn check(offload: &Offload) -> Result<()> {
    if (offload.chunks == 0 && !offload.act) || offload.chunks > CHUNKS {
        return Err(PlanError::Invalid(format!(
            "offload of {} chunks: give 1 to {CHUNKS}",
            offload.chunks
        )));
    }
    if offload.chunks == 0 && offload.nvme > 0 {
        return Err(PlanError::Invalid(
            "nvme puts offloaded optimizer state on the NVMe, and offload=act offloads none: \
             write offload=act+opt nvme"
                .into(),
        ));
    }
    Ok(())
}

/// One chunk of a plan's offload section: its parameters and where their state rests.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChunkJson {
    pub index: u32,
    /// The first parameter of the chunk (its Hugging Face name) and how many it holds.
    pub first: String,
    pub params: usize,
    /// The chunk's parameter bytes (global, as stored for compute).
    pub bytes: u64,
    pub params_tier: Tier,
    pub grads_tier: Tier,
    pub optimizer_tier: Tier,
}

/// A plan's `offload` section: the choice, every chunk's tiers, and the figures predicted from
/// the offloaded Program (per device).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct OffloadJson {
    /// As the config string writes it: `offload=grads+opt:8/16`.
    pub config: String,
    pub kind: OffloadKind,
    /// Offloaded chunks (the first ones in execution order) out of [`CHUNKS`].
    pub chunks_offloaded: u32,
    /// Of those, the chunks whose optimizer state rests on the NVMe (the last ones).
    pub nvme_chunks: u32,
    pub chunks: Vec<ChunkJson>,
    /// Bytes copied between tiers in one step (host link and NVMe).
    pub moved_bytes_per_step: u64,
    /// Peak of the host memory the device's offloaded state and copies take.
    pub host_peak_bytes: u64,
    /// The host memory the plan may use per device.
    pub host_memory_bytes: u64,
    /// Peak of the NVMe bytes (0 without `nvme`).
    pub nvme_peak_bytes: u64,
    /// Activation offload (`offload=act...`): the kept block inputs that rest on the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub act: bool,
    /// Bytes of activations copied to the host in one step (each fetched back once; per
    /// device, every micro-batch's).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub act_bytes_per_step: u64,
    /// Kept activations the Program moves to the host in one step.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub act_tensors_per_step: u64,
    /// Seconds of copies, of host work (the offloaded AdamW), and what of them the device's
    /// compute does not hide (part of the step time).
    pub transfer_s: f64,
    pub host_compute_s: f64,
    pub exposed_s: f64,
    /// The share of copies and host work hidden behind the device's compute.
    pub hidden_fraction: f64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl OffloadJson {
    /// The section for `offload` on the global forward graph `g`, with the lowered figures of
    /// its Program `program`.
    pub fn new(
        offload: &Offload,
        g: &Graph,
        program: &tessera_ir::Program,
        memory: &tessera_profile::MemoryReport,
        time: &crate::cost::StepTime,
        host_memory_bytes: u64,
    ) -> OffloadJson {
        let mut chunks: Vec<ChunkJson> = Vec::new();
        for (p, c) in chunk_of(g) {
            let bytes = g.meta(p).size_bytes();
            match chunks.last_mut() {
                Some(last) if last.index == c => {
                    last.params += 1;
                    last.bytes += bytes;
                }
                _ => {
                    let off = c < offload.chunks;
                    let eager = offload.kind.eager_grads();
                    chunks.push(ChunkJson {
                        index: c,
                        first: g.tensor_scope(p).to_string(),
                        params: 1,
                        bytes,
                        params_tier: if off && offload.kind == OffloadKind::All {
                            Tier::Host
                        } else {
                            Tier::Device
                        },
                        // Either way an offloaded gradient is moved to the host; `opt` keeps
                        // it on the device through the backward pass.
                        grads_tier: if off && eager { Tier::Host } else { Tier::Device },
                        optimizer_tier: offload.state_tier(c).unwrap_or(Tier::Device),
                    })
                }
            }
        }
        let (act_tensors, act_bytes) = activations_moved(program);
        OffloadJson {
            config: offload.to_string(),
            act: offload.act,
            act_bytes_per_step: act_bytes,
            act_tensors_per_step: act_tensors,
            kind: offload.kind,
            chunks_offloaded: offload.chunks,
            nvme_chunks: offload.nvme.min(offload.chunks),
            chunks,
            moved_bytes_per_step: time.moved_bytes,
            host_peak_bytes: memory.host_peak_bytes,
            host_memory_bytes,
            nvme_peak_bytes: memory.nvme_peak_bytes,
            transfer_s: time.transfer_s,
            host_compute_s: time.host_compute_s,
            exposed_s: time.offload_exposed_s,
            hidden_fraction: time.offload_hidden_fraction().unwrap_or(1.0),
        }
    }

    /// The choice it records.
    pub fn choice(&self) -> Offload {
        Offload {
            kind: self.kind,
            chunks: self.chunks_offloaded,
            nvme: self.nvme_chunks,
            act: self.act,
        }
    }
}

/// Checks an offloaded Program's host and NVMe peaks against the cluster's tiers; the error
/// names the tier, what the plan needs there and the fix.
pub fn check_tiers(
    cluster: &crate::Cluster,
    memory: &tessera_profile::MemoryReport,
    config: &str,
) -> Result<()> {
    if memory.host_peak_bytes > cluster.host.memory_bytes {
        return Err(PlanError::TierInfeasible {
            tier: Tier::Host,
            budget: cluster.host.memory_bytes,
            needed: memory.host_peak_bytes,
            hint: format!(
                "`{config}`; give --host-memory (or the cluster file's [host] memory), offload \
                 fewer chunks (offload=KIND:K/{CHUNKS}) or add nvme"
            ),
        });
    }
    let nvme = cluster.nvme.map_or(0, |n| n.capacity_bytes);
    if memory.nvme_peak_bytes > nvme {
        return Err(PlanError::TierInfeasible {
            tier: Tier::Nvme,
            budget: nvme,
            needed: memory.nvme_peak_bytes,
            hint: format!("`{config}`; give --nvme-size or --offload-dir on a larger disk"),
        });
    }
    Ok(())
}

impl OffloadJson {
    /// The table's lines: what is offloaded, the host (and NVMe) peak, the bytes moved and how
    /// much of the copies and host work the compute hides; with `chunks`, one line per chunk.
    pub fn summary(&self, chunks: bool) -> String {
        use crate::units::format_bytes as b;
        let lower = match self.nvme_chunks {
            0 => "host".to_string(),
            n if n >= self.chunks_offloaded => "NVMe".to_string(),
            n => format!("host ({n} of them on the NVMe)"),
        };
        let what = match self.chunks_offloaded {
            0 => "activations only: every chunk's model state on the device".to_string(),
            k => format!(
                "{k} of {CHUNKS} chunks' {} on the {lower}",
                match self.kind {
                    OffloadKind::Opt => "optimizer state",
                    OffloadKind::GradsOpt => "gradients and optimizer state",
                    OffloadKind::All => "parameters, gradients and optimizer state",
                }
            ),
        };
        let mut s = format!(
            "offload   {}: {what}; host peak {} of {}{}\n\
             \x20         {} moved per step: copies {:.4} s + host AdamW {:.4} s, {:.0}% hidden \
             ({:.4} s exposed)\n",
            self.config,
            b(self.host_peak_bytes),
            b(self.host_memory_bytes),
            if self.nvme_chunks > 0 {
                format!(", NVMe peak {}", b(self.nvme_peak_bytes))
            } else {
                String::new()
            },
            b(self.moved_bytes_per_step),
            self.transfer_s,
            self.host_compute_s,
            100.0 * self.hidden_fraction,
            self.exposed_s
        );
        if self.act {
            s += &format!(
                "\x20         activations: {} kept block inputs ({}) copied to the host in the \
                 forward pass, each fetched back one block ahead of its backward pass\n",
                self.act_tensors_per_step,
                b(self.act_bytes_per_step)
            );
        }
        if chunks && self.chunks_offloaded > 0 {
            s += "chunk  first parameter                              params      bytes  params  \
                  grads  optimizer\n";
            for c in &self.chunks {
                s += &format!(
                    "{:>5}  {:<42} {:>6} {:>10}  {:<6}  {:<5}  {}\n",
                    c.index,
                    c.first,
                    c.params,
                    b(c.bytes),
                    c.params_tier,
                    c.grads_tier,
                    c.optimizer_tier
                );
            }
        }
        s
    }
}

/// The activations a Program moves to the host in one step: how many, and their bytes (the
/// forward pass's device-to-host copies; model-state copies run in the backward pass and the
/// optimizer).
pub fn activations_moved(p: &Program) -> (u64, u64) {
    let g = p.graph();
    g.nodes
        .iter()
        .filter(|n| {
            n.phase == Phase::Forward
                && matches!(n.op, Op::Transfer { from: Tier::Device, to: Tier::Host })
        })
        .fold((0, 0), |(k, bytes), n| (k + 1, bytes + g.meta(n.inputs[0]).size_bytes()))
}
