//! What a copy of many blocks is, in O(blocks): one pattern of pieces (a block's spans, source
//! and destination side by side) and one shift per block pair. Layouts place every block at
//! one stride from the last ([`crate::layout::LayoutViews::block_pattern`]), so block `i`'s
//! copies are the pattern moved by `(src_shift[i], dst_shift[i])`; the gather kernel runs it as
//! it is, the memcpy and CPU engines walk the runs it merges into.
//!
//! Also here: the choice of engine, and the claims that refuse two copies in flight into the
//! same destination bytes.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{GatherPiece, GatherShift, MemoryKind};
use crate::error::{Error, Result};

/// Largest piece of a kernel task (a warp's work item): pieces are split to at most this.
pub(crate) const MAX_PIECE: u64 = 64 << 10;
/// Smallest piece size the split goes down to when a copy is small (more tasks than bytes
/// would only add overhead).
const MIN_PIECE: u64 = 4 << 10;
/// Tasks a kernel launch should have at least, where the bytes allow: about four per warp of
/// one resident wave on an H100 (4224 warps), so the warps stay balanced to the end.
const TARGET_TASKS: u64 = 16384;

/// Copies the memcpy engine takes when the move is small ([`MEMCPY_MAX_BYTES`]): below it
/// one `cuMemcpyAsync` each costs less than the kernel's fixed cost (a descriptor upload
/// and a launch).
pub(crate) const MEMCPY_ALWAYS: u64 = 4;
/// Moves above this go to the kernel whatever their copy count. On the H100 (`gpu-bench p2p`,
/// engines forced, same runs) the kernel wrote 1 GiB into a layout at 1324-1352 GB/s where
/// `cuMemcpyAsync` reached 1143-1266 GB/s, and one `cuMemcpyDtoDAsync` of 256 MiB between
/// chunked VMM ranges took 128-265 µs of host time (the driver walks the mappings under both
/// ranges) where the whole kernel path took 13-60 µs.
pub(crate) const MEMCPY_MAX_BYTES: u64 = 4 << 20;

/// How the bytes of a copy move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyEngine {
    /// The CPU copies (host memory), before the call returns.
    Cpu,
    /// One `cuMemcpyAsync` per merged run (submitted as a batch where the driver has
    /// `cuMemcpyBatchAsync` and the stream is not the legacy one).
    Memcpy,
    /// One launch of the gather kernel for all blocks (pattern and per-block shifts uploaded
    /// in stream order).
    Kernel,
}

impl std::fmt::Display for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyEngine::Cpu => "cpu",
            CopyEngine::Memcpy => "memcpy",
            CopyEngine::Kernel => "kernel",
        })
    }
}

/// Which engine a copy may use ([`crate::p2p::ImportedGrant::copy_into_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineChoice {
    /// Merged runs go to `cuMemcpyAsync` when they are few (4 or fewer) and the move is at
    /// most 4 MiB; everything else to the gather kernel (falling back to memcpy where the
    /// kernel cannot be loaded). Host memory: the CPU.
    #[default]
    Auto,
    /// Always one `cuMemcpyAsync` per merged run.
    Memcpy,
    /// Always the gather kernel; an error where it cannot run (nothing is copied then).
    Kernel,
}

/// The engine for a move of `bytes` bytes in all made of `copies()` merged copies. The copies
/// are counted (a pass over the blocks) only where the choice depends on them: a small move on
/// [`EngineChoice::Auto`].
pub(crate) fn choose(
    memory: MemoryKind,
    choice: EngineChoice,
    bytes: u64,
    copies: impl FnOnce() -> u64,
) -> CopyEngine {
    if memory == MemoryKind::Host {
        return CopyEngine::Cpu;
    }
    match choice {
        EngineChoice::Memcpy => CopyEngine::Memcpy,
        EngineChoice::Kernel => CopyEngine::Kernel,
        EngineChoice::Auto => {
            if bytes <= MEMCPY_MAX_BYTES && copies() <= MEMCPY_ALWAYS {
                CopyEngine::Memcpy
            } else {
                CopyEngine::Kernel
            }
        }
    }
}

