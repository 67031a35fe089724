//! The structural invariant audit of the tree.

use super::*;

impl RadixTree {
    /// Checks every structural invariant listed in the module docs. `O(nodes)`.
    pub fn check(&self) -> std::result::Result<(), InvariantViolation> {
        let p = self.page_size;
        let root = &self.nodes[self.root as usize];
        ensure_inv!(root.leaf.is_none(), "root is in the evictable-leaf set");
        ensure_inv!(root.lock_ref == 0, "root holds a lock count");
        let (mut evictable, mut protected, mut leaves) = (0, 0, 0);
        for (k, n) in self.nodes.iter() {
            let k = k as u32;
            let (mut child_locks, mut dev_children, mut count) = (0u64, 0u32, 0usize);
            let mut check_child = |c: u32| -> std::result::Result<(), InvariantViolation> {
                let cn = self.nodes.get(c as usize);
                ensure_inv!(
                    cn.is_some_and(|cn| cn.parent == k),
                    "child {c} of {k} has another parent"
                );
                let cn = &self.nodes[c as usize];
                child_locks += u64::from(cn.lock_ref);
                dev_children += u32::from(cn.on_device());
                count += 1;
                let h = self.child_hash(k, &cn.namespace, &cn.key[..p]);
                ensure_inv!(h == cn.child_hash, "child {c} has a stale first-page hash");
                Ok(())
            };
            match &n.children {
                Children::Inline(v) => {
                    for &c in v {
                        check_child(c)?;
                    }
                }
                Children::Table(t) => {
                    for slot in t.live_entries(|i, g| self.is_live(i, g)) {
                        if self.nodes[slot.idx as usize].parent != k {
                            continue; // slot reused by a node elsewhere: stale
                        }
                        ensure_inv!(
                            self.nodes[slot.idx as usize].child_hash == slot.hash,
                            "child {} filed under a foreign hash",
                            slot.idx
                        );
                        check_child(slot.idx)?;
                    }
                    ensure_inv!(
                        count == n.children.len(),
                        "node {k}: child table count {} != {count}",
                        n.children.len()
                    );
                }
            }
            ensure_inv!(
                dev_children == n.device_children,
                "node {k}: device_children {} != {dev_children}",
                n.device_children
            );
            if k == self.root {
                continue;
            }
            ensure_inv!(
                u64::from(n.lock_ref) >= child_locks,
                "node {k}: lock_ref {} < children's {child_locks}",
                n.lock_ref
            );
            ensure_inv!(
                !n.key.is_empty() && n.key.len().is_multiple_of(p),
                "node {k}: key length {} not page-aligned",
                n.key.len()
            );
            ensure_inv!(
                n.pages.is_empty() || n.pages.len() * p == n.key.len(),
                "node {k}: {} pages for {} tokens",
                n.pages.len(),
                n.key.len()
            );
            ensure_inv!(
                n.host.as_ref().is_none_or(|h| h.len() * p == n.key.len()),
                "node {k}: host pages do not cover the key"
            );
            ensure_inv!(
                n.on_device() || n.host.is_some(),
                "node {k} has neither device nor host KV"
            );
            if self.event_keys.is_some() {
                ensure_inv!(
                    n.page_keys.len() * p == n.key.len()
                        && n.page_keys.first().is_some_and(|first| {
                            let parent = &self.nodes[n.parent as usize];
                            match parent.page_keys.last() {
                                Some(pk) => pk.next(&n.key[..p]) == *first,
                                None => n.parent == self.root,
                            }
                        }),
                    "node {k}: event page keys do not chain from its parent"
                );
            }
            let parent = &self.nodes[n.parent as usize];
            ensure_inv!(
                n.depth == parent.depth + n.key.len(),
                "node {k} ends at {} tokens, its parent at {} with {} more",
                n.depth,
                parent.depth,
                n.key.len()
            );
            ensure_inv!(
                !n.on_device() || n.parent == self.root || parent.on_device(),
                "node {k} on device under an evicted parent"
            );
            ensure_inv!(
                n.host.is_none() || n.parent == self.root || parent.host.is_some(),
                "node {k} backed up under a parent that is not"
            );
            if n.parent != self.root {
                ensure_inv!(
                    n.namespace == parent.namespace,
                    "node {k} crosses namespaces"
                );
            }
            if n.on_device() {
                if n.lock_ref > 0 {
                    protected += n.key.len();
                } else {
                    evictable += n.key.len();
                }
            }
            ensure_inv!(
                n.leaf.is_some() == self.is_evictable_leaf(k),
                "node {k}: leaf-set membership {} disagrees with its state",
                n.leaf.is_some()
            );
            leaves += usize::from(n.leaf.is_some());
        }
        ensure_inv!(
            evictable == self.evictable,
            "evictable counter {} != {evictable}",
            self.evictable
        );
        ensure_inv!(
            protected == self.protected,
            "protected counter {} != {protected}",
            self.protected
        );
        ensure_inv!(
            leaves == self.policy.len(),
            "policy holds {} leaves, tree has {leaves}",
            self.policy.len()
        );
        self.check_mamba()?;
        self.check_swa()?;
        self.check_end_hashes()
    }

    /// No match hash ever accepted an edge whose tokens differ, and (debug builds) every
    /// match hash a node was given is its path's chain: each is checked when it is set
    /// ([`RadixTree::verify_end_hash`]), so the audit stays `O(nodes)`.
    fn check_end_hashes(&self) -> std::result::Result<(), InvariantViolation> {
        ensure_inv!(
            !self.hash_contract_broken.load(Ordering::Relaxed),
            "a match hash accepted an edge whose tokens differ (hashes that are not the \
             tokens' chain were given)"
        );
        ensure_inv!(
            !self.hash_chain_broken.load(Ordering::Relaxed),
            "a node was given a match hash that is not its path's chain"
        );
        Ok(())
    }

    /// Debug builds: checks that node `idx`'s match hash (if any) is its path's chain, hashing
    /// its path's keys back to the nearest ancestor with a match hash (checked when it was
    /// set) or the root, and records a failure for the audit. Release builds check nothing.
    pub(super) fn verify_end_hash(&self, idx: u32) {
        if !cfg!(debug_assertions) || self.nodes[idx as usize].end_hash == 0 {
            return;
        }
        let mut path = vec![idx];
        let mut i = self.nodes[idx as usize].parent;
        let start = loop {
            if i == self.root {
                let top = path.last().copied().unwrap_or(idx);
                break self.page_hasher.seed(&self.nodes[top as usize].namespace);
            }
            let n = &self.nodes[i as usize];
            if n.end_hash != 0 {
                break PageHash(n.end_hash);
            }
            path.push(i);
            i = n.parent;
        };
        let mut h = start;
        for &j in path.iter().rev() {
            for page in self.nodes[j as usize].key.chunks_exact(self.page_size) {
                h = self.page_hasher.extend(h, page);
            }
        }
        if h != PageHash(self.nodes[idx as usize].end_hash) {
            self.hash_chain_broken.store(true, Ordering::Relaxed);
        }
    }
}
