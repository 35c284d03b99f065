//! Fuzzing the planner's user inputs (issue 17, item 7): parallel config strings, cluster
//! strings and files, memory sizes, sharding specs and plan files. Any input gives a value or
//! an error with a message, never a panic; what is accepted round-trips through its printed
//! form, and a config string or plan file that parses is then planned or lowered on a small
//! GPT-2 (as `tessera plan` / `train --plan` do) without a panic either.

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, Gpt2Params, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{lower_plan, plan_auto, plan_fixed, plan_from_file, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::units::parse_bytes;
use tessera_plan::{Cluster, PlanError, Spec};

/// An error must say what is wrong.
fn said<T>(r: &Result<T, PlanError>, input: &str) -> Result<(), TestCaseError> {
    if let Err(e) = r {
        prop_assert!(!e.to_string().trim().is_empty(), "empty error for {input:?}");
    }
    Ok(())
}

/// Words glued from `tokens` (1 to 3 each), joined by `separators`.
fn sentence(
    tokens: Vec<&'static str>,
    separators: Vec<&'static str>,
) -> impl Strategy<Value = String> {
    let word = prop::collection::vec(
        prop_oneof![
            8 => prop::sample::select(tokens).prop_map(String::from),
            1 => "[0-9]{1,25}",
            1 => ".{0,2}",
        ],
        1..4,
    )
    .prop_map(|parts| parts.concat());
    prop::collection::vec((word, prop::sample::select(separators)), 0..7)
        .prop_map(|ws| ws.into_iter().map(|(w, sep)| format!("{w}{sep}")).collect())
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "01",
    "007",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775808",
    "4294967296",
    "99999999999999999999999",
    "٣",
    "²",
    "-1",
    "+2",
    "1.5",
    "1e3",
];

// ---- parallel config strings -----------------------------------------------------------------

fn config_string() -> impl Strategy<Value = String> {
    let mut tokens = vec![
        "dp",
        "tp",
        "sp",
        "mb",
        "zero",
        "pp",
        "ckpt",
        "ckpt=",
        "sched=",
        "sched",
        "none",
        "selective",
        "full",
        "1f1b",
        "=",
        ",",
        "x",
        "DP",
        "Tp",
        "SP",
        "ZERO",
        "İ",
        "ß",
        "K",
        "cpu",
        "H100",
        "GiB",
    ];
    tokens.extend_from_slice(NUMBERS);
    // Each kind at most once (so most strings are valid configs), in any order.
    let kinds = vec!["dp", "tp", "mb", "zero", "sp", "ckpt="];
    let modes = prop::sample::select(vec!["full", "none", "Selective", "full", "some"]);
    let separator = prop::sample::select(vec![" ", " ", "+", " + ", "\t", "\u{3000}"]);
    let structured = (
        prop::sample::subsequence(kinds, 1..=5),
        prop::collection::vec((number(), modes, separator), 8),
    )
        .prop_map(|(kinds, args)| {
            kinds
                .into_iter()
                .zip(args)
                .map(|(k, (n, mode, sep))| match k {
                    "sp" => format!("sp{sep}"),
                    "ckpt=" => format!("ckpt={mode}{sep}"),
                    _ => format!("{k}{n}{sep}"),
                })
                .collect::<Vec<_>>()
        })
        .prop_shuffle()
        .prop_map(|ts| ts.concat());
    prop_oneof![
        4 => structured,
        4 => sentence(tokens, vec![" ", " ", "+", "  ", "\t", "\n", "\u{3000}", "\u{a0}", ","]),
        1 => ".*",
    ]
}

/// Counts: small ones (that may fit 4 devices), huge ones and malformed ones.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (0u64..9).prop_map(|n| n.to_string()),
        1 => prop::sample::select(NUMBERS).prop_map(String::from),
        2 => any::<u64>().prop_map(|n| n.to_string()),
        1 => "[0-9]{15,25}",
    ]
}

// ---- cluster strings -------------------------------------------------------------------------

