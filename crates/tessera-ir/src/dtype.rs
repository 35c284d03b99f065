//! Element types. The IR only needs their names and sizes; arithmetic lives in the runtime.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I32,
    I64,
    Bool,
    /// Unsigned bytes: quantised weights (int8 as offset binary `q + 128`, int4 as two
    /// offset nibbles `q + 8` per byte; see [`crate::QuantSpec`]).
    U8,
}

impl DType {
    /// Bytes per element as stored on a device.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Bool | DType::U8 => 1,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    pub const fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
            DType::U8 => "u8",
        }
    }

    /// Parses the names used by users and by Hugging Face configs (`torch_dtype`/`dtype`).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "f64" | "float64" | "double" => DType::F64,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
