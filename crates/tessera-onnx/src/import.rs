//! The import walk: demand-driven from the graph outputs, each ONNX value becomes either a
//! constant (folded, [`crate::consts`]) or an IR tensor ([`crate::lower`]), after the fusions
//! of [`crate::fuse`] had their chance. Values never demanded are never emitted, so what the
//! exporter wrote for shapes and masks leaves no trace in the IR.
//!
//! A tensor value may carry a pending permutation (`Transpose` is free until an operator needs
//! the logical layout): `x.transpose(1, 2)` before attention or `weight.T` before a matmul cost
//! nothing, as in the hand-written builders.

use crate::consts;
use crate::error::{OnnxError, Result};
use crate::model::{Dim, OnnxModel};
use crate::tensor::{Const, Elem};
use onnx_protobuf::NodeProto;
use std::collections::HashMap;
use std::rc::Rc;
use tessera_ir::{Builder, DType, Shape, TensorId};

/// What to bind the model's dynamic axes and float type to.
#[derive(Clone, Debug, PartialEq)]
pub struct Bind {
    pub batch: usize,
    pub seq: usize,
    /// The float type of parameters and activations (ONNX float tensors map to it).
    pub dtype: DType,
}

/// A data input of an imported graph.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedInput {
    pub name: String,
    pub tensor: TensorId,
    pub elem: Elem,
}

/// An imported forward graph.
pub struct Imported {
    pub builder: Builder,
    /// The graph outputs, in order.
    pub outputs: Vec<TensorId>,
    pub inputs: Vec<ImportedInput>,
}

/// An ONNX value during the walk.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    Const(Rc<Const>),
    /// An initialiser not yet read: a parameter if an operator on tensors uses it, its data
    /// if a folded one does.
    Init(String),
    /// An IR tensor; the logical value is `id` permuted by `perm` (dims of the logical value
    /// in terms of the physical one), when set.
    Tensor {
        id: TensorId,
        perm: Option<Vec<usize>>,
    },
}

pub(crate) struct Importer<'m> {
    pub(crate) m: &'m OnnxModel,
    pub(crate) b: Builder,
    pub(crate) dtype: DType,
    memo: HashMap<String, Value>,
    producer: HashMap<&'m str, usize>,
    consumers: HashMap<&'m str, Vec<usize>>,
    params: HashMap<String, TensorId>,
    decoded: HashMap<String, Rc<Const>>,
    /// Folds already done ([`fold_key`] → outputs).
    folded: HashMap<String, Vec<Rc<Const>>>,
    /// Attention masks already judged: the masks' identities and `[S, T]` → causal or not.
    pub(crate) verdicts: HashMap<(Vec<usize>, usize, usize), Option<bool>>,
    /// Rotary tables already read: their identities and the rotated shape → the sequence
    /// axis and the frequencies.
    pub(crate) rope_tables: HashMap<(usize, usize, Vec<usize>), RopeRead>,
    /// Values known not to depend on a graph input (memo of [`Importer::is_static`]).
    statics: HashMap<String, bool>,
    /// Depth of the demand recursion (guards against pathological graphs).
    depth: usize,
}

/// Imports `m` with its dynamic axes bound by `bind`.
pub fn import(m: &OnnxModel, bind: &Bind) -> Result<Imported> {
    // The walk recurses along the graph's depth: give it room.
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn_scoped(s, || import_on_this_thread(m, bind))
            .map_err(|e| OnnxError::Model {
                path: m.path.display().to_string(),
                reason: e.to_string(),
            })?
            .join()
            .unwrap_or_else(|_| {
                Err(OnnxError::Model {
                    path: m.path.display().to_string(),
                    reason: "the importer panicked (a bug: please report it with the file)".into(),
                })
            })
    })
}

