//! Times reading an ONNX file and importing it at a batch and sequence (benchmark helper for
//! BENCHMARKS.md): `cargo run --release -p tessera-onnx --example import_time -- FILE [B S]`.

use std::time::Instant;
use tessera_ir::DType;
use tessera_onnx::{import, Bind, OnnxModel};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: import_time FILE [BATCH SEQ]")?;
    let batch = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let seq = args.get(3).map_or(Ok(1024), |s| s.parse())?;
    let t = Instant::now();
    let model = OnnxModel::open(std::path::Path::new(path))?;
    let read = t.elapsed();
    // The first import folds and checks the attention masks; later ones (the planner's, at
    // other micro-batch sizes) reuse the verdicts.
    let t = Instant::now();
    let first = import(&model, &Bind { batch, seq, dtype: DType::BF16 })?;
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    let reps = 5;
    let t = Instant::now();
    for b in 1..=reps {
        import(&model, &Bind { batch: b, seq, dtype: DType::BF16 })?;
    }
    let later_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    println!(
        "{path} at {batch}x{seq}: read {:.0} ms, first import {first_ms:.1} ms, later imports \
         {later_ms:.1} ms ({} ONNX nodes -> {} IR nodes)",
        read.as_secs_f64() * 1e3,
        model.graph_nodes(),
        first.builder.graph.nodes.len()
    );
    Ok(())
}
