//! Plain value types shared by every layer: token ids, pages, rows, namespaces, keys, node handles.

use std::fmt;
use std::sync::Arc;

use crate::page_hash::{NO_HASHES, PageHashes};

/// A token id as the tokenizer produces it.
pub type TokenId = u32;

/// Index of one page in the device KV pool. A page holds `page_size` consecutive token slots.
///
/// `#[repr(transparent)]` over `u32`: a row of pages is laid out exactly like the `u32` page
/// table an attention kernel reads, so [`PageId::as_u32_slice`] hands it over without a copy.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct PageId(pub u32);

impl PageId {
    /// The page indices of `pages` as `u32`s, without a copy: what a page table upload (a
    /// host-to-device copy of a request's row) takes.
    #[inline]
    pub fn as_u32_slice(pages: &[PageId]) -> &[u32] {
        // SAFETY: `PageId` is `#[repr(transparent)]` over `u32`, so `[PageId]` and `[u32]`
        // have the same size, alignment and element layout, and every `u32` is a valid value.
        // The slice keeps the pointer, the length and the borrow's lifetime of `pages`.
        unsafe { std::slice::from_raw_parts(pages.as_ptr().cast::<u32>(), pages.len()) }
    }

    /// The first KV slot of this page for a pool with `page_size` tokens per page (saturating
    /// for a page and page size that no pool has: a pool's token count fits `usize`).
    #[inline]
    pub fn first_slot(self, page_size: usize) -> u64 {
        u64::from(self.0).saturating_mul(page_size as u64)
    }

    /// The page index as a `usize`.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Debug for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

/// Handle to a request-pool row (the page table of one running request or session).
///
/// Rows are generation-checked: a handle kept after the row was released is reported as stale
/// instead of naming whatever row reuses the index.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct RowId {
    pub(crate) idx: u32,
    pub(crate) generation: u32,
}

impl RowId {
    /// The row index (stable while the row is alive).
    pub fn index(self) -> usize {
        self.idx as usize
    }
}

/// Handle to a tree node. Generation-checked: never names a different node than the one it was
/// issued for; a handle to a removed node is an error ([`crate::CacheError::StaleNode`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct NodeId {
    pub(crate) idx: u32,
    pub(crate) generation: u32,
}

impl NodeId {
    /// Arena index of the node (for diagnostics and policy bookkeeping).
    pub fn index(self) -> usize {
        self.idx as usize
    }

    /// A handle for arena index `idx` (generation 0) that no tree issued, so an
    /// [`crate::EvictionPolicy`] can be driven directly over one's own nodes (offline
    /// simulations of the shipped policies). Handing one to a tree is harmless: the tree checks
    /// index and generation and refuses a handle that names no live node.
    pub fn detached(idx: u32) -> NodeId {
        NodeId { idx, generation: 0 }
    }
}

/// The isolation domain of a key: tenant, LoRA adapter or cache salt.
///
/// Keys in different namespaces never share a node, not even directly below the root, so no
/// match ever crosses namespaces. The default namespace is allocation-free; named namespaces
/// share one `Arc<str>` and compare by content.
///
/// Set the namespace server-side (from the authenticated tenant): a client-chosen salt lets an
/// attacker name the victim's namespace.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace(Option<Arc<str>>);

impl Namespace {
    /// The default (shared) namespace.
    pub const DEFAULT: Namespace = Namespace(None);

    /// A named namespace. The empty string is the default namespace.
    pub fn new(name: &str) -> Self {
        if name.is_empty() {
            Self::DEFAULT
        } else {
            Namespace(Some(Arc::from(name)))
        }
    }

    /// The namespace's name (`""` for the default one).
    pub fn name(&self) -> &str {
        self.0.as_deref().unwrap_or("")
    }

    /// True for the default namespace.
    pub fn is_default(&self) -> bool {
        self.0.is_none()
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            None => f.write_str("ns:default"),
            Some(s) => write!(f, "ns:{s:?}"),
        }
    }
}

/// Serialized as its name (`""` for the default namespace), so a consumer needs no knowledge of
/// how the name is held.
impl serde::Serialize for Namespace {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Namespace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Ok(Namespace::new(&name))
    }
}

impl From<&str> for Namespace {
    fn from(s: &str) -> Self {
        Namespace::new(s)
    }
}

/// A token sequence in a namespace: what the tree is keyed by.
#[derive(Clone, Default, PartialEq, Eq, Hash, Debug)]
pub struct RadixKey {
    /// The tokens.
    pub tokens: Vec<TokenId>,
    /// The isolation domain.
    pub namespace: Namespace,
}

impl RadixKey {
    /// A key in the default namespace.
    pub fn new(tokens: Vec<TokenId>) -> Self {
        RadixKey {
            tokens,
            namespace: Namespace::DEFAULT,
        }
    }

