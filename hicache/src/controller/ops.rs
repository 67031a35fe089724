//! The operations the controller queues and reports, and how their page pairs merge into runs.

use std::sync::Arc;

use radixkv_radix::PageId;

use crate::backend::PageRun;

/// Name of a pool an operation moves.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolName {
    /// The full-attention KV pool (the primary pool; always present).
    Kv,
    /// Mamba / SSM state checkpoints (one slot per checkpoint).
    Mamba,
    /// Sliding-window KV.
    Swa,
    /// A sparse-attention indexer cache.
    Indexer,
    /// A draft model's KV (speculative decoding).
    Draft,
}

/// Who allocates the device-side slots of an extra pool.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum SlotOwner {
    /// The controller: a load allocates the target slots from its own allocator.
    #[default]
    Controller,
    /// The caller, which keeps its own allocator for the device slots (a cache whose tree owns
    /// the Mamba state pool): a load names the target slots in
    /// [`PoolTransfer::device_indices`], and the controller allocates only host slots.
    Caller,
}

/// Sizes of an extra pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ExtraPoolSpec {
    /// Which pool.
    pub name: PoolName,
    /// Host slots.
    pub host_slots: u32,
    /// Device slots.
    pub device_slots: u32,
    /// Bytes of one slot (one Mamba state checkpoint, one SWA page, ...).
    pub item_bytes: usize,
    /// Who allocates the device slots.
    pub device_owner: SlotOwner,
}

/// Indices of one extra pool moved by an operation. For `write` the caller fills
/// `device_indices` and the controller allocates `host_indices`; for `load` the reverse, except
/// for a pool whose device slots the caller owns ([`SlotOwner::Caller`]): there a load names both
/// (the host slots it reads and the device slots it writes, pairwise).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolTransfer {
    /// Which pool.
    pub name: PoolName,
    /// Host slots.
    pub host_indices: Vec<u32>,
    /// Device slots.
    pub device_indices: Vec<u32>,
}

/// Identifier of a queued operation, reported back in [`Acks`].
pub type OpId = u64;

/// One queued backup or load.
#[derive(Clone, Debug)]
pub struct CacheOperation {
    /// Its id.
    pub id: OpId,
    /// Device pages (sources of a backup, targets of a load).
    pub device_pages: Vec<PageId>,
    /// Host pages paired with `device_pages`.
    pub host_pages: Vec<u32>,
    /// Request priority (informational; merged operations run together).
    pub priority: i32,
    /// Extra pools moved with the KV.
    pub extra: Vec<PoolTransfer>,
}

/// What one merged transfer moved.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Operations merged.
    pub ops: usize,
    /// Pages moved.
    pub pages: usize,
    /// Contiguous runs after coalescing.
    pub runs: usize,
    /// Bytes moved (all layers).
    pub bytes: usize,
}

/// A started pipelined load.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LoadStep {
    /// Producer index in the [`LayerDoneCounter`](crate::LayerDoneCounter) ring (hand it to `set_consumer`).
    pub producer: usize,
    /// What was merged.
    pub stats: TransferStats,
}

/// Completed operations, in completion order. A failed operation is listed only as failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acks {
    /// Backups whose bytes are on the host.
    pub writes: Vec<OpId>,
    /// Loads whose bytes are on the device.
    pub loads: Vec<OpId>,
    /// Backups whose copy failed: the host pages hold garbage.
    pub failed_writes: Vec<OpId>,
    /// Loads whose copy failed: the device pages hold garbage.
    pub failed_loads: Vec<OpId>,
}

impl Acks {
    /// True when nothing completed.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
            && self.loads.is_empty()
            && self.failed_writes.is_empty()
            && self.failed_loads.is_empty()
    }

    /// True when some copy failed.
    pub fn has_failures(&self) -> bool {
        !self.failed_writes.is_empty() || !self.failed_loads.is_empty()
    }

    /// Appends `other` (a later poll).
    pub fn extend(&mut self, other: Acks) {
        self.writes.extend(other.writes);
        self.loads.extend(other.loads);
        self.failed_writes.extend(other.failed_writes);
        self.failed_loads.extend(other.failed_loads);
    }
}

