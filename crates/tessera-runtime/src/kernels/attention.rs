//! Fused attention (FlashAttention-style memory) and rotary position embeddings.
//!
//! Layout `[B,S,H,D]`: the heads of one position are interleaved in a row, so head `h` of
//! batch `b` is the strided matrix at `((b·S)·H + h)·D` with row stride `H·D` (`Hkv·D` for
//! k and v). Every product (QKᵀ, PV, dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q) is one `gemm` call on such
//! views, so nothing is transposed or gathered.
//!
//! Queries are processed in blocks of rows; a block only multiplies against the key range
//! that some row of it can see (causal and sliding-window masks skip whole key ranges), and
//! holds its scores in a `rows × keys` scratch (the backward two: P and dP).
//!
//! Memory: the declared workspace is the scores of `min(S, ATTENTION_SCRATCH_ROWS)` query rows
//! against all T keys. The tasks run in *lanes*: at most `ATTENTION_SCRATCH_ROWS / (rows per
//! block · buffers)` of them, each taking its tasks one after another with one scratch it
//! allocates once at the exact size `rows × T` (so no `Vec` growth overshoots), run in parallel.
//! However many rayon threads there are, and even when a thread waiting inside a
//! multithreaded gemm steals another lane, at most that many scratches are alive: the bound
//! holds for long sequences, whose 256K×256K block could never be held. For S below the cap
//! the lanes are what limits it, not S: with more threads than S has blocks, up to
//! `threads × 64` rows may be live (as before this bound existed), which is more than the
//! declared S rows by at most that (small) amount. Only `out` and the log-sum-exp `[B,H,S]`
//! are saved; the backward recomputes the probabilities from q, k and the log-sum-exp.
//! Lanes change only which thread runs a block, never a block's arithmetic, so results are
//! the same bits at any cap.
//!
//! Ring attention (`AttentionSpec::ring`): queries and keys sit at global positions (from the
//! device's cp coordinate and the ring step), increasing with the local index, so a mask still
//! leaves each query a contiguous range of local keys (found by binary search) and a block of
//! queries that sees none of the block's keys costs nothing. The backward's optional seventh
//! input, the log-sum-exp's cotangent, lowers the row term `D` by it.
//!
//! Work split: the forward runs over (batch, head, query block) tasks; the backward over
//! (batch, kv head) tasks, each looping over its group's query heads, so dk and dv are
//! accumulated by a single task without races (and dq rows belong to one task too). A lane
//! takes every `lanes`-th task, so causal blocks of unequal cost spread over the lanes. When
//! there are fewer lanes than threads, the gemms themselves go multithreaded.
//!
//! The softmax rows use a branch-free polynomial `exp` (Cephes' `expf`, ~2 ulp) with lane-wise
//! max / sum reductions, so they vectorise; they are compiled a second time for AVX2+FMA and
//! picked at run time (with libm's scalar `exp` the row pass was a large share of the time).

use super::matmul::{all_threads, gemm_f32, MatMut, MatRef, SendConstPtr, SendPtr};
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;
use tessera_ir::dist::MeshPos;
use tessera_ir::ops::ATTENTION_SCRATCH_ROWS;
use tessera_ir::AttentionSpec;

/// Query rows per block.
const BLOCK_ROWS: usize = 64;

fn unsupported(op: &str, reason: String) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cpu".into(), op: op.into(), reason }
}

fn bshd(t: &Tensor, what: &str) -> Result<[usize; 4]> {
    match *t.dims() {
        [b, s, h, d] => Ok([b, s, h, d]),
        _ => Err(RuntimeError::Binding(format!(
            "{what} {:?} must be [batch, seq, heads, head_dim]",
            t.dims()
        ))),
    }
}

fn expect_f32(op: &str, ts: &[(&Tensor, &str)]) -> Result<()> {
    for (t, what) in ts {
        if t.dtype() != DType::F32 {
            return Err(unsupported(
                op,
                format!("{what} is {:?}; only f32 is supported on the CPU", t.dtype()),
            ));
        }
    }
    Ok(())
}

