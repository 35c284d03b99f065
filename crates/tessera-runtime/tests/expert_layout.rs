//! MoE checkpoints one to one: the Hub's per-expert tensors (the tiny Qwen2-MoE that
//! `transformers`' `save_pretrained` wrote, the CLI's parity fixture) load into the model's
//! stacked expert parameters (`[E, f, d]`), and every writer — `save_checkpoint` and
//! `export_hf` — writes them back under the same names with the same bytes; reading the saved
//! checkpoint back (whole, and slice by slice as a resume under another plan does, an expert
//! split included) restacks them. A checkpoint missing an expert is refused by name.

use candle_core::{DType as CDType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use tessera_ir::DType;
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::checkpoint::{load_checkpoint, load_hf_weights, save_checkpoint, Manifest};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::dist_checkpoint::export_hf;
use tessera_runtime::hf_weights::HfWeights;
use tessera_runtime::mapped::MappedCheckpoint;
use tessera_runtime::LrSchedule;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-cli/tests/fixtures/hf_moe/qwen2_moe")
}

fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("expert-layout-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file's tensors by name, as (shape, raw bytes).
fn file_tensors(path: &std::path::Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect()
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims()
        && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn per_expert_checkpoints_load_stacked_and_save_back_one_to_one() {
    let dir = fixture();
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let graph = build(&cfg, &BuildOptions::new(1, 8, DType::F32)).unwrap().builder.graph;
    let name = |p| graph.tensor_scope(p).to_string();
    // The model holds each projection of a layer's experts as one stacked parameter.
    let stacked = "model.layers.0.mlp.experts.gate_proj.weight";
    let p = graph.parameters().into_iter().find(|&p| name(p) == stacked).expect(stacked);
    assert_eq!(graph.shape(p).dims(), &[4, 16, 32]);
    assert!(!graph.parameters().iter().any(|&p| name(p).contains(".experts.0.")));

    let loaded: HashMap<String, Tensor> =
        load_hf_weights(&dir, &graph).unwrap().into_iter().map(|(p, t)| (name(p), t)).collect();
    let hub = file_tensors(&dir.join("model.safetensors"));
    // Row e of the stacked parameter is expert e's tensor of the file.
    let row = loaded[stacked].get(3).unwrap();
    let (shape, bytes) = &hub["model.layers.0.mlp.experts.3.gate_proj.weight"];
    assert_eq!(row.dims(), shape.as_slice());
    let want: Vec<f32> =
        bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(row.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);

    // save_checkpoint writes the Hub's names and bytes back, one to one.
    let out = scratch("roundtrip").join("ckpt");
    let mut params: Vec<(String, Tensor)> =
        loaded.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let manifest = Manifest::new(0, 1, 0, "qwen2-moe", LrSchedule::Constant { lr: 1e-3 });
    save_checkpoint(&out, &cfg.to_hf_json(), &params, &[], &manifest).unwrap();
    assert_eq!(file_tensors(&out.join("model.safetensors")), hub);

    // Read back whole: stacked again, equal.
    let ckpt = load_checkpoint(&out).unwrap();
    assert_eq!(ckpt.params.len(), loaded.len());
    for (n, t) in &loaded {
        assert!(same(&ckpt.params[n], t), "{n} changed through save and load");
    }
    // Slice reads as a resume does: expert 2..4 of a 2-way expert split is rows 2..4.
    let mapped = MappedCheckpoint::open(&out).unwrap();
    let mesh = DeviceMesh::new(&[2], 1).unwrap();
    let half = mapped.params.shard(stacked, &vec![vec![0], vec![], vec![]], &mesh, CDType::F32);
    assert!(same(&half.unwrap(), &loaded[stacked].narrow(0, 2, 2).unwrap()));
    // The checkpoint directory loads as Hugging Face weights too (its own files).
    let again = HfWeights::open(&out, &graph).unwrap();
    assert!(same(&again.global(stacked, CDType::F32).unwrap(), &loaded[stacked]));

    // export_hf writes the Hub's layout as well.
    let exported = scratch("roundtrip").join("export");
    export_hf(&ckpt, &exported, false).unwrap();
    assert_eq!(file_tensors(&exported.join("model.safetensors")), hub);
}

#[test]
fn a_checkpoint_missing_an_expert_is_refused_by_name() {
    let dir = fixture();
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let graph = build(&cfg, &BuildOptions::new(1, 8, DType::F32)).unwrap().builder.graph;
    let tmp = scratch("missing");
    std::fs::copy(dir.join("config.json"), tmp.join("config.json")).unwrap();
    let gone = "model.layers.2.mlp.experts.1.up_proj.weight";
    let tensors: HashMap<String, Tensor> = file_tensors(&dir.join("model.safetensors"))
        .into_iter()
        .filter(|(n, _)| n != gone)
        .map(|(n, (shape, bytes))| {
            let t = Tensor::from_raw_buffer(&bytes, CDType::F32, &shape, &Device::Cpu).unwrap();
            (n, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, tmp.join("model.safetensors")).unwrap();
    let msg = HfWeights::open(&tmp, &graph).unwrap_err().to_string();
    assert!(msg.contains("missing from the checkpoint") && msg.contains(gone), "{msg}");
}
