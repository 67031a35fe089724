//! The Mamba component of the tree: state checkpoints on nodes, their slot pool, their locks
//! and their own eviction order.
//!
//! A Mamba (SSM) state is a *point* checkpoint: the recurrent state after the last token of a
//! node. It cannot be split, so when a node is split only the lower node (which keeps the
//! node's id and its last token) keeps the state; the new upper node has none. A match is
//! usable only up to the deepest node on the path that carries a state, even when the KV goes
//! deeper. A node's state may be dropped (a *tombstone*) while its KV stays; dropping a node's
//! device KV always drops its state (the cascade), because a state without the KV before it
//! cannot be resumed.
//!
//! The component lives beside the nodes, indexed by arena index, instead of in them: a tree
//! without the component (KV-only models) keeps its node layout and pays one branch on a
//! `None` where a node leaves the device. Its own counters, lock counts and LRU order are
//! independent of the KV's, which is the shape a further component (sliding-window KV) takes
//! too (see the crate docs).

use std::collections::BTreeSet;

use super::*;
use crate::mamba_policy::{
    CheckpointKind, EVICTION_BATCH_DIV, MambaPolicy, MambaStats, MarconiParams,
};
use crate::slots::{SlotState, StateSlotPool};
use crate::types::ComponentAccounting;

/// Per-node Mamba data, indexed by the node's arena index. `slot == NIL`: no state on device;
/// `host == NIL`: no host copy of the state (tiered caches, see `mamba_tier`).
#[derive(Copy, Clone, Debug)]
pub(super) struct MambaNode {
    pub(super) slot: u32,
    /// The host slot holding a copy of the state (an index of the owner's host pool).
    pub(super) host: u32,
    /// Requests that locked this node's state (each also locks the node's KV path).
    pub(super) lock: u32,
    /// The component's own recency tick (the LRU key while unlocked).
    pub(super) tick: u64,
    /// The generation of the node that got the state (device or host): the audit catches a
    /// state left behind by a removed node whose arena index was reused.
    pub(super) generation: u32,
    /// Why the state was stored ([`CheckpointKind`] as its index).
    pub(super) kind: u8,
}

pub(super) const NO_STATE: MambaNode = MambaNode {
    slot: NIL,
    host: NIL,
    lock: 0,
    tick: 0,
    generation: 0,
    kind: 0,
};

/// The Mamba component of a [`RadixTree`] (see the module docs).
#[derive(Debug)]
pub(crate) struct MambaComponent {
    pub(super) pool: StateSlotPool,
    pub(super) nodes: Vec<MambaNode>,
    /// Unlocked states by (tick, node index): the eviction order under slot pressure.
    pub(super) lru: BTreeSet<(u64, u32)>,
    /// Tree-held states that are locked.
    protected: usize,
    clock: u64,
    /// Utility eviction ([`MambaPolicy::Marconi`]); `None`: least recently used first.
    utility: Option<MarconiParams>,
    /// Mamba-aware KV eviction ([`MarconiParams::dead_end_kv_first`]): the tree's eviction
    /// policy keeps the leaves whose node has a state (on device or host) in
    /// [`LeafClass::Later`], the dead-end ones in [`LeafClass::First`]. Off: every leaf is
    /// `First` and nothing is recorded (no cost).
    pub(super) dead_end_first: bool,
    /// Nodes whose state (device or host) appeared or went since the tree last brought their
    /// leaf class in line ([`RadixTree::apply_leaf_classes`]); only while `dead_end_first`.
    /// Empty between the tree's public calls.
    pub(super) moved: Vec<u32>,
    stats: MambaStats,
}

impl MambaComponent {
    fn new(slots: u32) -> Result<Self> {
        Ok(MambaComponent {
            pool: StateSlotPool::new(slots)?,
            nodes: Vec::new(),
            lru: BTreeSet::new(),
            protected: 0,
            clock: 0,
            utility: None,
            dead_end_first: false,
            moved: Vec::new(),
            stats: MambaStats::default(),
        })
    }

    #[inline]
    pub(super) fn get(&self, idx: u32) -> MambaNode {
        self.nodes.get(idx as usize).copied().unwrap_or(NO_STATE)
    }

    pub(super) fn entry(&mut self, idx: u32) -> &mut MambaNode {
        if idx as usize >= self.nodes.len() {
            self.nodes.resize(idx as usize + 1, NO_STATE);
        }
        &mut self.nodes[idx as usize]
    }

    pub(super) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// True when node `idx` carries a state.
    pub(super) fn has_state(&self, idx: u32) -> bool {
        self.get(idx).slot != NIL
    }

