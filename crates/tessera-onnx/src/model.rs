//! An ONNX file read and checked once: its graph, initialisers by name, the graph inputs
//! and outputs with their dynamic axes, and the summary the CLI reports.

use crate::error::{OnnxError, Result};
use crate::tensor::{decode, elem_of, Const, Elem};
use onnx_protobuf::{GraphProto, Message, ModelProto};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One dimension of a graph input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Fixed(usize),
    /// A dynamic axis (`dim_param`), bound at import to the batch or the sequence length.
    Named(String),
}

/// A graph input or output: name, element kind and dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct Port {
    pub name: String,
    pub elem: Elem,
    pub dims: Vec<Dim>,
}

/// A parsed ONNX model.
#[derive(Debug)]
pub struct OnnxModel {
    pub path: PathBuf,
    pub(crate) graph: GraphProto,
    pub(crate) inits: HashMap<String, usize>,
    /// Parameters `torch.onnx.export` merged into another initialiser because their values
    /// were equal (freshly initialised biases and norms): each is an `Identity` of the one kept,
    /// named as the parameter was. Name → the initialiser holding its (initial) value.
    pub(crate) aliases: HashMap<String, String>,
    /// Graph inputs that are data (not initialisers), in order.
    pub inputs: Vec<Port>,
    pub outputs: Vec<Port>,
    /// The default-domain opset the file declares.
    pub opset: i64,
    /// Attention masks judged by earlier imports: (the attention's output value, S, T) → causal, unmasked
    /// (`Some(false)`), or neither. A mask is a function of the shapes, so the planner's many
    /// imports at one sequence length fold it once.
    verdicts: std::sync::Mutex<HashMap<(String, usize, usize), Option<bool>>>,
    /// What a dynamo export's metadata says about its parameters ([`crate::torch_meta`]);
    /// `None` for files without it (TorchScript exports): every float initialiser a weight.
    torch: Option<crate::torch_meta::TorchParams>,
    /// Rotary tables read by earlier imports: "cos|sin|shape" → what they were.
    ropes: std::sync::Mutex<HashMap<String, crate::import::RopeRead>>,
}

/// The oldest default-domain opset the importer reads (LayerNormalization is opset 17).
pub const MIN_OPSET: i64 = 13;

