//! [`HiRadixCache`]: the tiered prefix cache (device L1 + host L2).
//!
//! # Node tier states
//! device only → writing (host pages allocated, copy in flight, node locked until the ack) →
//! both → host only (device pages freed by eviction, node kept) → gone (host eviction). A load
//! brings a host-only chain back to both. Backed-up nodes form a root-connected prefix, as do
//! device-resident nodes; the tree checks both. A node's Mamba state and window KV (hybrid
//! models) follow the same states beside its KV (see "Extra pools" below).
//!
//! # Threads
//! Copies run on the backend's streams, but the tree is only ever changed on the caller's
//! thread: completions come back as acks that [`HiRadixCache::step`] applies at step
//! boundaries (it releases the locks that protected writing and loading nodes).
//!
//! # Events
//! A device-medium `BlockStored` is emitted when KV becomes resident (insert, load-back); a
//! host-medium `BlockStored` only when the backup's copy is acknowledged at a step boundary,
//! never when it is queued, so a consumer of the events never learns of host KV that is not
//! there yet. Removals are reported per medium as they happen.
//!
//! # Failed copies
//! - A failed **backup** is undone at the step boundary that sees it: the node loses its host
//!   copy (host pages freed, node device-only again, lock released), and so does every backup
//!   below it, to keep backed-up nodes root-connected. No host event was reported for it.
//!   Backups still queued then (refused submissions awaiting a retry) are failed and undone
//!   with it: one may extend the failed chain, and none was reported or copied yet.
//! - A failed **load** is never reported as loaded. The forward pass learns it first:
//!   [`LayerDoneCounter::wait_until`] returns [`HiCacheError::Transfer`] for the batch, which
//!   stops there, while the load's later layers may still be copying. The next
//!   [`HiRadixCache::step`] repairs the KV: it waits for those copies (the load is known to
//!   have failed, and the repair's copy would queue behind them on the load stream anyway),
//!   then copies the (intact) host copy again, synchronously. So once a layer wait has
//!   failed, an `Ok` from the next `step` means the pages hold the right KV and the batch may
//!   be re-run. `step` waits only when such a failure is known (or a load was only partly
//!   submitted); loads merely in flight are left to the layer waits. If the repair fails
//!   too, `step` returns the error: abort the batch's requests; the loaded nodes are demoted
//!   back to host-only as soon as they are unlocked (retried at every step), so their device
//!   pages are never served again once demoted. Until the failed load is repaired or demoted,
//!   [`HiRadixCache::start_loading`] refuses every batch (a later request may have matched
//!   the garbage pages). Between the failed layer wait and the next `step`, a batch that
//!   matched the failed load's nodes learns it from its own layer waits, which cover every
//!   load not acknowledged yet, failed ones included.
//!
//! # Back-pressure and refused submissions
//! The controller holds at most [`HiCacheConfig::max_pending_ops`] operations per direction
//! (queued or in flight until acknowledged at a step). A backup that finds the write side full
//! is skipped: the prefix stays device-only, as when the host is full, and is counted in
//! [`HiCacheStats::backups_skipped_queue_full`]. A load-back is never skipped that way: when the
//! load side is full, `begin_request` returns [`CacheError::Busy`] with nothing changed (the
//! request waits; the pending loads are acknowledged at the next [`HiRadixCache::step`]). A
//! submission the backend refuses is retried: backups at the next insert or step (counted in
//! [`HiCacheStats::refused_submissions`]), loads at the next
//! [`HiRadixCache::start_loading`] — whose error tells the batch not to run. A reset does not
//! retry refused backups: everything is discarded, so they are undone. A closed stream
//! (its worker died) fails every pending and later transfer, which the failed-copy paths above
//! handle.
//!
//! # Room for allocations
//! A write-through backup locks its nodes until the ack, so right after an insert (or a session
//! demotion) that KV is neither free nor evictable. Allocation does not fail on it:
//! [`PrefixCache::available_tokens`] counts it ([`HiRadixCache::backup_pinned_tokens`]), and
//! [`PrefixCache::make_room`], when evicting the unpinned KV is not enough but completing the
//! pending backups would be, waits for them and applies their acks first
//! ([`HiRadixCache::finish_pinned_backups`], counted in
//! [`HiCacheStats::backups_awaited_for_room`]), then evicts.
//!
//! # Asynchronous write-back eviction
//! Under write-back, a victim without a host copy must be copied before its device pages go.
//! [`HiRadixCache::prepare_room`] (what a scheduler calls before it admits a request) and the
//! first pass of [`PrefixCache::make_room`] do not wait for that copy: backed-up victims are
//! demoted at once, the others and their unbacked ancestors are backed up in one merged write
//! (counted in [`HiCacheStats::write_backs_async`]), and the victims stay on the device,
//! locked, until its ack; the ack demotes those still evictable (a victim a request locked or
//! extended meanwhile stays, backed up). Until then the victims count in
//! [`HiRadixCache::backup_pinned_tokens`], so admission budgets see the room coming, and
//! victims in flight count toward later targets
//! ([`HiRadixCache::write_back_pending_tokens`]), so retries do not evict more. A failed copy
//! releases its victims device-only. An allocation cannot wait a step: when the first pass
//! frees too little now, `make_room` completes the write-backs in flight and finishes
//! synchronously (counted in `backups_awaited_for_room`). [`PrefixCache::evict`] stays
//! synchronous (its victims are gone when it returns). The write-through policies evict at
//! once and are unchanged.
//!
//! # Extra pools: Mamba states
//! With Mamba slots in [`RadixConfig::mamba_slots`] the controller gets a Mamba pool
//! ([`PoolName::Mamba`]) whose device side is the tree's state slot pool (the slot indices are
//! the tree's; [`SlotOwner::Caller`]) and whose host side holds
//! [`HiCacheConfig::mamba_host_slots`] copies of [`HiCacheConfig::mamba_state_bytes`] each. A
//! node's state follows its KV through the same tier states:
//! - **Backup.** Every backup (write-through at insert, selective write-through, a write-back
//!   eviction, a session demotion's insert) carries the device states of its nodes that have
//!   no host copy yet as one extra [`PoolTransfer`] of the same operation, so one ack covers
//!   KV and states; the states of backed-up nodes above the chain whose state came later (a
//!   checkpoint at a split) ride along, in an operation without KV pages if need be. Until the
//!   ack the states are locked like the KV ([`RadixTree::inc_lock_ref_mamba`]), so no device
//!   slot a copy reads is reused. A failed backup frees the host copies of its states with its
//!   pages.
//! - **Host slots short.** A backup that finds too few free host Mamba slots host-evicts
//!   host-only leaves (host-policy order; each frees its state's slot) until enough are free;
//!   if that is not enough, the shallowest states of the backup are left out and counted in
//!   [`HiCacheStats::mamba_host_full`]: their KV is backed up without them (never an error).
//! - **Device eviction.** A device eviction drops the node's device state (the tree's cascade)
//!   and a Mamba eviction ([`HiRadixCache::evict_mamba_states`], or a slot allocation under
//!   pressure) drops a device state alone; either way the host copy stays.
//! - **Host eviction** of a host-only leaf frees its host state too
//!   ([`HiCacheStats::mamba_host_evicted`]).
//! - **Load-back.** A match is usable only up to the deepest device node with a device state;
//!   [`PrefixCache::match_request`] reports as the host hit the way to the deepest node past
//!   it with a host copy of its state. `begin_request` loads, in one operation, the host-only
//!   KV down to that node and its state into a device slot taken from the tree's pool (evicting
//!   an unlocked state if none is free; the KV pages and the slot are allocated all or
//!   nothing), which becomes the node's device state: the request's prefix ends there, and its
//!   [`RequestKv::mamba_cow`] copies from that slot. A node whose KV is still on device but
//!   whose device state went loads the state alone. The state's slot copy is submitted before
//!   the first layer's KV, so the forward pass runs the copy on write after its first layer
//!   wait. A failed load is repaired (KV and state copied again) or demoted like a KV-only
//!   one.
//!
//! # Extra pools: sliding-window KV
//! With [`RadixConfig::swa`] the controller gets an SWA pool ([`PoolName::Swa`]) whose device
//! side is the tree's SWA page pool ([`SlotOwner::Caller`]) and whose host side holds
//! [`HiCacheConfig::swa_host_pages`] pages of [`HiCacheConfig::swa_page_bytes`] each. A node's
//! window KV follows its KV through the tier states:
//! - **Backup.** A backup carries the live device window pages of its chain's nodes as one
//!   extra [`PoolTransfer`] of the same operation (one ack covers both); until the ack they are
//!   pinned ([`RadixTree::pin_swa_pages`]), so no SWA page a copy reads is tombstoned and
//!   reused. A node whose window KV is a tombstone at backup time, or whose window KV came back
//!   after its KV was backed up, stays a *host tombstone* (no host copy of its window KV). A
//!   failed backup frees its host window pages with its host KV.
//! - **Host pages short.** A backup that finds too few free host SWA pages host-evicts
//!   host-only leaves until enough are free; if that is not enough, the window pages of the
//!   shallowest nodes are left out (counted in [`HiCacheStats::swa_host_full`]): their KV is
//!   backed up without them.
//! - **Device SWA eviction** (a tombstone) and **device eviction** keep the host copy; **host
//!   eviction** of a host-only leaf frees it ([`HiCacheStats::swa_host_pages_evicted`]).
//! - **Load-back.** A match is usable only where a full window of window KV precedes its end
//!   (the tree's window rule); [`PrefixCache::match_request`] reports as the host hit the way
//!   to the deepest node past the device match whose window is live on device or on the host
//!   ([`RadixTree::match_swa_tiered`]). `begin_request` loads, in one operation, the host-only
//!   KV down to that node and the host window pages of the nodes in the window before its end
//!   into SWA pages taken from the tree's pool (all or nothing), which become their device
//!   window pages, pinned until the ack. A failed load is repaired (KV and window pages copied
//!   again) or demoted (the loaded window pages tombstoned).
//!
//! - **Sessions** (`radixkv-session` over this cache): an idle session slot locks the window
//!   KV of its cached prefix like a running request (so it is neither tombstoned nor evicted
//!   while held) and owns the window pages past it; demotion finishes the slot as a request,
//!   so its KV and window KV are inserted and backed up as any finish's, and a demoted
//!   session's next turn loads both back from the host like any host hit.
//!
//! # Extra pools: both in one tree
//! A tree with Mamba slots **and** sliding-window layers gets both pools, and each component
//! follows the rules above; what differs is where a match may end:
//! - **Match.** The usable device prefix ends where the device tier's combined match ends (a
//!   device state, and a full window of live window KV before it). The host hit is the
//!   deepest node past it that passes both validators with host copies counted: a full window
//!   of window KV before its end, live on device or on the host, **and** a Mamba state, on
//!   device or on the host ([`RadixTree::match_swa_tiered`]).
//! - **Load-back.** One operation brings back all the match needs: the host-only KV down to
//!   that node, the host window pages of the window before its end, and its state unless its
//!   device state is still there (a node whose window KV went while its KV stayed; the state
//!   is then locked while the window pages are allocated). The KV pages, the SWA pages and the
//!   slot are allocated all or nothing; the request's [`RequestKv::mamba_cow`] copies from
//!   the node's device state. A failed load is repaired (all three copied again) or demoted
//!   (the KV back to host-only, the loaded window pages tombstoned, which drops the node's
//!   state by the tree's cascade).
//! - **Backup** carries the chain's KV, the device states without a host copy and the live
//!   window pages in one operation (one [`PoolTransfer`] per extra pool); shortages of host
//!   Mamba slots or host SWA pages degrade as above, each counted in its own counter.
//!
//! Whatever the components, a load-back pins the live window KV of the window it completes
//! while it takes SWA pages, so that taking them tombstones none of that window.
//!
//! # Storage tier
//! With [`HiCacheConfig::storage`] a [`StorageTier`](crate::storage::StorageTier) engine sits
//! under the host tier (refused with [`HiCacheConfig::extra_pools`]; the tree's own Mamba and
//! SWA components are stored, see "Storage tier: components" below).
//! Nothing here blocks on the store: jobs run on a tokio runtime and their completions are
//! applied by [`HiRadixCache::step`].
//! - **Backup.** When a backup to the host is acknowledged, its host pages are queued for the
//!   store (one job per path of the backup's nodes, including parts split off them since; the
//!   job writes only the pages the store lacks, and in a hybrid tree the stored pages it gives
//!   a state or window page they lack: "Storage tier: components" below). Until the job's
//!   completion is applied, the deepest node of the path is protected from host eviction (so
//!   are its ancestors, which are not leaves), and the job reads the host pages itself, page
//!   by page under its gate. A path whose host copy is dropped meanwhile (a failed backup
//!   above it) has its job cancelled first. Counted in
//!   [`HiCacheStats::backup_pages_written`] and its siblings.
//! - **Prefetch.** [`HiRadixCache::prefetch`] looks up the whole pages after the tree's match
//!   (up to the key's last token) in the store when the match ends at a backed-up node or the
//!   root and at least `prefetch_threshold_tokens` remain, within the prefetch cap. The query
//!   runs in the background; at a step, the hit (at least the threshold) gets host pages
//!   (host-evicting if needed) and a fetch fills them, checking every page (a corrupt or
//!   missing page ends the hit there). [`HiRadixCache::check_prefetch`] ends it under its
//!   [`PrefetchStop`] policy, [`HiRadixCache::terminate_prefetch`] ends it now,
//!   [`HiRadixCache::abort_prefetch`] drops it. Ending stops the fetch (after which it writes
//!   nothing), inserts the loaded prefix under the match's anchor as host-only nodes
//!   ([`RadixTree::insert_host_only`](radixkv_radix::RadixTree::insert_host_only): positions
//!   already on the host keep theirs and the fetched copies are freed) and frees the other
//!   reserved pages. The request then matches again and takes the load-back path.
//! - **Failures.** A store that is down, slow past the operation timeout or returns bad pages
//!   turns into misses and failed backups, counted in [`HiCacheStats`]; requests recompute.
//!
//! # Storage tier: components
//! With the Mamba and/or SWA component, a stored page is still one object under the page's key
//! of the one chain; its header lists the sections it carries
//! ([`PageFormat`](crate::storage::PageFormat)):
//! - **What a page carries.** A backup reads, beside each page's KV, the host copies its
//!   nodes hold at the ack: a node's Mamba state goes into the section of the node's *last*
//!   page (a state is the checkpoint after the node's last token, so "a state ends here" is a
//!   page carrying a Mamba section), and its window KV page by page into each page's SWA
//!   section. A node without a host state or window copy (a host tombstone, or one left out
//!   for lack of host slots) stores its pages without. A component that reaches the host
//!   after its page was stored is added to the stored page: a backup job reads back the
//!   stored pages it gives a section they lack and writes them again with it, keeping their
//!   other sections
//!   ([`StorageTier::backup_with_sections`](crate::storage::StorageTier::backup_with_sections)).
//!   That covers window KV backed up to the host with KV the store holds already (its page
//!   was stored without its window: a tombstone or a host shortage at the first backup, and
//!   the node's host copy went since, by host eviction or in another cache over the same
//!   store) and a Mamba state that reaches the host after its node's pages (a checkpoint at a
//!   later split, backed up without KV: the node's last page is backed up again with the
//!   state's section). A stored page with every section a backup gives it is not written
//!   again. The host slots a backup reads are cancelled like its pages when the tree drops
//!   them.
//! - **What a prefetch asks for.** As for KV-only trees, the pages past the tree's KV match
//!   (device or host): a stored state or window inside KV the tree already holds (say KV on
//!   device whose state was evicted) is not fetched.
//! - **Prefetch.** The fetch reserves, beside the KV pages, one host Mamba slot (the fetch
//!   writes each stored state into it, so it ends up holding the deepest one fetched; with no
//!   slot to be had even after host eviction the prefetch is revoked: KV without a state is no
//!   hit) and host SWA pages for as many of the hit's last pages as the pool gives (at least a
//!   window's worth is host-evicted for). The gate records which page brought which section.
//! - **Where the hit ends.** When the prefetch ends, the hit is cut where the tree's rules
//!   allow a match to end ([`HiCacheStats::prefetch_pages_unusable`] counts the pages cut):
//!   with Mamba, exactly at the deepest fetched page that carried a state (one past the kept
//!   pages is never used); with SWA, at the deepest page whose window (the
//!   `ceil(window / page)` pages before it) all carried window KV, or, where the window
//!   reaches above the fetched pages, whose anchor side has live or host window KV for the
//!   rest (or reaches the root); with both, the state's page, if its window is complete. Under
//!   several ranks the end passes through the consensus hook (minimum and maximum): ranks
//!   that disagree keep nothing, so no rank restores a state another does not have.
//! - **Into the tree.** The kept pages enter as host-only nodes (with SWA, the window before
//!   the end as a node of its own), the window pages restored as that node's host copy
//!   ([`RadixTree::restore_swa_host_pages`](radixkv_radix::RadixTree::restore_swa_host_pages))
//!   and the state as the host state of the node ending at the hit
//!   ([`RadixTree::restore_mamba_host_state`](radixkv_radix::RadixTree::restore_mamba_host_state));
//!   unused reserved slots are freed. From there the host tier's rules apply unchanged: the
//!   tiered match validates the components and `begin_request` loads KV, window pages and
//!   state in one operation (atomic allocation, rollback, repair).
//!
//! # Several ranks
//! [`HiCacheConfig::consensus`] reduces every asynchronous outcome across ranks before the
//! tree changes: how many completed backup and load transfers [`HiRadixCache::step`] applies
//! (minimum), how many storage backups and queries are applied at a step (minimum, in
//! submission order), each query's hit length (minimum), whether a prefetch ends (maximum of
//! "stopped short", minimum of "may end") and how much of it is kept (minimum). Whether a
//! device or host copy *failed* is not agreed: a rank whose copy fails undoes or repairs it
//! alone (its tree may then differ). [`HiRadixCache::flush`] and the other paths that wait for
//! every transfer apply them all, which every rank does alike.
//!
//! [`RadixTree::pin_swa_pages`]: radixkv_radix::RadixTree::pin_swa_pages
//! [`RadixTree::match_swa_tiered`]: radixkv_radix::RadixTree::match_swa_tiered
//!
//! [`RadixTree::inc_lock_ref_mamba`]: radixkv_radix::RadixTree::inc_lock_ref_mamba
//! [`PoolTransfer`]: crate::PoolTransfer

