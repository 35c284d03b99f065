//! Runs that never lose work (issue 17), through the binary: the reliability drill
//! (`scripts/drill.sh`: kill -9 during saves on 1 and 4 devices and under MPI, flipped bytes in
//! every checkpoint file, full disks) at a small size, `tessera checkpoint verify`, and
//! non-finite weights refused by name before any training.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn tessera(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("tessera runs")
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("reliability-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_drill_loses_nothing_and_detects_every_corruption() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/drill.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).args(["--bin", BIN, "--kills", "3", "--steps", "6", "--seed", "17"]);
    if cfg!(feature = "mpi") {
        cmd.arg("--mpi");
    }
    let out = cmd.output().expect("bash runs");
    assert!(out.status.success(), "the drill failed:\n{}", stderr(&out));
    let figures: Value = serde_json::from_slice(&out.stdout).expect("the drill prints JSON");
    let n = |k: &str| figures[k].as_u64().unwrap_or_else(|| panic!("{k} in {figures}"));
    let configs = if cfg!(feature = "mpi") { 3 } else { 2 };
    // Kills land at random moments; on any machine some land before a run ends.
    assert!(n("kills") >= 2, "{figures}\n{}", stderr(&out));
    assert_eq!(n("kills_survived"), n("kills"), "{figures}");
    assert_eq!(n("resumes_bit_exact"), configs, "{figures}");
    assert_eq!(n("bytes_lost"), 0, "{figures}");
    // 1 device: model, optimizer, config, manifest; 4 devices: 4 rank files, config, manifest.
    assert_eq!(n("corruptions"), 4 + 6, "{figures}");
    assert_eq!(n("detected_by_verify"), n("corruptions"), "{figures}");
    assert_eq!(n("detected_by_resume"), n("corruptions"), "{figures}");
    assert_eq!(n("full_disk_checks"), 2, "{figures}");
    // Issue 43: 18 misuses refused (exports onto sources, ancestors and checkpoints with
    // --force, saves over another run's checkpoint, tampered manifests and configs loaded by
    // eval, generate and train --init, --init with --resume) with every file kept, and 3
    // output flags written through a link, a FIFO and stdout.
    assert_eq!(n("misuse_cases"), 21, "{figures}");
    assert_eq!(n("misuse_refused"), 18, "{figures}");
    assert_eq!(n("misuse_lost"), 0, "{figures}");
}

