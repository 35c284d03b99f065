//! Sharded checkpoints: every rank of a thread-simulated mesh saves its shards, the global
//! tensors come back bit-exact (any mesh shape, any placement, replicas written once), they
//! re-shard for another mesh, failed saves keep the previous checkpoint, damaged rank files
//! are named, `load_checkpoint` dispatches, and `export_hf` writes a loadable HF directory.

use candle_core::{DType as CDType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_comm::{run_on_threads, CommStats, Communicator, Group};
use tessera_ir::DType;
use tessera_models::{build, BuildOptions, Gpt2Params, ModelConfig};
use tessera_runtime::checkpoint::{load_checkpoint, load_hf_weights, Manifest};
use tessera_runtime::collective::{shard, DeviceMesh, Placement};
use tessera_runtime::dist_checkpoint::{
    export_hf, is_sharded, load_sharded, rank_file_name, read_sharded_manifest, save_sharded,
    TensorRole,
};
use tessera_runtime::{LrSchedule, RuntimeError};

// ---- helpers ---------------------------------------------------------------------------------

/// Global tensors with the placement each rank holds them under.
type State = Vec<(String, Tensor, Placement)>;

const TIMEOUT: Duration = Duration::from_secs(20);

fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dist-checkpoint-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn random_tensor(rng: &mut StdRng, dims: &[usize], dtype: CDType) -> Tensor {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// The raw bits of a tensor (bit-exact comparisons, any float dtype).
fn bits(t: &Tensor) -> (CDType, Vec<usize>, Vec<u64>) {
    let flat = t.flatten_all().unwrap();
    let words = match t.dtype() {
        CDType::F32 => flat.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits() as u64).collect(),
        CDType::BF16 => {
            flat.to_vec1::<half::bf16>().unwrap().iter().map(|x| x.to_bits() as u64).collect()
        }
        CDType::F16 => {
            flat.to_vec1::<half::f16>().unwrap().iter().map(|x| x.to_bits() as u64).collect()
        }
        CDType::F64 => flat.to_vec1::<f64>().unwrap().iter().map(|x| x.to_bits()).collect(),
        other => panic!("unexpected dtype {other:?}"),
    };
    (t.dtype(), t.dims().to_vec(), words)
}

/// A loaded manifest without the checksums its save added (checking they are there: every
/// file the checkpoint holds but the manifest itself).
fn without_checksums(m: &Manifest) -> Manifest {
    assert!(m.checksums.contains_key("config.json"), "{:?}", m.checksums.keys());
    assert!(
        m.checksums.keys().all(|k| k.ends_with(".safetensors") || k == "config.json"),
        "{:?}",
        m.checksums.keys()
    );
    let mut m = m.clone();
    m.checksums.clear();
    m
}

/// Makes `dir`'s manifest one written before checksums (none listed, no seal).
fn drop_checksums(dir: &Path) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let doc = m.as_object_mut().unwrap();
    assert!(doc.remove("checksums").is_some() && doc.remove("manifest_xxh3").is_some());
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

fn manifest(step: u64) -> Manifest {
    let schedule = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 10, total: 100 };
    let mut m = Manifest::new(step, 100, 1234, "gpt2-small-test", schedule);
    m.extra = serde_json::json!({ "data_offset": step * 4096 });
    m
}

/// A small GPT-2 (tied head, as GPT-2 is).
fn gpt2_small() -> ModelConfig {
    let p = Gpt2Params::new("gpt2-small-test", 64, 16, 32, 2, 4);
    ModelConfig::Gpt2(tessera_models::Gpt2Config::new(p).unwrap())
}

