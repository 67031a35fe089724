//! Sequences of store operations (put, get, exists_prefix, delete, discard_damaged) through
//! `FaultStore` over `MemStore` (capped or not), with faults switched on and off, the store
//! taken down and up, and pages that are valid, stored under another key, or garbage —
//! against a model map of the bytes last stored under each key.
//!
//! Every future is polled once with a no-op waker, as a tier with a zero deadline would:
//! over `MemStore` an operation is ready at once unless the wrapper made it hang, which the
//! target checks (and then drops it). Properties: no panic; a page `get` returns that decodes
//! is exactly the bytes last stored under its key; without corruption every page returned is
//! exactly those bytes; the store never holds a key the model lacks (`exists_prefix` and
//! `delete` never exceed the model; `discard_damaged` is a delete the store counts); without
//! a cap and without partial batches the answers equal the model's; a failed or hung
//! operation changes nothing; and at the end, faults off, the store and its counters agree
//! with the model.
#![no_main]

use std::collections::HashMap;
use std::future::Future;
use std::task::{Context, Poll, Waker};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixkv_hicache::KvGeometry;
use radixkv_hicache::storage::{
    FaultConfig, FaultStore, MemStore, PageFormat, StorageBackend, StoreError,
};
use radixkv_radix::{KeySeed, KvIdentity, Namespace, PageKey};

const KEYS: usize = 12;

#[derive(Arbitrary, Debug)]
enum Page {
    /// A valid page of this key, version `u8` of its KV.
    Valid(u8),
    /// A valid page of another key.
    OtherKey(u8, u8),
    /// Arbitrary bytes.
    Garbage(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Put(Vec<(u8, Page)>),
    Get(Vec<u8>),
    Exists(Vec<u8>),
    Delete(Vec<u8>),
    /// `discard_damaged`: a delete that the store counts.
    Discard(Vec<u8>),
    Down(bool),
    /// Probabilities in sixteenths (error, hang, partial, corrupt) and a seed.
    Faults([u8; 4], u64),
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// The inner store's cap, in pages of the valid size (0: no cap).
    cap_pages: u8,
    ops: Vec<Op>,
}

/// Polls `f` once; `None` when it is not ready (a hang).
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

struct World {
    fmt: PageFormat,
    keys: Vec<PageKey>,
    store: FaultStore<MemStore>,
    model: HashMap<PageKey, Vec<u8>>,
    capped: bool,
    /// Whether the current fault configuration corrupts or cuts batches.
    corrupting: bool,
    partial: bool,
}

impl World {
    fn page(&self, key: usize, page: &Page) -> Vec<u8> {
        let mut out = Vec::new();
        match page {
            Page::Valid(v) => {
                let kv = vec![*v; self.fmt.kv_bytes()];
                self.fmt
                    .encode(&self.keys[key], &kv, &[], &mut out)
                    .unwrap();
            }
            Page::OtherKey(k, v) => {
                let kv = vec![*v; self.fmt.kv_bytes()];
                let other = &self.keys[usize::from(*k) % KEYS];
                self.fmt.encode(other, &kv, &[], &mut out).unwrap();
            }
            Page::Garbage(b) => out.extend(b.iter().take(300)),
        }
        out
    }

    fn keys_of(&self, idx: &[u8]) -> Vec<PageKey> {
        idx.iter()
            .take(16)
            .map(|&i| self.keys[usize::from(i) % KEYS])
            .collect()
    }

    /// The longest prefix of `keys` the model holds.
    fn model_prefix(&self, keys: &[PageKey]) -> usize {
        keys.iter()
            .take_while(|k| self.model.contains_key(k))
            .count()
    }

    /// Checks one returned page of `key`.
    fn check_page(&self, key: &PageKey, got: &[u8]) {
        let want = self
            .model
            .get(key)
            .expect("the store returned a page the model never stored");
        if self.fmt.decode(key, got).is_ok() {
            assert_eq!(got, &want[..], "a page that decodes is not the page stored");
        }
        if !self.corrupting {
            assert_eq!(got, &want[..], "a page changed without a corruption fault");
        }
    }

    fn exact(&self) -> bool {
        !self.capped && !self.partial
    }

