//! The stores of the storage tier: the shared conformance suite over `MemStore` and
//! `FileStore`, the file store's restart, cleanup, cap and sharing behaviour, and every fault
//! `FaultStore` injects.

#[path = "common/storage.rs"]
mod storage_suite;

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use radixkv_hicache::storage::{
    FaultConfig, FaultCounts, FaultStore, FileStore, FileStoreConfig, FileSync, MemStore,
    PageFormat, StorageBackend, StoreError,
};
use radixkv_radix::PageKey;
use storage_suite::{Suite, conformance, conformance_cap, page_format, pattern};

/// A fresh, empty directory for one test (removed when dropped).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "radixkv-store-{name}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }

    fn config(&self) -> FileStoreConfig {
        FileStoreConfig::new(&self.0)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn key(i: u64) -> PageKey {
    Suite::exact(7).key(i)
}

/// Polls `f` once, outside any runtime.
fn poll_once<F: Future>(f: F) -> Poll<F::Output> {
    let mut f = std::pin::pin!(f);
    f.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

// ---- the conformance suite ----

#[tokio::test]
async fn mem_store_conforms() {
    conformance(&MemStore::new(), &Suite::exact(1)).await;
    conformance_cap(&MemStore::with_cap(4000), 4000, &Suite::exact(2)).await;
}

#[tokio::test]
async fn file_store_conforms_under_every_sync_policy() {
    for (i, sync) in [FileSync::Never, FileSync::Pages, FileSync::PagesAndDirs]
        .into_iter()
        .enumerate()
    {
        let dir = TempDir::new("conform");
        let store = FileStore::open(dir.config().with_sync(sync)).await.unwrap();
        conformance(&store, &Suite::exact(10 + i as u64)).await;
    }
    let dir = TempDir::new("conform-cap");
    let store = FileStore::open(dir.config().with_cap(4000)).await.unwrap();
    conformance_cap(&store, 4000, &Suite::exact(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_conforms_on_a_multi_thread_runtime_through_a_dyn_arc() {
    let dir = TempDir::new("conform-mt");
    let store: Arc<dyn StorageBackend> = Arc::new(
        FileStore::open(dir.config().with_cap(1 << 30))
            .await
            .unwrap(),
    );
    conformance(store.as_ref(), &Suite::exact(30)).await;
}

#[tokio::test]
async fn fault_store_without_faults_conforms() {
    let store = FaultStore::new(MemStore::new(), FaultConfig::seeded(3)).unwrap();
    conformance(&store, &Suite::exact(40)).await;
    assert_eq!(store.counts(), FaultCounts::default());
}

// ---- FileStore ----

#[tokio::test]
async fn file_store_lays_pages_out_by_hex_key_in_fanout_directories() {
    let dir = TempDir::new("layout");
    let store = FileStore::open(dir.config()).await.unwrap();
    let k = key(1);
    store.put(&[(k, b"page".to_vec())]).await.unwrap();
    let hex = k.to_hex();
    let path = dir.0.join(&hex[..2]).join(&hex);
    assert_eq!(store.page_path(&k), path);
    assert_eq!(fs::read(&path).unwrap(), b"page");
    // Nothing but the page is left in its directory (no temporary file).
    let names: Vec<_> = fs::read_dir(dir.0.join(&hex[..2]))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [std::ffi::OsString::from(&hex)]);
}

#[tokio::test]
async fn file_store_survives_a_restart_with_its_pages_and_byte_count() {
    let dir = TempDir::new("restart");
    let pages: Vec<(PageKey, Vec<u8>)> = (0..50)
        .map(|i| (key(i), pattern(i, 300 + i as usize)))
        .collect();
    let bytes: u64 = pages.iter().map(|(_, b)| b.len() as u64).sum();
    {
        let store = FileStore::open(dir.config()).await.unwrap();
        store.put(&pages).await.unwrap();
        store.delete(&[key(49)]).await.unwrap();
    }
    let store = FileStore::open(dir.config()).await.unwrap();
    let s = store.stats();
    assert_eq!((s.pages, s.bytes), (49, bytes - 349));
    let keys: Vec<PageKey> = (0..50).map(key).collect();
    assert_eq!(store.exists_prefix(&keys).await.unwrap(), 49);
    let got = store.get(&keys).await.unwrap();
    for (i, g) in got.iter().enumerate().take(49) {
        assert_eq!(g.as_ref(), Some(&pages[i].1));
    }
    assert_eq!(got[49], None);
    // The blocking constructor finds the same.
    let again = FileStore::open_blocking(dir.config()).unwrap();
    assert_eq!(again.stats().bytes, bytes - 349);
}

#[tokio::test]
async fn file_store_open_removes_temp_files_and_ignores_foreign_ones() {
    let dir = TempDir::new("temp");
    {
        let store = FileStore::open(dir.config()).await.unwrap();
        store.put(&[(key(1), vec![1; 10])]).await.unwrap();
    }
    let hex = key(1).to_hex();
    let sub = dir.0.join(&hex[..2]);
    // A crashed writer's leftovers, a foreign file, a file in a non-fanout directory, and a
    // page name in the wrong fan-out directory.
    fs::write(sub.join(format!(".tmp.{hex}.1.2.3")), b"half a pa").unwrap();
    fs::write(sub.join(".tmp.x"), b"").unwrap();
    fs::write(sub.join("notes.txt"), b"keep me").unwrap();
    fs::create_dir_all(dir.0.join("other")).unwrap();
    fs::write(dir.0.join("other").join(&hex), b"keep me too").unwrap();
    let other = key(2).to_hex();
    let wrong = if &other[..2] == "00" { "01" } else { "00" };
    fs::create_dir_all(dir.0.join(wrong)).unwrap();
    fs::write(dir.0.join(wrong).join(&other), b"misplaced").unwrap();

    let store = FileStore::open(dir.config()).await.unwrap();
    let mut names: Vec<_> = fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want = vec![hex.clone(), "notes.txt".to_owned()];
    want.sort();
    assert_eq!(names, want, "temporary files are gone, the rest stays");
    let s = store.stats();
    assert_eq!((s.pages, s.bytes), (1, 10), "only the page counts");
    assert!(dir.0.join("other").join(&hex).exists());
    assert_eq!(store.get(&[key(2)]).await.unwrap(), [None]);
}

/// Sets the modification time of a page's file.
fn set_mtime(store: &FileStore, k: &PageKey, secs: u64) {
    let f = fs::File::options()
        .write(true)
        .open(store.page_path(k))
        .unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        .unwrap();
}

#[tokio::test]
async fn file_store_cap_holds_across_restarts_oldest_files_first() {
    let dir = TempDir::new("cap-restart");
    {
        let store = FileStore::open(dir.config().with_cap(4000)).await.unwrap();
        let pages: Vec<(PageKey, Vec<u8>)> = (0..4).map(|i| (key(i), pattern(i, 1000))).collect();
        assert_eq!(store.put(&pages).await.unwrap(), [true; 4]);
        // Make the age order explicit: page 2 oldest, then 0, 3, 1.
        for (i, t) in [(2, 100), (0, 200), (3, 300), (1, 400)] {
            set_mtime(&store, &key(i), t);
        }
    }
    // A smaller cap evicts at open, oldest first.
    let store = FileStore::open(dir.config().with_cap(2500)).await.unwrap();
    let s = store.stats();
    assert_eq!((s.pages, s.bytes, s.evicted_pages), (2, 2000, 2));
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let got = store.get(&keys).await.unwrap();
    let present: Vec<bool> = got.iter().map(Option::is_some).collect();
    assert_eq!(present, [false, true, false, true]);
    drop(store);
    // The survivors are still there at the old cap, and the cap keeps working.
    let store = FileStore::open(dir.config().with_cap(4000)).await.unwrap();
    assert_eq!(store.stats().bytes, 2000);
    let more: Vec<(PageKey, Vec<u8>)> = (4..7).map(|i| (key(i), pattern(i, 1000))).collect();
    assert_eq!(store.put(&more).await.unwrap(), [true; 3]);
    let s = store.stats();
    assert_eq!((s.pages, s.bytes, s.evicted_pages), (4, 4000, 1));
    // The files on disk agree with the count.
    let on_disk: u64 = fs::read_dir(&dir.0)
        .unwrap()
        .flat_map(|d| fs::read_dir(d.unwrap().path()).unwrap())
        .map(|f| f.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(on_disk, 4000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_file_stores_share_a_directory() {
    let dir = TempDir::new("shared");
    let a = Arc::new(FileStore::open(dir.config()).await.unwrap());
    let b = Arc::new(FileStore::open(dir.config()).await.unwrap());
    // A page one writes, the other finds (and indexes once it reads it).
    a.put(&[(key(1), pattern(1, 500))]).await.unwrap();
    assert_eq!(b.exists_prefix(&[key(1)]).await.unwrap(), 1);
    assert_eq!(b.get(&[key(1)]).await.unwrap(), [Some(pattern(1, 500))]);
    assert_eq!((b.stats().pages, b.stats().bytes), (1, 500));
    // A page one deletes is a miss for the other, which forgets it.
    b.delete(&[key(1)]).await.unwrap();
    assert_eq!(a.get(&[key(1)]).await.unwrap(), [None]);
    assert_eq!((a.stats().pages, a.stats().bytes), (0, 0));

    // Both rewrite the same keys with whole encoded pages while both read them: every page
    // read is a whole page that decodes, never a mix.
    let (fmt, seed) = page_format();
    let keys: Vec<PageKey> = (0..8u32).map(|i| seed.first(&[i, 0, 0, 0])).collect();
    fn encode(fmt: &PageFormat, writer: u64, round: u64, k: &PageKey) -> Vec<u8> {
        let mut out = Vec::new();
        let kv = pattern(writer << 32 | round, fmt.kv_bytes());
        fmt.encode(k, &kv, &[], &mut out).unwrap();
        out
    }
    let mut tasks = Vec::new();
    for (w, store) in [(1u64, Arc::clone(&a)), (2, Arc::clone(&b))] {
        let keys = keys.clone();
        let fmt = fmt.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..40u64 {
                let pages: Vec<(PageKey, Vec<u8>)> = keys
                    .iter()
                    .map(|k| (*k, encode(&fmt, w, round, k)))
                    .collect();
                assert_eq!(store.put(&pages).await.unwrap(), vec![true; 8]);
                for (k, got) in keys.iter().zip(store.get(&keys).await.unwrap()) {
                    if let Some(got) = got {
                        fmt.decode(k, &got).expect("a whole page");
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let leftovers = fs::read_dir(&dir.0)
        .unwrap()
        .flat_map(|d| fs::read_dir(d.unwrap().path()).unwrap())
        .filter(|f| {
            f.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp.")
        })
        .count();
    assert_eq!(leftovers, 0, "no temporary file is left behind");
}

#[tokio::test]
async fn file_store_refuses_bad_configs_with_typed_errors() {
    let dir = TempDir::new("config");
    fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("a-file");
    fs::write(&file, b"x").unwrap();
    let err = FileStore::open(FileStoreConfig::new(&file))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = FileStore::open(FileStoreConfig::new(file.join("below")))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = FileStore::open(dir.config().with_cap(0)).await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
}

#[test]
fn file_store_outside_a_runtime_is_a_config_error() {
    let dir = TempDir::new("no-runtime");
    assert!(matches!(
        poll_once(FileStore::open(dir.config())),
        Poll::Ready(Err(StoreError::Config(_)))
    ));
    let store = FileStore::open_blocking(dir.config()).unwrap();
    assert!(matches!(
        poll_once(store.get(&[key(1)])),
        Poll::Ready(Err(StoreError::Config(_)))
    ));
    assert_eq!(store.stats().errors, 1);
}

#[tokio::test]
async fn file_store_io_failures_are_io_errors_and_counted() {
    let dir = TempDir::new("io");
    let store = FileStore::open(dir.config()).await.unwrap();
    // A directory where a page's file should be: reading and deleting it fail.
    fs::create_dir_all(store.page_path(&key(1))).unwrap();
    assert!(matches!(store.get(&[key(1)]).await, Err(StoreError::Io(_))));
    assert!(matches!(
        store.delete(&[key(1)]).await,
        Err(StoreError::Io(_))
    ));
    assert!(matches!(
        store.put(&[(key(1), vec![1])]).await,
        Err(StoreError::Io(_))
    ));
    // Not a page: no prefix.
    assert_eq!(store.exists_prefix(&[key(1)]).await.unwrap(), 0);
    assert_eq!(store.stats().errors, 3);
    // No temporary file is left by the failed put.
    let sub = store.page_path(&key(1)).parent().unwrap().to_owned();
    assert_eq!(fs::read_dir(sub).unwrap().count(), 1);
}

// ---- FaultStore ----

fn faulty(config: FaultConfig) -> FaultStore<MemStore> {
    FaultStore::new(MemStore::new(), config).unwrap()
}

async fn fill(store: &dyn StorageBackend, n: u64) -> Vec<(PageKey, Vec<u8>)> {
    let pages: Vec<(PageKey, Vec<u8>)> = (0..n).map(|i| (key(i), pattern(i, 64))).collect();
    assert!(store.put(&pages).await.unwrap().iter().all(|&s| s));
    pages
}

#[tokio::test]
async fn fault_store_goes_down_and_up() {
    let store = faulty(FaultConfig::seeded(1));
    let pages = fill(&store, 4).await;
    store.set_down(true);
    assert!(store.is_down());
    let keys = [key(0)];
    let unavailable = |r: Result<(), StoreError>| matches!(r, Err(StoreError::Unavailable(_)));
    assert!(unavailable(store.exists_prefix(&keys).await.map(drop)));
    assert!(unavailable(store.get(&keys).await.map(drop)));
    assert!(unavailable(store.put(&pages).await.map(drop)));
    assert!(unavailable(store.delete(&keys).await.map(drop)));
    assert_eq!(store.counts().down, 4);
    assert_eq!(store.stats().errors, 4);
    store.set_down(false);
    assert_eq!(store.get(&keys).await.unwrap(), [Some(pages[0].1.clone())]);
    assert_eq!(
        store.inner().stats().put_pages,
        4,
        "nothing reached the store while down"
    );
}

#[tokio::test]
async fn fault_store_errors_are_unavailable_or_io_and_never_reach_the_store() {
    let store = faulty(FaultConfig {
        error: 1.0,
        ..FaultConfig::seeded(2)
    });
    let (mut unavailable, mut io) = (0, 0);
    for i in 0..40 {
        match store.put(&[(key(i), vec![1])]).await {
            Err(StoreError::Unavailable(_)) => unavailable += 1,
            Err(StoreError::Io(_)) => io += 1,
            other => panic!("not an injected error: {other:?}"),
        }
    }
    assert!(unavailable > 0 && io > 0, "{unavailable} {io}");
    assert_eq!(store.counts().errors, 40);
    assert_eq!(store.inner().stats().put_pages, 0);
}

#[tokio::test]
async fn fault_store_hangs_until_dropped_and_stores_nothing() {
    let store = faulty(FaultConfig {
        hang: 1.0,
        ..FaultConfig::seeded(3)
    });
    let put = [(key(1), vec![1])];
    assert!(poll_once(store.put(&put)).is_pending());
    // The deadline of the tier above ends it.
    let r = tokio::time::timeout(Duration::from_millis(10), store.get(&[key(1)])).await;
    assert!(r.is_err(), "a hang never completes");
    assert_eq!(store.counts().hangs, 2);
    assert_eq!(store.inner().stats().put_pages, 0);
}

#[tokio::test]
async fn fault_store_slow_answers_arrive_late_or_are_cut_by_a_deadline() {
    let store = faulty(FaultConfig {
        slow: 1.0,
        slow_ms: 20,
        ..FaultConfig::seeded(4)
    });
    let pages = fill(&store, 2).await;
    assert_eq!(
        store.get(&[key(0), key(1)]).await.unwrap(),
        [Some(pages[0].1.clone()), Some(pages[1].1.clone())]
    );
    assert_eq!(store.counts().slow, 2);
    // An answer held back ten minutes: the deadline fires, and dropping the future ends the
    // wait (the runtime would otherwise wait for it at shutdown).
    store
        .set_config(FaultConfig {
            slow: 1.0,
            slow_ms: 600_000,
            ..FaultConfig::seeded(4)
        })
        .unwrap();
    let r = tokio::time::timeout(Duration::from_millis(10), store.put(&[(key(9), vec![9])])).await;
    assert!(r.is_err());
    // The slow put ran before its answer was held back.
    assert_eq!(store.inner().get(&[key(9)]).await.unwrap(), [Some(vec![9])]);
    assert_eq!(store.counts().slow, 3);
}

#[test]
fn fault_store_slow_outside_a_runtime_is_a_config_error() {
    let store = faulty(FaultConfig {
        slow: 1.0,
        slow_ms: 1,
        ..FaultConfig::seeded(5)
    });
    assert!(matches!(
        poll_once(store.get(&[key(1)])),
        Poll::Ready(Err(StoreError::Config(_)))
    ));
}

#[tokio::test]
async fn fault_store_partial_batches_are_prefixes() {
    let store = faulty(FaultConfig::seeded(6));
    let pages = fill(&store, 8).await;
    let keys: Vec<PageKey> = (0..8).map(key).collect();
    store
        .set_config(FaultConfig {
            partial: 1.0,
            ..FaultConfig::seeded(6)
        })
        .unwrap();
    for _ in 0..10 {
        let got = store.get(&keys).await.unwrap();
        let n = got.iter().take_while(|p| p.is_some()).count();
        assert!(n < 8, "a partial get misses a suffix");
        assert!(got[n..].iter().all(Option::is_none));
        for (g, (_, want)) in got.iter().zip(&pages).take(n) {
            assert_eq!(g.as_ref(), Some(want));
        }
        assert!(store.exists_prefix(&keys).await.unwrap() < 8);
    }
    // A partial put stores exactly the prefix it reports.
    let new: Vec<(PageKey, Vec<u8>)> = (100..108).map(|i| (key(i), pattern(i, 8))).collect();
    let stored = store.put(&new).await.unwrap();
    let n = stored.iter().take_while(|&&s| s).count();
    assert!(n < 8 && stored[n..].iter().all(|&s| !s));
    let new_keys: Vec<PageKey> = new.iter().map(|(k, _)| *k).collect();
    let inner = store.inner().get(&new_keys).await.unwrap();
    for (i, g) in inner.iter().enumerate() {
        assert_eq!(g.is_some(), i < n);
    }
    assert_eq!(store.counts().partial_batches, 21);
    // An empty batch is never partial.
    store.get(&[]).await.unwrap();
    assert_eq!(store.counts().partial_batches, 21);
}

#[tokio::test]
async fn fault_store_corrupted_pages_never_decode() {
    let (fmt, seed) = page_format();
    let store = faulty(FaultConfig::seeded(7));
    let mut pages = Vec::new();
    let mut k = seed.first(&[9, 9, 9, 9]);
    for i in 0..64u32 {
        let mut out = Vec::new();
        fmt.encode(&k, &pattern(u64::from(i), fmt.kv_bytes()), &[], &mut out)
            .unwrap();
        pages.push((k, out));
        k = k.next(&[i, 0, 0, 0]);
    }
    store.put(&pages).await.unwrap();
    let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
    // Every page corrupted: each comes back different and fails to decode.
    store
        .set_config(FaultConfig {
            corrupt: 1.0,
            ..FaultConfig::seeded(7)
        })
        .unwrap();
    for round in 0..5 {
        for ((k, want), got) in pages.iter().zip(store.get(&keys).await.unwrap()) {
            let got = got.unwrap();
            assert_ne!(&got, want);
            assert!(fmt.decode(k, &got).is_err(), "round {round}");
        }
    }
    assert_eq!(store.counts().corrupted_pages, 5 * 64);
    // Half corrupted, many seeds: whatever decodes is exactly the page stored.
    let mut decoded = 0;
    for s in 0..20 {
        store
            .set_config(FaultConfig {
                corrupt: 0.5,
                ..FaultConfig::seeded(s)
            })
            .unwrap();
        for ((k, want), got) in pages.iter().zip(store.get(&keys).await.unwrap()) {
            let got = got.unwrap();
            if let Ok(d) = fmt.decode(k, &got) {
                decoded += 1;
                assert_eq!(&got, want);
                assert_eq!(d.kv, fmt.decode(k, want).unwrap().kv);
            }
        }
    }
    assert!(decoded > 0 && decoded < 20 * 64);
}

#[tokio::test]
async fn fault_store_is_deterministic_per_seed() {
    async fn run(seed: u64) -> (Vec<String>, FaultCounts) {
        let store = faulty(FaultConfig {
            error: 0.2,
            partial: 0.3,
            corrupt: 0.2,
            ..FaultConfig::seeded(seed)
        });
        let mut log = Vec::new();
        for i in 0..60u64 {
            let pages = [
                (key(i % 7), pattern(i, 16)),
                (key(i % 7 + 1), pattern(i, 17)),
            ];
            log.push(format!("{:?}", store.put(&pages).await));
            let keys = [key(i % 5), key(i % 5 + 1), key(i % 5 + 2)];
            log.push(format!("{:?}", store.get(&keys).await));
            log.push(format!("{:?}", store.exists_prefix(&keys).await));
        }
        (log, store.counts())
    }
    let (a, ca) = run(11).await;
    let (b, cb) = run(11).await;
    assert_eq!(a, b);
    assert_eq!(ca, cb);
    assert!(
        ca.errors > 0 && ca.partial_batches > 0 && ca.corrupted_pages > 0,
        "{ca:?}"
    );
    let (c, _) = run(12).await;
    assert_ne!(a, c, "another seed, other faults");
}

#[test]
fn fault_store_refuses_bad_probabilities() {
    for bad in [-0.1, 1.5, f64::NAN] {
        let config = FaultConfig {
            error: bad,
            ..FaultConfig::default()
        };
        assert!(matches!(
            FaultStore::new(MemStore::new(), config),
            Err(StoreError::Config(_))
        ));
    }
    let store = faulty(FaultConfig::seeded(1));
    let bad = FaultConfig {
        corrupt: 2.0,
        ..FaultConfig::seeded(9)
    };
    assert!(store.set_config(bad).is_err());
    assert_eq!(
        store.config(),
        FaultConfig::seeded(1),
        "the old config stays"
    );
}
