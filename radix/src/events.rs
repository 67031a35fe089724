//! KV events for KV-aware routers, in the meaning vLLM and SGLang publish them: a page was
//! stored (with its chain hash, parent hash and tokens), pages were removed, everything was
//! cleared. Each stored or removed event names the medium the KV lives on and the namespace
//! (tenant / LoRA / cache salt) it belongs to.
//!
//! Page hashes here are a deterministic 64-bit chain (the same tokens in the same namespace
//! always give the same hashes, across processes), meant for routing hints only. They are not
//! collision-resistant against crafted prompts, so nothing may key stored KV by them.
//!
//! ## Publishing
//! Events travel in a [`KvEventBatch`] (a timestamp, the sequence number of its first event and
//! the events), which derives `serde`'s `Serialize` and `Deserialize`: publish it as JSON
//! (`serde_json`) or msgpack (`rmp-serde`; `to_vec_named` keeps the field names, as routers
//! that decode by name expect). An event is a map tagged by `"type"` with the variant's name.
//!
//! ## Mapping to vLLM's KV events
//! The variants carry vLLM's event names; a publisher that feeds a vLLM-style router (vLLM's
//! own, Dynamo's) renames fields as follows.
//!
//! | radixkv | vLLM |
//! | --- | --- |
//! | [`KvEventBatch::timestamp_ms`] (Unix milliseconds) | batch `ts` (Unix seconds, a float): divide by 1000 |
//! | [`KvEventBatch::seq`] | none in the batch: vLLM's publisher numbers each *batch* in its transport frame. Ours numbers *events*, so that the count lost to a full buffer is visible (see [`KvEventBatch`]) |
//! | `BlockStored::page_hashes` | `BlockStored.block_hashes` |
//! | `BlockStored::parent_hash` | `BlockStored.parent_block_hash` |
//! | `BlockStored::token_ids` | `BlockStored.token_ids` |
//! | `BlockStored::page_size` | `BlockStored.block_size` |
//! | `BlockStored::namespace` | `BlockStored.lora_name` when the namespace is a LoRA adapter's name; a tenant or cache salt is part of vLLM's per-block `extra_keys`. The default namespace (`""`) is vLLM's `None`. vLLM's deprecated integer `lora_id` has no counterpart |
//! | `BlockStored::medium`, `BlockRemoved::medium` | `medium`: [`Medium::Device`] is vLLM's `"GPU"`, [`Medium::Host`] its CPU offload tier |
//! | `BlockRemoved::page_hashes` | `BlockRemoved.block_hashes` |
//! | `BlockRemoved::namespace` | none: vLLM's hashes already include the LoRA and salt; ours do too (the chain is seeded by the namespace), the field is there for routers that index by namespace |
//! | [`KvEvent::AllBlocksCleared`] | `AllBlocksCleared` |
//!
//! | `BlockStored::page_keys`, `BlockStored::parent_key`, `BlockRemoved::page_keys` | none (see [Page keys](#page-keys)); left out of the serialized event when empty |
//!
//! ## Page keys
//! A tree built with [`RadixConfig::event_page_keys`](crate::RadixConfig::event_page_keys)
//! (or [`RadixTree::set_event_page_keys`](crate::RadixTree::set_event_page_keys)) also gives
//! each stored and removed page its 256-bit [`PageKey`]: the BLAKE3 chain that the storage tier
//! stores the page under, seeded by the namespace and the same
//! [`KvIdentity`](crate::KvIdentity). A router, or a peer that reads the same store, can then
//! name exactly the stored page an event speaks of, which the 64-bit routing hash cannot do
//! safely. The keys serialize as 64 lower-case hex digits. Keys cost one BLAKE3 hash per new
//! page and 32 bytes per cached page, so they are off unless asked for.
//!
//! vLLM's `group_idx` and KV-cache-spec fields (hybrid models with several KV groups) and its
//! `data_parallel_rank` have no counterpart: this cache holds one KV group, and the engine
//! that runs several ranks knows which one published. The events carry no request id: the
//! cache stores and evicts pages of the tree, which several requests may share, and never
//! learns the engine's request ids.

use crate::page_key::PageKey;
use crate::types::{Medium, Namespace, TokenId};

/// One KV event. Serialized as a map tagged by `"type"` (`"BlockStored"`, `"BlockRemoved"`,
/// `"AllBlocksCleared"`); see the module docs for the mapping to vLLM's events.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type")]
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
        /// The storage key of each stored page (see [Page keys](#page-keys)); empty unless the
        /// tree keys its events, and then left out of the serialized event.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        page_keys: Vec<PageKey>,
        /// The storage key of the page before the first stored page (`None` at the start of a
        /// sequence, or without page keys).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent_key: Option<PageKey>,
    },
    /// Pages stopped being resident on `medium`.
    BlockRemoved {
        /// Chain hash of each removed page.
        page_hashes: Vec<u64>,
        /// The namespace (tenant / LoRA / salt) the pages belonged to.
        namespace: Namespace,
        /// Where the KV was removed from.
        medium: Medium,
        /// The storage key of each removed page; empty unless the tree keys its events.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        page_keys: Vec<PageKey>,
    },
    /// Everything was dropped (cache reset), on every medium.
    AllBlocksCleared,
}

