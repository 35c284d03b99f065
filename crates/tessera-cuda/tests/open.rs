//! Opening a GPU: on a machine with a driver it opens and compiles every kernel; without one
//! (CI) it is an error naming what is missing and how to proceed, never a crash.

use tessera_cuda::Gpu;

#[test]
fn opening_a_gpu_works_or_names_the_missing_driver() {
    match Gpu::open(0) {
        Ok(gpu) => {
            assert!(!gpu.device_name().is_empty());
            let (free, total) = gpu.mem_info().unwrap();
            assert!(free <= total && total > 0);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda.so") || msg.contains("opening GPU 0"),
                "the error must name the missing driver or the failing device: {msg}"
            );
        }
    }
}