/// Pair a source pattern (`(offset, len)` per span) with a destination pattern (`(addr, len)`
/// per span) into pieces, merging neighbours that continue on both sides. Spans that do not
/// pair up (another count, another length) are a [`Error::LayoutMismatch`] with the numbers.
pub(crate) fn pair_pattern(src: &[(u64, u64)], dst: &[(u64, u64)]) -> Result<Vec<GatherPiece>> {
    if src.len() != dst.len() {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "a granted block has {} spans, a destination block {}",
                src.len(),
                dst.len()
            ),
        });
    }
    let mut out: Vec<GatherPiece> = Vec::with_capacity(src.len());
    for (k, (&(s, sl), &(d, dl))) in src.iter().zip(dst).enumerate() {
        if sl != dl {
            return Err(Error::LayoutMismatch {
                detail: format!(
                    "span {k} of a block is {sl} bytes in the grant and {dl} bytes here"
                ),
            });
        }
        if sl == 0 {
            continue;
        }
        match out.last_mut() {
            Some(p)
                if p.src.checked_add(p.len) == Some(s) && p.dst.checked_add(p.len) == Some(d) =>
            {
                p.len += sl
            }
            _ => out.push(GatherPiece {
                src: s,
                dst: d,
                len: sl,
            }),
        }
    }
    Ok(out)
}

/// A copy of many blocks: the pattern and one shift per block pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The pattern, neighbours merged (not split).
    pub(crate) pieces: Vec<GatherPiece>,
    /// Per block pair, in the order given.
    pub(crate) shifts: Vec<GatherShift>,
    /// Distance between consecutive blocks on each side.
    pub(crate) src_stride: u64,
    pub(crate) dst_stride: u64,
}

impl Plan {
    /// Bytes the pattern moves per block.
    pub(crate) fn block_bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Whether piece k of block pair i and of pair i + 1 continue each other when both sides
    /// move by one stride (every piece is exactly one stride long on both sides).
    fn runs_merge(&self) -> bool {
        self.pieces
            .iter()
            .all(|p| p.len == self.src_stride && p.len == self.dst_stride)
    }

    /// Runs of block pairs that continue each other on both sides, as `(first, count)`.
    pub(crate) fn runs(&self) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        if !self.runs_merge() {
            return (0..self.shifts.len()).map(|i| (i, 1)).collect();
        }
        for (i, h) in self.shifts.iter().enumerate() {
            match out.last_mut() {
                Some((first, n))
                    if {
                        let last = self.shifts[*first + *n - 1];
                        last.src.wrapping_add(self.src_stride) == h.src
                            && last.dst.wrapping_add(self.dst_stride) == h.dst
                    } =>
                {
                    *n += 1
                }
                _ => out.push((i, 1)),
            }
        }
        out
    }

    /// Contiguous copies after merging runs: what the memcpy engine issues (the tests check
    /// [`Plan::count_copies`] against it).
    #[cfg(test)]
    pub(crate) fn copies(&self, runs: &[(usize, usize)]) -> u64 {
        runs.len() as u64 * self.pieces.len() as u64
    }

    /// [`Plan::copies`] without building the runs (the kernel never needs them).
    pub(crate) fn count_copies(&self) -> u64 {
        let runs = if self.runs_merge() {
            1 + self
                .shifts
                .windows(2)
                .filter(|w| {
                    w[0].src.wrapping_add(self.src_stride) != w[1].src
                        || w[0].dst.wrapping_add(self.dst_stride) != w[1].dst
                })
                .count() as u64
        } else {
            self.shifts.len() as u64
        };
        if self.shifts.is_empty() {
            return 0;
        }
        runs * self.pieces.len() as u64
    }

    /// Every merged copy `(dst, src, len)`, run by run, piece by piece.
    pub(crate) fn for_each_copy(&self, runs: &[(usize, usize)], mut f: impl FnMut(u64, u64, u64)) {
        for &(first, n) in runs {
            let h = self.shifts[first];
            for p in &self.pieces {
                f(
                    h.dst.wrapping_add(p.dst),
                    h.src.wrapping_add(p.src),
                    p.len * n as u64,
                );
            }
        }
    }

    /// The pattern split for the kernel: pieces of at most `piece` bytes.
    pub(crate) fn split(&self, piece: u64) -> Vec<GatherPiece> {
        let piece = piece.max(1);
        let mut out = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            let mut at = 0;
            while at < p.len {
                let len = piece.min(p.len - at);
                out.push(GatherPiece {
                    src: p.src.wrapping_add(at),
                    dst: p.dst.wrapping_add(at),
                    len,
                });
                at += len;
            }
        }
        out
    }

    /// The piece size for the kernel: [`MAX_PIECE`], smaller when the copy is too small to
    /// give every warp a task ([`TARGET_TASKS`]), never below [`MIN_PIECE`]; a power of two, so
    /// pieces keep their start's alignment.
    pub(crate) fn piece_size(bytes: u64) -> u64 {
        (bytes / TARGET_TASKS)
            .checked_next_power_of_two()
            .unwrap_or(MAX_PIECE)
            .clamp(MIN_PIECE, MAX_PIECE)
    }
}