    /// A key in `namespace`.
    pub fn with_namespace(tokens: Vec<TokenId>, namespace: Namespace) -> Self {
        RadixKey { tokens, namespace }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the key has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// A borrowed view of the whole key.
    pub fn as_ref(&self) -> KeyRef<'_> {
        KeyRef {
            tokens: &self.tokens,
            namespace: &self.namespace,
            hashes: &NO_HASHES,
            pages_before: 0,
        }
    }

    /// A borrowed view of the first `len` tokens (clamped to the key length). No copy.
    pub fn prefix(&self, len: usize) -> KeyRef<'_> {
        KeyRef {
            tokens: &self.tokens[..len.min(self.tokens.len())],
            namespace: &self.namespace,
            hashes: &NO_HASHES,
            pages_before: 0,
        }
    }
}

/// A borrowed key: a token slice, its namespace and, optionally, the match hashes of its
/// leading pages. Cheap to pass around; no allocation.
#[derive(Copy, Clone, Debug)]
pub struct KeyRef<'a> {
    /// The tokens.
    pub tokens: &'a [TokenId],
    /// The isolation domain.
    pub namespace: &'a Namespace,
    /// Match hashes of the tokens' leading whole pages (any number of them, from none; see
    /// [`crate::page_hash`]): where given, a match accepts a cached edge by its last page's
    /// hash instead of comparing its tokens.
    pub hashes: &'a PageHashes,
    /// Whole pages of the key before `tokens` (0 but for a key given from a lock anchor on,
    /// [`crate::RadixTree::insert_tail`]): `hashes` count from the key's first page, so the
    /// page `tokens` start with has hash `pages_before`.
    pub(crate) pages_before: usize,
}

impl<'a> KeyRef<'a> {
    /// A key in the default namespace.
    pub fn new(tokens: &'a [TokenId]) -> Self {
        KeyRef {
            tokens,
            namespace: &Namespace::DEFAULT,
            hashes: &NO_HASHES,
            pages_before: 0,
        }
    }

    /// A key in `namespace`.
    pub fn with_namespace(tokens: &'a [TokenId], namespace: &'a Namespace) -> Self {
        KeyRef {
            tokens,
            namespace,
            hashes: &NO_HASHES,
            pages_before: 0,
        }
    }

    /// The same key with the match hashes of its leading pages (see [`crate::page_hash`]'s
    /// contract: the tree's hasher's chain over these tokens).
    pub fn with_hashes(self, hashes: &'a PageHashes) -> Self {
        KeyRef { hashes, ..self }
    }

    /// The first `len` tokens (clamped), with the hashes that still cover whole pages of them
    /// left as they are (a match ignores hashes past the tokens).
    pub fn prefix(self, len: usize) -> Self {
        KeyRef {
            tokens: &self.tokens[..len.min(self.tokens.len())],
            ..self
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the key has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Where a copy of some KV lives. Used by events and by tiered caches. (There is no storage
/// tier yet, so no storage medium either.)
///
/// Serialized as `"device"` / `"host"`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// The device KV pool (L1).
    Device,
    /// The host pool (L2).
    Host,
}

/// Rounds `n` down to a multiple of `page_size`.
#[inline]
pub fn align_down(n: usize, page_size: usize) -> usize {
    n - n % page_size
}

/// Number of pages needed to hold `n` tokens.
#[inline]
pub fn pages_for(n: usize, page_size: usize) -> usize {
    n.div_ceil(page_size)
}

/// Where every unit of a tree component's pool is, as counts: Mamba state slots
/// ([`crate::RadixTree::mamba_accounting`]) or sliding-window KV pages
/// ([`crate::RadixTree::swa_accounting`]).
///
/// `free + evictable + protected + request_owned == total` always holds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ComponentAccounting {
    /// Units in the pool.
    pub total: usize,
    /// Free units.
    pub free: usize,
    /// Tree-held units no receipt has locked: evictable under pressure (the nodes keep their
    /// full KV).
    pub evictable: usize,
    /// Tree-held units locked by at least one receipt.
    pub protected: usize,
    /// Units held by requests (or any caller that allocated them).
    pub request_owned: usize,
}

impl ComponentAccounting {
    /// True when the four parts add up to the total.
    pub fn balanced(&self) -> bool {
        self.free + self.evictable + self.protected + self.request_owned == self.total
    }
}

#[cfg(test)]
mod tests {
    use super::PageId;

    #[test]
    fn a_row_of_pages_is_its_u32_page_table_without_a_copy() {
        assert_eq!(size_of::<PageId>(), size_of::<u32>());
        assert_eq!(align_of::<PageId>(), align_of::<u32>());
        let row = [PageId(7), PageId(0), PageId(u32::MAX), PageId(42)];
        let table = PageId::as_u32_slice(&row);
        assert_eq!(table, &[7, 0, u32::MAX, 42]);
        assert_eq!(
            table.as_ptr().cast::<PageId>(),
            row.as_ptr(),
            "the same memory"
        );
        assert_eq!(PageId::as_u32_slice(&row[1..3]), &[0, u32::MAX]);
        assert!(PageId::as_u32_slice(&[]).is_empty());
    }
}
