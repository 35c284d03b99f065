//! Every integration test of this crate but those that need a process of their own, as one
//! test program: one link and one binary instead of one per file (a clean `make test` links
//! fewer, smaller files). A new file here needs its `mod` line; `tidy.rs`
//! (`every_test_file_is_compiled`) fails on a file no test target reaches.

mod act_offload;
mod chunked_loss;
mod ckpt;
mod cli;
mod context_parallel;
mod cuda_cli;
mod denoise_inference;
mod diffusers_unet;
mod dit;
mod eval_io;
mod expert_parallel;
mod export;
mod families;
mod fp16;
mod fuzz_flags;
mod generate;
mod hf_parity;
mod inference_plan;
mod latent_pipeline;
mod lora;
mod megatron_layout;
mod misuse;
mod moe_models;
mod mpi_train;
mod offload;
mod onnx;
mod onnx_dynamo;
mod pictures;
mod pipeline;
mod plan;
mod published_runs;
mod python_package;
mod readme;
mod reliability;
mod ring_attention;
mod run_file;
mod runtime_grads;
mod sd_components;
mod spmd;
mod spmd_cli;
mod support;
mod tidy;
mod tiled_mlp;
mod train;
mod unet_spmd;
mod vision_spmd;
