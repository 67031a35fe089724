//! The storage tier on a real Redis server that is killed and restarted in the middle of a
//! stream of requests: nothing panics, every request is served (recomputed while the store is
//! gone), no host page or device page leaks, and once the server is back the tier stores and
//! finds pages again.
//!
//! Needs the `redis` feature (on whenever the workspace is built with `radixkv-replay`, whose
//! default features enable it) and `redis-server` on `PATH`; without either the test says why
//! it skipped (run with `--nocapture`), and under `CI=true` it fails instead.

mod common;
// The redis-server helper the hicache Redis tests use too.
#[path = "../../hicache/tests/common/redis_server.rs"]
mod redis_server;

use common::{balanced, step};
use radixkv_scheduler_api::{
    Admission, HostTier, KvCacheManager, PrefetchStopPolicy, Request, StorageBackendKind,
    StorageTier, WaitReason,
};
use redis_server::{Server, have_redis_server};

fn manager(url: &str) -> KvCacheManager {
    let backend = StorageBackendKind::Redis {
        url: url.into(),
        cluster: false,
        key_prefix: format!("radixkv-test-{}:", std::process::id()),
    };
    let tier = HostTier::ratio(256, 4.0)
        .load_back_min_tokens(4)
        .storage(Some(
            StorageTier::new(backend, "test-model")
                .prefetch_threshold_tokens(4)
                .stop(PrefetchStopPolicy::WaitComplete {})
                .op_timeout_ms(500),
        ));
    KvCacheManager::builder()
        .page_size(4)
        .device_tokens(256)
        .host_tier(tier)
        .build()
        .expect("a manager over the Redis store")
}

/// Request `i`: one of 4 shared 48-token prefixes, then 8 tokens of its own.
fn prompt(i: u32) -> Vec<u32> {
    let family = i % 4;
    (0..48)
        .map(|t| 1_000 * (family + 1) + t)
        .chain((0..8).map(|t| 100_000 + 100 * i + t))
        .collect()
}

/// Serves one request to its end; returns the tokens its admission took from the store.
fn serve(kv: &mut KvCacheManager, tokens: Vec<u32>) -> usize {
    let r = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
    let a = loop {
        match kv.admit(r).unwrap() {
            Admission::Ready(a) => break a,
            // Bounded: a lookup or fetch ends at the store's answer or its 500 ms timeout.
            Admission::Wait(WaitReason::Prefetching) => step(kv),
            other => panic!("{other:?}"),
        }
    };
    kv.extend(r, a.extend_tokens).unwrap();
    let s = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(s).unwrap();
    kv.finish(r).unwrap();
    step(kv);
    // Every transfer and storage job done: nothing may be held.
    kv.drain().unwrap();
    balanced(kv);
    let acc = kv.accounting();
    assert_eq!((acc.request_owned, acc.protected), (0, 0), "{acc:?}");
    a.storage_tokens
}

#[test]
fn a_redis_server_killed_and_restarted_mid_stream_degrades_and_recovers() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let why = if !cfg!(feature = "redis") {
        Some("radixkv-scheduler-api was built without its `redis` feature")
    } else if !have_redis_server() {
        Some("redis-server is not on PATH")
    } else {
        None
    };
    if let Some(why) = why {
        assert!(!ci, "the Redis storage test cannot run under CI: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let mut server = Server::start();
    let url = server.url();
    let mut kv = manager(&url);
    let mut written_before_kill = 0;
    for i in 0..24 {
        if i == 8 {
            written_before_kill = kv.metrics().counters.backup_pages_written;
            assert!(written_before_kill > 0, "backups reached the server");
            server.kill();
        }
        if i == 16 {
            server.restart();
        }
        serve(&mut kv, prompt(i));
    }
    let c = kv.metrics().counters;
    // While it was gone, backups failed and the store counted errors; requests recomputed.
    assert!(c.backup_pages_failed > 0, "{c:?}");
    assert!(c.store_errors > 0, "{c:?}");
    // After the restart (an empty server: no persistence) backups land again.
    assert!(c.backup_pages_written > written_before_kill, "{c:?}");
    assert_eq!(c.finished, 24);

    // A prompt first served after the restart is stored (the families served before it stay
    // in this engine's host tier, so they are not written to the emptied server again), and
    // a restarted engine (device and host cold) finds it.
    let new: Vec<u32> = (0..56).map(|t| 900_000 + t).collect();
    serve(&mut kv, new.clone());
    let mut fresh = manager(&url);
    let found = serve(&mut fresh, new);
    assert_eq!(found, 52, "{:?}", fresh.metrics().counters);
    assert_eq!(fresh.metrics().counters.hit_tokens_storage, 52);
}
