//! Constant tensors known at import time: initialisers, `Constant` nodes and everything
//! computed from them and from the bound shapes (position ids, causal masks, rotary tables).
//! Values are held as f64 (floats) or i64 (integers and booleans), which is exact for every
//! ONNX type they come from except 64-bit integers beyond 2^53 in float arithmetic.

use crate::error::{OnnxError, Result};
use onnx_protobuf::TensorProto;
use std::path::Path;

/// The element kind of a constant (its ONNX type, coarsely).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    Float,
    Int,
    Bool,
}

/// An ONNX `TensorProto.DataType` as an element kind, `None` for types the importer does not
/// read (strings, complex, 8-bit floats).
pub fn elem_of(data_type: i32) -> Option<Elem> {
    match data_type {
        1 | 10 | 11 | 16 => Some(Elem::Float),
        2..=7 | 12 | 13 => Some(Elem::Int),
        9 => Some(Elem::Bool),
        _ => None,
    }
}

/// The data of a constant, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F(Vec<f64>),
    I(Vec<i64>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Const {
    pub shape: Vec<usize>,
    pub elem: Elem,
    pub data: Data,
}

impl Const {
    pub fn floats(shape: Vec<usize>, v: Vec<f64>) -> Const {
        Const { shape, elem: Elem::Float, data: Data::F(v) }
    }
    pub fn ints(shape: Vec<usize>, v: Vec<i64>) -> Const {
        Const { shape, elem: Elem::Int, data: Data::I(v) }
    }
    pub fn bools(shape: Vec<usize>, v: Vec<bool>) -> Const {
        Const { shape, elem: Elem::Bool, data: Data::I(v.into_iter().map(i64::from).collect()) }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Element `i` as f64.
    pub fn f(&self, i: usize) -> f64 {
        match &self.data {
            Data::F(v) => v[i],
            Data::I(v) => v[i] as f64,
        }
    }
    /// Element `i` as i64 (floats truncated toward zero).
    pub fn i(&self, i: usize) -> i64 {
        match &self.data {
            Data::F(v) => v[i] as i64,
            Data::I(v) => v[i],
        }
    }
    pub fn to_f64(&self) -> Vec<f64> {
        (0..self.numel()).map(|i| self.f(i)).collect()
    }
    pub fn to_i64(&self) -> Vec<i64> {
        (0..self.numel()).map(|i| self.i(i)).collect()
    }
    /// The single value of a one-element constant.
    pub fn scalar(&self) -> Option<f64> {
        (self.numel() == 1).then(|| self.f(0))
    }
    /// A new constant of this one's kind with `shape` and elements `idx` of this one.
    pub fn gather_flat(&self, shape: Vec<usize>, idx: impl Iterator<Item = usize>) -> Const {
        let data = match &self.data {
            Data::F(v) => Data::F(idx.map(|i| v[i]).collect()),
            Data::I(v) => Data::I(idx.map(|i| v[i]).collect()),
        };
        Const { shape, elem: self.elem, data }
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// NumPy broadcast of two shapes, `None` if they do not broadcast.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let y = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (x, y) {
            _ if x == y => x,
            (1, _) => y,
            (_, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// For each element of `out` (a broadcast of `shape`), the flat index it reads in `shape`.
pub fn broadcast_index(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let st = strides(shape);
    let lead = out.len() - shape.len();
    let total: usize = out.iter().product();
    let mut idx = Vec::with_capacity(total);
    let mut pos = vec![0usize; out.len()];
    for _ in 0..total {
        let mut flat = 0;
        for (d, &st_d) in st.iter().enumerate() {
            if shape[d] != 1 {
                flat += pos[lead + d] * st_d;
            }
        }
        idx.push(flat);
        for d in (0..out.len()).rev() {
            pos[d] += 1;
            if pos[d] < out[d] {
                break;
            }
            pos[d] = 0;
        }
    }
    idx
}

/// Decodes an initialiser or a `Constant`'s tensor. `dir` resolves external data files.
pub fn decode(t: &TensorProto, dir: &Path) -> Result<Const> {
    let name = if t.name.is_empty() { "<constant>" } else { t.name.as_str() };
    let bad = |reason: String| OnnxError::Model { path: name.to_string(), reason };
    let shape = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}"))))
        .collect::<Result<Vec<usize>>>()?;
    let n: usize = shape.iter().product();
    let elem = elem_of(t.data_type)
        .ok_or_else(|| bad(format!("tensor data type {} is not supported", t.data_type)))?;
    let raw: std::borrow::Cow<[u8]> = if t.data_location.value() == 1 {
        std::borrow::Cow::Owned(external(t, dir)?)
    } else {
        std::borrow::Cow::Borrowed(&t.raw_data)
    };
    let data = if !raw.is_empty() {
        let width = match t.data_type {
            2 | 3 | 9 => 1,
            4 | 5 | 10 | 16 => 2,
            1 | 6 | 12 => 4,
            _ => 8,
        };
        if raw.len() != n * width {
            return Err(bad(format!("{} bytes of data for {n} elements of {width}", raw.len())));
        }
        let ch = raw.chunks_exact(width);
        let le4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
        let le8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
        match t.data_type {
            1 => Data::F(ch.map(|c| f32::from_le_bytes(le4(c)) as f64).collect()),
            11 => Data::F(ch.map(|c| f64::from_le_bytes(le8(c))).collect()),
            10 => Data::F(ch.map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]]))).collect()),
            16 => Data::F(
                ch.map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
                    .collect(),
            ),
            2 | 9 => Data::I(ch.map(|c| c[0] as i64).collect()),
            3 => Data::I(ch.map(|c| c[0] as i8 as i64).collect()),
            4 => Data::I(ch.map(|c| u16::from_le_bytes([c[0], c[1]]) as i64).collect()),
            5 => Data::I(ch.map(|c| i16::from_le_bytes([c[0], c[1]]) as i64).collect()),
            6 => Data::I(ch.map(|c| i32::from_le_bytes(le4(c)) as i64).collect()),
            12 => Data::I(ch.map(|c| u32::from_le_bytes(le4(c)) as i64).collect()),
            13 => Data::I(ch.map(|c| u64::from_le_bytes(le8(c)) as i64).collect()),
            _ => Data::I(ch.map(|c| i64::from_le_bytes(le8(c))).collect()),
        }
    } else {
        match t.data_type {
            1 => Data::F(t.float_data.iter().map(|&x| x as f64).collect()),
            11 => Data::F(t.double_data.clone()),
            10 => Data::F(t.int32_data.iter().map(|&x| f16_to_f64(x as u16)).collect()),
            16 => Data::F(
                t.int32_data.iter().map(|&x| f32::from_bits((x as u32) << 16) as f64).collect(),
            ),
            7 => Data::I(t.int64_data.clone()),
            12 | 13 => Data::I(t.uint64_data.iter().map(|&x| x as i64).collect()),
            _ => Data::I(t.int32_data.iter().map(|&x| x as i64).collect()),
        }
    };
    let len = match &data {
        Data::F(v) => v.len(),
        Data::I(v) => v.len(),
    };
    if len != n {
        return Err(bad(format!("{len} values for shape {shape:?} ({n} elements)")));
    }
    Ok(Const { shape, elem, data })
}