/// Destination bytes some copy is writing now. Two copies into overlapping bytes at once would
/// race; the second is refused. A leaf lock: bookkeeping only, never held across a driver call.
static CLAIMS: Mutex<Claims> = Mutex::new(Claims {
    next: 0,
    live: Vec::new(),
});

struct Claims {
    next: u64,
    live: Vec<(u64, Claim)>,
}

/// What one copy writes.
#[derive(Debug)]
pub(crate) enum Claim {
    /// Every byte of `[lo, hi)`.
    Range { lo: u64, hi: u64 },
    /// Blocks of one layout: block `b`'s bytes are `pattern` (addresses of block 0's views)
    /// moved by `b * stride`; `set` is a bitmap of the blocks over `num_blocks`.
    Blocks {
        pattern: Arc<[(u64, u64)]>,
        stride: u64,
        set: Vec<u64>,
        num_blocks: usize,
        /// Bounds of every byte written.
        lo: u64,
        hi: u64,
    },
}

impl Claim {
    /// The blocks `blocks` (each below `num_blocks`, none twice: the caller checked) of a
    /// layout with this pattern and stride.
    pub(crate) fn blocks(
        pattern: Arc<[(u64, u64)]>,
        stride: u64,
        num_blocks: usize,
        set: Vec<u64>,
        (first, last): (usize, usize),
    ) -> Claim {
        let lo = pattern.iter().map(|v| v.0).min().unwrap_or(0) + first as u64 * stride;
        let hi = pattern.iter().map(|v| v.0 + v.1).max().unwrap_or(0) + last as u64 * stride;
        Claim::Blocks {
            pattern,
            stride,
            set,
            num_blocks,
            lo,
            hi,
        }
    }

    fn bounds(&self) -> (u64, u64) {
        match *self {
            Claim::Range { lo, hi } | Claim::Blocks { lo, hi, .. } => (lo, hi),
        }
    }

    /// Whether this claim writes any byte of `[lo, hi)`.
    fn hits(&self, lo: u64, hi: u64) -> bool {
        let (a, b) = self.bounds();
        if hi <= a || b <= lo {
            return false;
        }
        match self {
            Claim::Range { .. } => true,
            Claim::Blocks {
                pattern,
                stride,
                set,
                num_blocks,
                ..
            } => pattern.iter().any(|&(at, len)| {
                // Blocks whose copy of this view meets [lo, hi): at + b*stride < hi and
                // at + b*stride + len > lo.
                let first = match lo.checked_sub(at + len) {
                    None => 0,
                    Some(d) => d / stride + 1,
                };
                let end = match hi.checked_sub(at) {
                    None | Some(0) => 0,
                    Some(d) => d.div_ceil(*stride),
                };
                let end = end.min(*num_blocks as u64);
                first < end && any_bit(set, first as usize, end as usize)
            }),
        }
    }

    /// Whether the two claims write a byte in common.
    fn overlaps(&self, other: &Claim) -> bool {
        let ((a, b), (c, d)) = (self.bounds(), other.bounds());
        if b <= c || d <= a {
            return false;
        }
        match (self, other) {
            (Claim::Range { lo, hi }, o) | (o, Claim::Range { lo, hi }) => o.hits(*lo, *hi),
            (
                Claim::Blocks {
                    pattern: p,
                    stride: s,
                    set: x,
                    ..
                },
                Claim::Blocks {
                    pattern: q,
                    stride: t,
                    set: y,
                    ..
                },
            ) if s == t && (Arc::ptr_eq(p, q) || p[..] == q[..]) => {
                // One layout: distinct blocks never share a byte.
                x.iter().zip(y).any(|(a, b)| a & b != 0)
            }
            (
                Claim::Blocks {
                    pattern,
                    stride,
                    set,
                    ..
                },
                o,
            ) => {
                // Different layouts whose bounds meet (not two elastic layouts, which never
                // share addresses): view by view.
                ones(set).any(|b| {
                    pattern.iter().any(|&(at, len)| {
                        let lo = at + b as u64 * stride;
                        o.hits(lo, lo + len)
                    })
                })
            }
        }
    }
}

