//! What each op of a forward graph does, in a few words, and scopes within blocks.

use tessera_ir::{BinaryOp, Graph, Node, Op, ReduceOp, UnaryOp};

/// What each node of a forward graph does, in a few words (indexed by node): the op's kind
/// refined by its parameters and by its place in the graph — `silu`, `bias add`,
/// `residual add`, `cast bf16→f32 of o_proj`, `slice dim 2 0..256 of c_attn`,
/// `attention causal`. Names within a block never mention the block's index, so alike blocks
/// read alike.
pub fn op_details(g: &Graph) -> Vec<String> {
    // Tensors on a block's residual stream: outputs of residual adds, and of the norms a
    // post-LN block (BERT) applies to them.
    let mut stream = vec![false; g.tensors.len()];
    let mut out = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        let residual = is_residual_add(g, n, &stream);
        let post_norm = matches!(n.op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
            && n.block.is_some()
            && n.inputs
                .first()
                .is_some_and(|&t| stream[t.index()] && g.producer(t).block == n.block);
        if residual || post_norm {
            for &t in &n.outputs {
                stream[t.index()] = true;
            }
        }
        out.push(detail(g, n, residual, &stream));
    }
    out
}

/// An add inside a block of two values shaped like its output, one of them the block's input
/// (made outside the block) or already on the residual stream.
fn is_residual_add(g: &Graph, n: &Node, stream: &[bool]) -> bool {
    if !matches!(n.op, Op::Binary(BinaryOp::Add)) || n.block.is_none() || n.inputs.len() != 2 {
        return false;
    }
    let shape = g.shape(n.outputs[0]);
    n.inputs.iter().all(|&t| g.shape(t) == shape && !g.producer(t).op.is_leaf())
        && n.inputs.iter().any(|&t| stream[t.index()] || g.producer(t).block != n.block)
}

fn detail(g: &Graph, n: &Node, residual: bool, stream: &[bool]) -> String {
    let of = || source(g, n, stream).map_or(String::new(), |s| format!(" of {s}"));
    match &n.op {
        Op::Unary(u) => unary(*u).to_string(),
        Op::Binary(BinaryOp::Add) if residual => "residual add".into(),
        Op::Binary(BinaryOp::Add) if n.inputs.iter().any(|&t| from_parameter(g, t)) => {
            "bias add".into()
        }
        Op::Binary(b) => binary(*b).to_string(),
        Op::Cast(to) => format!("cast {}→{to}{}", g.meta(n.inputs[0]).dtype, of()),
        Op::Dropout { p, .. } => format!("dropout p={p}"),
        Op::Reduce { op, dims, .. } => {
            let dims: Vec<String> = dims.iter().map(usize::to_string).collect();
            let s = if dims.len() == 1 { "" } else { "s" };
            format!("{} over dim{s} {}", reduce(*op), dims.join(","))
        }
        Op::Permute(p) => format!("permute {p:?}{}", of()),
        Op::Slice { dim, start, end } => format!("slice dim {dim} {start}..{end}{}", of()),
        Op::Concat { dim } => format!("concat dim {dim}"),
        Op::Rope { inverse: true, .. } => format!("inverse rope{}", of()),
        Op::Reshape(_) | Op::Expand(_) | Op::Pad { .. } | Op::Rope { .. } => {
            format!("{}{}", n.op.name(), of())
        }
        Op::Attention(a) => {
            let mut s = "attention".to_string();
            if a.causal {
                s += " causal";
            }
            if let Some(w) = a.window {
                s += &format!(" window {w}");
            }
            s
        }
        Op::Conv2d(c) => {
            let w = g.shape(n.inputs[1]).dims();
            let mut s = format!("conv2d {}×{}", w[2], w[3]);
            if c.stride != [1, 1] {
                s += &format!(" stride {}", hw(c.stride));
            }
            if c.dilation != [1, 1] {
                s += &format!(" dilation {}", hw(c.dilation));
            }
            if c.groups > 1 {
                s += &format!(" groups {}", c.groups);
            }
            s
        }
        Op::GroupNorm { groups, .. } => format!("group_norm {groups} groups"),
        Op::MaxPool2d(p) | Op::AvgPool2d { pool: p, .. } => {
            format!("{} {} stride {}", n.op.name(), hw(p.kernel), hw(p.stride))
        }
        Op::Upsample2d { scale } => format!("upsample nearest ×{}", hw(*scale)),
        Op::CrossEntropy { sum: true, .. } => "cross_entropy (sum)".into(),
        Op::TiledMlp(spec) => {
            let kind = if spec.gated { "gated" } else { "plain" };
            format!("tiled {kind} mlp ({}), {} rows per tile", unary(spec.act), spec.chunk_rows)
        }
        Op::LinearCrossEntropy { chunk_rows, .. } => {
            format!("lm_head + cross_entropy (sum), {chunk_rows} rows per chunk")
        }
        Op::Fill { value, .. } => format!("fill {value}"),
        // The rest say all in their name (backward, optimizer and communication ops do not
        // appear in a forward graph).
        op => op.name().to_string(),
    }
}

