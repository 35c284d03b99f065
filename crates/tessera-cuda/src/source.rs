//! The kernels' CUDA C source, compiled at run time by NVRTC for the device at hand, and the
//! op codes the backend passes them: each an exhaustive match over an IR enum, so a new
//! variant does not compile until it has a code here and a case in `kernels.cu`.

use tessera_ir::{BinaryOp, DType, ReduceOp, UnaryOp};

/// `kernels.cu` (helpers, copies, elementwise), `reduce.cu` (reductions, norms), `layers.cu`
/// (embedding, loss, AdamW, RoPE, unfused attention), then the flash-attention kernels
/// (`flash.cu`), the vision ops (`vision.cu`), the generation ops (`infer.cu`), the
/// mixture-of-experts routing ops (`moe.cu`) and ring attention's merges (`ring.cu`); each uses
/// the helpers of the files before it.
pub const KERNELS: &str = concat!(
    include_str!("kernels.cu"),
    include_str!("reduce.cu"),
    include_str!("layers.cu"),
    include_str!("flash.cu"),
    include_str!("vision.cu"),
    include_str!("infer.cu"),
    include_str!("moe.cu"),
    include_str!("ring.cu")
);

pub fn unary_code(u: UnaryOp) -> i32 {
    match u {
        UnaryOp::Neg => 0,
        UnaryOp::Exp => 1,
        UnaryOp::Log => 2,
        UnaryOp::Sqrt => 3,
        UnaryOp::Rsqrt => 4,
        UnaryOp::Tanh => 5,
        UnaryOp::Gelu => 6,
        UnaryOp::GeluTanh => 7,
        UnaryOp::Silu => 8,
        UnaryOp::Relu => 9,
        UnaryOp::Sigmoid => 10,
        UnaryOp::Sin => 11,
        UnaryOp::Cos => 12,
    }
}

pub fn binary_code(b: BinaryOp) -> i32 {
    match b {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Max => 4,
        BinaryOp::Min => 5,
    }
}

pub fn reduce_code(r: ReduceOp) -> i32 {
    match r {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::SumSquares => 3,
    }
}

/// The type code of `load_as` / `store_as` for a stored dtype (ints are stored as i64, bools
/// as bytes, as on the CPU).
pub fn type_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I32 | DType::I64 => 4,
        DType::Bool | DType::U8 => 5,
    }
}

/// The type code of a float operand the kernels load or store in its own dtype (`ldf`/`stf`:
/// f32, bf16, f16); anything else is refused for `op`.
pub fn float_code(op: &str, d: DType) -> tessera_runtime::Result<i32> {
    match d {
        DType::F32 | DType::BF16 | DType::F16 => Ok(type_code(d)),
        other => Err(tessera_runtime::RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: op.into(),
            reason: format!("a {other:?} operand (f32, bf16 or f16 only)"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FUNCTIONS;

    /// Every kernel the backend loads is defined (with C linkage) in the source.
    #[test]
    fn every_launched_kernel_is_defined() {
        for f in FUNCTIONS
            .iter()
            .chain(crate::vision::FUNCTIONS)
            .chain(crate::infer::FUNCTIONS)
            .chain(crate::moe::FUNCTIONS)
        {
            // The flash kernels are instantiated per head dim by macros.
            let head_dim = f.strip_prefix("flash_fwd_").or_else(|| f.strip_prefix("flash_bwd_"));
            let def = match (head_dim, f.strip_prefix("flash_bwd2_")) {
                (_, Some(d)) => format!("FA2_KERNELS({d})"),
                (Some(d), None) => format!("FA_KERNELS({d})"),
                (None, None) => format!("extern \"C\" __global__ void {f}("),
            };
            assert!(KERNELS.contains(&def), "the kernel source does not define {f}");
        }
    }

    /// The source's op switches have a case for every code the backend passes.
    #[test]
    fn op_codes_match_the_source_switches() {
        let unary = [
            UnaryOp::Neg,
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Sqrt,
            UnaryOp::Rsqrt,
            UnaryOp::Tanh,
            UnaryOp::Gelu,
            UnaryOp::GeluTanh,
            UnaryOp::Silu,
            UnaryOp::Relu,
            UnaryOp::Sigmoid,
            UnaryOp::Sin,
            UnaryOp::Cos,
        ];
        let mut codes: Vec<i32> = unary.iter().map(|&u| unary_code(u)).collect();
        codes.sort();
        assert_eq!(codes, (0..13).collect::<Vec<_>>(), "unary codes are 0..13, distinct");
        // The last code is the `default:` case; the others are explicit cases in both
        // switches (forward and gradient).
        for c in 0..12 {
            assert!(KERNELS.matches(&format!("case {c}:")).count() >= 2, "case {c}");
        }
        let braces = KERNELS.matches('{').count();
        assert_eq!(braces, KERNELS.matches('}').count(), "unbalanced braces in kernels.cu");
    }
}
