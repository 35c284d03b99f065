//! Fuzzing the safetensors readers (issue 17, item 7): files whose 8-byte header length, JSON
//! header and data are corrupt in every way we could think of — wrong and huge lengths,
//! offsets out of range, overlapping or reversed, unknown dtypes, shapes whose element count
//! overflows or disagrees with the bytes, bad metadata, truncated or padded files — are
//! opened and read through every public reader: `MappedCheckpoint::open` (+ `read` of every
//! tensor), `load_checkpoint`, `HfWeights::open` (+ `global` of every parameter) and
//! `load_hf_weights`. Each must give a value or an error with a message, never a panic, and
//! what it gives must have the shapes the header states.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use tessera_ir::{DType, Graph};
use tessera_models::{build, BuildOptions, Gpt2Config, Gpt2Params, ModelConfig};
use tessera_runtime::checkpoint::{load_checkpoint, load_hf_weights, Manifest};
use tessera_runtime::hf_weights::{open_weights, HfWeights};
use tessera_runtime::mapped::MappedCheckpoint;
use tessera_runtime::LrSchedule;

/// `cases` cases, and no regression files: the failures found so far are the deterministic
/// tests at the end, and a failing run would otherwise leave a file in the source tree.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- the model whose parameter names and shapes the files use --------------------------------

fn graph() -> &'static Graph {
    static GRAPH: OnceLock<Graph> = OnceLock::new();
    GRAPH.get_or_init(|| {
        let p = Gpt2Params::new("fuzz-gpt2", 16, 8, 8, 1, 2);
        let cfg = ModelConfig::Gpt2(Gpt2Config::new(p).unwrap());
        build(&cfg, &BuildOptions::new(1, 4, DType::F32)).unwrap().builder.finish()
    })
}

/// `(name, shape)` of every parameter.
fn params() -> Vec<(String, Vec<u64>)> {
    let g = graph();
    g.parameters()
        .into_iter()
        .map(|p| {
            (g.tensor_scope(p).to_string(), g.shape(p).dims().iter().map(|&d| d as u64).collect())
        })
        .collect()
}

// ---- file descriptions -----------------------------------------------------------------------

/// Bytes per element of a safetensors dtype name (bits / 8, rounded up); 4 for unknown names.
fn dtype_bytes(d: &str) -> u64 {
    match d {
        "F64" | "I64" | "U64" | "C64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F8_E4M3" | "F8_E5M2" | "U8" | "I8" | "BOOL" | "F8_E8M0" | "F4" | "F6_E2M3" => 1,
        _ => 4,
    }
}

#[derive(Clone, Debug)]
enum Offsets {
    /// Back to back, as a writer lays them out.
    Packed,
    /// Packed, then `begin`/`end` moved by these deltas (overlaps, gaps, reversals).
    Shifted(i64, i64),
    /// Any JSON for `data_offsets`.
    Raw(Value),
}

#[derive(Clone, Debug)]
struct TensorDesc {
    name: String,
    /// A dtype name, or any JSON.
    dtype: Value,
    /// Dims, or any JSON.
    shape: Value,
    offsets: Offsets,
}

#[derive(Clone, Debug)]
enum HeaderLen {
    Exact,
    Delta(i64),
    Raw(u64),
}

#[derive(Clone, Debug)]
enum Tail {
    /// Exactly the bytes the offsets cover (capped at 64 KiB; beyond, the file is short).
    Exact,
    /// Cut `n` bytes off the end of the whole file (header included when n is large).
    Cut(usize),
    /// `n` more bytes.
    Extra(usize),
}

#[derive(Clone, Debug)]
struct FileDesc {
    tensors: Vec<TensorDesc>,
    /// `__metadata__`, if any (any JSON).
    metadata: Option<Value>,
    header_len: HeaderLen,
    /// Spaces after the header JSON (safetensors allows padding).
    padding: usize,
    tail: Tail,
    /// The byte every data byte is (0x7f bytes are NaN in f32, 0x00 zeros).
    fill: u8,
    /// Replaces the header text by a prefix of it (truncated JSON).
    cut_header: Option<usize>,
}

