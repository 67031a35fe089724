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

/// Sorts (device, host) pairs by device page and coalesces pairs adjacent on both sides into
/// runs. Each device page appears once, so this is the minimal number of runs for the pairing.
pub fn merge_runs(pairs: &mut [(u32, u32)]) -> Vec<PageRun> {
    pairs.sort_unstable();
    let mut runs: Vec<PageRun> = Vec::new();
    for &(d, h) in pairs.iter() {
        match runs.last_mut() {
            Some(r) if r.device + r.pages == d && r.host + r.pages == h => r.pages += 1,
            _ => runs.push(PageRun {
                device: d,
                host: h,
                pages: 1,
            }),
        }
    }
    runs
}
