//! A folder of pictures (PNG/JPEG) with captions or classes, prepared as diffusers' training
//! scripts prepare them: decoded to RGB, the shorter side resized to `side` (PIL's `BILINEAR`,
//! which torchvision's `Resize` calls on a PIL image), centre-cropped to `side × side`
//! (torchvision's `CenterCrop` rounding) and scaled from 0..255 to `[-1, 1]`.
//!
//! - Pictures: the files ending `.png`, `.jpg` or `.jpeg` (any case) directly in the folder,
//!   sorted by name; or, when the folder holds no picture but sub-folders that do, one class
//!   per sub-folder (sorted names → classes 0, 1, ...).
//! - Captions: a `metadata.jsonl` in the folder (Hugging Face `imagefolder`'s convention: one
//!   `{"file_name": ..., "text": ..., "label": ...}` object a line, `file_name` relative to the
//!   folder) or, for a picture it does not list, a `.txt` beside it with the same stem (its
//!   text trimmed). A metadata `label` (an integer) gives the class where there are no class
//!   folders.
//! - What the model needs is checked here ([`Needs`]), with a [`PictureError`] naming the file.
//!
//! The resampler is PIL's (`Resample.c`): a separable triangle filter whose support widens by
//! the downscale factor, fixed-point coefficients of 22 fraction bits, a horizontal pass then a
//! vertical one, each rounded and clamped to 8 bits, so pixels equal PIL's exactly.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What is wrong with a picture folder.
#[derive(Debug, thiserror::Error)]
pub enum PictureError {
    #[error("--data {0}: not a directory of pictures (PNG/JPEG files)")]
    NotADirectory(String),
    #[error("--data {0}: no .png, .jpg or .jpeg pictures in it (nor in class sub-folders)")]
    Empty(String),
    #[error("--data: cannot read {path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error(
        "--data: {path} has no caption, and the model is text-conditioned: write {txt}, or a \
         line {{\"file_name\": \"{name}\", \"text\": ...}} in the folder's metadata.jsonl"
    )]
    NoCaption { path: String, txt: String, name: String },
    #[error(
        "--data: {path} has no class, and the model is class-conditional: put the pictures in \
         one sub-folder per class, or give each a \"label\" in metadata.jsonl"
    )]
    NoLabel { path: String },
    #[error(
        "--data: {path} has class {label}, but the model has {classes} classes (0..{classes})"
    )]
    LabelOutOfRange { path: String, label: i64, classes: usize },
    #[error("--data: {path} line {line}: {reason}")]
    BadMetadata { path: String, line: usize, reason: String },
}

type Result<T> = std::result::Result<T, PictureError>;

/// What the model conditions on, so the folder is checked for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Every picture needs a caption.
    Captions,
    /// Every picture needs a class below this count.
    Classes(usize),
    /// Pictures only.
    Nothing,
}

/// The prepared pictures of a folder.
#[derive(Clone, Debug)]
pub struct PictureFolder {
    /// The folder, for messages.
    pub source: String,
    /// The picture files, in order.
    pub files: Vec<PathBuf>,
    /// `[n, 3, side, side]`, row-major, in `[-1, 1]`.
    pub pixels: Vec<f32>,
    pub side: usize,
    /// Each picture's caption, if it has one.
    pub captions: Vec<Option<String>>,
    /// Each picture's class, if it has one.
    pub labels: Vec<Option<i64>>,
    /// The class sub-folders' names, when the classes come from them.
    pub class_names: Vec<String>,
}

#[derive(Deserialize)]
struct MetaLine {
    file_name: String,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    label: Option<i64>,
}

fn is_picture(p: &Path) -> bool {
    p.is_file()
        && p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
            e.eq_ignore_ascii_case("png")
                || e.eq_ignore_ascii_case("jpg")
                || e.eq_ignore_ascii_case("jpeg")
        })
}

fn unreadable(path: &Path, e: impl std::fmt::Display) -> PictureError {
    PictureError::Unreadable { path: path.display().to_string(), reason: e.to_string() }
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| unreadable(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| unreadable(dir, e)))
        .collect::<Result<_>>()?;
    v.sort();
    Ok(v)
}

