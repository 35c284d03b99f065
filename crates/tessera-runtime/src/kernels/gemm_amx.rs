//! The bf16 GEMM on Intel AMX tiles (`tdpbf16ps`): the same contract as
//! [`super::gemm_bf16::gemm_bf16`] (`dst = scale · lhs · rhs`, bf16 operands read through their
//! strides, f32 accumulation, the result written as f32 or rounded once to bf16), chosen at run
//! time where the CPU has AMX-BF16 and the kernel grants the process the tile state.
//!
//! A tile register holds 16 rows of 64 bytes. The micro-kernel keeps a 32 × 32 f32 block of the
//! result in four tiles (`tmm0..3`) and per step of 32 along k loads two `lhs` tiles (16 rows ×
//! 32 bf16 each, `tmm4..5`) and two `rhs` tiles (16 pairs × 16 columns of
//! `(b[2p][j], b[2p+1][j])` words, `tmm6..7`), then issues four `tdpbf16ps` — 64 K multiply-adds
//! for 4 KiB of operands. Each load is issued as soon as the products before it have read the
//! tile it overwrites (tiles are not renamed), so its latency overlaps the products.
//!
//! Blocking (BLIS-like): the columns in passes of `nc`, k in blocks of [`KC_STEPS`] steps (2048
//! elements); per (pass, block) the `rhs` block is packed once and shared, and row blocks of
//! `lhs` are packed and multiplied in parallel. Where k has several blocks, each 32 × 32 block's
//! f32 sums are stored after one k block and loaded back before the next (exact: nothing is
//! rounded but the f32 sums themselves, in the same order as without the split), and only the
//! last block writes `dst`. Without the split, a long k (the LM head's gradient, k = 50,257)
//! made the `rhs` panel so narrow that every row block was packed once per 32 columns.
//!
//! Packing: `rhs` panels use [`super::gemm_bf16`]'s pair-interleaved layout ([`NR`] = 32 words
//! per pair), which is exactly two `rhs` tiles side by side at a row stride of 128 bytes; k is
//! padded with zero pairs to a multiple of 32. A row-major `lhs` is not packed where a tile
//! can be loaded straight from it (`tileloadd` takes a row stride): whole 32-row blocks over
//! whole steps of k. Other `lhs` rows are packed tile by tile: per 16 rows and step of 32
//! along k, one contiguous kibibyte (zero past m and past k). Transposed operands (a weight's
//! gradient reads its `lhs` column-major; a linear layer's `rhs` is a stored `[out, in]`
//! weight) are packed by AVX-512 16 × 16 word transposes ([`super::pack_avx512`]). Zero
//! padding adds only `0 · 0` products, so every valid output element is the sum the other
//! kernels compute (up to the order of the additions and AMX's flushing of subnormals).
//!
//! The packing buffers are per thread and kept between calls, aligned to cache lines: a
//! fresh buffer cost a memset per call, and one at a 16-byte offset split every 64-byte tile
//! row over two lines.
//!
//! Tile state: the process asks Linux for it once (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, in
//! [`available`]); each task loads the tile configuration on its thread and releases the tiles
//! when it ends, so threads that no longer use them carry no tile state.

use super::gemm_bf16::{pack_rhs_panel, store_rows, Bf16Dst, Bf16Ref, TaskGrid, NR};
use super::matmul::SendPtr;
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;
use std::thread::LocalKey;

/// Rows of the micro-tile: two tiles of 16.
const MR: usize = 32;
/// Rows of one tile.
const TILE_ROWS: usize = 16;
/// bf16 elements along k per tile step (64 bytes).
const KSTEP: usize = 32;
/// Budget of one packed `rhs` block (`nc` columns × one k block).
const B_PANEL_BYTES: usize = 1 << 20;
/// Budget of one packed `lhs` row block (`mc` rows × one k block), per task.
const A_BLOCK_BYTES: usize = 384 << 10;
/// Steps along k per block (64 × 32 elements): the packed blocks of both operands stay within
/// their budgets whatever k is, and a transformer layer's k (≤ 2048) is one block. 16 was
/// 10% slower on GPT-2's step (more passes and accumulator round trips, BENCHMARKS.md).
const KC_STEPS: usize = 64;
/// Budget of the f32 sums carried from one k block to the next (every row × one pass's
/// columns; at least one panel's).
const ACC_BYTES: usize = 4 << 20;

