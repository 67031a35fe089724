//! `ManagerConfig` from arbitrary TOML and JSON text (the same bytes go to both parsers).
//!
//! A parsed config is a validated one; it survives a JSON round trip exactly (and a TOML one
//! when TOML can represent its integers); its modeled byte counts do not overflow; and a
//! config small enough to build (pools capped here so the fuzzer does not spend its time
//! allocating) builds a manager that runs a request and ends with nothing held, or is refused
//! with a typed error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use radixkv_scheduler_api::{
    Admission, CacheKind, KvCacheManager, ManagerConfig, ManagerError, Request, StorageBackendKind,
};

/// Largest pools the target builds.
const MAX_PAGES: usize = 4096;
const MAX_ROWS: usize = 256;

fn small(cfg: &ManagerConfig) -> bool {
    let p = cfg.model.page_size;
    // A storage tier is built only in memory: a file store would create the directory the
    // input names, a Redis store would connect to the host it names.
    let host_ok = match &cfg.cache {
        CacheKind::HiCache(h) => {
            h.host_tokens / p <= 2 * MAX_PAGES
                && h.storage.as_ref().is_none_or(|s| {
                    matches!(s.backend, StorageBackendKind::Memory { .. }) && s.worker_threads <= 2
                })
        }
        _ => true,
    };
    p <= 64
        && cfg.device_pages() <= MAX_PAGES
        && cfg.max_rows <= MAX_ROWS
        && host_ok
        && cfg.sim_geometry.layers <= 4
        && cfg.sim_geometry.bytes_per_token_per_layer <= 16
}

/// A short request (of session 1 when sessions are on: a manager without them refuses the
/// tag) through the whole lifecycle; afterwards nothing may be held.
fn run_one(kv: &mut KvCacheManager) -> Result<(), ManagerError> {
    let mut req = Request::new((0..9).collect()).max_new_tokens(2);
    if kv.config().sessions.is_some() {
        req = req.session(1);
    }
    let r = kv.arrive(req)?;
    let step = kv.begin_step();
    let served = match kv.admit(r)? {
        Admission::Ready(a) => kv
            .extend(r, a.extend_tokens)
            .and_then(|_| kv.chunk_done(r))
            .and_then(|()| kv.decode(r, 7)),
        Admission::Wait(_) | Admission::Never(_) => Err(ManagerError::OutOfMemory {
            needed: 0,
            available: 0,
        }),
    };
    kv.end_step(step)?;
    match served {
        Ok(_) => kv.finish(r)?,
        Err(ManagerError::OutOfMemory { .. }) => kv.abort(r)?,
        Err(e) => return Err(e),
    }
    kv.close_all_sessions()?;
    kv.drain()?;
    Ok(())
}

fn check(cfg: &ManagerConfig) {
    cfg.validate().expect("a parsed config is a valid one");
    let m = &cfg.model;
    assert!(
        m.kv_bytes_per_token_per_layer
            .checked_mul(m.layer_counts().attention)
            .and_then(|b| b.checked_mul(m.page_size as u64))
            .is_some(),
        "a valid config whose modeled page bytes overflow: {m:?}"
    );
    let _ = cfg.label();
    let json = serde_json::to_string(cfg).expect("a config serializes to JSON");
    let back = ManagerConfig::from_json_str(&json).expect("a config re-parses from its JSON");
    assert_eq!(&back, cfg, "JSON round trip");
    if let Ok(text) = toml::to_string(cfg) {
        let back = ManagerConfig::from_toml_str(&text).expect("a config re-parses from its TOML");
        assert_eq!(&back, cfg, "TOML round trip");
    }
    if !small(cfg) {
        return;
    }
    match KvCacheManager::new(cfg.clone()) {
        Ok(mut kv) => {
            kv.set_check_every_step(true);
            if let Err(e) = run_one(&mut kv) {
                panic!("a built manager failed a plain request: {e}");
            }
            kv.check_invariants().expect("invariants after one request");
            let a = kv.accounting();
            assert_eq!((a.protected, a.request_owned), (0, 0), "leak: {a:?}");
            assert_eq!(kv.reserved_tokens(), 0);
        }
        Err(
            ManagerError::NotWired { .. }
            | ManagerError::NotImplemented { .. }
            | ManagerError::Config(_)
            | ManagerError::Tier(_),
        ) => {}
        Err(e) => panic!("a valid config was refused with an untyped reason: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for parsed in [
        ManagerConfig::from_toml_str(text),
        ManagerConfig::from_json_str(text),
    ] {
        match parsed {
            Ok(cfg) => check(&cfg),
            Err(e) => assert!(
                matches!(
                    e,
                    ManagerError::Config(_)
                        | ManagerError::NotImplemented { .. }
                        | ManagerError::FeatureOff { .. }
                ),
                "{e}"
            ),
        }
    }
});
