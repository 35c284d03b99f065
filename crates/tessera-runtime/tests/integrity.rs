//! Checkpoint integrity (issue 17): flipped bytes in any file of a checkpoint are found by every
//! reader and named down to the tensor; non-finite weights are refused by name; a checkpoint
//! from before checksums still loads; the lock, the room check and file modes.

use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use tessera_runtime::checkpoint::{load_checkpoint, preflight_save, save_checkpoint, Manifest};
use tessera_runtime::integrity::verify_checkpoint;
use tessera_runtime::mapped::MappedCheckpoint;
use tessera_runtime::LrSchedule;

fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("integrity-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tensor(values: &[f32], dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(values.to_vec(), dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn ramp(n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 - n as f32 / 2.0) * scale).collect()
}

/// A small checkpoint: two parameters (one bf16) and their AdamW state.
fn save(dir: &Path, bias: &[f32]) {
    let params = vec![
        ("h.0.weight".to_string(), tensor(&ramp(64, 0.01), &[8, 8], DType::F32)),
        ("h.0.bias".to_string(), tensor(bias, &[8], DType::BF16)),
    ];
    let optimizer = vec![
        ("h.0.weight.adam_m".to_string(), tensor(&ramp(64, 0.001), &[8, 8], DType::F32)),
        ("h.0.weight.adam_v".to_string(), tensor(&ramp(64, 0.0001), &[8, 8], DType::F32)),
        ("h.0.bias.adam_m".to_string(), tensor(&ramp(8, 0.1), &[8], DType::F32)),
        ("h.0.bias.adam_v".to_string(), tensor(&ramp(8, 0.2), &[8], DType::F32)),
        ("h.0.bias.master".to_string(), tensor(bias, &[8], DType::F32)),
    ];
    let schedule = LrSchedule::Constant { lr: 1e-3 };
    let manifest = Manifest::new(5, 10, 7, "test", schedule);
    let config = serde_json::json!({"model_type": "test", "hidden_size": 8});
    save_checkpoint(dir, &config, &params, &optimizer, &manifest).unwrap();
}

/// The byte ranges of a safetensors file's header and each tensor's data.
fn regions(path: &Path) -> Vec<(String, std::ops::Range<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut out = vec![("header".to_string(), 8..8 + n)];
    for (name, info) in meta.tensors() {
        out.push((name, 8 + n + info.data_offsets.0..8 + n + info.data_offsets.1));
    }
    out
}

/// Flips up to 16 bytes from `at` (not past `end`) of the file at `path`.
fn flip(path: &Path, at: usize, end: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    for b in &mut bytes[at..end.min(at + 16)] {
        *b ^= 0x5a;
    }
    std::fs::write(path, bytes).unwrap();
}

/// Every reader's error on the checkpoint at `dir`, reading every tensor.
fn every_reader(dir: &Path) -> Vec<String> {
    let mapped = MappedCheckpoint::open(dir).and_then(|c| {
        for t in [&c.params, &c.optimizer] {
            let shapes: Vec<(String, Vec<usize>, DType)> =
                t.shapes().map(|(n, s, d)| (n.to_string(), s.to_vec(), d)).collect();
            for (name, shape, dtype) in shapes {
                t.read(&name, &vec![0; shape.len()], &shape, dtype)?;
            }
        }
        Ok(())
    });
    [
        load_checkpoint(dir).err().map(|e| e.to_string()),
        mapped.err().map(|e| e.to_string()),
        verify_checkpoint(dir).err().map(|e| e.to_string()),
    ]
    .into_iter()
    .map(|e| e.unwrap_or_else(|| "no error".into()))
    .collect()
}