/// Whether any of the bits `first..end` is set (word by word).
fn any_bit(set: &[u64], first: usize, end: usize) -> bool {
    let mut b = first;
    while b < end {
        let (w, off) = (b / 64, b % 64);
        let take = (64 - off).min(end - b);
        let mask = if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << off
        };
        if set.get(w).is_some_and(|x| x & mask != 0) {
            return true;
        }
        b += take;
    }
    false
}

fn ones(set: &[u64]) -> impl Iterator<Item = usize> + '_ {
    set.iter().enumerate().flat_map(|(i, &w)| {
        (0..64)
            .filter(move |j| w & (1 << j) != 0)
            .map(move |j| i * 64 + j)
    })
}

/// A bitmap of `blocks` over `num_blocks`, with the smallest and largest: a block out of range
/// or listed twice is an error naming it.
pub(crate) fn block_set(blocks: &[usize], num_blocks: usize) -> Result<(Vec<u64>, (usize, usize))> {
    let mut set = vec![0u64; num_blocks.div_ceil(64)];
    // 64 blocks at a time: a chunk of consecutive blocks (the common case) goes in as whole
    // words, the others block by block.
    for chunk in blocks.chunks(64) {
        let (a, z) = (chunk[0], chunk[chunk.len() - 1]);
        // Ends `len - 1` apart, in range, and each one more than the last: every block from
        // `a` to `z`, each once. Bit operations over the whole chunk rather than a loop that
        // stops early: they vectorize.
        let run = a <= z
            && z - a == chunk.len() - 1
            && z < num_blocks
            && chunk
                .iter()
                .zip(&chunk[1..])
                .fold(0, |off, (x, y)| off | (y.wrapping_sub(*x) ^ 1))
                == 0;
        if run {
            // At most two words. A bit set already is a block listed before this chunk; the
            // lowest such comes first in it.
            for (w, word) in (a / 64..).zip(&mut set[a / 64..=z / 64]) {
                let lo = (w * 64).max(a) % 64;
                let hi = (w * 64 + 63).min(z) % 64;
                let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
                if *word & mask != 0 {
                    let b = w * 64 + (*word & mask).trailing_zeros() as usize;
                    return Err(Error::InvalidArgument(format!(
                        "destination block {b} is listed twice"
                    )));
                }
                *word |= mask;
            }
            continue;
        }
        for &b in chunk {
            if b >= num_blocks {
                return Err(Error::InvalidArgument(format!(
                    "destination block {b} does not exist: the layout has {num_blocks} blocks"
                )));
            }
            let (w, bit) = (b / 64, 1u64 << (b % 64));
            if set[w] & bit != 0 {
                return Err(Error::InvalidArgument(format!(
                    "destination block {b} is listed twice"
                )));
            }
            set[w] |= bit;
        }
    }
    // The smallest and largest from the bitmap, not block by block: the loop above stays lean.
    let lowest = set.iter().position(|&w| w != 0);
    let highest = set.iter().rposition(|&w| w != 0);
    let bounds = match (lowest, highest) {
        (Some(i), Some(j)) => (
            i * 64 + set[i].trailing_zeros() as usize,
            j * 64 + 63 - set[j].leading_zeros() as usize,
        ),
        _ => (0, 0),
    };
    Ok((set, bounds))
}

/// A claim held in [`CLAIMS`] until dropped.
pub(crate) struct WriteClaim {
    id: u64,
}

impl WriteClaim {
    /// Claim `claim`'s bytes, or refuse with the bounds of both claims when a copy in flight
    /// writes any of them.
    pub(crate) fn take(claim: Claim) -> Result<WriteClaim> {
        let mut c = CLAIMS.lock();
        if let Some((_, other)) = c.live.iter().find(|(_, o)| o.overlaps(&claim)) {
            let ((a, b), (x, y)) = (claim.bounds(), other.bounds());
            return Err(Error::InvalidArgument(format!(
                "destination bytes within [{a:#x}, {b:#x}) overlap bytes within [{x:#x}, {y:#x}) that another p2p copy is writing: wait for its completion first"
            )));
        }
        let id = c.next;
        c.next += 1;
        c.live.push((id, claim));
        Ok(WriteClaim { id })
    }
}