fn config_json() -> serde_json::Value {
    serde_json::json!({ "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "vocab_size": 64 })
}

fn layout() -> serde_json::Value {
    serde_json::json!({ "plan": "test", "mesh_axes": ["data", "model"], "cost": 1.5 })
}

/// Parameters of several dtypes and placements over a 2-axis mesh, with optimizer-like
/// state placed differently from its parameter (ZeRO style).
fn state_2d(seed: u64) -> State {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = |dims: &[usize], dtype| random_tensor(&mut rng, dims, dtype);
    vec![
        ("transformer.wte.weight".into(), t(&[8, 6], CDType::F32), vec![vec![0], vec![]]),
        ("transformer.wte.weight.adam_m".into(), t(&[8, 6], CDType::F32), vec![vec![0, 1], vec![]]),
        ("transformer.wte.weight.adam_v".into(), t(&[8, 6], CDType::F32), vec![vec![], vec![]]),
        (
            "transformer.h.0.attn.c_attn.weight".into(),
            t(&[4, 8], CDType::BF16),
            vec![vec![], vec![1]],
        ),
        (
            "transformer.h.0.attn.c_attn.weight.master".into(),
            t(&[4, 8], CDType::F32),
            vec![vec![1], vec![0]],
        ),
        (
            "transformer.h.0.mlp.c_fc.weight".into(),
            t(&[8, 4], CDType::F32),
            vec![vec![0, 1], vec![]],
        ),
        (
            "transformer.h.0.mlp.c_proj.weight".into(),
            t(&[4, 8], CDType::F16),
            vec![vec![1], vec![0]],
        ),
        (
            "transformer.h.0.mlp.c_proj.weight.adam_m".into(),
            t(&[4, 8], CDType::F32),
            vec![vec![], vec![0, 1]],
        ),
        ("transformer.ln_f.weight".into(), t(&[6], CDType::F32), vec![vec![]]),
        ("transformer.table".into(), t(&[3, 5], CDType::F64), vec![vec![], vec![]]),
    ]
}

/// The same kinds of tensors for a 1-axis mesh of `n` devices.
fn state_1d(seed: u64) -> State {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = |dims: &[usize], dtype| random_tensor(&mut rng, dims, dtype);
    vec![
        ("a.weight".into(), t(&[8, 4], CDType::F32), vec![vec![0], vec![]]),
        ("a.weight.adam_m".into(), t(&[8, 4], CDType::F32), vec![vec![], vec![0]]),
        ("a.weight.adam_v".into(), t(&[8, 4], CDType::F32), vec![vec![], vec![]]),
        ("b.weight".into(), t(&[4, 12], CDType::BF16), vec![vec![], vec![0]]),
        ("b.weight.master".into(), t(&[4, 12], CDType::F32), vec![vec![0], vec![]]),
        ("c.bias".into(), t(&[12], CDType::F16), vec![vec![0]]),
        ("d.scale".into(), t(&[5], CDType::F64), vec![vec![]]),
        ("e.gate".into(), t(&[], CDType::F32), vec![]),
    ]
}

/// This rank's `(name, local shard, placement)`, as `SpmdTrainer::local_state` gives them.
fn local_state(mesh: &DeviceMesh, state: &State) -> State {
    state.iter().map(|(n, g, p)| (n.clone(), shard(mesh, g, p, n).unwrap(), p.clone())).collect()
}

/// One rank's save; errors as text (they cross threads and are compared as text).
fn save_rank(
    dir: &Path,
    shape: &[usize],
    state: &State,
    comm: &mut dyn Communicator,
    step: u64,
) -> Result<(), String> {
    let mesh = DeviceMesh::new(shape, comm.rank()).map_err(|e| e.to_string())?;
    let local = local_state(&mesh, state);
    save_sharded(dir, &mesh, &local, comm, &config_json(), &manifest(step), layout())
        .map_err(|e| e.to_string())
}

/// Every rank of a `shape` mesh saves `state`; returns each rank's outcome.
fn save_all(dir: &Path, shape: &[usize], state: &State, step: u64) -> Vec<Result<(), String>> {
    let n = shape.iter().product();
    run_on_threads(n, TIMEOUT, |comm| Ok(save_rank(dir, shape, state, comm, step)))
        .into_iter()
        .map(|r| r.map_err(|e| e.to_string()).and_then(|inner| inner))
        .collect()
}

fn save_ok(dir: &Path, shape: &[usize], state: &State, step: u64) {
    for (rank, r) in save_all(dir, shape, state, step).into_iter().enumerate() {
        if let Err(e) = r {
            panic!("rank {rank} failed to save: {e}");
        }
    }
}

/// The loaded checkpoint holds exactly `state`'s global tensors, bit for bit, parameters and
/// optimizer state each in their map.
fn assert_global(ck: &tessera_runtime::checkpoint::Checkpoint, state: &State) {
    assert_eq!(ck.params.len() + ck.optimizer.len(), state.len(), "tensor count");
    for (name, want, _) in state {
        let is_opt = [".adam_m", ".adam_v", ".master"].iter().any(|s| name.ends_with(s));
        let map = if is_opt { &ck.optimizer } else { &ck.params };
        let got = map.get(name).unwrap_or_else(|| panic!("{name} missing (optimizer: {is_opt})"));
        assert!(bits(got) == bits(want), "{name} differs");
    }
}

fn error_text<T: std::fmt::Debug>(r: Result<T, RuntimeError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn rank_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join("shards").join(rank_file_name(rank))
}

/// Tensor names in a rank file, sorted.
fn names_in(path: &Path) -> Vec<String> {
    let map = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let mut names: Vec<String> = map.into_keys().collect();
    names.sort();
    names
}

// ---- round trips ---------------------------------------------------------------------------------

#[test]
fn round_trip_on_a_2x2_mesh_is_bit_exact() {
    let root = scratch("round-trip-2x2");
    let dir = root.join("ckpt");
    let state = state_2d(1);
    save_ok(&dir, &[2, 2], &state, 10);
    assert_eq!(entries(&root), ["ckpt"], "no temporary directory left behind");
    assert_eq!(entries(&dir), ["config.json", "manifest.json", "shards"]);
    let ck = load_sharded(&dir).unwrap();
    assert_eq!(without_checksums(&ck.manifest), manifest(10));
    assert_eq!(ck.config_json["model_type"], "gpt2");
    assert_eq!(ck.dir, dir);
    assert_global(&ck, &state);

    let (m, section) = read_sharded_manifest(&dir).unwrap();
    assert_eq!(without_checksums(&m), manifest(10));
    assert_eq!(section.mesh, [2, 2]);
    assert_eq!(section.world_size, 4);
    assert_eq!(section.layout, layout(), "the layout is stored verbatim");
    let wte = section.tensors.iter().find(|t| t.name == "transformer.wte.weight").unwrap();
    assert_eq!(wte.shape, [8, 6]);
    assert_eq!(wte.dtype, "f32");
    assert_eq!(wte.role, TensorRole::Param);
    let holders: Vec<(Vec<usize>, usize)> =
        wte.chunks.iter().map(|c| (c.index.clone(), c.rank)).collect();
    assert_eq!(holders, [(vec![0, 0], 0), (vec![1, 0], 2)], "dim 0 split over axis 0");
    let master = section
        .tensors
        .iter()
        .find(|t| t.name == "transformer.h.0.attn.c_attn.weight.master")
        .unwrap();
    assert_eq!(master.role, TensorRole::Optimizer);
    assert_eq!(master.chunks.len(), 4);
}

#[test]
fn round_trip_on_a_line_of_4_and_of_2() {
    for (shape, test) in [(vec![4], "round-trip-4"), (vec![2], "round-trip-2")] {
        let root = scratch(test);
        let dir = root.join("ckpt");
        let state = state_1d(7);
        save_ok(&dir, &shape, &state, 3);
        let ck = load_sharded(&dir).unwrap();
        assert_global(&ck, &state);
        assert_eq!(entries(&dir.join("shards")).len(), shape[0], "one file per rank");
    }
}

#[test]
fn saving_again_replaces_the_checkpoint() {
    let root = scratch("save-again");
    let dir = root.join("ckpt");
    save_ok(&dir, &[2, 2], &state_2d(1), 10);
    // A different mesh for the next save: the old rank files must not survive.
    let state = state_1d(2);
    save_ok(&dir, &[2], &state, 20);
    assert_eq!(entries(&root), ["ckpt"]);
    assert_eq!(entries(&dir.join("shards")), [rank_file_name(0), rank_file_name(1)]);
    let ck = load_sharded(&dir).unwrap();
    assert_eq!(ck.manifest.step, 20);
    assert_global(&ck, &state);
}

// ---- replicas and re-sharding -----------------------------------------------------------------

#[test]
fn replicas_are_written_once() {
    let root = scratch("replicas");
    let dir = root.join("ckpt");
    save_ok(&dir, &[2, 2], &state_2d(3), 1);
    // Mesh [2, 2]: rank = 2·c0 + c1. A rank writes a tensor when its coordinate is 0 on
    // every axis the placement does not split.
    let all = [
        "transformer.h.0.attn.c_attn.weight.master", // [[1],[0]]
        "transformer.h.0.mlp.c_fc.weight",           // [[0,1],[]]
        "transformer.h.0.mlp.c_proj.weight",         // [[1],[0]]
        "transformer.h.0.mlp.c_proj.weight.adam_m",  // [[],[0,1]]
        "transformer.wte.weight.adam_m",             // [[0,1],[]]
    ];
    let axis0 = ["transformer.wte.weight"]; // [[0],[]]: c1 = 0
    let axis1 = ["transformer.h.0.attn.c_attn.weight"]; // [[],[1]]: c0 = 0
    let once = ["transformer.ln_f.weight", "transformer.table", "transformer.wte.weight.adam_v"];
    let sorted = |v: Vec<&str>| {
        let mut v: Vec<String> = v.into_iter().map(String::from).collect();
        v.sort();
        v
    };
    let expected = [
        sorted([&all[..], &axis0, &axis1, &once].concat()),
        sorted([&all[..], &axis1].concat()),
        sorted([&all[..], &axis0].concat()),
        sorted(all.to_vec()),
    ];
    for (rank, want) in expected.iter().enumerate() {
        assert_eq!(&names_in(&rank_file(&dir, rank)), want, "rank {rank}");
    }
    let stored: usize = (0..4).map(|r| names_in(&rank_file(&dir, r)).len()).sum();
    let section = read_sharded_manifest(&dir).unwrap().1;
    let chunks: usize = section.tensors.iter().map(|t| t.chunks.len()).sum();
    assert_eq!(stored, chunks, "every chunk stored exactly once");
    assert_eq!(stored, 5 * 4 + 2 + 2 + 3);
}

#[test]
fn a_2x2_checkpoint_reshards_for_a_mesh_of_2() {
    let root = scratch("reshard");
    let dir = root.join("ckpt");
    let state = state_2d(5);
    save_ok(&dir, &[2, 2], &state, 4);
    let ck = load_sharded(&dir).unwrap();
    // The new plan splits every tensor's dim 0 over the 2 devices.
    for rank in 0..2 {
        let mesh = DeviceMesh::new(&[2], rank).unwrap();
        for (name, global, _) in &state {
            let loaded = ck.params.get(name).or_else(|| ck.optimizer.get(name)).unwrap();
            let mut placement: Placement = vec![vec![]; global.rank()];
            placement[0] = vec![0];
            if global.dims()[0] % 2 != 0 {
                placement[0].clear();
            }
            let got = shard(&mesh, loaded, &placement, name).unwrap();
            let len = if placement[0].is_empty() { global.dims()[0] } else { global.dims()[0] / 2 };
            let start = if placement[0].is_empty() { 0 } else { rank * len };
            let want = global.narrow(0, start, len).unwrap();
            assert!(bits(&got) == bits(&want), "{name} on rank {rank}");
        }
    }
}

// ---- failures --------------------------------------------------------------------------------------

/// A communicator that, once the save's temporary `shards` directory exists, puts a non-empty
/// directory where its rank's file must be renamed to: that rank's write fails with a real
/// I/O error in the middle of the save.
struct Obstructed<'a> {
    inner: &'a mut dyn Communicator,
    shards: PathBuf,
    done: bool,
}

impl Obstructed<'_> {
    fn obstruct(&mut self) {
        if !self.done && self.shards.is_dir() {
            let obstacle = self.shards.join(rank_file_name(self.inner.rank())).join("in-the-way");
            std::fs::create_dir_all(obstacle).unwrap();
            self.done = true;
        }
    }
}

