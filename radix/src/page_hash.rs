//! Match hashes: a 128-bit hash chain over a prompt's pages that lets a match skip comparing
//! the tokens of a cached prefix.
//!
//! Matching a prompt against the tree compares its tokens with the tree's, so a request whose
//! first 120K tokens are cached reads all 120K of them (and as many of the tree's) at every
//! admission. An engine that already knows its prompt's page hashes (it computes them as
//! tokens are appended, once per token over a conversation's life, the way vLLM keeps its
//! request block hashes) can hand them over with the prompt: [`RequestKv::page_hashes`] (or
//! [`KeyRef::with_hashes`] for the tree). The tree remembers the hash of the last page of
//! every node it learns one for, and a match then accepts a whole edge when the prompt's hash
//! at the edge's end equals the node's: one comparison per node on the path instead of one per
//! token. The first page of each edge is still compared token by token (it picks the child),
//! and an edge that ends past the hashed pages, has no hash yet or differs is compared token by
//! token as before, so a match's result never depends on whether hashes were given.
//!
//! The hashes come from the tree's [`PageHasher`] ([`RadixTree::page_hasher`],
//! [`PrefixCache::page_hasher`]): `h(0) = seed(namespace)`, `h(i + 1) = XXH3-128(h(i) ‖ page
//! i's tokens)` keyed by a seed drawn at random for each tree. The keyed seed keeps the
//! hashes inside the process that made them: they are never published (KV events carry their
//! own deterministic chain) and never address stored KV (the storage tier uses [`PageKey`]s).
//! An accidental match of two 128-bit chains is out of reach. XXH3 is not a cryptographic
//! hash: against a crafted prompt the defence is the one of a hash map's random seed (an
//! attacker who never sees a hash has nothing to aim at), not collision resistance, and the
//! match still compares each edge's first page by its tokens.
//!
//! **Contract.** Hashes given with a prompt must be the hasher's chain over that prompt's
//! leading whole pages (as many as the engine has; fewer is fine, extra ones are ignored).
//! Other hashes give wrong matches in release builds. Debug builds compare the tokens of every
//! edge a hash accepts and match by tokens where they differ, check every hash a node is given
//! against its path's tokens, and report either as an invariant violation
//! ([`RadixTree::check`](crate::RadixTree::check)).
//!
//! ```
//! use radixkv_radix::{KeyRef, PageId, PolicyKind, RadixTree};
//!
//! let mut tree = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
//! let hasher = tree.page_hasher();
//! let tokens = [1, 2, 3, 4, 5, 6];
//! let hashes = hasher.hashes(&radixkv_radix::Namespace::DEFAULT, &tokens);
//! assert_eq!(hashes.len(), 3);
//! // Extending a chain by a page gives the next hash.
//! assert_eq!(hasher.extend(hashes.get(1).unwrap(), &tokens[4..6]), hashes.get(2).unwrap());
//!
//! let mut pages = vec![PageId(10), PageId(11), PageId(12)];
//! let key = KeyRef::new(&tokens).with_hashes(&hashes);
//! tree.insert(key, &mut pages, &mut Vec::new(), Default::default()).unwrap();
//! let mut out = Vec::new();
//! assert_eq!(tree.match_prefix(key, &mut out).device_len, 6);
//! ```
//!
//! [`RequestKv::page_hashes`]: crate::RequestKv::page_hashes
//! [`KeyRef::with_hashes`]: crate::KeyRef::with_hashes
//! [`RadixTree::page_hasher`]: crate::RadixTree::page_hasher
//! [`PrefixCache::page_hasher`]: crate::PrefixCache::page_hasher
//! [`PageKey`]: crate::PageKey

use std::sync::Arc;

use xxhash_rust::xxh3::{Xxh3, xxh3_128_with_seed};

use crate::types::{Namespace, TokenId};

/// The chain hash of a prompt's pages up to and including one page (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHash(pub u128);