#[test]
fn verify_reports_a_sound_checkpoint_and_names_a_corrupt_tensor() {
    let dir = temp("verify");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let out = tessera(&[
        "train",
        "--devices",
        "1",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--eval-batches",
        "0",
        "--save",
        ck_s,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = tessera(&["checkpoint", "verify", ck_s, "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["files_checked"], 3, "{v}");
    assert_eq!(v["checksums"], true, "{v}");
    assert!(v["tensors"].as_u64().unwrap() > 10, "{v}");

    // 16 flipped bytes inside the first tensor of model.safetensors (the failure of the
    // issue: they used to load silently).
    let model = ck.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let (name, info) = meta.tensors().into_iter().next().unwrap();
    let at = 8 + n + info.data_offsets.0;
    for b in &mut bytes[at..at + 16] {
        *b ^= 0xff;
    }
    std::fs::write(&model, bytes).unwrap();
    let out = tessera(&["checkpoint", "verify", ck_s]);
    let e = stderr(&out);
    assert!(!out.status.success());
    assert!(e.contains("model.safetensors") && e.contains(&format!("tensor {name}")), "{e}");
    // And eval, which reads the weights as a resume does.
    let out = tessera(&["eval", "--model-dir", ck_s, "--tokens", "1,2,3,4"]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains(&format!("tensor {name}")), "{e}");
}

#[test]
fn nan_weights_are_refused_by_name_before_training() {
    let dir = temp("nan");
    let (ck, hf) = (dir.join("ck"), dir.join("hf"));
    let (ck_s, hf_s) = (ck.to_str().unwrap(), hf.to_str().unwrap());
    let small = ["--steps", "1", "--batch", "2", "--seq", "16", "--eval-batches", "0"];
    let mut args = vec!["train", "--devices", "1", "--save", ck_s];
    args.extend(small);
    assert!(tessera(&args).status.success());
    let out = tessera(&["export", "--checkpoint", ck_s, "--hf", hf_s]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Hugging Face weights (no checksums) with one NaN in a layer norm.
    let path = hf.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    let victim = "transformer.ln_f.weight";
    let t = &tensors[victim];
    let mut values = t.to_vec1::<f32>().unwrap();
    values[5] = f32::NAN;
    let nan = candle_core::Tensor::from_vec(values, t.dims(), t.device()).unwrap();
    tensors.insert(victim.to_string(), nan);
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let mut args = vec!["train", "--devices", "2", "--init", hf_s];
    args.extend(small);
    let out = tessera(&args);
    let e = stderr(&out);
    assert!(!out.status.success(), "trained from NaN weights");
    assert!(e.contains(victim) && e.contains("NaN") && e.contains("element 5"), "{e}");
    assert!(!e.contains("learning rate"), "{e}");
}

/// A killed run leaves a trace (issue 17: `--log-json` used to be written at exit only): every
/// step that ended before the kill is in the log.
#[test]
fn a_killed_run_leaves_its_steps_in_the_log() {
    let dir = temp("trace");
    let log = dir.join("steps.jsonl");
    let out = Command::new(BIN)
        .args(["train", "--devices", "1", "--steps", "5", "--batch", "2", "--seq", "16"])
        .args(["--eval-batches", "0", "--log-json", log.to_str().unwrap()])
        .env("TESSERA_FAULT", "rank=0,step=4,kind=kill")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the fault must end the run");
    let steps: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3], "{}", stderr(&out));
}

/// Numeric flags out of range are refused before anything is built (issue 17: `--lr -1`, a
/// negative weight decay or `--warmup` beyond `--steps` were accepted).
#[test]
fn flags_out_of_range_are_refused_naming_the_flag() {
    for (flags, says) in [
        (&["--lr=-1"][..], "'--lr <LR>': -1 is not a finite number in (0, 10]"),
        (&["--lr", "NaN"], "'--lr <LR>': NaN is not a finite number in (0, 10]"),
        (&["--weight-decay=-0.1"], "-0.1 is not a finite number in [0, 10]"),
        (&["--max-grad-norm=-1"], "-1 is not a finite number in [0, 1000000]"),
        (&["--warmup", "10"], "--warmup 10 is longer than the run (--steps 5)"),
        (&["--comm-timeout", "0"], "0 is not a finite number in (0, 1000000]: give seconds"),
    ] {
        let mut args = vec!["train", "--steps", "5"];
        args.extend(flags);
        let out = tessera(&args);
        let e = stderr(&out);
        assert!(!out.status.success() && e.contains(says), "{flags:?}: {e}");
        assert!(!e.contains("step 1/"), "{flags:?} trained: {e}");
    }
}

/// A plan whose simulated devices cannot fit in this machine's memory is refused before any
/// device allocates (issue 17: such a run was killed by the OOM killer after 80 s with no
/// message), and a vocabulary of 4e9 entries is a planning error, not an abort.
#[test]
fn runs_beyond_the_machines_memory_are_refused_before_step_1() {
    let out = tessera(&[
        "train",
        "--model",
        "gpt2-xl",
        "--devices",
        "4",
        "--plan",
        "dp4",
        "--batch",
        "64",
        "--seq",
        "1024",
        "--steps",
        "1",
        "--memory-budget",
        "4TiB",
    ]);
    let e = stderr(&out);
    assert!(!out.status.success(), "{e}");
    assert!(e.contains("of host memory (4 simulated device(s)") && e.contains("available"), "{e}");

    let dir = temp("vocab");
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type":"gpt2","vocab_size":4000000000,"n_positions":128,"n_embd":32,
            "n_layer":1,"n_head":2}"#,
    )
    .unwrap();
    let out =
        tessera(&["train", "--model", dir.to_str().unwrap(), "--devices", "1", "--steps", "1"]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("the least any plan needs is"), "{e}");
    assert!(!e.contains("panicked") && !e.contains("memory allocation"), "{e}");
}
