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
//! padded with zero pairs to a multiple of 32. `lhs` row blocks are packed tile by tile: per
//! 16 rows and step of 32 along k, one contiguous kibibyte (zero past m and past k). Zero
//! padding adds only `0 · 0` products, so every valid output element is the sum the other
//! kernels compute (up to the order of the additions and AMX's flushing of subnormals).
//!
//! Tile state: the process asks Linux for it once (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, in
//! [`available`]); each task loads the tile configuration on its thread and releases the tiles
//! when it ends, so threads that no longer use them carry no tile state.

use super::gemm_bf16::{pack_rhs_panel, store_rows, Bf16Dst, Bf16Ref, TaskGrid, NR};
use super::matmul::SendPtr;
use rayon::prelude::*;
use std::sync::OnceLock;

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
    let tile_len = TILE_ROWS * KSTEP;
    let mut bpack: Vec<u32> = Vec::new();
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
            bpack.clear();
            bpack.resize(npan * panel_words, 0);
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
            let bp = &bpack[..];
            let task = |t: usize| {
                let Some((i0, rows, p0, p1)) = grid.task(t) else {
                    return;
                };
                let pairs_of_rows = rows.div_ceil(MR);
                let mut apack = vec![0u16; 2 * pairs_of_rows * ns * tile_len];
                // SAFETY: rows i0..i0 + rows and columns k0..k0 + klen of lhs are in bounds
                // (contract).
                unsafe { pack_lhs(lhs.at(i0, k0), rows, klen, ns, &mut apack) };
                let _tiles = TileConfig::load();
                let mut scratch = [0f32; MR * NR];
                for jp in p0..p1 {
                    let bpanel = &bp[jp * panel_words..(jp + 1) * panel_words];
                    let j = jc + jp * NR;
                    let cols = NR.min(n - j);
                    for ip in 0..pairs_of_rows {
                        let i = i0 + ip * MR;
                        let a0 = &apack[2 * ip * ns * tile_len..];
                        let tile: &mut [f32] = if kblocks > 1 {
                            let at = ((i / MR) * panels_max + jp) * MR * NR;
                            // SAFETY: block (row pair i/MR, panel jp) of the accumulators is
                            // inside acc and belongs to this task alone (its rows).
                            unsafe { std::slice::from_raw_parts_mut(accp.get().add(at), MR * NR) }
                        } else {
                            &mut scratch
                        };
                        // SAFETY: the tile configuration is loaded on this thread; from a0 the
                        // block's first row tile has `ns` steps and its second the same
                        // `ns · 512` elements further; the panel holds 16 pairs per step; the
                        // tile is 32 × 32; rows i.. and columns j.. of dst are this task's own.
                        unsafe {
                            micro(a0.as_ptr(), ns * tile_len, bpanel.as_ptr(), ns, tile, !first);
                            if last {
                                store_rows(tile, dst, i, j, MR.min(m - i), cols, scale);
                            }
                        }
                    }
                }
            };
            grid.run(threads, task);
        }
    }
    drop(acc);
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
        // 16 rows of a tile are contiguous, so walk along them (a row at a time would touch
        // a cache line per element).
        for t in 0..rows.div_ceil(TILE_ROWS) {
            let r0 = t * TILE_ROWS;
            let nr = TILE_ROWS.min(rows - r0);
            for p in 0..k {
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

/// One 32 × 32 block over `steps` steps of 32 along k into `tile` (row-major f32, 32 columns),
/// added to what `tile` holds when `accumulate`, else replacing it.
///
/// # Safety
/// The tile configuration of [`TileConfig::load`] is loaded on this thread; `a` holds `steps`
/// packed `lhs` tiles (1 KiB each) of the block's first 16 rows, and `a_step` elements further
/// the same of its second 16; `b` holds `16 · steps` pairs of [`NR`] words; `tile` holds
/// `32 · 32` elements.
#[inline]
unsafe fn micro(
    a: *const u16,
    a_step: usize,
    b: *const u32,
    steps: usize,
    tile: &mut [f32],
    accumulate: bool,
) {
    debug_assert!(tile.len() >= MR * NR && steps > 0);
    let a1 = a.wrapping_add(a_step);
    let c = tile.as_mut_ptr();
    // SAFETY: the contract: every tile load reads 16 rows of 64 bytes inside the panels
    // (lhs: contiguous 1 KiB per step; rhs: 16 pairs of 128 bytes per step, two tiles side by
    // side); the accumulator's loads and stores touch 32 rows of 128 bytes, the whole block.
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
            "tileloadd tmm4, [{a0} + {s64}*1]",
            "tileloadd tmm6, [{b0} + {s128}*1]",
            "tileloadd tmm7, [{b0} + {s128}*1 + 64]",
            "tileloadd tmm5, [{a1} + {s64}*1]",
            "dec {n}",
            "jz 3f",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "add {a0}, 1024",
            "tileloadd tmm4, [{a0} + {s64}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "add {b0}, 2048",
            "tileloadd tmm6, [{b0} + {s128}*1]",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tileloadd tmm7, [{b0} + {s128}*1 + 64]",
            "add {a1}, 1024",
            "tileloadd tmm5, [{a1} + {s64}*1]",
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
            a0 = inout(reg) a => _,
            a1 = inout(reg) a1 => _,
            b0 = inout(reg) b => _,
            n = inout(reg) steps => _,
            c = in(reg) c,
            s64 = in(reg) 64usize,
            s128 = in(reg) 128usize,
            options(nostack),
        );
    }
}