fn cluster_string() -> impl Strategy<Value = String> {
    let mut tokens = vec![
        "x",
        "X",
        "×",
        " x ",
        "H100",
        "h100-sxm",
        "H200",
        "A100-40G",
        "a100_80g",
        "A100",
        "RTX 4090",
        "rtx3060",
        "3080",
        "cpu",
        "CPU",
        "tpu",
        "",
        " ",
        ".json",
        ".toml",
        "GiB",
        "Cargo.toml",
    ];
    tokens.extend_from_slice(NUMBERS);
    let device = prop::sample::select(vec![
        "H100", "h100-sxm", "A100-80G", "RTX 4090", "cpu", "A100", "tpu", "", " H200 ",
    ]);
    let x = prop::sample::select(vec!["x", "X", "×", " x ", "", "xx"]);
    let structured =
        (prop::collection::vec((number(), x), 0..4), device).prop_map(|(counts, d)| {
            let counts: String = counts.into_iter().map(|(n, x)| format!("{n}{x}")).collect();
            format!("{counts}{d}")
        });
    prop_oneof![
        4 => structured,
        4 => sentence(tokens, vec!["", "", "x", " ", "×"]),
        1 => ".*",
    ]
}

// ---- memory sizes ----------------------------------------------------------------------------

fn size_string() -> impl Strategy<Value = String> {
    let mut tokens = vec![
        ".",
        "..",
        "B",
        "b",
        "KB",
        "kb",
        "MB",
        "GB",
        "TB",
        "PB",
        "KiB",
        "MiB",
        "GiB",
        "TiB",
        "PiB",
        "EiB",
        "K",
        "M",
        "G",
        "T",
        "P",
        "k",
        "iB",
        "e9",
        "-",
        "+",
        " ",
        "_",
        "0.5",
        ".5",
        "٣",
        "١٢",
        "ｇｉｂ",
    ];
    tokens.extend_from_slice(NUMBERS);
    let unit = prop::sample::select(vec![
        "", "B", "kb", "MB", "GB", "TB", "PB", "KiB", "mib", "GiB", "TiB", "PiB", "EiB", "G",
        " GiB", "iB",
    ]);
    let digits = prop_oneof!["[0-9]{0,24}", number()];
    let structured =
        (digits.clone(), prop::option::of(digits), unit).prop_map(|(i, f, u)| match f {
            Some(f) => format!("{i}.{f}{u}"),
            None => format!("{i}{u}"),
        });
    prop_oneof![
        4 => structured,
        4 => sentence(tokens, vec!["", "", " "]),
        1 => ".*",
    ]
}

// ---- sharding specs --------------------------------------------------------------------------

fn spec_string() -> impl Strategy<Value = String> {
    let tokens = vec![
        "[",
        "]",
        ",",
        ", ",
        "R",
        "S",
        "S0",
        "S1",
        "S01",
        "S10",
        "S9",
        "S00",
        "P",
        "P0",
        "P10",
        "P00",
        " ",
        "r",
        "s0",
        "٣",
        "S٣",
        "P٣",
        "[R, S0]",
        "[S0, R] P1",
    ];
    prop_oneof![8 => sentence(tokens, vec!["", "", " ", ", "]), 1 => ".*"]
}

// ---- cluster files ---------------------------------------------------------------------------