impl Communicator for Obstructed<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.inner.all_reduce_sum(g, d)
    }
    fn all_gather(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        let r = self.inner.all_gather(g, d);
        self.obstruct();
        r
    }
    fn reduce_scatter_sum(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.inner.reduce_scatter_sum(g, d)
    }
    fn all_to_all(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.inner.all_to_all(g, d)
    }
    fn broadcast(&mut self, g: &Group, root: usize, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.inner.broadcast(g, root, d)
    }
    fn send(&mut self, to: usize, d: &[f32]) -> tessera_comm::Result<()> {
        self.inner.send(to, d)
    }
    fn recv(&mut self, from: usize) -> tessera_comm::Result<Vec<f32>> {
        self.inner.recv(from)
    }
    fn barrier(&mut self, g: &Group) -> tessera_comm::Result<()> {
        let r = self.inner.barrier(g);
        self.obstruct();
        r
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}

#[test]
fn a_save_failing_on_one_rank_fails_everywhere_and_keeps_the_previous_checkpoint() {
    let root = scratch("failing-rank");
    let dir = root.join("ckpt");
    let state = state_2d(1);
    save_ok(&dir, &[2, 2], &state, 10);

    let shards = root.join("ckpt.tmp-20").join("shards");
    let outcomes: Vec<Result<(), String>> = run_on_threads(4, TIMEOUT, |comm| {
        if comm.rank() == 1 {
            let mut bad = Obstructed { inner: comm, shards: shards.clone(), done: false };
            Ok(save_rank(&dir, &[2, 2], &state_2d(2), &mut bad, 20))
        } else {
            Ok(save_rank(&dir, &[2, 2], &state_2d(2), comm, 20))
        }
    })
    .into_iter()
    .map(|r| r.map_err(|e| e.to_string()).and_then(|x| x))
    .collect();
    assert_eq!(outcomes.len(), 4);
    for (rank, r) in outcomes.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank reports the failure");
        if rank == 1 {
            assert!(e.contains("rank-00001.safetensors"), "rank 1 names its file: {e}");
        } else {
            assert!(e.contains("rank(s) 1"), "rank {rank} names the failed rank: {e}");
        }
    }
    assert_eq!(entries(&root), ["ckpt"], "rank 0 removed the temporary directory");
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.manifest.step, 10);
    assert_global(&ck, &state);
}