    /// True when node `idx` has a state on device or a host copy of one (a leaf there is not
    /// dead-end KV).
    #[inline]
    pub(super) fn keeps_state(&self, idx: u32) -> bool {
        let e = self.get(idx);
        e.slot != NIL || e.host != NIL
    }

    /// Notes that node `idx`'s state (device or host) appeared or went, so that the tree moves
    /// it to its leaf class if it is a leaf (while dead-end tracking is on).
    #[inline]
    pub(super) fn state_changed(&mut self, idx: u32) {
        if self.dead_end_first {
            self.moved.push(idx);
        }
    }

    /// Drops node `idx`'s state if it has one and it is unlocked (the cascade of a component
    /// with a higher eviction priority on the same node). Returns whether it went.
    pub(super) fn drop_unlocked_state(&mut self, idx: u32) -> bool {
        let e = self.get(idx);
        e.slot != NIL && e.lock == 0 && self.drop_state(idx)
    }

    /// Refreshes the recency of `idx`'s (unlocked or locked) state.
    pub(super) fn touch(&mut self, idx: u32) {
        let now = self.tick();
        let e = self.entry(idx);
        let old = std::mem::replace(&mut e.tick, now);
        if e.lock == 0 {
            self.lru.remove(&(old, idx));
            self.lru.insert((now, idx));
        }
    }

    /// Drops the state of node `idx` (which must be unlocked), freeing its slot. Returns
    /// whether there was one.
    pub(super) fn drop_state(&mut self, idx: u32) -> bool {
        self.drop_state_counted(idx, true)
    }

    /// [`MambaComponent::drop_state`] for a node whose device KV goes with it (the cascade of
    /// a KV eviction): it is no leaf any more, so no leaf class is to be moved.
    pub(super) fn drop_state_with_kv(&mut self, idx: u32) -> bool {
        self.drop_state_counted(idx, false)
    }

    fn drop_state_counted(&mut self, idx: u32, note: bool) -> bool {
        let kind = CheckpointKind::from_index(self.get(idx).kind);
        let dropped = self.drop_state_uncounted(idx, note);
        if dropped {
            self.stats.kind_mut(kind).evicted += 1;
        }
        dropped
    }

    /// Drops the state; `note`: record it for the leaf classes ([`MambaComponent::moved`]).
    fn drop_state_uncounted(&mut self, idx: u32, note: bool) -> bool {
        let e = self.get(idx);
        if e.slot == NIL {
            return false;
        }
        debug_assert_eq!(e.lock, 0, "dropping a locked Mamba state");
        self.lru.remove(&(e.tick, idx));
        // The slot is tree-held by the component's invariant; a failure here is a bug the
        // audit reports (the slot stays where it is).
        let freed = self.pool.free_tree(e.slot);
        debug_assert!(freed.is_ok(), "Mamba slot {} was not tree-held", e.slot);
        // A host copy of the state stays (with the generation and the kind it was stored as).
        self.nodes[idx as usize] = MambaNode {
            host: e.host,
            generation: e.generation,
            kind: e.kind,
            ..NO_STATE
        };
        if note {
            self.state_changed(idx);
        }
        true
    }

    /// Frees every tree-held state and forgets every host copy (a reset: no lock is
    /// outstanding; the owner resets its host pool).
    pub(super) fn clear_tree_states(&mut self) {
        for i in 0..self.nodes.len() as u32 {
            self.drop_state_uncounted(i, false);
        }
        self.nodes.clear();
        self.lru.clear();
        self.protected = 0;
        self.moved.clear();
    }
}

/// Result of [`RadixTree::match_mamba`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MambaMatch {
    /// The KV match as [`RadixTree::match_prefix`] found it: `kv.device_len` is how far the
    /// device KV went. When it passes `usable_len`, the forward pass should checkpoint the
    /// state at `kv.device_len` so that the next request on this path hits there.
    pub kv: TreeMatch,
    /// Leading tokens the request may reuse: the depth of the deepest device node on the path
    /// that carries a Mamba state (0 when none does). The pages appended to `out` cover
    /// exactly this prefix.
    pub usable_len: usize,
    /// The node that ends `usable_len` (the root when 0): the lock anchor.
    pub anchor: NodeId,
    /// The state slot of `anchor` (`None` when `usable_len` is 0).
    pub state_slot: Option<u32>,
}