/// Events as a publisher sends them: what was drained at once, stamped and numbered.
///
/// Events are numbered consecutively in the order the cache produced them, and an event
/// dropped because a bounded buffer was full ([`EventBuffer`]) uses up its number too. So a
/// consumer expects each batch's `seq` to be the previous batch's `seq` plus its event count;
/// a larger `seq` means that many events were lost (the drops are numbered before the batch
/// that follows them), and the consumer must resync its view of this cache. Without drops the
/// numbers have no gap. Events that an [`KvEvent::AllBlocksCleared`] superseded while still
/// buffered take no number: the clear that replaces them tells the consumer all it needs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvEventBatch {
    /// When the batch was taken, in milliseconds since the Unix epoch (wall clock).
    pub timestamp_ms: u64,
    /// Sequence number of the first event of the batch (of the next event when it is empty).
    pub seq: u64,
    /// The events, oldest first.
    pub events: Vec<KvEvent>,
}

impl KvEventBatch {
    /// The `seq` the next batch has when no event is dropped in between.
    pub fn next_seq(&self) -> u64 {
        self.seq.saturating_add(self.events.len() as u64)
    }
}

/// A bounded buffer of KV events, for whoever holds events until a consumer drains them (the
/// tree, the scheduler facade).
///
/// At capacity a new event is dropped and counted ([`EventBuffer::dropped`]), so a cache whose
/// events nobody drains stays at a bounded size instead of growing with the traffic. A drop
/// leaves a gap in the stream: a consumer that sees the counter move since its last drain must
/// stop trusting its view of this cache and resync — forget what it learned from these events
/// and rebuild from the ones that follow (its view then under-reports cached blocks, which
/// costs routing quality, never correctness). [`KvEvent::AllBlocksCleared`] is never dropped: it
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
        if ev == KvEvent::AllBlocksCleared {
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
            namespace: Namespace::new("tenant"),
            medium: Medium::Device,
            page_keys: vec![],
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
        // A full buffer still takes AllBlocksCleared, which supersedes what it held.
        b.extend([removed(8), removed(9)]);
        b.push(KvEvent::AllBlocksCleared);
        b.push(removed(10));
        assert_eq!(b.take(), vec![KvEvent::AllBlocksCleared, removed(10)]);
        assert_eq!(b.dropped(), 3, "never reset");
    }

    fn sample_batch() -> KvEventBatch {
        let ns = Namespace::new("lora-7");
        let mut page_hashes = Vec::new();
        chain_hashes(namespace_seed(&ns), &[1, 2, 3, 4], 2, &mut page_hashes);
        KvEventBatch {
            timestamp_ms: 1_700_000_000_123,
            seq: 41,
            events: vec![
                KvEvent::BlockStored {
                    page_hashes: page_hashes.clone(),
                    parent_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    page_size: 2,
                    namespace: ns.clone(),
                    medium: Medium::Host,
                    page_keys: vec![],
                    parent_key: None,
                },
                KvEvent::BlockStored {
                    page_hashes: vec![u64::MAX],
                    parent_hash: Some(page_hashes[1]),
                    token_ids: vec![5, 6],
                    page_size: 2,
                    namespace: Namespace::DEFAULT,
                    medium: Medium::Device,
                    page_keys: vec![],
                    parent_key: None,
                },
                KvEvent::BlockRemoved {
                    page_hashes,
                    namespace: ns,
                    medium: Medium::Device,
                    page_keys: vec![],
                },
                KvEvent::AllBlocksCleared,
            ],
        }
    }

    #[test]
    fn batches_round_trip_through_json() {
        let b = sample_batch();
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<KvEventBatch>(&text).unwrap(), b);
        // The wire shape routers decode by name: tagged events, plain names for the enums.
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["seq"], 41);
        assert_eq!(v["events"][0]["type"], "BlockStored");
        assert_eq!(v["events"][0]["namespace"], "lora-7");
        assert_eq!(v["events"][0]["medium"], "host");
        assert_eq!(v["events"][1]["namespace"], "");
        assert_eq!(
            v["events"][1]["page_hashes"][0],
            u64::MAX,
            "no precision lost"
        );
        assert_eq!(v["events"][2]["type"], "BlockRemoved");
        assert_eq!(v["events"][3]["type"], "AllBlocksCleared");
        assert_eq!(b.next_seq(), 45);
    }

    #[test]
    fn batches_round_trip_through_msgpack() {
        let b = sample_batch();
        // With field names (what routers decoding by name read) and compact (positional).
        let named = rmp_serde::to_vec_named(&b).unwrap();
        assert_eq!(rmp_serde::from_slice::<KvEventBatch>(&named).unwrap(), b);
        let compact = rmp_serde::to_vec(&b).unwrap();
        assert_eq!(rmp_serde::from_slice::<KvEventBatch>(&compact).unwrap(), b);
        assert!(compact.len() < named.len());
        // A default namespace decodes as the default one (allocation-free), not a named "".
        let KvEvent::BlockStored { namespace, .. } = &rmp_serde::from_slice::<KvEventBatch>(&named)
            .unwrap()
            .events[1]
        else {
            unreachable!()
        };
        assert!(namespace.is_default());
    }

    #[test]
    fn namespaces_seed_differently() {
        let d = namespace_seed(&Namespace::DEFAULT);
        let t = namespace_seed(&Namespace::new("tenant"));
        assert_ne!(d, t);
        assert_ne!(page_hash(d, &[1]), page_hash(t, &[1]));
    }
}
