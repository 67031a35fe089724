//! A shadow of what is stored on each medium, built only from drained KV events.
//!
//! A KV-aware router knows nothing but the events, so they must be self-consistent and agree
//! with the cache: every stored page is reported once, a removal names a page reported stored
//! on that medium, the chain hashes match the reported tokens, residency reported per medium
//! is root-connected (a stored page's parent page is stored on the same medium), a removal
//! names the namespace the page was stored in, and the number of pages the shadow holds equals
//! what the cache holds. A shadow built with [`EventShadow::with_page_keys`] also checks each
//! page's storage key: the BLAKE3 chain from the namespace's seed over the page's tokens,
//! continued from the parent page's key, and named again by its removal.

use std::collections::HashMap;

use radixkv_radix::events::{chain_hashes, namespace_seed};
use radixkv_radix::{
    KeySeed, KvEvent, KvIdentity, Medium, Namespace, PageKey, TokenId, align_down,
};

/// A stored page: the hash of its parent page, its namespace and its storage key (with
/// page keys on).
type StoredPage = (Option<u64>, Namespace, Option<PageKey>);

/// Pages stored per medium, each with the hash of its parent page and its namespace.
#[derive(Debug, Default, Clone)]
pub struct EventShadow {
    page_size: usize,
    stored: HashMap<Medium, HashMap<u64, StoredPage>>,
    /// The identity the events' page keys chain from (`None`: events carry no keys).
    keys: Option<KvIdentity>,
    /// Events applied so far.
    pub applied: usize,
}

impl EventShadow {
    /// An empty shadow for a cache of `page_size` tokens per page.
    pub fn new(page_size: usize) -> Self {
        EventShadow {
            page_size,
            ..Default::default()
        }
    }

    /// An empty shadow for a cache whose events carry page keys chained from `identity`.
    pub fn with_page_keys(page_size: usize, identity: KvIdentity) -> Self {
        EventShadow {
            page_size,
            keys: Some(identity),
            ..Default::default()
        }
    }

    /// The storage keys a stored event must carry: the chain over `tokens` from `parent_key`
    /// (or the namespace's seed); empty without page keys.
    fn want_keys(
        &self,
        namespace: &Namespace,
        parent_key: Option<&PageKey>,
        tokens: &[TokenId],
    ) -> Vec<PageKey> {
        let mut out = Vec::new();
        if let Some(id) = &self.keys {
            KeySeed::new(namespace, id).extend_chain(parent_key, tokens, self.page_size, &mut out);
        }
        out
    }

    fn medium(&mut self, m: Medium) -> &mut HashMap<u64, StoredPage> {
        self.stored.entry(m).or_default()
    }

    /// Pages stored on `m`.
    pub fn stored(&self, m: Medium) -> usize {
        self.stored.get(&m).map_or(0, HashMap::len)
    }

    /// Applies drained events.
    ///
    /// # Errors
    /// The first inconsistency: a double store, a removal of a page not stored there (or
    /// stored in another namespace), a chain hash that does not match its tokens, or a stored page whose parent is not stored on the
    /// same medium once the batch is applied.
    pub fn apply(&mut self, events: impl IntoIterator<Item = KvEvent>) -> Result<(), String> {
        for ev in events {
            self.applied += 1;
            match ev {
                KvEvent::BlockStored {
                    page_hashes,
                    parent_hash,
                    token_ids,
                    page_size,
                    namespace,
                    medium,
                    page_keys,
                    parent_key,
                } => {
                    if page_size != self.page_size
                        || page_hashes.is_empty()
                        || token_ids.len() != page_hashes.len() * page_size
                    {
                        return Err(format!(
                            "BlockStored of {} pages with {} tokens at page size {page_size}",
                            page_hashes.len(),
                            token_ids.len()
                        ));
                    }
                    let seed = parent_hash.unwrap_or_else(|| namespace_seed(&namespace));
                    let mut want = Vec::new();
                    chain_hashes(seed, &token_ids, page_size, &mut want);
                    if want != page_hashes {
                        return Err(format!(
                            "BlockStored on {medium:?}: hashes do not chain over its tokens"
                        ));
                    }
                    if page_keys != self.want_keys(&namespace, parent_key.as_ref(), &token_ids) {
                        return Err(format!(
                            "BlockStored on {medium:?}: page keys do not chain over its tokens"
                        ));
                    }
                    let known_parent = parent_hash.and_then(|h| {
                        self.stored
                            .values()
                            .find_map(|map| map.get(&h))
                            .map(|stored| stored.2)
                    });
                    if let Some(known) = known_parent
                        && known != parent_key
                    {
                        return Err(format!(
                            "BlockStored on {medium:?}: parent key {parent_key:?}, but the \
                             parent page was stored with {known:?}"
                        ));
                    }
                    let mut parent = parent_hash;
                    let mut keys = page_keys.into_iter();
                    let map = self.medium(medium);
                    for h in page_hashes {
                        if map
                            .insert(h, (parent, namespace.clone(), keys.next()))
                            .is_some()
                        {
                            return Err(format!("page {h:#x} stored twice on {medium:?}"));
                        }
                        parent = Some(h);
                    }
                }
                KvEvent::BlockRemoved {
                    page_hashes,
                    namespace,
                    medium,
                    page_keys,
                } => {
                    if self.keys.is_some() == page_keys.is_empty()
                        || (!page_keys.is_empty() && page_keys.len() != page_hashes.len())
                    {
                        return Err(format!(
                            "BlockRemoved of {} pages with {} page keys",
                            page_hashes.len(),
                            page_keys.len()
                        ));
                    }
                    let map = self.medium(medium);
                    for (i, h) in page_hashes.into_iter().enumerate() {
                        match map.remove(&h) {
                            Some((_, _, key)) if key != page_keys.get(i).copied() => {
                                return Err(format!(
                                    "BlockRemoved of page {h:#x} names key {:?}, stored as {key:?}",
                                    page_keys.get(i)
                                ));
                            }
                            None => {
                                return Err(format!(
                                    "BlockRemoved of page {h:#x}, never stored on {medium:?}"
                                ));
                            }
                            Some((_, ns, _)) if ns != namespace => {
                                return Err(format!(
                                    "BlockRemoved of page {h:#x} in {namespace:?}, stored in {ns:?}"
                                ));
                            }
                            Some(_) => {}
                        }
                    }
                }
                KvEvent::AllBlocksCleared => self.stored.clear(),
            }
        }
        for (m, map) in &self.stored {
            if let Some((h, p)) = map
                .iter()
                .find(|(_, (p, _, _))| p.is_some_and(|p| !map.contains_key(&p)))
            {
                return Err(format!(
                    "page {h:#x} is stored on {m:?} but its parent {:?} is not",
                    p.0
                ));
            }
        }
        Ok(())
    }

