//! The Program interpreter.
//!
//! Leaves are bound by the caller: resident ones (parameters, optimizer state) once, the
//! step's inputs before every run. [`Executor::run`] then walks the instructions: a `Run`
//! charges the node's fresh output buffers and its workspace to the accountant (failing before
//! the kernel runs if a budget would be exceeded), executes the kernel, and stores the
//! outputs; a `Free` drops every tensor sharing the freed buffer and credits its bytes.
//!
//! On a device of a parallel plan, [`Executor::with_collectives`] hands `Reshard` nodes to a
//! [`ReshardRunner`] (the communicator), and [`Executor::write_back`] makes a ZeRO-1/2
//! gathered parameter the parameter's new value the moment it is produced (the Program frees
//! the gathered buffer right after; the parameter keeps its storage).
//!
//! Offloaded Programs put some buffers in lower tiers ([`Tier`]): each tier has its own
//! accountant (the device's budget, the host's), charged exactly as the memory simulation
//! charges the tier, and `Transfer` nodes are real copies between them. NVMe buffers rest in
//! files ([`crate::nvme`]): written by background threads, read back ahead of use (the next
//! [`NVME_PREFETCH`] reads are in flight while the step runs).

use crate::collective::ReshardRunner;
use crate::tensor::{candle_dtype, check_meta};
use crate::{Backend, MemoryAccountant, Result, RuntimeError};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::time::Instant;
use tessera_ir::dist::MeshPos;
use tessera_ir::{Instr, Op, Program, TensorId, TensorMeta, Tier};

/// NVMe reads started ahead of the instruction that needs them.
pub const NVME_PREFETCH: usize = 2;

/// Wall time spent in one op kind (`matmul`, `attention_backward`, ...), and the FLOPs those
/// calls did by the IR's count (`Op::flops`), so a kind's achieved GFLOP/s inside a step can
/// be set beside its kernel micro-benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTime {
    pub calls: u64,
    pub seconds: f64,
    pub flops: u64,
}

/// One op kind's [`OpTime`] under its name, as a run reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpTimeRow {
    pub kind: String,
    pub time: OpTime,
}

impl OpTimeRow {
    /// Achieved GFLOP/s (None for kinds that do no FLOPs or took no measurable time).
    pub fn gflop_per_s(&self) -> Option<f64> {
        (self.time.flops > 0 && self.time.seconds > 0.0)
            .then(|| self.time.flops as f64 / self.time.seconds / 1e9)
    }
}

pub struct Executor<B: Backend> {
    program: Program,
    backend: B,
    values: Vec<Option<B::Value>>,
    /// Tensors sharing each buffer (indexed by root), so a free drops every handle.
    members: Vec<Vec<TensorId>>,
    accountant: MemoryAccountant,
    /// The host's and the NVMe's accountants (offloaded buffers), in [`Tier::ALL`] order after
    /// the device's.
    lower: [MemoryAccountant; 2],
    /// Per-op-kind wall time, when enabled.
    timings: Option<BTreeMap<&'static str, OpTime>>,
    /// Runs `Reshard` nodes that move data between devices.
    collectives: Option<Box<dyn ReshardRunner>>,
    /// Produced tensor → leaf whose value it becomes (ZeRO-1/2 gathered parameters).
    write_back: BTreeMap<TensorId, TensorId>,
    /// The device's place in its mesh (kernels that depend on it: sharded dropout masks).
    at: MeshPos,
    host: HostMemory,
    /// The NVMe tier's files (offloaded plans with NVMe chunks).
    nvme: Option<crate::nvme::NvmeStore>,
    /// Instructions that read an NVMe buffer, in order, and how far prefetching has got.
    nvme_reads: Vec<(usize, TensorId)>,
    nvme_next: usize,
    /// NVMe buffers a `Run` produced and the accountant holds until their `Free` (a result
    /// written back into its state no longer has a file of its own).
    nvme_charged: std::collections::HashSet<TensorId>,
}

