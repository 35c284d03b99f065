//! bf16 GEMM with f32 accumulation: `dst[m×n] = scale · lhs[m×k] · rhs[k×n]`, bf16 operands
//! read in place through their strides, the result written as f32 or as bf16 (rounded to
//! nearest even, exactly as `half::bf16::from_f32`).
//!
//! Structure (BLIS-like, without a k split): the columns are cut into panels of `nc` (sized so
//! a packed panel of `rhs` over the whole of k stays within [`B_PANEL_BYTES`]); each panel of
//! `rhs` is packed once, then row blocks of `lhs` (`mc` rows, within [`A_BLOCK_BYTES`]) are
//! packed and multiplied in parallel (rayon). Packing interleaves k in *pairs*: a packed `lhs`
//! micro-panel holds, per pair `p`, the [`MR`] 32-bit words `(a[i][2p], a[i][2p+1])`; a packed
//! `rhs` micro-panel the [`NR`] words `(b[2p][j], b[2p+1][j])` — the operand layout of
//! `vdpbf16ps`, which multiplies the two halves of a word pairwise and adds both products to
//! an f32 lane. Odd k pads the last pair with zero, and tails of m and n pad the micro-panels
//! with zero rows/columns that the epilogue does not write.
//!
//! The micro-kernel keeps an `MR × NR` = 12 × 32 tile in 24 zmm accumulators over the whole of
//! k (f32 accumulation, no intermediate rounding), then the epilogue scales the tile and
//! writes its valid part (f32, or bf16 by round-to-nearest-even on the bits). Two
//! micro-kernels share all of the above: [`Bf16Kernel::Avx512Bf16`] (`vdpbf16ps`, chosen at run
//! time when the CPU has AVX512_BF16) and [`Bf16Kernel::Portable`] (plain f32 arithmetic on
//! the same packed words, for tests and CPUs without it). Products of two bf16 values are
//! exact in f32, so both compute the same sums and differ only in rounding order.
//!
//! Without a k split the tile's sum never leaves the registers, at the price of streaming a
//! micro-panel of length k from L2 per tile: 176 bytes per 24 `vdpbf16ps` at 12 × 32, well
//! within L2 bandwidth for the k of transformer layers. Memory: the packed panels are bounded
//! by the two constants (per thread for `lhs`), whatever the operands' sizes.

use half::bf16;
use rayon::prelude::*;

/// Rows of the micro-tile.
pub(super) const MR: usize = 12;
/// Columns of the micro-tile (two zmm of 16 f32 lanes).
pub(super) const NR: usize = 32;
/// Budget of one packed `rhs` panel (`nc` columns × all of k).
const B_PANEL_BYTES: usize = 1 << 20;
/// Budget of one packed `lhs` row block (`mc` rows × all of k), per task.
const A_BLOCK_BYTES: usize = 384 << 10;

/// Which micro-kernel runs the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// `vdpbf16ps` on zmm registers (AVX512F + AVX512_BF16).
    Avx512Bf16,
    /// Intel AMX tiles (`tdpbf16ps`, AMX-BF16): [`super::gemm_amx`].
    Amx,
    /// Plain f32 arithmetic on the same packed panels: every CPU, slower.
    Portable,
}

impl Bf16Kernel {
    /// The fastest kernel this CPU runs natively, if any: AMX tiles where the CPU has them
    /// (and Linux grants them), else `vdpbf16ps`. The portable one exists for tests.
    pub fn native() -> Option<Bf16Kernel> {
        if Bf16Kernel::Amx.available() {
            return Some(Bf16Kernel::Amx);
        }
        if Bf16Kernel::Avx512Bf16.available() {
            return Some(Bf16Kernel::Avx512Bf16);
        }
        None
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Avx512Bf16 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Bf16Kernel::Avx512Bf16 => false,
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Amx => super::gemm_amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Bf16Kernel::Amx => false,
            Bf16Kernel::Portable => true,
        }
    }

    /// Whether the kernel runs bf16 products faster than the f32 GEMM runs their upcasts, so
    /// that the CPU backend uses it by default: AMX does (several times over); `vdpbf16ps`
    /// does not beat `gemm`'s AVX-512 f32 kernels (BENCHMARKS.md) and stays opt-in.
    pub fn beats_upcasting(self) -> bool {
        self == Bf16Kernel::Amx
    }
}

