//! Tier API of the tree for tiered caches (device L1 + host L2).
//!
//! The core tree already stores host pages per node, keeps device residency root-connected,
//! matches through host-only nodes and demotes a backed-up node on device eviction. This module
//! adds what a tiered owner needs on top, keeping the counters, the evictable-leaf set and the
//! events consistent:
//! - attach host pages to a device node (a backup) and read them back;
//! - host-only leaves: test, enumerate and remove them (host eviction);
//! - attach device pages to a host-only node whose parent is on device (load-back);
//! - a non-mutating walk that reports how a key lies across the tiers.
//!
//! Host pages are plain `u32` slot indices of the owner's host pool: the tree never interprets
//! them, it only keeps one per page of the node's key.

use super::{Children, Node, RadixTree};
use crate::error::{CacheError, Result};
use crate::events::{chain_hashes, namespace_seed};
use crate::policy::NodeMeta;
use crate::types::{KeyRef, Medium, Namespace, NodeId, PageId};

/// What [`RadixTree::insert_host_only`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostInsert {
    /// Tokens after the anchor that already had a host copy (the caller's pages for them were
    /// not used).
    pub present_len: usize,
    /// Tokens added as a new host-only leaf (0 when none was).
    pub added_len: usize,
    /// The deepest node holding the inserted key's host KV (the new leaf, or the last node
    /// already present; the anchor when nothing was).
    pub last_node: NodeId,
}

/// How a key lies across the tiers, found without changing the tree ([`RadixTree::tier_walk`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierWalk {
    /// Leading tokens on device.
    pub device_len: usize,
    /// Tokens after `device_len` held only by the host tier.
    pub host_len: usize,
    /// The nodes whose whole key lies inside the matched prefix, root first (root excluded).
    pub nodes: Vec<NodeId>,
}

impl RadixTree {
    /// The host pages of `id` (`None` when the node has no host copy).
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn host_pages(&self, id: NodeId) -> Result<Option<&[u32]>> {
        Ok(self.nodes[self.resolve(id)? as usize].host.as_deref())
    }