#[test]
fn a_rank_that_dies_does_not_hang_the_others() {
    let root = scratch("dead-rank");
    let dir = root.join("ckpt");
    let state = state_1d(1);
    save_ok(&dir, &[4], &state, 10);
    let started = std::time::Instant::now();
    let outcomes = run_on_threads(4, TIMEOUT, |comm| {
        if comm.rank() == 2 {
            // Gone before the save: its communicator is dropped.
            return Ok(Err("rank 2 died".to_string()));
        }
        Ok(save_rank(&dir, &[4], &state_1d(2), comm, 20))
    });
    for (rank, r) in outcomes.into_iter().enumerate() {
        let inner = r.unwrap();
        assert!(inner.is_err(), "rank {rank} must fail");
    }
    assert!(started.elapsed() < TIMEOUT, "the departure is noticed before the timeout");
    let ck = load_sharded(&dir).unwrap();
    assert_eq!(ck.manifest.step, 10);
    assert_global(&ck, &state);
}

#[test]
fn ranks_that_disagree_on_the_step_or_tensors_save_nothing() {
    let root = scratch("disagree");
    let dir = root.join("ckpt");
    let state = state_1d(1);
    save_ok(&dir, &[2], &state, 10);
    let outcomes = run_on_threads(2, TIMEOUT, |comm| {
        let step = if comm.rank() == 1 { 21 } else { 20 };
        Ok(save_rank(&dir, &[2], &state_1d(2), comm, step))
    });
    for r in outcomes {
        let e = r.unwrap().unwrap_err();
        assert!(e.contains("disagree with rank 0"), "{e}");
    }
    // A rank whose placement is invalid fails the save on every rank.
    let outcomes = run_on_threads(2, TIMEOUT, |comm| {
        let mut s = state_1d(2);
        if comm.rank() == 1 {
            s[0].2 = vec![vec![0], vec![0]];
        }
        let mesh = DeviceMesh::new(&[2], comm.rank()).unwrap();
        let local: State = s
            .iter()
            .map(|(n, g, p)| {
                // The bad placement cannot shard; pass the whole tensor.
                let t = shard(&mesh, g, p, n).unwrap_or_else(|_| g.clone());
                (n.clone(), t, p.clone())
            })
            .collect();
        Ok(save_sharded(&dir, &mesh, &local, comm, &config_json(), &manifest(20), layout())
            .map_err(|e| e.to_string()))
    });
    let errors: Vec<String> = outcomes.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(errors[0].contains("rank(s) 1"), "{}", errors[0]);
    assert!(errors[1].contains("a.weight") && errors[1].contains("splits more than one dim"));
    assert_eq!(entries(&root), ["ckpt"]);
    assert_eq!(load_sharded(&dir).unwrap().manifest.step, 10);
}

