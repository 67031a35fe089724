//! Components restored from a storage tier (tiered caches): a host-only node that a storage
//! prefetch inserted ([`RadixTree::insert_host_only`]) may get a host copy of its Mamba state
//! or of its window KV that came from the store, not from a backup of a device copy.
//!
//! The restored copy is in the same tier state as one whose device copy went (a device
//! eviction or a component eviction): a host copy on a host-only node. The tree's tiered
//! matches ([`RadixTree::match_mamba_tiered`], [`RadixTree::match_swa_tiered`]) treat it like
//! any other host copy, so the usual load-back brings it to the device with the KV.

use super::*;

impl RadixTree {
    /// Records `host_slot` (a slot of the owner's host Mamba pool, holding a state read from
    /// a store) as the host copy of node `id`'s state: the state after the node's last token.
    /// Its checkpoint kind is [`CheckpointKind::RequestEnd`](crate::CheckpointKind) (a stored
    /// page does not record why its state was taken).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] for the root, a node whose KV is on device (its
    /// state comes from the device, by a backup), a node without a host KV copy, or one that
    /// has a host state already; [`CacheError::SlotOutOfRange`] for the reserved index.
    /// Nothing changes on error.
    pub fn restore_mamba_host_state(&mut self, id: NodeId, host_slot: u32) -> Result<()> {
        let idx = self.resolve(id)?;
        let e = self.mamba_ref()?.get(idx);
        let n = &self.nodes[idx as usize];
        if idx == self.root || n.host.is_none() || n.on_device() {
            return Err(CacheError::InvalidRequestState(
                "a stored Mamba state is restored only onto a host-only node",
            ));
        }
        if e.host != NIL || e.slot != NIL {
            return Err(CacheError::InvalidRequestState(
                "the node has a Mamba state already",
            ));
        }
        if host_slot == NIL {
            return Err(CacheError::SlotOutOfRange {
                slot: host_slot,
                total: NIL as usize,
            });
        }
        let generation = self.generations[idx as usize];
        let m = self.mamba_mut()?;
        let e = m.entry(idx);
        e.host = host_slot;
        e.generation = generation;
        e.kind = crate::mamba_policy::CheckpointKind::RequestEnd.index() as u8;
        Ok(())
    }

    /// Records `host` (pages of the owner's host SWA pool, one per page of the node's key,
    /// holding window KV read from a store) as the host copy of node `id`'s window KV.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] for the root, a node whose KV is on device, a node
    /// without a host KV copy, or one that has a host copy of its window KV already;
    /// [`CacheError::LengthMismatch`] when `host` does not hold one page per page of the key.
    /// Nothing changes on error.
    pub fn restore_swa_host_pages(&mut self, id: NodeId, host: Vec<u32>) -> Result<()> {
        let idx = self.resolve(id)?;
        let w = self.swa_ref()?;
        let n = &self.nodes[idx as usize];
        if idx == self.root || n.host.is_none() || n.on_device() {
            return Err(CacheError::InvalidRequestState(
                "stored window KV is restored only onto a host-only node",
            ));
        }
        if w.live(idx) || w.get(idx).is_some_and(|e| !e.host.is_empty()) {
            return Err(CacheError::InvalidRequestState(
                "the node has window KV already",
            ));
        }
        let len = n.key.len();
        if host.is_empty() || host.len() * self.page_size != len {
            return Err(CacheError::LengthMismatch {
                tokens: len,
                pages: host.len(),
                page_size: self.page_size,
            });
        }
        let generation = self.generations[idx as usize];
        let e = self.swa_mut()?.entry(idx);
        e.host = host;
        e.generation = generation;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    #[test]
    fn restored_components_go_on_host_only_nodes_once() {
        let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
        t.enable_mamba(4).unwrap();
        t.enable_swa(4, 8).unwrap();
        let key = [1, 2, 3, 4, 5, 6];
        let mut unused = Vec::new();
        let root = t.root();
        let r = t
            .insert_host_only(root, 0, KeyRef::new(&key), &[7, 8, 9], &mut unused)
            .unwrap();
        let n = r.last_node;
        assert!(t.restore_mamba_host_state(root, 1).is_err(), "the root");
        assert!(
            t.restore_mamba_host_state(n, NIL).is_err(),
            "reserved index"
        );
        t.restore_mamba_host_state(n, 3).unwrap();
        assert!(t.restore_mamba_host_state(n, 4).is_err(), "once");
        assert_eq!(t.mamba_host_state(n).unwrap(), Some(3));
        assert!(
            t.restore_swa_host_pages(n, vec![1, 2]).is_err(),
            "one page per page"
        );
        t.restore_swa_host_pages(n, vec![1, 2, 5]).unwrap();
        assert!(t.restore_swa_host_pages(n, vec![0, 3, 4]).is_err(), "once");
        t.check().unwrap();
        // The tiered match finds both host copies: a load-back can make the node usable.
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&[1, 2, 3, 4, 5, 6, 7, 8]), &mut Vec::new())
            .unwrap();
        assert_eq!(m.usable_len, 0);
        let hit = hit.expect("a host hit");
        assert_eq!((hit.node, hit.len, hit.state_load), (n, 6, Some(3)));
        // Host eviction still needs the owner to take both copies first.
        assert!(t.evict_host_leaf(n, &mut Vec::new()).is_err());
        assert_eq!(t.take_mamba_host_state(n).unwrap(), Some(3));
        assert_eq!(t.take_swa_host_pages(n).unwrap(), Some(vec![1, 2, 5]));
        t.evict_host_leaf(n, &mut Vec::new()).unwrap();
        t.check().unwrap();
    }
}
