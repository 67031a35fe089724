//! The stored-page decoder (`PageFormat::decode`) on arbitrary bytes, and on valid pages with
//! arbitrary edits.
//!
//! The first bytes pick a format (geometry and extra-pool sections). Then either
//! - the rest is the page itself, decoded under the key its header names (so the key check is
//!   not what stops the decoder); or
//! - a valid page is encoded from fuzzer-chosen KV and sections, edited (bytes set, cut,
//!   appended; header fields overwritten), and its checksum optionally recomputed over the
//!   edited bytes, which lets the fuzzer reach every check behind the checksum.
//!
//! Whatever the bytes: no panic, and a page that decodes re-encodes (same key, its KV, its
//! sections in order) to exactly the bytes decoded: nothing a reader accepts is anything but
//! a page the encoder writes. An edited page whose checksum was not recomputed never decodes
//! unless the edits left the bytes unchanged; an unedited page always decodes to its parts.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixkv_hicache::storage::{FIXED_HEADER_BYTES, PageFormat};
use radixkv_hicache::{KvGeometry, PoolName};
use radixkv_radix::{KvIdentity, PageKey};

/// Where the header's checksum sits (the format's documented layout: an XXH3-128 in bytes
/// 104..120 over every other byte).
const CHECKSUM_AT: usize = 104;

const POOLS: [PoolName; 4] = [
    PoolName::Mamba,
    PoolName::Swa,
    PoolName::Indexer,
    PoolName::Draft,
];

#[derive(Arbitrary, Debug)]
enum Edit {
    /// Sets the byte at (position mod length).
    Set(u16, u8),
    /// Cuts the page to (length mod (page length + 1)).
    Cut(u16),
    /// Appends bytes.
    Append(Vec<u8>),
    /// Overwrites a little-endian u32 at a header offset (mod the fixed header's length).
    Field(u8, u32),
}

fn format(u: &mut Unstructured) -> arbitrary::Result<PageFormat> {
    let layers = u.int_in_range(1..=3)?;
    let page_size = u.int_in_range(1..=4)?;
    let bytes = u.int_in_range(1..=8)?;
    let mut sections = Vec::new();
    for pool in POOLS {
        if u.arbitrary::<bool>()? {
            sections.push((pool, u.int_in_range(1..=6)?));
        }
    }
    let g = KvGeometry::new(layers, page_size, bytes).expect("a small valid geometry");
    let id = KvIdentity::new("fuzz-model", if u.arbitrary()? { "a" } else { "b" });
    Ok(PageFormat::new(g, &id, &sections).expect("distinct pools, non-empty items"))
}

/// Decodes `bytes` as `key`'s page; if it decodes, re-encoding its parts gives `bytes` back.
fn check(fmt: &PageFormat, key: &PageKey, bytes: &[u8]) -> bool {
    let Ok(page) = fmt.decode(key, bytes) else {
        return false;
    };
    let sections: Vec<(PoolName, &[u8])> = page.sections.iter().copied().collect();
    let mut again = Vec::new();
    fmt.encode(key, page.kv, &sections, &mut again)
        .expect("a decoded page's parts encode");
    assert_eq!(
        again, bytes,
        "a decoded page is not what its parts encode to"
    );
    true
}

fn run(data: &[u8]) -> arbitrary::Result<()> {
    let mut u = Unstructured::new(data);
    let fmt = format(&mut u)?;
    if u.arbitrary::<bool>()? {
        let page = u.take_rest();
        let key = match page.get(64..96) {
            Some(k) => PageKey(k.try_into().expect("32 bytes")),
            None => PageKey([0; 32]),
        };
        check(&fmt, &key, page);
        return Ok(());
    }
    let key = PageKey(u.arbitrary()?);
    let mut kv = vec![0u8; fmt.kv_bytes()];
    u.fill_buffer(&mut kv)?;
    let mut items: Vec<(PoolName, Vec<u8>)> = Vec::new();
    for pool in POOLS {
        if let Some(n) = fmt.section_bytes(pool)
            && u.arbitrary::<bool>()?
        {
            let mut item = vec![0u8; n];
            u.fill_buffer(&mut item)?;
            items.push((pool, item));
        }
    }
    if u.arbitrary::<bool>()? {
        items.reverse();
    }
    let sections: Vec<(PoolName, &[u8])> = items.iter().map(|(p, b)| (*p, &b[..])).collect();
    let mut page = Vec::new();
    fmt.encode(&key, &kv, &sections, &mut page)
        .expect("parts of the format's sizes encode");
    let good = page.clone();

    let edits: Vec<Edit> = u.arbitrary()?;
    let fix = u.arbitrary::<bool>()?;
    for e in edits.iter().take(8) {
        match e {
            Edit::Set(at, v) if !page.is_empty() => {
                let i = usize::from(*at) % page.len();
                page[i] = *v;
            }
            Edit::Set(..) => {}
            Edit::Cut(n) => page.truncate(usize::from(*n) % (page.len() + 1)),
            Edit::Append(b) => page.extend(b.iter().take(64)),
            Edit::Field(at, v) => {
                let at = usize::from(*at) % (FIXED_HEADER_BYTES - 3);
                if page.len() >= at + 4 {
                    page[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    if fix && page.len() >= FIXED_HEADER_BYTES {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&page[..CHECKSUM_AT]);
        h.update(&page[CHECKSUM_AT + 16..]);
        let sum = h.digest128().to_le_bytes();
        page[CHECKSUM_AT..CHECKSUM_AT + 16].copy_from_slice(&sum);
    }
    let decoded = check(&fmt, &key, &page);
    if page == good {
        assert!(decoded, "an unedited page must decode");
        let d = fmt.decode(&key, &page).expect("decodes");
        assert_eq!(d.kv, &kv[..]);
        assert_eq!(&d.sections[..], &sections[..]);
    } else if !fix {
        assert!(!decoded, "an edited page passed its checksum");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