/// Coalesces (device, host) pairs into runs adjacent on both sides: each pair continues the
/// run before it when it follows that run on both sides, in the order the pairs are given.
/// When that leaves few runs (at most [`SORT_RUNS_UP_TO`], or runs of [`SORT_RUNS_FROM_PAGES`]
/// pages or more on average), the runs are also sorted by device page and joined where they
/// meet, which gives the minimal runs for the pairing (the runs of the pairs sorted by device
/// page; a device page listed twice keeps both copies, in host page order).
///
/// Loads and backups list mostly consecutive pages, so the pass in the given order finds the
/// runs; the sort only joins runs listed out of order (operations queued in another order
/// than their pages). On long lists of scattered pages, which is what a full cache's
/// evictions and loads give, profiles showed the sort joining nothing while costing more than
/// the pass itself, so those keep the order they came in.
pub fn merge_runs(pairs: impl IntoIterator<Item = (u32, u32)>) -> Vec<PageRun> {
    let pairs = pairs.into_iter();
    let mut b = RunBuilder::with_capacity(pairs.size_hint().0);
    b.extend(pairs);
    b.finish()
}

/// Runs at most this many are sorted by device page (and joined) whatever their length.
pub const SORT_RUNS_UP_TO: usize = 64;

/// Runs this many pages long or longer on average are sorted by device page (and joined).
pub const SORT_RUNS_FROM_PAGES: usize = 4;

/// Builds [`merge_runs`]'s runs from pairs given in pieces (one piece an operation).
///
/// A pair continues the run before it when it follows the pair before it on both sides, a
/// test of the pair and its predecessor alone: no pair waits for the run built so far. Each
/// pair is written, as the first of a possible run, to the slot after the runs found so far,
/// and only a pair that starts a run moves past it; a run holds its first pair's index in
/// `pages` until [`RunBuilder::close`] turns the indices into lengths. (Built on the open run,
/// each pair waited for the previous one's comparison and update: about 2.4 ns a pair.)
pub(crate) struct RunBuilder {
    /// Runs in `runs[..len]`; the rest is room, one slot per pair still to come.
    runs: Vec<PageRun>,
    len: usize,
    /// The device and host page a pair must have to continue the last pair's run
    /// (`u64::MAX`, which no page is, before the first pair).
    next: (u64, u64),
    pairs: usize,
}

impl RunBuilder {
    const EMPTY: PageRun = PageRun {
        device: 0,
        host: 0,
        pages: 0,
    };

    /// A builder with room for `pairs` pairs (it grows past them).
    pub(crate) fn with_capacity(pairs: usize) -> Self {
        Self::reusing(Vec::new(), pairs)
    }

    /// Appends pairs (fewer than 2^32 in all, as a run's length is a `u32`).
    pub(crate) fn extend(&mut self, pairs: impl Iterator<Item = (u32, u32)>) {
        let room = self.len + pairs.size_hint().0;
        if room > self.runs.len() {
            self.runs.resize(room, Self::EMPTY);
        }
        // The state lives in locals through the loop and is stored back once.
        let (mut len, mut next, mut count) = (self.len, self.next, self.pairs);
        let runs = &mut self.runs;
        for (d, h) in pairs {
            if len == runs.len() {
                // More pairs than the iterator's lower bound said.
                runs.resize(2 * len + 1, Self::EMPTY);
            }
            let (d64, h64) = (u64::from(d), u64::from(h));
            let joins = (next.0 == d64) & (next.1 == h64);
            runs[len] = PageRun {
                device: d,
                host: h,
                pages: count as u32,
            };
            len += usize::from(!joins);
            next = (d64 + 1, h64 + 1);
            count += 1;
        }
        (self.len, self.next, self.pairs) = (len, next, count);
    }