    fn op(&mut self, op: &Op) {
        let hangs = self.store.counts().hangs;
        let hung = |w: &World| {
            assert_eq!(
                w.store.counts().hangs,
                hangs + 1,
                "pending without a hang fault"
            )
        };
        match op {
            Op::Put(pages) => {
                let batch: Vec<(PageKey, Vec<u8>)> = pages
                    .iter()
                    .take(16)
                    .map(|(k, p)| {
                        let k = usize::from(*k) % KEYS;
                        (self.keys[k], self.page(k, p))
                    })
                    .collect();
                match poll_once(self.store.put(&batch)) {
                    None => hung(self),
                    Some(Err(e)) => expect_injected(&e),
                    Some(Ok(stored)) => {
                        assert_eq!(stored.len(), batch.len());
                        if !self.partial && !self.capped {
                            assert!(stored.iter().all(|&s| s));
                        }
                        for ((k, b), s) in batch.iter().zip(stored) {
                            if s {
                                self.model.insert(*k, b.clone());
                            }
                        }
                    }
                }
            }
            Op::Get(idx) => {
                let keys = self.keys_of(idx);
                match poll_once(self.store.get(&keys)) {
                    None => hung(self),
                    Some(Err(e)) => expect_injected(&e),
                    Some(Ok(pages)) => {
                        assert_eq!(pages.len(), keys.len());
                        for (k, p) in keys.iter().zip(&pages) {
                            match p {
                                Some(b) => self.check_page(k, b),
                                None if self.exact() => {
                                    assert!(!self.model.contains_key(k), "a stored page missed")
                                }
                                None => {}
                            }
                        }
                    }
                }
            }
            Op::Exists(idx) => {
                let keys = self.keys_of(idx);
                match poll_once(self.store.exists_prefix(&keys)) {
                    None => hung(self),
                    Some(Err(e)) => expect_injected(&e),
                    Some(Ok(n)) => {
                        let want = self.model_prefix(&keys);
                        assert!(n <= want, "the store holds a key the model lacks");
                        if self.exact() {
                            assert_eq!(n, want);
                        }
                    }
                }
            }
            Op::Delete(idx) | Op::Discard(idx) => {
                let keys = self.keys_of(idx);
                let discard = matches!(op, Op::Discard(_));
                let damaged = self.store.inner().stats().damaged_pages;
                let f = if discard {
                    self.store.discard_damaged(&keys)
                } else {
                    self.store.delete(&keys)
                };
                match poll_once(f) {
                    None => hung(self),
                    Some(Err(e)) => expect_injected(&e),
                    Some(Ok(n)) => {
                        let mut present = 0;
                        for k in &keys {
                            if self.model.remove(k).is_some() {
                                present += 1;
                            }
                        }
                        assert!(n <= present);
                        if !self.capped {
                            assert_eq!(n, present);
                        }
                        let counted = self.store.inner().stats().damaged_pages - damaged;
                        assert_eq!(counted, if discard { n as u64 } else { 0 });
                    }
                }
            }
            Op::Down(down) => self.store.set_down(*down),
            Op::Faults(p, seed) => {
                let f = |x: u8| f64::from(x % 17) / 16.0;
                let config = FaultConfig {
                    error: f(p[0]),
                    hang: f(p[1]),
                    partial: f(p[2]),
                    corrupt: f(p[3]),
                    ..FaultConfig::seeded(*seed)
                };
                self.store.set_config(config).expect("valid probabilities");
                self.partial = config.partial > 0.0;
                self.corrupting = config.corrupt > 0.0;
            }
        }
        if self.capped {
            // Evictions only shrink the store: drop what it lost from the model.
            // (`exists_prefix` of one key: it does not count as a use.)
            let inner = self.store.inner();
            let gone: Vec<PageKey> = self
                .keys
                .iter()
                .filter(|k| {
                    poll_once(inner.exists_prefix(std::slice::from_ref(*k)))
                        .expect("MemStore is ready")
                        .unwrap()
                        == 0
                })
                .copied()
                .collect();
            for k in &gone {
                self.model.remove(k);
            }
        }
    }

    /// Faults off, store up: the store is the model.
    fn finish(&mut self) {
        self.store.set_down(false);
        self.store.set_config(FaultConfig::seeded(0)).unwrap();
        self.partial = false;
        self.corrupting = false;
        let keys = self.keys.clone();
        let got = poll_once(self.store.get(&keys)).unwrap().unwrap();
        let mut bytes = 0;
        for (k, p) in keys.iter().zip(got) {
            assert_eq!(
                p.as_ref(),
                self.model.get(k),
                "the store and the model differ"
            );
            bytes += p.map_or(0, |b| b.len() as u64);
        }
        let s = self.store.inner().stats();
        assert_eq!((s.pages, s.bytes), (self.model.len() as u64, bytes));
    }
}

fn expect_injected(e: &StoreError) {
    assert!(
        matches!(e, StoreError::Unavailable(_) | StoreError::Io(_)),
        "not an injected fault: {e:?}"
    );
}

fn run(data: &[u8]) -> arbitrary::Result<()> {
    let input = Input::arbitrary_take_rest(Unstructured::new(data))?;
    let id = KvIdentity::new("fuzz-model", "fuzz-layout");
    let g = KvGeometry::new(1, 2, 4).expect("a valid geometry");
    let fmt = PageFormat::new(g, &id, &[]).expect("a valid format");
    let tokens: Vec<u32> = (0..2 * KEYS as u32).collect();
    let keys = KeySeed::new(&Namespace::DEFAULT, &id).chain(&tokens, 2);
    let page_len = fmt.encoded_len(&[]) as u64;
    let capped = input.cap_pages > 0;
    let inner = if capped {
        MemStore::with_cap(u64::from(input.cap_pages % 16 + 1) * page_len)
    } else {
        MemStore::new()
    };
    let mut w = World {
        fmt,
        keys,
        store: FaultStore::new(inner, FaultConfig::seeded(1)).expect("no faults"),
        model: HashMap::new(),
        capped,
        corrupting: false,
        partial: false,
    };
    for op in input.ops.iter().take(64) {
        w.op(op);
    }
    w.finish();
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