mod host_leaves;
mod mamba;
mod recovery;
mod storage;
mod swa;
mod tiering;

pub use storage::{DEFAULT_PREFETCH_THRESHOLD_TOKENS, PrefetchStatus, PrefetchStop, StorageConfig};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use radixkv_radix::{
    CacheError, DevicePools, FinishKind, InsertOptions, InsertResult, InvariantViolation, KeyRef,
    KvEvent, LockReceipt, NodeId, PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig,
    RequestKv, RequestMatch, TierWalk, TreeMatch, align_down, make_room_by_evicting,
    pages_to_alloc, refuse_partial_key_finish,
};

use crate::backend::DeviceBackend;
use crate::consensus::{Consensus, Ranks, SingleRank};
use crate::controller::{
    Acks, DEFAULT_MAX_PENDING_OPS, ExtraPoolSpec, HybridCacheController, LoadStep, OpId, PoolName,
    SlotOwner,
};
use crate::error::{HiCacheError, Result as HiResult};
use crate::geometry::HostLayout;
use crate::host_pool::{HostPool, HostSize};
use crate::layer_counter::LayerDoneCounter;
use host_leaves::HostLeaves;

/// When device KV is backed up to the host.
///
/// Written as a plain string ([`WritePolicy::from_name`], [`fmt::Display`]):
/// `write_through`, `write_back`, or `write_through_selective[:N]` (`N` hits, default 2). With
/// the `serde` feature it (de)serializes as that string.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(try_from = "String", into = "String")
)]
pub enum WritePolicy {
    /// Back up every new node at insert.
    WriteThrough,
    /// Back up a node once it was inserted `hits` times (reused `hits − 1` times).
    WriteThroughSelective {
        /// Inserts needed (default 2).
        hits: u32,
    },
    /// Back up only when a node is evicted from the device (synchronously, in batches).
    WriteBack,
}

