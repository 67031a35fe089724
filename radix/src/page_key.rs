//! Content-addressed page keys: a BLAKE3 hash chain over token pages.
//!
//! The storage tier (L3) stores a page of KV under a [`PageKey`]: a 256-bit hash of the page's
//! tokens chained from the previous page's key, so a key names the page **and its whole
//! prefix**. The chain starts from a [`KeySeed`] that hashes the page's [`Namespace`] (tenant,
//! LoRA adapter, cache salt) together with a [`KvIdentity`] (the model and the layout of its KV):
//!
//! - two namespaces never share a key, even for the same tokens;
//! - two models, or one model with another KV layout (dtype, page size, head split), never
//!   share a key, so a store can be shared by a fleet that serves several models;
//! - a crafted prompt cannot alias another prompt's page: that needs a BLAKE3 collision.
//!
//! The 64-bit chain of [`crate::events`] is a routing hint only; this chain is what a store
//! trusts. A KV-event consumer that reads the same store computes the same keys with
//! [`KeySeed::chain`].
//!
//! ```
//! use radixkv_radix::{KeySeed, KvIdentity, Namespace};
//!
//! let model = KvIdentity::new("llama-3-8b@main", "bf16 kv, 32 layers, 8 kv heads x 128");
//! let seed = KeySeed::new(&Namespace::DEFAULT, &model);
//! let keys = seed.chain(&[1, 2, 3, 4, 5], 2); // two whole pages; the partial one has no key
//! assert_eq!(keys.len(), 2);
//! assert_eq!(keys[1], keys[0].next(&[3, 4]));
//! let other = KeySeed::new(&Namespace::new("tenant-b"), &model);
//! assert_ne!(other.chain(&[1, 2], 2)[0], keys[0]);
//! ```

use std::fmt;

use crate::types::{Namespace, TokenId};

/// Context strings of BLAKE3's key derivation mode: the seed and the page keys live in
/// separate domains, so no page key is ever a valid seed and the reverse.
const SEED_CONTEXT: &str = "radixkv 2026-11 storage key seed v1";
const PAGE_CONTEXT: &str = "radixkv 2026-11 storage page key v1";

/// What a key must not be shared across besides the namespace: the model and its KV layout.
///
/// Both strings are hashed as given (length-prefixed, so no two pairs of strings collide by
/// concatenation). Put in `model` whatever names the weights (name and revision, adapter
/// merged in or not) and in `layout` whatever changes the bytes of a page (dtype, layers,
/// heads, head size, page size, quantisation).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvIdentity {
    model: String,
    layout: String,
}

impl KvIdentity {
    /// An identity from the model's name and its KV layout's description.
    pub fn new(model: impl Into<String>, layout: impl Into<String>) -> Self {
        KvIdentity {
            model: model.into(),
            layout: layout.into(),
        }
    }

    /// The model part.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The layout part.
    pub fn layout(&self) -> &str {
        &self.layout
    }

    /// A 256-bit digest of both parts (what a stored page's header records).
    pub fn digest(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new_derive_key(SEED_CONTEXT);
        h.update(b"identity");
        hash_str(&mut h, &self.model);
        hash_str(&mut h, &self.layout);
        *h.finalize().as_bytes()
    }
}

