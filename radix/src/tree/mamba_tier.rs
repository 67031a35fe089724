//! The host tier of the Mamba component (tiered caches): a node may carry a host copy of its
//! state beside (or instead of) the device state.
//!
//! The host copy is a slot index of the owner's host pool: the tree never allocates or frees
//! host slots, it only records which node holds which one, like host pages. Its tier states
//! follow the KV's: a state is backed up with its node (the node has a host KV copy), the
//! device state may go (Mamba eviction, or the cascade of a device eviction) while the host
//! copy stays, and a load-back gives the node a device state again
//! ([`RadixTree::attach_mamba_state`]). A host copy never outlives its node's host KV: removing
//! a node's host KV ([`RadixTree::evict_host_leaf`], [`RadixTree::clear_host_pages`]) is
//! refused while the node still holds one, so the owner takes it first
//! ([`RadixTree::take_mamba_host_state`]) and frees its slot.

use super::mamba::MambaMatch;
use super::*;
use crate::slots::SlotState;

/// Where the deepest usable Mamba state of a tiered match is
/// ([`RadixTree::match_mamba_tiered`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MambaHostHit {
    /// The node whose host state would be loaded (on device or host-only).
    pub node: NodeId,
    /// Its depth in tokens: the usable prefix after the load.
    pub len: usize,
    /// The host slot of its state.
    pub host_slot: u32,
}