impl Default for WritePolicy {
    fn default() -> Self {
        WritePolicy::WriteThroughSelective { hits: 2 }
    }
}

impl WritePolicy {
    /// A short name for labels: `wt`, `wts2`, `wb`.
    pub fn short_name(&self) -> String {
        match self {
            WritePolicy::WriteThrough => "wt".into(),
            WritePolicy::WriteThroughSelective { hits } => format!("wts{hits}"),
            WritePolicy::WriteBack => "wb".into(),
        }
    }

    /// Parses `write_through`, `write_through_selective[:N]` (`N` hits, default 2) or
    /// `write_back` (`-` may stand for `_`). `None` for anything else.
    pub fn from_name(s: &str) -> Option<Self> {
        let (name, arg) = s.split_once(':').unwrap_or((s, ""));
        match (name.replace('-', "_").as_str(), arg) {
            ("write_through", "") => Some(WritePolicy::WriteThrough),
            ("write_back", "") => Some(WritePolicy::WriteBack),
            ("write_through_selective", "") => Some(WritePolicy::WriteThroughSelective { hits: 2 }),
            ("write_through_selective", n) => Some(WritePolicy::WriteThroughSelective {
                hits: n.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// The name [`WritePolicy::from_name`] parses: `write_through`, `write_through_selective:N`,
/// `write_back`.
impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WritePolicy::WriteThrough => f.write_str("write_through"),
            WritePolicy::WriteThroughSelective { hits } => {
                write!(f, "write_through_selective:{hits}")
            }
            WritePolicy::WriteBack => f.write_str("write_back"),
        }
    }
}

impl std::str::FromStr for WritePolicy {
    type Err = HiCacheError;
    fn from_str(s: &str) -> HiResult<Self> {
        WritePolicy::from_name(s).ok_or_else(|| {
            HiCacheError::Config(format!(
                "unknown write policy {s:?}; known: write_through, \
                 write_through_selective[:N], write_back"
            ))
        })
    }
}

impl TryFrom<String> for WritePolicy {
    type Error = HiCacheError;
    fn try_from(s: String) -> HiResult<Self> {
        s.parse()
    }
}

impl From<WritePolicy> for String {
    fn from(p: WritePolicy) -> String {
        p.to_string()
    }
}

/// Configuration of a [`HiRadixCache`].
#[derive(Clone, Debug)]
pub struct HiCacheConfig {
    /// The device tier (page size, pool size, rows, policy, events).
    pub radix: RadixConfig,
    /// Host pool size.
    pub host_size: HostSize,
    /// Host pool layout.
    pub host_layout: HostLayout,
    /// Backup policy.
    pub write_policy: WritePolicy,
    /// Eviction policy of the host tier (`None`: the device tier's, `radix.policy`). Keeping
    /// plain LRU on the device and [`PolicyKind::Reuse`] on the host tier lets the large tier
    /// carry reuse history while the device, which also holds host-backed copies, turns over
    /// by recency alone.
    pub host_policy: Option<PolicyKind>,
    /// Host hits shorter than this many tokens (rounded up to whole pages) are not loaded
    /// back; recomputing them is cheaper than a transfer.
    pub load_back_min_tokens: usize,
    /// Largest load-back in tokens `begin_request` performs (`None`: no limit).
    pub load_back_quota_tokens: Option<usize>,
    /// Load host hits back in `begin_request` (otherwise only through
    /// [`HiRadixCache::init_load_back`]).
    pub load_back_on_begin: bool,
    /// Extra pools registered with the controller beside the ones the cache derives from
    /// `radix` (their buffers are allocated, the cache moves nothing in them). The Mamba pool
    /// of a `radix` with Mamba slots and the SWA pool of one with sliding-window layers are
    /// registered by the cache itself: listing them here too is refused.
    pub extra_pools: Vec<ExtraPoolSpec>,
    /// Bytes of one Mamba state slot in the backend's device-side Mamba buffer (one slot holds
    /// the states of every Mamba layer). Required when `radix.mamba_slots` is set (the cache
    /// registers the backend's Mamba pool with `radix.mamba_slots` slots of this size);
    /// ignored otherwise.
    pub mamba_state_bytes: Option<usize>,
    /// Host slots for copies of Mamba states (`None`: the host pool's share, i.e.
    /// `radix.mamba_slots × host pages / device pages`, rounded up). Ignored without Mamba
    /// slots.
    pub mamba_host_slots: Option<u32>,
    /// Bytes of one page of window KV in the backend's device-side SWA buffer (all
    /// sliding-window layers of one page). Required when `radix.swa` is set (the cache
    /// registers the backend's SWA pool with the tree's SWA pages of this size); ignored
    /// otherwise.
    pub swa_page_bytes: Option<usize>,
    /// Host pages for copies of window KV (`None`: the host pool's share, i.e. SWA device
    /// pages × host pages / device pages, rounded up). Ignored without `radix.swa`.
    pub swa_host_pages: Option<u32>,
    /// Operations per direction (backups, loads) the controller holds queued or in flight
    /// before it refuses more (default [`DEFAULT_MAX_PENDING_OPS`]; see the module docs for what
    /// happens then).
    pub max_pending_ops: usize,
    /// The storage tier (L3) under the host tier (`None`: none). See the module docs,
    /// "Storage tier". With Mamba slots or sliding-window layers the stored pages carry the
    /// states and window KV too; refused together with `extra_pools` (which it cannot store).
    pub storage: Option<StorageConfig>,
    /// How the ranks of one model agree on asynchronous outcomes (default [`SingleRank`]);
    /// see [`Consensus`].
    pub consensus: Arc<dyn Consensus>,
}

impl Default for HiCacheConfig {
    fn default() -> Self {
        HiCacheConfig {
            radix: RadixConfig::default(),
            host_size: HostSize::Ratio(2.0),
            host_layout: HostLayout::PageFirst,
            write_policy: WritePolicy::default(),
            host_policy: None,
            load_back_min_tokens: 10,
            load_back_quota_tokens: None,
            load_back_on_begin: true,
            extra_pools: Vec::new(),
            mamba_state_bytes: None,
            mamba_host_slots: None,
            swa_page_bytes: None,
            swa_host_pages: None,
            max_pending_ops: DEFAULT_MAX_PENDING_OPS,
            storage: None,
            consensus: Arc::new(SingleRank),
        }
    }
}

/// Counters of tier traffic and graceful degradations.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HiCacheStats {
    /// Tokens whose backup was queued.
    pub backed_up_tokens: u64,
    /// Backups acknowledged.
    pub writes_acked: u64,
    /// Tokens loaded back from the host.
    pub loaded_tokens: u64,
    /// Loads acknowledged.
    pub loads_acked: u64,
    /// Tokens demoted to host-only by device eviction.
    pub demoted_tokens: u64,
    /// Tokens freed from the host by host eviction.
    pub host_evicted_tokens: u64,
    /// Backups skipped because the host was full even after host eviction.
    pub host_exhausted: u64,
    /// Tokens evicted from the device without a host copy under write-back.
    pub dropped_without_backup: u64,
    /// Load-backs skipped as shorter than the minimum.
    pub load_back_too_small: u64,
    /// Load-backs skipped as larger than the quota.
    pub load_back_over_quota: u64,
    /// Load-backs abandoned because the device could not free enough pages.
    pub load_back_device_full: u64,
    /// Transfers that reported a failed copy.
    pub failed_transfers: u64,
    /// Backups whose copy failed (undone: the nodes are device-only again).
    pub failed_writes: u64,
    /// Loads whose copy failed.
    pub failed_loads: u64,
    /// Failed loads repaired by a second, synchronous copy.
    pub repaired_loads: u64,
    /// Failed loads whose nodes were demoted back to host-only.
    pub demoted_failed_loads: u64,
    /// Tokens whose host copy was dropped because a backup failed (theirs or an ancestor's).
    pub dropped_backup_tokens: u64,
    /// Backups skipped because the controller's write side held its limit of pending
    /// operations (the nodes stay device-only).
    pub backups_skipped_queue_full: u64,
    /// Load-backs refused with [`CacheError::Busy`] because the load side held its limit of
    /// pending operations (the request waits and retries).
    pub load_back_queue_full: u64,
    /// Backup submissions the backend refused (the operations stay queued and are retried).
    pub refused_submissions: u64,
    /// Times [`PrefixCache::make_room`] waited for the backups pinning device KV (and applied
    /// their acks) because evicting the unpinned KV alone could not free enough pages, or
    /// `begin_request` did so because every device Mamba slot was held and pending backups
    /// locked some of them.
    pub backups_awaited_for_room: u64,
    /// Asynchronous write-back evictions queued (one merged backup each; see
    /// [`HiRadixCache::prepare_room`]).
    pub write_backs_async: u64,
    /// Device tokens of asynchronous write-back victims demoted at their acks.
    pub write_back_demoted_tokens: u64,
    /// Mamba states whose backup was queued (with their node's KV, or alone for a node whose
    /// KV was backed up before).
    pub mamba_states_backed_up: u64,
    /// Mamba states not backed up because no host slot could be freed (their nodes' KV was
    /// backed up without them).
    pub mamba_host_full: u64,
    /// Mamba states loaded back from the host (with their load's KV).
    pub mamba_states_loaded: u64,
    /// Host copies of Mamba states freed by host eviction.
    pub mamba_host_evicted: u64,
    /// Load-backs abandoned because no device Mamba slot could be had (for the loaded state,
    /// or one more for the request's own running state).
    pub mamba_load_back_no_slot: u64,
    /// Window pages whose backup was queued with their node's KV.
    pub swa_pages_backed_up: u64,
    /// Nodes whose window pages were not backed up because no host SWA pages could be freed
    /// (their KV was backed up without them).
    pub swa_host_full: u64,
    /// Window pages loaded back from the host (with their load's KV).
    pub swa_pages_loaded: u64,
    /// Host window pages freed by host eviction.
    pub swa_host_pages_evicted: u64,
    /// Load-backs abandoned because the device SWA pool could not give the window pages.
    pub swa_load_back_no_pages: u64,
    /// Tokens the storage tier loaded into the tree (as host-only KV) for prefetches.
    pub storage_hit_tokens: u64,
    /// Prefetches started.
    pub prefetches_started: u64,
    /// Prefetches that ended before any host page was reserved: the storage hit was below
    /// the threshold, the host had no room, or the prefetch was ended during its query.
    pub prefetches_revoked: u64,
    /// Prefetches ended by their timeout before every page arrived.
    pub prefetch_timeouts: u64,
    /// Prefetched pages that entered the tree.
    pub prefetch_pages_loaded: u64,
    /// Host pages reserved for prefetches and returned without entering the tree (not
    /// arrived when the prefetch ended, past another rank's progress, or aborted).
    pub prefetch_pages_revoked: u64,
    /// Prefetched pages that arrived but were dropped because a hybrid tree's components do
    /// not allow a match to end past them: after the deepest stored Mamba state, or without
    /// the stored window KV a full window needs (see the module docs, "Storage tier").
    pub prefetch_pages_unusable: u64,
    /// Prefetches that met a stored page failing its checks (a miss there; the fetch stops).
    pub prefetch_pages_corrupt: u64,
    /// Storage backup jobs completed.
    pub storage_backups: u64,
    /// Pages written to the store by backups (stored pages written again to add a state or
    /// window section included).
    pub backup_pages_written: u64,
    /// Pages a backup found in the store already, with every section it would give them (not
    /// written again).
    pub backup_pages_skipped: u64,
    /// Pages a backup could not write (store error, timeout, refusal, cancellation).
    pub backup_pages_failed: u64,
}

/// Deliberately broken variants of the cache, for tests that must show their checks catch
/// the bug. Not a setting: every field off is the only correct configuration.
#[doc(hidden)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TestMutations {
    /// Backups do not lock their chain until the ack: device eviction may free (and reuse)
    /// pages a write is still reading.
    pub unpinned_backups: bool,
    /// Loads do not lock their nodes until the ack: the nodes may be evicted (and their pages
    /// reused) while the copy still writes them.
    pub unpinned_loads: bool,
    /// `step` applies only completed transfers, even when a load still in flight is known to
    /// have failed: it returns `Ok` while that load's pages hold garbage.
    pub step_skips_failing_loads: bool,
    /// An asynchronous write-back eviction frees its victims' device pages when it queues
    /// their backup instead of at the ack: the copy reads pages that may be reused.
    pub write_back_frees_early: bool,
}