#[test]
fn saving_over_a_directory_that_is_not_a_checkpoint_is_refused_on_every_rank() {
    let root = scratch("foreign");
    let dir = root.join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    for r in save_all(&dir, &[2], &state_1d(1), 1) {
        assert!(r.is_err());
    }
    assert_eq!(entries(&dir), ["notes.txt"]);
    assert_eq!(entries(&root), ["ckpt"]);
}

// ---- damaged checkpoints -------------------------------------------------------------------------

#[test]
fn a_missing_rank_file_is_named() {
    let root = scratch("missing-rank-file");
    let dir = root.join("ckpt");
    save_ok(&dir, &[2, 2], &state_2d(1), 10);
    std::fs::remove_file(rank_file(&dir, 2)).unwrap();
    let e = error_text(load_sharded(&dir));
    assert!(e.contains("rank-00002.safetensors") && e.contains("missing"), "{e}");
    assert!(e.contains("transformer."), "names a tensor it held: {e}");
}

#[test]
fn a_corrupt_rank_file_is_named() {
    let root = scratch("corrupt-rank-file");
    let dir = root.join("ckpt");
    save_ok(&dir, &[2, 2], &state_2d(1), 10);
    let path = rank_file(&dir, 3);
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 7]).unwrap();
    let e = error_text(load_checkpoint(&dir));
    assert!(e.contains("rank-00003.safetensors") && e.contains("corrupt or truncated"), "{e}");
}

