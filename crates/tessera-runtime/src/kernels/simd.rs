//! Runtime ISA dispatch for the memory- and exp-bound kernels (elementwise, norms, softmax,
//! cross-entropy, dropout, AdamW).
//!
//! The crate is built for the baseline x86-64 (SSE2: four f32 or two f64 lanes), so the
//! vectorised loops of these kernels used a quarter of an AVX-512 register. [`wide!`] compiles a
//! loop nest once per ISA (AVX-512, AVX2, baseline) and runs the widest the CPU has, chosen at
//! run time.
//!
//! Results are bit-identical to the baseline build: rustc never contracts `a·b + c` into an
//! FMA (no fast-math flags), every vector instruction LLVM picks rounds per lane as the
//! scalar one does, and the reductions' lane structure is written out in the source
//! ([`super::elementwise::sum_by`]: eight f64 lanes), not left to the vectoriser. The tests
//! compare each kernel's output with [`plain`] (the baseline code path) bit for bit.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// Which code path [`wide!`] takes: 0 = not yet detected, then one of the tiers below.
static TIER: AtomicU8 = AtomicU8::new(0);
const PLAIN: u8 = 1;
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub const AVX2: u8 = 2;
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub const AVX512: u8 = 3;
/// Callers inside [`plain`]: while non-zero, the baseline path even where the CPU has more.
static FORCE_PLAIN: AtomicUsize = AtomicUsize::new(0);

/// `TESSERA_ISA=baseline` (or `avx2`) caps the tier: the before/after comparison of these
/// kernels in one binary, and a way round a CPU that misreports its features.
fn cap() -> u8 {
    match std::env::var("TESSERA_ISA").as_deref() {
        Ok("baseline") => PLAIN,
        #[cfg(target_arch = "x86_64")]
        Ok("avx2") => AVX2,
        _ => u8::MAX,
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> u8 {
    detect_cpu().min(cap())
}

#[cfg(target_arch = "x86_64")]
fn detect_cpu() -> u8 {
    use std::arch::is_x86_feature_detected as has;
    if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma") {
        AVX512
    } else if has!("avx2") && has!("fma") {
        AVX2
    } else {
        PLAIN
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> u8 {
    PLAIN.min(cap())
}

/// The detected (or forced) tier; read by [`wide!`]'s expansion.
#[inline(always)]
#[doc(hidden)]
pub fn tier() -> u8 {
    if FORCE_PLAIN.load(Ordering::Relaxed) > 0 {
        return PLAIN;
    }
    match TIER.load(Ordering::Relaxed) {
        0 => {
            let t = detect();
            TIER.store(t, Ordering::Relaxed);
            t
        }
        t => t,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
#[doc(hidden)]
/// Calls `f` in a function compiled for AVX-512 (F, VL, BW, DQ) and AVX2 + FMA.
///
/// # Safety
/// The CPU must have those features ([`tier`] returned `AVX512`).
pub unsafe fn run_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
#[doc(hidden)]
/// Calls `f` in a function compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have those features ([`tier`] returned `AVX2` or `AVX512`).
pub unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Makes [`wide!`] take the baseline path in this whole process while `f` runs: the reference
/// the tests compare the wide path with. Kernels running concurrently on other threads take
/// the baseline path meanwhile too (same results, by the module's argument), so a test that
/// compares the two paths should be the only one in its test binary.
pub fn plain<R>(f: impl FnOnce() -> R) -> R {
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            FORCE_PLAIN.fetch_sub(1, Ordering::SeqCst);
        }
    }
    FORCE_PLAIN.fetch_add(1, Ordering::SeqCst);
    let _release = Release;
    f()
}

/// The vector ISA [`wide!`] uses on this CPU (`"avx512"`, `"avx2"` or `"baseline"`).
pub fn isa() -> &'static str {
    match tier() {
        #[cfg(target_arch = "x86_64")]
        AVX512 => "avx512",
        #[cfg(target_arch = "x86_64")]
        AVX2 => "avx2",
        _ => "baseline",
    }
}

/// Runs `$body` (an expression, usually a loop nest) compiled for the widest vector ISA this
/// CPU has: the body is expanded into one closure per tier, each called only from its tier's
/// `#[target_feature]` function and marked `#[inline(always)]`, so LLVM inlines it there and
/// vectorises its loops for that ISA. (A closure handed to one generic wide function would be
/// a single function compiled for the baseline and merely called from the wide one. Without
/// the attribute, LLVM's inliner kept a large body — a norm's backward row — out of line, in
/// baseline SSE2 code, at a third of the speed.) Put it around the loops themselves
/// — a row's work, a run of elements, a chunk of AdamW — with only `#[inline(always)]` helpers
/// inside; the dispatch costs an atomic load and a branch.
macro_rules! wide {
    ($($body:tt)*) => {
        match $crate::kernels::simd::tier() {
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::simd::AVX512 => {
                // SAFETY: `tier` detected every feature `run_avx512` enables on this CPU.
                unsafe { $crate::kernels::simd::run_avx512(#[inline(always)] || { $($body)* }) }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::simd::AVX2 => {
                // SAFETY: `tier` detected every feature `run_avx2` enables on this CPU.
                unsafe { $crate::kernels::simd::run_avx2(#[inline(always)] || { $($body)* }) }
            }
            _ => $crate::kernels::simd::run_plain(|| { $($body)* }),
        }
    };
}
pub(super) use wide;

/// The baseline expansion of [`wide!`] (a closure too, so `return` means the same in every
/// tier).
#[inline(always)]
#[doc(hidden)]
pub fn run_plain<R>(f: impl FnOnce() -> R) -> R {
    f()
}
