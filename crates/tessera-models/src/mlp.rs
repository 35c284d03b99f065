//! A multilayer perceptron classifier (our own `model_type: "mlp"`).
//!
//! Reference: Rumelhart, Hinton & Williams 1986, "Learning representations by
//! back-propagating errors"; layers as PyTorch's `nn.Linear` (weight `[out, in]`), the shape of
//! the classic MNIST example (784 → 1024 → 1024 → 10).
//!
//! ```text
//! for each hidden layer j:  x = relu(layers.j(x))          # block j
//! logits_bl = layers.{J}(x)                                 # J = number of hidden layers
//! loss = cross_entropy(logits_bl, labels_b)
//! ```
//! Shape suffixes: `b` batch, `f` features of the current layer, `l` classes.
//!
//! FLOPs: forward per sample = Σ over layers 2·in·out (+ the biases and ReLUs as "other");
//! training 3× that (the first layer's dX product is skipped: the input needs no gradient).

use crate::config::MlpConfig;
use crate::error::Result;
use crate::nn::{self, Inputs};
use crate::{BuildOptions, ForwardModel, InputKind};
use tessera_ir::{Builder, DType, UnaryOp};

pub(crate) fn build(cfg: &MlpConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, dtype) = (opts.batch, opts.dtype);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let mut x_bf = inputs.add(&mut b, "inputs", [batch, cfg.input_dim], dtype, InputKind::Features);
    let labels_b = inputs.add(
        &mut b,
        "labels",
        [batch],
        DType::I64,
        InputKind::Labels { num_classes: cfg.num_classes, ignore_index: None },
    );
    for (j, &width) in cfg.hidden_dims.iter().enumerate() {
        b.set_block(Some(j as u32));
        let name = format!("layers.{j}");
        x_bf = nn::linear(&mut b, &name, x_bf, width, true)?;
        x_bf = b.scoped(&name, |b| b.unary(UnaryOp::Relu, x_bf))?;
    }
    b.set_block(None);
    let last = format!("layers.{}", cfg.hidden_dims.len());
    let logits_bl = nn::linear(&mut b, &last, x_bf, cfg.num_classes, true)?;
    let loss = b.cross_entropy(logits_bl, labels_b, None)?;
    Ok(ForwardModel { builder: b, loss, logits: logits_bl, batch, seq: 1, inputs: inputs.list })
}