/// A read-only strided bf16 matrix (bits): element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct Bf16Ref {
    pub ptr: *const u16,
    pub rs: isize,
    pub cs: isize,
}

impl Bf16Ref {
    /// The submatrix starting at element (i, j) (a method, so closures capture the whole
    /// `Sync` wrapper rather than its raw pointer).
    pub(super) fn at(self, i: usize, j: usize) -> Bf16Ref {
        Bf16Ref {
            ptr: self.ptr.wrapping_offset(i as isize * self.rs + j as isize * self.cs),
            ..self
        }
    }
}

/// Where the product goes: f32 or bf16 (bits) elements, strided.
#[derive(Clone, Copy)]
pub(super) enum Bf16Dst {
    F32 { ptr: *mut f32, rs: isize, cs: isize },
    Bf16 { ptr: *mut u16, rs: isize, cs: isize },
}

// SAFETY: the raw pointers are only dereferenced under `gemm_bf16`'s contract (disjoint
// writes per task, reads of live operands).
unsafe impl Send for Bf16Ref {}
// SAFETY: as above.
unsafe impl Sync for Bf16Ref {}
// SAFETY: as above.
unsafe impl Send for Bf16Dst {}
// SAFETY: as above.
unsafe impl Sync for Bf16Dst {}

/// `x` rounded to bf16 (nearest, ties to even; NaN stays a quiet NaN), as `half` does it but
/// branch-free on the bits so loops over it vectorise.
#[inline(always)]
pub(super) fn round_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// `dst = scale · lhs · rhs` for an `m×k` `lhs` and a `k×n` `rhs`; `parallel` lets it use
/// every rayon thread (off inside a caller's own parallel loop).
///
/// # Safety
/// Every element the strides address (m×k of `lhs`, k×n of `rhs`, m×n of `dst`) must be in
/// bounds of a live allocation, `dst` must not overlap the operands, no other thread may
/// access `dst`'s elements during the call, and `kernel.available()` must hold.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_bf16(
    m: usize,
    n: usize,
    k: usize,
    dst: Bf16Dst,
    lhs: Bf16Ref,
    rhs: Bf16Ref,
    scale: f32,
    kernel: Bf16Kernel,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Bf16Kernel::Amx {
        // SAFETY: the same contract; available() checked the tiles.
        unsafe { super::gemm_amx::gemm(m, n, k, dst, lhs, rhs, scale, parallel) };
        return;
    }
    let kp = k.div_ceil(2).max(1);
    let words_per_col = kp * 4;
    let nc = (B_PANEL_BYTES / words_per_col / NR * NR).clamp(NR, n.next_multiple_of(NR));
    let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
    // Row blocks within the budget, and at least four per thread where m allows (so uneven
    // blocks balance); every output element's sum is the same whatever the blocking.
    let mc = (A_BLOCK_BYTES / words_per_col / MR * MR)
        .min(m.div_ceil(4 * threads).next_multiple_of(MR))
        .clamp(MR, m.next_multiple_of(MR));
    let mut bpack: Vec<u32> = Vec::new();
    for jc in (0..n).step_by(nc) {
        let ncur = nc.min(n - jc);
        let npan = ncur.div_ceil(NR);
        bpack.clear();
        bpack.resize(npan * kp * NR, 0);
        let pack_b = |(jp, buf): (usize, &mut [u32])| {
            let cols = NR.min(ncur - jp * NR);
            // SAFETY: columns jc + jp·NR .. + cols and rows 0..k are in bounds (contract).
            unsafe { pack_rhs_panel(rhs.at(0, jc + jp * NR), k, cols, buf) };
        };
        if threads > 1 && npan > 1 {
            bpack.par_chunks_mut(kp * NR).enumerate().for_each(pack_b);
        } else {
            bpack.chunks_mut(kp * NR).enumerate().for_each(pack_b);
        }
        let grid = TaskGrid::new(m, mc, npan, threads);
        let bp = &bpack[..];
        let task = |t: usize| {
            let Some((i0, rows, p0, p1)) = grid.task(t) else {
                return;
            };
            let mut apack = vec![0u32; rows.div_ceil(MR) * kp * MR];
            // SAFETY: rows i0..i0+rows and 0..k of lhs are in bounds (contract).
            unsafe { pack_lhs(lhs.at(i0, 0), rows, k, &mut apack) };
            let mut tile = [0f32; MR * NR];
            for jp in p0..p1 {
                let bpanel = &bp[jp * kp * NR..(jp + 1) * kp * NR];
                let j = jc + jp * NR;
                let cols = NR.min(n - j);
                for (ip, apanel) in apack.chunks(kp * MR).enumerate() {
                    let i = i0 + ip * MR;
                    let nrows = MR.min(m - i);
                    // SAFETY: the panels hold kp pairs each; the kernel is available
                    // (contract); the tile's rows i.. and columns j.. are this task's own.
                    unsafe {
                        micro(kernel, kp, apanel, bpanel, &mut tile);
                        store_rows(&tile, dst, i, j, nrows, cols, scale);
                    }
                }
            }
        };
        grid.run(threads, task);
    }
}