/// The check of the host's memory before large allocations: an instruction whose fresh
/// buffers and workspace take at least `check_from` bytes runs only when `available()` (the
/// memory the kernel can still give) covers them, else it fails naming its tensor. Large
/// buffers come straight from the OS (glibc maps anything over 32 MiB), so memory the process
/// freed earlier cannot serve them and the figure is the right one. The preflight before step 1
/// checks the whole plan against the same figure; this catches what changed since (another
/// process, a prediction that missed), where the kernel would otherwise kill the run without a
/// message.
#[derive(Clone, Copy, Debug)]
pub struct HostMemory {
    pub check_from: u64,
    pub available: fn() -> Option<u64>,
}

impl Default for HostMemory {
    fn default() -> Self {
        HostMemory { check_from: 64 << 20, available: crate::host::available_memory }
    }
}

impl<B: Backend> Executor<B> {
    pub fn new(program: Program, backend: B, budget: Option<u64>) -> Executor<B> {
        let n = program.graph.tensors.len();
        let mut members = vec![Vec::new(); n];
        for (t, root) in program.buffer_of.iter().enumerate() {
            members[root.index()].push(TensorId(t as u32));
        }
        let accountant = MemoryAccountant::new(backend.name(), budget);
        let lower = [
            MemoryAccountant::new(format!("{} host memory", backend.name()), None),
            MemoryAccountant::new(format!("{} NVMe", backend.name()), None),
        ];
        Executor {
            program,
            backend,
            values: vec![None; n],
            members,
            accountant,
            lower,
            timings: None,
            collectives: None,
            write_back: BTreeMap::new(),
            at: MeshPos::single(),
            host: HostMemory::default(),
            nvme: None,
            nvme_reads: Vec::new(),
            nvme_next: 0,
            nvme_charged: Default::default(),
        }
    }

    /// Keeps the Program's NVMe-tier buffers in files under `dir` (this rank's subdirectory).
    pub fn with_nvme_dir(mut self, dir: &std::path::Path, rank: usize) -> Result<Executor<B>> {
        let p = &self.program;
        let mut reads = Vec::new();
        for (i, instr) in p.instrs.iter().enumerate() {
            if let Instr::Run(n) = *instr {
                for &t in &p.graph.node(n).inputs {
                    if p.tier_of(t) == Tier::Nvme {
                        reads.push((i, p.buffer_of[t.index()]));
                    }
                }
            }
        }
        self.nvme_reads = reads;
        self.nvme = Some(crate::nvme::NvmeStore::new(dir, rank)?);
        Ok(self)
    }

    /// Whether the Program keeps buffers on the NVMe (and so needs [`Executor::with_nvme_dir`]).
    pub fn needs_nvme(&self) -> bool {
        self.program.tier.contains(&Tier::Nvme)
    }

    fn store(&mut self) -> Result<&mut crate::nvme::NvmeStore> {
        self.nvme.as_mut().ok_or_else(|| {
            RuntimeError::Binding(
                "the plan keeps optimizer state on the NVMe: give --offload-dir DIR (a \
                 directory on the NVMe) for its files"
                    .into(),
            )
        })
    }

    /// The value of a tensor between steps, on the host, also when it rests on the NVMe
    /// (read from its file).
    pub fn value(&self, t: TensorId) -> Result<Option<Tensor>> {
        if let Some(v) = self.values[t.index()].as_ref() {
            return Ok(Some(self.backend.download(v)?));
        }
        let root = self.program.buffer_of[t.index()];
        match self.nvme.as_ref() {
            Some(s) => s.read_now(root, self.program.graph.meta(t)),
            None => Ok(None),
        }
    }

    /// Bounds the host tier's accountant (offloaded state and copies) by `budget` bytes.
    pub fn with_host_budget(mut self, budget: Option<u64>) -> Executor<B> {
        self.lower[0] =
            MemoryAccountant::new(format!("{} host memory", self.backend.name()), budget);
        self
    }