/// The attention geometry.
#[derive(Clone)]
struct Geom {
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
    scale: f32,
    /// Per row, the position of its first query (a KV-cache step); `None`: the last S of T.
    start: Option<Vec<i64>>,
    /// Per local head, its ALiBi slope (empty without ALiBi).
    slopes: Vec<f32>,
    /// Per local query head, the KV head it reads (`h / group`, or by its global index when
    /// k/v hold every KV head and q some of the query heads).
    kv_of: Vec<usize>,
    /// Ring attention: the global positions of the queries and of the keys (both increasing).
    ring: Option<(Vec<i64>, Vec<i64>)>,
}

impl Geom {
    fn at(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        start: Option<&Tensor>,
        spec: &AttentionSpec,
        at: &MeshPos,
    ) -> Result<Geom> {
        let [b, s, h, d] = bshd(q, "q")?;
        let [bk, t, hkv, dk] = bshd(k, "k")?;
        if v.dims() != k.dims() {
            return Err(RuntimeError::Binding(format!(
                "v {:?} must match k {:?}",
                v.dims(),
                k.dims()
            )));
        }
        if bk != b || dk != d {
            return Err(RuntimeError::Binding(format!(
                "k {:?} does not fit q {:?} (same batch and head_dim)",
                k.dims(),
                q.dims()
            )));
        }
        let kv_of = spec.kv_heads_of(h, hkv, Some(at)).map_err(|e| {
            RuntimeError::Binding(format!("k {:?} does not fit q {:?}: {e}", k.dims(), q.dims()))
        })?;
        let start = match start {
            Some(st) => {
                let v: Vec<i64> = contiguous(st)?.flatten_all()?.to_vec1::<i64>()?;
                if v.len() != b || v.iter().any(|&p| p < 0 || p as usize + s > t) {
                    return Err(RuntimeError::Binding(format!(
                        "attention: starts {v:?} must give each of the {b} rows {s} positions \
                         within the cache's {t}"
                    )));
                }
                Some(v)
            }
            None => None,
        };
        let slopes = match &spec.alibi {
            Some(a) => a.local_slopes(h, Some(at))?.into_iter().map(|x| x as f32).collect(),
            None => Vec::new(),
        };
        let ring = spec.ring.map(|r| r.positions(s, t, Some(at)));
        Ok(Geom {
            b,
            s,
            t,
            h,
            hkv,
            d,
            causal: spec.causal,
            window: spec.window,
            scale: spec.scale as f32,
            start,
            slopes,
            kv_of,
            ring,
        })
    }

    /// The position of query `i` of row `b`.
    fn pos(&self, b: usize, i: usize) -> i64 {
        match (&self.start, &self.ring) {
            (Some(st), _) => st[b] + i as i64,
            (None, Some((q, _))) => q[i],
            (None, None) => i as i64 + self.t as i64 - self.s as i64,
        }
    }

    /// The position of key `j`.
    fn key_pos(&self, j: usize) -> i64 {
        self.ring.as_ref().map_or(j as i64, |(_, k)| k[j])
    }

    /// How many keys sit at positions `< p` (keys are in increasing position order).
    fn keys_before(&self, p: i64) -> usize {
        match &self.ring {
            Some((_, k)) => k.partition_point(|&x| x < p),
            None => p.clamp(0, self.t as i64) as usize,
        }
    }

    /// Adds head `h`'s ALiBi bias `slope·(j − p)` to the scores `row` of keys `jlo..` for the
    /// query at position `p`.
    fn add_bias(&self, h: usize, p: i64, jlo: usize, row: &mut [f32]) {
        if let Some(&slope) = self.slopes.get(h) {
            for (x, j) in row.iter_mut().zip(jlo..) {
                *x += slope * (self.key_pos(j) - p) as f32;
            }
        }
    }

    /// Element offset of q/out/dout row (b, i, h).
    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.s + i) * self.h + h) * self.d
    }

    /// Element offset of k/v row (b, j, kv head g).
    fn kv_at(&self, b: usize, j: usize, g: usize) -> usize {
        ((b * self.t + j) * self.hkv + g) * self.d
    }

    /// Keys `lo..hi` visible to query `i` of row `b` (empty when `hi <= lo`).
    fn visible(&self, b: usize, i: usize) -> (usize, usize) {
        let p = self.pos(b, i);
        let hi = if self.causal { self.keys_before(p + 1) } else { self.t };
        let lo = match self.window {
            Some(w) => self.keys_before(p - w as i64 + 1),
            None => 0,
        };
        (lo, hi)
    }

    /// Keys any query of `i0..i1` of row `b` can see (both bounds are monotone in i).
    fn block_keys(&self, b: usize, i0: usize, i1: usize) -> (usize, usize) {
        let (lo, _) = self.visible(b, i0);
        let (_, hi) = self.visible(b, i1 - 1);
        (lo, hi.max(lo))
    }
}