/// Values a dim or offset takes: small ones that make valid files and overflowing ones.
fn big() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..6,
        1 => prop::sample::select(vec![
            8u64,
            255,
            1 << 31,
            1 << 32,
            (1 << 32) + 1,
            1 << 33,
            1 << 40,
            (1 << 61) - 1,
            1 << 61,
            1 << 62,
            1 << 63,
            u64::MAX - 7,
            u64::MAX,
        ]),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        big().prop_map(Value::from),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!("F32")),
        Just(json!("")),
        Just(json!([])),
        Just(json!([1, 2, 3])),
        Just(json!({})),
        Just(json!({"format": "pt"})),
        Just(json!({"rank": 0})),
    ]
}

fn dtype() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => prop::sample::select(vec!["F32", "F32", "F16", "BF16", "F64"]).prop_map(Value::from),
        3 => prop::sample::select(vec![
            "I64", "I32", "U8", "I8", "BOOL", "U32", "U16", "F8_E4M3", "F8_E5M2", "F4",
            "F6_E2M3", "F8_E8M0", "C64", "f32", "float32", "XYZ", "",
        ])
        .prop_map(Value::from),
        1 => any_json(),
    ]
}

fn tensor(names: Vec<String>, shapes: Vec<Vec<u64>>) -> impl Strategy<Value = TensorDesc> {
    let name = prop_oneof![
        6 => prop::sample::select(names),
        1 => prop::sample::select(vec![
            "lm_head.weight", "h.0.attn.bias", "wte.weight", "transformer.wte.gamma",
            "__metadata__", "", "x.adam_m", "transformer.wte.weight.adam_v",
        ]).prop_map(String::from),
        1 => ".{0,8}",
    ];
    let shape = prop_oneof![
        6 => prop::sample::select(shapes).prop_map(|s| json!(s)),
        3 => prop::collection::vec(big(), 0..4).prop_map(|s| json!(s)),
        1 => any_json(),
    ];
    let offsets = prop_oneof![
        8 => Just(Offsets::Packed),
        2 => (-9i64..9, -9i64..9).prop_map(|(b, e)| Offsets::Shifted(b, e)),
        1 => prop_oneof![
            (big(), big()).prop_map(|(b, e)| json!([b, e])),
            any_json(),
            Just(json!([0])),
            Just(json!([0, 4, 8])),
            Just(json!([-4, 4])),
        ]
        .prop_map(Offsets::Raw),
    ];
    (name, dtype(), shape, offsets).prop_map(|(name, dtype, shape, offsets)| TensorDesc {
        name,
        dtype,
        shape,
        offsets,
    })
}

fn file() -> impl Strategy<Value = FileDesc> {
    let ps = params();
    let names: Vec<String> = ps.iter().map(|(n, _)| n.clone()).collect();
    let shapes: Vec<Vec<u64>> = ps.iter().map(|(_, s)| s.clone()).collect();
    // Mostly one tensor per parameter, with its name and shape, in order: what a real file
    // holds, which the corruptions below then break a little.
    let real: Vec<TensorDesc> = ps
        .iter()
        .map(|(n, s)| TensorDesc {
            name: n.clone(),
            dtype: json!("F32"),
            shape: json!(s),
            offsets: Offsets::Packed,
        })
        .collect();
    let tensors = prop_oneof![
        1 => prop::collection::vec(tensor(names.clone(), shapes.clone()), 0..6),
        2 => (
            prop::collection::vec((any::<prop::sample::Index>(), tensor(names, shapes)), 0..3),
            Just(real),
        )
            .prop_map(|(edits, mut real)| {
                for (i, t) in edits {
                    let k = i.index(real.len());
                    real[k] = t;
                }
                real
            }),
    ];
    let header_len = prop_oneof![
        8 => Just(HeaderLen::Exact),
        2 => (-9i64..9).prop_map(HeaderLen::Delta),
        1 => prop_oneof![
            big(),
            Just(100_000_000u64),
            Just(100_000_001u64),
            Just(usize::MAX as u64 - 8),
        ]
        .prop_map(HeaderLen::Raw),
    ];
    let tail = prop_oneof![
        8 => Just(Tail::Exact),
        1 => prop_oneof![0usize..9, 9usize..4096].prop_map(Tail::Cut),
        1 => (1usize..9).prop_map(Tail::Extra),
    ];
    (
        tensors,
        prop_oneof![
            6 => Just(None),
            3 => Just(Some(json!({"format": "pt"}))),
            1 => any_json().prop_map(Some),
        ],
        header_len,
        prop_oneof![4 => Just(0usize), 1 => 1usize..9],
        tail,
        prop::sample::select(vec![0u8, 0x3c, 0x7f, 0xff]),
        prop_oneof![8 => Just(None), 1 => any::<usize>().prop_map(Some)],
    )
        .prop_map(|(tensors, metadata, header_len, padding, tail, fill, cut_header)| {
            FileDesc { tensors, metadata, header_len, padding, tail, fill, cut_header }
        })
}

