//! `tessera eval --inputs IN.safetensors --outputs OUT.safetensors [--grads]` through the
//! binary: the written `logits` and `loss` reproduce `transformers`' (the parity fixtures of
//! `tests/fixtures/hf` and `hf_moe`: GPT-2, LLaMA, Mixtral) and PyTorch's on imported ONNX
//! models (GPT-2, ViT), whose `reference.safetensors` also holds every parameter's gradient
//! (`grad.<name>`), the reference for `--grads`; a finite difference of the loss through the
//! same command checks one more; bad inputs are refused by name.

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("eval-io-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// A named tensor: dtype, shape, little-endian bytes.
#[derive(Clone)]
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Raw {
    fn i64s(shape: &[usize], v: &[i64]) -> Raw {
        Raw {
            dtype: Dtype::I64,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    fn f32s(shape: &[usize], v: &[f32]) -> Raw {
        Raw {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    fn values(&self) -> Vec<f64> {
        match self.dtype {
            Dtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            Dtype::I64 => self
                .data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            other => panic!("unexpected dtype {other:?}"),
        }
    }
}

fn read(path: &Path) -> BTreeMap<String, Raw> {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (n, Raw { dtype: v.dtype(), shape: v.shape().to_vec(), data: v.data().to_vec() })
        })
        .collect()
}

fn write(path: &Path, tensors: &[(&str, Raw)]) {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(n, r)| (*n, TensorView::new(r.dtype, r.shape.clone(), &r.data).unwrap()))
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

/// Runs `eval --inputs --outputs [--grads] --format json` and returns stdout's JSON and the
/// outputs read back.
fn eval(
    model: &Path,
    inputs: &[(&str, Raw)],
    grads: bool,
    tag: &str,
) -> (Value, BTreeMap<String, Raw>) {
    let dir = scratch(tag);
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    write(&inp, inputs);
    let mut args = vec![
        "eval",
        "--model-dir",
        model.to_str().unwrap(),
        "--inputs",
        inp.to_str().unwrap(),
        "--outputs",
        out.to_str().unwrap(),
        "--format",
        "json",
    ];
    if grads {
        args.push("--grads");
    }
    let o = tessera(&args);
    assert!(o.status.success(), "{tag}: eval failed: {}", String::from_utf8_lossy(&o.stderr));
    let doc: Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    (doc, read(&out))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// The hf parity fixture's 16 tokens as `input_ids` = ids[..15], `labels` = ids[1..], and
/// transformers' logits `[15, V]` and f64 mean cross-entropy.
fn hf_case(dir: &Path) -> (Vec<(&'static str, Raw)>, Vec<f64>, f64) {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids: Vec<i64> =
        expected["tokens"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
    let n = ids.len() - 1;
    let logits: Vec<f64> = expected["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
        .collect();
    let inputs = vec![
        ("input_ids", Raw::i64s(&[1, n], &ids[..n])),
        ("labels", Raw::i64s(&[1, n], &ids[1..])),
    ];
    (inputs, logits, expected["loss"].as_f64().unwrap())
}

#[test]
fn outputs_reproduce_transformers_logits_and_loss() {
    for (set, name) in [("hf", "gpt2"), ("hf", "llama"), ("hf_moe", "mixtral")] {
        let dir = fixtures().join(set).join(name);
        let (inputs, want, want_loss) = hf_case(&dir);
        let (doc, out) = eval(&dir, &inputs, false, name);
        let logits = &out["logits"];
        assert_eq!(logits.shape, [1, 15, want.len() / 15], "{name}: logits shape");
        let err = max_abs_diff(&logits.values(), &want);
        assert!(err <= 1e-4, "{name}: logits differ from transformers' by {err:e}");
        let loss = out["loss"].values()[0];
        assert!((loss - want_loss).abs() <= 1e-5 * want_loss, "{name}: loss {loss} vs {want_loss}");
        assert_eq!(doc["loss"].as_f64().unwrap() as f32, loss as f32, "{name}: reported loss");
        assert_eq!(out.len(), 2, "{name}: logits and loss only: {:?}", out.keys());

        // Without the labels: the logits alone, the same.
        let (doc, out) = eval(&dir, &inputs[..1], false, &format!("{name}-nolabels"));
        assert!(doc["loss"].is_null(), "{name}: no labels, no loss: {doc}");
        assert_eq!(out.keys().collect::<Vec<_>>(), ["logits"]);
        assert!(max_abs_diff(&out["logits"].values(), &want) <= 1e-4);
    }
}

/// ‖got − want‖ / max(‖want‖, floor), per gradient.
fn rel_err(got: &[f64], want: &[f64], floor: f64) -> f64 {
    let diff = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
    let norm = want.iter().map(|b| b * b).sum::<f64>().sqrt();
    diff / norm.max(floor)
}

#[test]
fn grads_reproduce_pytorch_on_imported_models() {
    for (name, data) in [("gpt2", ["input_ids", "labels"]), ("vit", ["pixel_values", "labels"])] {
        let dir = fixtures().join("onnx").join(name);
        let reference = read(&dir.join("reference.safetensors"));
        let inputs: Vec<(&str, Raw)> = data.iter().map(|&n| (n, reference[n].clone())).collect();
        let (_, out) = eval(&dir.join("model.onnx"), &inputs, true, &format!("onnx-{name}"));
        let err = max_abs_diff(&out["logits"].values(), &reference["logits"].values());
        assert!(err <= 1e-4, "{name}: logits differ from PyTorch's by {err:e}");
        let (loss, want) = (out["loss"].values()[0], reference["loss"].values()[0]);
        assert!((loss - want).abs() <= 1e-5 * want, "{name}: loss {loss} vs {want}");
        let want_grads: Vec<&String> =
            reference.keys().filter(|k| k.starts_with("grad.")).collect();
        let got_grads: Vec<&String> = out.keys().filter(|k| k.starts_with("grad.")).collect();
        assert_eq!(got_grads, want_grads, "{name}: one gradient per parameter, by PyTorch's names");
        // Some gradients are zero in exact arithmetic (fp32 noise in both): measure against a
        // floor of 1e-3 of all gradients' norm (as tests/onnx.rs does).
        let total = want_grads
            .iter()
            .flat_map(|k| reference[*k].values())
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt();
        for k in want_grads {
            assert_eq!(out[k].shape, reference[k].shape, "{name}: {k} shape");
            let e = rel_err(&out[k].values(), &reference[k].values(), 1e-3 * total);
            assert!(e < 1e-3, "{name}: {k}: relative error {e:.2e} against PyTorch");
        }
    }
}

/// A copy of checkpoint `dir` with `param[index] += delta`.
fn perturbed(dir: &Path, param: &str, index: usize, delta: f32, tag: &str) -> PathBuf {
    let to = scratch(tag);
    std::fs::copy(dir.join("config.json"), to.join("config.json")).unwrap();
    let mut weights = read(&dir.join("model.safetensors"));
    let w = weights.get_mut(param).unwrap_or_else(|| panic!("no {param}"));
    let mut v: Vec<f32> = w.values().iter().map(|&x| x as f32).collect();
    v[index] += delta;
    *w = Raw::f32s(&w.shape.clone(), &v);
    let list: Vec<(&str, Raw)> = weights.iter().map(|(k, r)| (k.as_str(), r.clone())).collect();
    write(&to.join("model.safetensors"), &list);
    to
}

#[test]
fn grads_match_finite_differences_of_the_loss() {
    let dir = fixtures().join("hf/llama");
    let (inputs, _, _) = hf_case(&dir);
    let (_, out) = eval(&dir, &inputs, true, "fd");
    let names: Vec<&String> = out.keys().filter(|k| k.starts_with("grad.")).collect();
    assert!(names.len() > 10, "every trainable parameter: {names:?}");
    for param in ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"] {
        let g = out[&format!("grad.{param}")].values();
        let (i, &want) =
            g.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
        let h = 1e-2f32;
        let loss_at = |d: f32, tag: &str| {
            let m = perturbed(&dir, param, i, d, tag);
            eval(&m, &inputs, false, &format!("{tag}-eval")).1["loss"].values()[0]
        };
        let fd = (loss_at(h, "fd-plus") - loss_at(-h, "fd-minus")) / (2.0 * h as f64);
        assert!(
            (fd - want).abs() <= 2e-2 * want.abs(),
            "{param}[{i}]: --grads {want}, finite difference {fd}"
        );
    }
}

fn refused(model: &Path, inputs: &[(&str, Raw)], extra: &[&str], tag: &str) -> String {
    let dir = scratch(tag);
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    write(&inp, inputs);
    let mut args = vec![
        "eval",
        "--model-dir",
        model.to_str().unwrap(),
        "--inputs",
        inp.to_str().unwrap(),
        "--outputs",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = tessera(&args);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{tag}: accepted");
    assert!(!stderr.contains("panicked"), "{tag}: {stderr}");
    assert!(!out.exists(), "{tag}: wrote outputs");
    stderr
}

/// A bad `--inputs` file: its tensors, extra flags, and what the error must say.
type Case<'a> = (Vec<(&'a str, Raw)>, &'a [&'a str], &'a [&'a str]);

#[test]
fn bad_inputs_are_refused_by_name() {
    let dir = fixtures().join("hf/gpt2");
    let ids = Raw::i64s(&[2, 4], &[1, 2, 3, 4, 5, 6, 7, 8]);
    let cases: Vec<Case> = vec![
        // An unknown name: listed against the model's inputs.
        (
            vec![("input_ids", ids.clone()), ("attention_mask", ids.clone())],
            &[],
            &["`attention_mask` is not an input", "`input_ids` (i64 [2, 4])", "`labels`"],
        ),
        // The model output's input missing.
        (vec![("labels", ids.clone())], &[], &["missing `input_ids` (i64 [2, 4])"]),
        // A dtype and a shape the graph does not take.
        (
            vec![("input_ids", Raw::f32s(&[2, 4], &[0.0; 8]))],
            &[],
            &["`input_ids` is f32 [2, 4]", "takes i64 [2, 4]"],
        ),
        (
            vec![("input_ids", ids.clone()), ("labels", Raw::i64s(&[2, 3], &[0; 6]))],
            &[],
            &["`labels` is i64 [2, 3]", "takes i64 [2, 4]", "batch 2, sequence 4"],
        ),
        // Gradients without the loss's inputs.
        (vec![("input_ids", ids.clone())], &["--grads"], &["--grads", "`labels`"]),
        // Nothing at all.
        (vec![], &[], &["holds no tensor", "`input_ids`"]),
    ];
    for (k, (inputs, extra, wants)) in cases.iter().enumerate() {
        let stderr = refused(&dir, inputs, extra, &format!("bad-{k}"));
        assert_eq!(stderr.lines().count(), 1, "case {k}: one line: {stderr}");
        for want in *wants {
            assert!(stderr.contains(want), "case {k}: `{want}` not in: {stderr}");
        }
    }
    // Token ids outside the vocabulary: a clear error, not a panic.
    let stderr = refused(&dir, &[("input_ids", Raw::i64s(&[1, 2], &[1, 100_000]))], &[], "oov");
    assert!(stderr.starts_with("error:"), "{stderr}");
    // --inputs with --tokens is a usage error.
    let o = tessera(&[
        "eval",
        "--model-dir",
        dir.to_str().unwrap(),
        "--inputs",
        "x",
        "--outputs",
        "y",
        "--tokens",
        "1,2",
    ]);
    assert_eq!(o.status.code(), Some(2));
}