/// How one pass's tasks cut the output: row blocks of `mc` rows, each cut into groups of
/// column panels when there are too few row blocks to keep every thread busy (short m:
/// decoding, attention blocks).
pub(super) struct TaskGrid {
    m: usize,
    mc: usize,
    npan: usize,
    groups: usize,
    per_group: usize,
    count: usize,
}

impl TaskGrid {
    pub(super) fn new(m: usize, mc: usize, npan: usize, threads: usize) -> TaskGrid {
        let row_blocks = m.div_ceil(mc);
        let groups = if row_blocks >= 2 * threads {
            1
        } else {
            npan.min((2 * threads).div_ceil(row_blocks))
        };
        TaskGrid {
            m,
            mc,
            npan,
            groups,
            per_group: npan.div_ceil(groups),
            count: row_blocks * groups,
        }
    }

    /// Task `t`'s first row, its number of rows and its panels `p0..p1`; `None` when it has no
    /// panel.
    pub(super) fn task(&self, t: usize) -> Option<(usize, usize, usize, usize)> {
        let (rb, g) = (t / self.groups, t % self.groups);
        let (i0, p0) = (rb * self.mc, g * self.per_group);
        let p1 = (p0 + self.per_group).min(self.npan);
        (p0 < p1).then(|| (i0, self.mc.min(self.m - i0), p0, p1))
    }

    /// Runs every task, in parallel where there are threads and tasks to share.
    pub(super) fn run(&self, threads: usize, task: impl Fn(usize) + Sync + Send) {
        if threads > 1 && self.count > 1 {
            (0..self.count).into_par_iter().for_each(task);
        } else {
            (0..self.count).for_each(task);
        }
    }
}

/// Packs rows `0..rows` of `a` (`rows × k`) into micro-panels of [`MR`] rows: per pair `p`,
/// the words `(a[i][2p], a[i][2p+1])` of the panel's rows (zero past `rows` and past k).
///
/// # Safety
/// Every addressed element of `a` is in bounds.
unsafe fn pack_lhs(a: Bf16Ref, rows: usize, k: usize, out: &mut [u32]) {
    let kp = k.div_ceil(2);
    for (ip, panel) in out.chunks_mut(kp * MR).enumerate() {
        for r in 0..MR.min(rows - ip * MR) {
            // SAFETY: row ip·MR + r < rows, columns < k (contract).
            unsafe { pack_line(a.at(ip * MR + r, 0).ptr, a.cs, k, panel, r, MR) };
        }
    }
}