/// Most data bytes a file is given (a header may claim far more).
const MAX_DATA: u64 = 1 << 16;

/// The bytes of `f`.
fn bytes(f: &FileDesc) -> Vec<u8> {
    let mut header = Map::new();
    let mut at = 0u64;
    for t in &f.tensors {
        let dims: Option<Vec<u64>> =
            t.shape.as_array().and_then(|a| a.iter().map(Value::as_u64).collect());
        let elems = dims.and_then(|d| d.iter().try_fold(1u64, |n, &x| n.checked_mul(x)));
        let width = t.dtype.as_str().map_or(4, dtype_bytes);
        let len = elems.and_then(|n| n.checked_mul(width)).unwrap_or(1 << 40);
        let end = at.saturating_add(len);
        let offsets = match &t.offsets {
            Offsets::Packed => json!([at, end]),
            Offsets::Shifted(b, e) => {
                json!([at.saturating_add_signed(*b), end.saturating_add_signed(*e)])
            }
            Offsets::Raw(v) => v.clone(),
        };
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": offsets}),
        );
        at = end;
    }
    if let Some(m) = &f.metadata {
        header.insert("__metadata__".into(), m.clone());
    }
    let mut text = Value::Object(header).to_string();
    if let Some(cut) = f.cut_header {
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        text.truncate(bounds[cut % bounds.len()]);
    }
    text.push_str(&" ".repeat(f.padding));
    let n = text.len() as u64;
    let n = match f.header_len {
        HeaderLen::Exact => n,
        HeaderLen::Delta(d) => n.saturating_add_signed(d),
        HeaderLen::Raw(r) => r,
    };
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.resize(out.len() + at.min(MAX_DATA) as usize, f.fill);
    match f.tail {
        Tail::Exact => {}
        Tail::Cut(k) => out.truncate(out.len().saturating_sub(k)),
        Tail::Extra(k) => out.resize(out.len() + k, f.fill),
    }
    out
}

// ---- running the readers ---------------------------------------------------------------------

/// A fresh directory under the target's temp dir, unique per process and call.
fn scratch() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "fuzz-safetensors-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A valid safetensors file without tensors.
fn empty_safetensors() -> Vec<u8> {
    let header = b"{}";
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out
}

/// A single-device checkpoint directory (no checksums: read unchecked) around `model` and
/// `optimizer` bytes.
fn checkpoint_dir(model: &[u8], optimizer: &[u8]) -> PathBuf {
    let dir = scratch();
    let schedule = LrSchedule::Constant { lr: 1e-3 };
    let manifest = Manifest::new(1, 10, 0, "fuzz-gpt2", schedule);
    std::fs::write(dir.join("manifest.json"), serde_json::to_string(&manifest).unwrap()).unwrap();
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    std::fs::write(dir.join("model.safetensors"), model).unwrap();
    std::fs::write(dir.join("optimizer.safetensors"), optimizer).unwrap();
    dir
}

fn said<T, E: std::fmt::Display>(r: &Result<T, E>, what: &str) -> Result<(), TestCaseError> {
    if let Err(e) = r {
        prop_assert!(!e.to_string().trim().is_empty(), "{what}: an empty error");
    }
    Ok(())
}

/// Every reader on the checkpoint or weights directory `dir`, and every tensor they open.
fn check_readers(dir: &Path) -> Result<(), TestCaseError> {
    let g = graph();
    let opened = MappedCheckpoint::open(dir);
    said(&opened, "MappedCheckpoint::open")?;
    if let Ok(ck) = opened {
        for tensors in [&ck.params, &ck.optimizer] {
            for (name, shape, dtype) in tensors.shapes() {
                let r = tensors.read(name, &vec![0; shape.len()], shape, dtype);
                said(&r, &format!("MappedTensors::read({name})"))?;
                if let Ok(t) = r {
                    prop_assert_eq!(t.dims(), shape, "{}", name);
                }
            }
        }
    }

    let loaded = load_checkpoint(dir);
    said(&loaded, "load_checkpoint")?;

    let file = dir.join("model.safetensors");
    let weights = HfWeights::open(&file, g);
    said(&weights, "HfWeights::open")?;
    if let Ok(w) = weights {
        for p in g.parameters() {
            let r = w.global(g.tensor_scope(p), candle_core::DType::F32);
            said(&r, "HfWeights::global")?;
            if let Ok(t) = r {
                prop_assert_eq!(t.dims(), g.shape(p).dims());
            }
        }
    }
    let all = load_hf_weights(dir, g);
    said(&all, "load_hf_weights")?;
    let source = open_weights(dir, g);
    said(&source, "open_weights")?;
    Ok(())
}

