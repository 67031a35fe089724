//! KV events for KV-aware routers, in the meaning vLLM and SGLang publish them: a page was
//! stored (with its chain hash, parent hash and tokens), pages were removed, everything was
//! cleared. Each event names the medium the KV lives on.
//!
//! Page hashes here are a deterministic 64-bit chain (the same tokens in the same namespace
//! always give the same hashes, across processes), meant for routing hints only. They are not
//! collision-resistant against crafted prompts, so nothing may key stored KV by them.

use crate::types::{Medium, Namespace, TokenId};

/// One KV event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages became resident on `medium`. One event per run of consecutive pages of one node.
    BlockStored {
        /// Chain hash of each stored page.
        page_hashes: Vec<u64>,
        /// Hash of the page before the first stored page (`None` at the start of a sequence).
        parent_hash: Option<u64>,
        /// The tokens of the stored pages, `page_size` per page.
        token_ids: Vec<TokenId>,
        /// Tokens per page.
        page_size: usize,
        /// The namespace (tenant / LoRA / salt) the pages belong to.
        namespace: Namespace,
        /// Where the KV now lives.
        medium: Medium,
    },
    /// Pages stopped being resident on `medium`.
    BlockRemoved {
        /// Chain hash of each removed page.
        page_hashes: Vec<u64>,
        /// Where the KV was removed from.
        medium: Medium,
    },
    /// Everything was dropped (cache reset).
    AllCleared,
}

/// A bounded buffer of KV events, for whoever holds events until a consumer drains them (the
/// tree, the scheduler facade).
///
/// At capacity a new event is dropped and counted ([`EventBuffer::dropped`]), so a cache whose
/// events nobody drains stays at a bounded size instead of growing with the traffic. A drop
/// leaves a gap in the stream: a consumer that sees the counter move since its last drain must
/// stop trusting its view of this cache and resync — forget what it learned from these events
/// and rebuild from the ones that follow (its view then under-reports cached blocks, which
/// costs routing quality, never correctness). [`KvEvent::AllCleared`] is never dropped: it
/// supersedes every event buffered before it, which it replaces.
#[derive(Clone, Debug)]
pub struct EventBuffer {
    events: Vec<KvEvent>,
    capacity: usize,
    dropped: u64,
}

impl EventBuffer {
    /// Events held by default before new ones are dropped: 16,384 (a few tens of MB at most for
    /// long prompts; a consumer that drains every scheduler step never comes near it).
    pub const DEFAULT_CAPACITY: usize = 16_384;

    /// An empty buffer holding at most `capacity` events.
    ///
    /// # Errors
    /// [`CacheError::Config`](crate::CacheError::Config) for a capacity of 0.
    pub fn new(capacity: usize) -> crate::Result<Self> {
        if capacity == 0 {
            return Err(crate::CacheError::Config(
                "the KV event buffer must hold at least one event".into(),
            ));
        }
        Ok(EventBuffer {
            events: Vec::new(),
            capacity,
            dropped: 0,
        })
    }

    /// Changes the capacity; events already buffered are kept even above it.
    ///
    /// # Errors
    /// [`CacheError::Config`](crate::CacheError::Config) for 0.
    pub fn set_capacity(&mut self, capacity: usize) -> crate::Result<()> {
        self.capacity = Self::new(capacity)?.capacity;
        Ok(())
    }

    /// Records `ev`, or counts it as dropped when the buffer is full.
    pub fn push(&mut self, ev: KvEvent) {
        if ev == KvEvent::AllCleared {
            self.events.clear();
        } else if self.events.len() >= self.capacity {
            self.dropped += 1;
            return;
        }
        self.events.push(ev);
    }

    /// Records every event of `evs` in order, as [`EventBuffer::push`] does.
    pub fn extend(&mut self, evs: impl IntoIterator<Item = KvEvent>) {
        for ev in evs {
            self.push(ev);
        }
    }