/// A queued or in-flight backup.
#[derive(Debug)]
pub(crate) struct PendingWrite {
    /// The lock protecting the chain until the ack (`None` for synchronous write-back).
    pub(crate) lock: Option<LockReceipt>,
    /// The nodes backed up (each keeps its id across splits; split-off parts become its
    /// ancestors).
    pub(crate) nodes: Vec<NodeId>,
    /// The host pages written, in no particular order (sorted at the ack where lookups need
    /// it: [`HiRadixCache::sort_backup_host`]).
    pub(crate) host: Vec<u32>,
    /// The Mamba states backed up: (node, host slot).
    pub(crate) states: Vec<(NodeId, u32)>,
    /// Locks on the backed-up states (their device slots must not be reused before the ack).
    pub(crate) state_locks: Vec<LockReceipt>,
    /// The host window pages written, in no particular order.
    pub(crate) swa_host: Vec<u32>,
    /// Pinned window KV: (node, pages when pinned), unpinned at the ack.
    pub(crate) swa_pins: Vec<(NodeId, usize)>,
    /// Asynchronous write-back: a lock on each victim (the anchor is the victim), released at
    /// the ack, when the victims still evictable are demoted.
    pub(crate) victims: Vec<LockReceipt>,
    /// Device tokens of the victims when the write-back was queued.
    pub(crate) victim_tokens: usize,
}

/// A queued or in-flight load.
#[derive(Debug)]
pub(crate) struct PendingLoad {
    /// The lock on the anchor (released at the ack).
    pub(crate) lock: Option<LockReceipt>,
    /// The anchor: the deepest node loaded.
    pub(crate) last: NodeId,
    /// Source host pages, paired with `device`.
    pub(crate) host: Vec<u32>,
    /// Target device pages.
    pub(crate) device: Vec<PageId>,
    /// The Mamba state loaded into `last`: (host slot, device slot).
    pub(crate) state: Option<(u32, u32)>,
    /// The window pages loaded: (node, host pages, device pages).
    pub(crate) swa: Vec<(NodeId, Vec<u32>, Vec<PageId>)>,
    /// Pinned window KV: (node, pages when pinned), unpinned at the ack.
    pub(crate) swa_pins: Vec<(NodeId, usize)>,
}

/// The tiered prefix cache. See the module docs.
pub struct HiRadixCache<B: DeviceBackend> {
    inner: RadixCache,
    ctrl: HybridCacheController<B>,
    policy: WritePolicy,
    load_back_min_tokens: usize,
    load_back_quota_tokens: Option<usize>,
    load_back_on_begin: bool,
    host_leaves: HostLeaves,
    pending_writes: HashMap<OpId, PendingWrite>,
    pending_loads: HashMap<OpId, PendingLoad>,
    /// Failed loads not yet repaired or demoted.
    unrepaired: Vec<PendingLoad>,
    stats: HiCacheStats,
    pages: Vec<PageId>,
    host_scratch: Vec<u32>,
    /// Host pages a host eviction kept for the backup that needed the room (see
    /// `backup_chain`); empty between calls.
    host_reuse: Vec<u32>,
    mutations: TestMutations,
    /// The tree carries the Mamba component: states move with the KV.
    mamba: bool,
    /// The tree carries the SWA component: window KV moves with the KV.
    swa: bool,
    /// The storage tier, if configured.
    storage: Option<Box<storage::StorageState>>,
    /// How the ranks agree.
    consensus: Ranks,
    /// Device tokens of the victims of asynchronous write-backs not acknowledged yet (the sum
    /// of their [`PendingWrite::victim_tokens`]): room that arrives at their acks.
    write_back_tokens: usize,
}