fn check_file(f: &FileDesc) -> Result<(), TestCaseError> {
    let model = bytes(f);
    let dir = checkpoint_dir(&model, &empty_safetensors());
    let r = check_readers(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    r.map_err(|e| TestCaseError::fail(format!("{e}\nheader: {}", header_text(&model))))
}

/// The header of a (possibly corrupt) file, for failure messages.
fn header_text(bytes: &[u8]) -> String {
    let n = bytes.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
    format!(
        "length {n}, {:?}",
        String::from_utf8_lossy(&bytes[8.min(bytes.len())..bytes.len().min(8 + 4096)])
    )
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn corrupt_safetensors_files_never_panic(f in file()) {
        check_file(&f)?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        len in prop_oneof![Just(None), big().prop_map(Some)],
        body in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut model = len.map_or_else(Vec::new, |n| n.to_le_bytes().to_vec());
        model.extend_from_slice(&body);
        let dir = checkpoint_dir(&model, &model);
        let r = check_readers(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        r?;
    }
}

/// A file of the given tensors `(name, dtype, shape, [begin, end])` and `data` bytes.
fn raw_file(tensors: &[(&str, &str, Vec<u64>, [u64; 2])], data: usize) -> Vec<u8> {
    let mut header = Map::new();
    for (name, dtype, shape, offsets) in tensors {
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": offsets}),
        );
    }
    let text = Value::Object(header).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.resize(out.len() + data, 0);
    out
}

/// Runs every reader on a checkpoint whose model file is `model`; panics on a failure.
fn check_model_file(model: &[u8]) {
    let dir = checkpoint_dir(model, &empty_safetensors());
    let r = check_readers(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = r {
        panic!("{e}\nheader: {}", header_text(model));
    }
}

/// Eight tensors of 2^61 - 1 bytes each, back to back: offsets that fit a u64 but whose end
/// plus the header length does not.
#[test]
fn offsets_ending_near_u64_max() {
    let size = (1u64 << 61) - 1;
    let tensors: Vec<(String, [u64; 2])> =
        (0..8).map(|i| (format!("t{i}"), [i * size, (i + 1) * size])).collect();
    let tensors: Vec<(&str, &str, Vec<u64>, [u64; 2])> =
        tensors.iter().map(|(n, o)| (n.as_str(), "U8", vec![size], *o)).collect();
    check_model_file(&raw_file(&tensors, 0));
}

/// An empty tensor whose other dims multiply past usize: zero bytes, a valid header.
#[test]
fn empty_tensor_with_overflowing_dims() {
    for shape in [vec![0, 1 << 33, 1 << 33], vec![1 << 33, 0, 1 << 33], vec![0, u64::MAX]] {
        check_model_file(&raw_file(&[("transformer.wte.weight", "F32", shape, [0, 0])], 0));
    }
}

// ---- sharded checkpoints ---------------------------------------------------------------------

/// A valid file of `tensors` `(name, dims)` in f32, back to back, with `metadata`.
fn f32_file(tensors: &[(&str, Vec<u64>)], metadata: Value) -> Vec<u8> {
    let mut header = Map::new();
    let mut at = 0u64;
    for (name, dims) in tensors {
        let end = at + 4 * dims.iter().product::<u64>();
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": dims, "data_offsets": [at, end]}),
        );
        at = end;
    }
    header.insert("__metadata__".into(), metadata);
    let text = Value::Object(header).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.resize(out.len() + at as usize, 0x3c);
    out
}

/// The `sharded` section of a 2-rank checkpoint: a parameter split along dim 0, its Adam
/// state split along dim 1, and a replicated parameter that rank 0 holds.
fn sharded_section() -> Value {
    json!({
        "mesh": [2],
        "world_size": 2,
        "tensors": [
            {"name": "transformer.wpe.weight", "role": "param", "shape": [8, 8],
             "dtype": "f32", "placement": [[], []], "chunks": [{"index": [0, 0], "rank": 0}]},
            {"name": "transformer.wte.weight", "role": "param", "shape": [16, 8],
             "dtype": "f32", "placement": [[0], []],
             "chunks": [{"index": [0, 0], "rank": 0}, {"index": [1, 0], "rank": 1}]},
            {"name": "transformer.wte.weight.adam_m", "role": "optimizer", "shape": [16, 8],
             "dtype": "f32", "placement": [[], [0]],
             "chunks": [{"index": [0, 0], "rank": 0}, {"index": [0, 1], "rank": 1}]},
        ],
        "layout": null
    })
}

/// Writes a sharded checkpoint of `section` (rank files as `sharded_section` describes,
/// whatever the section now says).
fn sharded_dir(section: &Value, rank_metadata: [Value; 2]) -> PathBuf {
    let dir = scratch();
    let schedule = LrSchedule::Constant { lr: 1e-3 };
    let mut manifest =
        serde_json::to_value(Manifest::new(1, 10, 0, "fuzz-gpt2", schedule)).unwrap();
    manifest["sharded"] = section.clone();
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let shards = dir.join("shards");
    std::fs::create_dir(&shards).unwrap();
    let [m0, m1] = rank_metadata;
    let rank0 = f32_file(
        &[
            ("transformer.wpe.weight", vec![8, 8]),
            ("transformer.wte.weight", vec![8, 8]),
            ("transformer.wte.weight.adam_m", vec![16, 4]),
        ],
        m0,
    );
    let rank1 = f32_file(
        &[("transformer.wte.weight", vec![8, 8]), ("transformer.wte.weight.adam_m", vec![16, 4])],
        m1,
    );
    std::fs::write(shards.join("rank-00000.safetensors"), rank0).unwrap();
    std::fs::write(shards.join("rank-00001.safetensors"), rank1).unwrap();
    dir
}

fn rank_metadata(rank: usize) -> Value {
    json!({"format": "pt", "rank": rank.to_string(), "step": "1"})
}

/// Every path to a value inside `v`, `v` itself first.
fn paths(v: &Value) -> Vec<Vec<Value>> {
    fn walk(v: &Value, at: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
        out.push(at.clone());
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    at.push(json!(k));
                    walk(x, at, out);
                    at.pop();
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    at.push(json!(i));
                    walk(x, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

fn at_path<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match k {
        Value::String(k) => &mut v[k.as_str()],
        Value::Number(i) => &mut v[i.as_u64().unwrap() as usize],
        _ => unreachable!(),
    })
}

#[derive(Clone, Debug)]
enum Edit {
    /// A number (or list of numbers) of the same type where one was; a dtype or role name
    /// where a string was.
    Tweak(prop::sample::Index, u64, Vec<u64>, String),
    /// Any value.
    Set(prop::sample::Index, Value),
    /// Removes an array element or object key; or duplicates an array element.
    Remove(prop::sample::Index, bool),
}

fn edit() -> impl Strategy<Value = Edit> {
    let name = prop::sample::select(vec![
        "f32",
        "bf16",
        "f16",
        "u8",
        "i64",
        "F32",
        "xyz",
        "param",
        "optimizer",
        "",
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.wte.weight.adam_v",
    ])
    .prop_map(String::from);
    prop_oneof![
        6 => (any::<prop::sample::Index>(), big(), prop::collection::vec(big(), 0..4), name)
            .prop_map(|(i, n, ns, s)| Edit::Tweak(i, n, ns, s)),
        1 => (any::<prop::sample::Index>(), any_json()).prop_map(|(i, v)| Edit::Set(i, v)),
        2 => (any::<prop::sample::Index>(), any::<bool>()).prop_map(|(i, d)| Edit::Remove(i, d)),
    ]
}

fn apply(mut v: Value, edits: &[Edit]) -> Value {
    for e in edits {
        let all = paths(&v);
        match e {
            Edit::Tweak(i, n, ns, s) => {
                let slot = at_path(&mut v, &all[i.index(all.len())]);
                *slot = match &*slot {
                    Value::Number(_) => json!(n),
                    Value::String(_) => json!(s),
                    Value::Array(a) if a.first().is_none_or(Value::is_number) => json!(ns),
                    // A list of lists (a placement): one more or one fewer dim.
                    Value::Array(a) if a.first().is_some_and(Value::is_array) => {
                        let mut a = a.clone();
                        if ns.len() % 2 == 0 {
                            a.push(json!(ns));
                        } else {
                            a.pop();
                        }
                        Value::Array(a)
                    }
                    other => other.clone(),
                };
            }
            Edit::Set(i, x) => *at_path(&mut v, &all[i.index(all.len())]) = x.clone(),
            Edit::Remove(i, dup) => {
                let path = &all[i.index(all.len())];
                let Some((last, parent)) = path.split_last() else { continue };
                match (at_path(&mut v, parent), last) {
                    (Value::Object(m), Value::String(k)) if !dup => {
                        m.remove(k);
                    }
                    (Value::Array(a), Value::Number(k)) => {
                        let k = k.as_u64().unwrap() as usize;
                        if *dup {
                            let x = a[k].clone();
                            a.insert(k, x);
                        } else {
                            a.remove(k);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    v
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn corrupt_sharded_manifests_never_panic(
        edits in prop::collection::vec(edit(), 1..4),
        metadata in prop_oneof![
            8 => Just([rank_metadata(0), rank_metadata(1)]),
            1 => Just([rank_metadata(1), rank_metadata(0)]),
            1 => Just([json!({"rank": "0", "step": "2"}), rank_metadata(1)]),
        ],
    ) {
        let section = apply(sharded_section(), &edits);
        // Sections claiming more ranks or elements than memory holds are among them: readers
        // fail on the files before allocating (also `sharded_*_beyond_memory`).
        let dir = sharded_dir(&section, metadata);
        let r = check_readers(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        r.map_err(|e| TestCaseError::fail(format!("{e}\nsection: {section}")))?;
    }
}

/// The files the fuzzers corrupt are valid to begin with (else they test nothing): the
/// single-device checkpoint of every parameter and the sharded one both open and read back.
#[test]
fn the_uncorrupted_files_read_back() {
    let ps = params();
    let real: Vec<(&str, Vec<u64>)> = ps.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    let dir = checkpoint_dir(&f32_file(&real, json!({"format": "pt"})), &empty_safetensors());
    check_readers(&dir).unwrap();
    let ck = MappedCheckpoint::open(&dir).unwrap();
    assert_eq!(ck.params.shapes().count(), ps.len());
    assert_eq!(load_checkpoint(&dir).unwrap().params.len(), ps.len());
    assert_eq!(load_hf_weights(&dir, graph()).unwrap().len(), ps.len());
    let _ = std::fs::remove_dir_all(&dir);

    let dir = weights_dir(&weights_index());
    assert_eq!(load_hf_weights(&dir, graph()).unwrap().len(), ps.len());
    let _ = std::fs::remove_dir_all(&dir);

    let dir = sharded_dir(&sharded_section(), [rank_metadata(0), rank_metadata(1)]);
    check_readers(&dir).unwrap();
    let ck = MappedCheckpoint::open(&dir).unwrap();
    let wte = ck.params.read("transformer.wte.weight", &[0, 0], &[16, 8], candle_core::DType::F32);
    assert_eq!(wte.unwrap().dims(), &[16, 8]);
    let loaded = load_checkpoint(&dir).unwrap();
    assert_eq!((loaded.params.len(), loaded.optimizer.len()), (2, 1));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- sharded Hugging Face weights (an index and its shards) ----------------------------------

const SHARD_FILES: [&str; 2] =
    ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];

/// The index of every parameter, the first half in the first shard file.
fn weights_index() -> Value {
    let ps = params();
    let map: Map<String, Value> = ps
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), json!(SHARD_FILES[usize::from(2 * i >= ps.len())])))
        .collect();
    json!({"metadata": {"total_size": 0}, "weight_map": map})
}

/// A directory of the two shard files (as `weights_index` splits the parameters) and `index`.
fn weights_dir(index: &Value) -> PathBuf {
    let dir = scratch();
    let ps = params();
    let (first, second) = ps.split_at(ps.len().div_ceil(2));
    for (file, part) in SHARD_FILES.iter().zip([first, second]) {
        let tensors: Vec<(&str, Vec<u64>)> =
            part.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
        std::fs::write(dir.join(file), f32_file(&tensors, json!({"format": "pt"}))).unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn corrupt_weight_indexes_never_panic(edits in prop::collection::vec(edit(), 1..4)) {
        let index = apply(weights_index(), &edits);
        let dir = weights_dir(&index);
        let r = check_readers(&dir).and_then(|()| {
            let w = HfWeights::open(&dir, graph());
            said(&w, "HfWeights::open(index)")
        });
        let _ = std::fs::remove_dir_all(&dir);
        r.map_err(|e| TestCaseError::fail(format!("{e}\nindex: {index}")))?;
    }
}

// ---- the panics found so far, one minimal input each -----------------------------------------
//
// These fail until the readers (mapped.rs, checkpoint.rs, dist_checkpoint.rs) are fixed.

/// The sharded section with one tensor, `transformer.wpe.weight` (rank 0 holds it whole as
/// `[8, 8]`), described by `tensor` (merged over the real description).
fn one_tensor_section(mesh: Value, tensor: Value) -> Value {
    let mut t = json!({
        "name": "transformer.wpe.weight", "role": "param", "shape": [8, 8], "dtype": "f32",
        "placement": [[], []], "chunks": [{"index": [0, 0], "rank": 0}]
    });
    for (k, v) in tensor.as_object().unwrap() {
        t[k] = v.clone();
    }
    json!({"mesh": mesh, "world_size": 2, "tensors": [t]})
}

fn check_sharded(section: &Value) {
    let dir = sharded_dir(section, [rank_metadata(0), rank_metadata(1)]);
    let r = check_readers(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = r {
        panic!("{e}\nsection: {section}");
    }
}

/// A placement with more dims than the shape.
#[test]
fn sharded_placement_longer_than_shape() {
    check_sharded(&one_tensor_section(json!([2]), json!({"placement": [[], [], []]})));
}

/// Mesh axes whose sizes multiply past usize.
#[test]
fn sharded_mesh_product_overflows() {
    let mesh = json!([1u64 << 32, 1u64 << 32]);
    check_sharded(&one_tensor_section(mesh, json!({"placement": [[0, 1], []]})));
}

/// A global shape whose element count overflows usize.
#[test]
fn sharded_shape_product_overflows() {
    check_sharded(&one_tensor_section(json!([2]), json!({"shape": [1u64 << 61, 8]})));
}

/// Chunk indices that are too short, beyond the chunk grid, or overflow when multiplied by
/// the chunk shape: `load_checkpoint` refuses them all (outside the chunk grid), so the
/// mapped reader must too, and not read zeros where the chunk was supposed to be.
#[test]
fn sharded_chunk_index_outside_the_grid() {
    for index in [json!([5]), json!([0, 1u64 << 62]), json!([0, 5])] {
        let section =
            one_tensor_section(json!([2]), json!({"chunks": [{"index": index, "rank": 0}]}));
        check_sharded(&section);
        let dir = sharded_dir(&section, [rank_metadata(0), rank_metadata(1)]);
        let (mapped, loaded) = (MappedCheckpoint::open(&dir), load_checkpoint(&dir));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(loaded.is_err(), "load_checkpoint accepts chunk index {index}");
        assert!(mapped.is_err(), "MappedCheckpoint::open accepts chunk index {index}");
    }
}

/// Runs the calling test's `case` in a child process (this test binary, filtered to `test`):
/// an allocation failure aborts the process, which no test in this one could report.
fn in_child(test: &str, case: impl FnOnce()) {
    const CHILD: &str = "TESSERA_FUZZ_SAFETENSORS_CHILD";
    if std::env::var_os(CHILD).is_some() {
        case();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{test} crashed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr).lines().take(12).collect::<Vec<_>>().join("\n")
    );
}

/// A world of 2^40 ranks: the reader must refuse it before reserving memory for each rank.
#[test]
fn sharded_world_beyond_memory() {
    in_child("sharded_world_beyond_memory", || {
        let mut section = one_tensor_section(json!([2]), json!({}));
        section["world_size"] = json!(1u64 << 40);
        check_sharded(&section);
    });
}

/// A tensor of 2^43 elements (32 TiB) held by a rank whose file has 64: the reader must
/// check the rank files before allocating the global tensor.
#[test]
fn sharded_shape_beyond_memory() {
    in_child("sharded_shape_beyond_memory", || {
        check_sharded(&one_tensor_section(json!([2]), json!({"shape": [1u64 << 40, 8]})));
    });
}