fn import_on_this_thread(m: &OnnxModel, bind: &Bind) -> Result<Imported> {
    let mut producer = HashMap::new();
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in m.graph.node.iter().enumerate() {
        for o in &n.output {
            producer.insert(o.as_str(), i);
        }
        for x in &n.input {
            consumers.entry(x.as_str()).or_default().push(i);
        }
    }
    let mut im = Importer {
        m,
        b: Builder::new(),
        dtype: bind.dtype,
        memo: HashMap::new(),
        producer,
        consumers,
        params: HashMap::new(),
        decoded: HashMap::new(),
        statics: HashMap::new(),
        folded: HashMap::new(),
        verdicts: HashMap::new(),
        rope_tables: HashMap::new(),
        depth: 0,
    };
    let mut inputs = Vec::new();
    for p in &m.inputs {
        let mut dims = Vec::with_capacity(p.dims.len());
        for (i, d) in p.dims.iter().enumerate() {
            dims.push(match d {
                Dim::Fixed(n) => *n,
                Dim::Named(name) => bind_axis(name, i, bind).ok_or_else(|| OnnxError::Model {
                    path: m.path.display().to_string(),
                    reason: format!(
                        "input {} has dynamic axis {i} (\"{name}\"), neither the batch nor the \
                         sequence; export it with a fixed size",
                        p.name
                    ),
                })?,
            });
        }
        let dtype = match p.elem {
            Elem::Float => bind.dtype,
            Elem::Int => DType::I64,
            Elem::Bool => DType::Bool,
        };
        im.b.set_block(None);
        let id = im.b.input(&p.name, dims, dtype);
        im.memo.insert(p.name.clone(), Value::Tensor { id, perm: None });
        inputs.push(ImportedInput { name: p.name.clone(), tensor: id, elem: p.elem });
    }
    let mut outputs = Vec::new();
    for o in &m.outputs {
        let v = im.value(&o.name)?;
        let id = im.tensor(&v, &o.name, "output")?;
        outputs.push(id);
    }
    prune(im.b, outputs, inputs)
}

/// The graph without the nodes no output reads: what `Shape` demanded of a value a fusion
/// then bypassed (the repeated keys of grouped-query attention, say). Data inputs stay,
/// read or not, so every model takes the inputs its file declares.
fn prune(b: Builder, outputs: Vec<TensorId>, inputs: Vec<ImportedInput>) -> Result<Imported> {
    let g = b.finish();
    let mut live = vec![false; g.nodes.len()];
    let mut stack: Vec<TensorId> = outputs.clone();
    stack.extend(inputs.iter().map(|i| i.tensor));
    while let Some(t) = stack.pop() {
        let n = g.tensor(t).producer.index();
        if !live[n] {
            live[n] = true;
            stack.extend(g.nodes[n].inputs.iter().copied());
        }
    }
    let mut nb = Builder::new();
    let mut map: HashMap<TensorId, TensorId> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        if !live[i] {
            continue;
        }
        let scope = g.scope_name(node.scope).to_string();
        nb.set_block(node.block);
        let outs: Vec<TensorId> = match &node.op {
            tessera_ir::Op::Parameter { meta, .. } => {
                vec![nb.parameter(&scope, meta.shape.clone(), meta.dtype)]
            }
            tessera_ir::Op::Input(meta) => vec![nb.input(&scope, meta.shape.clone(), meta.dtype)],
            op => {
                nb.set_scope_path(&scope);
                let ins: Vec<TensorId> = node.inputs.iter().map(|t| map[t]).collect();
                nb.push(op.clone(), &ins)
                    .map_err(|source| OnnxError::Ir {
                        node: scope.clone(),
                        op: format!("{op:?}"),
                        source: Box::new(source),
                    })?
                    .to_vec()
            }
        };
        for (old, new) in node.outputs.iter().zip(outs) {
            map.insert(*old, new);
        }
    }
    Ok(Imported {
        builder: nb,
        outputs: outputs.iter().map(|t| map[t]).collect(),
        inputs: inputs.into_iter().map(|i| ImportedInput { tensor: map[&i.tensor], ..i }).collect(),
    })
}

/// The size of dynamic axis `name` at position `i`: names that say batch or sequence, else
/// the position (0 batch, 1 sequence).
fn bind_axis(name: &str, i: usize, bind: &Bind) -> Option<usize> {
    let n = name.to_ascii_lowercase();
    if n.contains("batch") {
        Some(bind.batch)
    } else if n.contains("seq") || n.contains("len") || n.contains("token") {
        Some(bind.seq)
    } else {
        match i {
            0 => Some(bind.batch),
            1 => Some(bind.seq),
            _ => None,
        }
    }
}