/// Packs columns `0..cols` of `b` (`k × cols`) into one micro-panel of [`NR`] columns: per pair
/// `p < ⌈k/2⌉`, the words `(b[2p][j], b[2p+1][j])` (zero past `cols` and past k; words of
/// pairs past k, where `out` is longer, are left as they are).
///
/// # Safety
/// Every addressed element of `b` is in bounds; `out` holds at least `⌈k/2⌉·NR` words.
pub(super) unsafe fn pack_rhs_panel(b: Bf16Ref, k: usize, cols: usize, out: &mut [u32]) {
    let out = &mut out[..k.div_ceil(2) * NR];
    if b.cs == 1 && cols == NR {
        // Row-major rhs: interleave two contiguous rows per pair.
        #[cfg(target_arch = "x86_64")]
        if super::pack_avx512::available() {
            for (p, words) in out.chunks_exact_mut(NR).enumerate().take(k / 2) {
                let r0 = b.ptr.wrapping_offset((2 * p) as isize * b.rs);
                let r1 = b.ptr.wrapping_offset((2 * p + 1) as isize * b.rs);
                // SAFETY: rows 2p, 2p + 1 < k hold NR = cols elements each (contract); words
                // holds NR words.
                unsafe { super::pack_avx512::rhs_pairs_interleave(r0, r1, words.as_mut_ptr()) };
            }
            if k % 2 == 1 {
                let last = b.ptr.wrapping_offset((k - 1) as isize * b.rs);
                for (j, w) in out[(k / 2) * NR..].iter_mut().enumerate() {
                    // SAFETY: row k − 1, columns < NR = cols (contract).
                    *w = u32::from(unsafe { *last.add(j) });
                }
            }
            return;
        }
        for (p, words) in out.chunks_exact_mut(NR).enumerate() {
            let r0 = b.ptr.wrapping_offset((2 * p) as isize * b.rs);
            let r1 = b.ptr.wrapping_offset((2 * p + 1) as isize * b.rs);
            for (j, w) in words.iter_mut().enumerate() {
                // SAFETY: rows 2p (and 2p + 1 when < k), columns < NR = cols (contract).
                let lo = u32::from(unsafe { *r0.add(j) });
                let hi = if 2 * p + 1 < k { u32::from(unsafe { *r1.add(j) }) } else { 0 };
                *w = lo | hi << 16;
            }
        }
        return;
    }
    let mut c0 = 0;
    #[cfg(target_arch = "x86_64")]
    if b.rs == 1 && super::pack_avx512::available() {
        // Transposed rhs: each column's pairs are contiguous words; 16 columns × 16 pairs at
        // a time are one transpose.
        let full_pairs = k / 32 * 16;
        while c0 + 16 <= cols {
            for p0 in (0..full_pairs).step_by(16) {
                // SAFETY: columns c0..c0 + 16 < cols and rows 2·p0 .. 2·p0 + 32 <= k are in
                // bounds (contract); out holds ⌈k/2⌉·NR words, past p0 + 15 rows of NR.
                unsafe {
                    super::pack_avx512::rhs_pairs_from_rows(
                        b.at(2 * p0, c0).ptr,
                        b.cs,
                        out.as_mut_ptr().add(p0 * NR + c0),
                        NR,
                    )
                };
            }
            if full_pairs * 2 < k {
                let rest = b.at(2 * full_pairs, 0);
                let tail = &mut out[full_pairs * NR..];
                for c in c0..c0 + 16 {
                    // SAFETY: column c < cols, rows 2·full_pairs .. k (contract).
                    unsafe { pack_line(rest.at(0, c).ptr, b.rs, k - 2 * full_pairs, tail, c, NR) };
                }
            }
            c0 += 16;
        }
    }
    for c in c0..cols {
        // SAFETY: column c < cols, rows < k (contract).
        unsafe { pack_line(b.at(0, c).ptr, b.rs, k, out, c, NR) };
    }
}

/// Writes the k elements at `line + t·step` as pairs into `out[p·width + slot]`.
///
/// # Safety
/// The k addressed elements are in bounds.
#[inline(always)]
unsafe fn pack_line(
    line: *const u16,
    step: isize,
    k: usize,
    out: &mut [u32],
    slot: usize,
    width: usize,
) {
    let kp = k.div_ceil(2);
    if step == 1 {
        for p in 0..k / 2 {
            // SAFETY: elements 2p, 2p + 1 < k; unaligned read of two u16 (little endian).
            let w = unsafe { line.add(2 * p).cast::<u32>().read_unaligned() };
            out[p * width + slot] = u32::from_le(w);
        }
    } else {
        for p in 0..k / 2 {
            // SAFETY: elements 2p, 2p + 1 < k.
            let (lo, hi) = unsafe {
                (*line.offset(2 * p as isize * step), *line.offset((2 * p + 1) as isize * step))
            };
            out[p * width + slot] = lo as u32 | (hi as u32) << 16;
        }
    }
    if k % 2 == 1 {
        // SAFETY: element k − 1 is in bounds.
        out[(kp - 1) * width + slot] = unsafe { *line.offset((k - 1) as isize * step) } as u32;
    }
}