/// A copy the device backend must perform before the request's first forward: the cached state
/// in `src` into the request's own slot `dst` (copy on write; the tree never copies bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MambaCow {
    /// The tree-held state (locked by the receipt that asked for the copy).
    pub src: u32,
    /// The request's new slot.
    pub dst: u32,
}

/// What [`RadixTree::insert_mamba_state`] did with the request's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MambaInsert {
    /// The slot became the node's state.
    Stored,
    /// The node already had a state: the request's slot was freed (and the cached state's
    /// recency refreshed).
    AlreadyCached,
    /// The tree also has the sliding-window component and the node's window KV is a
    /// tombstone: a state there could not be resumed (no match ends there until a later
    /// insert revives the window), so the request's slot was freed.
    WindowTombstone,
}

impl RadixTree {
    /// Adds the Mamba component with a pool of `slots` state slots. Only an empty tree can
    /// gain it.
    ///
    /// # Errors
    /// [`CacheError::Config`] for 0 slots, a tree that already has the component, or one that
    /// holds nodes.
    pub fn enable_mamba(&mut self, slots: u32) -> Result<()> {
        self.check_can_add_component("Mamba", self.mamba.is_some())?;
        self.mamba = Some(Box::new(MambaComponent::new(slots)?));
        Ok(())
    }

    /// True when the tree has the Mamba component.
    pub fn mamba_enabled(&self) -> bool {
        self.mamba.is_some()
    }

    /// Sets how states are evicted under slot pressure: least recently used first
    /// ([`MambaPolicy::Sglang`]) or by utility ([`MambaPolicy::Marconi`]; see
    /// [`crate::mamba_policy`]). Admission is the caller's (a [`crate::RadixCache`] applies
    /// the rest of the policy).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`]; [`CacheError::PolicyParam`] (nothing changes then).
    pub fn set_mamba_policy(&mut self, policy: &MambaPolicy) -> Result<()> {
        policy.validate()?;
        self.mamba_ref()?;
        let track = policy.marconi().is_some_and(|p| p.dead_end_kv_first);
        if track && !self.policy.supports_classes() {
            return Err(CacheError::PolicyParam {
                param: "dead_end_kv_first",
                reason: "the tree's eviction policy keeps no leaf classes",
            });
        }
        let m = self.mamba_mut()?;
        m.utility = policy.marconi().copied();
        if track != m.dead_end_first {
            m.dead_end_first = track;
            m.moved.clear();
            // Refill the policy with every leaf in its class (O(nodes); a policy is set once,
            // normally on an empty tree).
            self.rebuild_policy();
        }
        Ok(())
    }

    /// Evictable device leaves that carry no Mamba state (on device or host): *dead-end* KV,
    /// whose tokens no match can use, since a match is usable only up to the deepest node
    /// with a state. Under [`MarconiParams::dead_end_kv_first`] (the Marconi default) the
    /// eviction policy keeps them in [`LeafClass::First`], so every eviction
    /// ([`RadixTree::evict`], [`RadixTree::pop_victim`]) takes these first; `None` while that
    /// is off or without the component.
    pub fn dead_end_leaves(&self) -> Option<usize> {
        self.mamba
            .as_deref()
            .filter(|m| m.dead_end_first)
            .map(|_| self.policy.class_len(LeafClass::First))
    }

    /// The class a leaf at node `idx` belongs in (see [`MambaComponent::dead_end_first`]).
    #[inline]
    pub(super) fn leaf_class(&self, idx: u32) -> LeafClass {
        match self.mamba.as_deref() {
            Some(m) if m.dead_end_first && m.keeps_state(idx) => LeafClass::Later,
            _ => LeafClass::First,
        }
    }

    /// Moves every leaf whose state appeared or went since the last call into its class
    /// ([`MambaComponent::moved`]): `O(1)` (LRU, MRU, reuse) or `O(log n)` per node in the
    /// policy, which keeps what it records about the leaf. Called at the end of every tree
    /// method that stores, drops or loads a state, and before a victim is popped.
    pub(super) fn apply_leaf_classes(&mut self) {
        let Some(m) = self.mamba.as_deref_mut() else {
            return;
        };
        if m.moved.is_empty() {
            return;
        }
        let mut moved = std::mem::take(&mut m.moved);
        for &idx in &moved {
            // A node that is no leaf (any more) is placed by `update_leaf` when it becomes one.
            let Some(tok) = self.nodes.get(idx as usize).and_then(|n| n.leaf) else {
                continue;
            };
            let (class, id) = (self.leaf_class(idx), self.id_of(idx));
            self.nodes[idx as usize].leaf = Some(self.policy.set_class(id, tok, class));
        }
        moved.clear();
        if let Some(m) = self.mamba.as_deref_mut() {
            m.moved = moved;
        }
    }