#[test]
fn a_rank_file_missing_a_tensor_or_with_a_wrong_shape_is_named() {
    let root = scratch("rank-file-contents");
    let dir = root.join("ckpt");
    save_ok(&dir, &[2, 2], &state_2d(1), 10);
    let path = rank_file(&dir, 1);
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let full = tensors.clone();
    let gone = "transformer.h.0.attn.c_attn.weight";
    tensors.remove(gone).unwrap();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    // The checksums see a replaced file first ...
    let e = error_text(load_sharded(&dir));
    assert!(e.contains("rank-00001.safetensors") && e.contains("was replaced"), "{e}");
    // ... and without them (a checkpoint from before checksums) the contents are checked.
    drop_checksums(&dir);
    let e = error_text(load_sharded(&dir));
    assert!(
        e.contains("rank-00001.safetensors") && e.contains(gone) && e.contains("missing"),
        "{e}"
    );

    let mut tensors = full;
    tensors.insert(gone.to_string(), Tensor::zeros((4, 5), CDType::BF16, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let e = error_text(load_sharded(&dir));
    assert!(e.contains("rank-00001.safetensors") && e.contains(gone) && e.contains("shape"), "{e}");

    // A file of another rank under this rank's name.
    std::fs::copy(rank_file(&dir, 0), &path).unwrap();
    let e = error_text(load_sharded(&dir));
    assert!(e.contains("rank-00001.safetensors") && e.contains("rank"), "{e}");
}

// ---- load_checkpoint dispatch -----------------------------------------------------------------

#[test]
fn load_checkpoint_dispatches_to_sharded_checkpoints_and_recovers_them() {
    let root = scratch("dispatch");
    let dir = root.join("ckpt");
    let state = state_2d(9);
    save_ok(&dir, &[2, 2], &state, 12);
    assert!(is_sharded(&dir));
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(without_checksums(&ck.manifest), manifest(12));
    assert_global(&ck, &state);

    // A save killed between its renames: DIR is missing, DIR.old-<pid> holds the checkpoint.
    std::fs::rename(&dir, root.join("ckpt.old-4242")).unwrap();
    std::fs::create_dir(root.join("ckpt.tmp-13")).unwrap();
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.dir, dir);
    assert_global(&ck, &state);
    assert_eq!(entries(&root), ["ckpt", "ckpt.tmp-13"]);
    std::fs::rename(&dir, root.join("ckpt.old-4243")).unwrap();
    assert_global(&load_sharded(&dir).unwrap(), &state);

    // The next save clears the leftovers.
    save_ok(&dir, &[2, 2], &state, 13);
    assert_eq!(entries(&root), ["ckpt"]);
}

#[test]
fn a_single_device_checkpoint_is_not_sharded() {
    let root = scratch("single");
    let dir = root.join("ckpt");
    let params = vec![("w".to_string(), Tensor::ones((2, 2), CDType::F32, &Device::Cpu).unwrap())];
    tessera_runtime::checkpoint::save_checkpoint(&dir, &config_json(), &params, &[], &manifest(1))
        .unwrap();
    assert!(!is_sharded(&dir));
    assert_eq!(load_checkpoint(&dir).unwrap().params.len(), 1);
    let e = error_text(load_sharded(&dir));
    assert!(e.contains("single-device checkpoint"), "{e}");
}

// ---- export ------------------------------------------------------------------------------------------

#[test]
fn export_hf_writes_config_and_global_weights_that_load_into_the_model() {
    let root = scratch("export");
    let dir = root.join("ckpt");
    let cfg = gpt2_small();
    let graph = build(&cfg, &BuildOptions::new(1, 8, DType::F32)).unwrap().builder.graph;
    let mut rng = StdRng::seed_from_u64(3);
    let mut state: State = Vec::new();
    for p in graph.parameters() {
        let dims = graph.shape(p).dims().to_vec();
        let name = graph.tensor_scope(p).to_string();
        let value = random_tensor(&mut rng, &dims, CDType::F32);
        let placement: Placement = match dims.len() {
            2 => vec![vec![0], vec![1]],
            1 => vec![vec![1]],
            _ => vec![vec![]; dims.len()],
        };
        let m = random_tensor(&mut rng, &dims, CDType::F32);
        state.push((format!("{name}.adam_m"), m, vec![vec![]; dims.len()]));
        state.push((name, value, placement));
    }
    let n = 4;
    let outcomes = run_on_threads(n, TIMEOUT, |comm| {
        let mesh = DeviceMesh::new(&[2, 2], comm.rank()).unwrap();
        let local = local_state(&mesh, &state);
        Ok(save_sharded(&dir, &mesh, &local, comm, &cfg.to_hf_json(), &manifest(5), layout())
            .map_err(|e| e.to_string()))
    });
    for r in outcomes {
        r.unwrap().unwrap();
    }
    let ck = load_checkpoint(&dir).unwrap();
    let out = root.join("hf");
    export_hf(&ck, &out, false).unwrap();
    assert_eq!(entries(&out), ["config.json", "model.safetensors", "tessera-export.json"]);
    assert_eq!(entries(&root), ["ckpt", "hf"]);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "float32");
    assert_eq!(config["model_type"], cfg.to_hf_json()["model_type"]);
    let stored =
        candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let params: BTreeMap<&String, &Tensor> =
        state.iter().filter(|(n, _, _)| !n.ends_with(".adam_m")).map(|(n, t, _)| (n, t)).collect();
    assert_eq!(stored.len(), params.len(), "parameters only, each once");
    for (name, want) in &params {
        assert!(bits(&stored[*name]) == bits(want), "{name}");
    }
    // The weights load into the model by their HF names (what from_pretrained relies on).
    let loaded = load_hf_weights(&out, &graph).unwrap();
    let by_name: HashMap<&str, &Tensor> =
        loaded.iter().map(|(p, t)| (graph.tensor_scope(*p), t)).collect();
    for (name, want) in &params {
        assert!(bits(by_name[name.as_str()]) == bits(want), "{name}");
    }

    // Exporting again replaces the previous export.
    export_hf(&ck, &out, false).unwrap();
    assert_eq!(entries(&root), ["ckpt", "hf"]);
    // Another directory is not replaced, --force or not.
    let foreign = root.join("mine");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("tokenizer.json"), "{}").unwrap();
    for force in [false, true] {
        let e = error_text(export_hf(&ck, &foreign, force));
        assert!(e.contains("mine") && e.contains("files an export did not write"), "{e}");
        assert!(e.contains("tokenizer.json") && e.contains("--force never"), "{e}");
        assert_eq!(entries(&foreign), ["tokenizer.json"]);
    }
    // Nor is a checkpoint (issue 17: `export --checkpoint ck --hf ck` destroyed ck; issue 43:
    // so did --force, and --hf naming a directory above it): not the one being exported, not
    // a directory holding it, not another one, whatever `replace` says.
    for force in [false, true] {
        let e = error_text(export_hf(&ck, &dir, force));
        assert!(e.contains("the checkpoint being exported") && e.contains("--force"), "{e}");
        let e = error_text(export_hf(&ck, &root, force));
        assert!(e.contains("holds the checkpoint being exported"), "{e}");
        let other = root.join("other-ck");
        std::fs::create_dir_all(other.join("shards")).unwrap();
        std::fs::write(other.join("manifest.json"), "{}").unwrap();
        let e = error_text(export_hf(&ck, &other, force));
        assert!(e.contains("is a Tessera checkpoint") && e.contains("--force never"), "{e}");
        assert_eq!(entries(&other), ["manifest.json", "shards"]);
    }
    assert_eq!(entries(&dir), ["config.json", "manifest.json", "shards"]);
    assert!(load_checkpoint(&dir).is_ok(), "the checkpoint is intact");
    // An unmarked export (an older Tessera's, save_pretrained's) is replaced with --force only.
    let unmarked = root.join("unmarked");
    std::fs::create_dir(&unmarked).unwrap();
    std::fs::copy(out.join("config.json"), unmarked.join("config.json")).unwrap();
    let e = error_text(export_hf(&ck, &unmarked, false));
    assert!(e.contains("tessera-export.json") && e.contains("pass --force"), "{e}");
    export_hf(&ck, &unmarked, true).unwrap();
    assert_eq!(entries(&unmarked), ["config.json", "model.safetensors", "tessera-export.json"]);
}