    /// Checks that every whole page of `tokens[..len]` in `ns` is reported stored on `m`
    /// (what a router would believe about a hit of `len` tokens).
    ///
    /// # Errors
    /// The first page of the hit that the events never reported (or reported removed).
    pub fn check_resident(
        &self,
        m: Medium,
        ns: &Namespace,
        tokens: &[TokenId],
        len: usize,
    ) -> Result<(), String> {
        let mut hashes = Vec::new();
        let whole = align_down(len.min(tokens.len()), self.page_size);
        chain_hashes(
            namespace_seed(ns),
            &tokens[..whole],
            self.page_size,
            &mut hashes,
        );
        let stored = |h: &u64| self.stored.get(&m).is_some_and(|map| map.contains_key(h));
        match hashes.iter().position(|h| !stored(h)) {
            Some(i) => Err(format!(
                "page {i} of a {len}-token hit on {m:?} was never reported stored there"
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(tokens: &[TokenId], parent: Option<u64>, medium: Medium) -> KvEvent {
        let ns = Namespace::DEFAULT;
        let mut page_hashes = Vec::new();
        chain_hashes(
            parent.unwrap_or_else(|| namespace_seed(&ns)),
            tokens,
            2,
            &mut page_hashes,
        );
        KvEvent::BlockStored {
            page_hashes,
            parent_hash: parent,
            token_ids: tokens.to_vec(),
            page_size: 2,
            namespace: ns,
            medium,
        }
    }

    #[test]
    fn double_stores_and_unknown_removals_are_caught() {
        let mut s = EventShadow::new(2);
        s.apply([stored(&[1, 2, 3, 4], None, Medium::Device)])
            .unwrap();
        assert_eq!(s.stored(Medium::Device), 2);
        s.check_resident(Medium::Device, &Namespace::DEFAULT, &[1, 2, 3, 4, 5], 5)
            .unwrap();
        assert!(
            s.check_resident(Medium::Host, &Namespace::DEFAULT, &[1, 2], 2)
                .is_err()
        );
        assert!(
            s.clone()
                .apply([stored(&[1, 2], None, Medium::Device)])
                .is_err()
        );
        assert!(
            s.clone()
                .apply([KvEvent::BlockRemoved {
                    page_hashes: vec![7],
                    namespace: Namespace::DEFAULT,
                    medium: Medium::Device
                }])
                .is_err()
        );
        let KvEvent::BlockStored { page_hashes, .. } = stored(&[1, 2], None, Medium::Device) else {
            unreachable!()
        };
        assert!(
            s.clone()
                .apply([KvEvent::BlockRemoved {
                    page_hashes,
                    namespace: Namespace::new("other"),
                    medium: Medium::Device
                }])
                .is_err(),
            "a removal in the wrong namespace"
        );
    }

    #[test]
    fn an_orphaned_page_is_caught() {
        let mut s = EventShadow::new(2);
        let KvEvent::BlockStored { page_hashes, .. } = stored(&[1, 2], None, Medium::Host) else {
            unreachable!()
        };
        assert!(
            s.apply([stored(&[3, 4], Some(page_hashes[0]), Medium::Host)])
                .is_err()
        );
    }
}
