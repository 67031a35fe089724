//! Match, split and insert: the walks from the root (or a lock anchor) down the tree.

use super::*;

/// An anchor that does not end where the caller says its key's tokens start.
const ANCHOR_OFF: CacheError =
    CacheError::InvalidRequestState("insert anchor does not end at the given offset");

/// Where a match walk stands: the node it reached, ending at token `pos`.
struct MatchAt {
    node: u32,
    pos: usize,
    device_len: usize,
    last_device: u32,
    on_device: bool,
}

impl MatchAt {
    fn root(root: u32) -> Self {
        MatchAt {
            node: root,
            pos: 0,
            device_len: 0,
            last_device: root,
            on_device: true,
        }
    }

    fn result(&self, tree: &RadixTree) -> TreeMatch {
        TreeMatch {
            device_len: self.device_len,
            host_len: self.pos - self.device_len,
            last_device: tree.id_of(self.last_device),
            last_node: tree.id_of(self.node),
        }
    }
}

impl RadixTree {
    // ---------------------------------------------------------------------------------------
    // Match

    /// Longest page-aligned prefix of `key` in the tree. Appends the device pages of the
    /// device prefix to `out`. The key is truncated to whole pages first. Refreshes access
    /// times along the path and splits a node when the match ends inside it (so the returned
    /// anchors end exactly at the match). Takes no lock.
    pub fn match_prefix(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> TreeMatch {
        let now = self.next_tick();
        self.match_down(key, now, MatchAt::root(self.root), out)
    }

    /// [`RadixTree::match_prefix`] for a caller that knows a node on `key`'s path: `hint`
    /// (e.g. the deepest node an earlier match of the same request reached, whose key has only
    /// grown since) must have `key[..depth]` as its path from the root. The path down to it is
    /// read through the parent links and only the tokens past it are compared, so a match
    /// repeated while a request waits costs the hint's depth in nodes, not its tokens. The
    /// result, the access times and the splits are those of [`RadixTree::match_prefix`].
    ///
    /// A hint that is stale, deeper than `key`'s whole pages, in another namespace or whose
    /// last page differs from `key`'s at that depth is ignored (the walk starts at the root).
    pub fn match_prefix_from(
        &mut self,
        hint: NodeId,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> TreeMatch {
        let p = self.page_size;
        let whole = key.tokens.len() - key.tokens.len() % p;
        let Ok(start) = self.resolve(hint) else {
            return self.match_prefix(key, out);
        };
        // Decided at the hint itself, before its path is read: a node's depth is kept, and a
        // path below the root stays in one namespace (the audit checks both).
        let depth = self.depth_of(start);
        let n = &self.nodes[start as usize];
        let usable = start != self.root
            && (p..=whole).contains(&depth)
            && n.namespace == *key.namespace
            && n.key[n.key.len() - p..] == key.tokens[depth - p..depth];
        if !usable {
            return self.match_prefix(key, out);
        }
        let mut path = std::mem::take(&mut self.path_scratch);
        path.clear();
        self.push_path(start, &mut path);
        debug_assert!(
            self.path_tokens(&path)
                .eq(key.tokens[..depth].iter().copied()),
            "match hint's path is not a prefix of the key"
        );
        let now = self.next_tick();
        // The hint's path, root first, as the walk from the root would visit it.
        let mut at = MatchAt::root(self.root);
        let mut stopped = false;
        for &child in path.iter().rev() {
            let len = self.nodes[child as usize].key.len();
            if !self.match_visit(child, len, now, &mut at, out) {
                stopped = true;
                break;
            }
            at.pos += len;
            at.node = child;
        }
        self.path_scratch = path;
        if stopped {
            return at.result(self);
        }
        self.match_down(key, now, at, out)
    }

    /// Appends the first `n` tokens of the path from the root to `node` to `out`: the tokens
    /// a request locked at `node` dropped from its key ([`RequestKv::drop_cached_prefix`]),
    /// for [`PrefixCache::restore_key`].
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the path holds
    /// fewer than `n` tokens (`out` is left as it was).
    ///
    /// [`RequestKv::drop_cached_prefix`]: crate::RequestKv::drop_cached_prefix
    /// [`PrefixCache::restore_key`]: crate::PrefixCache::restore_key
    pub fn path_prefix_tokens(&self, node: NodeId, n: usize, out: &mut Vec<TokenId>) -> Result<()> {
        let idx = self.resolve(node)?;
        if self.depth_of(idx) < n {
            return Err(CacheError::InvalidRequestState(
                "the lock anchor's path holds fewer tokens than the key dropped",
            ));
        }
        let mut path = Vec::new();
        self.push_path(idx, &mut path);
        out.reserve(n);
        let mut left = n;
        for &i in path.iter().rev() {
            let key = &self.nodes[i as usize].key;
            let take = left.min(key.len());
            out.extend_from_slice(&key[..take]);
            left -= take;
            if left == 0 {
                break;
            }
        }
        Ok(())
    }

    /// The tokens of `path` (deepest first), root first.
    pub(super) fn path_tokens<'a>(&'a self, path: &'a [u32]) -> impl Iterator<Item = TokenId> + 'a {
        path.iter()
            .rev()
            .flat_map(|&i| self.nodes[i as usize].key.iter().copied())
    }

    /// The walk of [`RadixTree::match_prefix`] from `at` down.
    fn match_down(
        &mut self,
        key: KeyRef<'_>,
        now: u64,
        mut at: MatchAt,
        out: &mut Vec<PageId>,
    ) -> TreeMatch {
        let p = self.page_size;
        let key = key.prefix(key.tokens.len() - key.tokens.len() % p);
        while at.pos < key.tokens.len() {
            let Some((child, common)) = self.step_down(at.node, key, at.pos) else {
                break;
            };
            if !self.match_visit(child, common, now, &mut at, out) {
                break;
            }
            let n = &self.nodes[child as usize];
            at.pos += common;
            at.node = child;
            if common < n.key.len() {
                break;
            }
        }
        at.result(self)
    }

    /// A match reaches `child`, matching `len` tokens of it: touches it and takes its device
    /// pages while the match is still on device. False when the match stops before it
    /// (neither on device nor backed up).
    #[inline]
    fn match_visit(
        &mut self,
        child: u32,
        len: usize,
        now: u64,
        at: &mut MatchAt,
        out: &mut Vec<PageId>,
    ) -> bool {
        self.touch(child, now);
        let n = &self.nodes[child as usize];
        if at.on_device && n.on_device() {
            out.extend_from_slice(&n.pages);
            at.device_len += len;
            at.last_device = child;
        } else if n.host.is_some() {
            at.on_device = false;
        } else {
            return false;
        }
        true
    }

    /// One step of a walk: the child of `node` (which ends at token `pos` of `key`, whose
    /// tokens are whole pages) that starts with the page at `pos`, and how many tokens of
    /// `key` from `pos` it matches (whole pages). A child matched only in part is split
    /// first, so the returned node ends exactly at the match. The key's match hashes accept
    /// a whole edge where they reach its end, and the nodes they reach learn them.
    #[inline]
    pub(super) fn step_down(
        &mut self,
        node: u32,
        key: KeyRef<'_>,
        pos: usize,
    ) -> Option<(u32, usize)> {
        if let Some(c) = self.child_by_end_hash(node, key, pos) {
            // Accepted by the end hash it already holds: nothing to split or learn.
            return Some((c, self.nodes[c as usize].key.len()));
        }
        let p = self.page_size;
        let child = self.find_child(node, key.namespace, &key.tokens[pos..pos + p])?;
        let common = self.edge_match(child, key, pos);
        let child = if common < self.nodes[child as usize].key.len() {
            self.split(child, common)
        } else {
            child
        };
        let h = self.end_hash_at(key, pos + common);
        if h != 0 && self.nodes[child as usize].end_hash == 0 {
            self.nodes[child as usize].end_hash = h;
            self.verify_end_hash(child);
        }
        Some((child, common))
    }

    /// The match hash of `key`'s page ending at token `end` (0 when its hashes do not reach
    /// it): the end hash of a node that ends there.
    #[inline]
    pub(super) fn end_hash_at(&self, key: KeyRef<'_>, end: usize) -> u128 {
        (key.pages_before + end / self.page_size)
            .checked_sub(1)
            .and_then(|i| key.hashes.get(i))
            .map_or(0, |h| h.0)
    }

    /// The child of `node` whose whole edge the key's match hashes accept from `pos`, found
    /// among a few children (most nodes on a conversation's path have one) by the hash at each
    /// child's end alone: neither the child's tokens nor the key's are read, where finding the
    /// child by its first page reads both (a cache miss per node on a long path). `None`
    /// when the key carries no hash there, the node has many children (their table finds
    /// the child by its first page), or no child's edge is wholly matched.
    #[inline]
    fn child_by_end_hash(&self, node: u32, key: KeyRef<'_>, pos: usize) -> Option<u32> {
        if key.hashes.len() <= key.pages_before + pos / self.page_size {
            return None;
        }
        let Children::Inline(children) = &self.nodes[node as usize].children else {
            return None;
        };
        children
            .iter()
            .copied()
            .find(|&c| self.hashes_accept_edge(c, key, pos))
    }

    /// True when `key`'s match hash at the end of `child`'s edge (from `pos`) is the child's
    /// end hash: the whole edge matches without comparing tokens. Debug builds compare them
    /// (and the namespace under the root) and report a hash that is not the tokens' chain,
    /// which is then not trusted.
    #[inline]
    fn hashes_accept_edge(&self, child: u32, key: KeyRef<'_>, pos: usize) -> bool {
        let n = &self.nodes[child as usize];
        let end = pos + n.key.len();
        let accepted =
            n.end_hash != 0 && end <= key.tokens.len() && self.end_hash_at(key, end) == n.end_hash;
        if accepted
            && cfg!(debug_assertions)
            && (n.key[..] != key.tokens[pos..end]
                || (n.parent == self.root && n.namespace != *key.namespace))
        {
            self.note_broken_hash();
            return false;
        }
        accepted
    }

    /// Records that a match hash accepted an edge whose tokens differ (debug builds).
    #[cold]
    fn note_broken_hash(&self) {
        self.hash_contract_broken.store(true, Ordering::Relaxed);
    }

    /// How many tokens of `key` (whole pages) from `pos` the edge of `child` (a child found by
    /// the page at `pos`) matches: all of it when the key's match hash at the edge's end is
    /// the node's, else by comparing tokens.
    #[inline]
    pub(super) fn edge_match(&self, child: u32, key: KeyRef<'_>, pos: usize) -> usize {
        let n = &self.nodes[child as usize];
        if self.hashes_accept_edge(child, key, pos) {
            return n.key.len();
        }
        common_pages(&n.key, &key.tokens[pos..], self.page_size)
    }

    /// An insert passed through `idx`: count the reuse (unless chunked), raise the priority,
    /// then touch, so the policy keys the leaf by the new statistics.
    #[inline]
    fn record_reuse(&mut self, idx: u32, opts: InsertOptions, now: u64) {
        let n = &mut self.nodes[idx as usize];
        if !opts.chunked {
            n.meta.hit_count = n.meta.hit_count.saturating_add(1);
        }
        n.meta.priority = n.meta.priority.max(opts.priority);
        self.touch(idx, now);
    }

    /// Splits `child` so that its first `at` tokens become a new parent node; returns the new
    /// node. The child keeps its id, so outstanding receipts anchored at it stay valid.
    pub(super) fn split(&mut self, child: u32, at: usize) -> u32 {
        let p = self.page_size;
        debug_assert!(at > 0 && at.is_multiple_of(p) && at < self.nodes[child as usize].key.len());
        let pages_at = at / p;
        let c = &mut self.nodes[child as usize];
        let tail_key = c.key.split_off(at);
        let mut head_key = std::mem::replace(&mut c.key, tail_key);
        // The head keeps the edge's allocation: give back what the tail took from it, so a
        // split prefix does not hold its old leaf's memory.
        if head_key.capacity() > 2 * head_key.len() {
            head_key.shrink_to_fit();
        }
        let head_pages = if c.pages.is_empty() {
            Vec::new()
        } else {
            let tail = c.pages.split_off(pages_at);
            std::mem::replace(&mut c.pages, tail)
        };
        let head_host = c.host.as_mut().map(|h| {
            let tail = h.split_off(pages_at);
            std::mem::replace(h, tail)
        });
        let head_hashes = if c.page_hashes.is_empty() {
            Vec::new()
        } else {
            let tail = c.page_hashes.split_off(pages_at);
            std::mem::replace(&mut c.page_hashes, tail)
        };
        let head_keys = if c.page_keys.is_empty() {
            Vec::new()
        } else {
            let tail = c.page_keys.split_off(pages_at);
            std::mem::replace(&mut c.page_keys, tail)
        };
        let parent = c.parent;
        let depth = c.depth - c.key.len();
        let mid_node = Node {
            parent,
            key: head_key,
            depth,
            pages: head_pages,
            host: head_host,
            children: Children::default(),
            child_hash: c.child_hash,
            namespace: c.namespace.clone(),
            lock_ref: c.lock_ref,
            device_children: u32::from(c.on_device()),
            meta: c.meta,
            leaf: None,
            page_hashes: head_hashes,
            end_hash: 0,
            page_keys: head_keys,
        };
        let mid = self.alloc_node(mid_node);
        if let Some(w) = self.swa.as_deref_mut() {
            w.split(child, mid, pages_at, self.generations[mid as usize]);
        }
        self.replace_child(parent, child, mid);
        let new_hash = self.child_hash(
            mid,
            &Namespace::DEFAULT,
            &self.nodes[child as usize].key[..p],
        );
        let c = &mut self.nodes[child as usize];
        c.parent = mid;
        c.child_hash = new_hash;
        if let Children::Inline(v) = &mut self.nodes[mid as usize].children {
            v.push(child);
        }
        // The child's leaf status is unchanged (its own state did not change); the new parent
        // may be a leaf only in tiered caches (child not on device).
        self.update_leaf(mid);
        mid
    }

    // ---------------------------------------------------------------------------------------
    // Insert

    /// Inserts `key` (page-aligned, non-empty) with one device page per page in `pages`.
    ///
    /// Where the tree already holds a device page for a position and it differs from
    /// `pages[i]`, the caller's page is a duplicate: it is appended to `replaced` and `pages[i]`
    /// is overwritten with the tree's page, so on return `pages` is the canonical page list of
    /// the key. Every other page of `pages` is adopted by the tree (the caller must mark it
    /// tree-owned). Nodes that exist only on the host tier adopt the caller's pages.
    ///
    /// # Errors
    /// [`CacheError::EmptyKey`], [`CacheError::Misaligned`], [`CacheError::LengthMismatch`];
    /// the tree is unchanged then.
    pub fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        if key.tokens.is_empty() {
            return Err(CacheError::EmptyKey);
        }
        self.check_key_pages(key.tokens, pages)?;
        self.insert_at(self.root, key, pages, replaced, opts)
    }

    /// A key must be whole pages with one page per page of tokens.
    pub(super) fn check_key_pages(&self, tokens: &[TokenId], pages: &[PageId]) -> Result<()> {
        let p = self.page_size;
        if !tokens.len().is_multiple_of(p) {
            return Err(CacheError::Misaligned {
                len: tokens.len(),
                page_size: p,
            });
        }
        if pages.len() * p != tokens.len() {
            return Err(CacheError::LengthMismatch {
                tokens: tokens.len(),
                pages: pages.len(),
                page_size: p,
            });
        }
        Ok(())
    }

    /// Like [`RadixTree::insert`], but starts the walk at `anchor`, which must end exactly at
    /// token `offset` of `key` (a node locked by the request whose key this is: its path is
    /// `key[..offset]` and its pages are already the caller's first `offset / P` pages). The
    /// cached prefix is not compared again, which makes finishing a request cost its new tokens
    /// only; the anchor's ancestors still get their reuse statistics. `prefix_len` counts from
    /// `offset` on top of it. It is [`RadixTree::insert_tail`] of the key's tokens from
    /// `offset` on.
    ///
    /// # Errors
    /// [`CacheError::Misaligned`], [`CacheError::LengthMismatch`], [`CacheError::StaleNode`] for a dead anchor and
    /// [`CacheError::InvalidRequestState`] when the anchor does not end at `offset`.
    pub fn insert_from(
        &mut self,
        anchor: NodeId,
        offset: usize,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        self.check_key_pages(key.tokens, pages)?;
        let (Some(tail), Some(pages)) = (
            key.tokens.get(offset..),
            pages.get_mut(offset / self.page_size..),
        ) else {
            return Err(ANCHOR_OFF);
        };
        let tail = KeyRef::with_namespace(tail, key.namespace);
        self.insert_tail(anchor, offset, tail, key.hashes, pages, replaced, opts)
    }

    /// [`RadixTree::insert_from`] of a key given only from `offset` on: `tail` is tokens
    /// `offset..` of the key (whole pages), `pages` their device pages, and `hashes` the match
    /// hashes of the whole key, by page from its first (any number of them). The walk below
    /// `anchor` reads the tail only, and the hashes from the key's page `offset / P` on
    /// (accepting edges by them and giving new nodes their end hashes, as a walk of the whole
    /// key does), so a request need not hold the tokens the tree already holds on its locked
    /// path ([`RequestKv::drop_cached_prefix`](crate::RequestKv::drop_cached_prefix)).
    /// Positions in the result count from the key's first token.
    ///
    /// # Errors
    /// As [`RadixTree::insert_from`]; [`CacheError::EmptyKey`] for an empty tail under the
    /// root.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_tail(
        &mut self,
        anchor: NodeId,
        offset: usize,
        tail: KeyRef<'_>,
        hashes: &crate::page_hash::PageHashes,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        let start = self.resolve(anchor)?;
        // The anchor's depth is whole pages, so the tail starts a page.
        if self.depth_of(start) != offset {
            return Err(ANCHOR_OFF);
        }
        self.check_key_pages(tail.tokens, pages)?;
        if tail.is_empty() && start == self.root {
            return Err(CacheError::EmptyKey);
        }
        // The walk counts positions from the anchor, and the hashes from the key's first page.
        let key = KeyRef {
            hashes,
            pages_before: offset / self.page_size,
            ..tail
        };
        let mut r = self.insert_at(start, key, pages, replaced, opts)?;
        r.prefix_len += offset;
        Ok(r)
    }