    /// The accountant of `tier` (the device's is [`Executor::accountant`]).
    pub fn tier_accountant(&self, tier: Tier) -> &MemoryAccountant {
        match tier {
            Tier::Device => &self.accountant,
            Tier::Host => &self.lower[0],
            Tier::Nvme => &self.lower[1],
        }
    }

    fn tier_accountant_mut(&mut self, tier: Tier) -> &mut MemoryAccountant {
        match tier {
            Tier::Device => &mut self.accountant,
            Tier::Host => &mut self.lower[0],
            Tier::Nvme => &mut self.lower[1],
        }
    }

    /// Replaces the host-memory check ([`HostMemory`]).
    pub fn with_host_memory(mut self, host: HostMemory) -> Executor<B> {
        self.host = host;
        self
    }

    /// Runs `Reshard` nodes through `runner` (one device of a parallel plan, placed where the
    /// runner's mesh says).
    pub fn with_collectives(mut self, runner: Box<dyn ReshardRunner>) -> Executor<B> {
        self.at = runner.mesh().clone();
        self.collectives = Some(runner);
        self
    }

    /// The device's place in its mesh.
    pub fn at(&self) -> &MeshPos {
        &self.at
    }

    /// Places the device at `at` in its mesh without a communicator (its collectives are
    /// handed over later with [`Executor::put_collectives`]).
    pub fn at_position(mut self, at: MeshPos) -> Executor<B> {
        self.at = at;
        self
    }

    /// Takes the communicator back (to hand it to another Program of the same device).
    pub fn take_collectives(&mut self) -> Option<Box<dyn ReshardRunner>> {
        self.collectives.take()
    }

    /// Gives the executor a communicator taken from another one of the same device.
    pub fn put_collectives(&mut self, runner: Option<Box<dyn ReshardRunner>>) {
        self.collectives = runner;
    }

    pub fn collectives(&self) -> Option<&dyn ReshardRunner> {
        self.collectives.as_deref()
    }

    pub fn collectives_mut(&mut self) -> Option<&mut (dyn ReshardRunner + 'static)> {
        self.collectives.as_deref_mut()
    }

    /// When `produced` is computed, it becomes the value of leaf `leaf` (same meta).
    pub fn write_back(&mut self, produced: TensorId, leaf: TensorId) -> Result<()> {
        let g = &self.program.graph;
        if g.meta(produced) != g.meta(leaf) || !self.is_leaf(leaf) {
            return Err(RuntimeError::Binding(format!(
                "cannot write {} ({}) back into {} ({})",
                g.tensor_scope(produced),
                g.meta(produced),
                g.tensor_scope(leaf),
                g.meta(leaf)
            )));
        }
        self.write_back.insert(produced, leaf);
        Ok(())
    }

    pub fn program(&self) -> &Program {
        &self.program
    }
    pub fn backend(&self) -> &B {
        &self.backend
    }
    pub fn accountant(&self) -> &MemoryAccountant {
        &self.accountant
    }

    /// Starts (or stops) recording wall time per op kind.
    pub fn record_timings(&mut self, on: bool) {
        self.timings = on.then(BTreeMap::new);
    }

