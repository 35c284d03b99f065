//! The [`Communicator`] trait: what one rank of an SPMD program can ask of the others.
//!
//! The trait is the seam between the runtime and a transport. The runtime only sees f32
//! slices (it converts other dtypes), so a backend moves one element type and stays small.
//!
//! Besides the plain collectives, whose chunks lie end to end, the trait has variants whose
//! buffers hold the members' chunks interleaved ([`ChunkLayout`]): a tensor cut or joined
//! along a dim that is not the leading one, possibly inside a larger tensor. The runtime hands
//! its tensor's own buffer (or the buffer that becomes the result) to these, so no whole-tensor
//! reordering copy is made on either side, and an all-gather can fill its part of a final
//! result in place ([`Communicator::all_gather_in_place`]), so a chain of all-gathers needs no
//! intermediate buffer. Their default implementations reorder around the plain calls (what a
//! backend without a better way gets); the thread backend implements them directly.

use std::ops::Range;

use crate::error::{describe_op, CommError, Result};
use crate::group::Group;
use crate::stats::{CollectiveKind, CommStats};

/// Where each member's chunk lies in a buffer holding one chunk per member of a group.
///
/// Each chunk is cut into `outer` equal *blocks* of `inner = chunk / outer` elements. Block b of
/// member k's chunk starts at `offset + b·stride + k·inner`: the members' blocks lie side by
/// side, and `stride` apart from one block index to the next. The *packed* layouts
/// ([`ChunkLayout::interleaved`]) have `offset` 0 and `stride = members·inner`: the buffer is a
/// row-major `[outer, members, inner]` array and nothing else, which is how a tensor cut into
/// (or joined from) one chunk per member along dim `d` is laid out, with `outer` = the product
/// of the dims before `d`. [`ChunkLayout::CONTIGUOUS`] (`outer` 1) is the plain collectives'
/// layout: chunk k is elements `k·c .. (k+1)·c`. [`ChunkLayout::placed`] puts the chunks inside
/// a larger buffer (a part of a larger tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkLayout {
    outer: usize,
    /// `None`: packed (`members·inner`).
    stride: Option<usize>,
    offset: usize,
}

impl ChunkLayout {
    /// Chunks end to end: chunk k is elements `k·c .. (k+1)·c`.
    pub const CONTIGUOUS: ChunkLayout = ChunkLayout { outer: 1, stride: None, offset: 0 };

    /// Packed: chunks cut into `outer` blocks each, interleaved member by member.
    pub fn interleaved(outer: usize) -> ChunkLayout {
        ChunkLayout { outer, stride: None, offset: 0 }
    }

    /// Chunks cut into `outer` blocks each, block b of member k at `offset + b·stride +
    /// k·inner` of a buffer that may hold more than the chunks.
    pub fn placed(outer: usize, stride: usize, offset: usize) -> ChunkLayout {
        ChunkLayout { outer, stride: Some(stride), offset }
    }

    /// The number of blocks each chunk is cut into.
    pub fn outer(self) -> usize {
        self.outer
    }

    /// Whether the buffer is the chunks and nothing else, interleaved.
    pub fn is_packed(self) -> bool {
        self.stride.is_none() && self.offset == 0
    }

    /// The buffer length this layout needs for `members` chunks of `chunk` elements (0 if the
    /// chunks are empty), or `None` if it does not fit them: `outer` does not divide `chunk`,
    /// or the stride would make blocks overlap.
    pub fn span(self, members: usize, chunk: usize) -> Option<usize> {
        if chunk == 0 || members == 0 {
            return Some(0);
        }
        if self.outer == 0 || !chunk.is_multiple_of(self.outer) {
            return None;
        }
        let row = members.checked_mul(chunk / self.outer)?;
        let stride = self.stride.unwrap_or(row);
        if stride < row {
            return None;
        }
        (self.outer - 1).checked_mul(stride)?.checked_add(row)?.checked_add(self.offset)
    }

    /// For elements `range` of member `k`'s chunk (of `chunk` elements, in a group of
    /// `members`), calls `f(offset in the chunk, offset in the buffer, length)` once per run
    /// that is contiguous in the buffer, in chunk order. The layout must fit (see
    /// [`ChunkLayout::span`]) and `range` lie within the chunk.
    pub fn for_each_run(
        self,
        members: usize,
        chunk: usize,
        k: usize,
        range: Range<usize>,
        mut f: impl FnMut(usize, usize, usize),
    ) {
        if range.is_empty() {
            return;
        }
        // `range` is non-empty, so `chunk > 0` and (the layout fitting) `outer >= 1`.
        let inner = chunk / self.outer.max(1);
        let stride = self.stride.unwrap_or(members * inner);
        let mut j = range.start;
        while j < range.end {
            let (block, within) = (j / inner, j % inner);
            let len = (inner - within).min(range.end - j);
            f(j, self.offset + block * stride + k * inner + within, len);
            j += len;
        }
    }
}

