//! The stored page: a self-describing header, then the page's KV of every layer, then the extra
//! pools' sections that travel with it.
//!
//! ```text
//! offset  size  field
//!      0     8  magic  b"RKVPAGE\0"
//!      8     2  version (2)
//!     10     2  header length in bytes (136 + 8 × extra sections)
//!     12     4  reserved, 0
//!     16     4  layers
//!     20     4  tokens per page
//!     24     4  bytes per token per layer
//!     28     4  extra sections
//!     32    32  KvIdentity digest (model and layout)
//!     64    32  the page's key
//!     96     8  payload length in bytes
//!    104    16  XXH3-128 of bytes 0..104, 120..136, the section table and the payload
//!    120    16  reserved, 0
//!    136  8 × n section table: pool tag (u32), length (u32)
//!         ...   payload: KV (layer 0's page, layer 1's page, …), then each section in order
//! ```
//!
//! All integers are little-endian. The KV payload is in the canonical page-major order whatever
//! the host pool's layout, so hosts with either layout share one store. [`PageFormat::decode`]
//! checks everything a reader relies on — magic, version, lengths, geometry, identity, key and
//! checksum — and a mismatch is a [`PageError`] (the caller counts it as a miss): a stored page
//! is never read as another page's KV.
//!
//! The checksum finds damage (bit flips, torn or mixed-up writes), not forgery: whoever can
//! write to a store can write a page with a right checksum under any key, whatever the hash,
//! so a cryptographic one would buy nothing here (the *keys* are BLAKE3, so that prompts cannot
//! alias each other's pages). Version 1 used BLAKE3 for the checksum too, which on this
//! project's machines ran at about a tenth of XXH3's speed (1.5 against 16 GB/s), so that
//! checking a loaded 2 MiB page took longer than reading it from a local file store. A page of
//! an older version is treated as damage ([`PageError::is_damage`]): the tier discards it and
//! backs the page up again in this format.

use radixkv_radix::{KvIdentity, PageKey};
use smallvec::SmallVec;
use xxhash_rust::xxh3::Xxh3;

use crate::controller::PoolName;
use crate::geometry::KvGeometry;

/// The first 8 bytes of every stored page.
pub const PAGE_MAGIC: [u8; 8] = *b"RKVPAGE\0";
/// The format version this build writes and reads.
pub const PAGE_VERSION: u16 = 2;
/// Bytes of the fixed part of the header.
pub const FIXED_HEADER_BYTES: usize = 136;
/// Most extra-pool sections one page may carry.
pub const MAX_SECTIONS: usize = 8;

/// Where the checksum field (16 bytes) starts; 16 reserved bytes follow it.
const CHECKSUM_AT: usize = 104;
const CHECKSUM_LEN: usize = 16;

