//! The counting allocator keeps per-thread shards and hands bytes on in batches: the current
//! count must still be exact once threads are gone, and large allocations must move the peak
//! at once. One test in its own binary, so no other test allocates meanwhile.

use tessera_runtime::alloc::{current_bytes, peak_bytes, reset_peak, CountingAlloc};

#[global_allocator]
static A: CountingAlloc = CountingAlloc;

#[test]
fn counts_are_exact_across_threads_and_peaks_see_large_buffers() {
    let base = current_bytes();
    assert!(base > 0, "the counting allocator is installed");
    // Small allocations on threads that exit while their buffers live on: each thread's
    // held-back bytes must survive it.
    let (threads, per, size) = (4usize, 1000usize, 100usize);
    let kept: Vec<Vec<Vec<u8>>> = (0..threads)
        .map(|_| std::thread::spawn(move || (0..per).map(|_| vec![1u8; size]).collect()))
        .map(|h| h.join().expect("thread ran"))
        .collect();
    let held = (threads * per * size) as u64;
    let grown = current_bytes() - base;
    // Exact up to the holders' own vectors (one Vec header per buffer, and the outer vectors).
    let headers = (threads * per * std::mem::size_of::<Vec<u8>>()
        + threads * std::mem::size_of::<Vec<Vec<u8>>>()) as u64;
    assert!(
        (held..=held + headers + 4096).contains(&grown),
        "{grown} bytes counted for {held} allocated (+{headers} of vector headers)"
    );
    drop(kept);
    let after = current_bytes();
    assert!(after <= base + 4096, "freed buffers still counted: {after} vs {base} before");

    reset_peak();
    let start = peak_bytes();
    let big = vec![0u8; 10 << 20];
    std::hint::black_box(&big);
    drop(big);
    let rose = peak_bytes() - start;
    assert!(rose >= 10 << 20, "a 10 MiB buffer moved the peak by only {rose} bytes");
    assert!(rose < (10 << 20) + (1 << 20), "peak rose by {rose} for a 10 MiB buffer");
}
