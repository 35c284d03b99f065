//! Issue 43, through the binary: nothing a user had is lost to a misused flag, and every load
//! checks what it reads. Each case fails naming the cause and the fix (or does the right
//! thing), and every file that was there before is byte-identical after. One tiny checkpoint
//! (1 step) is trained once and copied into each test's directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");
const TINY: [&str; 8] = ["--devices", "1", "--batch", "2", "--seq", "16", "--eval-batches", "0"];

fn tessera_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(BIN).current_dir(cwd).args(args).output().expect("tessera runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lost-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `train` of the tiny run for `steps` steps, with `extra`.
fn train(cwd: &Path, steps: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--steps", steps];
    args.extend(TINY);
    args.extend(extra);
    tessera_in(cwd, &args)
}

/// The shared 1-step checkpoint (trained once per test process).
fn fixture() -> &'static Path {
    static CK: OnceLock<PathBuf> = OnceLock::new();
    CK.get_or_init(|| {
        let dir = temp("fixture");
        let out = train(&dir, "1", &["--save", "ck"]);
        assert!(out.status.success(), "{}", stderr(&out));
        dir.join("ck")
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Every file under `dir` (lock files aside), with its length and a hash of its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (usize, u64)> {
    let mut all = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                todo.push(p);
            } else if meta.is_file() && !p.to_string_lossy().ends_with(".lock") {
                use std::hash::{Hash, Hasher};
                let bytes = std::fs::read(&p).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                bytes.hash(&mut h);
                all.insert(p.clone(), (bytes.len(), h.finish()));
            }
        }
    }
    all
}

/// Asserts that `out` failed saying every one of `says`.
fn refused(out: &Output, says: &[&str]) {
    let e = stderr(out);
    assert!(!out.status.success(), "succeeded: {e}");
    for s in says {
        assert!(e.contains(s), "missing {s:?} in: {e}");
    }
}

