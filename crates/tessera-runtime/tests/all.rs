//! Every integration test of this crate but those that need a process of their own, as one
//! test program: one link and one binary instead of one per file (a clean `make test` links
//! fewer, smaller files). A new file here needs its `mod` line; `tidy.rs`
//! (`every_test_file_is_compiled`) fails on a file no test target reaches.

mod batches;
mod bf16_policy;
mod checkpoint;
mod data;
mod dist_checkpoint;
mod expert_layout;
mod fuzz_safetensors;
mod host_memory;
mod integrity;
mod kernels_basic;
mod kernels_bf16;
mod kernels_linear_loss;
mod kernels_moe;
mod kernels_simd;
mod kernels_tiled_mlp;
mod vision_model;