    /// Inserts `key` below `start` (the root, or an anchor whose path is the key's
    /// `key.pages_before` pages): positions count from `start`, and `prefix_len` from it.
    pub(super) fn insert_at(
        &mut self,
        start: u32,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        let p = self.page_size;
        let tokens = key.tokens;
        let now = self.next_tick();
        // The anchor's path was matched before: it only needs its statistics refreshed.
        let mut up = start;
        while up != self.root {
            self.record_reuse(up, opts, now);
            up = self.nodes[up as usize].parent;
        }
        let mut node = start;
        let mut pos = 0;
        let mut prefix_len = 0;
        let mut adopted = 0;
        let mut prefix_done = false;
        while pos < tokens.len() {
            let Some((child, common)) = self.step_down(node, key, pos) else {
                break;
            };
            self.record_reuse(child, opts, now);
            let seg = &mut pages[pos / p..(pos + common) / p];
            if self.nodes[child as usize].on_device() {
                for (mine, theirs) in seg.iter_mut().zip(&self.nodes[child as usize].pages) {
                    if *mine != *theirs {
                        replaced.push(*mine);
                        *mine = *theirs;
                    }
                }
                if !prefix_done {
                    prefix_len += common;
                }
            } else {
                // Host-only node (tiered caches): take the caller's pages.
                prefix_done = true;
                self.nodes[child as usize].pages = seg.to_vec();
                self.on_device_added(child, common);
                adopted += common;
            }
            pos += common;
            node = child;
        }
        if pos < tokens.len() {
            let leaf = self.new_leaf(
                node,
                key.namespace,
                &tokens[pos..],
                &pages[pos / p..],
                self.end_hash_at(key, tokens.len()),
                now,
                opts,
            );
            adopted += tokens.len() - pos;
            node = leaf;
        }
        Ok(TreeInsert {
            prefix_len,
            adopted_len: adopted,
            last_node: self.id_of(node),
        })
    }