    /// Drains the buffered events, oldest first.
    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Events buffered now.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when no event is buffered.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The most events held at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Events dropped because the buffer was full, since it was built (never reset).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

impl Default for EventBuffer {
    fn default() -> Self {
        EventBuffer {
            events: Vec::new(),
            capacity: Self::DEFAULT_CAPACITY,
            dropped: 0,
        }
    }
}

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xbf58_476d_1ce4_e5b9;
const K2: u64 = 0x94d0_49bb_1331_11eb;

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(K1);
    z = (z ^ (z >> 27)).wrapping_mul(K2);
    z ^ (z >> 31)
}

/// The chain seed of a namespace: what the first page's hash is chained from.
pub fn namespace_seed(ns: &Namespace) -> u64 {
    let mut h = K0;
    for chunk in ns.name().as_bytes().chunks(8) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(b)).wrapping_add(K0);
    }
    mix(h ^ ns.name().len() as u64)
}

/// Hash of one page chained from `parent` (the previous page's hash or the namespace seed).
#[inline]
pub fn page_hash(parent: u64, tokens: &[TokenId]) -> u64 {
    let mut h = mix(parent ^ K0);
    let mut pairs = tokens.chunks_exact(2);
    for p in &mut pairs {
        h = mix(h ^ (u64::from(p[0]) | u64::from(p[1]) << 32)).wrapping_add(K0);
    }
    if let [t] = pairs.remainder() {
        h = mix(h ^ u64::from(*t) ^ K2);
    }
    mix(h ^ tokens.len() as u64)
}

/// Appends the chain hashes of every page of `tokens` (page-aligned) to `out`.
pub fn chain_hashes(parent: u64, tokens: &[TokenId], page_size: usize, out: &mut Vec<u64>) {
    let mut h = parent;
    for page in tokens.chunks_exact(page_size) {
        h = page_hash(h, page);
        out.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_deterministic_and_order_sensitive() {
        let seed = namespace_seed(&Namespace::DEFAULT);
        let mut a = Vec::new();
        chain_hashes(seed, &[1, 2, 3, 4], 2, &mut a);
        let mut b = Vec::new();
        chain_hashes(seed, &[1, 2, 3, 4], 2, &mut b);
        assert_eq!(a, b);
        let mut c = Vec::new();
        chain_hashes(seed, &[3, 4, 1, 2], 2, &mut c);
        assert_ne!(a[1], c[1]);
        // The second page depends on the first.
        assert_ne!(page_hash(seed, &[3, 4]), a[1]);
    }

    fn removed(h: u64) -> KvEvent {
        KvEvent::BlockRemoved {
            page_hashes: vec![h],
            medium: Medium::Device,
        }
    }

    #[test]
    fn buffer_drops_and_counts_past_capacity_and_keeps_all_cleared() {
        assert!(EventBuffer::new(0).is_err());
        let mut b = EventBuffer::new(2).unwrap();
        b.extend((0..5).map(removed));
        assert_eq!((b.len(), b.dropped()), (2, 3));
        assert_eq!(
            b.take(),
            vec![removed(0), removed(1)],
            "the oldest are kept"
        );
        b.push(removed(7));
        assert_eq!(b.take(), vec![removed(7)], "room again after a drain");
        // A full buffer still takes AllCleared, which supersedes what it held.
        b.extend([removed(8), removed(9)]);
        b.push(KvEvent::AllCleared);
        b.push(removed(10));
        assert_eq!(b.take(), vec![KvEvent::AllCleared, removed(10)]);
        assert_eq!(b.dropped(), 3, "never reset");
    }

    #[test]
    fn namespaces_seed_differently() {
        let d = namespace_seed(&Namespace::DEFAULT);
        let t = namespace_seed(&Namespace::new("tenant"));
        assert_ne!(d, t);
        assert_ne!(page_hash(d, &[1]), page_hash(t, &[1]));
    }
}
