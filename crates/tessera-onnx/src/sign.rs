//! Which values are never negative, decided on the graph and its constants: a `Pow` with a
//! fractional exponent (`x ** 0.5`) is NaN on a negative entry, and the importer refuses it
//! unless its base is provably non-negative, naming the node, rather than let the first step's
//! NaN be blamed on the learning rate.
//!
//! Sound but incomplete: a value is non-negative when its operator makes it so (`Abs`,
//! `Relu`, `Exp`, `Sigmoid`, `Softmax`, `Sqrt`, an even power, `x · x`) or when it combines
//! non-negative values in a way that keeps the sign (sums, products, quotients, means,
//! reshapes). Trained weights are never assumed non-negative (their sign may change). The
//! search looks at most [`MAX_STEPS`] values back (no unbounded recursion).

use crate::import::Importer;

/// The most values the proof explores before answering "may be negative".
const MAX_STEPS: usize = 256;

impl Importer<'_> {
    /// Whether value `name` is never negative, as far as the graph shows.
    pub(crate) fn never_negative(&mut self, name: &str) -> bool {
        let mut budget = MAX_STEPS;
        self.never_negative_within(name, &mut budget, 0)
    }

    fn never_negative_within(&mut self, name: &str, budget: &mut usize, depth: usize) -> bool {
        if *budget == 0 || depth > 64 || name.is_empty() {
            return false;
        }
        *budget -= 1;
        if self.m.is_initializer(name) {
            if self.m.is_weight(name) {
                return false;
            }
            return self.const_non_negative(name);
        }
        let Some(i) = self.producer_of(name) else { return false };
        let node = self.node(i);
        let ins: Vec<String> = node.input.clone();
        let mut all = |im: &mut Self, names: &[String]| {
            names.iter().all(|x| im.never_negative_within(x, budget, depth + 1))
        };
        match node.op_type.as_str() {
            "Abs" | "Relu" | "Exp" | "Sigmoid" | "Softmax" | "Sqrt" | "Shape" | "Size" => true,
            "Constant" => self.const_non_negative(name),
            "Pow" => {
                let even = self
                    .const_input(&ins[1])
                    .ok()
                    .flatten()
                    .and_then(|c| c.scalar())
                    .is_some_and(|e| e % 2.0 == 0.0);
                even || all(self, &ins[..1])
            }
            "Mul" if ins.len() == 2 && ins[0] == ins[1] => true,
            "Add" | "Mul" | "Div" | "ReduceMean" | "ReduceSum" | "Min" | "Concat" | "Where" => {
                // Where: both branches (input 0 is the condition).
                let from = usize::from(node.op_type == "Where");
                let data: Vec<String> = match node.op_type.as_str() {
                    "ReduceMean" | "ReduceSum" => ins[..1].to_vec(),
                    _ => ins[from..].to_vec(),
                };
                all(self, &data)
            }
            "Max" => ins.iter().any(|x| self.never_negative_within(x, budget, depth + 1)),
            "Identity" | "Cast" | "Reshape" | "Transpose" | "Expand" | "Unsqueeze" | "Squeeze"
            | "Flatten" | "Slice" | "Split" | "Dropout" | "Gather" => all(self, &ins[..1]),
            _ => false,
        }
    }

    /// Whether the constant value `name` holds no negative entry (false if not constant).
    fn const_non_negative(&mut self, name: &str) -> bool {
        if !self.is_static(name) {
            return false;
        }
        match self.const_input(name) {
            Ok(Some(c)) => c.to_f64().iter().all(|&v| v >= 0.0),
            _ => false,
        }
    }
}