    /// True when `id` has device pages.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn on_device(&self, id: NodeId) -> Result<bool> {
        Ok(self.nodes[self.resolve(id)? as usize].on_device())
    }

    /// Number of children of `id` (on any tier).
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn child_count(&self, id: NodeId) -> Result<usize> {
        Ok(self.nodes[self.resolve(id)? as usize].children.len())
    }

    /// Records a host copy of node `id` (one host page per page of its key) and emits a
    /// host-medium `BlockStored` event.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::LengthMismatch`] when `host` does not cover the
    /// key; [`CacheError::InvalidRequestState`] for the root, a node that already has a host
    /// copy, or whose parent has none (backed-up nodes must stay root-connected). Nothing
    /// changes on error.
    pub fn set_host_pages(&mut self, id: NodeId, host: Vec<u32>) -> Result<()> {
        let idx = self.attach_host(id, host)?;
        self.emit_stored(idx, Medium::Host);
        Ok(())
    }

    /// Records a host copy of node `id` like [`RadixTree::set_host_pages`] but emits no event:
    /// for owners that report the host copy only once its bytes have arrived (with
    /// [`RadixTree::emit_stored_event`]).
    ///
    /// # Errors
    /// As [`RadixTree::set_host_pages`]; nothing changes on error.
    pub fn set_host_pages_unreported(&mut self, id: NodeId, host: Vec<u32>) -> Result<()> {
        self.attach_host(id, host).map(|_| ())
    }

    /// Removes the host copy of the device-resident node `id` (a backup that failed or must be
    /// dropped), appending its host pages to `out`. Emits no event (see
    /// [`RadixTree::emit_removed_event`]). The node stays on device. Costs a scan of the tree
    /// when the node has children.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the node has no host
    /// copy, is not on device, still holds a host Mamba state or host window pages (take them
    /// first with [`RadixTree::take_mamba_host_state`], [`RadixTree::take_swa_host_pages`]), or a child still has a host copy (backed-up
    /// nodes must stay root-connected). Nothing changes on error.
    pub fn clear_host_pages(&mut self, id: NodeId, out: &mut Vec<u32>) -> Result<()> {
        let idx = self.resolve(id)?;
        let n = &self.nodes[idx as usize];
        if n.host.is_none() || !n.on_device() {
            return Err(CacheError::InvalidRequestState(
                "only a device node with a host copy can drop it",
            ));
        }
        if self.has_mamba_host_state(idx) {
            return Err(CacheError::InvalidRequestState(
                "take the node's host Mamba state first",
            ));
        }
        if self.has_swa_host_pages(idx) {
            return Err(CacheError::InvalidRequestState(
                "take the node's host window pages first",
            ));
        }
        // A scan (`O(nodes)`): this is the rare failure path, and the child table keeps stale
        // entries that would need generation checks.
        let child_backed = n.children.len() > 0
            && self
                .nodes
                .iter()
                .any(|(_, c)| c.parent == idx && c.host.is_some());
        if child_backed {
            return Err(CacheError::InvalidRequestState(
                "a child still has a host copy",
            ));
        }
        if let Some(h) = self.nodes[idx as usize].host.take() {
            out.extend_from_slice(&h);
        }
        Ok(())
    }

    /// Emits a `BlockRemoved` event for node `id` on `medium` (the counterpart of
    /// [`RadixTree::emit_stored_event`]).
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn emit_removed_event(&mut self, id: NodeId, medium: Medium) -> Result<()> {
        let idx = self.resolve(id)?;
        self.emit_removed(idx, medium);
        Ok(())
    }

    fn attach_host(&mut self, id: NodeId, host: Vec<u32>) -> Result<u32> {
        let idx = self.resolve(id)?;
        if idx == self.root {
            return Err(CacheError::InvalidRequestState("the root has no host copy"));
        }
        let n = &self.nodes[idx as usize];
        if n.host.is_some() {
            return Err(CacheError::InvalidRequestState(
                "node already has a host copy",
            ));
        }
        if host.len() * self.page_size != n.key.len() {
            return Err(CacheError::LengthMismatch {
                tokens: n.key.len(),
                pages: host.len(),
                page_size: self.page_size,
            });
        }
        if n.parent != self.root && self.nodes[n.parent as usize].host.is_none() {
            return Err(CacheError::InvalidRequestState(
                "a node can be backed up only under a backed-up parent",
            ));
        }
        self.nodes[idx as usize].host = Some(host);
        Ok(idx)
    }

    /// True when `id` is a host-only leaf: not on device, has a host copy, no children, not
    /// locked. Such a node can be removed by [`RadixTree::evict_host_leaf`].
    pub fn is_host_leaf(&self, id: NodeId) -> bool {
        self.resolve(id).is_ok_and(|idx| self.is_host_leaf_idx(idx))
    }

    fn is_host_leaf_idx(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        idx != self.root
            && !n.on_device()
            && n.host.is_some()
            && n.children.len() == 0
            && n.lock_ref == 0
    }

    /// Every host-only leaf, by a full scan (`O(nodes)`): for rebuilding an owner's host-leaf
    /// order and for audits.
    pub fn host_leaves(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(k, _)| self.is_host_leaf_idx(*k as u32))
            .map(|(k, _)| self.id_of(k as u32))
            .collect()
    }

    /// Removes the host-only leaf `id`: appends its host pages to `out`, emits a host-medium
    /// `BlockRemoved` event and deletes the node. Returns the tokens released.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when `id` is not a
    /// host-only leaf or still holds a host Mamba state or host window pages (take them first
    /// with [`RadixTree::take_mamba_host_state`], [`RadixTree::take_swa_host_pages`]); nothing
    /// changes then.
    pub fn evict_host_leaf(&mut self, id: NodeId, out: &mut Vec<u32>) -> Result<usize> {
        let idx = self.resolve(id)?;
        if !self.is_host_leaf_idx(idx) {
            return Err(CacheError::InvalidRequestState(
                "only an unlocked host-only leaf can be evicted from the host",
            ));
        }
        if self.has_mamba_host_state(idx) {
            return Err(CacheError::InvalidRequestState(
                "take the node's host Mamba state first",
            ));
        }
        if self.has_swa_host_pages(idx) {
            return Err(CacheError::InvalidRequestState(
                "take the node's host window pages first",
            ));
        }
        self.emit_removed(idx, Medium::Host);
        let parent = self.nodes[idx as usize].parent;
        self.remove_child(parent, idx);
        let n = &mut self.nodes[idx as usize];
        if let Some(h) = n.host.take() {
            out.extend_from_slice(&h);
        }
        let len = n.key.len();
        // Its edge buffers serve the next edge inserted (the steady state of a full host
        // tier: every device eviction writes back into room a host-leaf eviction made).
        self.free_node_recycle(idx);
        // The parent's device-children count is unchanged (the leaf was not on device), but a
        // parent on device may be an evictable leaf only if it has no device child, which did
        // not change either.
        Ok(len)
    }

    /// Gives the host-only node `id` the device pages `pages` (a load-back): the node becomes
    /// resident on both tiers, the counters and the leaf set follow, and a device-medium
    /// `BlockStored` event is emitted. The caller must already have marked the pages
    /// tree-owned in its allocator.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::LengthMismatch`]; [`CacheError::InvalidRequestState`]
    /// when the node is on device already, has no host copy, or its parent is not on device
    /// (device residency must stay root-connected). Nothing changes on error.
    pub fn attach_device_pages(&mut self, id: NodeId, pages: &[PageId]) -> Result<()> {
        let idx = self.resolve(id)?;
        if idx == self.root {
            return Err(CacheError::InvalidRequestState("the root holds no pages"));
        }
        let n = &self.nodes[idx as usize];
        if n.on_device() || n.host.is_none() {
            return Err(CacheError::InvalidRequestState(
                "load-back needs a host-only node",
            ));
        }
        if pages.len() * self.page_size != n.key.len() {
            return Err(CacheError::LengthMismatch {
                tokens: n.key.len(),
                pages: pages.len(),
                page_size: self.page_size,
            });
        }
        if n.parent != self.root && !self.nodes[n.parent as usize].on_device() {
            return Err(CacheError::InvalidRequestState(
                "load-back must proceed from the device prefix downwards",
            ));
        }
        let len = n.key.len();
        self.nodes[idx as usize].pages = pages.to_vec();
        self.on_device_added(idx, len);
        self.emit_stored(idx, Medium::Device);
        Ok(())
    }

    /// Emits a `BlockStored` event for node `id` on `medium` (for owners that make a node
    /// resident through a path that does not report it, e.g. an insert that re-adopts pages
    /// into a host-only node).
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn emit_stored_event(&mut self, id: NodeId, medium: Medium) -> Result<()> {
        let idx = self.resolve(id)?;
        self.emit_stored(idx, medium);
        Ok(())
    }

    /// Visits every host page held by the tree, with its node.
    pub fn for_each_host_page(&self, mut f: impl FnMut(NodeId, u32)) {
        for (k, n) in self.nodes.iter() {
            if let Some(h) = &n.host {
                let id = self.id_of(k as u32);
                h.iter().for_each(|&p| f(id, p));
            }
        }
    }

    /// How `key` (truncated to whole pages) lies across the tiers, without splitting nodes,
    /// touching access times or taking locks. `nodes` lists only nodes whose whole key is
    /// matched, so after an insert of `key` it is exactly the path that holds it.
    pub fn tier_walk(&self, key: KeyRef<'_>) -> TierWalk {
        let mut walk = TierWalk::default();
        self.tier_walk_down(key, self.root, 0, true, &mut walk);
        walk
    }

    /// [`RadixTree::tier_walk`] of `key` for a caller that knows a node on its path: `anchor`
    /// must end exactly at token `offset` of `key` (its path from the root is
    /// `key[..offset]`, e.g. the node a request locked at its match). The path down to the
    /// anchor is read through the parent links, without comparing its tokens again, so the
    /// walk costs the anchor's depth in nodes plus the tokens of `key` past `offset`.
    ///
    /// An anchor that is stale, does not end at `offset` or lies in another namespace (or
    /// `offset` past `key`'s whole pages) is not an error: the walk then compares `key` from
    /// the root, as [`RadixTree::tier_walk`] does. Otherwise it is
    /// [`RadixTree::tier_walk_tail`] of `key`'s tokens past `offset`.
    pub fn tier_walk_from(&self, anchor: NodeId, offset: usize, key: KeyRef<'_>) -> TierWalk {
        let p = self.page_size;
        let whole = key.tokens.len() - key.tokens.len() % p;
        if offset > whole || !offset.is_multiple_of(p) {
            return self.tier_walk(key);
        }
        let tail = KeyRef {
            tokens: &key.tokens[offset..],
            ..key
        };
        match self.tier_walk_tail(anchor, offset, tail, key.hashes) {
            Ok(walk) => {
                // The tail walk checks itself against its anchor's own path; this checks that
                // the path is `key`'s.
                debug_assert_eq!(walk, self.tier_walk(key), "tier_walk_from disagrees");
                walk
            }
            Err(_) => self.tier_walk(key),
        }
    }

    /// [`RadixTree::tier_walk`] of a key given from a lock anchor on: `anchor` ends at token
    /// `offset` of the key (a whole number of pages), `tail` holds the key's tokens from
    /// `offset` on, and `hashes` are the whole key's match hashes, counted from its first
    /// page (or none). For a request that dropped the tokens its lock covers
    /// ([`crate::RequestKv::drop_cached_prefix`]): the path down to the anchor is read through
    /// the parent links, and only `tail` is compared.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the anchor does not
    /// end at `offset` or lies in another namespace than `tail` (the tokens before `offset`
    /// are not there to walk from the root instead).
    pub fn tier_walk_tail(
        &self,
        anchor: NodeId,
        offset: usize,
        tail: KeyRef<'_>,
        hashes: &crate::page_hash::PageHashes,
    ) -> Result<TierWalk> {
        let start = self.resolve(anchor)?;
        if self.depth_of(start) != offset {
            return Err(CacheError::InvalidRequestState(
                "walk anchor does not end at the given offset",
            ));
        }
        let mut walk = TierWalk::default();
        // The anchor's path, root first.
        let mut up = start;
        while up != self.root {
            walk.nodes.push(self.id_of(up));
            up = self.nodes[up as usize].parent;
        }
        walk.nodes.reverse();
        if let Some(top) = walk.nodes.first()
            && self.nodes[top.idx as usize].namespace != *tail.namespace
        {
            return Err(CacheError::InvalidRequestState(
                "walk anchor lies in another namespace than the key",
            ));
        }
        // Classify it exactly as the walk down would: device nodes first, then host copies.
        let mut on_device = true;
        let mut keep = walk.nodes.len();
        for (k, id) in walk.nodes.iter().enumerate() {
            let n = &self.nodes[id.idx as usize];
            if on_device && n.on_device() {
                walk.device_len += n.key.len();
            } else if n.host.is_some() {
                on_device = false;
                walk.host_len += n.key.len();
            } else {
                keep = k;
                break;
            }
        }
        if keep < walk.nodes.len() {
            walk.nodes.truncate(keep);
        } else {
            // Positions count from the anchor, and the hashes from the key's first page.
            let key = KeyRef {
                hashes,
                pages_before: offset / self.page_size,
                ..tail
            };
            self.tier_walk_down(key, start, 0, on_device, &mut walk);
        }
        #[cfg(debug_assertions)]
        {
            // The same walk from the root over the whole key: the path's tokens, then the tail.
            let mut deepest_first = Vec::new();
            self.push_path(start, &mut deepest_first);
            let whole: Vec<u32> = self
                .path_tokens(&deepest_first)
                .chain(tail.tokens.iter().copied())
                .collect();
            let key = KeyRef::with_namespace(&whole, tail.namespace);
            debug_assert_eq!(walk, self.tier_walk(key), "tier_walk_tail disagrees");
        }
        Ok(walk)
    }

    /// The walk of [`RadixTree::tier_walk`] from `node`, which ends at token `pos` of `key`.
    fn tier_walk_down(
        &self,
        key: KeyRef<'_>,
        mut node: u32,
        mut pos: usize,
        mut on_device: bool,
        walk: &mut TierWalk,
    ) {
        let p = self.page_size;
        let tokens = &key.tokens[..key.tokens.len() - key.tokens.len() % p];
        while pos < tokens.len() {
            let Some(child) = self.find_child(node, key.namespace, &tokens[pos..pos + p]) else {
                break;
            };
            let common = self.edge_match(child, key.prefix(tokens.len()), pos);
            let n = &self.nodes[child as usize];
            if on_device && n.on_device() {
                walk.device_len += common;
            } else if n.host.is_some() {
                on_device = false;
                walk.host_len += common;
            } else {
                break;
            }
            pos += common;
            if common < n.key.len() {
                break;
            }
            walk.nodes.push(self.id_of(child));
            node = child;
        }
    }

    /// The namespace of `id`'s key (every node below a root child shares it).
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn namespace(&self, id: NodeId) -> Result<&Namespace> {
        Ok(&self.nodes[self.resolve(id)? as usize].namespace)
    }

    /// Adds the host-only KV of `key[offset..]` below `anchor` (a node ending exactly at token
    /// `offset` of `key`, with a host copy, or the root with `offset` 0): the pages a storage
    /// tier fetched into the host pool, one host page per page of `key[offset..]` in `host`.
    ///
    /// The walk goes down from the anchor through the nodes that already hold a host copy of
    /// `key` (splitting one that matches only in part): their positions keep their own host
    /// pages, and the caller's pages for them are appended to `unused`. It stops at the first
    /// node without a host copy (device-only KV: host residency must stay root-connected),
    /// whose positions' pages and every later one go to `unused` too. Otherwise the rest of
    /// `key` becomes one new host-only leaf (host-medium `BlockStored` event), which the
    /// result names.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::Misaligned`] or [`CacheError::LengthMismatch`]
    /// when `key[offset..]` is not whole pages or `host` does not cover it;
    /// [`CacheError::InvalidRequestState`] when the anchor does not end at `offset`, or is
    /// neither the root nor backed up. Nothing changes on error.
    pub fn insert_host_only(
        &mut self,
        anchor: NodeId,
        offset: usize,
        key: KeyRef<'_>,
        host: &[u32],
        unused: &mut Vec<u32>,
    ) -> Result<HostInsert> {
        let start = self.resolve(anchor)?;
        let p = self.page_size;
        let tokens = key.tokens;
        if offset > tokens.len() || self.depth_of(start) != offset {
            return Err(CacheError::InvalidRequestState(
                "host insert anchor does not end at the given offset",
            ));
        }
        if start != self.root && self.nodes[start as usize].host.is_none() {
            return Err(CacheError::InvalidRequestState(
                "host-only KV can only go below a backed-up node or the root",
            ));
        }
        let rest = tokens.len() - offset;
        if !rest.is_multiple_of(p) {
            return Err(CacheError::Misaligned {
                len: rest,
                page_size: p,
            });
        }
        if host.len() * p != rest {
            return Err(CacheError::LengthMismatch {
                tokens: rest,
                pages: host.len(),
                page_size: p,
            });
        }
        let now = self.next_tick();
        let mut node = start;
        let mut pos = offset;
        let mut present = 0;
        while pos < tokens.len() {
            let Some(child) = self.find_child(node, key.namespace, &tokens[pos..pos + p]) else {
                break;
            };
            if self.nodes[child as usize].host.is_none() {
                // Device-only KV: nothing may be backed up below it before it is.
                unused.extend_from_slice(&host[(pos - offset) / p..]);
                return Ok(HostInsert {
                    present_len: present,
                    added_len: 0,
                    last_node: self.id_of(node),
                });
            }
            let Some((child, common)) = self.step_down(node, key, pos) else {
                break;
            };
            self.touch(child, now);
            unused.extend_from_slice(&host[(pos - offset) / p..(pos - offset + common) / p]);
            present += common;
            pos += common;
            node = child;
        }
        if pos == tokens.len() {
            return Ok(HostInsert {
                present_len: present,
                added_len: 0,
                last_node: self.id_of(node),
            });
        }
        let seg = &tokens[pos..];
        let child_hash = self.child_hash(node, key.namespace, &seg[..p]);
        let mut page_hashes = Vec::new();
        if self.events.is_some() {
            let seed = self.nodes[node as usize]
                .page_hashes
                .last()
                .copied()
                .unwrap_or_else(|| namespace_seed(key.namespace));
            chain_hashes(seed, seg, p, &mut page_hashes);
        }
        let page_keys = self.chain_page_keys(node, key.namespace, seg);
        let node_key = self.bufs.tokens(seg);
        let depth = self.nodes[node as usize].depth + node_key.len();
        let idx = self.alloc_node(Node {
            parent: node,
            key: node_key,
            depth,
            pages: Vec::new(),
            host: Some(host[(pos - offset) / p..].to_vec()),
            children: Children::default(),
            child_hash,
            namespace: key.namespace.clone(),
            lock_ref: 0,
            device_children: 0,
            meta: NodeMeta {
                last_access: now,
                created: now,
                hit_count: 0,
                priority: 0,
            },
            leaf: None,
            page_hashes,
            end_hash: self.end_hash_at(key, tokens.len()),
            page_keys,
        });
        self.add_child(node, idx);
        self.verify_end_hash(idx);
        self.emit_stored(idx, Medium::Host);
        Ok(HostInsert {
            present_len: present,
            added_len: tokens.len() - pos,
            last_node: self.id_of(idx),
        })
    }

    /// Number of host pages held by the tree (`O(nodes)`, for audits).
    pub fn host_page_count(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|(_, n)| n.host.as_ref().map(Vec::len))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEvent;
    use crate::policy::PolicyKind;
    use crate::tree::InsertOptions;

    fn tree() -> RadixTree {
        RadixTree::new(2, PolicyKind::Lru, true).unwrap()
    }

    #[test]
    fn backup_demote_load_back_and_host_evict() {
        let mut t = tree();
        let mut pg = vec![PageId(0), PageId(1)];
        let mut rep = Vec::new();
        let r = t
            .insert(
                KeyRef::new(&[1, 2, 3, 4]),
                &mut pg,
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap();
        let id = r.last_node;
        assert!(t.set_host_pages(id, vec![7]).is_err(), "length mismatch");
        t.set_host_pages(id, vec![7, 8]).unwrap();
        assert!(
            t.set_host_pages(id, vec![7, 8]).is_err(),
            "already backed up"
        );
        assert!(!t.is_host_leaf(id));
        let mut out = Vec::new();
        t.evict(4, &mut out);
        assert_eq!(out, vec![PageId(0), PageId(1)]);
        assert!(t.contains(id) && t.is_host_leaf(id));
        assert_eq!(t.host_leaves(), vec![id]);
        let w = t.tier_walk(KeyRef::new(&[1, 2, 3, 4, 5]));
        assert_eq!(
            (w.device_len, w.host_len, w.nodes.clone()),
            (0, 4, vec![id])
        );
        t.attach_device_pages(id, &[PageId(5), PageId(6)]).unwrap();
        assert_eq!(t.evictable_tokens(), 4);
        assert!(t.attach_device_pages(id, &[PageId(5), PageId(6)]).is_err());
        t.check().unwrap();
        out.clear();
        t.evict(4, &mut out);
        let mut host = Vec::new();
        assert_eq!(t.evict_host_leaf(id, &mut host).unwrap(), 4);
        assert_eq!(host, vec![7, 8]);
        assert!(!t.contains(id));
        t.check().unwrap();
    }

    #[test]
    fn host_copy_needs_backed_up_parent_and_locked_leaf_stays() {
        let mut t = tree();
        let mut rep = Vec::new();
        let a = t
            .insert(
                KeyRef::new(&[1, 2]),
                &mut [PageId(0)],
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        let b = t
            .insert(
                KeyRef::new(&[1, 2, 3, 4]),
                &mut [PageId(0), PageId(1)],
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        assert!(t.set_host_pages(b, vec![1]).is_err());
        t.set_host_pages(a, vec![0]).unwrap();
        t.set_host_pages(b, vec![1]).unwrap();
        let mut out = Vec::new();
        t.evict(4, &mut out);
        let lock = t.inc_lock_ref(b).unwrap();
        assert!(!t.is_host_leaf(b));
        let mut host = Vec::new();
        assert!(t.evict_host_leaf(b, &mut host).is_err());
        assert!(t.evict_host_leaf(a, &mut host).is_err(), "a has a child");
        t.dec_lock_ref(lock).unwrap();
        t.evict_host_leaf(b, &mut host).unwrap();
        assert!(t.is_host_leaf(a));
        assert!(t.attach_device_pages(a, &[PageId(3), PageId(4)]).is_err());
        t.check().unwrap();
    }
    #[test]
    fn unreported_backup_and_dropping_a_host_copy() {
        let mut t = tree();
        let mut rep = Vec::new();
        let ins = |t: &mut RadixTree, k: &[u32], p: &mut [PageId], rep: &mut Vec<PageId>| {
            t.insert(KeyRef::new(k), p, rep, InsertOptions::default())
                .unwrap()
                .last_node
        };
        let a = ins(&mut t, &[1, 2], &mut [PageId(0)], &mut rep);
        let b = ins(&mut t, &[1, 2, 3, 4], &mut [PageId(0), PageId(1)], &mut rep);
        t.take_events();
        t.set_host_pages_unreported(a, vec![5]).unwrap();
        t.set_host_pages_unreported(b, vec![6]).unwrap();
        assert!(t.take_events().is_empty(), "no event until reported");
        t.emit_stored_event(a, Medium::Host).unwrap();
        assert_eq!(t.take_events().len(), 1);
        let mut out = Vec::new();
        assert!(
            t.clear_host_pages(a, &mut out).is_err(),
            "b is backed up below"
        );
        t.clear_host_pages(b, &mut out).unwrap();
        t.clear_host_pages(a, &mut out).unwrap();
        assert_eq!(out, vec![6, 5]);
        assert!(
            t.clear_host_pages(a, &mut out).is_err(),
            "no host copy left"
        );
        assert_eq!(t.host_page_count(), 0);
        t.emit_removed_event(a, Medium::Host).unwrap();
        assert!(matches!(
            t.take_events()[..],
            [KvEvent::BlockRemoved {
                medium: Medium::Host,
                ..
            }]
        ));
        t.check().unwrap();
    }

    #[test]
    fn host_only_insert_splits_skips_present_and_stops_at_device_only() {
        let mut t = tree();
        let mut rep = Vec::new();
        // A backed-up, demoted node [1,2,3,4] (host pages 10, 11).
        let a = t
            .insert(
                KeyRef::new(&[1, 2, 3, 4]),
                &mut [PageId(0), PageId(1)],
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        t.set_host_pages(a, vec![10, 11]).unwrap();
        let mut out = Vec::new();
        t.evict(4, &mut out);
        let root = t.root();
        let mut unused = Vec::new();
        assert!(
            t.insert_host_only(a, 2, KeyRef::new(&[1, 2, 3, 4, 5, 6]), &[1, 2], &mut unused)
                .is_err(),
            "the anchor does not end at 2"
        );
        assert!(
            t.insert_host_only(root, 0, KeyRef::new(&[1, 2, 3]), &[1, 2], &mut unused)
                .is_err(),
            "misaligned"
        );
        t.take_events();
        // From the root: [1,2] is present (split off `a`), [7,8] is new.
        let r = t
            .insert_host_only(root, 0, KeyRef::new(&[1, 2, 7, 8]), &[20, 21], &mut unused)
            .unwrap();
        assert_eq!((r.present_len, r.added_len), (2, 2));
        assert_eq!(unused, vec![20]);
        assert_eq!(t.host_pages(r.last_node).unwrap(), Some(&[21][..]));
        assert!(t.is_host_leaf(r.last_node) && t.is_host_leaf(a));
        assert_eq!(t.namespace(r.last_node).unwrap(), &Namespace::DEFAULT);
        assert!(matches!(
            t.take_events()[..],
            [KvEvent::BlockStored {
                medium: Medium::Host,
                ..
            }]
        ));
        // Below a device-only node nothing is added.
        let d = t
            .insert(
                KeyRef::new(&[5, 6]),
                &mut [PageId(2)],
                &mut rep,
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        unused.clear();
        let r = t
            .insert_host_only(root, 0, KeyRef::new(&[5, 6, 7, 8]), &[30, 31], &mut unused)
            .unwrap();
        assert_eq!((r.present_len, r.added_len, r.last_node), (0, 0, root));
        assert_eq!(unused, vec![30, 31]);
        assert!(
            t.insert_host_only(d, 2, KeyRef::new(&[5, 6, 1, 1]), &[1], &mut unused)
                .is_err()
        );
        assert_eq!(t.host_page_count(), 3);
        t.check().unwrap();
    }
}