/// Fails with [`CommError::InvalidArgument`] unless `layout` fits the group's chunks of `chunk`
/// elements within a buffer of `len` elements.
pub(crate) fn check_layout(
    rank: usize,
    kind: CollectiveKind,
    group: &Group,
    layout: ChunkLayout,
    chunk: usize,
    len: usize,
) -> Result<()> {
    match layout.span(group.len(), chunk) {
        Some(span) if span <= len => Ok(()),
        _ => Err(CommError::InvalidArgument(format!(
            "rank {rank}: {} cannot lay out {} chunks of {chunk} elements as {layout:?} in a \
             buffer of {len}",
            describe_op(kind, group.ranks()),
            group.len()
        ))),
    }
}

/// Element-wise sum of the `n` equal chunks of `parts`, in chunk order (member order): how a
/// transport that gathers every member's input sums it, so that every member, on every
/// transport, gets the thread backend's bits.
pub fn sum_chunks(parts: &[f32], n: usize) -> Vec<f32> {
    let len = parts.len().checked_div(n).unwrap_or(0);
    if len == 0 {
        return Vec::new();
    }
    let (first, rest) = parts.split_at(len);
    let mut out = first.to_vec();
    for chunk in rest.chunks_exact(len) {
        for (o, x) in out.iter_mut().zip(chunk) {
            *o += *x;
        }
    }
    out
}

/// The largest tag of [`Communicator::send_tagged`] / [`Communicator::recv_tagged`]. MPI
/// guarantees tags up to 32767 only, and its backend keeps a few below its range of user tags
/// for itself; every backend refuses a larger tag, so that a program run on threads also runs
/// on MPI.
pub const MAX_TAG: u32 = 32_751;

/// Fails with [`CommError::InvalidArgument`] naming [`MAX_TAG`] if `tag` is above it.
pub fn check_tag(rank: usize, kind: CollectiveKind, peer: usize, tag: u32) -> Result<()> {
    if tag > MAX_TAG {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank}: {} with tag {tag}: tags go up to {MAX_TAG} (MPI guarantees only 32767, \
             and keeps a few for the backend's own messages)",
            describe_op(kind, &[peer])
        )));
    }
    Ok(())
}

/// The error of the default tagged calls for a tag other than 0.
fn untagged_only(rank: usize, kind: CollectiveKind, peer: usize, tag: u32) -> CommError {
    CommError::InvalidArgument(format!(
        "rank {rank}: {} with tag {tag}: this communicator implements only tag 0 (it does not \
         override send_tagged / recv_tagged)",
        describe_op(kind, &[peer])
    ))
}

/// A copy of a buffer of `members` equal chunks, converted from packed layout `from` to packed
/// layout `to` (both must fit the chunk length).
fn relayout(data: &[f32], members: usize, from: ChunkLayout, to: ChunkLayout) -> Vec<f32> {
    if from == to || members == 0 {
        return data.to_vec();
    }
    let chunk = data.len() / members;
    let mut out = vec![0.0f32; data.len()];
    for k in 0..members {
        // Walk chunk k in `to`'s runs, then each of those in `from`'s runs.
        to.for_each_run(members, chunk, k, 0..chunk, |j, dst, len| {
            from.for_each_run(members, chunk, k, j..j + len, |j2, src, len2| {
                let at = dst + (j2 - j);
                out[at..at + len2].copy_from_slice(&data[src..src + len2]);
            });
        });
    }
    out
}

