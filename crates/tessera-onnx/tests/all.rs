//! Every integration test of this crate but those that need a process of their own, as one
//! test program: one link and one binary instead of one per file (a clean `make test` links
//! fewer, smaller files). A new file here needs its `mod` line; `tidy.rs`
//! (`every_test_file_is_compiled`) fails on a file no test target reaches.

mod dynamo;
mod fixtures;
mod fuzz_onnx;
mod support;
mod validate;