fn hash_str(h: &mut blake3::Hasher, s: &str) {
    h.update(&(s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

/// The key of one stored page: a BLAKE3 hash of the page's tokens chained from the previous
/// page's key (or from the [`KeySeed`] for a sequence's first page).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; 32]);

impl PageKey {
    /// The key of the page of `tokens` that follows the page keyed `self`.
    pub fn next(&self, tokens: &[TokenId]) -> PageKey {
        chain_step(&self.0, tokens)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hexadecimal (64 characters): how file and Redis stores name a page.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        s
    }

    /// Parses [`PageKey::to_hex`]'s form; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<PageKey> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(PageKey(out))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageKey({}…)", &self.to_hex()[..16])
    }
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Serialized as its 64 lower-case hex digits ([`PageKey::to_hex`]), the form stores name a
/// page by, so a KV event's key reads the same in JSON, msgpack and a store's listing.
impl serde::Serialize for PageKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for PageKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        PageKey::from_hex(&s).ok_or_else(|| {
            serde::de::Error::invalid_value(
                serde::de::Unexpected::Str(&s),
                &"a page key: 64 lower-case hex digits",
            )
        })
    }
}

fn chain_step(parent: &[u8; 32], tokens: &[TokenId]) -> PageKey {
    let mut h = blake3::Hasher::new_derive_key(PAGE_CONTEXT);
    h.update(parent);
    h.update(&(tokens.len() as u64).to_le_bytes());
    // Tokens as little-endian u32s, in bounded chunks so no allocation grows with the page.
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    PageKey(*h.finalize().as_bytes())
}

/// Where a namespace's chain starts: a hash of the namespace and the [`KvIdentity`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeySeed([u8; 32]);

impl KeySeed {
    /// The seed of `namespace`'s chains for the model and layout `identity`.
    pub fn new(namespace: &Namespace, identity: &KvIdentity) -> Self {
        let mut h = blake3::Hasher::new_derive_key(SEED_CONTEXT);
        h.update(b"seed");
        hash_str(&mut h, namespace.name());
        h.update(&identity.digest());
        KeySeed(*h.finalize().as_bytes())
    }

    /// The key of a sequence's first page.
    pub fn first(&self, tokens: &[TokenId]) -> PageKey {
        chain_step(&self.0, tokens)
    }

    /// The keys of every whole page of `tokens` (`tokens.len() / page_size` keys; a trailing
    /// partial page has none). `page_size` 0 gives no keys.
    pub fn chain(&self, tokens: &[TokenId], page_size: usize) -> Vec<PageKey> {
        let mut out = Vec::new();
        self.extend_chain(None, tokens, page_size, &mut out);
        out
    }

    /// Appends the keys of every whole page of `tokens` to `out`, chained from `parent` (the
    /// key of the page before `tokens`; `None` when `tokens` starts the sequence).
    pub fn extend_chain(
        &self,
        parent: Option<&PageKey>,
        tokens: &[TokenId],
        page_size: usize,
        out: &mut Vec<PageKey>,
    ) {
        if page_size == 0 {
            return;
        }
        out.reserve(tokens.len() / page_size);
        let mut prev = parent.map_or(self.0, |p| p.0);
        for page in tokens.chunks_exact(page_size) {
            let k = chain_step(&prev, page);
            prev = k.0;
            out.push(k);
        }
    }
}

impl fmt::Debug for KeySeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeySeed({}…)", &PageKey(self.0).to_hex()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> KvIdentity {
        KvIdentity::new("m", "bf16")
    }

    #[test]
    fn chains_are_deterministic_and_prefix_closed() {
        let s = KeySeed::new(&Namespace::DEFAULT, &id());
        let a = s.chain(&[1, 2, 3, 4, 5, 6], 2);
        assert_eq!(a, s.chain(&[1, 2, 3, 4, 5, 6], 2));
        assert_eq!(a.len(), 3);
        assert_eq!(s.chain(&[1, 2, 3, 4], 2), a[..2]);
        let mut tail = Vec::new();
        s.extend_chain(Some(&a[0]), &[3, 4, 5, 6], 2, &mut tail);
        assert_eq!(tail, a[1..]);
        assert!(s.chain(&[1, 2, 3], 0).is_empty());
    }

    #[test]
    fn keys_depend_on_everything_they_name() {
        let ns = Namespace::new("t");
        let s = KeySeed::new(&ns, &id());
        let k = s.chain(&[1, 2, 3, 4], 2);
        // Namespace, model, layout, token order, the previous page, page boundaries.
        assert_ne!(
            KeySeed::new(&Namespace::DEFAULT, &id()).chain(&[1, 2, 3, 4], 2),
            k
        );
        assert_ne!(
            KeySeed::new(&ns, &KvIdentity::new("m2", "bf16")).chain(&[1, 2, 3, 4], 2),
            k
        );
        assert_ne!(
            KeySeed::new(&ns, &KvIdentity::new("m", "fp8")).chain(&[1, 2, 3, 4], 2),
            k
        );
        assert_ne!(s.chain(&[2, 1, 3, 4], 2)[1], k[1]);
        assert_ne!(
            s.chain(&[9, 9, 3, 4], 2)[1],
            k[1],
            "a page's key covers its prefix"
        );
        assert_ne!(s.chain(&[1, 2, 3, 4], 4)[0], k[1]);
        // Length-prefixed strings: moving a byte between model and layout changes the seed.
        assert_ne!(
            KvIdentity::new("ab", "c").digest(),
            KvIdentity::new("a", "bc").digest()
        );
        // Token bytes are length-prefixed: a page of [0] differs from an empty page.
        assert_ne!(s.first(&[0]), s.first(&[]));
    }

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        let k = KeySeed::new(&Namespace::DEFAULT, &id()).first(&[7; 300]);
        assert_eq!(PageKey::from_hex(&k.to_hex()), Some(k));
        assert_eq!(k.to_string(), k.to_hex());
        assert_eq!(PageKey::from_hex("00"), None);
        assert_eq!(PageKey::from_hex(&"g".repeat(64)), None);
        assert_eq!(PageKey::from_hex(&k.to_hex().to_uppercase()), None);
    }
}
