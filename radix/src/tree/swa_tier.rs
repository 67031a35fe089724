//! The host tier of the sliding-window component (tiered caches): a node may carry a host copy
//! of its window KV beside (or instead of) the device window pages.
//!
//! The host copy is a list of page indices of the owner's host SWA pool, one per page of the
//! node's key: the tree never allocates or frees host pages, it only records which node holds
//! which, like host KV pages. Its tier states follow the KV's: the window KV is backed up with
//! its node (the node has a host KV copy); the device window pages may go (an SWA tombstone,
//! or the cascade of a device eviction) while the host copy stays; a split divides the host
//! copy like the device pages; and a load-back gives the node device window pages again
//! ([`RadixTree::attach_swa_pages`]). A host copy never outlives its node's host KV: removing
//! a node's host KV ([`RadixTree::evict_host_leaf`], [`RadixTree::clear_host_pages`]) is
//! refused while the node still holds one, so the owner takes it first
//! ([`RadixTree::take_swa_host_pages`]) and frees its pages. A node without a host copy is a
//! *host tombstone*: its window KV is not on the host.

use super::swa::{SwaComponent, SwaMatch};
use super::*;
use crate::alloc::PageState;

/// Where a tiered SWA match can be extended by a load-back ([`RadixTree::match_swa_tiered`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwaHostHit {
    /// The deepest node past the usable device prefix with a full window of window KV before
    /// its end, live on device or on the host: the end of the load.
    pub node: NodeId,
    /// Its depth in tokens: the usable prefix after the load.
    pub len: usize,
    /// The nodes (root first) inside that window whose window KV is on the host only: the
    /// load brings their window pages back with the KV.
    pub window_loads: Vec<NodeId>,
    /// With the Mamba component: the host slot of the node's state when the load must bring
    /// it back (the node has no device state); `None` when its device state is there, and
    /// always without the component.
    pub state_load: Option<u32>,
}