impl<B: DeviceBackend> std::fmt::Debug for HiRadixCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiRadixCache")
            .field("tree", self.inner.tree())
            .field("controller", &self.ctrl)
            .field("policy", &self.policy)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<B: DeviceBackend> HiRadixCache<B> {
    /// A tiered cache over `backend`, whose device pool must match `cfg.radix` (page size and
    /// pages).
    ///
    /// With Mamba slots in `cfg.radix`, the controller gets a Mamba pool whose device side is
    /// the tree's slot pool (`radix.mamba_slots` slots of `cfg.mamba_state_bytes`, the
    /// backend's buffer) and whose host side holds `cfg.mamba_host_slots` copies. With
    /// sliding-window layers (`radix.swa`), likewise an SWA pool: the tree's SWA pages of
    /// `cfg.swa_page_bytes` on the device side, `cfg.swa_host_pages` on the host side.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for mismatched or impossible sizes, for Mamba slots without
    /// `mamba_state_bytes` (or with 0 bytes or 0 host slots), for sliding-window layers
    /// without `swa_page_bytes` (or with 0 bytes or 0 host pages), and a Mamba or SWA pool
    /// listed in `extra_pools` as well. A `cfg.radix` with both Mamba slots and
    /// sliding-window layers gets both pools.
    pub fn new(cfg: HiCacheConfig, backend: Arc<B>) -> HiResult<Self> {
        let g = backend.geometry();
        if g.page_size != cfg.radix.page_size || backend.device_pages() != cfg.radix.total_pages {
            return Err(HiCacheError::Config(format!(
                "device pool ({} pages of {} tokens) does not match the cache ({} pages of {})",
                backend.device_pages(),
                g.page_size,
                cfg.radix.total_pages,
                cfg.radix.page_size
            )));
        }
        if let WritePolicy::WriteThroughSelective { hits: 0 } = cfg.write_policy {
            return Err(HiCacheError::Config(
                "selective write-through needs hits ≥ 1".into(),
            ));
        }
        let host_pages = cfg.host_size.pages(&g, backend.device_pages())?;
        let mut extra = cfg.extra_pools.clone();
        if let Some(slots) = cfg.radix.mamba_slots {
            extra.push(mamba_pool_spec(&cfg, slots, host_pages)?);
        }
        if let Some(w) = cfg.radix.swa {
            extra.push(swa_pool_spec(&cfg, w.pages, host_pages)?);
        }
        let host = HostPool::new(g, host_pages, cfg.host_layout)?;
        let host_leaves = HostLeaves::new(cfg.host_policy.unwrap_or(cfg.radix.policy));
        let mamba = cfg.radix.mamba_slots.is_some();
        let swa = cfg.radix.swa.is_some();
        let storage = match cfg.storage {
            None => None,
            Some(s) => {
                if !cfg.extra_pools.is_empty() {
                    return Err(HiCacheError::Config(
                        "the storage tier stores KV pages with the Mamba states and \
                         sliding-window KV of the tree; it is not built for other extra pools"
                            .into(),
                    ));
                }
                // Stored pages carry the tree's components as sections.
                let mut sections = Vec::new();
                if mamba && let Some(b) = cfg.mamba_state_bytes {
                    sections.push((PoolName::Mamba, b));
                }
                if swa && let Some(b) = cfg.swa_page_bytes {
                    sections.push((PoolName::Swa, b));
                }
                let format = crate::storage::PageFormat::new(g, &s.identity, &sections)?;
                Some(Box::new(storage::StorageState::new(
                    s,
                    format,
                    g.page_size,
                    host_pages,
                )?))
            }
        };
        // The controller registers the host memory and the extra pools with the backend: every
        // check that may refuse the config runs first.
        crate::controller::check_max_pending_ops(cfg.max_pending_ops)?;
        let inner = RadixCache::new(cfg.radix)?;
        let mut ctrl = HybridCacheController::new(backend, host, &extra)?;
        ctrl.set_max_pending_ops(cfg.max_pending_ops)?;
        Ok(HiRadixCache {
            inner,
            ctrl,
            policy: cfg.write_policy,
            load_back_min_tokens: cfg.load_back_min_tokens,
            load_back_quota_tokens: cfg.load_back_quota_tokens,
            load_back_on_begin: cfg.load_back_on_begin,
            host_leaves,
            pending_writes: HashMap::new(),
            pending_loads: HashMap::new(),
            unrepaired: Vec::new(),
            stats: HiCacheStats::default(),
            pages: Vec::new(),
            host_scratch: Vec::new(),
            host_reuse: Vec::new(),
            mutations: TestMutations::default(),
            mamba,
            swa,
            storage,
            consensus: Ranks::new(cfg.consensus),
            write_back_tokens: 0,
        })
    }

    /// Test hook: switches on deliberately broken behaviour (see [`TestMutations`]).
    #[doc(hidden)]
    pub fn set_test_mutations(&mut self, m: TestMutations) {
        self.mutations = m;
    }

    /// The device-tier cache (tree and pools), read-only.
    pub fn device_cache(&self) -> &RadixCache {
        &self.inner
    }

    /// The controller (host pool, queues, backend).
    pub fn controller(&self) -> &HybridCacheController<B> {
        &self.ctrl
    }

    /// The device backend.
    pub fn backend(&self) -> &Arc<B> {
        self.ctrl.backend()
    }

    /// The per-layer load counter the forward pass waits on.
    pub fn layer_counter(&self) -> &Arc<LayerDoneCounter<B::Event>> {
        self.ctrl.layer_counter()
    }

    /// Tier traffic counters.
    pub fn stats(&self) -> HiCacheStats {
        self.stats
    }

    /// The write policy.
    pub fn write_policy(&self) -> WritePolicy {
        self.policy
    }

    /// The eviction policy family ordering both tiers (the device tier's, from the config).
    pub fn host_policy(&self) -> PolicyKind {
        self.host_leaves.kind()
    }

    /// Host pages of backups queued or in flight: allocated, but not yet reported by a host
    /// `BlockStored` event.
    pub fn unacked_backup_pages(&self) -> usize {
        self.pending_writes.values().map(|w| w.host.len()).sum()
    }

    /// Device tokens that only pending backups keep locked: the nodes a write-through backup
    /// pins until its ack, and that nothing else (a request, a session, a load) locks. They
    /// become evictable once the backups are acknowledged, which
    /// [`HiRadixCache::finish_pinned_backups`] forces, so [`PrefixCache::available_tokens`]
    /// counts them and [`PrefixCache::make_room`] frees them when it must.
    pub fn backup_pinned_tokens(&self) -> usize {
        let tree = self.inner.tree();
        let root = tree.root();
        // Locks each node holds from pending backups: a backup locks its anchor's root path.
        let mut pins: HashMap<NodeId, u32> = HashMap::new();
        for lock in self
            .pending_writes
            .values()
            .flat_map(|w| w.lock.iter().chain(&w.state_locks).chain(&w.victims))
        {
            let mut n = lock.anchor();
            while n != root {
                *pins.entry(n).or_default() += 1;
                match tree.parent(n) {
                    Ok(Some(p)) => n = p,
                    _ => break,
                }
            }
        }
        pins.into_iter()
            .filter(|&(n, pinned)| {
                tree.lock_ref(n).is_ok_and(|l| l == pinned) && tree.on_device(n).unwrap_or(false)
            })
            .map(|(n, _)| tree.node_key(n).map_or(0, <[u32]>::len))
            .sum()
    }

    /// Completes every pending backup now: starts the queued ones, waits for their copies and
    /// applies the acks (as [`HiRadixCache::step`] would), which releases the locks that pin
    /// the backed-up nodes. A backup the backend refuses to start cannot wait for a retry
    /// here, so it is undone like a failed one (its nodes stay device-only); a failed copy is
    /// undone the same way. Loads in flight are not waited for.
    ///
    /// # Errors
    /// A stale lock (a bug). A failed load whose repair fails again among the acks is not this
    /// call's failure: the next [`HiRadixCache::step`] reports it, and
    /// [`HiRadixCache::start_loading`] refuses every batch until it is repaired.
    pub fn finish_pinned_backups(&mut self) -> HiResult<()> {
        self.start_writes();
        self.ctrl.fail_queued_writes();
        // A failed copy is handled by the acks (undone), so the wait's error adds nothing.
        let _ = self.ctrl.wait_writes();
        // Only the backups: every rank has finished the same ones now, while which loads are
        // complete depends on the rank's timing (the next step applies them, agreed).
        let mut acks = self.ctrl.poll_acks_upto(usize::MAX, 0);
        self.apply_acks_leaving_repairs(&mut acks)
    }

    /// Starts making `tokens` device tokens free without waiting, for a scheduler about to
    /// admit a request that needs them: returns `true` when they are free now (or waiting
    /// would not bring them: the allocation then evicts as usual), `false` when they arrive
    /// only at the acks of write-backs in flight: retry after the next
    /// [`HiRadixCache::step`].
    ///
    /// Only write-back evicts here: its eviction must copy unbacked victims to the host first,
    /// so it is asynchronous. Victims with a host copy are demoted now; the others (and their
    /// unbacked ancestors) are backed up in one merged write and stay on the device, locked,
    /// until its ack, which demotes those still evictable. Victims of write-backs already in
    /// flight count toward `tokens`, so repeated calls do not evict more. Under the
    /// write-through policies eviction is immediate, so this changes nothing and returns
    /// `true`. Lock the request's matched prefix first, or it may be chosen as a victim.
    pub fn prepare_room(&mut self, tokens: usize) -> bool {
        if self.policy != WritePolicy::WriteBack {
            return true;
        }
        let p = self.page_size();
        let need = tokens.div_ceil(p);
        let free = self.pools().pages.available();
        if free >= need {
            return true;
        }
        self.evict_device_async((need - free) * p);
        self.pools().pages.available() >= need || self.write_back_tokens == 0
    }

    /// Device tokens of write-back victims whose backup is in flight: they become free at
    /// the acks (see [`HiRadixCache::prepare_room`]).
    pub fn write_back_pending_tokens(&self) -> usize {
        self.write_back_tokens
    }

    /// Evicts up to `n` unlocked device Mamba states (least recently used first, or by the
    /// tree's utility order; see `RadixTree::evict_mamba`): their nodes keep their KV and any
    /// host copy of the state, which a later load-back brings back. Returns the states
    /// evicted; 0 without the Mamba component.
    pub fn evict_mamba_states(&mut self, n: usize) -> usize {
        self.inner.parts_mut().0.evict_mamba(n)
    }

    /// Host Mamba state copies held (0 without the Mamba component).
    pub fn host_mamba_states(&self) -> usize {
        self.ctrl
            .extra_host(PoolName::Mamba)
            .map_or(0, |a| a.used())
    }

    /// Tokens held by the host tier.
    pub fn host_tokens(&self) -> usize {
        self.ctrl.host().used() * self.inner.tree().page_size()
    }

    /// Starts every queued load as one merged, layer-pipelined transfer (call once the batch
    /// is formed, before its forward — also when the batch loaded nothing: it may have matched
    /// pages of an earlier batch's load still in flight, which the returned step covers too).
    /// Hand the returned producer to [`LayerDoneCounter::set_consumer`]; `None` means there is
    /// nothing to wait for.
    ///
    /// # Errors
    /// The backend refused the copy or its stream is closed. The batch that needs the queued
    /// loads must not run its forward then: their device pages hold no KV yet. A refused load
    /// stays queued and the next call retries it; a load on a closed stream is reported as
    /// failed at the next [`HiRadixCache::step`]. Also while a failed load could not be
    /// repaired (its repair copy failed too, and a request still holds its nodes, so they are
    /// not demoted either): its pages are garbage, and a request of this batch may read them.
    /// The next step retries the repair.
    pub fn start_loading(&mut self) -> HiResult<Option<LoadStep>> {
        if !self.unrepaired.is_empty() {
            return Err(HiCacheError::Transfer(
                "a failed load is not repaired yet; its pages hold no KV".into(),
            ));
        }
        self.ctrl.start_loading()
    }

    /// Starts queued backups. A refusal is not the caller's failure: the backups stay queued
    /// (or, on a closed stream, come back as failed acks) and the next insert or step retries.
    fn start_writes(&mut self) {
        match self.ctrl.start_writing() {
            Ok(_) | Err(HiCacheError::StreamClosed(_)) => {}
            Err(e) => {
                self.stats.refused_submissions += 1;
                tracing::warn!(error = %e, "backup submission refused; retried at the next step");
            }
        }
    }

    /// Step boundary: starts queued backups and applies every completed transfer (releasing
    /// the locks that protected writing and loading nodes). Returns what completed.
    ///
    /// Transfers still in flight are not waited for — unless one is already known to have
    /// failed (a layer wait of the forward pass returned the error, or the load was only
    /// partly submitted): then `step` waits for the started transfers to finish and repairs
    /// the failed load before it returns (see the module docs). So an `Ok` means that every
    /// load whose failure was known when `step` was called now holds the right KV.
    ///
    /// # Errors
    /// A stale lock (a bug), or a failed load that could not be repaired (see the module
    /// docs). A refused backup submission is not an error: it is retried at the next step.
    pub fn step(&mut self) -> HiResult<Acks> {
        if self.idle_boundary() && self.storage.is_none() {
            // Nothing to start, acknowledge, repair or store, and no rank to agree with: the
            // calls below would change nothing. Most steps of a replay are such steps (an
            // agentic request lives about 275 of them, and loads or backs up in one or two).
            return Ok(Acks::default());
        }
        self.start_writes();
        if !self.mutations.step_skips_failing_loads && self.ctrl.has_failing_transfers() {
            // The forward pass stops at a failed layer while the load's later layers may still
            // be copying. Their completion is what reports the load as failed, so finish them
            // now and repair below: returning `Ok` first would let the batch re-run on pages
            // that still hold garbage. (The repair's copy queues behind them on the load
            // stream anyway.) The wait's error is the failure the acks report.
            let _ = self.ctrl.wait_all();
        }
        // Every rank applies the same number of completed transfers (the fewest any has).
        let (w, l) = self.ctrl.ready_transfers();
        let w = self.consensus.min(w as u64) as usize;
        let l = self.consensus.min(l as u64) as usize;
        let mut acks = self.ctrl.poll_acks_upto(w, l);
        // The acks are all applied even when one fails, and the storage step's collectives
        // run whatever they gave: every rank makes the same consensus calls.
        let applied = self.apply_acks(&mut acks);
        let stored = self.storage_step();
        applied?;
        stored?;
        Ok(acks)
    }

    /// True when a step boundary of the host tier's transfers would change nothing: no
    /// transfer is queued, in flight or unacknowledged, no failed load waits for its repair,
    /// and there is no rank to agree with (every rank makes the same consensus calls, so a
    /// multi-rank cache never skips them).
    fn idle_boundary(&self) -> bool {
        self.consensus.is_single_rank() && self.ctrl.is_idle() && self.unrepaired.is_empty()
    }

    /// Blocks until every transfer started so far has completed, and applies nothing: queued
    /// operations stay queued, and the acks (a failed copy's included) are applied by the next
    /// call that polls them ([`HiRadixCache::step`], [`HiRadixCache::flush`], an allocation).
    /// For a harness that needs the copies done at a known point without charging the wait to
    /// the call that applies them; a serving scheduler never blocks on its copies.
    pub fn wait_transfers(&self) {
        // A failed copy has completed too: its failure is the polling call's to apply.
        let _ = self.ctrl.wait_all();
    }

    /// Starts everything queued, waits for every transfer and applies the acks.
    ///
    /// # Errors
    /// A failed copy, or a refused submission (its operations stay queued: flush again).
    pub fn flush(&mut self) -> HiResult<()> {
        if self.idle_boundary() {
            // Nothing to start, wait for, acknowledge or repair (a replay flushes after every
            // step, most of which moved nothing).
            return Ok(());
        }
        let started = self
            .ctrl
            .start_writing()
            .map(|_| ())
            .and(self.ctrl.start_loading().map(|_| ()));
        let waited = self.ctrl.wait_all();
        let mut acks = self.ctrl.poll_acks();
        self.apply_acks(&mut acks)?;
        match started {
            // The operations of a closed stream came back as failed acks, handled above.
            Ok(()) | Err(HiCacheError::StreamClosed(_)) => {}
            Err(e) => return Err(e),
        }
        // Failed copies were handled above; what is left to report is a failure that was not.
        waited.or_else(|e| if acks.has_failures() { Ok(()) } else { Err(e) })
    }

    /// Pre-insert view of `key`, kept only when events are on (to report nodes an insert makes
    /// device-resident again).
    /// `anchor`: a node on `key`'s path (see [`HiRadixCache::walk`]).
    fn pre_walk(
        &self,
        key: WalkKey<'_>,
        anchor: Option<NodeId>,
    ) -> radixkv_radix::Result<Option<TierWalk>> {
        let events = self.inner.tree().events_enabled();
        events.then(|| self.walk(key, anchor)).transpose()
    }

    /// [`RadixTree::tier_walk`] of `key`; with `anchor`, a node whose path from the root is a
    /// prefix of `key` (the node a request locked), only the tokens past it are compared. A
    /// request's key that dropped its cached prefix is walked from that anchor
    /// ([`RadixTree::tier_walk_tail`]), which it needs.
    fn walk(&self, key: WalkKey<'_>, anchor: Option<NodeId>) -> radixkv_radix::Result<TierWalk> {
        let t = self.inner.tree();
        let whole = match key {
            WalkKey::Whole(k) => k,
            WalkKey::Request(req, len) if req.key_start == 0 => req.key_prefix(len),
            WalkKey::Request(req, len) => {
                let Some(anchor) = anchor else {
                    return Err(CacheError::InvalidRequestState(
                        "a key without its cached prefix needs the lock anchor that ends it",
                    ));
                };
                let depth = t.depth_tokens(anchor)?;
                let tail = req
                    .key_tokens(depth, len)
                    .ok_or(CacheError::InvalidRequestState(
                        "the key's tokens start past its lock anchor",
                    ))?;
                let tail = KeyRef::with_namespace(tail, &req.key.namespace);
                return t.tier_walk_tail(anchor, depth, tail, &req.page_hashes);
            }
        };
        Ok(match anchor.map(|a| (a, t.depth_tokens(a))) {
            Some((a, Ok(depth))) => t.tier_walk_from(a, depth, whole),
            _ => t.tier_walk(whole),
        })
    }

    /// After an insert of `key`: report re-adopted nodes, back up per policy, start writes.
    /// `anchor` as for [`HiRadixCache::walk`].
    fn after_insert(
        &mut self,
        key: WalkKey<'_>,
        pre: Option<TierWalk>,
        anchor: Option<NodeId>,
    ) -> HiResult<()> {
        let readopted = pre.filter(|p| p.host_len > 0);
        // The walk of the key's path feeds the events of re-adopted nodes and the
        // write-through backups: under write-back with nothing re-adopted it is not made.
        if readopted.is_some() || self.backup_threshold().is_some() {
            let walk = self.walk(key, anchor)?;
            if let Some(pre) = readopted {
                self.report_readopted(&walk, &pre)?;
            }
            self.backup_path(&walk.nodes)?;
        }
        self.start_writes();
        Ok(())
    }

    /// Reports the nodes of `walk` (after an insert) that `pre` (before it) found on the host
    /// only: the insert made them device-resident again.
    fn report_readopted(&mut self, walk: &TierWalk, pre: &TierWalk) -> HiResult<()> {
        let (lo, hi) = (pre.device_len, pre.device_len + pre.host_len);
        let (tree, _) = self.inner.parts_mut();
        let mut depth = 0;
        for &n in &walk.nodes {
            let len = tree.node_key(n).map_or(0, <[u32]>::len);
            if depth >= lo && depth + len <= hi {
                tree.emit_stored_event(n, radixkv_radix::Medium::Device)?;
            }
            depth += len;
        }
        Ok(())
    }
}