/// Whether this process may run AMX-BF16 tiles: the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7)
/// and Linux granted the tile data state. Asked once per process.
pub(super) fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            if std::arch::x86_64::__cpuid(0).eax < 7 {
                return false;
            }
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            let (amx_bf16, amx_tile) = (edx & (1 << 22) != 0, edx & (1 << 24) != 0);
            if !(amx_bf16 && amx_tile) {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it changes only which
            // extended states this process may use.
            let rc = unsafe {
                libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
            };
            rc == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// `dst = scale · lhs · rhs` on AMX tiles: see the module docs.
///
/// # Safety
/// As [`super::gemm_bf16::gemm_bf16`]'s contract, and [`available`] returned true.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: Bf16Dst,
    lhs: Bf16Ref,
    rhs: Bf16Ref,
    scale: f32,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let steps = k.div_ceil(KSTEP).max(1);
    let kc_steps = KC_STEPS.min(steps);
    let kblocks = steps.div_ceil(kc_steps);
    let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
    let bytes_per_col = kc_steps * KSTEP * 2;
    let row_pairs = m.div_ceil(MR);
    // Columns per pass: the packed rhs block within its budget and, where k is split, every
    // row's f32 sums over those columns within theirs (at least one panel: O(m) scratch).
    let mut nc = (B_PANEL_BYTES / bytes_per_col / NR * NR).max(NR);
    if kblocks > 1 {
        nc = nc.min((ACC_BYTES / (row_pairs * MR * 4) / NR * NR).max(NR));
    }
    let nc = nc.min(n.next_multiple_of(NR));
    let mc = (A_BLOCK_BYTES / bytes_per_col / MR * MR)
        .min(m.div_ceil(4 * threads).next_multiple_of(MR))
        .clamp(MR, m.next_multiple_of(MR));
    let panels_max = nc.div_ceil(NR);
    let mut acc =
        if kblocks > 1 { vec![0f32; row_pairs * panels_max * MR * NR] } else { Vec::new() };
    let accp = SendPtr(acc.as_mut_ptr());
    let bmax = nc.div_ceil(NR) * kc_steps * TILE_ROWS * NR;
    with_scratch(&B_SCRATCH, bmax, |bpack| {
        for jc in (0..n).step_by(nc) {
            let ncur = nc.min(n - jc);
            let npan = ncur.div_ceil(NR);
            for kb in 0..kblocks {
                let s0 = kb * kc_steps;
                let ns = kc_steps.min(steps - s0);
                let k0 = (s0 * KSTEP).min(k);
                let klen = (ns * KSTEP).min(k - k0);
                let (first, last) = (kb == 0, kb + 1 == kblocks);
                let panel_words = ns * TILE_ROWS * NR;
                // The packing writes every word of whole panels over whole steps; only padding
                // (a narrow last panel, k short of a whole step) needs zeros under it.
                let bpack = &mut bpack[..npan * panel_words];
                if !ncur.is_multiple_of(NR) || klen < ns * KSTEP {
                    bpack.fill(0);
                }
                let pack_b = |(jp, buf): (usize, &mut [u32])| {
                    let cols = NR.min(ncur - jp * NR);
                    // SAFETY: columns jc + jp·NR .. + cols and rows k0..k0 + klen are in bounds
                    // (contract); the pairs past klen stay zero.
                    unsafe { pack_rhs_panel(rhs.at(k0, jc + jp * NR), klen, cols, buf) };
                };
                if threads > 1 && npan > 1 {
                    bpack.par_chunks_mut(panel_words).enumerate().for_each(pack_b);
                } else {
                    bpack.chunks_mut(panel_words).enumerate().for_each(pack_b);
                }
                let grid = TaskGrid::new(m, mc, npan, threads);
                let block = KBlock {
                    m,
                    n,
                    dst,
                    lhs,
                    scale,
                    k0,
                    klen,
                    ns,
                    jc,
                    first,
                    last,
                    bpack: &bpack[..],
                    panel_words,
                    acc: (kblocks > 1).then_some((accp, panels_max)),
                };
                let task = |t: usize| {
                    if let Some((i0, rows, p0, p1)) = grid.task(t) {
                        // SAFETY: the caller's contract; the task's rows and panels are its own.
                        unsafe { block.task(i0, rows, p0..p1) };
                    }
                };
                grid.run(threads, task);
            }
        }
    });
    drop(acc);
}

