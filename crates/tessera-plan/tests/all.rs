//! Every integration test of this crate but those that need a process of their own, as one
//! test program: one link and one binary instead of one per file (a clean `make test` links
//! fewer, smaller files). A new file here needs its `mod` line; `tidy.rs`
//! (`every_test_file_is_compiled`) fails on a file no test target reaches.

mod act_offload;
mod chunked_loss;
mod common;
mod config_pipeline;
mod fuzz_inputs;
mod ilp;
mod kernel_table;
mod least_memory;
mod pilots;
mod pipeline_balance;
mod pipeline_memory;
mod priced;
mod reshard;
mod scan_bound;
mod search;
mod tidy_modules;
mod tiled_mlp;
mod vision;