/// The layer index in a node or parameter name: the number after the first `<name>.<int>`
/// or `<name>_<int>` path segment (`/transformer/h.3/attn/MatMul`, `model.layers.3.mlp`).
pub fn block_of(name: &str) -> Option<u32> {
    let segs: Vec<&str> = name.split(['/', '.']).filter(|s| !s.is_empty()).collect();
    for w in segs.windows(2) {
        if w[0].chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(i) = w[1].parse::<u32>() {
            return Some(i);
        }
    }
    None
}

/// What a rotary table pair was found to be: its sequence axis and inverse frequencies, or
/// not a rotary table (`None`).
pub(crate) type RopeRead = Option<(usize, Vec<f64>)>;

/// What identifies a fold: the operator, its attributes, and each input by value when small
/// (shape arithmetic computed afresh per layer) or by identity when large (a mask buffer).
/// Identities are stable: every constant of an import stays alive in its memo until the end,
/// so no address is reused while the key exists.
fn fold_key(node: &NodeProto, inputs: &[Option<Rc<Const>>]) -> String {
    use onnx_protobuf::Message;
    let mut key = node.op_type.clone();
    for a in &node.attribute {
        key.push_str(&format!("|{}={:?}", a.name, a.write_to_bytes().unwrap_or_default()));
    }
    for c in inputs {
        match c {
            None => key.push_str("|-"),
            Some(c) if c.numel() <= 64 => {
                key.push_str(&format!("|{:?}{:?}{:?}", c.elem, c.shape, c.to_f64()));
            }
            Some(c) => key.push_str(&format!("|@{:p}", Rc::as_ptr(c))),
        }
    }
    key
}

/// A node's scope path: its name with `/` separators as dots.
fn scope_of(node: &NodeProto) -> String {
    let s = node.name.trim_start_matches('/').replace('/', ".");
    if s.is_empty() {
        node.op_type.clone()
    } else {
        s
    }
}