/// Why a stored page was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// Fewer bytes than a header, or than the header says.
    #[error("stored page truncated: {got} bytes, {needed} needed")]
    Truncated {
        /// Bytes present.
        got: usize,
        /// Bytes the header needs.
        needed: usize,
    },
    /// Not a stored page (no magic, or a reserved field set).
    #[error("not a stored page")]
    BadMagic,
    /// A stored page of another format version (written by another build).
    #[error("stored page of format version {0}; this build reads version {PAGE_VERSION}")]
    Version(u16),
    /// The header's lengths disagree with each other or with the bytes present.
    #[error("stored page lengths are inconsistent: {0}")]
    BadLength(&'static str),
    /// The page was written for another geometry or model.
    #[error("stored page belongs to another model or KV layout")]
    WrongLayout,
    /// The page is stored under another key (a store returned the wrong object).
    #[error("stored page carries another key")]
    WrongKey,
    /// The checksum does not match: the bytes were corrupted.
    #[error("stored page checksum mismatch")]
    Checksum,
    /// A section of an extra pool this reader does not expect, or of the wrong size.
    #[error("stored page has an unexpected {0} section")]
    UnexpectedSection(&'static str),
}

impl PageError {
    /// Whether the bytes are damaged: no magic, inconsistent lengths, a truncation, a key that
    /// is not the one they are stored under, or a checksum mismatch — bytes no reader can
    /// use, which the storage tier removes from the store
    /// ([`super::StorageBackend::discard_damaged`]). A page of another format version, model,
    /// layout or set of extra pools is whole and is left to the readers it belongs to — except
    /// a page of an *older* format version, which this build treats as damage so that it is
    /// replaced by a page in the current format (in a fleet upgraded in turns, the newer
    /// servers take the pages over; a newer version's page is left to newer readers).
    pub fn is_damage(&self) -> bool {
        match self {
            PageError::Truncated { .. }
            | PageError::BadMagic
            | PageError::BadLength(_)
            | PageError::WrongKey
            | PageError::Checksum => true,
            PageError::Version(v) => *v < PAGE_VERSION,
            PageError::WrongLayout | PageError::UnexpectedSection(_) => false,
        }
    }
}

/// A stored page that passed every check, borrowing the bytes it was decoded from.
#[derive(Debug)]
pub struct DecodedPage<'a> {
    /// The page's KV, page-major: `layers` slices of `page_size × bytes_per_token_layer`.
    pub kv: &'a [u8],
    /// The extra pools' sections present, in the order they were written.
    pub sections: SmallVec<[(PoolName, &'a [u8]); 2]>,
}

/// The codec of one model's stored pages: its geometry, its identity and the extra pools a
/// page may carry (with the size of each pool's item).
#[derive(Clone, Debug)]
pub struct PageFormat {
    geometry: KvGeometry,
    identity: [u8; 32],
    sections: SmallVec<[(PoolName, usize); 2]>,
}

fn tag(pool: PoolName) -> u32 {
    match pool {
        PoolName::Kv => 0,
        PoolName::Mamba => 1,
        PoolName::Swa => 2,
        PoolName::Indexer => 3,
        PoolName::Draft => 4,
    }
}

fn pool_of(tag: u32) -> Option<PoolName> {
    Some(match tag {
        1 => PoolName::Mamba,
        2 => PoolName::Swa,
        3 => PoolName::Indexer,
        4 => PoolName::Draft,
        _ => return None,
    })
}

fn pool_label(pool: PoolName) -> &'static str {
    match pool {
        PoolName::Kv => "kv",
        PoolName::Mamba => "mamba",
        PoolName::Swa => "swa",
        PoolName::Indexer => "indexer",
        PoolName::Draft => "draft",
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl PageFormat {
    /// The format of pages of `geometry` for the model and layout `identity`, carrying
    /// sections of the extra pools in `sections` (pool, bytes of one item). A pool may be
    /// named once; [`PoolName::Kv`] is the page itself and is not a section.
    ///
    /// # Errors
    /// [`crate::HiCacheError::Config`] for a repeated pool, `Kv`, an empty item, more than
    /// [`MAX_SECTIONS`] pools, or sizes a header cannot describe (over `u32::MAX`).
    pub fn new(
        geometry: KvGeometry,
        identity: &KvIdentity,
        sections: &[(PoolName, usize)],
    ) -> crate::Result<Self> {
        let bad = |s: &str| Err(crate::HiCacheError::Config(format!("page format: {s}")));
        if sections.len() > MAX_SECTIONS {
            return bad("too many extra pools");
        }
        for (i, &(pool, bytes)) in sections.iter().enumerate() {
            if pool == PoolName::Kv {
                return bad("the KV pool is the page itself, not a section");
            }
            if sections[..i].iter().any(|&(p, _)| p == pool) {
                return bad("an extra pool is named twice");
            }
            if bytes == 0 || u32::try_from(bytes).is_err() {
                return bad("an extra pool's item size must be 1..=u32::MAX bytes");
            }
        }
        let fits = |n: usize| u32::try_from(n).is_ok();
        if !fits(geometry.layers)
            || !fits(geometry.page_size)
            || !fits(geometry.bytes_per_token_layer)
        {
            return bad("the geometry does not fit the header's 32-bit fields");
        }
        Ok(PageFormat {
            geometry,
            identity: identity.digest(),
            sections: sections.iter().copied().collect(),
        })
    }

    /// The geometry.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Bytes of one page's KV payload (all layers).
    pub fn kv_bytes(&self) -> usize {
        self.geometry.layers * self.geometry.page_size * self.geometry.bytes_per_token_layer
    }

    /// Bytes of the item of `pool`'s section, if the format carries that pool.
    pub fn section_bytes(&self, pool: PoolName) -> Option<usize> {
        self.sections
            .iter()
            .find(|&&(p, _)| p == pool)
            .map(|&(_, b)| b)
    }

    /// Bytes of a stored page carrying the sections of `pools`.
    pub fn encoded_len(&self, pools: &[PoolName]) -> usize {
        FIXED_HEADER_BYTES
            + 8 * pools.len()
            + self.kv_bytes()
            + pools
                .iter()
                .filter_map(|&p| self.section_bytes(p))
                .sum::<usize>()
    }

    /// Writes the stored page of `key` to `out` (cleared first): the header, `kv` (page-major,
    /// [`PageFormat::kv_bytes`] long) and each section of `sections`, in order.
    ///
    /// # Errors
    /// [`crate::HiCacheError::BufferSize`] for a `kv` or section of the wrong length,
    /// [`crate::HiCacheError::Config`] for a pool the format does not carry or named twice.
    pub fn encode(
        &self,
        key: &PageKey,
        kv: &[u8],
        sections: &[(PoolName, &[u8])],
        out: &mut Vec<u8>,
    ) -> crate::Result<()> {
        if kv.len() != self.kv_bytes() {
            return Err(crate::HiCacheError::BufferSize {
                got: kv.len(),
                expected: self.kv_bytes(),
            });
        }
        for (i, &(pool, data)) in sections.iter().enumerate() {
            let Some(want) = self.section_bytes(pool) else {
                return Err(crate::HiCacheError::Config(format!(
                    "page format carries no {} section",
                    pool_label(pool)
                )));
            };
            if sections[..i].iter().any(|&(p, _)| p == pool) {
                return Err(crate::HiCacheError::Config(
                    "a section is given twice".to_owned(),
                ));
            }
            if data.len() != want {
                return Err(crate::HiCacheError::BufferSize {
                    got: data.len(),
                    expected: want,
                });
            }
        }
        let header_len = FIXED_HEADER_BYTES + 8 * sections.len();
        let payload: usize = kv.len() + sections.iter().map(|(_, d)| d.len()).sum::<usize>();
        out.clear();
        out.reserve(header_len + payload);
        out.extend_from_slice(&PAGE_MAGIC);
        out.extend_from_slice(&PAGE_VERSION.to_le_bytes());
        out.extend_from_slice(&(header_len as u16).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        let g = self.geometry;
        for v in [
            g.layers,
            g.page_size,
            g.bytes_per_token_layer,
            sections.len(),
        ] {
            out.extend_from_slice(&(v as u32).to_le_bytes());
        }
        out.extend_from_slice(&self.identity);
        out.extend_from_slice(&key.0);
        out.extend_from_slice(&(payload as u64).to_le_bytes());
        out.extend_from_slice(&[0u8; 32]);
        for &(pool, data) in sections {
            out.extend_from_slice(&tag(pool).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(kv);
        for &(_, data) in sections {
            out.extend_from_slice(data);
        }
        seal(out);
        Ok(())
    }

    /// Checks `bytes` as the stored page of `key` in this format and returns its parts.
    ///
    /// # Errors
    /// A [`PageError`] naming the first check that failed; nothing is returned from a page
    /// that fails any check.
    pub fn decode<'a>(&self, key: &PageKey, bytes: &'a [u8]) -> Result<DecodedPage<'a>, PageError> {
        if bytes.len() < FIXED_HEADER_BYTES {
            return Err(PageError::Truncated {
                got: bytes.len(),
                needed: FIXED_HEADER_BYTES,
            });
        }
        if bytes[..8] != PAGE_MAGIC {
            return Err(PageError::BadMagic);
        }
        if u16_at(bytes, 8) != PAGE_VERSION {
            return Err(PageError::Version(u16_at(bytes, 8)));
        }
        let header_len = usize::from(u16_at(bytes, 10));
        let n_sections = u32_at(bytes, 28) as usize;
        if n_sections > MAX_SECTIONS {
            return Err(PageError::BadLength("too many sections"));
        }
        if header_len != FIXED_HEADER_BYTES + 8 * n_sections {
            return Err(PageError::BadLength("header length"));
        }
        if bytes.len() < header_len {
            return Err(PageError::Truncated {
                got: bytes.len(),
                needed: header_len,
            });
        }
        let payload = u64_at(bytes, 96);
        let Some(total) = usize::try_from(payload)
            .ok()
            .and_then(|p| p.checked_add(header_len))
        else {
            return Err(PageError::BadLength("payload length"));
        };
        if bytes.len() < total {
            return Err(PageError::Truncated {
                got: bytes.len(),
                needed: total,
            });
        }
        if bytes.len() > total {
            return Err(PageError::BadLength("trailing bytes"));
        }
        if u32_at(bytes, 12) != 0
            || bytes[CHECKSUM_AT + CHECKSUM_LEN..FIXED_HEADER_BYTES]
                .iter()
                .any(|&b| b != 0)
        {
            return Err(PageError::BadMagic);
        }
        let g = self.geometry;
        if u32_at(bytes, 16) as usize != g.layers
            || u32_at(bytes, 20) as usize != g.page_size
            || u32_at(bytes, 24) as usize != g.bytes_per_token_layer
            || bytes[32..64] != self.identity
        {
            return Err(PageError::WrongLayout);
        }
        if bytes[64..96] != key.0 {
            return Err(PageError::WrongKey);
        }
        if bytes[CHECKSUM_AT..CHECKSUM_AT + CHECKSUM_LEN] != checksum(bytes) {
            return Err(PageError::Checksum);
        }
        let mut sections = SmallVec::new();
        let mut at = header_len + self.kv_bytes();
        if at > bytes.len() {
            return Err(PageError::BadLength("payload shorter than the KV"));
        }
        for i in 0..n_sections {
            let entry = FIXED_HEADER_BYTES + 8 * i;
            let t = u32_at(bytes, entry);
            let len = u32_at(bytes, entry + 4) as usize;
            let Some(pool) = pool_of(t) else {
                return Err(PageError::UnexpectedSection("unknown"));
            };
            if self.section_bytes(pool) != Some(len) {
                return Err(PageError::UnexpectedSection(pool_label(pool)));
            }
            if sections.iter().any(|&(p, _)| p == pool) {
                return Err(PageError::UnexpectedSection(pool_label(pool)));
            }
            let end = at
                .checked_add(len)
                .filter(|&e| e <= bytes.len())
                .ok_or(PageError::BadLength("a section runs past the payload"))?;
            sections.push((pool, &bytes[at..end]));
            at = end;
        }
        if at != bytes.len() {
            return Err(PageError::BadLength("payload length and sections disagree"));
        }
        Ok(DecodedPage {
            kv: &bytes[header_len..header_len + self.kv_bytes()],
            sections,
        })
    }
}

/// XXH3-128 of everything but the checksum field itself (`bytes` holds at least a fixed
/// header).
fn checksum(bytes: &[u8]) -> [u8; CHECKSUM_LEN] {
    let mut h = Xxh3::new();
    h.update(&bytes[..CHECKSUM_AT]);
    h.update(&bytes[CHECKSUM_AT + CHECKSUM_LEN..]);
    h.digest128().to_le_bytes()
}

/// Writes the checksum of a stored page into its header, over whatever the other bytes are
/// ([`PageFormat::encode`] seals the pages it writes; the tests seal edited pages). Returns
/// `false`, changing nothing, where `bytes` is shorter than a fixed header.
fn seal(bytes: &mut [u8]) -> bool {
    if bytes.len() < FIXED_HEADER_BYTES {
        return false;
    }
    let sum = checksum(bytes);
    bytes[CHECKSUM_AT..CHECKSUM_AT + CHECKSUM_LEN].copy_from_slice(&sum);
    true
}

#[cfg(test)]
mod tests {
    use radixkv_radix::{KeySeed, Namespace};

    use super::*;

    fn fmt() -> (PageFormat, PageKey) {
        let id = KvIdentity::new("m", "l");
        let g = KvGeometry::new(2, 4, 3).unwrap();
        let f = PageFormat::new(g, &id, &[(PoolName::Mamba, 5), (PoolName::Swa, 7)]).unwrap();
        (
            f,
            KeySeed::new(&Namespace::DEFAULT, &id).first(&[1, 2, 3, 4]),
        )
    }

    #[test]
    fn round_trips_with_and_without_sections() {
        let (f, k) = fmt();
        let kv: Vec<u8> = (0..24).collect();
        let mut out = Vec::new();
        f.encode(&k, &kv, &[], &mut out).unwrap();
        assert_eq!(out.len(), f.encoded_len(&[]));
        let d = f.decode(&k, &out).unwrap();
        assert_eq!(d.kv, &kv[..]);
        assert!(d.sections.is_empty());
        drop(d);
        let m = [9u8; 5];
        let s = [8u8; 7];
        f.encode(
            &k,
            &kv,
            &[(PoolName::Swa, &s), (PoolName::Mamba, &m)],
            &mut out,
        )
        .unwrap();
        assert_eq!(out.len(), f.encoded_len(&[PoolName::Swa, PoolName::Mamba]));
        let d = f.decode(&k, &out).unwrap();
        assert_eq!(d.kv, &kv[..]);
        assert_eq!(
            &d.sections[..],
            &[(PoolName::Swa, &s[..]), (PoolName::Mamba, &m[..])]
        );
    }

    #[test]
    fn every_corruption_is_refused() {
        let (f, k) = fmt();
        let kv: Vec<u8> = (0..24).collect();
        let mut good = Vec::new();
        f.encode(&k, &kv, &[(PoolName::Mamba, &[1; 5])], &mut good)
            .unwrap();
        // Any single flipped bit anywhere is caught.
        for i in 0..good.len() {
            for bit in [0, 7] {
                let mut b = good.clone();
                b[i] ^= 1 << bit;
                assert!(
                    f.decode(&k, &b).is_err(),
                    "flip of byte {i} bit {bit} passed"
                );
            }
        }
        // Every truncation and an extension are caught.
        for n in 0..good.len() {
            assert!(
                f.decode(&k, &good[..n]).is_err(),
                "truncation to {n} passed"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            f.decode(&k, &long).unwrap_err(),
            PageError::BadLength("trailing bytes")
        );
        // Another key, another model, another geometry.
        let other = k.next(&[5]);
        assert_eq!(f.decode(&other, &good).unwrap_err(), PageError::WrongKey);
        let g = f.geometry();
        let f2 = PageFormat::new(g, &KvIdentity::new("m2", "l"), &[(PoolName::Mamba, 5)]).unwrap();
        assert_eq!(f2.decode(&k, &good).unwrap_err(), PageError::WrongLayout);
        // A reader that does not expect the section refuses the page.
        let f3 = PageFormat::new(g, &KvIdentity::new("m", "l"), &[]).unwrap();
        assert_eq!(
            f3.decode(&k, &good).unwrap_err(),
            PageError::UnexpectedSection("mamba")
        );
    }

    #[test]
    fn damage_is_told_from_pages_of_other_readers() {
        let (f, k) = fmt();
        let mut good = Vec::new();
        f.encode(&k, &[3; 24], &[], &mut good).unwrap();
        let mut flipped = good.clone();
        flipped[140] ^= 1;
        let mut magic = good.clone();
        magic[0] ^= 1;
        for bad in [
            &good[..100],
            &flipped[..],
            &magic[..],
            &good[..good.len() - 1],
        ] {
            assert!(f.decode(&k, bad).unwrap_err().is_damage());
        }
        assert!(f.decode(&k.next(&[9]), &good).unwrap_err().is_damage());
        let mut newer = good.clone();
        newer[8] = 3;
        let e = f.decode(&k, &newer).unwrap_err();
        assert_eq!(e, PageError::Version(3));
        assert!(!e.is_damage(), "a newer version's page is not damaged");
        let mut older = good.clone();
        older[8] = 1;
        let e = f.decode(&k, &older).unwrap_err();
        assert_eq!(e, PageError::Version(1));
        assert!(e.is_damage(), "an older version's page is replaced");
        // The reserved bytes after the checksum must stay zero, even resealed.
        let mut reserved = good.clone();
        reserved[CHECKSUM_AT + CHECKSUM_LEN + 3] = 1;
        assert!(seal(&mut reserved));
        assert_eq!(f.decode(&k, &reserved).unwrap_err(), PageError::BadMagic);
        // Resealing an unedited page changes nothing; a header too short is refused.
        let mut again = good.clone();
        assert!(seal(&mut again));
        assert_eq!(again, good);
        assert!(!seal(&mut [0u8; FIXED_HEADER_BYTES - 1]));
        let other = PageFormat::new(f.geometry(), &KvIdentity::new("m2", "l"), &[]).unwrap();
        assert!(!other.decode(&k, &good).unwrap_err().is_damage());
    }

    #[test]
    fn bad_formats_and_inputs_are_typed_errors() {
        let (f, k) = fmt();
        let g = f.geometry();
        let id = KvIdentity::new("m", "l");
        assert!(PageFormat::new(g, &id, &[(PoolName::Kv, 4)]).is_err());
        assert!(PageFormat::new(g, &id, &[(PoolName::Swa, 4), (PoolName::Swa, 4)]).is_err());
        assert!(PageFormat::new(g, &id, &[(PoolName::Swa, 0)]).is_err());
        let mut out = Vec::new();
        assert!(f.encode(&k, &[0; 23], &[], &mut out).is_err());
        assert!(
            f.encode(&k, &[0; 24], &[(PoolName::Mamba, &[0; 4])], &mut out)
                .is_err()
        );
        assert!(
            f.encode(&k, &[0; 24], &[(PoolName::Draft, &[0; 4])], &mut out)
                .is_err()
        );
        assert!(
            f.encode(
                &k,
                &[0; 24],
                &[(PoolName::Mamba, &[0; 5]), (PoolName::Mamba, &[0; 5])],
                &mut out
            )
            .is_err()
        );
    }
}