impl<B: DeviceBackend> PrefixCache for HiRadixCache<B> {
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    fn page_hasher(&self) -> radixkv_radix::PageHasher {
        self.inner.page_hasher()
    }

    fn has_state_slots(&self) -> bool {
        self.inner.has_state_slots()
    }

    fn has_window_state(&self) -> bool {
        self.inner.has_window_state()
    }

    fn check_request(&self, req: &RequestKv) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_request(req)
    }

    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }

    fn check_parked(
        &self,
        req: &RequestKv,
        lock: Option<&LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_parked(req, lock)
    }

    /// Makes room for the full-KV pages first through this cache's own eviction (demoting
    /// backed-up KV), then lets the device tier allocate them (and, with sliding-window
    /// layers, as many SWA pages; when too few are free or evictable but pending backups pin
    /// some, those backups are completed first, counted in
    /// [`HiCacheStats::backups_awaited_for_room`]).
    fn alloc_tokens(&mut self, req: &mut RequestKv, n: usize) -> radixkv_radix::Result<()> {
        let (_, need) = pages_to_alloc(self, req, n)?;
        // Window pages that only pending backups pin come free at their acks.
        let short = self
            .inner
            .swa_accounting()
            .is_some_and(|a| a.free + a.evictable < need);
        if short && self.pending_writes.values().any(|w| !w.swa_pins.is_empty()) {
            self.stats.backups_awaited_for_room += 1;
            self.finish_pinned_backups()?;
        }
        // Short of SWA pages, the device tier refuses before anything is evicted.
        let swa_ok = self
            .inner
            .swa_accounting()
            .is_none_or(|a| a.free + a.evictable >= need);
        if need > 0 && swa_ok {
            self.make_room(need)?;
        }
        self.inner.alloc_tokens(req, n)
    }

    fn slide_window(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<usize> {
        self.inner.slide_window(req)
    }

    fn truncate_request(&mut self, req: &mut RequestKv, len: usize) -> radixkv_radix::Result<()> {
        self.inner.truncate_request(req, len)
    }

    fn pools(&self) -> &DevicePools {
        self.inner.pools()
    }

    fn pools_mut(&mut self) -> &mut DevicePools {
        self.inner.pools_mut()
    }

    fn match_prefix(
        &mut self,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> radixkv_radix::Result<TreeMatch> {
        self.inner.match_prefix(key, out)
    }

    fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &[PageId],
        opts: InsertOptions,
    ) -> radixkv_radix::Result<InsertResult> {
        let pre = self.pre_walk(WalkKey::Whole(key), None)?;
        let r = self.inner.insert(key, pages, opts)?;
        self.after_insert(WalkKey::Whole(key), pre, None)?;
        Ok(r)
    }

    fn evict(&mut self, tokens: usize) -> usize {
        self.evict_device(tokens)
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> radixkv_radix::Result<LockReceipt> {
        self.inner.inc_lock_ref(node)
    }

    fn dec_lock_ref(&mut self, receipt: LockReceipt) -> radixkv_radix::Result<()> {
        self.inner.dec_lock_ref(receipt)
    }

    fn evictable_tokens(&self) -> usize {
        self.inner.evictable_tokens()
    }

    fn protected_tokens(&self) -> usize {
        self.inner.protected_tokens()
    }

    /// Evicts; when evicting the unpinned KV alone cannot free `n` pages but completing the
    /// pending backups would unpin enough, first completes them
    /// ([`HiRadixCache::finish_pinned_backups`], counted in
    /// [`HiCacheStats::backups_awaited_for_room`]). Under write-back, eviction is first tried
    /// asynchronously ([`HiRadixCache::prepare_room`]); an allocation cannot wait a step, so
    /// when that frees too little now, the write-backs in flight are completed and eviction
    /// finishes synchronously (also counted in `backups_awaited_for_room`). A scheduler avoids
    /// that wait by calling [`HiRadixCache::prepare_room`] before it admits a request.
    fn make_room(&mut self, n: usize) -> radixkv_radix::Result<()> {
        let p = self.page_size();
        let free = self.pools().pages.available();
        if free < n && free + self.inner.evictable_tokens() / p < n {
            let pinned = self.backup_pinned_tokens();
            if pinned > 0 && free + (self.inner.evictable_tokens() + pinned) / p >= n {
                self.stats.backups_awaited_for_room += 1;
                self.finish_pinned_backups()?;
            }
        } else if free < n && self.policy == WritePolicy::WriteBack {
            self.evict_device_async((n - free) * p);
            if self.pools().pages.available() < n && self.write_back_tokens > 0 {
                self.stats.backups_awaited_for_room += 1;
                self.finish_pinned_backups()?;
            }
        }
        make_room_by_evicting(self, n)
    }

    /// Free plus evictable tokens, plus those only pending backups pin
    /// ([`HiRadixCache::backup_pinned_tokens`]): [`PrefixCache::make_room`] frees them too.
    fn available_tokens(&self) -> usize {
        self.pools().pages.available() * self.page_size()
            + self.inner.evictable_tokens()
            + self.backup_pinned_tokens()
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.inner.take_events()
    }

    fn events_dropped(&self) -> u64 {
        self.inner.events_dropped()
    }

    fn reset(&mut self) -> radixkv_radix::Result<()> {
        if let Err(e) = self.flush() {
            // Every KV is about to go, so a backup the backend refused need not wait for a
            // retry: it is undone like a failed one.
            // A repair that fails again here is not the reset's failure: its load was demoted
            // (dropped below with the rest) or a request still holds it (refused below).
            if let Err(e) = self.finish_writes_now()
                && self.unrepaired.is_empty()
            {
                return Err(e.into());
            }
            // A failed load whose repair failed again is left: its nodes were not demoted
            // because a request holds them, so the tree's reset below refuses (Busy), as for
            // any KV a request holds. (It returned the repair's error instead.)
            if self.ctrl.queued() != (0, 0) {
                // A refused load: it keeps its lock until its retry (at the next step) is
                // acknowledged, and its request may still hold the KV, so nothing may be
                // dropped: the reset is refused as for any outstanding lock. (It returned the
                // refusal instead, which no caller could tell from a broken cache.)
                tracing::debug!(error = %e, "reset refused: a load-back waits for its retry");
                return Err(radixkv_radix::CacheError::Busy(
                    "a load-back waits for the retry of its refused submission",
                ));
            }
        }
        // The tree's reset refuses while requests hold KV; the storage tier's state (the
        // prefetches' host pages above all) goes only once it has gone through, so that a
        // refused reset leaves the prefetches and backups in flight as they were.
        self.inner.reset()?;
        self.storage_reset();
        self.host_leaves.clear();
        self.unrepaired.clear();
        self.ctrl.reset()?;
        Ok(())
    }

    fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_invariants()?;
        let tree = self.inner.tree();
        let host = self.ctrl.host();
        let mut seen = vec![false; host.total()];
        let mut bad = None;
        let mut count = 0;
        tree.for_each_host_page(|n, h| {
            count += 1;
            match seen.get_mut(h as usize) {
                Some(s) if !*s && host.is_used(h) => *s = true,
                _ => {
                    bad.get_or_insert((n, h));
                }
            }
        });
        if let Some((n, h)) = bad {
            return Err(InvariantViolation(format!(
                "node {n:?}: host page {h} is out of range, free, or listed twice"
            )));
        }
        let deferred = self.ctrl.deferred_host_pages();
        let prefetched = self.storage_reserved_pages();
        if count + deferred + prefetched != host.used() {
            return Err(InvariantViolation(format!(
                "tree holds {count} host pages (+{deferred} awaiting loads, +{prefetched} \
                 reserved by prefetches) but {} are allocated",
                host.used()
            )));
        }
        if self.mamba {
            self.check_mamba_host()?;
        }
        if self.swa {
            self.check_swa_host()?;
        }
        let pending = self
            .pending_writes
            .values()
            .map(|w| usize::from(w.lock.is_some()) + w.state_locks.len() + w.victims.len())
            .sum::<usize>()
            + self.pending_loads.len();
        let victim_tokens: usize = self.pending_writes.values().map(|w| w.victim_tokens).sum();
        if victim_tokens != self.write_back_tokens {
            return Err(InvariantViolation(format!(
                "pending write-backs hold {victim_tokens} victim tokens but {} are counted",
                self.write_back_tokens
            )));
        }
        // A backup in flight reads the device pages of its nodes and victims: they stay on
        // the device (locked) until the ack.
        for w in self.pending_writes.values() {
            let victims = w.victims.iter().map(LockReceipt::anchor);
            for v in w.nodes.iter().copied().chain(victims) {
                if !tree.on_device(v).unwrap_or(false) {
                    return Err(InvariantViolation(format!(
                        "node {v:?} left the device while its backup is in flight"
                    )));
                }
            }
        }
        if pending > tree.outstanding_locks() {
            return Err(InvariantViolation(format!(
                "{pending} transfers pending but only {} locks outstanding",
                tree.outstanding_locks()
            )));
        }
        Ok(())
    }

    /// Without the Mamba and SWA components, the device tier's match (the host hit is the KV
    /// after the device prefix). With the Mamba component, the usable prefix ends at the
    /// deepest device node with a device state, and the host hit reaches the deepest node past
    /// it with a host copy of its state: `host_hit_len` is what a load-back of the host-only KV
    /// down to that node and of its state adds to the prefix (it counts device KV between the
    /// two without a state too). With the SWA component (alone or with the Mamba one), the
    /// same with the window rule, and both validators with both components (see the module
    /// docs, "Extra pools").
    fn match_request(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<RequestMatch> {
        req.check_whole_key()?;
        if self.inner.is_disabled() || !(self.mamba || self.swa) {
            return self.inner.match_request(req);
        }
        if self.swa {
            return self.match_request_swa(req);
        }
        self.match_request_mamba(req)
    }

    fn begin_request(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        if req.row.is_some() || req.lock.is_some() {
            return Err(CacheError::InvalidRequestState(
                "begin_request called twice",
            ));
        }
        // Checked before the load-back is queued (device pages taken, the host chain attached),
        // so that running out of rows changes nothing.
        self.pools().rows.ensure_available()?;
        let tree = self.inner.tree();
        let mamba = self.mamba;
        let anchor_ok = req.last_node.is_some_and(|n| {
            n == tree.root()
                || (tree.device_pages(n).is_ok_and(|p| !p.is_empty())
                    // A Mamba hit needs its device state still there.
                    && (!mamba || tree.mamba_state(n).is_ok_and(|s| s.is_some())))
        });
        if !anchor_ok {
            self.match_request(req)?;
        }
        if self.mamba {
            self.unpin_states_if_short()?;
        }
        if self.load_back_on_begin && req.host_hit_len > 0 {
            self.init_load_back(req, self.load_back_quota_tokens)?;
        }
        self.inner.begin_request(req)
    }

    fn cache_unfinished_req(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        // A key without its cached prefix is refused by the inner cache where the components
        // read the whole key (before anything changes: the walk below only reads).
        let aligned = align_down(req.committed_len, self.page_size());
        // The request's lock ends on its key's path: the walks compare only what lies past it.
        let before = req.lock.as_ref().map(LockReceipt::anchor);
        let pre = self.pre_walk(WalkKey::Request(req, aligned), before)?;
        self.inner.cache_unfinished_req(req)?;
        if req.cache_protected_len > 0 {
            let after = req.lock.as_ref().map(LockReceipt::anchor).or(before);
            self.after_insert(WalkKey::Request(req, req.cache_protected_len), pre, after)?;
        }
        Ok(())
    }

    fn cache_finished_req(
        &mut self,
        req: &mut RequestKv,
        kind: FinishKind,
    ) -> radixkv_radix::Result<()> {
        if let Some(refused) = refuse_partial_key_finish(self, req, kind) {
            return refused;
        }
        let aligned = align_down(req.committed_len, self.page_size());
        let inserted = kind == FinishKind::Finished && req.row.is_some() && aligned > 0;
        // The request's lock ends on its key's path (and keeps its id through the insert, which
        // splits below it only): the walks compare only what lies past it.
        let anchor = req.lock.as_ref().map(LockReceipt::anchor);
        let pre = if inserted {
            self.pre_walk(WalkKey::Request(req, aligned), anchor)
        } else {
            Ok(None)
        };
        // The inner finish releases the request whatever happens. A key the walk cannot read
        // (a dropped prefix whose anchor does not end where the key's tokens start) is one
        // its insert refuses too, and that refusal is the error returned.
        self.inner.cache_finished_req(req, kind)?;
        let pre = pre?;
        if inserted && !self.inner.is_disabled() {
            // The request state is cleared but its key is kept.
            self.after_insert(WalkKey::Request(req, aligned), pre, anchor)?;
        }
        Ok(())
    }

    fn takes_windowed_keys(&self) -> bool {
        // The host tier's walks take them; the inner cache's components may not.
        self.inner.takes_windowed_keys()
    }

    fn restore_key(&self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        self.inner.restore_key(req)
    }
}

/// The key of a host-tier walk: a whole key, or a request's first `len` tokens (of which it
/// may hold only those from [`RequestKv::key_start`] on).
#[derive(Clone, Copy)]
enum WalkKey<'a> {
    Whole(KeyRef<'a>),
    Request(&'a RequestKv, usize),
}

/// The controller's SWA pool for a tree of `pages` device SWA pages (see
/// [`HiRadixCache::new`]).
fn swa_pool_spec(cfg: &HiCacheConfig, pages: usize, host_pages: usize) -> HiResult<ExtraPoolSpec> {
    if cfg.extra_pools.iter().any(|p| p.name == PoolName::Swa) {
        return Err(HiCacheError::Config(
            "the SWA pool is derived from radix.swa; do not list it in extra_pools".into(),
        ));
    }
    let item_bytes = match cfg.swa_page_bytes {
        Some(b) if b > 0 => b,
        _ => {
            return Err(HiCacheError::Config(
                "sliding-window layers under a host tier need swa_page_bytes (at least 1)".into(),
            ));
        }
    };
    let device_slots = u32::try_from(pages).map_err(|_| {
        HiCacheError::Config(format!(
            "{pages} SWA pages do not fit the controller's pool"
        ))
    })?;
    let host_slots = match cfg.swa_host_pages {
        Some(0) => {
            return Err(HiCacheError::Config(
                "swa_host_pages must be at least 1".into(),
            ));
        }
        Some(n) => n,
        None => {
            let device = cfg.radix.total_pages.max(1) as u128;
            let share = (pages as u128 * host_pages as u128).div_ceil(device);
            u32::try_from(share.max(1)).unwrap_or(u32::MAX)
        }
    };
    Ok(ExtraPoolSpec {
        name: PoolName::Swa,
        host_slots,
        device_slots,
        item_bytes,
        device_owner: SlotOwner::Caller,
    })
}

/// The controller's Mamba pool for a tree of `slots` device slots (see [`HiRadixCache::new`]).
fn mamba_pool_spec(cfg: &HiCacheConfig, slots: u32, host_pages: usize) -> HiResult<ExtraPoolSpec> {
    if cfg.extra_pools.iter().any(|p| p.name == PoolName::Mamba) {
        return Err(HiCacheError::Config(
            "the Mamba pool is derived from radix.mamba_slots; do not list it in extra_pools"
                .into(),
        ));
    }
    let item_bytes = match cfg.mamba_state_bytes {
        Some(b) if b > 0 => b,
        _ => {
            return Err(HiCacheError::Config(
                "Mamba slots under a host tier need mamba_state_bytes (at least 1)".into(),
            ));
        }
    };
    let host_slots = match cfg.mamba_host_slots {
        Some(0) => {
            return Err(HiCacheError::Config(
                "mamba_host_slots must be at least 1".into(),
            ));
        }
        Some(n) => n,
        None => {
            let device = cfg.radix.total_pages.max(1) as u128;
            let share = (u128::from(slots) * host_pages as u128).div_ceil(device);
            u32::try_from(share.max(1)).unwrap_or(u32::MAX)
        }
    };
    Ok(ExtraPoolSpec {
        name: PoolName::Mamba,
        host_slots,
        device_slots: slots,
        item_bytes,
        device_owner: SlotOwner::Caller,
    })
}

/// Records a tiered match on the request: usable on the device up to `usable` tokens (node
/// `anchor`); `host_hit` is the deepest node a load-back reaches and its length, if any.
fn set_tiered_match(
    req: &mut RequestKv,
    usable: usize,
    anchor: NodeId,
    host_hit: Option<(NodeId, usize)>,
) -> RequestMatch {
    req.prefix_len = usable;
    req.last_node = Some(anchor);
    let (host_len, load_anchor) = match host_hit {
        Some((node, len)) => (len - usable, node),
        None => (0, anchor),
    };
    req.host_hit_len = host_len;
    req.load_anchor = Some(load_anchor);
    RequestMatch {
        prefix_len: usable,
        host_hit_len: host_len,
        from_session: false,
    }
}

#[cfg(test)]
mod write_policy_names {
    use super::WritePolicy;

    #[test]
    fn every_policy_round_trips_through_its_name() {
        for p in [
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective { hits: 1 },
            WritePolicy::WriteThroughSelective { hits: 7 },
            WritePolicy::WriteBack,
        ] {
            assert_eq!(WritePolicy::from_name(&p.to_string()), Some(p));
            assert_eq!(p.to_string().parse::<WritePolicy>(), Ok(p));
        }
        assert_eq!(
            WritePolicy::from_name("write_through_selective"),
            Some(WritePolicy::WriteThroughSelective { hits: 2 })
        );
        assert_eq!(
            WritePolicy::from_name("write-back"),
            Some(WritePolicy::WriteBack)
        );
        for bad in ["sometimes", "write_back:3", "write_through_selective:x", ""] {
            assert_eq!(WritePolicy::from_name(bad), None, "{bad}");
            assert!(bad.parse::<WritePolicy>().is_err(), "{bad}");
        }
    }
}
