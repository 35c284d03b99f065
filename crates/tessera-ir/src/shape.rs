//! Shapes and the tensor metadata (shape + dtype) every graph value carries.

use crate::DType;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A shape's dims: inline up to four (every tensor of the transformer families), so that
/// the planner's many graph copies do not allocate per tensor.
pub type Dims = smallvec::SmallVec<[usize; 4]>;

/// A tensor shape: the size of each dimension ("dim"), outermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(pub Dims);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(Dims::from_vec(dims.into()))
    }
    pub fn scalar() -> Shape {
        Shape(Dims::new())
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn numel(&self) -> u64 {
        self.0.iter().map(|&d| d as u64).product()
    }
    /// Size of dim `i`, counting from the end when `i` is negative-style via `rank - k`.
    pub fn dim(&self, i: usize) -> usize {
        self.0[i]
    }
    pub fn last(&self) -> usize {
        *self.0.last().unwrap_or(&1)
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }

    /// NumPy broadcasting of two shapes; `None` when they are incompatible.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let rank = a.rank().max(b.rank());
        let mut out = vec![0; rank];
        for (i, o) in out.iter_mut().enumerate() {
            let da = dim_from_right(a, rank - 1 - i);
            let db = dim_from_right(b, rank - 1 - i);
            *o = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape::from(out))
    }

    /// True when `self` broadcasts to `target` (right-aligned, size-1 or equal dims).
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        self.rank() <= target.rank()
            && (0..self.rank()).all(|k| {
                let d = dim_from_right(self, k);
                d == 1 || d == dim_from_right(target, k)
            })
    }
}

/// Size of the `k`-th dim counted from the right (0 = last); 1 past the rank.
fn dim_from_right(s: &Shape, k: usize) -> usize {
    if k < s.rank() {
        s.0[s.rank() - 1 - k]
    } else {
        1
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ",")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Shape {
        Shape(Dims::from_vec(v))
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Shape {
        Shape(Dims::from_slice(&v))
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Shape {
        Shape(Dims::from_slice(v))
    }
}

/// Shape and element type of one tensor: all the IR knows about a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    pub shape: Shape,
    pub dtype: DType,
}

impl TensorMeta {
    pub fn new(shape: impl Into<Shape>, dtype: DType) -> TensorMeta {
        TensorMeta { shape: shape.into(), dtype }
    }
    pub fn numel(&self) -> u64 {
        self.shape.numel()
    }
    pub fn size_bytes(&self) -> u64 {
        self.shape.numel() * self.dtype.size_bytes()
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