impl Drop for WriteClaim {
    fn drop(&mut self) {
        let mut c = CLAIMS.lock();
        if let Some(i) = c.live.iter().position(|(id, _)| *id == self.id) {
            c.live.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(src: u64, dst: u64, len: u64) -> GatherPiece {
        GatherPiece { src, dst, len }
    }

    #[test]
    fn patterns_pair_and_merge_neighbours() {
        let p = pair_pattern(
            &[(0, 8), (8, 8), (100, 4)],
            &[(1000, 8), (1008, 8), (2000, 4)],
        )
        .unwrap();
        assert_eq!(p, vec![piece(0, 1000, 16), piece(100, 2000, 4)]);
        // Continuing on one side only: not merged.
        let p = pair_pattern(&[(0, 8), (8, 8)], &[(1000, 8), (1016, 8)]).unwrap();
        assert_eq!(p.len(), 2);
        let e = pair_pattern(&[(0, 8)], &[(0, 8), (8, 8)]).unwrap_err();
        assert!(matches!(e, Error::LayoutMismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("1 spans") && e.to_string().contains('2'),
            "{e}"
        );
        let e = pair_pattern(&[(0, 8)], &[(0, 9)]).unwrap_err();
        assert!(
            e.to_string().contains("8 bytes") && e.to_string().contains("9 bytes"),
            "{e}"
        );
    }

    fn plan(pieces: Vec<GatherPiece>, pairs: &[(u64, u64)], stride: u64) -> Plan {
        Plan {
            pieces,
            shifts: pairs
                .iter()
                .map(|&(s, d)| GatherShift {
                    src: s * stride,
                    dst: d * stride,
                })
                .collect(),
            src_stride: stride,
            dst_stride: stride,
        }
    }

    #[test]
    fn runs_merge_only_when_pieces_are_one_stride() {
        // Fully contiguous: one piece of a whole block; 3, 4, 5 -> 0, 1, 2 is one run.
        let p = plan(
            vec![piece(0, 1 << 40, 64)],
            &[(3, 0), (4, 1), (5, 2), (10, 7), (40, 8), (63, 15)],
            64,
        );
        let runs = p.runs();
        assert_eq!(runs, vec![(0, 3), (3, 1), (4, 1), (5, 1)]);
        assert_eq!(p.copies(&runs), 4);
        assert_eq!(p.count_copies(), 4);
        let mut copies = Vec::new();
        p.for_each_copy(&runs, |d, s, l| copies.push((d, s, l)));
        assert_eq!(copies[0], (1 << 40, 3 * 64, 3 * 64));
        assert_eq!(copies[3], ((1 << 40) + 15 * 64, 63 * 64, 64));
        // Pieces shorter than the stride (a packed destination of a layer-separate grant):
        // block by block.
        let p = plan(
            vec![piece(0, 0, 16), piece(1000, 16, 16)],
            &[(0, 0), (1, 1)],
            64,
        );
        assert_eq!(p.runs(), vec![(0, 1), (1, 1)]);
        assert_eq!(p.copies(&p.runs()), 4);
        assert_eq!(p.count_copies(), 4);
        // Merging pieces: a run breaks where either side jumps.
        let p = plan(
            vec![piece(0, 0, 64)],
            &[(0, 0), (1, 1), (2, 5), (3, 6), (9, 7)],
            64,
        );
        assert_eq!(p.count_copies(), p.copies(&p.runs()));
        assert_eq!(p.count_copies(), 3);
        assert_eq!(plan(vec![piece(0, 0, 64)], &[], 64).count_copies(), 0);
    }

    #[test]
    fn pieces_split_at_the_limit_keeping_alignment() {
        let p = plan(
            vec![piece(3, 5, 2 * MAX_PIECE + 17), piece(1 << 30, 7, 1)],
            &[(0, 0)],
            1 << 31,
        );
        let s = p.split(MAX_PIECE);
        assert_eq!(
            s,
            vec![
                piece(3, 5, MAX_PIECE),
                piece(3 + MAX_PIECE, 5 + MAX_PIECE, MAX_PIECE),
                piece(3 + 2 * MAX_PIECE, 5 + 2 * MAX_PIECE, 17),
                piece(1 << 30, 7, 1),
            ]
        );
        assert_eq!(s.iter().map(|p| p.len).sum::<u64>(), p.block_bytes());
        assert_eq!(Plan::piece_size(1 << 30), MAX_PIECE);
        assert_eq!(Plan::piece_size(256 << 20), 16 << 10);
        assert_eq!(Plan::piece_size(64 << 10), MIN_PIECE);
        assert_eq!(Plan::piece_size(0), MIN_PIECE);
        assert_eq!(Plan::piece_size(64 << 20), MIN_PIECE);
        assert!(Plan::piece_size(u64::MAX) <= MAX_PIECE);
    }

    #[test]
    fn engine_policy() {
        use CopyEngine::*;
        let auto = EngineChoice::Auto;
        assert_eq!(
            choose(MemoryKind::Host, EngineChoice::Kernel, 1 << 30, || 1000),
            Cpu
        );
        // Large moves: the kernel, whatever the copy count.
        assert_eq!(choose(MemoryKind::Device, auto, 1 << 30, || 1), Kernel);
        assert_eq!(choose(MemoryKind::Device, auto, 1 << 30, || 32), Kernel);
        // Small moves in few copies: memcpy.
        assert_eq!(choose(MemoryKind::Device, auto, 4096, || 4), Memcpy);
        assert_eq!(choose(MemoryKind::Device, auto, 4 << 20, || 1), Memcpy);
        assert_eq!(choose(MemoryKind::Device, auto, 1 << 20, || 5), Kernel);
        assert_eq!(
            choose(MemoryKind::Device, auto, (4 << 20) + 1, || 1),
            Kernel
        );
        assert_eq!(choose(MemoryKind::Device, auto, 256 << 20, || 1), Kernel);
        assert_eq!(
            choose(MemoryKind::Device, auto, 256 << 20, || 262_144),
            Kernel
        );
        assert_eq!(
            choose(MemoryKind::Device, EngineChoice::Memcpy, 1, || 262_144),
            Memcpy
        );
        assert_eq!(
            choose(MemoryKind::Device, EngineChoice::Kernel, 1 << 30, || 1),
            Kernel
        );
        // The copies are counted only where the choice depends on them.
        let uncounted = || -> u64 { panic!("copies counted for a choice made without them") };
        assert_eq!(choose(MemoryKind::Device, auto, 1 << 30, uncounted), Kernel);
        let kernel = EngineChoice::Kernel;
        assert_eq!(choose(MemoryKind::Device, kernel, 1, uncounted), Kernel);
        let memcpy = EngineChoice::Memcpy;
        assert_eq!(choose(MemoryKind::Device, memcpy, 1, uncounted), Memcpy);
        assert_eq!(choose(MemoryKind::Host, auto, 1, uncounted), Cpu);
    }

    #[test]
    fn block_sets_refuse_duplicates_and_strangers() {
        let (set, bounds) = block_set(&[3, 64, 65], 100).unwrap();
        assert_eq!(set, vec![1 << 3, 0b11]);
        assert_eq!(bounds, (3, 65));
        let e = block_set(&[1, 2, 1], 10).unwrap_err().to_string();
        assert!(e.contains("block 1 is listed twice"), "{e}");
        let e = block_set(&[10], 10).unwrap_err().to_string();
        assert!(
            e.contains("block 10 does not exist") && e.contains("10 blocks"),
            "{e}"
        );
        // Steps of one that wrap past the largest index are no run of blocks.
        let e = block_set(&[usize::MAX, 0], 10).unwrap_err().to_string();
        assert!(
            e.contains(&format!("block {} does not exist", usize::MAX)),
            "{e}"
        );
    }

    /// The bitmap, bounds and first error as a block-by-block walk gives them, for lists of runs
    /// (whole chunks of 64 and pieces), scattered blocks, repeats and strangers.
    #[test]
    fn block_sets_match_a_block_by_block_walk() {
        fn walk(
            blocks: &[usize],
            n: usize,
        ) -> std::result::Result<(Vec<u64>, (usize, usize)), String> {
            let mut set = vec![0u64; n.div_ceil(64)];
            let (mut first, mut last) = (usize::MAX, 0);
            for &b in blocks {
                if b >= n {
                    return Err(format!(
                        "destination block {b} does not exist: the layout has {n} blocks"
                    ));
                }
                if set[b / 64] & (1 << (b % 64)) != 0 {
                    return Err(format!("destination block {b} is listed twice"));
                }
                set[b / 64] |= 1 << (b % 64);
                first = first.min(b);
                last = last.max(b);
            }
            Ok((set, (first.min(last), last)))
        }
        let mut seed = 5u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        for round in 0..3000 {
            let n = 1 + next(700) as usize;
            let mut blocks = Vec::new();
            for _ in 0..next(6) {
                let at = next(n as u64) as usize;
                match next(4) {
                    0 => blocks.extend((at..n).take(next(200) as usize)),
                    1 => blocks.extend((0..next(40)).map(|_| next(n as u64) as usize)),
                    2 => blocks.extend((at..n).take(64)),
                    _ => blocks.push(at),
                }
            }
            if next(5) == 0 {
                let i = next(blocks.len() as u64 + 1) as usize;
                blocks.insert(i, n + next(3) as usize);
            }
            let got = block_set(&blocks, n).map_err(|e| match e {
                Error::InvalidArgument(m) => m,
                other => panic!("{other:?}"),
            });
            assert_eq!(got, walk(&blocks, n), "round {round}: {blocks:?} of {n}");
        }
    }

    fn blocks(pattern: &Arc<[(u64, u64)]>, stride: u64, nb: usize, b: &[usize]) -> Claim {
        let (set, bounds) = block_set(b, nb).unwrap();
        Claim::blocks(pattern.clone(), stride, nb, set, bounds)
    }

    #[test]
    fn claims_conflict_exactly_on_shared_bytes() {
        // A layer-separate layout: 2 regions of 16 blocks of 64 bytes, at 0x10000 and 0x20000.
        let pattern: Arc<[(u64, u64)]> = Arc::from(vec![(0x10000, 64), (0x20000, 64)]);
        let a = blocks(&pattern, 64, 16, &[0, 1, 2]);
        let b = blocks(&pattern, 64, 16, &[3, 15]);
        let c = blocks(&pattern, 64, 16, &[2]);
        assert!(!a.overlaps(&b) && !b.overlaps(&a));
        assert!(a.overlaps(&c) && c.overlaps(&a));
        // A range between block 2's and block 3's views in region 1 touches neither.
        let gap = Claim::Range {
            lo: 0x10000 + 3 * 64,
            hi: 0x10000 + 3 * 64 + 1,
        };
        assert!(!a.overlaps(&gap) && !gap.overlaps(&a));
        assert!(b.overlaps(&gap) && gap.overlaps(&b));
        // One byte at the end of block 2 in region 2.
        let end = Claim::Range {
            lo: 0x20000 + 3 * 64 - 1,
            hi: 0x20000 + 3 * 64,
        };
        assert!(a.overlaps(&end) && !b.overlaps(&end));
        // Ranges: half-open.
        let r = Claim::Range { lo: 0, hi: 10 };
        assert!(!r.overlaps(&Claim::Range { lo: 10, hi: 20 }));
        assert!(r.overlaps(&Claim::Range { lo: 9, hi: 20 }));
        // Another layout (same stride, other pattern) over the same bytes: view by view.
        let moved: Arc<[(u64, u64)]> = Arc::from(vec![(0x10000 + 64, 64)]);
        // Its block 3 lies where block 4 of the first does; its block 0 where block 1 does.
        let d = blocks(&moved, 64, 16, &[3]);
        assert!(!a.overlaps(&d) && !d.overlaps(&a), "{:?}", d.bounds());
        let e = blocks(&moved, 64, 16, &[0]);
        assert!(a.overlaps(&e) && e.overlaps(&a));
    }

    #[test]
    fn a_claim_is_refused_while_another_holds_the_bytes() {
        let base = 0x7777_0000_0000;
        let first = WriteClaim::take(Claim::Range {
            lo: base,
            hi: base + 100,
        })
        .unwrap();
        let e = WriteClaim::take(Claim::Range {
            lo: base + 99,
            hi: base + 200,
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("another p2p copy"), "{e}");
        let beside = WriteClaim::take(Claim::Range {
            lo: base + 100,
            hi: base + 200,
        })
        .unwrap();
        drop(first);
        let again = WriteClaim::take(Claim::Range {
            lo: base,
            hi: base + 100,
        })
        .unwrap();
        drop((beside, again));
    }
}