/// Rows of scratch a block may use when it holds `bufs` buffers: within `min(S, cap)` rows.
fn block_rows(s: usize, bufs: usize, cap: usize) -> usize {
    BLOCK_ROWS.min((s.min(cap) / bufs).max(1))
}

/// Runs `tasks` in at most `lanes` parallel lanes (lane `l` takes tasks `l, l + lanes, …` in
/// order), each lane with one scratch from `make`: no more than `lanes` scratches are ever
/// alive, whatever the thread count.
fn in_lanes<S>(
    tasks: usize,
    lanes: usize,
    make: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize) + Sync,
) {
    let lanes = lanes.clamp(1, tasks.max(1));
    (0..lanes).into_par_iter().for_each(|l| {
        let mut scratch = make();
        for task in (l..tasks).step_by(lanes) {
            f(&mut scratch, task);
        }
    });
}

/// The gemms' threading: multithreaded when there are fewer lanes than threads.
fn gemm_par(tasks: usize, lanes: usize) -> Parallelism {
    if tasks.min(lanes) < rayon::current_num_threads() {
        all_threads()
    } else {
        Parallelism::None
    }
}

/// Fused attention: `[out [B,S,H,D], logsumexp [B,H,S] f32]`; with `start`, row `b`'s queries
/// sit at positions `start[b]..` of a KV cache. `at` picks the device's ALiBi heads.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: Option<&Tensor>,
    spec: &AttentionSpec,
    at: &MeshPos,
) -> Result<Vec<Tensor>> {
    attention_within(q, k, v, start, spec, at, ATTENTION_SCRATCH_ROWS)
}

