//! Constant tensors known at import time: initialisers, `Constant` nodes and everything
//! computed from them and from the bound shapes (position ids, causal masks, rotary tables).
//! Values are held as f64 (floats) or i64 (integers and booleans), which is exact for every
//! ONNX type they come from except 64-bit integers beyond 2^53 in float arithmetic.

use crate::error::{OnnxError, Result};
use onnx_protobuf::TensorProto;
use std::path::Path;
use std::rc::Rc;

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

/// The storage of a constant (shared between views).
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F(Rc<Vec<f64>>),
    I(Rc<Vec<i64>>),
}

/// A constant: a (possibly strided) view of shared storage. Element `(i0, i1, ..)` is
/// `data[offset + Σ i_d · strides[d]]`; constructors build row-major storage, and `Expand`,
/// `Slice`, `Transpose`, `Unsqueeze` and a fill are views (a causal mask broadcast over the
/// batch is stored once).
#[derive(Clone, Debug, PartialEq)]
pub struct Const {
    pub shape: Vec<usize>,
    pub elem: Elem,
    data: Data,
    offset: usize,
    strides: Vec<isize>,
}

fn row_major(shape: &[usize]) -> Vec<isize> {
    strides(shape).into_iter().map(|s| s as isize).collect()
}

impl Const {
    fn contiguous(shape: Vec<usize>, elem: Elem, data: Data) -> Const {
        let strides = row_major(&shape);
        Const { shape, elem, data, offset: 0, strides }
    }
    pub fn floats(shape: Vec<usize>, v: Vec<f64>) -> Const {
        Const::contiguous(shape, Elem::Float, Data::F(Rc::new(v)))
    }
    pub fn ints(shape: Vec<usize>, v: Vec<i64>) -> Const {
        Const::contiguous(shape, Elem::Int, Data::I(Rc::new(v)))
    }
    pub fn bools(shape: Vec<usize>, v: Vec<bool>) -> Const {
        Const::contiguous(
            shape,
            Elem::Bool,
            Data::I(Rc::new(v.into_iter().map(i64::from).collect())),
        )
    }
    /// `value` (a one-element constant's kind) at every position of `shape`: stored once.
    pub fn filled(value: &Const, shape: Vec<usize>) -> Const {
        let data = value.gather_flat(vec![1], std::iter::once(0)).data;
        let strides = vec![0; shape.len()];
        Const { shape, elem: value.elem, data, offset: 0, strides }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Where logical element `i` (row-major) lives in the storage.
    fn at(&self, mut i: usize) -> usize {
        let mut off = self.offset as isize;
        for d in (0..self.shape.len()).rev() {
            let n = self.shape[d].max(1);
            off += (i % n) as isize * self.strides[d];
            i /= n;
        }
        off as usize
    }
    /// Storage positions of every element, row-major.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        let rank = self.shape.len();
        let n = self.numel();
        let mut pos = vec![0usize; rank];
        let mut off = self.offset as isize;
        (0..n).map(move |_| {
            let here = off as usize;
            for d in (0..rank).rev() {
                pos[d] += 1;
                off += self.strides[d];
                if pos[d] < self.shape[d] {
                    break;
                }
                off -= self.strides[d] * self.shape[d] as isize;
                pos[d] = 0;
            }
            here
        })
    }
    /// Element `i` as f64.
    pub fn f(&self, i: usize) -> f64 {
        let k = self.at(i);
        match &self.data {
            Data::F(v) => v[k],
            Data::I(v) => v[k] as f64,
        }
    }
    /// Element `i` as i64 (floats truncated toward zero).
    pub fn i(&self, i: usize) -> i64 {
        let k = self.at(i);
        match &self.data {
            Data::F(v) => v[k] as i64,
            Data::I(v) => v[k],
        }
    }
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            Data::F(v) => self.positions().map(|k| v[k]).collect(),
            Data::I(v) => self.positions().map(|k| v[k] as f64).collect(),
        }
    }
    pub fn to_i64(&self) -> Vec<i64> {
        match &self.data {
            Data::F(v) => self.positions().map(|k| v[k] as i64).collect(),
            Data::I(v) => self.positions().map(|k| v[k]).collect(),
        }
    }
    /// Whether the values are integers held exactly (ints and booleans).
    pub fn is_int(&self) -> bool {
        matches!(self.data, Data::I(_))
    }
    /// The single value of a one-element constant.
    pub fn scalar(&self) -> Option<f64> {
        (self.numel() == 1).then(|| self.f(0))
    }
    /// A new row-major constant of this one's kind with `shape` and logical elements `idx`.
    pub fn gather_flat(&self, shape: Vec<usize>, idx: impl Iterator<Item = usize>) -> Const {
        let data = match &self.data {
            Data::F(v) => Data::F(Rc::new(idx.map(|i| v[self.at(i)]).collect())),
            Data::I(v) => Data::I(Rc::new(idx.map(|i| v[self.at(i)]).collect())),
        };
        Const::contiguous(shape, self.elem, data)
    }
    /// The same values, row-major in fresh storage.
    pub fn materialize(&self) -> Const {
        let data = match &self.data {
            Data::F(v) => Data::F(Rc::new(self.positions().map(|k| v[k]).collect())),
            Data::I(v) => Data::I(Rc::new(self.positions().map(|k| v[k]).collect())),
        };
        Const::contiguous(self.shape.clone(), self.elem, data)
    }
    fn is_row_major(&self) -> bool {
        self.offset == 0 && self.strides == row_major(&self.shape)
    }
    /// The same elements in `shape` (same count): a view when only size-1 axes come or go or
    /// the storage is row-major, else a copy.
    pub fn reshaped(&self, shape: Vec<usize>) -> Const {
        let kept = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<usize>>();
        if kept(&self.shape) == kept(&shape) {
            let mut src =
                (0..self.shape.len()).filter(|&d| self.shape[d] != 1).map(|d| self.strides[d]);
            let strides =
                shape.iter().map(|&d| if d == 1 { 0 } else { src.next().unwrap_or(0) }).collect();
            return Const { shape, strides, ..self.clone() };
        }
        let base = if self.is_row_major() { self.clone() } else { self.materialize() };
        Const { strides: row_major(&shape), shape, ..base }
    }
    /// A view broadcast to `out` (NumPy rules, right-aligned), `None` if it does not broadcast.
    pub fn broadcast_to(&self, out: &[usize]) -> Option<Const> {
        if broadcast_shape(&self.shape, out).as_deref() != Some(out) {
            return None;
        }
        let lead = out.len() - self.shape.len();
        let strides = (0..out.len())
            .map(|d| if d < lead || self.shape[d - lead] == 1 { 0 } else { self.strides[d - lead] })
            .collect();
        Some(Const { shape: out.to_vec(), strides, ..self.clone() })
    }
    /// A view with axes permuted (`perm[d]` is the source axis of output axis `d`).
    pub fn permuted(&self, perm: &[usize]) -> Const {
        Const {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            ..self.clone()
        }
    }
    /// A view of `(start, step, len)` per axis (start within bounds, step non-zero).
    pub fn sliced(&self, p: &[(usize, i64, usize)]) -> Const {
        let offset = self.offset as isize
            + p.iter().zip(&self.strides).map(|(&(s, _, _), &st)| s as isize * st).sum::<isize>();
        Const {
            shape: p.iter().map(|&(_, _, n)| n).collect(),
            strides: p
                .iter()
                .zip(&self.strides)
                .map(|(&(_, step, _), &st)| step as isize * st)
                .collect(),
            offset: offset as usize,
            ..self.clone()
        }
    }
    /// The same values under another element kind of the same storage (bool ↔ int).
    pub fn with_elem(self, elem: Elem) -> Const {
        Const { elem, ..self }
    }
    /// Whether axis `d` is a broadcast (every index reads the same storage).
    pub fn is_broadcast(&self, d: usize) -> bool {
        self.strides[d] == 0
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

fn fv(v: Vec<f64>) -> Data {
    Data::F(Rc::new(v))
}

fn iv(v: Vec<i64>) -> Data {
    Data::I(Rc::new(v))
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
            1 => fv(ch.map(|c| f32::from_le_bytes(le4(c)) as f64).collect()),
            11 => fv(ch.map(|c| f64::from_le_bytes(le8(c))).collect()),
            10 => fv(ch.map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]]))).collect()),
            16 => fv(ch
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
                .collect()),
            2 | 9 => iv(ch.map(|c| c[0] as i64).collect()),
            3 => iv(ch.map(|c| c[0] as i8 as i64).collect()),
            4 => iv(ch.map(|c| u16::from_le_bytes([c[0], c[1]]) as i64).collect()),
            5 => iv(ch.map(|c| i16::from_le_bytes([c[0], c[1]]) as i64).collect()),
            6 => iv(ch.map(|c| i32::from_le_bytes(le4(c)) as i64).collect()),
            12 => iv(ch.map(|c| u32::from_le_bytes(le4(c)) as i64).collect()),
            13 => iv(ch.map(|c| u64::from_le_bytes(le8(c)) as i64).collect()),
            _ => iv(ch.map(|c| i64::from_le_bytes(le8(c))).collect()),
        }
    } else {
        match t.data_type {
            1 => fv(t.float_data.iter().map(|&x| x as f64).collect()),
            11 => fv(t.double_data.clone()),
            10 => fv(t.int32_data.iter().map(|&x| f16_to_f64(x as u16)).collect()),
            16 => {
                fv(t.int32_data.iter().map(|&x| f32::from_bits((x as u32) << 16) as f64).collect())
            }
            7 => iv(t.int64_data.clone()),
            12 | 13 => iv(t.uint64_data.iter().map(|&x| x as i64).collect()),
            _ => iv(t.int32_data.iter().map(|&x| x as i64).collect()),
        }
    };
    let len = match &data {
        Data::F(v) => v.len(),
        Data::I(v) => v.len(),
    };
    if len != n {
        return Err(bad(format!("{len} values for shape {shape:?} ({n} elements)")));
    }
    Ok(Const::contiguous(shape, elem, data))
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
    let io = |source| OnnxError::Io { path: path.display().to_string(), source };
    let num = |k: &str| -> Result<Option<u64>> {
        key(k).map(|v| v.parse::<u64>().map_err(|_| bad(format!("bad {k} {v}")))).transpose()
    };
    // Read only this tensor's bytes: one external file commonly holds every weight.
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(&path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    let offset = num("offset")?.unwrap_or(0);
    let length = num("length")?.unwrap_or(size.saturating_sub(offset));
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(bad(format!("{location} holds {size} bytes, fewer than asked")));
    }
    let len = usize::try_from(length).map_err(|_| bad(format!("length {length} too large")))?;
    let mut buf = vec![0u8; len];
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
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
    fn views_read_what_copies_hold() {
        let c = Const::ints(vec![2, 3], vec![0, 1, 2, 3, 4, 5]);
        // Broadcast: [2,3] → [4,2,3] reads each row block four times, storing it once.
        let b = c.broadcast_to(&[4, 2, 3]).unwrap();
        assert!(b.is_broadcast(0));
        assert_eq!(b.to_i64(), [0, 1, 2, 3, 4, 5].repeat(4));
        // Transpose, then a negative-step slice of the transpose, then size-1 axes added.
        let t = c.permuted(&[1, 0]);
        assert_eq!(t.to_i64(), vec![0, 3, 1, 4, 2, 5]);
        let s = t.sliced(&[(2, -1, 3), (1, 1, 1)]);
        assert_eq!(s.to_i64(), vec![5, 4, 3]);
        let u = s.reshaped(vec![1, 3, 1, 1]);
        assert_eq!((u.shape.clone(), u.to_i64()), (vec![1, 3, 1, 1], vec![5, 4, 3]));
        // A reshape that mixes axes of a strided view copies, in logical order.
        assert_eq!(t.reshaped(vec![6]).to_i64(), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(t.f(3), 4.0);
        // A fill stores one value.
        let one = Const::floats(vec![], vec![-1.5]);
        let f = Const::filled(&one, vec![3, 2]);
        assert_eq!(f.to_f64(), vec![-1.5; 6]);
    }

    #[test]
    fn halves_decode() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
        assert_eq!(f16_to_f64(0x0001), 2f64.powi(-24));
    }
}