    /// Wall time per op kind since recording started.
    pub fn timings(&self) -> Option<&BTreeMap<&'static str, OpTime>> {
        self.timings.as_ref()
    }

    /// Binds a leaf (parameter, optimizer state or input) to a host tensor of exactly its
    /// meta (uploaded to the device). Rebinding replaces the previous value and its charge.
    pub fn bind(&mut self, t: TensorId, value: Tensor) -> Result<()> {
        let g = &self.program.graph;
        self.check_leaf(t)?;
        check_meta(&value, g.meta(t), g.tensor_scope(t))?;
        if self.program.tier_of(t) == Tier::Nvme {
            return self.bind_nvme(t, &value);
        }
        let v = self.backend.upload(&value)?;
        self.bind_value(t, v)
    }

    /// Binds a leaf to a value already on this device (shared with another executor of the
    /// same device: the generator's prefill and decode Programs share weights this way).
    pub fn bind_value(&mut self, t: TensorId, value: B::Value) -> Result<()> {
        let g = &self.program.graph;
        self.check_leaf(t)?;
        let (have, want) = (self.backend.meta(&value)?, g.meta(t));
        if !same_storage(&have, want) {
            return Err(RuntimeError::Binding(format!(
                "{}: expected {want}, got {have}",
                g.tensor_scope(t)
            )));
        }
        let tier = self.program.tier_of(t);
        if tier == Tier::Nvme {
            let host = self.backend.download(&value)?;
            return self.bind_nvme(t, &host);
        }
        let scope = g.tensor_scope(t).to_string();
        // Charged as stored (an i32 leaf is held widened).
        let bytes = have.size_bytes();
        if let Some(old) = self.values[t.index()].take() {
            let old = self.backend.meta(&old)?.size_bytes();
            self.tier_accountant_mut(tier).free(old);
        }
        self.tier_accountant_mut(tier).alloc(bytes, &scope, &scope)?;
        self.values[t.index()] = Some(value);
        Ok(())
    }

    fn check_leaf(&self, t: TensorId) -> Result<()> {
        let g = &self.program.graph;
        let node = g.producer(t);
        if !node.op.is_bound() {
            return Err(RuntimeError::Binding(format!(
                "{} is computed by a {} node; only leaves can be bound",
                g.tensor_scope(t),
                node.op.name()
            )));
        }
        Ok(())
    }

    /// A leaf resting on the NVMe: its file is written now and charged to the NVMe tier.
    fn bind_nvme(&mut self, t: TensorId, value: &Tensor) -> Result<()> {
        let g = &self.program.graph;
        let scope = g.tensor_scope(t).to_string();
        let bytes = g.meta(t).size_bytes();
        let was = self.nvme.as_ref().is_some_and(|s| s.holds(t));
        let store = self.store()?;
        store.write(t, value)?;
        store.flush()?;
        if was {
            self.lower[1].free(bytes);
        }
        self.lower[1].alloc(bytes, &scope, &scope)
    }

    /// The current value of a tensor on the device, if live.
    pub fn get(&self, t: TensorId) -> Option<&B::Value> {
        self.values[t.index()].as_ref()
    }

    /// The current value of a tensor copied to the host, if live.
    pub fn fetch(&self, t: TensorId) -> Result<Option<Tensor>> {
        self.values[t.index()].as_ref().map(|v| self.backend.download(v)).transpose()
    }

    /// Drops the step's outputs (loss, gradient norm) kept from the previous run.
    pub fn clear_outputs(&mut self) {
        for i in 0..self.program.outputs.len() {
            let t = self.program.outputs[i];
            let root = self.program.buffer_of[t.index()];
            if self.values[root.index()].is_some() && !self.is_leaf(root) {
                self.release(root);
            }
        }
    }

    fn is_leaf(&self, t: TensorId) -> bool {
        self.program.graph.producer(t).op.is_bound()
    }

    /// Drops every handle of buffer `root` and credits its bytes.
    fn release(&mut self, root: TensorId) {
        let bytes = self.program.graph.meta(root).size_bytes();
        let mut had = false;
        for &m in &self.members[root.index()] {
            had |= self.values[m.index()].take().is_some();
        }
        if self.nvme_charged.remove(&root) {
            // A freed NVMe buffer's file goes (a result written back is its state's by now).
            if let Some(s) = self.nvme.as_mut() {
                let _ = s.remove(root);
            }
            had = true;
        }
        if had {
            let tier = self.program.tier_of(root);
            self.tier_accountant_mut(tier).free(bytes);
        }
    }

    /// Executes the Program once. Every leaf in `program.live_in` must be bound.
    pub fn run(&mut self) -> Result<()> {
        self.clear_outputs();
        let g = &self.program.graph;
        for &t in &self.program.live_in {
            let on_nvme = self.nvme.as_ref().is_some_and(|s| s.holds(t));
            if self.values[t.index()].is_none() && !on_nvme {
                return Err(RuntimeError::Binding(format!(
                    "{} ({}) is not bound",
                    g.tensor_scope(t),
                    g.meta(t)
                )));
            }
        }
        self.accountant.reset_peak();
        for a in &mut self.lower {
            a.reset_peak();
        }
        let mut metas: Vec<TensorMeta> = Vec::new();
        self.nvme_next = 0;
        self.backend.run_started();
        for i in 0..self.program.instrs.len() {
            match self.program.instrs[i] {
                Instr::Run(n) => {
                    self.prefetch_nvme(i)?;
                    self.run_node(n, &mut metas)?
                }
                Instr::Free(t) => self.release(t),
            }
        }
        self.backend.run_finished();
        if let Some(s) = self.nvme.as_mut() {
            s.flush()?;
        }
        Ok(())
    }

    /// Starts the NVMe reads of the next [`NVME_PREFETCH`] instructions that need one, from
    /// instruction `at` on.
    fn prefetch_nvme(&mut self, at: usize) -> Result<()> {
        let Some(store) = self.nvme.as_mut() else { return Ok(()) };
        while self.nvme_next < self.nvme_reads.len() && self.nvme_reads[self.nvme_next].0 < at {
            self.nvme_next += 1;
        }
        for &(_, root) in self.nvme_reads.iter().skip(self.nvme_next).take(NVME_PREFETCH) {
            store.prefetch(root, self.program.graph.meta(root))?;
        }
        Ok(())
    }

    fn run_node(&mut self, n: tessera_ir::NodeId, metas: &mut Vec<TensorMeta>) -> Result<()> {
        let g = &self.program.graph;
        let node = g.node(n);
        let scope = g.scope_name(node.scope);
        // Charge fresh buffers and workspace before running, so a budget breach happens before
        // anything is allocated.
        let mut fresh = 0u64;
        for &o in &node.outputs {
            if self.program.buffer_of[o.index()] == o {
                fresh += g.meta(o).size_bytes();
            }
        }
        let in_metas: Vec<&TensorMeta> = node.inputs.iter().map(|&t| g.meta(t)).collect();
        let workspace = node.op.workspace_bytes(&in_metas);
        let what = node.op.name();
        // A node's fresh outputs and workspace live in its tier.
        let tier = node.tier;
        let acc = match tier {
            Tier::Device => &mut self.accountant,
            Tier::Host => &mut self.lower[0],
            Tier::Nvme => &mut self.lower[1],
        };
        acc.alloc(fresh, what, scope)?;
        acc.touch_workspace(workspace, what, scope)?;
        let need = fresh.saturating_add(workspace);
        if need >= self.host.check_from {
            if let Some(available) = (self.host.available)().filter(|&a| need > a) {
                let tensor = match node.outputs.first() {
                    Some(&o) => format!("{scope} {}", g.meta(o)),
                    None => scope.to_string(),
                };
                return Err(RuntimeError::OutOfHostMemory {
                    device: self.backend.name().to_string(),
                    tensor,
                    op: what.to_string(),
                    bytes: need,
                    available,
                });
            }
        }

        // NVMe-resident inputs come from their files (prefetched by now, as a rule).
        let mut from_disk: Vec<(usize, B::Value)> = Vec::new();
        for (k, &t) in node.inputs.iter().enumerate() {
            let root = self.program.buffer_of[t.index()];
            if let Some(s) = self.nvme.as_mut().filter(|s| s.holds(root)) {
                from_disk.push((k, self.backend.upload(&s.read(root, g.meta(t))?)?));
            }
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for (k, &t) in node.inputs.iter().enumerate() {
            if let Some((_, v)) = from_disk.iter().find(|(i, _)| *i == k) {
                inputs.push(v);
                continue;
            }
            inputs.push(self.values[t.index()].as_ref().ok_or_else(|| {
                RuntimeError::Binding(format!(
                    "{}: input {} of {} is not live (a Program bug)",
                    scope,
                    g.tensor_scope(t),
                    what
                ))
            })?);
        }
        metas.clear();
        metas.extend(node.outputs.iter().map(|&t| g.meta(t).clone()));
        let started = self.timings.is_some().then(Instant::now);
        // Collectives move host tensors (free on the CPU, where a value is its host tensor).
        let b = &self.backend;
        let outs = match (&node.op, self.collectives.as_mut()) {
            // A reshard whose forward moves nothing (Megatron's identity "f", whose backward
            // reduces) is a view of its input, as the Program declares: no copy through the
            // host, no second buffer on a device.
            (Op::Reshard(spec), _) if spec.is_view() => vec![inputs[0].clone()],
            (Op::Reshard(spec), Some(runner)) => {
                vec![b.upload(&runner.reshard(spec, &b.download(inputs[0])?)?)?]
            }
            (Op::Send(p), Some(runner)) => {
                runner.send(p, &b.download(inputs[0])?)?;
                let token = Tensor::zeros((), candle_core::DType::F32, &candle_core::Device::Cpu)?;
                vec![b.upload(&token)?]
            }
            (Op::Recv(p, meta), Some(runner)) => vec![b.upload(&runner.recv(p, meta)?)?],
            _ => b.execute(&node.op, &inputs, metas, &self.at)?,
        };
        if let (Some(t0), Some(timings)) = (started, self.timings.as_mut()) {
            let seconds = t0.elapsed().as_secs_f64();
            let x: Vec<&TensorMeta> = node.inputs.iter().map(|&t| g.meta(t)).collect();
            let flops = node.op.flops(&x, &metas.iter().collect::<Vec<_>>()).total();
            let e = timings.entry(what).or_default();
            e.calls += 1;
            e.seconds += seconds;
            e.flops += flops;
        }
        if outs.len() != node.outputs.len() {
            return Err(RuntimeError::Binding(format!(
                "{scope}: {what} returned {} outputs, expected {}",
                outs.len(),
                node.outputs.len()
            )));
        }
        for (k, (t, o)) in outs.into_iter().zip(node.outputs.clone()).enumerate() {
            let have = self.backend.meta(&t)?;
            if !same_storage(&have, g.meta(o)) {
                return Err(RuntimeError::Binding(format!(
                    "{scope}: output {k} of {what}: expected {}, got {have}",
                    g.meta(o)
                )));
            }
            if tier == Tier::Nvme {
                // Written out in the background; a write-back moves the file to its state.
                let leaf = self.write_back.get(&o).copied();
                let Some(store) = self.nvme.as_mut() else {
                    return Err(RuntimeError::Binding(
                        "the plan keeps optimizer state on the NVMe: give --offload-dir DIR".into(),
                    ));
                };
                store.write(o, &self.backend.download(&t)?)?;
                if let Some(leaf) = leaf {
                    store.rename(o, leaf)?;
                }
                self.nvme_charged.insert(o);
                continue;
            }
            if let Some(&leaf) = self.write_back.get(&o) {
                // The leaf's old storage goes; the accountant already charged both buffers as
                // the Program does (the produced one is freed by the next instruction).
                self.values[leaf.index()] = Some(t.clone());
            }
            self.values[o.index()] = Some(t);
        }
        Ok(())
    }
}

/// Whether a value of meta `have` can hold a tensor of meta `want`: the same shape, stored in
/// the same element type (i32 is stored widened to i64, bools as bytes).
fn same_storage(have: &TensorMeta, want: &TensorMeta) -> bool {
    have.shape == want.shape && candle_dtype(have.dtype) == candle_dtype(want.dtype)
}
