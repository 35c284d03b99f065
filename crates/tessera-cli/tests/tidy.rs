//! Code health as a test: the architecture's invariants (ARCHITECTURE.md) are checked here,
//! not just written down.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// `cargo metadata` of the workspace's own packages.
fn metadata() -> serde_json::Value {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("metadata is JSON")
}

/// Workspace crate → its normal (non-dev) dependencies, from `cargo metadata`.
fn dependency_graph() -> BTreeMap<String, BTreeSet<String>> {
    let meta = metadata();
    let mut graph = BTreeMap::new();
    for pkg in meta["packages"].as_array().expect("packages") {
        let name = pkg["name"].as_str().expect("name").to_string();
        let deps = pkg["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null()) // normal dependencies only
            .map(|d| d["name"].as_str().expect("dep name").to_string())
            .collect();
        graph.insert(name, deps);
    }
    graph
}

#[test]
fn crates_depend_only_downwards() {
    let graph = dependency_graph();
    // What each crate may depend on inside the workspace (ARCHITECTURE.md, "Invariants").
    let allowed: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("tessera-ir", &[][..]),
        // The ONNX importer builds IR graphs; the models wrap them as a family, the runtime
        // reads an ONNX file's initialisers as starting weights.
        ("tessera-onnx", &["tessera-ir"][..]),
        ("tessera-models", &["tessera-ir", "tessera-onnx"][..]),
        ("tessera-profile", &["tessera-ir"][..]),
        ("tessera-plan", &["tessera-ir", "tessera-profile"][..]),
        ("tessera-comm", &[][..]),
        ("tessera-runtime", &["tessera-ir", "tessera-comm", "tessera-onnx"][..]),
        // The GPU check binary builds real models and predicts their memory; the NCCL
        // transport implements tessera-comm's Communicator (a crate below the runtime).
        (
            "tessera-cuda",
            &["tessera-ir", "tessera-comm", "tessera-runtime", "tessera-models", "tessera-profile"]
                [..],
        ),
        (
            "tessera-cli",
            &[
                "tessera-ir",
                "tessera-models",
                "tessera-profile",
                "tessera-plan",
                "tessera-comm",
                "tessera-runtime",
                "tessera-cuda",
            ][..],
        ),
        // The Python package calls the CLI's own command code, so its objects are the JSON the
        // commands print; it reaches nothing below.
        ("tessera-py", &["tessera-cli"][..]),
    ]);
    for (krate, deps) in &graph {
        let Some(ok) = allowed.get(krate.as_str()) else {
            panic!(
                "crate {krate} is not listed in the layering table of tidy.rs / ARCHITECTURE.md"
            );
        };
        for d in deps.iter().filter(|d| d.starts_with("tessera")) {
            assert!(ok.contains(&d.as_str()), "{krate} must not depend on {d}");
        }
    }
}

#[test]
fn ir_profiler_and_models_never_touch_a_tensor_library() {
    let graph = dependency_graph();
    for krate in ["tessera-ir", "tessera-onnx", "tessera-models", "tessera-profile"] {
        for d in &graph[krate] {
            for banned in ["candle", "tch", "ndarray", "cudarc", "burn"] {
                assert!(!d.starts_with(banned), "{krate} depends on tensor library {d}");
            }
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_source_file_opens_with_a_module_doc() {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(workspace_root().join("crates")).expect("crates dir") {
        let src = entry.expect("entry").path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 10, "found only {} source files", files.len());
    let missing: Vec<_> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("utf-8 source");
            !text.trim_start().starts_with("//!")
        })
        .collect();
    assert!(missing.is_empty(), "files without a `//!` module doc: {missing:?}");
}

/// The matches that define an op — its shape inference, FLOPs, bytes, aliasing, workspace and
/// VJP (`ops/mod.rs`), its reference semantics (`interp/mod.rs`), its sharding rule (`rules.rs`),
/// its FLOP profile (`flops.rs`) and its kernel (`kernels/mod.rs`) — have no wildcard arm (`_`
/// or a bare binding), so a new op does not compile until each exists. Passes that rewrite a
/// few ops and keep the rest (the lowering's `localize`, say) may use one.
#[test]
fn op_definitions_have_no_wildcard_arm() {
    let root = workspace_root().join("crates");
    let files = [
        "tessera-ir/src/ops/mod.rs",
        "tessera-ir/src/interp/mod.rs",
        "tessera-plan/src/rules.rs",
        "tessera-profile/src/flops.rs",
        "tessera-runtime/src/kernels/mod.rs",
    ];
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(root.join(f)).expect("source file");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").trim_start();
            let Some((pattern, _)) = code.split_once("=>") else { continue };
            let pattern = pattern.split(" if ").next().unwrap_or("").trim();
            let bare = !pattern.is_empty()
                && pattern
                    .chars()
                    .all(|c| c == '_' || c.is_ascii_lowercase() || c.is_ascii_digit());
            if bare && !["true", "false"].contains(&pattern) && !code.starts_with('|') {
                found.push(format!("{f}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "wildcard arms in op definitions:\n{}", found.join("\n"));
}

/// Every Rust file directly under a crate's `tests/`, and every module folder there, is compiled:
/// it is a test target's root or a `mod` of one. Most crates gather their integration tests into
/// one program (`tests/all.rs`, `autotests = false`), so a file no target names would otherwise
/// be a test that silently never runs.
#[test]
fn every_test_file_is_compiled() {
    let meta = metadata();
    let mut unreached = Vec::new();
    for pkg in meta["packages"].as_array().expect("packages") {
        let manifest = PathBuf::from(pkg["manifest_path"].as_str().expect("manifest_path"));
        let tests = manifest.parent().expect("crate dir").join("tests");
        let Ok(entries) = std::fs::read_dir(&tests) else { continue };
        let roots: Vec<PathBuf> = pkg["targets"]
            .as_array()
            .expect("targets")
            .iter()
            .filter(|t| t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "test")))
            .map(|t| PathBuf::from(t["src_path"].as_str().expect("src_path")))
            .collect();
        let mut reached: BTreeSet<String> = BTreeSet::new();
        for root in &roots {
            // A folder target (`tests/x/main.rs`) reaches the folder.
            let named = match root.file_stem() {
                Some(s) if s == "main" || s == "mod" => root.parent().and_then(|d| d.file_name()),
                s => s,
            };
            if let Some(name) = named {
                reached.insert(name.to_string_lossy().into_owned());
            }
            let text = std::fs::read_to_string(root).expect("read a test root");
            reached.extend(text.lines().filter_map(|l| {
                let name = l.trim().strip_prefix("mod ")?.strip_suffix(';')?;
                Some(name.to_string())
            }));
        }
        for entry in entries {
            let path = entry.expect("read tests/").path();
            let is_module_dir = path.join("mod.rs").is_file() || path.join("main.rs").is_file();
            let is_rust_file = path.extension().is_some_and(|e| e == "rs");
            if !(is_rust_file || path.is_dir() && is_module_dir) {
                continue;
            }
            let stem = path.file_stem().expect("a name").to_string_lossy().into_owned();
            if !reached.contains(&stem) {
                unreached.push(path.strip_prefix(workspace_root()).unwrap_or(&path).to_path_buf());
            }
        }
    }
    assert!(
        unreached.is_empty(),
        "test files no test target compiles (add a `mod` line to the crate's tests/all.rs, or a \
         [[test]] to its Cargo.toml): {unreached:?}"
    );
}