impl<'m> Importer<'m> {
    pub(crate) fn node(&self, i: usize) -> &'m NodeProto {
        &self.m.graph.node[i]
    }

    /// The node producing value `name`.
    pub(crate) fn producer_of(&self, name: &str) -> Option<usize> {
        self.producer.get(name).copied()
    }

    /// How many nodes read value `name` (a graph output counts as a reader).
    pub(crate) fn readers(&self, name: &str) -> usize {
        let outs = self.m.outputs.iter().filter(|o| o.name == name).count();
        self.consumers.get(name).map_or(0, Vec::len) + outs
    }

    pub(crate) fn err_ir(&self, node: &NodeProto, source: tessera_ir::IrError) -> OnnxError {
        OnnxError::Ir {
            node: node.name.clone(),
            op: node.op_type.clone(),
            source: Box::new(source),
        }
    }

    pub(crate) fn unsupported(&self, node: &NodeProto, reason: impl Into<String>) -> OnnxError {
        OnnxError::Unsupported {
            node: node.name.clone(),
            op: node.op_type.clone(),
            reason: reason.into(),
        }
    }

    /// The value `name`, emitting its producer on first demand.
    pub(crate) fn value(&mut self, name: &str) -> Result<Value> {
        if let Some(v) = self.memo.get(name) {
            return Ok(v.clone());
        }
        if self.m.is_initializer(name) {
            // A dynamo export's folded copy of a parameter reads as the parameter.
            let v = match self.m.read_as(name).cloned() {
                Some(r) if r.transposed => {
                    Value::Tensor { id: self.parameter(&r.param)?, perm: Some(vec![1, 0]) }
                }
                Some(r) => Value::Init(r.param),
                None => Value::Init(name.to_string()),
            };
            self.memo.insert(name.to_string(), v.clone());
            return Ok(v);
        }
        let Some(i) = self.producer_of(name) else {
            return Err(OnnxError::Model {
                path: self.m.path.display().to_string(),
                reason: format!("value {name} has no producer, initialiser or input"),
            });
        };
        self.depth += 1;
        // The validation bounds the graph's depth; this guards the walk itself.
        if self.depth > crate::validate::MAX_DEPTH + 1 {
            return Err(OnnxError::TooDeep {
                path: self.m.path.display().to_string(),
                node: crate::validate::describe(self.node(i), i),
                limit: crate::validate::MAX_DEPTH,
            });
        }
        let r = self.emit(i);
        self.depth -= 1;
        r?;
        self.memo.get(name).cloned().ok_or_else(|| {
            self.unsupported(self.node(i), format!("produced no value for output {name}"))
        })
    }

    /// Whether value `name` is a constant once the axes are bound: it depends on no graph
    /// input except through `Shape`/`Size`. Decided on the graph alone, emitting nothing, by
    /// an explicit stack (no recursion along the graph's depth).
    pub(crate) fn is_static(&mut self, name: &str) -> bool {
        // (value, its inputs already pushed); `open` holds the values whose inputs are being
        // decided, so a cycle (refused by the validation anyway) cannot loop.
        let mut stack: Vec<(String, bool)> = vec![(name.to_string(), false)];
        let mut open: std::collections::HashSet<String> = Default::default();
        while let Some((top, expanded)) = stack.pop() {
            if self.statics.contains_key(&top) {
                continue;
            }
            let s = if self.m.is_initializer(&top) {
                !self.m.is_weight(&top)
            } else if let Some(i) = self.producer_of(&top) {
                let node = self.node(i);
                match node.op_type.as_str() {
                    "Shape" | "Size" | "Constant" => true,
                    _ => {
                        let ins = || node.input.iter().filter(|x| !x.is_empty());
                        if !expanded {
                            let pending: Vec<(String, bool)> = ins()
                                .filter(|x| {
                                    !self.statics.contains_key(x.as_str()) && !open.contains(*x)
                                })
                                .map(|x| (x.clone(), false))
                                .collect();
                            if !pending.is_empty() {
                                open.insert(top.clone());
                                stack.push((top, true));
                                stack.extend(pending);
                                continue;
                            }
                        }
                        ins().all(|x| self.statics.get(x.as_str()) == Some(&true))
                    }
                }
            } else {
                false
            };
            open.remove(&top);
            self.statics.insert(top, s);
        }
        self.statics.get(name).copied().unwrap_or(false)
    }

    /// The constant behind `v`, if it is one.
    pub(crate) fn as_const(&mut self, v: &Value) -> Result<Option<Rc<Const>>> {
        match v {
            Value::Const(c) => Ok(Some(c.clone())),
            Value::Init(name) => {
                if let Some(c) = self.decoded.get(name) {
                    return Ok(Some(c.clone()));
                }
                let c = Rc::new(self.m.initializer(name)?.ok_or_else(|| OnnxError::Model {
                    path: self.m.path.display().to_string(),
                    reason: format!("initialiser {name} vanished"),
                })?);
                self.decoded.insert(name.clone(), c.clone());
                Ok(Some(c))
            }
            Value::Tensor { .. } => Ok(None),
        }
    }

    /// The constant value of input `name` of a node (`None` if it is a tensor or omitted).
    pub(crate) fn const_input(&mut self, name: &str) -> Result<Option<Rc<Const>>> {
        if name.is_empty() {
            return Ok(None);
        }
        let v = self.value(name)?;
        self.as_const(&v)
    }

    /// The logical shape of `v`.
    pub(crate) fn shape_of(&mut self, v: &Value) -> Result<Vec<usize>> {
        Ok(match v {
            Value::Tensor { id, perm } => {
                let d = self.b.shape(*id).dims().to_vec();
                match perm {
                    Some(p) => p.iter().map(|&i| d[i]).collect(),
                    None => d,
                }
            }
            // An initialiser's shape is in its header: never decode a weight for it.
            Value::Init(name) => self.m.initializer_meta(name).map(|(s, _)| s).unwrap_or_default(),
            Value::Const(c) => c.shape.clone(),
        })
    }

    /// The parameter for initialiser `name` (created once, named as in the file).
    pub(crate) fn parameter(&mut self, name: &str) -> Result<TensorId> {
        // A dynamo export's renamed or cast copy of a parameter is that parameter.
        let resolved = match self.m.read_as(name) {
            Some(r) if !r.transposed => r.param.clone(),
            _ => name.to_string(),
        };
        let name = resolved.as_str();
        if let Some(&t) = self.params.get(name) {
            return Ok(t);
        }
        let Some((shape, elem)) = self.m.initializer_meta(name) else {
            return Err(OnnxError::Model {
                path: self.m.path.display().to_string(),
                reason: format!("initialiser {name} vanished"),
            });
        };
        if elem != Some(Elem::Float) {
            return Err(OnnxError::Model {
                path: self.m.path.display().to_string(),
                reason: format!("initialiser {name} is not float but is used as a weight"),
            });
        }
        let (block, scope) = (self.b.block(), self.b.scope_id());
        self.b.set_block(block_of(name));
        let t = self.b.parameter(name, Shape::from(shape), self.dtype);
        self.b.set_block(block);
        self.b.set_scope_id(scope);
        self.params.insert(name.to_string(), t);
        Ok(t)
    }

    /// `v` as an IR tensor in its logical layout. A constant becomes a parameter if it is an
    /// initialiser, a fill if it is a scalar, and is refused otherwise (the IR holds no data
    /// constants: masks and rotary tables must be fused away first).
    pub(crate) fn tensor(&mut self, v: &Value, node: &str, op: &str) -> Result<TensorId> {
        let err =
            |e| OnnxError::Ir { node: node.to_string(), op: op.to_string(), source: Box::new(e) };
        match v {
            Value::Tensor { id, perm: None } => Ok(*id),
            Value::Tensor { id, perm: Some(p) } => self.b.permute(*id, p).map_err(err),
            Value::Init(name) if self.m.is_weight(name) => self.parameter(name),
            // A float initialiser a dynamo export's signature does not list is a constant.
            Value::Init(_) => match self.as_const(v)? {
                Some(c) => self.tensor(&Value::Const(c), node, op),
                None => Err(OnnxError::Unsupported {
                    node: node.to_string(),
                    op: op.to_string(),
                    reason: "an initialiser vanished".into(),
                }),
            },
            Value::Const(c) => match c.scalar() {
                Some(x) if c.elem == Elem::Float => {
                    let dtype = self.dtype;
                    let t = self.b.fill(x, Shape::scalar(), dtype).map_err(err)?;
                    self.b.reshape(t, Shape::from(vec![1; c.shape.len()])).map_err(err)
                }
                _ => Err(OnnxError::Unsupported {
                    node: node.to_string(),
                    op: op.to_string(),
                    reason: format!(
                        "a constant {:?} tensor of shape {:?} (computed from shapes or buffers) \
                         feeds an operator on activations; the IR has no data constants, and no \
                         fusion (attention mask, rotary table) absorbed it",
                        c.elem, c.shape
                    ),
                }),
            },
        }
    }

    /// Emits node `i`: a fusion rooted at it, a constant fold, or its lowering.
    fn emit(&mut self, i: usize) -> Result<()> {
        let node = self.node(i);
        self.b.set_scope_path(&scope_of(node));
        self.b.set_block(block_of(&node.name));
        if let Some(v) = crate::fuse::try_fuse(self, i)? {
            self.b.set_scope_path(&scope_of(node));
            self.memo.insert(node.output[0].clone(), v);
            return Ok(());
        }
        let mut values = Vec::with_capacity(node.input.len());
        for x in &node.input {
            values.push(if x.is_empty() { None } else { Some(self.value(x)?) });
        }
        // The walk may have moved the scope while emitting the inputs.
        self.b.set_scope_path(&scope_of(node));
        self.b.set_block(block_of(&node.name));
        let outs = match self.fold(node, &values)? {
            Some(c) => c.into_iter().map(Value::Const).collect(),
            None => self.lower(node, &values)?,
        };
        for (name, v) in node.output.iter().zip(outs) {
            if !name.is_empty() {
                self.memo.insert(name.clone(), v);
            }
        }
        Ok(())
    }

    /// Folds `node` if every input is constant and the operator folds.
    fn fold(
        &mut self,
        node: &NodeProto,
        values: &[Option<Value>],
    ) -> Result<Option<Vec<Rc<Const>>>> {
        let one = |c: Const| Ok(Some(vec![Rc::new(c)]));
        match node.op_type.as_str() {
            "Constant" => return one(self.constant(node)?),
            "Shape" | "Size" => {
                let v = values
                    .first()
                    .cloned()
                    .flatten()
                    .ok_or_else(|| self.unsupported(node, "no input"))?;
                let shape: Vec<i64> = self.shape_of(&v)?.iter().map(|&d| d as i64).collect();
                if node.op_type == "Size" {
                    return one(Const::ints(vec![], vec![shape.iter().product()]));
                }
                let r = shape.len() as i64;
                let clampi = |a: i64| (if a < 0 { a + r } else { a }).clamp(0, r) as usize;
                let s = clampi(crate::attrs::int(node, "start", 0));
                let e = clampi(crate::attrs::int(node, "end", r));
                let part = shape[s..e.max(s)].to_vec();
                return one(Const::ints(vec![part.len()], part));
            }
            _ => {}
        }
        // Float initialisers are weights: what reads them is computation, never folded.
        let weight = |v: &Value| match v {
            Value::Tensor { .. } => true,
            Value::Init(name) => self.m.is_weight(name),
            Value::Const(_) => false,
        };
        if values.iter().flatten().any(weight) || values.is_empty() {
            return Ok(None);
        }
        // Every input is constant: read the initialisers among them.
        let mut consts = Vec::with_capacity(values.len());
        for v in values {
            consts.push(match v {
                Some(v) => self.as_const(v)?,
                None => None,
            });
        }
        // The same computation on the same constants (every layer slicing one causal mask
        // buffer to the same size) is folded once: large inputs by identity, small by value.
        let key = fold_key(node, &consts);
        if let Some(hit) = self.folded.get(&key) {
            return Ok(Some(hit.clone()));
        }
        let refs: Vec<Option<&Const>> = consts.iter().map(|c| c.as_deref()).collect();
        let out = consts::eval(node, &refs).map_err(|reason| self.unsupported(node, reason))?;
        let out: Option<Vec<Rc<Const>>> = out.map(|v| v.into_iter().map(Rc::new).collect());
        if let Some(v) = &out {
            self.folded.insert(key, v.clone());
        }
        Ok(out)
    }

    /// A `Constant` node's value.
    fn constant(&mut self, node: &NodeProto) -> Result<Const> {
        use crate::attrs;
        if let Some(t) = attrs::tensor(node, "value") {
            return crate::tensor::decode(t, self.m.dir());
        }
        if let Some(a) = attrs::attr(node, "value_float") {
            return Ok(Const::floats(vec![], vec![a.f as f64]));
        }
        if let Some(a) = attrs::attr(node, "value_int") {
            return Ok(Const::ints(vec![], vec![a.i]));
        }
        if let Some(a) = attrs::attr(node, "value_floats") {
            return Ok(Const::floats(
                vec![a.floats.len()],
                a.floats.iter().map(|&x| x as f64).collect(),
            ));
        }
        if let Some(a) = attrs::attr(node, "value_ints") {
            return Ok(Const::ints(vec![a.ints.len()], a.ints.clone()));
        }
        Err(self.unsupported(node, "a Constant without a value, value_float(s) or value_int(s)"))
    }

    /// Names of the nodes reading node `i`'s outputs (for error messages).
    pub(crate) fn used_by(&self, i: usize) -> String {
        let mut names: Vec<String> = Vec::new();
        for o in &self.node(i).output {
            for &c in self.consumers.get(o.as_str()).into_iter().flatten() {
                let n = self.node(c);
                names.push(format!("{} ({})", n.name, n.op_type));
            }
            if self.m.outputs.iter().any(|p| &p.name == o) {
                names.push(format!("graph output {o}"));
            }
        }
        if names.is_empty() {
            "nothing".into()
        } else {
            names.join(", ")
        }
    }

    /// Index of node `node` (by identity).
    pub(crate) fn index_of(&self, node: &NodeProto) -> usize {
        self.m.graph.node.iter().position(|n| std::ptr::eq(n, node)).unwrap_or(0)
    }
}