/// One `MR × NR` tile over `kp` pairs into `tile` (row-major, f32).
///
/// # Safety
/// `kernel.available()`; `a` holds `kp·MR` words and `b` `kp·NR`.
#[inline]
unsafe fn micro(kernel: Bf16Kernel, kp: usize, a: &[u32], b: &[u32], tile: &mut [f32; MR * NR]) {
    debug_assert!(a.len() >= kp * MR && b.len() >= kp * NR);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: available() checked AVX512F and AVX512_BF16; sizes as asserted.
        Bf16Kernel::Avx512Bf16 => unsafe { avx512::micro(kp, a.as_ptr(), b.as_ptr(), tile) },
        #[cfg(not(target_arch = "x86_64"))]
        Bf16Kernel::Avx512Bf16 => unreachable!("AVX512_BF16 is never available off x86-64"),
        Bf16Kernel::Portable => micro_portable(kp, a, b, tile),
        // gemm_bf16 hands AMX products to gemm_amx before any micro-tile of this layout.
        Bf16Kernel::Amx => unreachable!("AMX products run in gemm_amx"),
    }
}

/// The f32 value of a bf16 bit pattern.
#[inline(always)]
fn f(bits: u32) -> f32 {
    f32::from_bits(bits << 16)
}

/// The portable micro-kernel: per lane, the high products then the low (`vdpbf16ps`' order).
fn micro_portable(kp: usize, a: &[u32], b: &[u32], tile: &mut [f32; MR * NR]) {
    tile.fill(0.0);
    for (aw, bw) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(kp) {
        for (i, &x) in aw.iter().enumerate() {
            let (xl, xh) = (f(x & 0xFFFF), f(x >> 16));
            let row = &mut tile[i * NR..(i + 1) * NR];
            for (c, &y) in row.iter_mut().zip(bw) {
                *c += xh * f(y >> 16);
                *c += xl * f(y & 0xFFFF);
            }
        }
    }
}

/// Writes rows `0..rows` and columns `0..cols` of `tile` (rows of [`NR`] columns: this file's
/// 12 × 32 tiles, the AMX kernel's 32 × 32 blocks), times `scale`, at `(i, j)` of `dst`; on
/// AVX-512 where the CPU has it (the same arithmetic, vectorised).
///
/// # Safety
/// The addressed elements of `dst` are in bounds and this caller's alone; `tile` holds at
/// least `rows` rows.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) unsafe fn store_rows(
    tile: &[f32],
    dst: Bf16Dst,
    i: usize,
    j: usize,
    rows: usize,
    cols: usize,
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: as the caller's; the features were just checked.
        return unsafe { avx512::store(tile, dst, i, j, rows, cols, scale) };
    }
    // SAFETY: as the caller's.
    unsafe { store_body(tile, dst, i, j, rows, cols, scale) }
}