/// A prompt's match hashes, one per leading whole page, held in shared chunks of
/// [`PageHashes::CHUNK`]: a clone shares them (`O(pages / CHUNK)`), and growing or cutting a
/// clone copies at most its last chunk. So an engine that keeps a conversation's hashes hands
/// each turn a clone of them, extended by the turn's new pages, without copying the history's.
///
/// A chunk is one allocation holding its hashes inline, so reading a hash follows one pointer
/// (a match reads one at each node it passes, scattered over the prompt). Slots past `len`
/// in the last chunk are stale and never read.
#[derive(Clone, Default)]
pub struct PageHashes {
    chunks: Vec<Arc<Chunk>>,
    len: usize,
}

/// [`PageHashes::CHUNK`] hash slots.
type Chunk = [PageHash; PageHashes::CHUNK];

impl PartialEq for PageHashes {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for PageHashes {}

/// No hashes.
pub(crate) static NO_HASHES: PageHashes = PageHashes::new();

impl std::fmt::Debug for PageHashes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageHashes({} pages)", self.len)
    }
}

impl PageHashes {
    /// Hashes per shared chunk (4 KiB of hashes).
    pub const CHUNK: usize = 256;

    /// No hashes.
    pub const fn new() -> Self {
        PageHashes {
            chunks: Vec::new(),
            len: 0,
        }
    }

    /// Pages hashed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no page is hashed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The hash of page `i` (`None` past the hashed pages).
    #[inline]
    pub fn get(&self, i: usize) -> Option<PageHash> {
        if i >= self.len {
            return None;
        }
        Some(self.chunks[i / Self::CHUNK][i % Self::CHUNK])
    }

    /// The last page's hash.
    pub fn last(&self) -> Option<PageHash> {
        self.len.checked_sub(1).and_then(|i| self.get(i))
    }

    /// The hashes in page order.
    pub fn iter(&self) -> impl Iterator<Item = PageHash> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| c.iter().copied())
            .take(self.len)
    }

    /// Appends a page's hash (copies the last chunk first if another clone shares it).
    pub fn push(&mut self, h: PageHash) {
        let at = self.len % Self::CHUNK;
        match self.chunks.last_mut() {
            Some(c) if at > 0 => Arc::make_mut(c)[at] = h,
            _ => {
                let mut c = [PageHash(0); Self::CHUNK];
                c[0] = h;
                self.chunks.push(Arc::new(c));
            }
        }
        self.len += 1;
    }

    /// Keeps the first `n` hashes.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        // The last kept chunk's slots past `n` go stale: a push writes them anew (after
        // copying the chunk if a clone still reads them).
        self.chunks.truncate(n.div_ceil(Self::CHUNK));
        self.len = n;
    }

    /// Bytes of hashes held (shared chunks counted whole, as if this clone were their only
    /// holder).
    pub fn bytes(&self) -> usize {
        self.chunks.len() * Self::CHUNK * std::mem::size_of::<PageHash>()
    }

    /// Bytes of hashes that `lists` hold together: a chunk that several of them share is
    /// counted once (what a set of clones, such as a conversation's turns, costs).
    pub fn bytes_together<'a>(lists: impl IntoIterator<Item = &'a PageHashes>) -> usize {
        let mut chunks: Vec<*const Chunk> = lists
            .into_iter()
            .flat_map(|l| l.chunks.iter().map(Arc::as_ptr))
            .collect();
        chunks.sort_unstable();
        chunks.dedup();
        chunks.len() * Self::CHUNK * std::mem::size_of::<PageHash>()
    }
}

impl From<Vec<PageHash>> for PageHashes {
    fn from(v: Vec<PageHash>) -> Self {
        v.into_iter().collect()
    }
}

impl FromIterator<PageHash> for PageHashes {
    fn from_iter<I: IntoIterator<Item = PageHash>>(iter: I) -> Self {
        let mut h = PageHashes::new();
        for x in iter {
            h.push(x);
        }
        h
    }
}