/// One (pass, k block) of the product: what every task of it reads and where it writes.
struct KBlock<'a> {
    m: usize,
    n: usize,
    dst: Bf16Dst,
    lhs: Bf16Ref,
    scale: f32,
    /// The block's first column of `lhs`, its length and its steps of 32.
    k0: usize,
    klen: usize,
    ns: usize,
    /// The pass's first column of `dst`.
    jc: usize,
    first: bool,
    last: bool,
    /// The pass's packed `rhs` panels, `panel_words` each.
    bpack: &'a [u32],
    panel_words: usize,
    /// Where k has several blocks: the f32 sums carried between them (blocks of 32 × 32 by
    /// row pair and panel, `panels_max` panels per row pair).
    acc: Option<(SendPtr<f32>, usize)>,
}

impl KBlock<'_> {
    /// Rows `i0..i0 + rows` times panels `panels` of this block.
    ///
    /// # Safety
    /// [`gemm`]'s contract; no other task writes these rows and panels.
    unsafe fn task(&self, i0: usize, rows: usize, panels: std::ops::Range<usize>) {
        let (lhs, ns, tile_len) = (self.lhs, self.ns, TILE_ROWS * KSTEP);
        let whole_steps = self.klen == ns * KSTEP;
        let pairs_of_rows = rows.div_ceil(MR);
        // Row-major lhs over whole steps: whole 32-row blocks are loaded as tiles straight
        // from lhs (a row stride of its own); the rest is packed.
        let direct = if lhs.cs == 1 && lhs.rs > 0 && whole_steps { rows / MR } else { 0 };
        let packed_rows = rows - direct * MR;
        let alen = 2 * packed_rows.div_ceil(MR) * ns * tile_len;
        with_scratch(&A_SCRATCH, alen, |apack| {
            if !packed_rows.is_multiple_of(MR) || !whole_steps {
                apack.fill(0); // padding: zero past the rows and past k
            }
            // SAFETY: rows i0 + direct·MR .. i0 + rows and columns k0..k0 + klen of lhs are in
            // bounds (contract).
            unsafe {
                pack_lhs(lhs.at(i0 + direct * MR, self.k0), packed_rows, self.klen, ns, apack)
            };
            let _tiles = TileConfig::load();
            let mut scratch = [0f32; MR * NR];
            for jp in panels {
                let bpanel = &self.bpack[jp * self.panel_words..(jp + 1) * self.panel_words];
                let j = self.jc + jp * NR;
                let cols = NR.min(self.n - j);
                for ip in 0..pairs_of_rows {
                    let i = i0 + ip * MR;
                    let a = if ip < direct {
                        let (r0, r1) = (lhs.at(i, self.k0).ptr, lhs.at(i + TILE_ROWS, self.k0).ptr);
                        ATiles { r0, r1, stride: 2 * lhs.rs as usize, advance: 2 * KSTEP }
                    } else {
                        let r0 = apack[2 * (ip - direct) * ns * tile_len..].as_ptr();
                        let r1 = r0.wrapping_add(ns * tile_len);
                        ATiles { r0, r1, stride: 2 * KSTEP, advance: 2 * tile_len }
                    };
                    let tile: &mut [f32] = match &self.acc {
                        Some((accp, panels_max)) => {
                            let at = ((i / MR) * panels_max + jp) * MR * NR;
                            // SAFETY: block (row pair i/MR, panel jp) of the accumulators is
                            // inside them and belongs to this task alone (its rows).
                            unsafe { std::slice::from_raw_parts_mut(accp.get().add(at), MR * NR) }
                        }
                        None => &mut scratch,
                    };
                    // SAFETY: the tile configuration is loaded on this thread; `a` addresses
                    // `ns` steps of both row tiles (rows i..i + 32 of lhs over whole steps, or
                    // packed tiles); the panel holds 16 pairs per step; the tile is 32 × 32;
                    // rows i.. and columns j.. of dst are this task's own.
                    unsafe {
                        micro(a, bpanel.as_ptr(), ns, tile, !self.first);
                        if self.last {
                            let r = MR.min(self.m - i);
                            store_rows(tile, self.dst, i, j, r, cols, self.scale);
                        }
                    }
                }
            }
        })
    }
}