/// A checkpoint opened for slice reads gives every device of another mesh exactly its shard
/// of the saved global tensors, bit for bit and in any dtype, for a sharded checkpoint (saved
/// on a 2×2 mesh, read on a line of 4 and on 2×2 under other placements) and for the
/// single-device one; nothing reads a whole tensor but a device whose shard it is.
#[test]
fn mapped_checkpoints_give_each_device_its_shard_of_the_saved_tensors() {
    use tessera_runtime::checkpoint::save_checkpoint;
    use tessera_runtime::mapped::MappedCheckpoint;
    let root = scratch("mapped");
    let sharded = root.join("sharded");
    let state = state_2d(7);
    save_ok(&sharded, &[2, 2], &state, 3);
    let single = root.join("single");
    let (params, optimizer): (Vec<_>, Vec<_>) = state
        .iter()
        .map(|(n, t, _)| (n.clone(), t.clone()))
        .partition(|(n, _)| ![".adam_m", ".adam_v", ".master"].iter().any(|s| n.ends_with(s)));
    save_checkpoint(&single, &config_json(), &params, &optimizer, &manifest(3)).unwrap();
    for dir in [&sharded, &single] {
        let ck = MappedCheckpoint::open(dir).unwrap();
        assert_eq!(without_checksums(&ck.manifest), manifest(3));
        for (name, global, _) in &state {
            let is_opt = [".adam_m", ".adam_v", ".master"].iter().any(|s| name.ends_with(s));
            let source = if is_opt { &ck.optimizer } else { &ck.params };
            let rank = global.dims().len();
            let mut placements: Vec<Vec<Vec<usize>>> = vec![vec![vec![]; rank]];
            if rank >= 1 && global.dims()[0] % 4 == 0 {
                let mut p = vec![vec![]; rank];
                p[0] = vec![0, 1];
                placements.push(p);
            }
            if rank == 2 && global.dims()[0] % 2 == 0 && global.dims()[1] % 2 == 0 {
                placements.push(vec![vec![1], vec![0]]);
            }
            for placement in &placements {
                for r in 0..4 {
                    let mesh = DeviceMesh::new(&[2, 2], r).unwrap();
                    let want = shard(&mesh, global, placement, name).unwrap();
                    let got = source.shard(name, placement, &mesh, global.dtype()).unwrap();
                    assert!(
                        bits(&got) == bits(&want),
                        "{name} {placement:?} rank {r} ({})",
                        dir.display()
                    );
                    let f32 = source.shard(name, placement, &mesh, CDType::F32).unwrap();
                    assert!(
                        bits(&f32) == bits(&want.to_dtype(CDType::F32).unwrap()),
                        "{name} as f32"
                    );
                }
            }
        }
    }
    // A rank file of another step is refused, naming it.
    let other = root.join("other");
    save_ok(&other, &[2, 2], &state, 4);
    std::fs::copy(rank_file(&other, 1), rank_file(&sharded, 1)).unwrap();
    let msg = MappedCheckpoint::open(&sharded).unwrap_err().to_string();
    assert!(msg.contains("rank-00001") && msg.contains("checksum mismatch in its header"), "{msg}");
    drop_checksums(&sharded);
    let msg = MappedCheckpoint::open(&sharded).unwrap_err().to_string();
    assert!(msg.contains("rank-00001") && msg.contains("step 4"), "{msg}");
}
