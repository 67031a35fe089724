//! The operations the controller queues and reports, and how their page pairs merge into runs.

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

/// Coalesces (device, host) pairs into runs adjacent on both sides, in device page order.
/// Each device page appears once, so this is the minimal number of runs for the pairing (the
/// runs of the pairs sorted by device page). `pairs` is left in an unspecified order.
///
/// Loads and backups list mostly consecutive pages, so the pairs are coalesced in their own
/// order first and only the runs, far fewer, are sorted and joined: O(pairs + runs log runs).
pub fn merge_runs(pairs: &mut [(u32, u32)]) -> Vec<PageRun> {
    let mut runs = Vec::new();
    coalesce(&mut runs, pairs.iter().map(|&(d, h)| (d, h, 1)));
    // Runs in device order that share no device page (what greedy joining leaves unjoinable).
    let apart =
        |a: &PageRun, b: &PageRun| u64::from(a.device) + u64::from(a.pages) <= u64::from(b.device);
    if runs.is_sorted_by(apart) {
        return runs;
    }
    runs.sort_unstable_by_key(|r| (r.device, r.host));
    if !runs.is_sorted_by(apart) {
        // A device page listed twice: the runs of the pairs themselves, sorted.
        pairs.sort_unstable();
        runs.clear();
        coalesce(&mut runs, pairs.iter().map(|&(d, h)| (d, h, 1)));
        return runs;
    }
    let sorted = std::mem::take(&mut runs);
    coalesce(
        &mut runs,
        sorted.iter().map(|r| (r.device, r.host, r.pages)),
    );
    runs
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

    /// The runs of the pairs sorted by device page: what `merge_runs` must return.
    fn reference(pairs: &[(u32, u32)]) -> Vec<PageRun> {
        let mut sorted = pairs.to_vec();
        sorted.sort_unstable();
        let mut runs = Vec::new();
        coalesce(&mut runs, sorted.into_iter().map(|(d, h)| (d, h, 1)));
        runs
    }

    #[test]
    fn merged_runs_equal_the_runs_of_the_sorted_pairs() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for case in 0..2000 {
            // Shuffled stretches of consecutive pages, sometimes adjacent to each other, and
            // (rarely) a device page listed twice.
            let mut pairs = Vec::new();
            for _ in 0..rnd(8) {
                let (d, h, n) = (rnd(64) as u32, rnd(64) as u32, 1 + rnd(6) as u32);
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
            let want = reference(&pairs);
            assert_eq!(merge_runs(&mut pairs.clone()), want, "{pairs:?}");
        }
        // Runs that only touch once sorted are joined; pages past u32::MAX never wrap.
        let mut pairs = vec![(4, 14), (5, 15), (0, 10), (1, 11), (2, 12), (3, 13)];
        let one = PageRun {
            device: 0,
            host: 10,
            pages: 6,
        };
        assert_eq!(merge_runs(&mut pairs), vec![one]);
        let mut edge = vec![(u32::MAX, 0), (0, 1)];
        assert_eq!(merge_runs(&mut edge).len(), 2);
    }
}
