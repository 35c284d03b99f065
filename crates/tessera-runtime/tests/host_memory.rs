//! An allocation the machine cannot give is an error naming the tensor, never an abort or a
//! silent kill by the kernel (issue 17): the executor checks the host's available memory
//! before large allocations ([`HostMemory`]). Here the figure is made up (a few KiB), so the
//! check trips on gpt2-tiny's first sizeable tensor; with room, the same Program runs.

use tessera_ir::{DType, Program};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::executor::HostMemory;
use tessera_runtime::{CpuBackend, Executor, RuntimeError};

fn executor(host: HostMemory) -> (Executor<CpuBackend>, tessera_ir::Graph) {
    let cfg = ModelConfig::resolve("gpt2-tiny").unwrap();
    let m = build(&cfg, &BuildOptions::new(2, 16, DType::F32)).unwrap();
    let inputs: Vec<_> = m.inputs.iter().map(|i| i.tensor).collect();
    let graph = m.builder.finish();
    let params = tessera_runtime::init::init_parameters(&graph, 5).unwrap();
    let mut exec = Executor::new(
        Program::lower_graph(graph.clone(), vec![m.loss], &[]),
        CpuBackend::new(0),
        None,
    )
    .with_host_memory(host);
    for (t, v) in params {
        exec.bind(t, v).unwrap();
    }
    for t in inputs {
        let meta = graph.meta(t);
        let v = match meta.dtype {
            DType::F32 => candle_core::Tensor::ones(
                meta.shape.dims(),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            ),
            _ => candle_core::Tensor::zeros(
                meta.shape.dims(),
                candle_core::DType::I64,
                &candle_core::Device::Cpu,
            ),
        };
        exec.bind(t, v.unwrap()).unwrap();
    }
    (exec, graph)
}

#[test]
fn a_tensor_the_host_cannot_hold_is_an_error_naming_it() {
    let (mut exec, graph) = executor(HostMemory { check_from: 4096, available: || Some(4096) });
    let err = exec.run().unwrap_err();
    let RuntimeError::OutOfHostMemory { tensor, bytes, available, .. } = &err else {
        panic!("expected OutOfHostMemory, got {err}");
    };
    assert!(*bytes > 4096 && *available == 4096, "{err}");
    // The tensor named is one of the graph's, with its shape.
    let named = graph.nodes.iter().any(|n| tensor.starts_with(graph.scope_name(n.scope)));
    assert!(named && tensor.contains('['), "{tensor}");
    let msg = err.to_string();
    assert!(msg.contains("out of host memory") && msg.contains("--batch"), "{msg}");
}

#[test]
fn with_room_the_same_program_runs() {
    let (mut exec, _) = executor(HostMemory { check_from: 4096, available: || Some(u64::MAX) });
    exec.run().unwrap();
    // A machine that cannot tell (not Linux) is not checked.
    let (mut exec, _) = executor(HostMemory { check_from: 4096, available: || None });
    exec.run().unwrap();
}