/// A fresh path under the target's temp dir, unique per process and call.
fn temp_path(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "fuzz-inputs-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Hostile JSON values for any field.
fn hostile() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(vec![
            0i64,
            1,
            2,
            3,
            4,
            8,
            255,
            256,
            -1,
            -2,
            i64::MIN,
            i64::MAX,
            1 << 32,
            1 << 33,
            1 << 62,
        ])
        .prop_map(Value::from),
        Just(json!(u64::MAX)),
        prop::sample::select(vec![
            0.0f64,
            -0.0,
            0.5,
            1.0,
            1.5,
            -1.0,
            1e-300,
            1e30,
            1e300,
            f64::MAX,
            f64::MIN_POSITIVE,
        ])
        .prop_map(Value::from),
        prop::sample::select(vec![
            "",
            "x",
            "H100",
            "cpu",
            "80GiB",
            "1.5GiB",
            "4G",
            "-1",
            "99999999999999999999999TiB",
            "[R, S0]",
            "[S0, R] P1",
            "[S0, S0]",
            "[S1, S0]",
            "[S9]",
            "[R, R, R]",
            "[",
            "R",
            "none",
            "full",
            "selective",
            "dp",
            "tp",
            "a0",
            "per-op",
            "megatron",
            "matmul",
            "add",
            "forward",
            "all_reduce",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Every path to a value inside `v` (object keys and array indices), `v` itself first.
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

/// Replacements of the same JSON type as what they replace, so an edited file still parses
/// and the edit reaches the planner: numbers, spec-like strings, lists of either.
#[derive(Clone, Debug)]
struct Typed {
    number: u64,
    string: String,
    numbers: Vec<u64>,
    strings: Vec<String>,
}

fn typed() -> impl Strategy<Value = Typed> {
    let number = prop_oneof![
        4 => 0u64..9,
        1 => prop::sample::select(vec![
            16u64,
            255,
            256,
            1 << 32,
            1 << 33,
            u32::MAX as u64,
            1 << 63,
            u64::MAX,
        ]),
    ];
    let string = prop_oneof![
        3 => spec_string(),
        1 => prop::sample::select(vec![
            "none", "full", "selective", "dp", "tp", "per-op", "megatron", "matmul", "add",
            "layer_norm", "",
        ])
        .prop_map(String::from),
    ];
    (
        number.clone(),
        string.clone(),
        prop::collection::vec(number, 0..5),
        prop::collection::vec(string, 0..4),
    )
        .prop_map(|(number, string, numbers, strings)| Typed {
            number,
            string,
            numbers,
            strings,
        })
}

impl Typed {
    /// A value of `old`'s type (`old` itself for booleans, null and objects).
    fn like(&self, old: &Value) -> Value {
        match old {
            Value::Number(_) => json!(self.number),
            Value::String(_) => json!(self.string),
            Value::Array(a) if a.first().is_some_and(Value::is_string) => json!(self.strings),
            Value::Array(_) => json!(self.numbers),
            other => other.clone(),
        }
    }
}

#[derive(Clone, Debug)]
enum Edit {
    /// Replaces the value at a path (chosen by index among all paths) by one of its type.
    Tweak(Index, Typed),
    /// Replaces the value at a path by any value.
    Set(Index, Value),
    /// Removes an object key or array element at a path.
    Remove(Index),
    /// Duplicates an array element at a path.
    Duplicate(Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (any::<Index>(), typed()).prop_map(|(i, t)| Edit::Tweak(i, t)),
        2 => (any::<Index>(), hostile()).prop_map(|(i, v)| Edit::Set(i, v)),
        2 => any::<Index>().prop_map(Edit::Remove),
        1 => any::<Index>().prop_map(Edit::Duplicate),
    ]
}

fn apply(mut v: Value, edits: &[Edit]) -> Value {
    for e in edits {
        let all = paths(&v);
        match e {
            Edit::Set(i, x) => *at_path(&mut v, &all[i.index(all.len())]) = x.clone(),
            Edit::Tweak(i, t) => {
                let slot = at_path(&mut v, &all[i.index(all.len())]);
                *slot = t.like(slot);
            }
            Edit::Remove(i) | Edit::Duplicate(i) => {
                let path = &all[i.index(all.len())];
                let Some((last, parent)) = path.split_last() else { continue };
                let dup = matches!(e, Edit::Duplicate(_));
                match (at_path(&mut v, parent), last) {
                    (Value::Object(m), Value::String(k)) if !dup => {
                        m.remove(k);
                    }
                    (Value::Array(a), Value::Number(n)) => {
                        let n = n.as_u64().unwrap() as usize;
                        if dup {
                            let x = a[n].clone();
                            a.insert(n, x);
                        } else {
                            a.remove(n);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    v
}

fn cluster_file_bases() -> Vec<(&'static str, String)> {
    let custom = json!({
        "nodes": 2,
        "gpus_per_node": 4,
        "device": {
            "name": "my-gpu", "memory_bytes": "24GiB", "reserve_bytes": 1024,
            "fp32_flops": 8e13, "bf16_flops": 1.6e14, "fp16_flops": 1.6e14,
            "memory_bandwidth": 1e12, "kernel_overhead_s": 5e-6,
            "matmul_efficiency": 0.7, "memory_efficiency": 0.8
        },
        "reserve": "2GiB",
        "intra": {"latency_s": 5e-6, "bandwidth": 5e10},
        "inter": {"latency_s": 1e-5, "bandwidth": 1e10}
    });
    let preset = json!({"nodes": 1, "gpus_per_node": 8, "device": "H100"});
    vec![("json", custom.to_string()), ("json", preset.to_string())]
}

// ---- plan files ------------------------------------------------------------------------------

/// A 2-layer GPT-2 small enough to lower in milliseconds.
fn tiny_model() -> ModelConfig {
    let mut p = Gpt2Params::new("fuzz-gpt2", 64, 16, 32, 2, 4);
    (p.embd_pdrop, p.resid_pdrop, p.attn_pdrop) = (0.0, 0.0, 0.0);
    ModelConfig::Gpt2(tessera_models::Gpt2Config::new(p).unwrap())
}

const BATCH: usize = 4;
const SEQ: usize = 8;

fn forward(mb: usize) -> tessera_plan::Result<Forward> {
    static CFG: OnceLock<ModelConfig> = OnceLock::new();
    let cfg = CFG.get_or_init(tiny_model);
    let m = build(cfg, &BuildOptions::new(mb, SEQ, DType::F32))
        .map_err(|e| PlanError::Invalid(e.to_string()))?;
    Ok(Forward { graph: m.builder.finish(), loss: m.loss })
}

/// `tessera plan --cluster 4xH100 --batch 4 --seq 8` of the tiny model.
fn request() -> Request<'static> {
    let cluster = Cluster::parse("4xH100").unwrap();
    Request {
        build: &forward,
        model: "fuzz-gpt2".into(),
        batch: BATCH,
        seq: SEQ,
        dtype: DType::F32,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e9,
        ckpt: CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    }
}

/// Plans as `tessera plan --out` writes them, under a few layouts.
fn plan_bases() -> &'static [Value] {
    static PLANS: OnceLock<Vec<Value>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let req = request();
        let mut plans: Vec<Plan> = ["dp2 tp2 sp zero1 mb2", "dp4 zero3", "dp1 tp4 ckpt=full"]
            .iter()
            .map(|c| plan_fixed(&req, &ParallelConfig::parse(c).unwrap()).unwrap())
            .collect();
        // The free search's per-op layout too.
        plans.push(plan_auto(&req).unwrap());
        plans.iter().map(|p| serde_json::to_value(p).unwrap()).collect()
    })
}

/// What `train --plan FILE` does with the file's text: parse, re-lower on the model, and
/// lower the result again for the run.
fn check_plan_text(text: &str) -> Result<(), TestCaseError> {
    let plan: Plan = match serde_json::from_str(text) {
        Ok(p) => p,
        Err(e) => {
            prop_assert!(!e.to_string().is_empty());
            return Ok(());
        }
    };
    let req = request();
    let r = plan_from_file(&req, &plan);
    said(&r, text)?;
    if let Ok(p) = r {
        let exe = lower_plan(&req, &p);
        prop_assert!(exe.is_ok(), "a re-planned file does not lower: {:?}", exe.err());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn parallel_config_strings_never_panic(s in config_string()) {
        let r = ParallelConfig::parse(&s);
        said(&r, &s)?;
        let Ok(c) = r else { return Ok(()) };
        prop_assert!(c.validate().is_ok(), "{s:?} parsed to an invalid {c:?}");
        let canon = c.canonical();
        prop_assert_eq!(ParallelConfig::parse(&canon).ok(), Some(c.clone()), "{:?}", s);
        prop_assert_eq!(s.parse::<ParallelConfig>().ok(), Some(c.clone()));
        // What `--plan "<config>"` does next on 4 devices.
        let fits = c.check_devices(4);
        said(&fits, &s)?;
        prop_assert_eq!(fits.is_ok(), c.devices() == 4);
        c.megatron_flags();
        c.deepspeed_config();
    }

    #[test]
    fn cluster_strings_never_panic(s in cluster_string()) {
        let r = Cluster::parse(&s);
        said(&r, &s)?;
        let Ok(c) = r else { return Ok(()) };
        prop_assert!(c.nodes >= 1 && c.gpus_per_node >= 1);
        prop_assert_eq!(Some(c.num_devices()), c.nodes.checked_mul(c.gpus_per_node));
        // A file names its own device; a preset string prints back to the same cluster.
        let lower = s.trim().to_ascii_lowercase();
        if !(lower.ends_with(".toml") || lower.ends_with(".json")) {
            prop_assert_eq!(Cluster::parse(&c.to_string()).ok(), Some(c.clone()), "{:?}", s);
        }
    }

    #[test]
    fn memory_sizes_never_panic(s in size_string()) {
        let r = parse_bytes(&s);
        said(&r, &s)?;
        if let Ok(b) = r {
            prop_assert_eq!(parse_bytes(&b.to_string()).ok(), Some(b), "{:?}", s);
            prop_assert_eq!(parse_bytes(&format!("{b} B")).ok(), Some(b), "{:?}", s);
        }
    }

    #[test]
    fn whole_sizes_are_exact(n in any::<u64>(), unit in 0usize..11) {
        let (name, scale): (&str, u128) = [
            ("B", 1), ("KB", 1_000), ("MB", 1_000_000), ("GB", 1_000_000_000),
            ("TB", 1_000_000_000_000), ("PB", 1_000_000_000_000_000), ("KiB", 1 << 10),
            ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40), ("PiB", 1 << 50),
        ][unit];
        let want = u64::try_from(u128::from(n) * scale).ok();
        let s = format!("{n}{name}");
        let got = parse_bytes(&s);
        said(&got, &s)?;
        prop_assert_eq!(got.ok(), want, "{}", s);
    }

    #[test]
    fn sharding_specs_never_panic(s in spec_string()) {
        // `Spec::parse` answers None for what is not a spec; a spec prints and parses back.
        if let Some(spec) = Spec::parse(&s) {
            prop_assert_eq!(Spec::parse(&spec.to_string()), Some(spec.clone()), "{:?}", s);
            let mesh = tessera_plan::Mesh::new(&Cluster::parse("4xH100").unwrap(), &[2, 2], &[])
                .unwrap();
            let shape = vec![4; spec.rank()];
            if let Some(local) = spec.local_shape(&mesh, &shape) {
                prop_assert_eq!(local.len(), spec.rank());
                prop_assert!(spec.is_valid(&mesh, spec.rank()));
            }
        }
    }

    #[test]
    fn cluster_files_never_panic(
        base in prop::sample::select(cluster_file_bases()),
        edits in prop::collection::vec(edit(), 1..4),
        as_toml in any::<bool>(),
    ) {
        let value = apply(serde_json::from_str(&base.1).unwrap(), &edits);
        let (ext, text) = if as_toml {
            // Values TOML cannot hold (null, mixed nesting) make the text itself fail.
            match toml::to_string(&value) {
                Ok(t) => ("toml", t),
                Err(_) => ("toml", value.to_string()),
            }
        } else {
            (base.0, value.to_string())
        };
        let path = temp_path(&format!("cluster.{ext}"));
        std::fs::write(&path, &text).unwrap();
        let r = Cluster::parse(path.to_str().unwrap());
        said(&r, &text)?;
        if let Ok(c) = r {
            prop_assert!(c.device.validate().is_ok(), "{text}");
            prop_assert!(c.nodes.checked_mul(c.gpus_per_node).is_some(), "{text}");
        }
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }
}

proptest! {
    // Each accepted plan file is lowered twice (as `train` does): fewer cases.
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn plan_files_never_panic(
        base in prop::sample::select(plan_bases()),
        edits in prop::collection::vec(edit(), 1..4),
    ) {
        check_plan_text(&apply(base, &edits).to_string())?;
    }

    #[test]
    fn plan_files_with_edited_layouts_never_panic(
        base in prop::sample::select(plan_bases()),
        field in prop::sample::select(vec![
            "mesh", "version", "zero_stage", "micro_batches", "checkpoint", "strategies",
            "batch", "devices",
        ]),
        edits in prop::collection::vec(edit(), 1..3),
    ) {
        // Edits inside one field the lowering reads, so most files still parse as plans.
        let mut plan = base;
        let part = plan[field].take();
        plan[field] = apply(part, &edits);
        check_plan_text(&plan.to_string())?;
    }

    #[test]
    fn config_strings_that_parse_plan_or_refuse(s in config_string()) {
        let Ok(c) = ParallelConfig::parse(&s) else { return Ok(()) };
        let r = plan_fixed(&request(), &c);
        said(&r, &s)?;
    }
}

/// The edits one at a time on the mesh and the strategies' first entries: overflowing,
/// zero-sized and out-of-range values where the lowering indexes with them.
#[test]
fn plan_file_extremes() {
    let base = &plan_bases()[0];
    let n = base["strategies"].as_array().unwrap().len();
    let mut cases: Vec<(String, Value)> = vec![
        ("/mesh/shape".into(), json!([1u64 << 32, 1u64 << 32])),
        ("/mesh/shape".into(), json!([u64::MAX, 2])),
        ("/mesh/shape".into(), json!([0, 4])),
        ("/mesh/shape".into(), json!([4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])),
        ("/mesh/shape".into(), json!([])),
        ("/mesh/axes".into(), json!([])),
        ("/micro_batches".into(), json!(0)),
        ("/micro_batches".into(), json!(u64::MAX)),
        ("/zero_stage".into(), json!(255)),
        ("/checkpoint".into(), json!([{"block": u32::MAX, "mode": "full"}])),
        ("/strategies".into(), json!([])),
    ];
    for k in [0, n / 2, n - 1] {
        for (field, v) in [
            ("node", json!(u64::MAX)),
            ("node", json!(0)),
            ("compute_axes", json!([9])),
            ("compute_axes", json!([0, 0, 1, 1])),
            ("compute_axes", json!([usize::MAX])),
            ("inputs", json!([])),
            ("inputs", json!(vec!["[S0, S1] P0"; 6])),
            ("inputs", json!(["[S9]"])),
            ("outputs", json!([])),
            ("outputs", json!(["[R, R, R, R, R]"])),
            ("outputs", json!(["[S01, S01]"])),
        ] {
            cases.push((format!("/strategies/{k}/{field}"), v));
        }
    }
    for (path, v) in cases {
        let mut plan = base.clone();
        *plan.pointer_mut(&path).unwrap() = v.clone();
        if let Err(e) = check_plan_text(&plan.to_string()) {
            panic!("{path} = {v}: {e}");
        }
    }
}

/// The panics this fuzzer found, each now a clear error naming the problem.
#[test]
fn found_panics_are_clear_errors() {
    // dp × tp overflowed in `devices()` (checking a config against the cluster).
    let e = ParallelConfig::parse("dp4611686018427387904 tp4").unwrap_err().to_string();
    assert!(e.contains("overflows") && e.contains("smaller degrees"), "{e}");
    let e = ParallelConfig::parse("dp2 mb18446744073709551615").unwrap_err().to_string();
    assert!(e.contains("overflows"), "{e}");

    let req = request();
    let lowered = |path: &str, v: Value| {
        let mut plan = plan_bases()[0].clone();
        *plan.pointer_mut(path).unwrap() = v;
        let plan: Plan = serde_json::from_value(plan).unwrap();
        plan_from_file(&req, &plan).unwrap_err().to_string()
    };
    // A mesh whose sizes multiply past usize overflowed in `Mesh::new`.
    let e = lowered("/mesh/shape", json!([1u64 << 32, 1u64 << 32]));
    assert!(e.contains("more than 2^64 devices") && e.contains("cluster has 4"), "{e}");
    // Fewer specs than the op has tensors indexed past the end in the lowering.
    let e = lowered("/strategies/3/inputs", json!([]));
    assert!(e.contains("give one spec per tensor"), "{e}");
    // A compute axis beyond the mesh indexed past its shape.
    let e = lowered("/strategies/3/compute_axes", json!([7]));
    assert!(e.contains("computes over mesh axes [7]") && e.contains("0..2"), "{e}");
    // A ZeRO stage beyond 3 ran as ZeRO-0 and was reported as "zero6".
    let e = lowered("/zero_stage", json!(6));
    assert!(e.contains("zero_stage 6") && e.contains("stages 0 to 3"), "{e}");
}