/// `metadata.jsonl` by file name (relative to the folder).
fn read_metadata(dir: &Path) -> Result<BTreeMap<String, MetaLine>> {
    let path = dir.join("metadata.jsonl");
    let mut out = BTreeMap::new();
    if !path.is_file() {
        return Ok(out);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| unreadable(&path, e))?;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| PictureError::BadMetadata {
            path: path.display().to_string(),
            line: i + 1,
            reason,
        };
        let m: MetaLine = serde_json::from_str(line).map_err(|e| {
            bad(format!("{e} (each line is {{\"file_name\": ..., \"text\": ..., \"label\": ...}})"))
        })?;
        if !dir.join(&m.file_name).is_file() {
            return Err(bad(format!("`{}` is not a file in {}", m.file_name, dir.display())));
        }
        out.insert(m.file_name.clone(), m);
    }
    Ok(out)
}

impl PictureFolder {
    /// Loads and prepares every picture of `dir` at `side × side`, checking `needs`.
    pub fn load(dir: &Path, side: usize, needs: Needs) -> Result<PictureFolder> {
        let source = dir.display().to_string();
        if !dir.is_dir() {
            return Err(PictureError::NotADirectory(source));
        }
        let meta = read_metadata(dir)?;
        let entries = sorted_entries(dir)?;
        let mut files: Vec<PathBuf> = entries.iter().filter(|p| is_picture(p)).cloned().collect();
        let mut labels: Vec<Option<i64>> = Vec::new();
        let mut class_names = Vec::new();
        if files.is_empty() {
            for sub in entries.iter().filter(|p| p.is_dir()) {
                let pics: Vec<PathBuf> =
                    sorted_entries(sub)?.into_iter().filter(|p| is_picture(p)).collect();
                if pics.is_empty() {
                    continue;
                }
                let class = class_names.len() as i64;
                class_names.push(
                    sub.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
                );
                labels.extend(std::iter::repeat_n(Some(class), pics.len()));
                files.extend(pics);
            }
        } else {
            labels =
                files.iter().map(|f| meta.get(&relative(dir, f)).and_then(|m| m.label)).collect();
        }
        if files.is_empty() {
            return Err(PictureError::Empty(source));
        }
        let mut captions = Vec::with_capacity(files.len());
        for f in &files {
            let listed = meta.get(&relative(dir, f)).and_then(|m| m.text.clone());
            let caption = match listed {
                Some(t) => Some(t),
                None => {
                    let txt = f.with_extension("txt");
                    match txt.is_file() {
                        true => Some(
                            std::fs::read_to_string(&txt)
                                .map_err(|e| unreadable(&txt, e))?
                                .trim()
                                .to_string(),
                        ),
                        false => None,
                    }
                }
            };
            captions.push(caption);
        }
        for (i, f) in files.iter().enumerate() {
            match needs {
                Needs::Captions if captions[i].is_none() => {
                    return Err(PictureError::NoCaption {
                        path: f.display().to_string(),
                        txt: f.with_extension("txt").display().to_string(),
                        name: relative(dir, f),
                    })
                }
                Needs::Classes(classes) => match labels[i] {
                    None => return Err(PictureError::NoLabel { path: f.display().to_string() }),
                    Some(label) if label < 0 || label as usize >= classes => {
                        return Err(PictureError::LabelOutOfRange {
                            path: f.display().to_string(),
                            label,
                            classes,
                        })
                    }
                    Some(_) => {}
                },
                Needs::Captions | Needs::Nothing => {}
            }
        }
        let mut pixels = Vec::with_capacity(files.len() * 3 * side * side);
        for f in &files {
            pixels.extend(prepare(f, side)?);
        }
        Ok(PictureFolder { source, files, pixels, side, captions, labels, class_names })
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

fn relative(dir: &Path, f: &Path) -> String {
    f.strip_prefix(dir).unwrap_or(f).to_string_lossy().replace('\\', "/")
}

/// One picture file, decoded to RGB and prepared (module docs): `[3, side, side]` in `[-1, 1]`.
pub fn prepare(path: &Path, side: usize) -> Result<Vec<f32>> {
    let img = image::ImageReader::open(path)
        .map_err(|e| unreadable(path, e))?
        .with_guessed_format()
        .map_err(|e| unreadable(path, e))?
        .decode()
        .map_err(|e| unreadable(path, e))?
        .to_rgb8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    if w == 0 || h == 0 {
        return Err(unreadable(path, "the picture is empty"));
    }
    Ok(resize_crop(img.as_raw(), w, h, side))
}

/// Interleaved RGB bytes `h × w` → `[3, side, side]` in `[-1, 1]` (module docs).
pub fn resize_crop(rgb: &[u8], w: usize, h: usize, side: usize) -> Vec<f32> {
    // torchvision's Resize(int): the shorter side to `side`, the longer `int(side·long/short)`.
    let (nw, nh) = match w <= h {
        true => (side, (side as f64 * h as f64 / w as f64) as usize),
        false => ((side as f64 * w as f64 / h as f64) as usize, side),
    };
    let resized = resize_pil_bilinear(rgb, w, h, nw, nh);
    let top = ((nh - side) as f64 / 2.0).round() as usize;
    let left = ((nw - side) as f64 / 2.0).round() as usize;
    let mut out = vec![0f32; 3 * side * side];
    for y in 0..side {
        for x in 0..side {
            for c in 0..3 {
                let v = resized[((top + y) * nw + left + x) * 3 + c];
                out[(c * side + y) * side + x] = f32::from(v) / 127.5 - 1.0;
            }
        }
    }
    out
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// PIL's `precompute_coeffs` for the bilinear filter and `normalize_coeffs_8bpc`: per output
/// index, the first input index and its fixed-point weights.
fn coeffs(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i64>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // the triangle's support is 1
    let ss = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let k: Vec<f64> = (xmin..xmax)
                .map(|x| {
                    let t = ((x - xmin) as f64 + xmin as f64 - center + 0.5) * ss;
                    let t = t.abs();
                    if t < 1.0 {
                        1.0 - t
                    } else {
                        0.0
                    }
                })
                .collect();
            let total: f64 = k.iter().sum();
            let fixed = k
                .iter()
                .map(|&v| {
                    let v = if total != 0.0 { v / total } else { v };
                    let s = v * f64::from(1u32 << PRECISION_BITS);
                    (if v < 0.0 { s - 0.5 } else { s + 0.5 }).trunc() as i64
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// PIL's `Image.resize((nw, nh), BILINEAR)` of interleaved RGB bytes: horizontal pass (when the
/// width changes), then vertical (when the height does), each rounded to 8 bits.
fn resize_pil_bilinear(rgb: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut cur = rgb.to_vec();
    let mut cw = w;
    if nw != w {
        let k = coeffs(w, nw);
        let mut out = vec![0u8; h * nw * 3];
        for y in 0..h {
            for (x, (xmin, ks)) in k.iter().enumerate() {
                for c in 0..3 {
                    let mut acc = half;
                    for (i, &kk) in ks.iter().enumerate() {
                        acc += i64::from(cur[(y * cw + xmin + i) * 3 + c]) * kk;
                    }
                    out[(y * nw + x) * 3 + c] = clip8(acc);
                }
            }
        }
        cur = out;
        cw = nw;
    }
    if nh != h {
        let k = coeffs(h, nh);
        let mut out = vec![0u8; nh * cw * 3];
        for (y, (ymin, ks)) in k.iter().enumerate() {
            for x in 0..cw {
                for c in 0..3 {
                    let mut acc = half;
                    for (i, &kk) in ks.iter().enumerate() {
                        acc += i64::from(cur[((ymin + i) * cw + x) * 3 + c]) * kk;
                    }
                    out[(y * cw + x) * 3 + c] = clip8(acc);
                }
            }
        }
        cur = out;
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_by_two_halves_to_the_mean() {
        // 2×2 → 1×1: the triangle's support spans both pixels with weight ½ each, so the
        // result is the rounded mean of each channel.
        let rgb = [0u8, 10, 255, 100, 11, 0, 50, 12, 255, 200, 14, 0];
        let out = resize_pil_bilinear(&rgb, 2, 2, 1, 1);
        assert_eq!(out, vec![88, 12, 128]);
    }

    #[test]
    fn same_size_is_identity_and_scaled() {
        let rgb: Vec<u8> = (0..2 * 2 * 3).map(|i| (i * 20) as u8).collect();
        let out = resize_crop(&rgb, 2, 2, 2);
        assert_eq!(out[0], -1.0);
        assert_eq!(out[4 * 2 + 3], 220.0 / 127.5 - 1.0); // channel 2, (1, 1): byte 11
    }
}