    /// The Mamba state counters per checkpoint kind.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`].
    pub fn mamba_stats(&self) -> Result<MambaStats> {
        Ok(self.mamba_ref()?.stats)
    }

    /// The Mamba counters, mutably (`None` without the component).
    pub(crate) fn mamba_stats_mut(&mut self) -> Option<&mut MambaStats> {
        self.mamba.as_deref_mut().map(|m| &mut m.stats)
    }

    /// Counts a checkpoint of `kind` that was not taken (admission refused it, or no slot).
    pub(crate) fn mamba_count_skip(&mut self, kind: CheckpointKind) {
        if let Some(m) = self.mamba.as_deref_mut() {
            m.stats.kind_mut(kind).skipped += 1;
        }
    }

    /// The checkpoint kind of node `id`'s state (`None`: no state).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn mamba_state_kind(&self, id: NodeId) -> Result<Option<CheckpointKind>> {
        let idx = self.resolve(id)?;
        let e = self.mamba_ref()?.get(idx);
        Ok((e.slot != NIL).then(|| CheckpointKind::from_index(e.kind)))
    }

    /// Where `key` (truncated to whole pages) leaves the tree's device paths at a *branch
    /// point*: the depth of the deepest common prefix when the key goes on past it and the
    /// cached path there either goes on inside the same edge or has other device children.
    /// 0 when there is none (nothing shared, the key stays on a cached path to its end, or it
    /// only extends a cached leaf). Read-only: no split, no recency change.
    pub fn mamba_branch_point(&self, key: KeyRef<'_>) -> usize {
        // Through the tiers' read-only walk: one more caller of the child lookup would change
        // how the compiler inlines it on the KV-only hot paths.
        let walk = self.tier_walk(key);
        let whole = key.tokens.len() - key.tokens.len() % self.page_size;
        let pos = walk.device_len;
        if pos == 0 || pos >= whole {
            return 0;
        }
        let full: usize = walk
            .nodes
            .iter()
            .filter_map(|&n| self.resolve(n).ok())
            .map(|i| self.nodes[i as usize].key.len())
            .sum();
        // Diverges inside an edge, or at the end of a node whose path continues elsewhere.
        let last = walk.nodes.last().and_then(|&n| self.resolve(n).ok());
        let branches =
            pos > full || last.is_some_and(|i| self.nodes[i as usize].device_children > 0);
        if branches { pos } else { 0 }
    }

    /// The device node that ends exactly `len` tokens into `key` (page-aligned), splitting the
    /// node that straddles it. Recency is not changed.
    ///
    /// # Errors
    /// [`CacheError::Misaligned`]; [`CacheError::InvalidRequestState`] when `len` is 0, past
    /// the key, or past the device KV on its path (nothing changes then).
    pub fn mamba_node_at(&mut self, key: KeyRef<'_>, len: usize) -> Result<NodeId> {
        let p = self.page_size;
        if !len.is_multiple_of(p) {
            return Err(CacheError::Misaligned { len, page_size: p });
        }
        if len == 0 || len > key.tokens.len() {
            return Err(CacheError::InvalidRequestState(
                "a checkpoint position inside the key is needed",
            ));
        }
        // Check first (read-only), so that a failure splits nothing.
        if self.tier_walk(key.prefix(len)).device_len < len {
            return Err(CacheError::InvalidRequestState(
                "the checkpoint position is past the device KV",
            ));
        }
        let (mut node, mut pos) = (self.root, 0);
        while pos < len {
            let Some((child, common)) = self.step_down(node, key.prefix(len), pos) else {
                break;
            };
            pos += common;
            node = child;
        }
        Ok(self.id_of(node))
    }

    pub(super) fn mamba_ref(&self) -> Result<&MambaComponent> {
        self.mamba
            .as_deref()
            .ok_or(CacheError::ComponentDisabled("mamba"))
    }

    pub(super) fn mamba_mut(&mut self) -> Result<&mut MambaComponent> {
        self.mamba
            .as_deref_mut()
            .ok_or(CacheError::ComponentDisabled("mamba"))
    }

    /// The Mamba slot pool.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component.
    pub fn mamba_pool(&self) -> Result<&StateSlotPool> {
        Ok(&self.mamba_ref()?.pool)
    }

    /// Where every Mamba slot is.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component.
    pub fn mamba_accounting(&self) -> Result<ComponentAccounting> {
        let m = self.mamba_ref()?;
        Ok(ComponentAccounting {
            total: m.pool.total(),
            free: m.pool.available(),
            evictable: m.lru.len(),
            protected: m.protected,
            request_owned: m.pool.request_slots(),
        })
    }

    /// The Mamba state slot of node `id` (`None`: no state, or a tombstone).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn mamba_state(&self, id: NodeId) -> Result<Option<u32>> {
        let idx = self.resolve(id)?;
        let e = self.mamba_ref()?.get(idx);
        Ok((e.slot != NIL).then_some(e.slot))
    }

    /// The Mamba lock count of node `id`.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn mamba_lock_ref(&self, id: NodeId) -> Result<u32> {
        let idx = self.resolve(id)?;
        Ok(self.mamba_ref()?.get(idx).lock)
    }

    /// Every node that carries a Mamba state, with its slot (`O(nodes)`, for audits and tests).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`].
    pub fn mamba_states(&self) -> Result<Vec<(NodeId, u32)>> {
        let m = self.mamba_ref()?;
        Ok(m.nodes
            .iter()
            .enumerate()
            .filter(|(_, e)| e.slot != NIL)
            // The generation the state was stored under: a state left behind by a removed node
            // shows as a stale handle, not as the node that reuses the index.
            .map(|(i, e)| {
                let id = NodeId {
                    idx: i as u32,
                    generation: e.generation,
                };
                (id, e.slot)
            })
            .collect())
    }

    /// Longest prefix of `key` whose KV is on device **and** that ends at a Mamba state:
    /// the KV match of [`RadixTree::match_prefix`] cut back to the deepest device node on its
    /// path that carries a state. Appends the pages of the usable prefix only to `out`. The
    /// used state's recency is refreshed (the KV path's as in `match_prefix`). Takes no lock.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component (nothing changes then).
    pub fn match_mamba(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<MambaMatch> {
        self.mamba_ref()?;
        let start = out.len();
        let kv = self.match_prefix(key, out);
        let mut i = self.resolve(kv.last_device)?;
        let mut depth = kv.device_len;
        {
            let m = self.mamba_ref()?;
            while i != self.root && m.get(i).slot == NIL {
                depth -= self.nodes[i as usize].key.len();
                i = self.nodes[i as usize].parent;
            }
        }
        out.truncate(start + depth / self.page_size);
        let at_root = i == self.root;
        let m = self.mamba_mut()?;
        let slot = (!at_root).then(|| {
            m.touch(i);
            m.get(i).slot
        });
        Ok(MambaMatch {
            kv,
            usable_len: depth,
            anchor: self.id_of(i),
            state_slot: slot,
        })
    }

    /// Locks the root path of `node` like [`RadixTree::inc_lock_ref`] **and** the node's Mamba
    /// state, so that neither its KV nor its state can be evicted until the receipt is handed
    /// back to [`RadixTree::dec_lock_ref`].
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] when the node carries no state. Nothing changes on
    /// error.
    pub fn inc_lock_ref_mamba(&mut self, node: NodeId) -> Result<LockReceipt> {
        let idx = self.resolve(node)?;
        if self.mamba_ref()?.get(idx).slot == NIL {
            return Err(CacheError::InvalidRequestState(
                "the node carries no Mamba state to lock",
            ));
        }
        let mut receipt = self.inc_lock_ref(node)?;
        self.mamba_lock(idx);
        receipt.mamba = true;
        Ok(receipt)
    }

    /// Locks the root path of `node`, the window KV before its end (as
    /// [`RadixTree::inc_lock_ref_swa`]) **and** its Mamba state (as
    /// [`RadixTree::inc_lock_ref_mamba`]), in one receipt: what a match of a tree with both
    /// components needs.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] unless both components are on,
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the node carries
    /// no state or part of its window is a tombstone. Nothing changes on error.
    pub fn inc_lock_ref_swa_mamba(&mut self, node: NodeId) -> Result<LockReceipt> {
        let idx = self.resolve(node)?;
        if self.mamba_ref()?.get(idx).slot == NIL {
            return Err(CacheError::InvalidRequestState(
                "the node carries no Mamba state to lock",
            ));
        }
        // Splits keep `node`'s id (and its state) on the lower part.
        let mut receipt = self.inc_lock_ref_swa(node)?;
        self.mamba_lock(idx);
        receipt.mamba = true;
        Ok(receipt)
    }

    /// Adds one Mamba lock to node `idx`'s state (which it has).
    fn mamba_lock(&mut self, idx: u32) {
        if let Some(m) = self.mamba.as_deref_mut() {
            let e = *m.entry(idx);
            if e.lock == 0 {
                m.lru.remove(&(e.tick, idx));
                m.protected += 1;
            }
            m.entry(idx).lock += 1;
        }
    }

    /// Releases the Mamba lock a receipt holds (validation happens before; see
    /// [`RadixTree::dec_lock_ref`]). A state whose window KV was tombstoned while it was
    /// locked goes now: the cascade (SWA before Mamba) that its lock deferred.
    pub(super) fn mamba_unlock(&mut self, idx: u32) {
        let tombstone = self.swa.as_deref().is_some_and(|w| !w.live(idx));
        if let Some(m) = self.mamba.as_deref_mut() {
            let e = m.entry(idx);
            e.lock -= 1;
            if e.lock == 0 {
                let t = e.tick;
                m.lru.insert((t, idx));
                m.protected -= 1;
                if tombstone {
                    m.drop_unlocked_state(idx);
                }
            }
        }
        self.apply_leaf_classes();
    }

    /// The Mamba lock count of `idx` (0 without the component).
    pub(super) fn mamba_lock_at(&self, idx: u32) -> u32 {
        self.mamba.as_deref().map_or(0, |m| m.get(idx).lock)
    }

    /// A fresh slot for a request's running state. When none is free, unlocked states are
    /// evicted (their nodes keep their KV): the least recently used one, or under
    /// [`MambaPolicy::Marconi`] the `max(1, slots / 64)` of lowest utility.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`]; [`CacheError::OutOfStateSlots`] when no slot is free
    /// and every cached state is locked (nothing changes then).
    pub fn alloc_mamba_slot(&mut self) -> Result<u32> {
        let m = self.mamba_ref()?;
        if m.pool.available() == 0 {
            // Utility eviction scans every candidate: take a batch per scan. Nothing evicted
            // (every state locked) leaves the pool empty: the error below.
            let batch = if m.utility.is_some() {
                (m.pool.total() / EVICTION_BATCH_DIV).max(1)
            } else {
                1
            };
            self.evict_mamba(batch);
        }
        let m = self.mamba_mut()?;
        m.pool.alloc_request().ok_or(CacheError::OutOfStateSlots {
            component: "mamba",
            capacity: m.pool.total(),
        })
    }

    /// Returns a request's slot to the pool (abort, retract, or a finish that caches no state).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::SlotOutOfRange`];
    /// [`CacheError::SlotState`] for a slot no request holds (a double free).
    pub fn free_mamba_slot(&mut self, slot: u32) -> Result<()> {
        self.mamba_mut()?.pool.free_request(slot)
    }

    /// Copy on write for a hit: allocates the request's own slot (evicting an unlocked state
    /// if the pool is full; the receipt's state is locked, so it is never the victim) and
    /// returns the copy the device backend must perform. Counts a hit of the state's
    /// [`CheckpointKind`] ([`RadixTree::mamba_stats`]).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`]; [`CacheError::StaleReceipt`] for a receipt of another
    /// tree, whose anchor is gone, or that holds no Mamba lock;
    /// [`CacheError::OutOfStateSlots`] (nothing changes then).
    pub fn cow_mamba(&mut self, receipt: &LockReceipt) -> Result<MambaCow> {
        if receipt.tree_id != self.tree_id || !receipt.mamba {
            return Err(CacheError::StaleReceipt);
        }
        let idx = self
            .resolve(receipt.anchor)
            .map_err(|_| CacheError::StaleReceipt)?;
        let e = self.mamba_ref()?.get(idx);
        if e.slot == NIL {
            return Err(CacheError::StaleReceipt);
        }
        let dst = self.alloc_mamba_slot()?;
        let depth = self.depth_of(idx);
        let k = self
            .mamba_mut()?
            .stats
            .kind_mut(CheckpointKind::from_index(e.kind));
        k.hits += 1;
        k.hit_tokens += depth as u64;
        Ok(MambaCow { src: e.slot, dst })
    }

    /// Stores a request's state `slot` as the checkpoint of `node` (the state after the node's
    /// last token), at the end of the request. When the node already carries a state, the
    /// request's slot is freed instead. Either way the request no longer holds the slot.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`],
    /// [`CacheError::SlotOutOfRange`], [`CacheError::SlotState`] for a slot no request holds;
    /// [`CacheError::InvalidRequestState`] for the root or a node whose KV is not on device.
    /// Nothing changes on error.
    pub fn insert_mamba_state(&mut self, node: NodeId, slot: u32) -> Result<MambaInsert> {
        self.insert_mamba_state_as(node, slot, CheckpointKind::RequestEnd)
    }

    /// [`RadixTree::insert_mamba_state`] for a checkpoint of the given kind (recorded with the
    /// state for [`RadixTree::mamba_stats`]).
    ///
    /// # Errors
    /// As [`RadixTree::insert_mamba_state`].
    pub fn insert_mamba_state_as(
        &mut self,
        node: NodeId,
        slot: u32,
        kind: CheckpointKind,
    ) -> Result<MambaInsert> {
        let idx = self.resolve(node)?;
        let m = self.mamba_ref()?;
        if m.pool.state(slot)? != SlotState::Request {
            return Err(CacheError::SlotState {
                slot,
                expected: "held by a request",
            });
        }
        if idx == self.root || !self.nodes[idx as usize].on_device() {
            return Err(CacheError::InvalidRequestState(
                "a Mamba state needs a node whose KV is on device",
            ));
        }
        let generation = self.generations[idx as usize];
        let window_dead = self.swa.as_deref().is_some_and(|w| !w.live(idx));
        let m = self.mamba_mut()?;
        if window_dead && m.get(idx).slot == NIL {
            m.pool.free_request(slot)?;
            return Ok(MambaInsert::WindowTombstone);
        }
        if m.get(idx).slot != NIL {
            m.pool.free_request(slot)?;
            m.touch(idx);
            return Ok(MambaInsert::AlreadyCached);
        }
        m.pool.request_to_tree(slot)?;
        let e = m.entry(idx);
        e.slot = slot;
        e.generation = generation;
        e.kind = kind as u8;
        debug_assert_eq!(e.lock, 0);
        m.stats.kind_mut(kind).stored += 1;
        let now = m.tick();
        m.entry(idx).tick = now;
        m.lru.insert((now, idx));
        m.state_changed(idx);
        self.apply_leaf_classes();
        Ok(MambaInsert::Stored)
    }

    /// Evicts up to `n` unlocked Mamba states: least recently used first, or under
    /// [`MambaPolicy::Marconi`] lowest utility first (see [`crate::mamba_policy`]). Their nodes
    /// keep their KV (they become tombstones for the Mamba component). Returns the states
    /// evicted; 0 without the component.
    pub fn evict_mamba(&mut self, n: usize) -> usize {
        let Some(m) = self.mamba.as_deref_mut() else {
            return 0;
        };
        let done = if let Some(params) = m.utility {
            self.evict_mamba_by_utility(n, &params)
        } else {
            let mut done = 0;
            while done < n {
                let Some(&(_, idx)) = m.lru.first() else {
                    break;
                };
                m.drop_state(idx);
                done += 1;
            }
            done
        };
        self.apply_leaf_classes();
        done
    }

    /// The `n` unlocked states of lowest utility, evicted in one scan of the candidates.
    fn evict_mamba_by_utility(&mut self, n: usize, params: &MarconiParams) -> usize {
        let Some(m) = self.mamba.as_deref() else {
            return 0;
        };
        if n == 0 || m.lru.is_empty() {
            return 0;
        }
        let (Some(&(oldest, _)), Some(&(newest, _))) = (m.lru.first(), m.lru.last()) else {
            return 0;
        };
        let span = newest.saturating_sub(oldest) as f64;
        // (recency, efficiency, idx) per candidate, in LRU order.
        let mut scored: Vec<(f64, f64, u32)> = Vec::with_capacity(m.lru.len());
        let mut max_eff = 0.0f64;
        for &(tick, idx) in &m.lru {
            // Depth of the state (L) and of its nearest ancestor with a state (A; 0 for none).
            let (mut depth, mut below_ancestor) = (0usize, None);
            let mut i = idx;
            while i != self.root {
                depth += self.nodes[i as usize].key.len();
                i = self.nodes[i as usize].parent;
                if below_ancestor.is_none() && i != self.root && m.get(i).slot != NIL {
                    below_ancestor = Some(depth);
                }
            }
            let ancestor = below_ancestor.map_or(0, |b| depth - b);
            let eff = params.efficiency(depth, ancestor);
            max_eff = max_eff.max(eff);
            let recency = if span > 0.0 {
                (tick - oldest) as f64 / span
            } else {
                0.0
            };
            scored.push((recency, eff, idx));
        }
        // (utility, LRU order, idx): the LRU order breaks ties.
        let mut utility: Vec<(f64, usize, u32)> = scored
            .iter()
            .enumerate()
            .map(|(order, &(recency, eff, idx))| {
                let eff = if max_eff > 0.0 { eff / max_eff } else { 0.0 };
                (recency + params.alpha * eff, order, idx)
            })
            .collect();
        let k = n.min(utility.len());
        let cmp =
            |a: &(f64, usize, u32), b: &(f64, usize, u32)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
        if k < utility.len() {
            utility.select_nth_unstable_by(k - 1, cmp);
        }
        let Some(m) = self.mamba.as_deref_mut() else {
            return 0;
        };
        for &(_, _, idx) in &utility[..k] {
            m.drop_state(idx);
        }
        k
    }

    /// Evicts the Mamba state of `node` only (its KV stays).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] when the node has no state or it is locked.
    pub fn evict_mamba_state(&mut self, node: NodeId) -> Result<()> {
        let idx = self.resolve(node)?;
        let m = self.mamba_mut()?;
        let e = m.get(idx);
        if e.slot == NIL || e.lock > 0 {
            return Err(CacheError::InvalidRequestState(
                "only an unlocked Mamba state can be evicted",
            ));
        }
        m.drop_state(idx);
        self.apply_leaf_classes();
        Ok(())
    }

    /// The Mamba part of [`RadixTree::check`].
    pub(super) fn check_mamba(&self) -> std::result::Result<(), InvariantViolation> {
        let Some(m) = self.mamba.as_deref() else {
            return Ok(());
        };
        m.pool.check()?;
        let mut seen = vec![false; m.pool.total()];
        let (mut states, mut protected, mut unlocked) = (0usize, 0usize, 0usize);
        self.check_mamba_host(m)?;
        for (i, e) in m.nodes.iter().enumerate() {
            let k = i as u32;
            if e.slot == NIL {
                ensure_inv!(
                    e.lock == 0,
                    "node {k}: Mamba lock {} without a state",
                    e.lock
                );
                continue;
            }
            ensure_inv!(
                k != self.root && self.is_live(k, e.generation),
                "Mamba slot {} held by dead node or root {k}",
                e.slot
            );
            let n = &self.nodes[i];
            ensure_inv!(
                n.on_device(),
                "node {k} holds Mamba slot {} without device KV",
                e.slot
            );
            ensure_inv!(
                m.pool.state(e.slot) == Ok(SlotState::Tree),
                "node {k}: Mamba slot {} is not tree-held",
                e.slot
            );
            ensure_inv!(
                !seen[e.slot as usize],
                "Mamba slot {} held by two nodes",
                e.slot
            );
            seen[e.slot as usize] = true;
            ensure_inv!(
                e.lock <= n.lock_ref,
                "node {k}: Mamba lock {} > KV lock {}",
                e.lock,
                n.lock_ref
            );
            // The cascade (SWA before Mamba on a node): an unlocked state never sits on a node
            // whose window KV is a tombstone.
            ensure_inv!(
                e.lock > 0 || self.swa.as_deref().is_none_or(|w| w.live(k)),
                "node {k}: an unlocked Mamba state on a window tombstone"
            );
            states += 1;
            if e.lock > 0 {
                protected += 1;
            } else {
                unlocked += 1;
                ensure_inv!(
                    m.lru.contains(&(e.tick, k)),
                    "node {k}: unlocked Mamba state missing from the LRU"
                );
            }
        }
        ensure_inv!(
            states == m.pool.tree_slots(),
            "{states} nodes hold Mamba states, the pool has {} tree-held slots",
            m.pool.tree_slots()
        );
        ensure_inv!(
            unlocked == m.lru.len() && protected == m.protected,
            "Mamba LRU holds {} (tree: {unlocked} unlocked), protected counter {} (tree: {protected})",
            m.lru.len(),
            m.protected
        );
        if m.dead_end_first {
            ensure_inv!(
                m.moved.is_empty(),
                "{} state changes not applied to the leaf classes",
                m.moved.len()
            );
            let (mut dead, mut live) = (0usize, 0usize);
            for (k, n) in self.nodes.iter() {
                if n.leaf.is_some() {
                    if m.keeps_state(k as u32) {
                        live += 1;
                    } else {
                        dead += 1;
                    }
                }
            }
            let (first, later) = (
                self.policy.class_len(LeafClass::First),
                self.policy.class_len(LeafClass::Later),
            );
            ensure_inv!(
                (first, later) == (dead, live),
                "leaf classes: the policy holds {first} dead-end and {later} state-carrying \
                 leaves, the tree has {dead} and {live}"
            );
        }
        Ok(())
    }
}