    /// A builder with room for `pairs` pairs in `buf`, a buffer an earlier builder gave back
    /// ([`RunBuilder::into_buffer`]). Its length is the room it had: a transfer no larger than
    /// the largest before it neither allocates nor fills room (a fresh buffer of a load's
    /// scattered pages was about a third of the merge, in the allocation and the filling).
    pub(crate) fn reusing(mut buf: Vec<PageRun>, pairs: usize) -> Self {
        if buf.len() < pairs {
            buf.resize(pairs, Self::EMPTY);
        }
        RunBuilder {
            runs: buf,
            len: 0,
            next: (u64::MAX, u64::MAX),
            pairs: 0,
        }
    }

    /// The buffer, its room kept (see [`RunBuilder::reusing`]).
    pub(crate) fn into_buffer(self) -> Vec<PageRun> {
        self.runs
    }

    /// Turns the runs' first-pair indices into lengths; returns how many runs there are.
    /// Once, after the last [`RunBuilder::extend`].
    fn close(&mut self) -> usize {
        let n = self.len;
        if n == 0 {
            return 0;
        }
        for k in 0..n - 1 {
            self.runs[k].pages = self.runs[k + 1].pages - self.runs[k].pages;
        }
        self.runs[n - 1].pages = self.pairs as u32 - self.runs[n - 1].pages;
        n
    }

    /// Whether [`RunBuilder::finish`] sorts and joins `runs` runs.
    fn sorts(&self, runs: usize) -> bool {
        runs <= SORT_RUNS_UP_TO || runs * SORT_RUNS_FROM_PAGES <= self.pairs
    }

    /// The runs, as [`RunBuilder::finish`] gives them, in a shared slice; the buffer stays
    /// with the builder for [`RunBuilder::into_buffer`].
    pub(crate) fn finish_shared(&mut self) -> Arc<[PageRun]> {
        let n = self.close();
        if self.sorts(n) {
            self.sort_and_join(self.runs[..n].to_vec()).into()
        } else {
            self.runs[..n].into()
        }
    }

    /// The runs.
    pub(crate) fn finish(mut self) -> Vec<PageRun> {
        let n = self.close();
        let mut runs = std::mem::take(&mut self.runs);
        runs.truncate(n);
        if self.sorts(n) {
            self.sort_and_join(runs)
        } else {
            runs
        }
    }

    /// Sorts `runs` by device page and joins them where they meet.
    fn sort_and_join(&self, mut runs: Vec<PageRun>) -> Vec<PageRun> {
        // Runs in device order that share no device page (what greedy joining leaves unjoinable).
        let apart = |a: &PageRun, b: &PageRun| {
            u64::from(a.device) + u64::from(a.pages) <= u64::from(b.device)
        };
        if runs.is_sorted_by(apart) {
            return runs;
        }
        radix_sort_by_key(&mut runs, |r| r.device);
        if !runs.is_sorted_by(apart) {
            // A device page listed twice: the runs of the pairs themselves, sorted.
            let mut pairs: Vec<(u32, u32)> = runs
                .iter()
                .flat_map(|r| (0..r.pages).map(move |i| (r.device + i, r.host + i)))
                .collect();
            pairs.sort_unstable();
            runs.clear();
            coalesce(&mut runs, pairs.into_iter().map(|(d, h)| (d, h, 1)));
            return runs;
        }
        let n = runs.len();
        let sorted = std::mem::replace(&mut runs, Vec::with_capacity(n));
        coalesce(
            &mut runs,
            sorted.iter().map(|r| (r.device, r.host, r.pages)),
        );
        runs
    }
}

/// Lengths from which on [`radix_sort_by_key`] sorts by radix rather than by comparison.
const RADIX_SORT_FROM: usize = 64;