/// One cache line: the packing buffers' unit, so every tile row (64 bytes) is one line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

thread_local! {
    /// Packed `lhs` tiles of the tasks this thread runs.
    static A_SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// Packed `rhs` panels of the products this thread calls.
    static B_SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Element types a packing buffer holds: plain integers, any bits valid.
trait Word: Copy {}
impl Word for u16 {}
impl Word for u32 {}

/// Runs `f` on `len` elements of this thread's packing buffer `key`, line-aligned and kept
/// from call to call (a fresh one each time cost a memset and, past the allocator's cache,
/// page faults): its contents are stale, so `f` writes before it reads and zeroes what packing
/// leaves out. A nested call on the same thread (a task stolen while the caller waits) gets a
/// buffer of its own.
fn with_scratch<T: Word, R>(
    key: &'static LocalKey<RefCell<Vec<Line>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let lines = (len * std::mem::size_of::<T>()).div_ceil(64);
    let run = |v: &mut Vec<Line>| {
        if v.len() < lines {
            v.resize(lines, Line([0; 64]));
        }
        // SAFETY: the first `lines` lines are initialised bytes, at least `len` elements of
        // `T` (any bits are a valid `T`, alignment 64 covers T's), borrowed mutably here only.
        f(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<T>(), len) })
    };
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => run(&mut v),
        Err(_) => run(&mut Vec::new()),
    })
}

/// Packs rows `0..rows` of `a` (`rows × k`) tile by tile: for each 16 rows and each step of 32
/// along k, 16 × 32 contiguous elements (zero past `rows` and past k).
///
/// # Safety
/// Every addressed element of `a` is in bounds.
unsafe fn pack_lhs(a: Bf16Ref, rows: usize, k: usize, steps: usize, out: &mut [u16]) {
    let tile_len = TILE_ROWS * KSTEP;
    if a.rs == 1 && a.cs != 1 {
        // Column-major lhs (a transposed operand, as in a weight's gradient): each column's
        // 16 rows of a tile are contiguous. Whole tiles go by AVX-512 transposes, a step along
        // k at a time across every whole tile, so each column's rows are read once, in whole
        // cache lines; the rest walks along the columns (a row at a time would touch a cache
        // line per element).
        let (whole_tiles, whole_steps) =
            if super::pack_avx512::available() { (rows / TILE_ROWS, k / KSTEP) } else { (0, 0) };
        for s in 0..whole_steps {
            for t in 0..whole_tiles {
                let at = (t * steps + s) * tile_len;
                // SAFETY: rows t·16 .. + 16 <= rows of columns s·32 .. + 32 <= k (contract);
                // the tile's 512 elements are inside out.
                unsafe {
                    super::pack_avx512::lhs_tile_from_cols(
                        a.at(t * TILE_ROWS, s * KSTEP).ptr,
                        a.cs,
                        out[at..at + tile_len].as_mut_ptr(),
                    )
                };
            }
        }
        for t in 0..rows.div_ceil(TILE_ROWS) {
            let r0 = t * TILE_ROWS;
            let nr = TILE_ROWS.min(rows - r0);
            let p0 = if t < whole_tiles { whole_steps * KSTEP } else { 0 };
            for p in p0..k {
                let base = (t * steps + p / KSTEP) * tile_len + p % KSTEP;
                // SAFETY: rows r0..r0 + nr < rows of column p < k, contiguous (rs = 1).
                let col = unsafe { std::slice::from_raw_parts(a.at(r0, p).ptr, nr) };
                for (rr, &v) in col.iter().enumerate() {
                    out[base + rr * KSTEP] = v;
                }
            }
        }
        return;
    }
    for r in 0..rows {
        let (t, rr) = (r / TILE_ROWS, r % TILE_ROWS);
        let line = a.at(r, 0);
        for s in 0..steps {
            let k0 = s * KSTEP;
            let len = KSTEP.min(k.saturating_sub(k0));
            let at = (t * steps + s) * tile_len + rr * KSTEP;
            let dst = &mut out[at..at + len];
            if line.cs == 1 {
                // SAFETY: columns k0..k0 + len < k of row r (contract).
                let src = unsafe { std::slice::from_raw_parts(line.ptr.add(k0), len) };
                dst.copy_from_slice(src);
            } else {
                for (c, d) in dst.iter_mut().enumerate() {
                    // SAFETY: column k0 + c < k of row r (contract).
                    *d = unsafe { *line.ptr.offset((k0 + c) as isize * line.cs) };
                }
            }
        }
    }
}