impl RadixTree {
    /// The host copy of node `id`'s Mamba state (`None`: none).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn mamba_host_state(&self, id: NodeId) -> Result<Option<u32>> {
        let idx = self.resolve(id)?;
        let e = self.mamba_ref()?.get(idx);
        Ok((e.host != NIL).then_some(e.host))
    }

    /// Records `host_slot` (a slot of the owner's host pool) as the host copy of node `id`'s
    /// device state: a backup of the state.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] for the root, a node without a host KV copy or a
    /// device state, or one that already has a host state. Nothing changes on error.
    pub fn set_mamba_host_state(&mut self, id: NodeId, host_slot: u32) -> Result<()> {
        let idx = self.resolve(id)?;
        let e = self.mamba_ref()?.get(idx);
        if idx == self.root || self.nodes[idx as usize].host.is_none() {
            return Err(CacheError::InvalidRequestState(
                "a host Mamba state needs a node with a host KV copy",
            ));
        }
        if e.slot == NIL || e.host != NIL {
            return Err(CacheError::InvalidRequestState(
                "a host Mamba state backs up the node's device state, once",
            ));
        }
        if host_slot == NIL {
            return Err(CacheError::SlotOutOfRange {
                slot: host_slot,
                total: NIL as usize,
            });
        }
        let m = self.mamba_mut()?;
        m.entry(idx).host = host_slot;
        Ok(())
    }

    /// Removes the host copy of node `id`'s state and returns its slot (`None`: it had none),
    /// for the owner to free: before a host eviction of the node, or to undo a backup.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn take_mamba_host_state(&mut self, id: NodeId) -> Result<Option<u32>> {
        let idx = self.resolve(id)?;
        let m = self.mamba_mut()?;
        if m.get(idx).host == NIL {
            return Ok(None);
        }
        let e = m.entry(idx);
        let host = std::mem::replace(&mut e.host, NIL);
        m.state_changed(idx);
        self.apply_leaf_classes();
        Ok(Some(host))
    }

    /// Load-back of a state: the request-held `slot` (into which the owner loads the host
    /// copy) becomes node `id`'s device state, under the kind it was stored as. The node keeps
    /// its host copy. Counts nothing in [`RadixTree::mamba_stats`] (the state was stored
    /// before).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`],
    /// [`CacheError::SlotOutOfRange`], [`CacheError::SlotState`] for a slot no request holds;
    /// [`CacheError::InvalidRequestState`] for a node that is not on device, has no host state
    /// or already has a device state. Nothing changes on error.
    pub fn attach_mamba_state(&mut self, id: NodeId, slot: u32) -> Result<()> {
        let idx = self.resolve(id)?;
        let m = self.mamba_ref()?;
        if m.pool.state(slot)? != SlotState::Request {
            return Err(CacheError::SlotState {
                slot,
                expected: "held by a request",
            });
        }
        let e = m.get(idx);
        if idx == self.root || !self.nodes[idx as usize].on_device() {
            return Err(CacheError::InvalidRequestState(
                "a loaded Mamba state needs a node whose KV is on device",
            ));
        }
        if e.host == NIL || e.slot != NIL {
            return Err(CacheError::InvalidRequestState(
                "a Mamba state is loaded only into a node with a host state and no device state",
            ));
        }
        let m = self.mamba_mut()?;
        m.pool.request_to_tree(slot)?;
        let now = m.tick();
        let e = m.entry(idx);
        e.slot = slot;
        e.tick = now;
        debug_assert_eq!(e.lock, 0);
        m.lru.insert((now, idx));
        m.state_changed(idx);
        self.apply_leaf_classes();
        Ok(())
    }

    /// Every node with a host Mamba state, with its host slot (`O(nodes)`, for audits).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`].
    pub fn mamba_host_states(&self) -> Result<Vec<(NodeId, u32)>> {
        let m = self.mamba_ref()?;
        Ok(m.nodes
            .iter()
            .enumerate()
            .filter(|(_, e)| e.host != NIL)
            .map(|(i, e)| {
                let id = NodeId {
                    idx: i as u32,
                    generation: e.generation,
                };
                (id, e.host)
            })
            .collect())
    }

    /// True when node index `idx` holds a host Mamba state (false without the component).
    pub(super) fn has_mamba_host_state(&self, idx: u32) -> bool {
        self.mamba
            .as_deref()
            .is_some_and(|m| m.get(idx).host != NIL)
    }

    /// The Mamba match of a tiered cache: [`RadixTree::match_mamba`] (the usable device
    /// prefix, whose pages are appended to `out`) plus, when the KV match goes deeper through
    /// device or host nodes, the deepest node past the usable prefix that holds a host copy of
    /// its state: loading the host-only KV down to it and its state makes the match usable
    /// there.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] (nothing changes then).
    pub fn match_mamba_tiered(
        &mut self,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> Result<(MambaMatch, Option<MambaHostHit>)> {
        let m = self.match_mamba(key, out)?;
        let deepest = self.resolve(m.kv.last_node)?;
        let mut i = deepest;
        let mut depth = m.kv.device_len + m.kv.host_len;
        let anchor = self.resolve(m.anchor)?;
        let comp = self.mamba_ref()?;
        while i != self.root && i != anchor {
            let e = comp.get(i);
            if e.host != NIL {
                let hit = MambaHostHit {
                    node: self.id_of(i),
                    len: depth,
                    host_slot: e.host,
                };
                return Ok((m, Some(hit)));
            }
            depth -= self.nodes[i as usize].key.len();
            i = self.nodes[i as usize].parent;
        }
        Ok((m, None))
    }

    /// The host-tier part of the Mamba audit: every host state sits on a live node with a host
    /// KV copy, and no host slot is held twice.
    pub(super) fn check_mamba_host(
        &self,
        m: &super::mamba::MambaComponent,
    ) -> std::result::Result<(), InvariantViolation> {
        let mut held: Vec<u32> = Vec::new();
        for (i, e) in m.nodes.iter().enumerate() {
            let k = i as u32;
            if e.host == NIL {
                continue;
            }
            ensure_inv!(
                k != self.root && self.is_live(k, e.generation),
                "host Mamba slot {} held by a dead node or the root {k}",
                e.host
            );
            ensure_inv!(
                self.nodes[i].host.is_some(),
                "node {k} holds host Mamba slot {} without a host KV copy",
                e.host
            );
            held.push(e.host);
        }
        held.sort_unstable();
        let twice = held.windows(2).find(|w| w[0] == w[1]);
        ensure_inv!(
            twice.is_none(),
            "host Mamba slot {:?} held by two nodes",
            twice.map(|w| w[0])
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;
    use crate::tree::InsertOptions;

    fn tree() -> RadixTree {
        let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
        t.enable_mamba(4).unwrap();
        t
    }

    #[test]
    fn host_states_follow_the_kv_tiers_and_refuse_misuse() {
        let mut t = tree();
        let mut rep = Vec::new();
        let key = [1, 2, 3, 4];
        let n = t
            .insert(
                KeyRef::new(&key),
                &mut [PageId(0), PageId(1)],
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        let s = t.alloc_mamba_slot().unwrap();
        t.insert_mamba_state(n, s).unwrap();
        assert!(t.set_mamba_host_state(n, 7).is_err(), "no host KV copy yet");
        t.set_host_pages(n, vec![0, 1]).unwrap();
        t.set_mamba_host_state(n, 7).unwrap();
        assert!(t.set_mamba_host_state(n, 8).is_err(), "backed up once");
        t.check().unwrap();
        // A split keeps the state and its host copy on the lower node.
        let mut out = Vec::new();
        t.match_prefix(KeyRef::new(&[1, 2, 9, 9]), &mut out);
        let upper = t.parent(n).unwrap().unwrap();
        assert_ne!(upper, t.root());
        assert_eq!(t.mamba_host_state(upper).unwrap(), None);
        assert_eq!(t.mamba_host_state(n).unwrap(), Some(7));
        // Device eviction: the device state goes with the KV, the host copy stays.
        let mut pages = Vec::new();
        t.evict(usize::MAX, &mut pages);
        assert_eq!(t.mamba_state(n).unwrap(), None);
        assert_eq!(t.mamba_host_state(n).unwrap(), Some(7));
        t.check().unwrap();
        // Host eviction is refused until the host state is taken.
        let mut host = Vec::new();
        assert!(t.evict_host_leaf(n, &mut host).is_err());
        // Load-back: KV first, then a request slot becomes the device state again.
        assert!(
            t.attach_mamba_state(n, 0).is_err(),
            "no request holds slot 0"
        );
        let slot = t.alloc_mamba_slot().unwrap();
        assert!(
            t.attach_mamba_state(n, slot).is_err(),
            "the KV is not on device"
        );
        t.attach_device_pages(upper, &[PageId(4)]).unwrap();
        t.attach_device_pages(n, &[PageId(5)]).unwrap();
        t.attach_mamba_state(n, slot).unwrap();
        assert_eq!(t.mamba_state(n).unwrap(), Some(slot));
        t.check().unwrap();
        let (m, hit) = t
            .match_mamba_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!((m.usable_len, hit), (4, None));
        // Only the device state goes: the tiered match finds the host copy past the usable
        // prefix.
        t.evict_mamba_state(n).unwrap();
        let (m, hit) = t
            .match_mamba_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!(m.usable_len, 0);
        assert_eq!(
            hit,
            Some(MambaHostHit {
                node: n,
                len: 4,
                host_slot: 7
            })
        );
        t.evict(usize::MAX, &mut pages);
        assert_eq!(t.take_mamba_host_state(n).unwrap(), Some(7));
        assert_eq!(t.take_mamba_host_state(n).unwrap(), None);
        t.evict_host_leaf(n, &mut host).unwrap();
        t.check().unwrap();
        assert!(t.mamba_host_states().unwrap().is_empty());
    }
}