/// Sorts `v` by a `u32` key: for lists of [`RADIX_SORT_FROM`] items or more, a stable
/// least-significant-digit radix sort, a byte a pass over the bytes the largest key uses
/// (two passes for keys under 65,536), O(items) where the comparison sort the shorter lists
/// get is O(items log items). Eviction's write-backs gather long lists of scattered page
/// ids: their runs to copy, and the host pages they are given. Items with equal keys keep an
/// unspecified order.
pub(crate) fn radix_sort_by_key<T: Copy>(v: &mut Vec<T>, key: impl Fn(&T) -> u32) {
    if v.len() < RADIX_SORT_FROM {
        v.sort_unstable_by_key(key);
        return;
    }
    let max = v.iter().map(&key).max().unwrap_or(0);
    let bytes = (u32::BITS - max.leading_zeros()).div_ceil(8);
    // Every pass writes each slot of `to` once: its starting contents do not matter.
    let mut to = v.clone();
    for pass in 0..bytes {
        let shift = pass * 8;
        let digit = |x: &T| ((key(x) >> shift) & 0xff) as usize;
        let mut start = [0usize; 256];
        for x in v.iter() {
            start[digit(x)] += 1;
        }
        let mut sum = 0;
        for s in &mut start {
            let n = *s;
            *s = sum;
            sum += n;
        }
        for x in v.iter() {
            let d = digit(x);
            to[start[d]] = *x;
            start[d] += 1;
        }
        std::mem::swap(v, &mut to);
    }
}

