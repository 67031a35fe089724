//! Drives a small `RadixCache` with an arbitrary operation sequence decoded from the input and
//! audits every invariant after each step. Any panic or invariant violation is a finding.
//!
//! Run with `cargo fuzz run radix_ops` from this folder (nightly toolchain).
#![no_main]

use libfuzzer_sys::fuzz_target;
use radixkv_radix::{
    FinishKind, InsertOptions, KeyRef, Namespace, PolicyKind, PrefixCache, RadixCache,
    RadixConfig, RadixKey, RequestKv,
};

fuzz_target!(|data: &[u8]| {
    let Some((&head, mut rest)) = data.split_first() else { return };
    let page_size = 1 + (head & 3) as usize;
    let policy = PolicyKind::ALL[(head >> 2) as usize % PolicyKind::ALL.len()];
    let Ok(mut cache) = RadixCache::new(RadixConfig {
        page_size,
        total_pages: 48,
        max_rows: 4,
        policy,
        events: head & 0x80 != 0,
        event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
        disabled: false,
    }) else {
        return;
    };
    let namespaces = [Namespace::DEFAULT, Namespace::new("a"), Namespace::new("b")];
    let mut running: Vec<RequestKv> = Vec::new();
    let mut receipts = Vec::new();
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        let len = (op >> 3) as usize % 24;
        let (toks, tail) = rest.split_at(len.min(rest.len()));
        rest = tail;
        let tokens: Vec<u32> = toks.iter().map(|b| u32::from(b & 3)).collect();
        let ns = namespaces[(op as usize >> 1) % 3].clone();
        match op & 7 {
            0 => {
                let mut out = Vec::new();
                if let Ok(m) = cache.match_prefix(KeyRef::with_namespace(&tokens, &ns), &mut out) {
                    assert_eq!(out.len() * page_size, m.device_len);
                    if op & 8 != 0 {
                        if let Ok(r) = cache.inc_lock_ref(m.last_device) {
                            receipts.push(r);
                        }
                    }
                }
            }
            1 => {
                let aligned = tokens.len() - tokens.len() % page_size;
                if let Ok(pages) = cache.alloc_pages(aligned / page_size) {
                    let key = KeyRef::with_namespace(&tokens[..aligned], &ns);
                    match cache.insert(key, &pages, InsertOptions::default()) {
                        Ok(r) => cache.pools_mut().pages.free(&r.duplicates).unwrap(),
                        Err(_) => cache.pools_mut().pages.free(&pages).unwrap(),
                    }
                }
            }
            2 => {
                if let Some(r) = receipts.pop() {
                    cache.dec_lock_ref(r).unwrap();
                }
            }
            3 => {
                cache.evict(len * page_size);
            }
            4 => {
                let mut req = RequestKv::new(RadixKey::with_namespace(tokens, ns));
                if cache.match_request(&mut req).is_ok() && cache.begin_request(&mut req).is_ok() {
                    running.push(req);
                }
            }
            5 => {
                if let Some(req) = running.last_mut() {
                    let n = (len % 6).min(req.key.len().saturating_sub(req.allocated_len));
                    if cache.alloc_tokens(req, n).is_ok() {
                        req.commit(n).unwrap();
                        cache.cache_unfinished_req(req).unwrap();
                    }
                }
            }
            6 => {
                if let Some(mut req) = running.pop() {
                    let kind = if op & 8 != 0 { FinishKind::Aborted } else { FinishKind::Finished };
                    cache.cache_finished_req(&mut req, kind).unwrap();
                }
            }
            _ => {
                if running.is_empty() && receipts.is_empty() {
                    cache.reset().unwrap();
                }
            }
        }
        cache.check_invariants().unwrap();
        assert!(cache.accounting().balanced());
    }
    for mut req in running {
        cache.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
    }
    for r in receipts {
        cache.dec_lock_ref(r).unwrap();
    }
    cache.check_invariants().unwrap();
    assert_eq!(cache.protected_tokens(), 0);
});