/// [`attention`] holding the scores of at most `cap_rows` query rows at once (the IR's
/// [`ATTENTION_SCRATCH_ROWS`] in a run; smaller in tests, so a short sequence exceeds it).
pub fn attention_within(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: Option<&Tensor>,
    spec: &AttentionSpec,
    at: &MeshPos,
    cap_rows: usize,
) -> Result<Vec<Tensor>> {
    expect_f32("attention", &[(q, "q"), (k, "k"), (v, "v")])?;
    let g = Geom::at(q, k, v, start, spec, at)?;
    let (q, k, v) = (contiguous(q)?, contiguous(k)?, contiguous(v)?);
    let (qs, ks, vs) = (read::<f32>(&q)?, read::<f32>(&k)?, read::<f32>(&v)?);
    let mut out = vec![0f32; g.b * g.s * g.h * g.d];
    let mut lse = vec![f32::NEG_INFINITY; g.b * g.h * g.s];
    let bq = block_rows(g.s, 1, cap_rows);
    let nblk = g.s.div_ceil(bq);
    let tasks = g.b * g.h * nblk;
    let lanes = cap_rows / bq;
    let (qp, kp, vp) =
        (SendConstPtr(qs.as_ptr()), SendConstPtr(ks.as_ptr()), SendConstPtr(vs.as_ptr()));
    let (op, lp) = (SendPtr(out.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    let par = gemm_par(tasks, lanes);
    let (hd, kvd) = ((g.h * g.d) as isize, (g.hkv * g.d) as isize);

    in_lanes(
        tasks,
        lanes,
        || Vec::<f32>::with_capacity(bq * g.t),
        |scores, task| {
            let (bh, blk) = (task / nblk, task % nblk);
            let (b, h) = (bh / g.h, bh % g.h);
            let kvh = g.kv_of[h];
            let (i0, i1) = (blk * bq, ((blk + 1) * bq).min(g.s));
            let (jlo, jhi) = g.block_keys(b, i0, i1);
            let (rows, tb) = (i1 - i0, jhi - jlo);
            if tb == 0 {
                return; // every query masked: zero output, lse −∞ (as allocated)
            }
            scores.clear();
            scores.resize(rows * tb, 0.0);
            let q_blk = MatRef { ptr: qp.get().wrapping_add(g.q_at(b, i0, h)), rs: hd, cs: 1 };
            let k_blk = MatRef { ptr: kp.get().wrapping_add(g.kv_at(b, jlo, kvh)), rs: kvd, cs: 1 };
            let v_blk = MatRef { ptr: vp.get().wrapping_add(g.kv_at(b, jlo, kvh)), rs: kvd, cs: 1 };
            let sc = MatMut { ptr: scores.as_mut_ptr(), rs: tb as isize, cs: 1 };
            // SAFETY: the views address rows i0..i1 of head h and keys jlo..jhi of kv head kvh,
            // inside the checked [B,S,H,D] / [B,T,Hkv,D] buffers; `scores` is this task's own.
            unsafe { gemm_f32(rows, tb, g.d, sc, false, q_blk, k_blk.t(), g.scale, par) };
            for (r, row) in scores.chunks_mut(tb).enumerate() {
                let i = i0 + r;
                g.add_bias(h, g.pos(b, i), jlo, row);
                let (lo, hi) = g.visible(b, i);
                let (lo, hi) = (lo.clamp(jlo, jhi) - jlo, hi.clamp(jlo, jhi) - jlo);
                let l = softmax_row(row, lo, hi);
                // SAFETY: lse[b, h, i] belongs to this task only.
                unsafe { *lp.get().add((b * g.h + h) * g.s + i) = l };
            }
            let o_blk = MatMut { ptr: op.get().wrapping_add(g.q_at(b, i0, h)), rs: hd, cs: 1 };
            let p = MatRef { ptr: scores.as_ptr(), rs: tb as isize, cs: 1 };
            // SAFETY: out rows i0..i1 of head h belong to this task only.
            unsafe { gemm_f32(rows, g.d, tb, o_blk, false, p, v_blk, 1.0, par) };
        },
    );
    drop((qs, ks, vs));
    Ok(vec![from_vec(out, &[g.b, g.s, g.h, g.d])?, from_vec(lse, &[g.b, g.h, g.s])?])
}

/// Turns scores `row[lo..hi]` into probabilities (zero outside) and returns the row's
/// log-sum-exp (−∞, with an all-zero row, when nothing is visible).
fn softmax_row(row: &mut [f32], lo: usize, hi: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { softmax_row_avx2(row, lo, hi) };
    }
    softmax_row_body(row, lo, hi)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_avx2(row: &mut [f32], lo: usize, hi: usize) -> f32 {
    softmax_row_body(row, lo, hi)
}

#[inline(always)]
fn softmax_row_body(row: &mut [f32], lo: usize, hi: usize) -> f32 {
    if hi <= lo {
        row.fill(0.0);
        return f32::NEG_INFINITY;
    }
    row[..lo].fill(0.0);
    row[hi..].fill(0.0);
    let vis = &mut row[lo..hi];
    let mx = lanes_max(vis);
    for x in vis.iter_mut() {
        *x = exp_approx(*x - mx);
    }
    let sum = lanes_sum(vis);
    let inv = 1.0 / sum;
    for x in vis.iter_mut() {
        *x *= inv;
    }
    mx + sum.ln()
}

/// Backward row: `p = exp(s − lse)` in `p`, and `dS = p·(dP − D)` in `dp`, over `lo..hi`
/// (zero outside).
fn backward_row(p: &mut [f32], dp: &mut [f32], lo: usize, hi: usize, lse: f32, big_d: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { backward_row_avx2(p, dp, lo, hi, lse, big_d) };
    }
    backward_row_body(p, dp, lo, hi, lse, big_d)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn backward_row_avx2(
    p: &mut [f32],
    dp: &mut [f32],
    lo: usize,
    hi: usize,
    lse: f32,
    big_d: f32,
) {
    backward_row_body(p, dp, lo, hi, lse, big_d)
}

#[inline(always)]
fn backward_row_body(p: &mut [f32], dp: &mut [f32], lo: usize, hi: usize, lse: f32, big_d: f32) {
    let lo = lo.min(hi);
    p[..lo].fill(0.0);
    p[hi..].fill(0.0);
    dp[..lo].fill(0.0);
    dp[hi..].fill(0.0);
    for (p, dp) in p[lo..hi].iter_mut().zip(&mut dp[lo..hi]) {
        *p = exp_approx(*p - lse);
        *dp = *p * (*dp - big_d);
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Max of a slice over 8 independent lanes (so it vectorises).
#[inline(always)]
fn lanes_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    rest.iter().chain(&acc).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Sum of a slice over 8 independent lanes (so it vectorises).
#[inline(always)]
fn lanes_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// `e^x` for `x ≤ 88` to about 2 ulp (Cephes' `expf` polynomial), branch-free so loops over
/// it vectorise; inputs below −87 give ~1e-38 instead of a denormal or 0.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer in the low bits
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let two_n = f32::from_bits(((t.to_bits() as i32 - 0x4B40_0000 + 127) << 23) as u32);
    y * two_n
}

/// `[dq, dk, dv]` of fused attention, recomputing the probabilities from `lse`; `x` is
/// `[q, k, v, out, lse, dout]`, with the log-sum-exp's cotangent `dlse` seventh where it was
/// read (ring attention's merge): the softmax row term is then `D − dlse`.
pub fn attention_backward(
    x: &[&Tensor],
    spec: &AttentionSpec,
    at: &MeshPos,
) -> Result<Vec<Tensor>> {
    attention_backward_within(x, spec, at, ATTENTION_SCRATCH_ROWS)
}

/// [`attention_backward`] holding the P and dP scores of at most `cap_rows` query rows in all
/// (see [`attention_within`]).
pub fn attention_backward_within(
    x: &[&Tensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    cap_rows: usize,
) -> Result<Vec<Tensor>> {
    let op = "attention_backward";
    let &[q, k, v, out, lse, dout, ..] = x else {
        return Err(RuntimeError::Binding(format!("{op} takes 6 or 7 inputs, got {}", x.len())));
    };
    let dlse = match x.get(6) {
        Some(&g) if g.dims() == lse.dims() => {
            expect_f32(op, &[(g, "dlogsumexp")])?;
            Some(contiguous(g)?)
        }
        Some(g) => {
            return Err(RuntimeError::Binding(format!(
                "{op}: dlogsumexp {:?} must match logsumexp {:?}",
                g.dims(),
                lse.dims()
            )))
        }
        None => None,
    };
    expect_f32(
        op,
        &[(q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "logsumexp"), (dout, "dout")],
    )?;
    let g = Geom::at(q, k, v, None, spec, at)?;
    if out.dims() != q.dims() || dout.dims() != q.dims() || lse.dims() != [g.b, g.h, g.s] {
        return Err(RuntimeError::Binding(format!(
            "{op}: out {:?} and dout {:?} must match q {:?}, logsumexp {:?} must be [B,H,S]",
            out.dims(),
            dout.dims(),
            q.dims(),
            lse.dims()
        )));
    }
    let (q, k, v) = (contiguous(q)?, contiguous(k)?, contiguous(v)?);
    let (out, lse, dout) = (contiguous(out)?, contiguous(lse)?, contiguous(dout)?);
    let (qs, ks, vs) = (read::<f32>(&q)?, read::<f32>(&k)?, read::<f32>(&v)?);
    let (os, ls, dos) = (read::<f32>(&out)?, read::<f32>(&lse)?, read::<f32>(&dout)?);
    let dlse = dlse.as_ref().map(read::<f32>).transpose()?;
    let dlse: Option<&[f32]> = dlse.as_deref();
    let mut dq = vec![0f32; qs.len()];
    let mut dk = vec![0f32; ks.len()];
    let mut dv = vec![0f32; vs.len()];

    let bq = block_rows(g.s, 2, cap_rows);
    let nblk = g.s.div_ceil(bq);
    let tasks = g.b * g.hkv;
    let lanes = cap_rows / (2 * bq);
    let par = gemm_par(tasks, lanes);
    let (hd, kvd) = ((g.h * g.d) as isize, (g.hkv * g.d) as isize);
    let (qp, kp, vp) =
        (SendConstPtr(qs.as_ptr()), SendConstPtr(ks.as_ptr()), SendConstPtr(vs.as_ptr()));
    let (opp, lp, dop) =
        (SendConstPtr(os.as_ptr()), SendConstPtr(ls.as_ptr()), SendConstPtr(dos.as_ptr()));
    let (dqp, dkp, dvp) =
        (SendPtr(dq.as_mut_ptr()), SendPtr(dk.as_mut_ptr()), SendPtr(dv.as_mut_ptr()));

    in_lanes(
        tasks,
        lanes,
        || (Vec::<f32>::with_capacity(bq * g.t), Vec::<f32>::with_capacity(bq * g.t)),
        |(pbuf, dpbuf), task| {
            let (b, kvh) = (task / g.hkv, task % g.hkv);
            let k_all = kp.get().wrapping_add(g.kv_at(b, 0, kvh));
            let v_all = vp.get().wrapping_add(g.kv_at(b, 0, kvh));
            let dk_all = dkp.get().wrapping_add(g.kv_at(b, 0, kvh));
            let dv_all = dvp.get().wrapping_add(g.kv_at(b, 0, kvh));
            for h in (0..g.h).filter(|&h| g.kv_of[h] == kvh) {
                for blk in 0..nblk {
                    let (i0, i1) = (blk * bq, ((blk + 1) * bq).min(g.s));
                    let (jlo, jhi) = g.block_keys(b, i0, i1);
                    let (rows, tb) = (i1 - i0, jhi - jlo);
                    if tb == 0 {
                        continue; // dq rows stay zero
                    }
                    pbuf.clear();
                    pbuf.resize(rows * tb, 0.0);
                    dpbuf.clear();
                    dpbuf.resize(rows * tb, 0.0);
                    let qo = g.q_at(b, i0, h);
                    let koff = jlo as isize * kvd;
                    let q_blk = MatRef { ptr: qp.get().wrapping_add(qo), rs: hd, cs: 1 };
                    let do_blk = MatRef { ptr: dop.get().wrapping_add(qo), rs: hd, cs: 1 };
                    let k_blk = MatRef { ptr: k_all.wrapping_offset(koff), rs: kvd, cs: 1 };
                    let v_blk = MatRef { ptr: v_all.wrapping_offset(koff), rs: kvd, cs: 1 };
                    let p_mut = MatMut { ptr: pbuf.as_mut_ptr(), rs: tb as isize, cs: 1 };
                    let dp_mut = MatMut { ptr: dpbuf.as_mut_ptr(), rs: tb as isize, cs: 1 };
                    // SAFETY (all gemms below): views address rows i0..i1 of head h and keys
                    // jlo..jhi of kv head kvh inside the checked buffers; the scratch is this
                    // task's own; dq rows of head h and dk/dv of kv head kvh (batch b) are
                    // written by this task only.
                    unsafe {
                        gemm_f32(rows, tb, g.d, p_mut, false, q_blk, k_blk.t(), g.scale, par);
                        gemm_f32(rows, tb, g.d, dp_mut, false, do_blk, v_blk.t(), 1.0, par);
                    }
                    for r in 0..rows {
                        let i = i0 + r;
                        let prow = &mut pbuf[r * tb..(r + 1) * tb];
                        let dprow = &mut dpbuf[r * tb..(r + 1) * tb];
                        // SAFETY: lse, out and dout are read-only inputs, rows in bounds.
                        let l = unsafe { *lp.get().add((b * g.h + h) * g.s + i) };
                        g.add_bias(h, g.pos(b, i), jlo, prow);
                        let (lo, hi) = g.visible(b, i);
                        let (lo, hi) = (lo.clamp(jlo, jhi) - jlo, hi.clamp(jlo, jhi) - jlo);
                        if l == f32::NEG_INFINITY || hi <= lo {
                            prow.fill(0.0);
                            dprow.fill(0.0);
                            continue;
                        }
                        let o = g.q_at(b, i, h);
                        let (orow, grow) = unsafe {
                            (
                                std::slice::from_raw_parts(opp.get().add(o), g.d),
                                std::slice::from_raw_parts(dop.get().add(o), g.d),
                            )
                        };
                        let big_d: f32 = orow.iter().zip(grow).map(|(a, b)| a * b).sum::<f32>()
                            - dlse.as_ref().map_or(0.0, |dl| dl[(b * g.h + h) * g.s + i]);
                        backward_row(prow, dprow, lo, hi, l, big_d);
                    }
                    let p = MatRef { ptr: pbuf.as_ptr(), rs: tb as isize, cs: 1 };
                    let ds = MatRef { ptr: dpbuf.as_ptr(), rs: tb as isize, cs: 1 };
                    let dq_blk = MatMut { ptr: dqp.get().wrapping_add(qo), rs: hd, cs: 1 };
                    let dk_blk = MatMut { ptr: dk_all.wrapping_offset(koff), rs: kvd, cs: 1 };
                    let dv_blk = MatMut { ptr: dv_all.wrapping_offset(koff), rs: kvd, cs: 1 };
                    unsafe {
                        gemm_f32(tb, g.d, rows, dv_blk, true, p.t(), do_blk, 1.0, par);
                        gemm_f32(rows, g.d, tb, dq_blk, false, ds, k_blk, g.scale, par);
                        gemm_f32(tb, g.d, rows, dk_blk, true, ds.t(), q_blk, g.scale, par);
                    }
                }
            }
        },
    );
    drop((qs, ks, vs, os, ls, dos));
    Ok(vec![from_vec(dq, q.dims())?, from_vec(dk, k.dims())?, from_vec(dv, v.dims())?])
}

/// Rotary embedding (rotate-half) at positions 0..S, or at `positions [B,S]`; `inverse`
/// rotates by −θ.
pub fn rope(
    x: &Tensor,
    positions: Option<&Tensor>,
    inv_freq: &[f64],
    inverse: bool,
) -> Result<Tensor> {
    expect_f32("rope", &[(x, "x")])?;
    let [b, s, h, d] = bshd(x, "x")?;
    let half = d / 2;
    if d % 2 != 0 || inv_freq.len() != half {
        return Err(RuntimeError::Binding(format!(
            "rope: head_dim {d} needs {half} inverse frequencies, got {}",
            inv_freq.len()
        )));
    }
    let sign = if inverse { -1.0 } else { 1.0 };
    // The position of each (row, query): 0..S, or the given ones.
    let at: Vec<i64> = match positions {
        Some(p) => {
            let v = contiguous(p)?.flatten_all()?.to_vec1::<i64>()?;
            if v.len() != b * s {
                return Err(RuntimeError::Binding(format!(
                    "rope: {} positions for x {:?}",
                    v.len(),
                    x.dims()
                )));
            }
            v
        }
        None => (0..s as i64).collect(),
    };
    let n_at = at.len();
    // cos/sin per (position, pair), angles in f64.
    let mut cos = Vec::with_capacity(n_at * half);
    let mut sin = Vec::with_capacity(n_at * half);
    for &pos in &at {
        for f in inv_freq {
            let (sn, cs) = (sign * pos as f64 * f).sin_cos();
            cos.push(cs as f32);
            sin.push(sn as f32);
        }
    }
    let x = contiguous(x)?;
    let xs = read::<f32>(&x)?;
    let mut out = vec![0f32; xs.len()];
    let row = h * d;
    if row > 0 {
        out.par_chunks_mut(row).zip(xs.par_chunks(row)).enumerate().with_min_len(16).for_each(
            |(r, (orow, xrow))| {
                let pos = r % n_at;
                let (c, sn) =
                    (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
                for (o, xh) in orow.chunks_mut(d).zip(xrow.chunks(d)) {
                    let (x1, x2) = xh.split_at(half);
                    let (o1, o2) = o.split_at_mut(half);
                    for i in 0..half {
                        o1[i] = x1[i] * c[i] - x2[i] * sn[i];
                        o2[i] = x2[i] * c[i] + x1[i] * sn[i];
                    }
                }
            },
        );
    }
    drop(xs);
    from_vec(out, &[b, s, h, d])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp_approx(x) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "exp_approx relative error {worst:e}");
        assert_eq!(exp_approx(0.0), 1.0);
        assert!(exp_approx(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn row_reductions() {
        let x: Vec<f32> = (0..21).map(|i| ((i * 7) % 11) as f32 - 3.0).collect();
        assert_eq!(lanes_max(&x), 7.0);
        assert_eq!(lanes_sum(&x), x.iter().sum::<f32>());
        assert_eq!(lanes_max(&[]), f32::NEG_INFINITY);
    }
}