/// Appends `(device, host, pages)` pieces to `runs`, joining each to the last run when it
/// continues it on both sides.
fn coalesce(runs: &mut Vec<PageRun>, pieces: impl Iterator<Item = (u32, u32, u32)>) {
    for (d, h, n) in pieces {
        match runs.last_mut() {
            Some(r)
                if u64::from(r.device) + u64::from(r.pages) == u64::from(d)
                    && u64::from(r.host) + u64::from(r.pages) == u64::from(h) =>
            {
                r.pages += n
            }
            _ => runs.push(PageRun {
                device: d,
                host: h,
                pages: n,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `merge_runs` must return: the runs of the pairs in their order, or, when those
    /// are few or long, the runs of the pairs sorted by device page (the minimal runs).
    fn reference(pairs: &[(u32, u32)]) -> Vec<PageRun> {
        let runs_of = |pairs: &[(u32, u32)]| {
            let mut runs = Vec::new();
            coalesce(&mut runs, pairs.iter().map(|&(d, h)| (d, h, 1)));
            runs
        };
        let in_order = runs_of(pairs);
        if in_order.len() > SORT_RUNS_UP_TO && in_order.len() * SORT_RUNS_FROM_PAGES > pairs.len() {
            return in_order;
        }
        let mut sorted = pairs.to_vec();
        sorted.sort_unstable();
        runs_of(&sorted)
    }

    /// A xorshift64 generator from `seed`: each call draws a number below `n`.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        }
    }

    #[test]
    fn radix_sort_equals_the_comparison_sort() {
        let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15);
        // Lengths on both sides of the switch to the radix sort; keys of one to four bytes
        // (the last case spans every u32).
        for len in [0, 1, 2, 63, 64, 65, 300, 1000] {
            for span in [1_u64, 200, 1 << 16, 1 << 20, 1 << 32] {
                let mut v: Vec<u32> = (0..len).map(|_| rnd(span) as u32).collect();
                if len > 2 {
                    // The largest key of the span, so that its every byte is sorted on.
                    v[len / 2] = (span - 1) as u32;
                }
                let mut want = v.clone();
                want.sort_unstable();
                radix_sort_by_key(&mut v, |&x| x);
                assert_eq!(v, want, "len {len}, span {span}");
            }
        }
        // Stable by the key: equal keys keep their order past the switch.
        let v: Vec<(u32, u32)> = (0..500).map(|i| (rnd(7) as u32, i)).collect();
        let mut sorted = v.clone();
        radix_sort_by_key(&mut sorted, |p| p.0);
        let mut want = v;
        want.sort_by_key(|p| p.0);
        assert_eq!(sorted, want);
    }

    #[test]
    fn merged_runs_are_the_listed_runs_or_the_minimal_ones() {
        let mut rnd = xorshift(0x2545_f491_4f6c_dd1d);
        // The controller's buffer, holding the runs of earlier (larger and smaller) cases.
        let mut buffer = Vec::new();
        for case in 0..3000 {
            // Shuffled stretches of consecutive pages, sometimes adjacent to each other, and
            // (rarely) a device page listed twice.
            let mut pairs = Vec::new();
            // Some cases are long enough for the radix sort, over device pages of one to
            // three bytes.
            let (stretches, span) = match case % 3 {
                0 => (rnd(8), 64),
                1 => (64 + rnd(200), 1 << 16),
                _ => (64 + rnd(200), 1 << 22),
            };
            for _ in 0..stretches {
                // Stretches of 3.5 or 6.5 pages on average: long lists on both sides of
                // SORT_RUNS_FROM_PAGES.
                let longest = if case % 2 == 0 { 6 } else { 12 };
                let (d, h, n) = (rnd(span) as u32, rnd(span) as u32, 1 + rnd(longest) as u32);
                pairs.extend((0..n).map(|i| (d + i, h + i)));
            }
            if case % 5 != 0 {
                pairs.sort_unstable();
                pairs.dedup_by_key(|p| p.0);
            }
            for _ in 0..rnd(3) {
                if pairs.len() > 1 {
                    let (i, j) = (rnd(pairs.len() as u64), rnd(pairs.len() as u64));
                    pairs.swap(i as usize, j as usize);
                }
            }
            if case % 7 == 1 {
                // Wholly shuffled.
                for i in (1..pairs.len()).rev() {
                    pairs.swap(i, rnd(i as u64 + 1) as usize);
                }
            }
            let want = reference(&pairs);
            assert_eq!(merge_runs(pairs.iter().copied()), want, "{pairs:?}");
            // Given in pieces (one an operation), some from iterators that do not know their
            // length: the same runs.
            let mut pieces = RunBuilder::with_capacity(rnd(pairs.len() as u64 + 1) as usize);
            let mut rest = &pairs[..];
            while !rest.is_empty() {
                let (piece, tail) = rest.split_at(1 + rnd(rest.len() as u64) as usize);
                if case % 2 == 0 {
                    pieces.extend(piece.iter().copied());
                } else {
                    pieces.extend(piece.iter().copied().filter(|_| true));
                }
                rest = tail;
            }
            assert_eq!(pieces.finish(), want, "{pairs:?} in pieces");
            // Through the reused buffer, told fewer pairs than come at times: the same runs.
            let hint = rnd(pairs.len() as u64 + 1) as usize;
            let mut reused = RunBuilder::reusing(std::mem::take(&mut buffer), hint);
            reused.extend(pairs.iter().copied());
            assert_eq!(&*reused.finish_shared(), &want[..], "{pairs:?} reused");
            buffer = reused.into_buffer();
        }
        assert!(!buffer.is_empty());
        assert!(RunBuilder::reusing(buffer, 0).finish_shared().is_empty());
        assert!(merge_runs(std::iter::empty()).is_empty());
        // Runs that only touch once sorted are joined; pages past u32::MAX never wrap.
        let pairs = vec![(4, 14), (5, 15), (0, 10), (1, 11), (2, 12), (3, 13)];
        let one = PageRun {
            device: 0,
            host: 10,
            pages: 6,
        };
        assert_eq!(merge_runs(pairs), vec![one]);
        let edge = vec![(u32::MAX, 0), (0, 1)];
        assert_eq!(merge_runs(edge).len(), 2);
    }
}