/// One rank's handle on the world. Object-safe and `Send`, so the runtime can hold a
/// `Box<dyn Communicator>` and move it to the thread that drives the rank.
///
/// # Contract
///
/// - Every collective takes a [`Group`]: sorted global ranks that include the caller. Every
///   member must call the same collectives on that group in the same order, with consistent
///   sizes (same input length; for broadcast, same root). Calls on different groups are
///   independent: each group has its own sequence of calls.
/// - Results are identical, bit for bit, on every member and across runs: sums are taken in
///   group order (`member0 + member1 + ...`), whatever order the members arrive in.
/// - Inputs and outputs are contiguous f32 buffers; "chunk k" of a buffer of length `n·c` in a
///   group of `n` members is elements `k·c .. (k+1)·c`.
/// - A call that cannot complete fails within the backend's timeout, and promptly if a rank it
///   needs has gone (see [`crate::CommError`]). After such an error the call sequences are out
///   of step: stop the rank.
pub trait Communicator: Send {
    /// This rank's global index, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// Element-wise sum of every member's `data` (all the same length), on every member.
    fn all_reduce_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// Every member's `data` (all the same length), concatenated in group order.
    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// An all-gather into a buffer the caller provides: `buf` holds one chunk of `chunk`
    /// elements per member, laid out by `layout` (anything else in it is left alone); the
    /// caller's own chunk (at its index in the group) is filled in on entry, and on return every
    /// member's is. It counts as an all-gather of `chunk` elements, and members may mix it with
    /// [`Communicator::all_gather`] calls of that length. `layout` must fit in `buf`.
    fn all_gather_in_place(
        &mut self,
        group: &Group,
        buf: &mut [f32],
        chunk: usize,
        layout: ChunkLayout,
    ) -> Result<()> {
        let (rank, kind, n) = (self.rank(), CollectiveKind::AllGather, group.len());
        check_layout(rank, kind, group, layout, chunk, buf.len())?;
        let me = group.index_of(rank).ok_or_else(|| {
            CommError::InvalidGroup(format!(
                "rank {rank}: {} does not include the calling rank",
                describe_op(kind, group.ranks())
            ))
        })?;
        let mut mine = Vec::with_capacity(chunk);
        layout.for_each_run(n, chunk, me, 0..chunk, |_, at, len| {
            mine.extend_from_slice(&buf[at..at + len]);
        });
        let all = self.all_gather(group, &mine)?;
        if all.len() != n * chunk {
            return Err(CommError::Internal(format!(
                "rank {rank}: {} returned {} elements, expected {n} × {chunk}",
                describe_op(kind, group.ranks()),
                all.len()
            )));
        }
        for (m, theirs) in all.chunks_exact(chunk.max(1)).enumerate() {
            layout.for_each_run(n, chunk, m, 0..chunk, |j, at, len| {
                buf[at..at + len].copy_from_slice(&theirs[j..j + len]);
            });
        }
        Ok(())
    }

    /// Member k gets chunk k of the element-wise sum. `data.len()` must divide by the group
    /// size and be the same on every member.
    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// [`Communicator::reduce_scatter_sum`] of a `data` whose chunks are laid out by `layout`
    /// (which must fit the chunk length and be the same on every member).
    fn reduce_scatter_sum_strided(
        &mut self,
        group: &Group,
        data: &[f32],
        layout: ChunkLayout,
    ) -> Result<Vec<f32>> {
        let n = group.len();
        if layout == ChunkLayout::CONTIGUOUS || !data.len().is_multiple_of(n) {
            // A bad length is for the plain call to report.
            return self.reduce_scatter_sum(group, data);
        }
        let kind = CollectiveKind::ReduceScatter;
        check_layout(self.rank(), kind, group, layout, data.len() / n, data.len())?;
        self.reduce_scatter_sum(group, &relayout(data, n, layout, ChunkLayout::CONTIGUOUS))
    }

    /// `data` is split into group-size equal chunks; member k receives chunk k of every member,
    /// concatenated in group order (a transpose of chunks).
    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// [`Communicator::all_to_all`] of a `data` whose chunks are laid out by `input`, with the
    /// result laid out by `output` (chunk k of the result comes from member k). Both must fit
    /// the chunk length and be the same on every member.
    fn all_to_all_strided(
        &mut self,
        group: &Group,
        data: &[f32],
        input: ChunkLayout,
        output: ChunkLayout,
    ) -> Result<Vec<f32>> {
        let n = group.len();
        if !data.len().is_multiple_of(n) {
            // A bad length is for the plain call to report.
            return self.all_to_all(group, data);
        }
        let kind = CollectiveKind::AllToAll;
        check_layout(self.rank(), kind, group, input, data.len() / n, data.len())?;
        check_layout(self.rank(), kind, group, output, data.len() / n, data.len())?;
        let received = if input == ChunkLayout::CONTIGUOUS {
            self.all_to_all(group, data)?
        } else {
            self.all_to_all(group, &relayout(data, n, input, ChunkLayout::CONTIGUOUS))?
        };
        if output == ChunkLayout::CONTIGUOUS {
            return Ok(received);
        }
        Ok(relayout(&received, n, ChunkLayout::CONTIGUOUS, output))
    }

    /// The `data` of `root` (a global rank, member of the group), on every member. Non-root
    /// inputs are ignored and may be empty.
    fn broadcast(&mut self, group: &Group, root: usize, data: &[f32]) -> Result<Vec<f32>>;

    /// Queues `data` for rank `to`; does not wait for the receiver. FIFO per (from, to) pair.
    /// The same as [`Communicator::send_tagged`] with tag 0.
    fn send(&mut self, to: usize, data: &[f32]) -> Result<()>;

    /// The oldest message from rank `from` not yet received, waiting for one if needed. The
    /// same as [`Communicator::recv_tagged`] with tag 0.
    fn recv(&mut self, from: usize) -> Result<Vec<f32>>;