#[inline(always)]
unsafe fn store_body(
    tile: &[f32],
    dst: Bf16Dst,
    i: usize,
    j: usize,
    rows: usize,
    cols: usize,
    scale: f32,
) {
    for (r, row) in tile.chunks_exact(NR).take(rows).enumerate() {
        let row = &row[..cols];
        match dst {
            Bf16Dst::F32 { ptr, rs, cs } => {
                let at = ptr.wrapping_offset((i + r) as isize * rs + j as isize * cs);
                if cs == 1 {
                    // SAFETY: cols contiguous elements of row i + r (contract).
                    let out = unsafe { std::slice::from_raw_parts_mut(at, cols) };
                    for (o, &v) in out.iter_mut().zip(row) {
                        *o = v * scale;
                    }
                } else {
                    for (c, &v) in row.iter().enumerate() {
                        // SAFETY: element (i + r, j + c) (contract).
                        unsafe { *at.offset(c as isize * cs) = v * scale };
                    }
                }
            }
            Bf16Dst::Bf16 { ptr, rs, cs } => {
                let at = ptr.wrapping_offset((i + r) as isize * rs + j as isize * cs);
                if cs == 1 {
                    // SAFETY: cols contiguous elements of row i + r (contract).
                    let out = unsafe { std::slice::from_raw_parts_mut(at, cols) };
                    for (o, &v) in out.iter_mut().zip(row) {
                        *o = round_bf16(v * scale);
                    }
                } else {
                    for (c, &v) in row.iter().enumerate() {
                        // SAFETY: element (i + r, j + c) (contract).
                        unsafe { *at.offset(c as isize * cs) = round_bf16(v * scale) };
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{store_body, Bf16Dst, MR, NR};
    use std::arch::x86_64::*;

    /// The `vdpbf16ps` micro-kernel: 24 zmm accumulators (12 rows × 2 × 16 columns), one
    /// broadcast `lhs` word and two `rhs` vectors per pair.
    ///
    /// # Safety
    /// AVX512F and AVX512_BF16 are available; `a` holds `kp·MR` words and `b` `kp·NR`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn micro(kp: usize, a: *const u32, b: *const u32, tile: &mut [f32; MR * NR]) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kp {
            // SAFETY: pair p's words lie within the panels (contract).
            unsafe {
                let bp = b.add(p * NR);
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.cast()));
                let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16).cast()));
                let ap = a.add(p * MR);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // SAFETY: row r of the tile holds NR = 32 f32.
            unsafe {
                _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR), acc[0]);
                _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR + 16), acc[1]);
            }
        }
    }

    /// [`store_body`] compiled for AVX-512 (its conversion loops vectorise).
    ///
    /// # Safety
    /// As `store_body`'s; AVX512F is available.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn store(
        tile: &[f32],
        dst: Bf16Dst,
        i: usize,
        j: usize,
        rows: usize,
        cols: usize,
        scale: f32,
    ) {
        // SAFETY: forwarded.
        unsafe { store_body(tile, dst, i, j, rows, cols, scale) }
    }
}

/// Test hook: `scale · lhs · rhs` on dense bf16 matrices given by shape and strides, with the
/// chosen kernel, into a fresh f32 and bf16 result (row-major `m×n`). `None` when the kernel is
/// not available on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_dense(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&[bf16], isize, isize),
    rhs: (&[bf16], isize, isize),
    scale: f32,
    kernel: Bf16Kernel,
) -> Option<(Vec<f32>, Vec<bf16>)> {
    if !kernel.available() {
        return None;
    }
    let span = |rows: usize, cols: usize, rs: isize, cs: isize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            ((rows - 1) as isize * rs + (cols - 1) as isize * cs) as usize + 1
        }
    };
    assert!(span(m, k, lhs.1, lhs.2) <= lhs.0.len() && span(k, n, rhs.1, rhs.2) <= rhs.0.len());
    assert!(lhs.1 >= 0 && lhs.2 >= 0 && rhs.1 >= 0 && rhs.2 >= 0, "non-negative strides");
    let a = Bf16Ref { ptr: lhs.0.as_ptr().cast(), rs: lhs.1, cs: lhs.2 };
    let b = Bf16Ref { ptr: rhs.0.as_ptr().cast(), rs: rhs.1, cs: rhs.2 };
    let mut y32 = vec![0f32; m * n];
    let mut y16 = vec![bf16::ZERO; m * n];
    let d32 = Bf16Dst::F32 { ptr: y32.as_mut_ptr(), rs: n as isize, cs: 1 };
    let d16 = Bf16Dst::Bf16 { ptr: y16.as_mut_ptr().cast(), rs: n as isize, cs: 1 };
    // SAFETY: the asserts bound every addressed element; the outputs are fresh.
    unsafe {
        gemm_bf16(m, n, k, d32, a, b, scale, kernel, true);
        gemm_bf16(m, n, k, d16, a, b, scale, kernel, true);
    }
    Some((y32, y16))
}

#[cfg(test)]
mod tests {
    use super::round_bf16;
    use half::bf16;

    #[test]
    fn rounding_matches_half() {
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY];
        let mut x = 0x0001_2345u32;
        for v in specials.into_iter().chain((0..100_000).map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            f32::from_bits(x)
        })) {
            let want = bf16::from_f32(v).to_bits();
            let got = round_bf16(v);
            if v.is_nan() {
                assert!(bf16::from_bits(got).is_nan(), "{v:?}");
            } else {
                assert_eq!(got, want, "{v:e} ({:#x})", v.to_bits());
            }
        }
    }
}