#[test]
fn flipped_bytes_anywhere_are_found_by_every_reader_and_named() {
    let root = scratch("flipped");
    let pristine = root.join("pristine");
    save(&pristine, &ramp(8, 0.5));
    let report = verify_checkpoint(&pristine).unwrap();
    assert_eq!((report.files_checked, report.tensors, report.checksums), (3, 7, true));
    let dir = root.join("ckpt");
    let mut detected = 0;
    // Every region of each safetensors file: the header and each tensor's bytes.
    for file in ["model.safetensors", "optimizer.safetensors"] {
        for (what, range) in regions(&pristine.join(file)) {
            let _ = std::fs::remove_dir_all(&dir);
            copy_dir(&pristine, &dir);
            // The header's JSON starts 8 bytes in: flip inside it, past the '{'.
            let at = if what == "header" { range.start + 4 } else { range.start };
            flip(&dir.join(file), at, range.end);
            for e in every_reader(&dir) {
                assert!(e.contains(file), "{file} {what}: {e}");
                if what != "header" {
                    // A header still readable names the tensor; a broken one the file.
                    assert!(
                        e.contains(&format!("tensor {what}")) || e.contains("not a valid"),
                        "{file} {what}: {e}"
                    );
                }
            }
            detected += 1;
        }
    }
    // The JSON files: a digit of the config, the step in the manifest.
    for (file, from, to) in [
        ("config.json", "\"hidden_size\": 8", "\"hidden_size\": 9"),
        ("manifest.json", "\"step\": 5", "\"step\": 6"),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&pristine, &dir);
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        assert!(text.contains(from), "{text}");
        std::fs::write(dir.join(file), text.replacen(from, to, 1)).unwrap();
        for e in every_reader(&dir) {
            assert!(e.contains(file) && e.contains("checksum mismatch"), "{file}: {e}");
        }
        detected += 1;
    }
    assert_eq!(detected, 2 + 2 + 5 + 2, "header + tensors of both files, both JSON files");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let dir = scratch("nan").join("ckpt");
    let mut bias = ramp(8, 0.5);
    bias[3] = f32::NAN;
    save(&dir, &bias);
    for e in every_reader(&dir) {
        assert!(
            e.contains("tensor h.0.bias ") && e.contains("NaN") && e.contains("element 3"),
            "{e}"
        );
    }
}

#[test]
fn a_checkpoint_saved_before_checksums_still_loads() {
    let dir = scratch("old").join("ckpt");
    save(&dir, &ramp(8, 0.5));
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let doc = m.as_object_mut().unwrap();
    assert!(doc.remove("checksums").is_some() && doc.remove("manifest_xxh3").is_some());
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    assert_eq!(every_reader(&dir), ["no error"; 3]);
    let report = verify_checkpoint(&dir).unwrap();
    assert_eq!((report.files_checked, report.tensors, report.checksums), (0, 7, false));
}

#[test]
fn a_second_writer_is_locked_out_until_the_first_ends() {
    let dir = scratch("lock").join("ckpt");
    let first = tessera_runtime::host::lock_dir(&dir).unwrap();
    let e = tessera_runtime::host::lock_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("being written by another run")
            && e.contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    drop(first);
    tessera_runtime::host::lock_dir(&dir).unwrap();
}

#[test]
fn a_save_that_would_not_fit_is_refused_before_training() {
    let dir = scratch("room").join("ckpt");
    let free = tessera_runtime::host::available_disk(&dir).expect("statvfs works here");
    preflight_save(&dir, 1 << 20).unwrap();
    let e = preflight_save(&dir, free.saturating_mul(4)).unwrap_err().to_string();
    assert!(e.contains("free but one checkpoint of this run needs about"), "{e}");
}

#[cfg(unix)]
#[test]
fn saved_files_follow_the_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch("modes").join("ckpt");
    save(&dir, &ramp(8, 0.5));
    // The test process's umask, as the writer reads it.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let umask = u32::from_str_radix(
        status.lines().find_map(|l| l.strip_prefix("Umask:")).unwrap().trim(),
        8,
    )
    .unwrap();
    for f in ["config.json", "manifest.json", "model.safetensors", "optimizer.safetensors"] {
        let mode = std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask, "{f}: {mode:o}");
    }
}
