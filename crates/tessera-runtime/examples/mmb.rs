use candle_core::{Device, Tensor};
use std::time::Instant;
use tessera_ir::Op;
use tessera_runtime::kernels::execute;
use tessera_runtime::tensor::meta_of;
fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().unwrap()).collect();
    let (m, k, n, ta, tb, secs) = (a[0], a[1], a[2], a[3] == 1, a[4] == 1, a[5]);
    let l = if ta {
        Tensor::randn(0f32, 1., &[k, m], &Device::Cpu)
    } else {
        Tensor::randn(0f32, 1., &[m, k], &Device::Cpu)
    }
    .unwrap()
    .to_dtype(candle_core::DType::BF16)
    .unwrap();
    let r = if tb {
        Tensor::randn(0f32, 1., &[n, k], &Device::Cpu)
    } else {
        Tensor::randn(0f32, 1., &[k, n], &Device::Cpu)
    }
    .unwrap()
    .to_dtype(candle_core::DType::BF16)
    .unwrap();
    let op = Op::MatMul { trans_a: ta, trans_b: tb };
    let ms = [meta_of(&l).unwrap(), meta_of(&r).unwrap()];
    let out = op.infer(&ms.iter().collect::<Vec<_>>()).unwrap();
    let t = Instant::now();
    let mut it = 0;
    while t.elapsed().as_secs() < secs as u64 || it < 3 {
        execute(&op, &[&l, &r], &out).unwrap();
        it += 1;
    }
    let s = t.elapsed().as_secs_f64() / it as f64;
    println!("{m}x{k}x{n} ta={ta} tb={tb}: {:.1} GFLOP/s", 2.0 * (m * n * k) as f64 / s / 1e9);
}