impl OnnxModel {
    /// Reads and checks `path`.
    pub fn open(path: &Path) -> Result<OnnxModel> {
        let bytes = std::fs::read(path)
            .map_err(|source| OnnxError::Io { path: path.display().to_string(), source })?;
        OnnxModel::from_bytes(&bytes, path)
    }

    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<OnnxModel> {
        let p = path.display().to_string();
        let model = ModelProto::parse_from_bytes(bytes)
            .map_err(|e| OnnxError::Parse { path: p.clone(), reason: e.to_string() })?;
        let bad = |reason: String| OnnxError::Model { path: p.clone(), reason };
        let graph = model.graph.into_option().ok_or_else(|| bad("the file has no graph".into()))?;
        let opset = model
            .opset_import
            .iter()
            .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map(|o| o.version)
            .ok_or_else(|| bad("the file declares no default-domain opset".into()))?;
        if opset < MIN_OPSET {
            return Err(bad(format!(
                "opset {opset} is older than {MIN_OPSET}; export with opset_version=17"
            )));
        }
        if let Some(n) = graph.node.iter().find(|n| !(n.domain.is_empty() || n.domain == "ai.onnx"))
        {
            return Err(OnnxError::UnsupportedOp {
                op: format!("{}::{}", n.domain, n.op_type),
                node: n.name.clone(),
                used_by: "the graph".into(),
                supported: "operators of the default ONNX domain only".into(),
            });
        }
        crate::validate::validate(&p, &graph)?;
        let inits: HashMap<String, usize> =
            graph.initializer.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let port = |v: &onnx_protobuf::ValueInfoProto| -> Result<Port> {
            let t = v.type_.tensor_type();
            let elem = elem_of(t.elem_type)
                .ok_or_else(|| bad(format!("{} has element type {}", v.name, t.elem_type)))?;
            let dims = t
                .shape
                .dim
                .iter()
                .map(|d| match &d.value {
                    Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimValue(n)) => {
                        usize::try_from(*n)
                            .map(Dim::Fixed)
                            .map_err(|_| bad(format!("{} has dimension {n}", v.name)))
                    }
                    Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimParam(s)) => {
                        Ok(Dim::Named(s.clone()))
                    }
                    _ => Ok(Dim::Named(String::new())),
                })
                .collect::<Result<Vec<Dim>>>()?;
            Ok(Port { name: v.name.clone(), elem, dims })
        };
        let aliases: HashMap<String, String> = graph
            .node
            .iter()
            .filter(|n| n.op_type == "Identity" && n.input.len() == 1 && n.output.len() == 1)
            .filter(|n| {
                inits
                    .get(&n.input[0])
                    .is_some_and(|&i| elem_of(graph.initializer[i].data_type) == Some(Elem::Float))
                    && !inits.contains_key(&n.output[0])
            })
            .map(|n| (n.output[0].clone(), n.input[0].clone()))
            .collect();
        let torch = crate::torch_meta::read(&graph, &inits, path)?;
        let inputs = graph
            .input
            .iter()
            .filter(|v| !inits.contains_key(&v.name))
            .map(port)
            .collect::<Result<Vec<_>>>()?;
        let outputs = graph.output.iter().map(port).collect::<Result<Vec<_>>>()?;
        if inputs.is_empty() || outputs.is_empty() {
            return Err(bad("the graph needs at least one data input and one output".into()));
        }
        Ok(OnnxModel {
            path: path.to_path_buf(),
            graph,
            inits,
            aliases,
            inputs,
            outputs,
            opset,
            torch,
            verdicts: Default::default(),
            ropes: Default::default(),
        })
    }

    /// The model's name: the file's stem (or its folder's name for `model.onnx`).
    pub fn name(&self) -> String {
        let stem = self.path.file_stem().map(|s| s.to_string_lossy().into_owned());
        match stem.as_deref() {
            Some("model") | None => self
                .path
                .parent()
                .and_then(Path::file_name)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
            Some(s) => s.to_string(),
        }
    }

    /// The folder external data files are read from.
    pub(crate) fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Whether `name` is an initialiser or a parameter merged into one ([`OnnxModel::aliases`]).
    pub fn is_initializer(&self, name: &str) -> bool {
        self.inits.contains_key(name)
            || self.aliases.contains_key(name)
            || self
                .torch
                .as_ref()
                .is_some_and(|t| t.aliases.contains_key(name) || t.transposed.contains_key(name))
    }

    /// The initialiser holding parameter (or initialiser) `name`'s value, and whether it
    /// holds it transposed.
    fn source<'a>(&'a self, name: &'a str) -> (&'a str, bool) {
        if let Some(t) = &self.torch {
            if let Some(f) = t.transposed.get(name) {
                return (f, true);
            }
            if let Some(a) = t.aliases.get(name) {
                return (a, false);
            }
        }
        (self.aliases.get(name).map_or(name, String::as_str), false)
    }

    /// How graph value `name`, an initialiser, is read when it is not read as itself: as
    /// another parameter (a tied or renamed weight) or as a parameter's transpose.
    pub(crate) fn read_as(&self, name: &str) -> Option<&crate::torch_meta::ReadAs> {
        let r = self.torch.as_ref()?.reads.get(name)?;
        (r.param != name || r.transposed).then_some(r)
    }

    /// The initialiser `name` (or the one a merged parameter's value is in), decoded.
    pub fn initializer(&self, name: &str) -> Result<Option<Const>> {
        let (name, transposed) = self.source(name);
        match self.inits.get(name) {
            Some(&i) => {
                let c = decode(&self.graph.initializer[i], self.dir())?;
                Ok(Some(if transposed { c.permuted(&[1, 0]).materialize() } else { c }))
            }
            None => Ok(None),
        }
    }

    /// Shape and element kind of initialiser `name` (or a merged parameter's), read from its
    /// header: no data is decoded.
    pub fn initializer_meta(&self, name: &str) -> Option<(Vec<usize>, Option<Elem>)> {
        let (name, transposed) = self.source(name);
        let t = &self.graph.initializer[*self.inits.get(name)?];
        let mut dims: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
        if transposed {
            dims.reverse();
        }
        Some((dims, elem_of(t.data_type)))
    }

    /// Whether initialiser `name` is a weight (a float tensor): a parameter of the graph.
    /// Integer and boolean initialisers are constants.
    pub fn is_weight(&self, name: &str) -> bool {
        if let Some(t) = &self.torch {
            return t.reads.contains_key(name)
                || t.aliases.contains_key(name)
                || t.transposed.contains_key(name);
        }
        let name = self.aliases.get(name).map_or(name, String::as_str);
        self.inits
            .get(name)
            .is_some_and(|&i| elem_of(self.graph.initializer[i].data_type) == Some(Elem::Float))
    }

    /// The initialiser `name` as f32 values with its shape (a parameter's starting weights).
    /// NaN or infinite values (or values beyond f32's range) are refused by name, so that no
    /// training starts from them.
    pub fn weights_f32(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
        let Some(c) = self.initializer(name)? else { return Ok(None) };
        let v: Vec<f32> = c.to_f64().into_iter().map(|x| x as f32).collect();
        let mut bad = v.iter().enumerate().filter(|(_, x)| !x.is_finite());
        if let Some((first_index, &x)) = bad.next() {
            let stored = self.aliases.get(name).map_or(name, String::as_str);
            let tensor = if stored == name {
                name.to_string()
            } else {
                format!("{stored} (the value of parameter {name})")
            };
            return Err(OnnxError::NonFinite {
                path: self.path.display().to_string(),
                tensor,
                count: 1 + bad.count(),
                total: v.len(),
                first_index,
                first_value: x as f64,
            });
        }
        Ok(Some((c.shape, v)))
    }

    /// Name and shape of every weight (float initialiser), in file order, then the merged
    /// parameters ([`OnnxModel::aliases`]) by name.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        if let Some(t) = &self.torch {
            // The parameters the graph reads, once each, in `named_parameters()` order.
            return t
                .order
                .iter()
                .map(|n| (n.clone(), self.initializer_meta(n).map(|m| m.0).unwrap_or_default()))
                .collect();
        }
        let dims = |t: &onnx_protobuf::TensorProto| -> Vec<usize> {
            t.dims.iter().map(|&d| d.max(0) as usize).collect()
        };
        let mut out: Vec<(String, Vec<usize>)> = self
            .graph
            .initializer
            .iter()
            .filter(|t| elem_of(t.data_type) == Some(Elem::Float))
            .map(|t| (t.name.clone(), dims(t)))
            .collect();
        let mut merged: Vec<(&String, &String)> = self.aliases.iter().collect();
        merged.sort();
        out.extend(
            merged
                .into_iter()
                .map(|(a, src)| (a.clone(), dims(&self.graph.initializer[self.inits[src]]))),
        );
        out
    }

    pub(crate) fn attention_verdict(&self, node: &str, s: usize, t: usize) -> Option<Option<bool>> {
        let v = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        v.get(&(node.to_string(), s, t)).copied()
    }

    pub(crate) fn remember_attention_verdict(
        &self,
        node: &str,
        s: usize,
        t: usize,
        v: Option<bool>,
    ) {
        let mut m = self.verdicts.lock().unwrap_or_else(|e| e.into_inner());
        m.insert((node.to_string(), s, t), v);
    }

    pub(crate) fn cached_rope(&self, key: &str) -> Option<crate::import::RopeRead> {
        self.ropes.lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned()
    }

    pub(crate) fn remember_rope(&self, key: &str, read: crate::import::RopeRead) {
        self.ropes.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string(), read);
    }

    /// The first operator of the graph the importer has no mapping for, as the error that
    /// names it, its node and the nodes reading its outputs.
    pub fn check_operators(&self) -> Result<()> {
        let Some(bad) =
            self.graph.node.iter().find(|n| !crate::SUPPORTED_OPS.contains(&n.op_type.as_str()))
        else {
            return Ok(());
        };
        let mut readers: Vec<String> = Vec::new();
        for o in &bad.output {
            for n in self.graph.node.iter().filter(|n| n.input.contains(o)) {
                readers.push(format!("{} ({})", n.name, n.op_type));
            }
            if self.outputs.iter().any(|p| &p.name == o) {
                readers.push(format!("graph output {o}"));
            }
        }
        Err(OnnxError::UnsupportedOp {
            op: bad.op_type.clone(),
            node: bad.name.clone(),
            used_by: if readers.is_empty() { "nothing".into() } else { readers.join(", ") },
            supported: crate::SUPPORTED_OPS.join(", "),
        })
    }

    /// Nodes in the graph.
    pub fn graph_nodes(&self) -> usize {
        self.graph.node.len()
    }

    /// The distinct operators the graph uses, sorted.
    pub fn operators(&self) -> BTreeSet<String> {
        self.graph.node.iter().map(|n| n.op_type.clone()).collect()
    }
}