/// The tile configuration of this thread while alive: 8 tiles of 16 rows × 64 bytes; released
/// on drop (the tiles return to their initial state, and the thread's context switches stop
/// saving them).
struct TileConfig;

impl TileConfig {
    fn load() -> TileConfig {
        #[repr(C, align(64))]
        struct Palette([u8; 64]);
        let mut p = [0u8; 64];
        p[0] = 1; // palette 1
        for t in 0..8 {
            p[16 + 2 * t] = 64; // bytes per row (u16 little endian)
            p[48 + t] = TILE_ROWS as u8; // rows
        }
        let palette = Palette(p);
        // SAFETY: AMX is available (the caller's contract); the palette is a valid
        // configuration of palette 1 (8 tiles within its 16 × 64-byte limits).
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) palette.0.as_ptr(), options(nostack, readonly))
        };
        TileConfig
    }
}

impl Drop for TileConfig {
    fn drop(&mut self) {
        // SAFETY: AMX is available; releasing tiles has no other effect.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Where a 32-row block's `lhs` tiles are: the first step's tiles of its two 16-row halves
/// start at `r0` and `r1`, a tile's rows are `stride` bytes apart and the next step's tiles
/// `advance` bytes further. Packed: 64 and 1 KiB; straight from a row-major `lhs`: its row
/// stride and 64.
struct ATiles {
    r0: *const u16,
    r1: *const u16,
    stride: usize,
    advance: usize,
}

/// One 32 × 32 block over `steps` steps of 32 along k into `tile` (row-major f32, 32 columns),
/// added to what `tile` holds when `accumulate`, else replacing it.
///
/// # Safety
/// The tile configuration of [`TileConfig::load`] is loaded on this thread; `a` addresses
/// `steps` readable tiles (16 rows of 64 bytes) of each half; `b` holds `16 · steps` pairs of
/// [`NR`] words; `tile` holds `32 · 32` elements.
#[inline]
unsafe fn micro(a: ATiles, b: *const u32, steps: usize, tile: &mut [f32], accumulate: bool) {
    debug_assert!(tile.len() >= MR * NR && steps > 0);
    let c = tile.as_mut_ptr();
    // SAFETY: the contract: every tile load reads 16 rows of 64 bytes inside the operands
    // (lhs: as `a` says; rhs: 16 pairs of 128 bytes per step, two tiles side by side); the
    // accumulator's loads and stores touch 32 rows of 128 bytes, the whole block.
    unsafe {
        if accumulate {
            std::arch::asm!(
                "tileloadd tmm0, [{c} + {s128}*1]",
                "tileloadd tmm1, [{c} + {s128}*1 + 64]",
                "tileloadd tmm2, [{c} + {s128}*1 + 2048]",
                "tileloadd tmm3, [{c} + {s128}*1 + 2112]",
                c = in(reg) c,
                s128 = in(reg) 128usize,
                options(nostack, readonly),
            );
        } else {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
        // Software-pipelined: each step's loads are issued as soon as the products before
        // them have read the tile they overwrite (tiles are not renamed), so a load's latency
        // overlaps the products still running.
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {s128}*1]",
            "tileloadd tmm7, [{b0} + {s128}*1 + 64]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "dec {n}",
            "jz 3f",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "add {a0}, {adv}",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "add {b0}, 2048",
            "tileloadd tmm6, [{b0} + {s128}*1]",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tileloadd tmm7, [{b0} + {s128}*1 + 64]",
            "add {a1}, {adv}",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "dec {n}",
            "jnz 2b",
            "3:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tilestored [{c} + {s128}*1], tmm0",
            "tilestored [{c} + {s128}*1 + 64], tmm1",
            "tilestored [{c} + {s128}*1 + 2048], tmm2",
            "tilestored [{c} + {s128}*1 + 2112], tmm3",
            a0 = inout(reg) a.r0 => _,
            a1 = inout(reg) a.r1 => _,
            b0 = inout(reg) b => _,
            n = inout(reg) steps => _,
            c = in(reg) c,
            sa = in(reg) a.stride,
            adv = in(reg) a.advance,
            s128 = in(reg) 128usize,
            options(nostack),
        );
    }
}