    /// A new leaf below `parent` for `tokens` (whole pages) with device pages `pages`;
    /// `end_hash` is its last page's match hash (0: unknown).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_leaf(
        &mut self,
        parent: u32,
        ns: &Namespace,
        tokens: &[TokenId],
        pages: &[PageId],
        end_hash: u128,
        now: u64,
        opts: InsertOptions,
    ) -> u32 {
        let p = self.page_size;
        let child_hash = self.child_hash(parent, ns, &tokens[..p]);
        let mut page_hashes = Vec::new();
        if self.events.is_some() {
            let seed = self.nodes[parent as usize]
                .page_hashes
                .last()
                .copied()
                .unwrap_or_else(|| namespace_seed(ns));
            page_hashes.reserve_exact(pages.len());
            chain_hashes(seed, tokens, p, &mut page_hashes);
        }
        let page_keys = self.chain_page_keys(parent, ns, tokens);
        let key = self.bufs.tokens(tokens);
        let node_pages = self.bufs.pages(pages);
        let depth = self.nodes[parent as usize].depth + key.len();
        let idx = self.alloc_node(Node {
            parent,
            key,
            depth,
            pages: node_pages,
            host: None,
            children: Children::default(),
            child_hash,
            namespace: ns.clone(),
            lock_ref: 0,
            device_children: 0,
            meta: NodeMeta {
                last_access: now,
                created: now,
                hit_count: 0,
                priority: opts.priority,
            },
            leaf: None,
            page_hashes,
            end_hash,
            page_keys,
        });
        self.add_child(parent, idx);
        self.verify_end_hash(idx);
        self.on_device_added(idx, tokens.len());
        self.emit_stored(idx, Medium::Device);
        idx
    }

    /// Counter and leaf bookkeeping after node `idx` gained `len` device tokens.
    pub(super) fn on_device_added(&mut self, idx: u32, len: usize) {
        if self.nodes[idx as usize].lock_ref > 0 {
            self.protected += len;
        } else {
            self.evictable += len;
        }
        let parent = self.nodes[idx as usize].parent;
        self.nodes[parent as usize].device_children += 1;
        self.update_leaf(parent);
        self.update_leaf(idx);
    }

    pub(super) fn emit_stored(&mut self, idx: u32, medium: Medium) {
        if self.events.is_none() {
            return;
        }
        let n = &self.nodes[idx as usize];
        let parent = &self.nodes[n.parent as usize];
        let ev = KvEvent::BlockStored {
            page_hashes: n.page_hashes.clone(),
            parent_hash: parent.page_hashes.last().copied(),
            token_ids: n.key.clone(),
            page_size: self.page_size,
            namespace: n.namespace.clone(),
            medium,
            page_keys: n.page_keys.clone(),
            parent_key: parent.page_keys.last().copied(),
        };
        self.push_event(ev);
    }

    /// Emits a `BlockRemoved` event for node `idx` on `medium` (the counterpart of
    /// [`RadixTree::emit_stored`]).
    pub(super) fn emit_removed(&mut self, idx: u32, medium: Medium) {
        if self.events.is_none() {
            return;
        }
        let n = &self.nodes[idx as usize];
        let ev = KvEvent::BlockRemoved {
            page_hashes: n.page_hashes.clone(),
            namespace: n.namespace.clone(),
            medium,
            page_keys: n.page_keys.clone(),
        };
        self.push_event(ev);
    }
}