/// The bytes of a tensor stored outside the model file (`location`, `offset`, `length`).
fn external(t: &TensorProto, dir: &Path) -> Result<Vec<u8>> {
    let key = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.clone());
    let bad = |reason: String| OnnxError::Model { path: t.name.clone(), reason };
    let location = key("location").ok_or_else(|| bad("external data without a location".into()))?;
    let rel = Path::new(&location);
    if rel.is_absolute() || rel.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        return Err(bad(format!("external data location {location} leaves the model's folder")));
    }
    let path = dir.join(rel);
    let bytes = std::fs::read(&path)
        .map_err(|source| OnnxError::Io { path: path.display().to_string(), source })?;
    let num = |k: &str| -> Result<Option<usize>> {
        key(k).map(|v| v.parse::<usize>().map_err(|_| bad(format!("bad {k} {v}")))).transpose()
    };
    let offset = num("offset")?.unwrap_or(0);
    let length = num("length")?.unwrap_or(bytes.len().saturating_sub(offset));
    bytes
        .get(offset..offset.saturating_add(length))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| bad(format!("{location} holds {} bytes, fewer than asked", bytes.len())))
}

/// IEEE half to f64.
fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_follows_numpy() {
        assert_eq!(broadcast_shape(&[2, 1, 3], &[4, 1]), Some(vec![2, 4, 3]));
        assert_eq!(broadcast_shape(&[2, 3], &[4]), None);
        // [1,3] over [2,3]: both rows read the same three elements.
        assert_eq!(broadcast_index(&[1, 3], &[2, 3]), vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(broadcast_index(&[2, 1], &[2, 3]), vec![0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn halves_decode() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
        assert_eq!(f16_to_f64(0x0001), 2f64.powi(-24));
    }
}