/// Pages of up to this many tokens are hashed from a buffer on the stack.
const STACK_PAGE_TOKENS: usize = 252;

/// Computes match hashes for one tree: its page size and its random seed.
#[derive(Copy, Clone, PartialEq, Eq)]
pub struct PageHasher {
    seed: u64,
    page_size: usize,
}

impl std::fmt::Debug for PageHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The seed stays out of logs.
        f.debug_struct("PageHasher")
            .field("page_size", &self.page_size)
            .finish_non_exhaustive()
    }
}

impl PageHasher {
    /// A hasher with a fresh random seed.
    pub(crate) fn random(page_size: usize) -> Self {
        let seed = ahash::RandomState::new().hash_one(0x7261_6469_786b_7621_u64);
        PageHasher { seed, page_size }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The chain's start for `namespace` (the "hash" before the first page).
    pub fn seed(&self, namespace: &Namespace) -> PageHash {
        PageHash(xxh3_128_with_seed(namespace.name().as_bytes(), self.seed))
    }

    /// The hash of the page after `prev` whose tokens are `page` (one page of tokens).
    #[inline]
    pub fn extend(&self, prev: PageHash, page: &[TokenId]) -> PageHash {
        debug_assert_eq!(page.len(), self.page_size, "one page of tokens");
        if page.len() <= STACK_PAGE_TOKENS {
            let mut buf = [0u8; 16 + 4 * STACK_PAGE_TOKENS];
            buf[..16].copy_from_slice(&prev.0.to_le_bytes());
            for (dst, t) in buf[16..].chunks_exact_mut(4).zip(page) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            PageHash(xxh3_128_with_seed(&buf[..16 + 4 * page.len()], self.seed))
        } else {
            let mut h = Xxh3::with_seed(self.seed);
            h.update(&prev.0.to_le_bytes());
            for t in page {
                h.update(&t.to_le_bytes());
            }
            PageHash(h.digest128())
        }
    }

    /// The hashes of `tokens`' whole pages in `namespace`.
    pub fn hashes(&self, namespace: &Namespace, tokens: &[TokenId]) -> PageHashes {
        let mut h = PageHashes::new();
        self.extend_chain(namespace, tokens, &mut h);
        h
    }

    /// Extends `hashes` (the chain of `tokens`' first `hashes.len()` pages in `namespace`, as
    /// an engine keeps it for a growing prompt; more are cut back to `tokens`' whole pages)
    /// to all of `tokens`' whole pages: the new pages only are hashed.
    pub fn extend_chain(&self, namespace: &Namespace, tokens: &[TokenId], hashes: &mut PageHashes) {
        let p = self.page_size;
        let done = hashes.len().min(tokens.len() / p);
        hashes.truncate(done);
        let mut h = hashes.last().unwrap_or_else(|| self.seed(namespace));
        for page in tokens[done * p..].chunks_exact(p) {
            h = self.extend(h, page);
            hashes.push(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_order_and_namespace_sensitive() {
        let h = PageHasher::random(2);
        let a = h.hashes(&Namespace::DEFAULT, &[1, 2, 3, 4, 5]);
        assert_eq!(a.len(), 2);
        let b = h.hashes(&Namespace::DEFAULT, &[3, 4, 1, 2]);
        assert_ne!(a.get(1), b.get(1));
        // The second page's hash depends on the first page.
        assert_ne!(
            a.get(1),
            Some(h.extend(h.seed(&Namespace::DEFAULT), &[3, 4]))
        );
        let c = h.hashes(&Namespace::new("tenant"), &[1, 2, 3, 4]);
        assert_ne!(a.get(0), c.get(0));
        // Two trees' hashers do not agree (random seeds).
        let other = PageHasher::random(2);
        let d = other.hashes(&Namespace::DEFAULT, &[1, 2]);
        assert_ne!(a.get(0), d.get(0));
    }

    #[test]
    fn extend_chain_hashes_only_new_pages_and_agrees() {
        let h = PageHasher::random(3);
        let tokens: Vec<TokenId> = (0..20).collect();
        // The chain by its definition: the seed, then one `extend` per whole page.
        let whole: Vec<PageHash> = tokens
            .chunks_exact(3)
            .scan(h.seed(&Namespace::DEFAULT), |prev, page| {
                *prev = h.extend(*prev, page);
                Some(*prev)
            })
            .collect();
        assert_eq!(whole.len(), 6);
        let mut grown = PageHashes::new();
        h.extend_chain(&Namespace::DEFAULT, &tokens[..7], &mut grown);
        assert_eq!(grown.len(), 2);
        h.extend_chain(&Namespace::DEFAULT, &tokens, &mut grown);
        assert_eq!(grown.iter().collect::<Vec<_>>(), whole);
        // A chain longer than the tokens' pages is cut back to them.
        h.extend_chain(&Namespace::DEFAULT, &tokens[..6], &mut grown);
        assert_eq!(grown.iter().collect::<Vec<_>>(), whole[..2]);
    }

    #[test]
    fn clones_share_chunks_and_grow_or_cut_apart() {
        let n = 3 * PageHashes::CHUNK + 17;
        let all: Vec<PageHash> = (0..n as u128).map(PageHash).collect();
        let a = PageHashes::from(all.clone());
        assert_eq!(
            (a.len(), a.get(n - 1), a.get(n)),
            (n, Some(all[n - 1]), None)
        );
        assert_eq!(a.iter().collect::<Vec<_>>(), all);
        let mut b = a.clone();
        // Cutting inside a shared chunk and growing past it leaves the original whole.
        b.truncate(PageHashes::CHUNK + 5);
        b.push(PageHash(u128::MAX));
        assert_eq!(b.len(), PageHashes::CHUNK + 6);
        assert_eq!(b.get(PageHashes::CHUNK + 5), Some(PageHash(u128::MAX)));
        assert_eq!(
            b.get(PageHashes::CHUNK + 4),
            Some(all[PageHashes::CHUNK + 4])
        );
        assert_eq!(a.iter().collect::<Vec<_>>(), all);
        // Cutting at a chunk boundary, to nothing, and past the end.
        let mut c = a.clone();
        c.truncate(2 * PageHashes::CHUNK);
        assert_eq!(c.len(), 2 * PageHashes::CHUNK);
        assert_eq!(c.last(), Some(all[2 * PageHashes::CHUNK - 1]));
        c.truncate(usize::MAX);
        assert_eq!(c.len(), 2 * PageHashes::CHUNK);
        c.truncate(0);
        assert!(c.is_empty() && c.last().is_none());
        assert_eq!(a.iter().collect::<PageHashes>(), a);
        assert_eq!(a.bytes(), 4 * PageHashes::CHUNK * 16);
        // A cut clone equals the same hashes built afresh (its last chunk's stale slots are
        // not compared), and differs once it grows apart.
        let mut d = a.clone();
        d.truncate(PageHashes::CHUNK + 5);
        let mut e: PageHashes = all[..PageHashes::CHUNK + 5].iter().copied().collect();
        assert_eq!(d, e);
        assert_eq!(d.iter().count(), PageHashes::CHUNK + 5);
        e.push(PageHash(7));
        assert_ne!(d, e);
        d.push(PageHash(7));
        assert_eq!(d, e);
    }

    #[test]
    fn large_pages_hash_like_small_ones_would() {
        // Pages past the stack buffer take the streaming path: still a chain, still stable.
        let h = PageHasher::random(300);
        let tokens: Vec<TokenId> = (0..600).collect();
        let a = h.hashes(&Namespace::DEFAULT, &tokens);
        let b = h.hashes(&Namespace::DEFAULT, &tokens);
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
        assert_eq!(Some(h.extend(a.get(0).unwrap(), &tokens[300..])), a.get(1));
    }
}
