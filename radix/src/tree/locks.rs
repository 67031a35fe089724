//! Lock receipts and eviction of unlocked leaves.

use super::*;

impl RadixTree {
    // ---------------------------------------------------------------------------------------
    // Locks

    /// Locks the path from the root to `node` against eviction.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`] for a handle to a removed node.
    pub fn inc_lock_ref(&mut self, node: NodeId) -> Result<LockReceipt> {
        let mut i = self.resolve(node)?;
        while i != self.root {
            let n = &mut self.nodes[i as usize];
            if n.counts_evictable() {
                self.evictable -= n.key.len();
                self.protected += n.key.len();
            }
            n.lock_ref += 1;
            let parent = n.parent;
            if self.nodes[i as usize].lock_ref == 1 {
                self.update_leaf(i);
            }
            i = parent;
        }
        self.outstanding_locks += 1;
        Ok(LockReceipt {
            anchor: node,
            tree_id: self.tree_id,
            mamba: false,
            swa: None,
        })
    }

    /// Device tokens on `node`'s root path that no lock holds: what
    /// [`RadixTree::inc_lock_ref`] of `node` would move from evictable to protected.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    pub fn unlocked_device_tokens_on_path(&self, node: NodeId) -> Result<usize> {
        let mut i = self.resolve(node)?;
        let mut tokens = 0;
        while i != self.root {
            let n = &self.nodes[i as usize];
            if n.counts_evictable() {
                tokens += n.key.len();
            }
            i = n.parent;
        }
        Ok(tokens)
    }

    /// Releases the lock proven by `receipt`.
    ///
    /// # Errors
    /// [`CacheError::StaleReceipt`] for a receipt of another tree or whose anchor is gone;
    /// [`CacheError::LockUnderflow`] if the path does not hold the lock (nothing changes then).
    pub fn dec_lock_ref(&mut self, receipt: LockReceipt) -> Result<()> {
        if receipt.tree_id != self.tree_id {
            return Err(CacheError::StaleReceipt);
        }
        let start = self
            .resolve(receipt.anchor)
            .map_err(|_| CacheError::StaleReceipt)?;
        if receipt.mamba && self.mamba_lock_at(start) == 0 {
            return Err(CacheError::LockUnderflow(receipt.anchor));
        }
        if let Some(mark) = receipt.swa {
            self.swa_check_unlock(start, mark)?;
        }
        let mut i = start;
        while i != self.root {
            if self.nodes[i as usize].lock_ref == 0 {
                return Err(CacheError::LockUnderflow(self.id_of(i)));
            }
            i = self.nodes[i as usize].parent;
        }
        if receipt.mamba {
            self.mamba_unlock(start);
        }
        if let Some(mark) = receipt.swa {
            self.swa_unlock(start, mark);
        }
        let mut i = start;
        while i != self.root {
            let n = &mut self.nodes[i as usize];
            n.lock_ref -= 1;
            let parent = n.parent;
            if n.lock_ref == 0 {
                if n.on_device() {
                    self.protected -= n.key.len();
                    self.evictable += n.key.len();
                }
                self.update_leaf(i);
            }
            i = parent;
        }
        self.outstanding_locks -= 1;
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Eviction

    /// Takes the next victim out of the evictable-leaf set (policy order). The node is still
    /// in the tree: pass it to [`RadixTree::evict_device`].
    ///
    /// A custom policy is not trusted: a bad answer (see [`RadixTree::try_pop_victim`]) is
    /// kept for [`RadixTree::take_policy_fault`], the policy is rebuilt from the tree's leaf
    /// set and asked once more; a second bad answer ends the eviction (`None`).
    pub fn pop_victim(&mut self) -> Option<NodeId> {
        match self.try_pop_victim() {
            Ok(v) => v,
            Err(e) => {
                self.policy_fault.get_or_insert(e);
                self.try_pop_victim().unwrap_or_else(|e| {
                    self.policy_fault.get_or_insert(e);
                    None
                })
            }
        }
    }

    /// Like [`RadixTree::pop_victim`], with a bad answer of the policy as an error.
    ///
    /// # Errors
    /// [`CacheError::PolicyFault`] when the policy returned a node that is not in the
    /// evictable-leaf set (a stale handle, a locked or inner node, one it already gave). The
    /// policy's contents have been rebuilt from the tree's leaf set by then, so the tree stays
    /// consistent and a later call may succeed.
    pub fn try_pop_victim(&mut self) -> Result<Option<NodeId>> {
        if self.mamba.is_some() {
            // Empty after every public call; a safety net for the class order.
            self.apply_leaf_classes();
        }
        let Some(id) = self.policy.pop() else {
            return Ok(None);
        };
        match self.resolve(id) {
            Ok(idx) if self.nodes[idx as usize].leaf.is_some() => {
                self.nodes[idx as usize].leaf = None;
                Ok(Some(id))
            }
            _ => {
                self.rebuild_policy();
                Err(CacheError::PolicyFault {
                    policy: self.policy.name(),
                    node: id,
                })
            }
        }
    }

    /// The first bad answer of the eviction policy since the last call (see
    /// [`RadixTree::pop_victim`]), if any.
    pub fn take_policy_fault(&mut self) -> Option<CacheError> {
        self.policy_fault.take()
    }

    /// Refills the policy with exactly the tree's evictable leaves, after it lost track of
    /// them. `O(nodes)`; only a misbehaving policy gets here.
    pub(super) fn rebuild_policy(&mut self) {
        self.policy.clear();
        let all: Vec<u32> = self.nodes.iter().map(|(k, _)| k as u32).collect();
        for idx in all {
            self.nodes[idx as usize].leaf = None;
            self.update_leaf(idx);
        }
    }

    /// Releases the device pages of `id` (appended to `out`); returns the tokens released.
    /// A node with a host copy stays in the tree (host only); any other node is removed.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the node is locked,
    /// the root, not on device or has a child on device (nothing changes then).
    pub fn evict_device(&mut self, id: NodeId, out: &mut Vec<PageId>) -> Result<usize> {
        let idx = self.resolve(id)?;
        let n = &self.nodes[idx as usize];
        if idx == self.root || n.lock_ref > 0 || !n.on_device() || n.device_children > 0 {
            return Err(CacheError::InvalidRequestState(
                "only an unlocked device leaf can be evicted",
            ));
        }
        if let Some(tok) = self.nodes[idx as usize].leaf.take() {
            self.policy.remove(id, tok);
        }
        // The cascade: a state cannot be resumed without the KV before it.
        if let Some(m) = self.mamba.as_deref_mut() {
            m.drop_state_with_kv(idx);
        }
        // And window KV is useless without the full KV of the same tokens.
        if let Some(w) = self.swa.as_deref_mut() {
            w.drop_pages(idx);
        }
        let n = &mut self.nodes[idx as usize];
        let len = n.key.len();
        out.extend_from_slice(&n.pages);
        let pages = std::mem::take(&mut n.pages);
        self.bufs.recycle(Vec::new(), pages);
        self.evictable -= len;
        let parent = n.parent;
        let keep = n.host.is_some();
        self.emit_removed(idx, Medium::Device);
        if !keep {
            debug_assert_eq!(self.nodes[idx as usize].children.len(), 0);
            self.remove_child(parent, idx);
            self.free_node_recycle(idx);
        }
        self.nodes[parent as usize].device_children -= 1;
        self.update_leaf(parent);
        Ok(len)
    }

    /// Evicts leaves in policy order until at least `tokens` device tokens were released or
    /// nothing evictable is left. Released pages are appended to `out`. Returns the tokens
    /// released.
    ///
    /// With Mamba-aware KV eviction on ([`crate::MarconiParams::dead_end_kv_first`]), leaves
    /// that carry no Mamba state ([`RadixTree::dead_end_leaves`]) go first, in the policy's
    /// order; leaves ending at a live state only once none is left (the policy keeps the two
    /// as [`crate::LeafClass`]es, so this costs nothing extra per victim).
    pub fn evict(&mut self, tokens: usize, out: &mut Vec<PageId>) -> usize {
        let mut done = 0;
        while done < tokens {
            let Some(victim) = self.pop_victim() else {
                break;
            };
            if let Some(n) = self
                .policy
                .peek()
                .and_then(|next| self.nodes.get(next.index()))
            {
                // Victims of a large cache are cold: start loading the next one's node while
                // this one is evicted.
                prefetch(n);
            }
            match self.evict_device(victim, out) {
                Ok(n) => done += n,
                Err(e) => {
                    debug_assert!(false, "policy returned a non-evictable node: {e}");
                    break;
                }
            }
        }
        done
    }
}