impl RadixTree {
    /// The host copy of node `id`'s window KV (`None`: a host tombstone).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn swa_host_pages(&self, id: NodeId) -> Result<Option<&[u32]>> {
        let idx = self.resolve(id)?;
        Ok(self
            .swa_ref()?
            .get(idx)
            .filter(|e| !e.host.is_empty())
            .map(|e| e.host.as_slice()))
    }

    /// Records `host` (pages of the owner's host SWA pool, one per page of the node's key) as
    /// the host copy of node `id`'s live device window KV: a backup of it.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] for the root, a node without a host KV copy or live
    /// device window KV, or one that already has a host copy; [`CacheError::LengthMismatch`]
    /// when `host` does not hold one page per page of the key. Nothing changes on error.
    pub fn set_swa_host_pages(&mut self, id: NodeId, host: Vec<u32>) -> Result<()> {
        let idx = self.resolve(id)?;
        let w = self.swa_ref()?;
        if idx == self.root || self.nodes[idx as usize].host.is_none() {
            return Err(CacheError::InvalidRequestState(
                "a host copy of window KV needs a node with a host KV copy",
            ));
        }
        if !w.live(idx) || w.get(idx).is_some_and(|e| !e.host.is_empty()) {
            return Err(CacheError::InvalidRequestState(
                "a host copy backs up the node's live window KV, once",
            ));
        }
        let len = self.nodes[idx as usize].key.len();
        if host.len() * self.page_size != len {
            return Err(CacheError::LengthMismatch {
                tokens: len,
                pages: host.len(),
                page_size: self.page_size,
            });
        }
        self.swa_mut()?.entry(idx).host = host;
        Ok(())
    }

    /// Removes the host copy of node `id`'s window KV and returns its pages (`None`: it had
    /// none), for the owner to free: before a host eviction of the node, or to undo a backup.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn take_swa_host_pages(&mut self, id: NodeId) -> Result<Option<Vec<u32>>> {
        let idx = self.resolve(id)?;
        let w = self.swa_mut()?;
        if w.get(idx).is_none_or(|e| e.host.is_empty()) {
            return Ok(None);
        }
        Ok(Some(std::mem::take(&mut w.entry(idx).host)))
    }

    /// Load-back of window KV: the caller-owned SWA `pages` (from
    /// [`RadixTree::alloc_swa_pages`], into which the owner loads the host copy) become node
    /// `id`'s device window pages. The node keeps its host copy.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::PageOutOfRange`] / [`CacheError::PageState`] for a page no caller holds
    /// or one listed twice; [`CacheError::LengthMismatch`] for a page count other than the
    /// key's; [`CacheError::InvalidRequestState`] for a node whose KV is not on device, that
    /// has no host copy of its window KV, or that has live device window KV. Nothing changes
    /// on error.
    pub fn attach_swa_pages(&mut self, id: NodeId, pages: &[PageId]) -> Result<()> {
        let idx = self.resolve(id)?;
        let w = self.swa_ref()?;
        if idx == self.root || !self.nodes[idx as usize].on_device() {
            return Err(CacheError::InvalidRequestState(
                "loaded window KV needs a node whose KV is on device",
            ));
        }
        if w.live(idx) || w.get(idx).is_none_or(|e| e.host.is_empty()) {
            return Err(CacheError::InvalidRequestState(
                "window KV is loaded only into a node with a host copy and a device tombstone",
            ));
        }
        let len = self.nodes[idx as usize].key.len();
        if pages.len() * self.page_size != len {
            return Err(CacheError::LengthMismatch {
                tokens: len,
                pages: pages.len(),
                page_size: self.page_size,
            });
        }
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        for (j, &pg) in sorted.iter().enumerate() {
            if w.pool.state(pg)? != PageState::Owned || (j > 0 && sorted[j - 1] == pg) {
                return Err(CacheError::PageState {
                    page: pg,
                    expected: "caller-owned, listed once",
                });
            }
        }
        let generation = self.generations[idx as usize];
        let w = self.swa_mut()?;
        w.pool.adopt_into_tree(pages)?;
        let now = w.tick();
        let e = w.entry(idx);
        e.pages = pages.to_vec();
        e.tick = now;
        e.generation = generation;
        w.lru.insert((now, idx));
        w.evictable += pages.len();
        Ok(())
    }

    /// Pins the live window KV of node `id` (a backup or load copying it): it cannot be
    /// tombstoned until [`RadixTree::unpin_swa_pages`]. The caller holds a KV lock on the node
    /// for as long (a pin counts as an SWA lock, which the audit bounds by the KV lock). A
    /// split while pinned leaves both parts pinned; the unpin walks up over them.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] for a node without live window KV or without a KV
    /// lock. Nothing changes on error.
    pub fn pin_swa_pages(&mut self, id: NodeId) -> Result<()> {
        let idx = self.resolve(id)?;
        let w = self.swa_ref()?;
        let held = w.get(idx).map_or(0, |e| e.lock);
        if !w.live(idx) || self.nodes[idx as usize].lock_ref <= held {
            return Err(CacheError::InvalidRequestState(
                "only live window KV of a KV-locked node can be pinned",
            ));
        }
        let w = self.swa_mut()?;
        let e = w.entry(idx);
        e.lock += 1;
        if e.lock == 1 {
            let (t, n) = (e.tick, e.pages.len());
            w.lru.remove(&(t, idx));
            w.evictable -= n;
            w.protected += n;
        }
        Ok(())
    }

    /// Releases a pin of [`RadixTree::pin_swa_pages`] on node `id`, which held `pages` window
    /// pages when it was pinned: the node and, when it was split since, the upper parts above
    /// it until `pages` pages are covered.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::LockUnderflow`] when those nodes do not hold the pin (nothing changes
    /// then).
    pub fn unpin_swa_pages(&mut self, id: NodeId, pages: usize) -> Result<()> {
        let idx = self.resolve(id)?;
        let w = self.swa_ref()?;
        let mut span = Vec::new();
        let (mut i, mut covered) = (idx, 0);
        while covered < pages.max(1) {
            let e = w.get(i).filter(|e| e.live() && e.lock > 0);
            let Some(e) = e.filter(|_| i != self.root) else {
                return Err(CacheError::LockUnderflow(self.id_of(i)));
            };
            covered += e.pages.len();
            span.push(i);
            i = self.nodes[i as usize].parent;
        }
        if covered != pages.max(1) {
            return Err(CacheError::LockUnderflow(id));
        }
        let w = self.swa_mut()?;
        for i in span {
            let e = w.entry(i);
            e.lock -= 1;
            if e.lock == 0 {
                e.mark = 0;
                let (t, n) = (e.tick, e.pages.len());
                w.lru.insert((t, i));
                w.protected -= n;
                w.evictable += n;
            }
        }
        Ok(())
    }

    /// Every node with a host copy of its window KV, with its host pages (`O(nodes)`, for
    /// audits).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`].
    pub fn swa_host_copies(&self) -> Result<Vec<(NodeId, Vec<u32>)>> {
        let w = self.swa_ref()?;
        Ok(w.nodes
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.host.is_empty())
            .map(|(i, e)| {
                let id = NodeId {
                    idx: i as u32,
                    generation: e.generation,
                };
                (id, e.host.clone())
            })
            .collect())
    }

    /// Host SWA pages the tree holds (`O(nodes)`; 0 without the component).
    pub fn swa_host_page_count(&self) -> usize {
        self.swa
            .as_deref()
            .map_or(0, |w| w.nodes.iter().map(|e| e.host.len()).sum())
    }

    /// True when node index `idx` holds a host copy of window KV (false without the
    /// component).
    pub(super) fn has_swa_host_pages(&self, idx: u32) -> bool {
        self.swa
            .as_deref()
            .is_some_and(|w| w.get(idx).is_some_and(|e| !e.host.is_empty()))
    }

    /// The SWA match of a tiered cache: [`RadixTree::match_swa`] (the usable device prefix,
    /// whose pages are appended to `out`) plus, when the KV match goes deeper through device
    /// or host nodes, the deepest node boundary past the usable prefix with a full window of
    /// window KV before it that is live on device or has a host copy: loading the host-only KV
    /// down to it and the window pages the window needs from the host makes the match usable
    /// there. With the Mamba component too, that boundary must also carry a Mamba state, on
    /// device or as a host copy (which the load then brings back: [`SwaHostHit::state_load`]),
    /// as the device match requires a device state there.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] (nothing changes then).
    pub fn match_swa_tiered(
        &mut self,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> Result<(SwaMatch, Option<SwaHostHit>)> {
        let m = self.match_swa(key, out)?;
        let path = self.path_from_root(self.resolve(m.kv.last_node)?);
        let w = self.swa_ref()?;
        let states = self.mamba.as_deref();
        let avail = |i: u32| w.get(i).is_some_and(|e| e.live() || !e.host.is_empty());
        // The Mamba validator: a device state, or a host copy to load.
        let state_ok = |i: u32| states.is_none_or(|s| s.has_state(i) || s.get(i).host != NIL);
        let (mut depth, mut run) = (0usize, 0usize);
        let mut best = None;
        for (k, &i) in path.iter().enumerate() {
            let len = self.nodes[i as usize].key.len();
            depth += len;
            run = if avail(i) { run + len } else { 0 };
            if depth > m.usable_len && (run >= w.window || run == depth) && state_ok(i) {
                best = Some((k, depth));
            }
        }
        let Some((k, len)) = best else {
            return Ok((m, None));
        };
        // The window before the hit's end, bottom-up: the nodes whose pages are host-only.
        let mut window_loads = Vec::new();
        let mut covered = 0;
        for &i in path[..=k].iter().rev() {
            if !w.live(i) {
                window_loads.push(self.id_of(i));
            }
            covered += self.nodes[i as usize].key.len();
            if covered >= w.window {
                break;
            }
        }
        window_loads.reverse();
        let end = path[k];
        let state_load = states
            .filter(|s| !s.has_state(end))
            .map(|s| s.get(end).host);
        let hit = SwaHostHit {
            node: self.id_of(end),
            len,
            window_loads,
            state_load,
        };
        Ok((m, Some(hit)))
    }

    /// The host-tier part of the SWA audit: every host copy sits on a live node with a host KV
    /// copy, holds one page per page of the key, and no host page is held twice.
    pub(super) fn check_swa_host(
        &self,
        w: &SwaComponent,
    ) -> std::result::Result<(), InvariantViolation> {
        let mut held: Vec<u32> = Vec::new();
        for (i, e) in w.nodes.iter().enumerate() {
            let k = i as u32;
            if e.host.is_empty() {
                continue;
            }
            ensure_inv!(
                k != self.root && self.is_live(k, e.generation),
                "host window pages {:?} held by a dead node or the root {k}",
                e.host
            );
            let n = &self.nodes[i];
            ensure_inv!(
                n.host.is_some(),
                "node {k} holds host window pages without a host KV copy"
            );
            ensure_inv!(
                e.host.len() * self.page_size == n.key.len(),
                "node {k}: {} host window pages for {} tokens",
                e.host.len(),
                n.key.len()
            );
            held.extend_from_slice(&e.host);
        }
        held.sort_unstable();
        let twice = held.windows(2).find(|d| d[0] == d[1]);
        ensure_inv!(
            twice.is_none(),
            "host window page {:?} held twice",
            twice.map(|d| d[0])
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;
    use crate::tree::InsertOptions;

    /// Page size 2, window 4 tokens, 8 SWA pages.
    fn tree() -> RadixTree {
        let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
        t.enable_swa(4, 8).unwrap();
        t
    }

    fn insert(t: &mut RadixTree, key: &[u32], first_page: u32) -> NodeId {
        let mut pages: Vec<PageId> = (0..key.len() as u32 / 2)
            .map(|i| PageId(first_page + i))
            .collect();
        let mut swa = Vec::new();
        t.alloc_swa_pages(pages.len(), &mut swa).unwrap();
        t.insert_swa(
            KeyRef::new(key),
            &mut pages,
            &swa,
            &mut Vec::new(),
            InsertOptions::default(),
        )
        .unwrap()
        .kv
        .last_node
    }

    #[test]
    fn host_window_pages_follow_the_kv_tiers_and_refuse_misuse() {
        let mut t = tree();
        let key = [1, 2, 3, 4, 5, 6];
        let n = insert(&mut t, &key, 0);
        assert!(
            t.set_swa_host_pages(n, vec![10, 11, 12]).is_err(),
            "no host KV copy yet"
        );
        t.set_host_pages(n, vec![0, 1, 2]).unwrap();
        assert!(
            t.set_swa_host_pages(n, vec![10, 11]).is_err(),
            "one host page per page"
        );
        t.set_swa_host_pages(n, vec![10, 11, 12]).unwrap();
        assert!(t.set_swa_host_pages(n, vec![13, 14, 15]).is_err(), "once");
        t.check().unwrap();
        assert_eq!(t.swa_host_page_count(), 3);
        // A split divides the host copy like the device pages.
        t.match_prefix(KeyRef::new(&[1, 2, 9, 9]), &mut Vec::new());
        let upper = t.parent(n).unwrap().unwrap();
        assert_ne!(upper, t.root());
        assert_eq!(t.swa_host_pages(upper).unwrap(), Some(&[10][..]));
        assert_eq!(t.swa_host_pages(n).unwrap(), Some(&[11, 12][..]));
        t.check().unwrap();
        // A device SWA tombstone keeps the host copy.
        t.evict_swa_node(n).unwrap();
        assert_eq!(t.swa_pages(n).unwrap(), None);
        assert_eq!(t.swa_host_pages(n).unwrap(), Some(&[11, 12][..]));
        t.check().unwrap();
        // The tiered match: the device match stops short of the window (upper is live, 2
        // tokens < window, but run == depth there), the host copy makes the whole key usable.
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!(m.usable_len, 2);
        let hit = hit.unwrap();
        assert_eq!((hit.node, hit.len), (n, 6));
        assert_eq!(hit.window_loads, vec![n]);
        // Device eviction: the device pages go with the KV, the host copies stay.
        let mut pages = Vec::new();
        t.evict(usize::MAX, &mut pages);
        assert!(!t.on_device(n).unwrap() && !t.on_device(upper).unwrap());
        assert_eq!(t.swa_host_pages(upper).unwrap(), Some(&[10][..]));
        assert_eq!(t.swa_host_pages(n).unwrap(), Some(&[11, 12][..]));
        t.check().unwrap();
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!(m.usable_len, 0);
        let hit = hit.unwrap();
        assert_eq!((hit.node, hit.len), (n, 6));
        // n alone covers the window: upper comes back as a device tombstone.
        assert_eq!(hit.window_loads, vec![n]);
        // Host eviction is refused until the host copy is taken.
        let mut host = Vec::new();
        assert!(t.evict_host_leaf(n, &mut host).is_err());
        // Load-back: KV first, then caller pages become the device window pages.
        let mut swa = Vec::new();
        t.alloc_swa_pages(2, &mut swa).unwrap();
        assert!(t.attach_swa_pages(n, &swa).is_err(), "KV not on device");
        t.attach_device_pages(upper, &[PageId(4)]).unwrap();
        t.attach_device_pages(n, &[PageId(5), PageId(6)]).unwrap();
        assert!(t.attach_swa_pages(n, &swa[..1]).is_err(), "too few pages");
        assert!(
            t.attach_swa_pages(n, &[swa[0], swa[0]]).is_err(),
            "listed twice"
        );
        t.attach_swa_pages(n, &swa).unwrap();
        assert!(t.attach_swa_pages(n, &swa).is_err(), "already live");
        t.check().unwrap();
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        // Upper is still a device tombstone, but n alone covers the window.
        assert_eq!((m.usable_len, hit), (6, None));
        // Taking the host copies, then host eviction.
        t.evict(usize::MAX, &mut pages);
        assert_eq!(t.take_swa_host_pages(n).unwrap(), Some(vec![11, 12]));
        assert_eq!(t.take_swa_host_pages(n).unwrap(), None);
        t.evict_host_leaf(n, &mut host).unwrap();
        assert!(t.evict_host_leaf(upper, &mut host).is_err());
        assert_eq!(t.take_swa_host_pages(upper).unwrap(), Some(vec![10]));
        t.evict_host_leaf(upper, &mut host).unwrap();
        t.check().unwrap();
        assert!(t.swa_host_copies().unwrap().is_empty());
        assert_eq!(t.swa_pool().unwrap().available(), 8);
    }

    /// With the Mamba component too, a host hit ends only where a state is, on device or on
    /// the host, and says whether the load must bring the state back.
    #[test]
    fn with_both_components_a_host_hit_ends_at_a_state() {
        let mut t = tree();
        t.enable_mamba(4).unwrap();
        let key = [1, 2, 3, 4, 5, 6];
        let n = insert(&mut t, &key, 0);
        let s = t.alloc_mamba_slot().unwrap();
        t.insert_mamba_state(n, s).unwrap();
        t.set_host_pages(n, vec![0, 1, 2]).unwrap();
        t.set_swa_host_pages(n, vec![10, 11, 12]).unwrap();
        // The window KV goes, and its unlocked state with it (the cascade): no host state, so
        // no host hit although the window is on the host.
        t.evict_swa_node(n).unwrap();
        assert_eq!(t.mamba_state(n).unwrap(), None);
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!((m.usable_len, hit), (0, None));
        t.check().unwrap();
        // With a host copy of the state, the hit ends at the node and loads the state too.
        let mut pages = Vec::new();
        t.evict(usize::MAX, &mut pages);
        t.attach_device_pages(n, &[PageId(0), PageId(1), PageId(2)])
            .unwrap();
        let mut swa = Vec::new();
        t.alloc_swa_pages(3, &mut swa).unwrap();
        t.attach_swa_pages(n, &swa).unwrap();
        let s = t.alloc_mamba_slot().unwrap();
        t.insert_mamba_state(n, s).unwrap();
        t.set_mamba_host_state(n, 5).unwrap();
        t.evict(usize::MAX, &mut pages);
        let (m, hit) = t
            .match_swa_tiered(KeyRef::new(&key), &mut Vec::new())
            .unwrap();
        assert_eq!(m.usable_len, 0);
        let hit = hit.unwrap();
        assert_eq!((hit.node, hit.len, hit.state_load), (n, 6, Some(5)));
        assert_eq!(hit.window_loads, vec![n]);
        t.check().unwrap();
    }

    #[test]
    fn the_audit_catches_a_host_page_held_twice() {
        let mut t = tree();
        let a = insert(&mut t, &[1, 2], 0);
        let b = insert(&mut t, &[3, 4], 1);
        t.set_host_pages(a, vec![0]).unwrap();
        t.set_host_pages(b, vec![1]).unwrap();
        t.set_swa_host_pages(a, vec![7]).unwrap();
        t.set_swa_host_pages(b, vec![7]).unwrap();
        assert!(t.check().is_err());
        t.take_swa_host_pages(b).unwrap();
        t.check().unwrap();
    }

    #[test]
    fn a_pin_survives_a_split_and_unpins_both_parts() {
        let mut t = tree();
        let n = insert(&mut t, &[1, 2, 3, 4, 5, 6], 0);
        assert!(t.pin_swa_pages(n).is_err(), "no KV lock");
        let lock = t.inc_lock_ref(n).unwrap();
        t.pin_swa_pages(n).unwrap();
        assert_eq!(t.evict_swa(usize::MAX), 0, "pinned window KV stays");
        t.match_prefix(KeyRef::new(&[1, 2, 9, 9]), &mut Vec::new());
        let upper = t.parent(n).unwrap().unwrap();
        assert_eq!(t.swa_lock_ref(upper).unwrap(), 1);
        t.check().unwrap();
        assert!(t.unpin_swa_pages(n, 4).is_err(), "wrong page count");
        t.unpin_swa_pages(n, 3).unwrap();
        assert_eq!(t.swa_lock_ref(upper).unwrap(), 0);
        assert_eq!(t.swa_lock_ref(n).unwrap(), 0);
        assert!(t.unpin_swa_pages(n, 3).is_err(), "unpinned twice");
        t.dec_lock_ref(lock).unwrap();
        t.check().unwrap();
        assert_eq!(t.evict_swa(usize::MAX), 3);
        t.check().unwrap();
    }
}
