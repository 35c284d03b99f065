//! Diffusion models of diffusers (read from a `config.json` by its `_class_name`).

mod dit;

pub(crate) use dit::{build as build_dit, from_diffusers as dit_from_diffusers};
pub use dit::{DitConfig, DitParams, DIT_CLASS_NAME, TIMESTEP_FEATURES};