    /// Queues `data` for rank `to` under `tag` (at most [`MAX_TAG`]); does not wait for the
    /// receiver. Messages with the same (from, to, tag) arrive in send order; each tag is its
    /// own stream, so one pair of ranks can carry several (a pipeline's activations of
    /// different stage boundaries, its gradients) whose orders differ between the two sides.
    /// Tag 0 is the stream of [`Communicator::send`] / [`Communicator::recv`]. A tag above
    /// [`MAX_TAG`] is refused with [`CommError::InvalidArgument`] by every backend.
    ///
    /// The default implementation serves tag 0 through [`Communicator::send`] and refuses any
    /// other tag (for a wrapper that forwards only the untagged calls); the backends of this
    /// crate implement every tag.
    fn send_tagged(&mut self, to: usize, tag: u32, data: &[f32]) -> Result<()> {
        match tag {
            0 => self.send(to, data),
            _ => Err(untagged_only(self.rank(), CollectiveKind::Send, to, tag)),
        }
    }

    /// The oldest message from rank `from` with `tag` not yet received, waiting for one if
    /// needed. A message with another tag never blocks it, however long it has been queued.
    /// A timeout names the peer and the tag. See [`Communicator::send_tagged`].
    fn recv_tagged(&mut self, from: usize, tag: u32) -> Result<Vec<f32>> {
        match tag {
            0 => self.recv(from),
            _ => Err(untagged_only(self.rank(), CollectiveKind::Recv, from, tag)),
        }
    }

    /// Returns once every member has called it.
    fn barrier(&mut self, group: &Group) -> Result<()>;

    /// This rank's traffic so far (successful calls only).
    fn stats(&self) -> CommStats;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(layout: ChunkLayout, n: usize, c: usize, k: usize, r: Range<usize>) -> Vec<[usize; 3]> {
        let mut out = Vec::new();
        layout.for_each_run(n, c, k, r, |j, at, len| out.push([j, at, len]));
        out
    }

    #[test]
    fn runs_follow_the_interleaved_layout() {
        // 3 members, chunks of 6 in 2 blocks of 3: buffer [2, 3, 3]; member 1 holds 3..6, 12..15.
        let l = ChunkLayout::interleaved(2);
        assert_eq!(runs(l, 3, 6, 1, 0..6), vec![[0, 3, 3], [3, 12, 3]]);
        assert_eq!(runs(l, 3, 6, 1, 2..5), vec![[2, 5, 1], [3, 12, 2]]);
        assert_eq!(runs(l, 3, 6, 2, 4..4), Vec::<[usize; 3]>::new());
        assert_eq!(runs(ChunkLayout::CONTIGUOUS, 3, 6, 2, 1..5), vec![[1, 13, 4]]);
        assert_eq!(l.span(3, 6), Some(18));
        assert_eq!(l.span(3, 0), Some(0));
        assert_eq!(l.span(3, 5), None);
        assert_eq!(ChunkLayout::interleaved(0).span(3, 4), None);
        // Inside a larger buffer: blocks 20 apart from element 2 on.
        let p = ChunkLayout::placed(2, 20, 2);
        assert_eq!(runs(p, 3, 6, 1, 0..6), vec![[0, 5, 3], [3, 25, 3]]);
        assert_eq!(p.span(3, 6), Some(31));
        assert_eq!(ChunkLayout::placed(2, 8, 0).span(3, 6), None, "blocks would overlap");
        assert!(l.is_packed() && !p.is_packed() && l.outer() == 2);
    }

    #[test]
    fn chunks_sum_in_member_order() {
        assert_eq!(sum_chunks(&[1.0, 2.0, 10.0, 20.0, 100.0, 200.0], 3), vec![111.0, 222.0]);
        assert_eq!(sum_chunks(&[], 3), Vec::<f32>::new());
        // Order matters for rounding: (1e8 + 1) - 1e8 is 0 in f32, whereas 1e8 - 1e8 + 1 is 1.
        assert_eq!(sum_chunks(&[1e8, 1.0, -1e8], 3), vec![0.0]);
    }

    #[test]
    fn relayout_round_trips() {
        let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let (a, b) = (ChunkLayout::interleaved(4), ChunkLayout::interleaved(2));
        let there = relayout(&data, 3, ChunkLayout::CONTIGUOUS, a);
        // Member 0's chunk (0..8) in 4 blocks of 2, each followed by members 1 and 2's blocks.
        assert_eq!(&there[..8], &[0.0, 1.0, 8.0, 9.0, 16.0, 17.0, 2.0, 3.0]);
        let via = relayout(&there, 3, a, b);
        assert_eq!(relayout(&via, 3, b, ChunkLayout::CONTIGUOUS), data);
    }
}