#[test]
fn export_never_replaces_a_source_an_ancestor_or_a_checkpoint_even_with_force() {
    let root = temp("export");
    let runs = root.join("runs");
    copy_dir(fixture(), &runs.join("ck1"));
    copy_dir(fixture(), &runs.join("ck2"));
    std::fs::write(runs.join("notes.txt"), "mine").unwrap();
    std::fs::create_dir(root.join("mine")).unwrap();
    std::fs::write(root.join("mine/tokenizer.json"), "{}").unwrap();
    let before = snapshot(&root);
    let export = |cwd: &Path, ck: &str, hf: &str| {
        tessera_in(cwd, &["export", "--checkpoint", ck, "--hf", hf, "--force"])
    };
    let root_s = root.to_str().unwrap().to_string();
    let parent = root.parent().unwrap().to_str().unwrap().to_string();
    let mine = format!("{root_s}/mine");
    let (root_s, parent, mine) = (root_s.as_str(), parent.as_str(), mine.as_str());
    for (cwd, ck, hf, says) in [
        (&root, "runs/ck1", "runs", "holds the checkpoint being exported"),
        (&root, "runs/ck1", "runs/ck1", "is the checkpoint being exported"),
        (&root, "runs/ck1", "runs/ck1/../ck1", "is the checkpoint being exported"),
        (&root, "runs/ck1", root_s, "holds the checkpoint being exported"),
        (&root, "runs/ck1", parent, "holds the checkpoint being exported"),
        (&root.join("mine"), "../runs/ck1", mine, "the working directory"),
        (&root, "runs/ck1", "runs/ck2", "is a Tessera checkpoint"),
        (&root, "runs/ck1", "mine", "files an export did not write (tokenizer.json)"),
        (&root, "runs/ck1", "runs/ck1/hf", "inside the checkpoint being exported"),
    ] {
        let out = export(cwd, ck, hf);
        refused(&out, &["--hf", says, "give a"]);
    }
    assert_eq!(snapshot(&root), before, "a refused export changed files");
    // An export replaces an export (its marker says so), and nothing else is touched.
    for _ in 0..2 {
        let out = tessera_in(&root, &["export", "--checkpoint", "runs/ck1", "--hf", "hf"]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let mut names: Vec<_> = std::fs::read_dir(root.join("hf"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["config.json", "model.safetensors", "tessera-export.json"]);
    let after = snapshot(&root);
    assert!(before.iter().all(|(p, b)| after.get(p) == Some(b)), "the export changed files");
}

#[test]
fn save_over_another_runs_checkpoint_is_refused_before_step_1() {
    let root = temp("save");
    copy_dir(fixture(), &root.join("other"));
    std::fs::create_dir(root.join("notes")).unwrap();
    std::fs::write(root.join("notes/a.txt"), "mine").unwrap();
    copy_dir(fixture(), &root.join("mine"));
    let before = snapshot(&root);
    // Another run's checkpoint (another seed: a new run), and a directory of other files.
    let out = train(&root, "1", &["--seed", "7", "--save", "other"]);
    refused(&out, &["--save other holds the checkpoint", "--resume other", "--overwrite-save"]);
    assert!(!stderr(&out).contains("step 1/"), "it trained");
    let out = train(&root, "1", &["--save", "notes"]);
    refused(&out, &["notes exists and is not a Tessera checkpoint", "another checkpoint path"]);
    // Resuming another checkpoint does not make this one the run's.
    let out = train(&root, "2", &["--resume", "mine", "--save", "other"]);
    refused(&out, &["this run resumes mine, not other", "--overwrite-save"]);
    assert_eq!(snapshot(&root), before, "a refused run changed files");
    // The flag that names the replacement, and a resume of the same directory, both save.
    let out = train(&root, "1", &["--seed", "7", "--save", "other", "--overwrite-save"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let manifest = std::fs::read_to_string(root.join("other/manifest.json")).unwrap();
    assert!(manifest.contains("\"seed\": 7"), "{manifest}");
    let out = train(&root, "2", &["--seed", "7", "--resume", "other", "--save", "other"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[cfg(unix)]
#[test]
fn output_flags_write_through_links_into_fifos_and_to_stdout_leaving_no_temporary_file() {
    let root = temp("outputs");
    std::fs::create_dir(root.join("real")).unwrap();
    std::fs::write(root.join("real/plan.json"), "old").unwrap();
    std::os::unix::fs::symlink("real/plan.json", root.join("link.json")).unwrap();
    let plan = |out: &str| {
        tessera_in(
            &root,
            &[
                "plan",
                "--model",
                "gpt2-tiny",
                "--cluster",
                "2xcpu",
                "--format",
                "json",
                "--out",
                out,
            ],
        )
    };
    let out = plan("link.json");
    assert!(out.status.success(), "{}", stderr(&out));
    let link = std::fs::symlink_metadata(root.join("link.json")).unwrap();
    assert!(link.file_type().is_symlink(), "the link was replaced by a file");
    let written = std::fs::read_to_string(root.join("real/plan.json")).unwrap();
    assert!(written.contains("\"version\""), "{written}");

    let fifo = root.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let out = plan("fifo");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(reader.join().unwrap().contains("\"version\""));
    use std::os::unix::fs::FileTypeExt as _;
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "FIFO replaced");

    let out = plan("-");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"version\""));
    assert!(!root.join("-").exists(), "`-` became a file");

    // A write that fails (into a directory that does not exist) leaves nothing behind.
    let out = plan("gone/plan.json");
    refused(&out, &["gone"]);
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .chain(std::fs::read_dir(root.join("real")).unwrap())
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["fifo", "link.json", "plan.json", "real"], "temporary files left");
}

/// Rewrites the manifest of `dir` through `edit` (unsealed: what a hand edit leaves).
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn loads_refuse_a_tampered_manifest_or_config_and_say_what_an_old_checkpoint_lacks() {
    let root = temp("loads");
    let cases = [
        ("empty", "manifest.json", "not a sound Tessera manifest"),
        ("flipped", "manifest.json", "manifest.json"),
        ("config", "config.json", "bytes, but"),
        ("missing", "manifest.json", "missing, but"),
    ];
    for (name, _, _) in cases {
        copy_dir(fixture(), &root.join(name));
    }
    std::fs::write(root.join("empty/manifest.json"), "{}").unwrap();
    let m = root.join("flipped/manifest.json");
    let mut bytes = std::fs::read(&m).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(&m, bytes).unwrap();
    edit_json(&root.join("config/config.json"), |c| c["layer_norm_epsilon"] = 0.5.into());
    std::fs::remove_file(root.join("missing/manifest.json")).unwrap();
    let before = snapshot(&root);
    for (name, file, says) in cases {
        let runs: [Vec<&str>; 3] = [
            vec!["eval", "--model-dir", name, "--tokens", "1,2,3,4"],
            vec!["generate", "--model-dir", name, "--prompt", "hi", "--max-new-tokens", "2"],
            vec![
                "train",
                "--devices",
                "1",
                "--steps",
                "1",
                "--batch",
                "2",
                "--seq",
                "16",
                "--init",
                name,
            ],
        ];
        for args in runs {
            let out = tessera_in(&root, &args);
            refused(&out, &[file, says, "re-save"]);
        }
    }
    assert_eq!(snapshot(&root), before);

    // A checkpoint saved before checksums loads, saying what could not be checked.
    let old = root.join("old");
    copy_dir(fixture(), &old);
    let text = std::fs::read_to_string(old.join("manifest.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let map = v.as_object_mut().unwrap();
    map.remove("checksums");
    map.remove("manifest_xxh3");
    std::fs::write(old.join("manifest.json"), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let out = tessera_in(&root, &["eval", "--model-dir", "old", "--tokens", "1,2,3,4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("saved before checkpoints carried checksums"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn init_and_resume_flags_that_contradict_are_refused_naming_the_fix() {
    let root = temp("flags");
    copy_dir(fixture(), &root.join("ck"));
    let before = snapshot(&root);
    let out = train(&root, "1", &["--init", "ck", "--resume", "ck"]);
    refused(&out, &["--init ck and --resume ck both say where the run starts", "drop --init"]);
    let out = train(&root, "1", &["--init", "ck", "--model", "gpt2-small"]);
    refused(&out, &["--model gpt2-small and --init ck disagree", "drop --model"]);
    let out = train(&root, "1", &["--init", "ck", "--model", "gpt2-tiny"]);
    assert!(out.status.success(), "the same model: {}", stderr(&out));
    // A resumed run keeps its settings: a changed one is refused with the saved value.
    for (flag, value, says) in [
        ("--weight-decay", "0.5", "resume with --weight-decay 0.1"),
        ("--max-grad-norm", "2", "resume with --max-grad-norm 1"),
        ("--schedule", "constant", "resume with --schedule cosine"),
        ("--warmup", "1", "resume with --warmup 0"),
        ("--lr", "0.01", "resume with --lr 0.001"),
    ] {
        let out = tessera_in(
            &root,
            &["train", "--devices", "1", "--steps", "2", "--batch", "2", "--seq", "16"]
                .into_iter()
                .chain(["--eval-batches", "0", "--resume", "ck", flag, value])
                .collect::<Vec<_>>(),
        );
        refused(&out, &[flag, says]);
    }
    assert_eq!(snapshot(&root), before);
}