/// `3×3`, or `2` when both spatial dims agree.
fn hw(v: [usize; 2]) -> String {
    if v[0] == v[1] {
        v[0].to_string()
    } else {
        format!("{}×{}", v[0], v[1])
    }
}

/// Where a node's first input comes from, seen through views (reshape, permute, expand): the
/// producer's scope relative to the node's, or — from the same scope or another block — what
/// the producer does.
fn source(g: &Graph, n: &Node, stream: &[bool]) -> Option<String> {
    let mut t = *n.inputs.first()?;
    for _ in 0..4 {
        let p = g.producer(t);
        if !matches!(p.op, Op::Reshape(_) | Op::Permute(_) | Op::Expand(_)) || p.block != n.block {
            break;
        }
        t = p.inputs[0];
    }
    let p = g.producer(t);
    let own = in_block(g.scope_name(n.scope), n.block);
    let theirs = in_block(g.scope_name(p.scope), p.block);
    let rel = relative(own, theirs);
    if p.block != n.block || p.scope == n.scope || rel.is_empty() {
        return Some(match &p.op {
            Op::Binary(BinaryOp::Add) if stream[t.index()] => "residual".into(),
            Op::Binary(b) => binary(*b).into(),
            Op::Unary(u) => unary(*u).into(),
            op => op.name().into(),
        });
    }
    Some(rel.to_string())
}

/// Whether `t` is a parameter, seen through casts and views.
fn from_parameter(g: &Graph, mut t: tessera_ir::TensorId) -> bool {
    for _ in 0..4 {
        let p = g.producer(t);
        match p.op {
            Op::Parameter { .. } => return true,
            Op::Cast(_) | Op::Reshape(_) | Op::Expand(_) => t = p.inputs[0],
            _ => return false,
        }
    }
    false
}

/// `theirs` with the dotted prefix it shares with `own` removed.
pub(crate) fn relative<'a>(own: &str, theirs: &'a str) -> &'a str {
    let mut at = 0;
    for (a, b) in own.split('.').zip(theirs.split('.')) {
        if a != b {
            break;
        }
        at += b.len() + 1;
    }
    theirs.get(at.min(theirs.len())..).unwrap_or("").trim_start_matches('.')
}

/// A scope within its block: what follows the block's index (`model.layers.3.mlp.up_proj` in
/// block 3 → `mlp.up_proj`; the block's own scope → ``). Outside blocks, the whole scope.
pub fn in_block(scope: &str, block: Option<u32>) -> &str {
    block.and_then(|b| split_at_block(scope, b)).map_or(scope, |(_, rest)| rest)
}

/// `model.layers.3.mlp` in block 3 → (`model.layers`, `mlp`).
pub(crate) fn split_at_block(scope: &str, block: u32) -> Option<(&str, &str)> {
    let index = block.to_string();
    let mut at = 0;
    for part in scope.split('.') {
        if part == index {
            let head = scope[..at].trim_end_matches('.');
            let rest = scope.get(at + part.len() + 1..).unwrap_or("");
            return Some((head, rest));
        }
        at += part.len() + 1;
    }
    None
}

fn unary(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::Neg => "neg",
        UnaryOp::Exp => "exp",
        UnaryOp::Log => "log",
        UnaryOp::Sqrt => "sqrt",
        UnaryOp::Rsqrt => "rsqrt",
        UnaryOp::Tanh => "tanh",
        UnaryOp::Gelu => "gelu",
        UnaryOp::GeluTanh => "gelu_tanh",
        UnaryOp::Silu => "silu",
        UnaryOp::Relu => "relu",
        UnaryOp::Sigmoid => "sigmoid",
        UnaryOp::Sin => "sin",
        UnaryOp::Cos => "cos",
    }
}

fn binary(b: BinaryOp) -> &'static str {
    match b {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Max => "max",
        BinaryOp::Min => "min",
    }
}

fn reduce(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "sum",
        ReduceOp::Mean => "mean",
        ReduceOp::Max => "max",
        ReduceOp::SumSquares => "sum of squares",
    }
}
