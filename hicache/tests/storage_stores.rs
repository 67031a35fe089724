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
    PageFormat, RECORD_HEADER_BYTES, StorageBackend, StoreError,
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
    conformance_cap(&MemStore::with_cap(4000), 4000, 0, &Suite::exact(2)).await;
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
    conformance_cap(&store, 4000, RECORD_HEADER_BYTES, &Suite::exact(20)).await;
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

/// The segment files in `dir`, by name.
fn segments(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn file_store_appends_a_batch_to_one_segment_file() {
    let dir = TempDir::new("layout");
    let store = FileStore::open(dir.config()).await.unwrap();
    let pages: Vec<(PageKey, Vec<u8>)> = (0..3)
        .map(|i| (key(i), pattern(i, 100 + i as usize)))
        .collect();
    assert_eq!(store.put(&pages).await.unwrap(), [true; 3]);
    let segs = segments(&dir.0);
    assert_eq!(segs.len(), 1, "one segment: {segs:?}");
    let bytes = fs::read(&segs[0]).unwrap();
    let mut at = RECORD_HEADER_BYTES;
    for (k, page) in &pages {
        let (path, off, len) = store.page_location(k).unwrap();
        assert_eq!((&path, off, len), (&segs[0], at, page.len() as u64));
        assert_eq!(&bytes[off as usize..(off + len) as usize], &page[..]);
        at += len + RECORD_HEADER_BYTES;
    }
    assert_eq!(
        bytes.len() as u64,
        at - RECORD_HEADER_BYTES,
        "nothing but the records"
    );
    // Nothing but the segment is in the directory.
    assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 1);
    assert_eq!(store.page_location(&key(9)), None);
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
async fn file_store_ignores_and_keeps_foreign_files() {
    let dir = TempDir::new("foreign");
    {
        let store = FileStore::open(dir.config()).await.unwrap();
        store.put(&[(key(1), vec![1; 10])]).await.unwrap();
    }
    // A foreign file, a file in a directory, a page file of the old one-file-per-page
    // layout, a directory and a file with the segment suffix that is not a segment name.
    let hex = key(2).to_hex();
    fs::write(dir.0.join("notes.txt"), b"keep me").unwrap();
    fs::create_dir_all(dir.0.join(&hex[..2])).unwrap();
    fs::write(dir.0.join(&hex[..2]).join(&hex), b"old layout").unwrap();
    fs::create_dir_all(dir.0.join("0000000000000000-00000000-00000000.seg")).unwrap();
    fs::write(dir.0.join("Not A Segment.seg"), b"garbage").unwrap();
    // An evicted segment a store renamed but did not delete before it stopped, and a
    // foreign file with the same suffix.
    let evicted = dir.0.join("0000000000000001-00000000-00000000.seg.evicted");
    fs::write(&evicted, b"evicted").unwrap();
    fs::write(dir.0.join("notes.evicted"), b"keep me").unwrap();

    let store = FileStore::open(dir.config()).await.unwrap();
    let s = store.stats();
    assert_eq!((s.pages, s.bytes), (1, 10), "only the page counts");
    assert_eq!(
        store.get(&[key(2), key(1)]).await.unwrap(),
        [None, Some(vec![1; 10])]
    );
    assert_eq!(fs::read(dir.0.join("notes.txt")).unwrap(), b"keep me");
    assert!(dir.0.join(&hex[..2]).join(&hex).exists());
    assert!(dir.0.join("Not A Segment.seg").exists());
    assert!(
        !evicted.exists(),
        "a leftover evicted segment is deleted at open"
    );
    assert!(dir.0.join("notes.evicted").exists());
}

/// Sets the modification time of the segment holding a page.
fn set_mtime(store: &FileStore, k: &PageKey, secs: u64) {
    let f = fs::File::options()
        .write(true)
        .open(store.page_location(k).unwrap().0)
        .unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        .unwrap();
}

#[tokio::test]
async fn file_store_cap_holds_across_restarts_oldest_segments_first() {
    let dir = TempDir::new("cap-restart");
    // Four records of 1000-byte pages: the cap counts their headers too.
    let cap = 4 * (1000 + RECORD_HEADER_BYTES);
    {
        let store = FileStore::open(dir.config().with_cap(cap)).await.unwrap();
        let pages: Vec<(PageKey, Vec<u8>)> = (0..4).map(|i| (key(i), pattern(i, 1000))).collect();
        assert_eq!(store.put(&pages).await.unwrap(), [true; 4]);
        // One page per segment (a segment is at most cap / 16 bytes). Make the age order
        // explicit: page 2 oldest, then 0, 3, 1.
        assert_eq!(segments(&dir.0).len(), 4);
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
    let store = FileStore::open(dir.config().with_cap(cap)).await.unwrap();
    assert_eq!(store.stats().bytes, 2000);
    let more: Vec<(PageKey, Vec<u8>)> = (4..7).map(|i| (key(i), pattern(i, 1000))).collect();
    assert_eq!(store.put(&more).await.unwrap(), [true; 3]);
    let s = store.stats();
    assert_eq!((s.pages, s.bytes, s.evicted_pages), (4, 4000, 1));
    // The files on disk agree with the count: four records, each a header and its page.
    let on_disk: u64 = segments(&dir.0)
        .iter()
        .map(|p| p.metadata().unwrap().len())
        .sum();
    assert_eq!(on_disk, cap);
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
    // A page one deletes is still served whole by the other until a miss of the other
    // rescans the directory and finds the tombstone; then it is a miss there too.
    assert_eq!(b.delete(&[key(1)]).await.unwrap(), 1);
    assert_eq!(b.get(&[key(1)]).await.unwrap(), [None]);
    assert_eq!(a.get(&[key(1)]).await.unwrap(), [Some(pattern(1, 500))]);
    assert_eq!(a.exists_prefix(&[key(2)]).await.unwrap(), 0);
    assert_eq!(a.get(&[key(1)]).await.unwrap(), [None]);
    assert_eq!((a.stats().pages, a.stats().bytes), (0, 0));
    // A third store opened now finds neither.
    let c = FileStore::open(dir.config()).await.unwrap();
    assert_eq!((c.stats().pages, c.stats().bytes), (0, 0));
    // Each store appends only to its own segments.
    a.put(&[(key(3), pattern(3, 10))]).await.unwrap();
    b.put(&[(key(4), pattern(4, 10))]).await.unwrap();
    let (pa, pb) = (
        a.page_location(&key(3)).unwrap().0,
        b.page_location(&key(4)).unwrap().0,
    );
    assert_ne!(pa, pb);
    assert_eq!(
        c.get(&[key(3), key(4)]).await.unwrap(),
        [Some(pattern(3, 10)), Some(pattern(4, 10))]
    );
    assert_eq!(c.page_location(&key(3)).unwrap().0, pa);

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
    // Both stores find the pages after the race, whole.
    for store in [&a, &b] {
        assert_eq!(store.exists_prefix(&keys).await.unwrap(), 8);
        for (k, got) in keys.iter().zip(store.get(&keys).await.unwrap()) {
            fmt.decode(k, &got.expect("stored")).expect("a whole page");
        }
    }
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
    // Segments of 100 bytes: every 200-byte page starts a segment, and so does a tombstone.
    let store = FileStore::open(dir.config().with_segment_bytes(100))
        .await
        .unwrap();
    store.put(&[(key(1), vec![1; 200])]).await.unwrap();
    // A directory where the page's segment should be: reading it fails.
    let seg = store.page_location(&key(1)).unwrap().0;
    fs::remove_file(&seg).unwrap();
    fs::create_dir_all(&seg).unwrap();
    assert!(matches!(store.get(&[key(1)]).await, Err(StoreError::Io(_))));
    // A file where the store's directory should be: no new segment can be made.
    fs::remove_dir_all(&dir.0).unwrap();
    fs::write(&dir.0, b"x").unwrap();
    assert!(matches!(
        store.put(&[(key(2), vec![2; 200])]).await,
        Err(StoreError::Io(_))
    ));
    assert!(matches!(
        store.delete(&[key(1)]).await,
        Err(StoreError::Io(_))
    ));
    assert_eq!(store.stats().errors, 3);
    // The failed put and delete changed nothing; a miss, which lists the directory again,
    // fails too.
    assert_eq!(store.exists_prefix(&[key(1)]).await.unwrap(), 1);
    assert!(matches!(
        store.exists_prefix(&[key(1), key(2)]).await,
        Err(StoreError::Io(_))
    ));
    assert_eq!(store.stats().errors, 4);
    assert_eq!((store.stats().pages, store.stats().bytes), (1, 200));
    fs::remove_file(&dir.0).unwrap();
}

// ---- FileStore: segments, torn tails, damage, eviction ----

#[tokio::test]
async fn file_store_restart_skips_a_torn_tail_and_keeps_writing() {
    let dir = TempDir::new("torn");
    let pages: Vec<(PageKey, Vec<u8>)> = (0..4).map(|i| (key(i), pattern(i, 1000))).collect();
    let seg = {
        let store = FileStore::open(dir.config()).await.unwrap();
        store.put(&pages).await.unwrap();
        store.page_location(&key(0)).unwrap().0
    };
    let full = fs::metadata(&seg).unwrap().len();
    assert_eq!(full, 4 * (1000 + RECORD_HEADER_BYTES));
    // Cut the last record short (a process killed mid-write), and at the last header.
    for (cut, found) in [
        (full - 1, 3),
        (full - 1000 - 3, 3),
        (3 * (1000 + RECORD_HEADER_BYTES) + 5, 3),
    ] {
        let f = fs::File::options().write(true).open(&seg).unwrap();
        f.set_len(cut).unwrap();
        drop(f);
        let store = FileStore::open(dir.config()).await.unwrap();
        assert_eq!(store.stats().pages, found, "cut at {cut}");
        let got = store.get(&[key(0), key(1), key(2), key(3)]).await.unwrap();
        assert_eq!(
            got[..3],
            [
                Some(pages[0].1.clone()),
                Some(pages[1].1.clone()),
                Some(pages[2].1.clone())
            ]
        );
        assert_eq!(got[3], None, "a torn record is a miss");
    }
    // Garbage after the last whole record (zeros of a lost write, random bytes).
    let mut f = fs::File::options().append(true).open(&seg).unwrap();
    std::io::Write::write_all(&mut f, &[0u8; 100]).unwrap();
    std::io::Write::write_all(&mut f, &pattern(9, 300)).unwrap();
    drop(f);
    let store = FileStore::open(dir.config()).await.unwrap();
    assert_eq!(store.stats().pages, 3);
    // The store writes on into a segment of its own; a restart finds everything.
    assert_eq!(
        store.put(&[(key(3), pages[3].1.clone())]).await.unwrap(),
        [true]
    );
    assert_ne!(store.page_location(&key(3)).unwrap().0, seg);
    drop(store);
    let store = FileStore::open(dir.config()).await.unwrap();
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let got = store.get(&keys).await.unwrap();
    assert!(
        got.iter()
            .zip(&pages)
            .all(|(g, (_, p))| g.as_ref() == Some(p))
    );
}

/// Flips `mask` into byte `at` of `k`'s payload in its segment file (damage on disk), and
/// returns the payload `page` as it now reads.
fn flip_on_disk(store: &FileStore, k: &PageKey, page: &[u8], at: usize, mask: u8) -> Vec<u8> {
    let (path, off, _) = store.page_location(k).unwrap();
    let mut bytes = fs::read(&path).unwrap();
    bytes[off as usize + at] ^= mask;
    fs::write(&path, &bytes).unwrap();
    let mut damaged = page.to_vec();
    damaged[at] ^= mask;
    damaged
}

#[tokio::test]
async fn file_store_a_damaged_page_is_a_counted_miss_never_wrong_bytes() {
    let dir = TempDir::new("damage");
    let store = FileStore::open(dir.config()).await.unwrap();
    let pages: Vec<(PageKey, Vec<u8>)> = (0..3).map(|i| (key(i), pattern(i, 500))).collect();
    store.put(&pages).await.unwrap();
    // One payload byte of page 1 flipped on disk.
    flip_on_disk(&store, &key(1), &pages[1].1, 250, 0x10);
    let got = store.get(&[key(0), key(1), key(2)]).await.unwrap();
    assert_eq!(
        got,
        [Some(pages[0].1.clone()), None, Some(pages[2].1.clone())]
    );
    let s = store.stats();
    assert_eq!(
        (s.damaged_pages, s.pages, s.bytes, s.get_hits),
        (1, 2, 1000, 2)
    );
    assert_eq!(store.exists_prefix(&[key(0), key(1)]).await.unwrap(), 1);
    // Written again, it is whole.
    store.put(&[pages[1].clone()]).await.unwrap();
    assert_eq!(
        store.get(&[key(1)]).await.unwrap(),
        [Some(pages[1].1.clone())]
    );
}

/// Without `payload_checksums` puts write no checksum and a get checks only the length: a page
/// damaged on disk comes back as it reads (the reader's own check — the storage tier's — finds
/// it), `discard_damaged` then drops and counts it, and the undamaged pages read back whole.
#[tokio::test]
async fn file_store_without_payload_checksums_leaves_damage_to_the_reader() {
    let dir = TempDir::new("noverify");
    let store = FileStore::open(dir.config().with_payload_checksums(false))
        .await
        .unwrap();
    let pages: Vec<(PageKey, Vec<u8>)> = (0..3).map(|i| (key(i), pattern(i, 500))).collect();
    store.put(&pages).await.unwrap();
    let damaged = flip_on_disk(&store, &key(1), &pages[1].1, 250, 0x10);
    let got = store.get(&[key(0), key(1), key(2)]).await.unwrap();
    assert_eq!(
        got,
        [
            Some(pages[0].1.clone()),
            Some(damaged),
            Some(pages[2].1.clone())
        ]
    );
    assert_eq!(store.stats().damaged_pages, 0);
    assert_eq!(store.discard_damaged(&[key(1)]).await.unwrap(), 1);
    let s = store.stats();
    assert_eq!((s.damaged_pages, s.pages), (1, 2));
    assert_eq!(store.get(&[key(1)]).await.unwrap(), [None]);
    // The directory reopened by a store with checksums: the records written without one
    // read as they are (page 2 damaged on disk too comes back damaged), while a page it
    // writes itself carries a checksum and damage to it is a counted miss.
    drop(store);
    let store = FileStore::open(dir.config()).await.unwrap();
    let damaged_2 = flip_on_disk(&store, &key(2), &pages[2].1, 7, 0x01);
    assert_eq!(
        store.get(&[key(0), key(2)]).await.unwrap(),
        [Some(pages[0].1.clone()), Some(damaged_2)]
    );
    let page_3 = pattern(3, 500);
    store.put(&[(key(3), page_3.clone())]).await.unwrap();
    assert_eq!(store.get(&[key(3)]).await.unwrap(), [Some(page_3.clone())]);
    flip_on_disk(&store, &key(3), &page_3, 9, 0x01);
    assert_eq!(store.get(&[key(3)]).await.unwrap(), [None]);
    assert_eq!(store.stats().damaged_pages, 1);
}

/// Pages of up to a few MiB (over 512 KiB written 512 KiB at a time, each chunk checksummed as
/// it goes, the header last; read back the same way) beside small ones: byte-exact before and after a
/// restart, and a byte damaged in a late chunk of a large page is a counted miss.
#[tokio::test]
async fn file_store_large_pages_round_trip_and_damage_is_caught() {
    let dir = TempDir::new("large");
    let lens = [300_001, 17, 524_288, 524_289, 2 << 20, 5, 1_777_777];
    let pages: Vec<(PageKey, Vec<u8>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| (key(i as u64), pattern(i as u64, n)))
        .collect();
    let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
    let expect: Vec<Option<Vec<u8>>> = pages.iter().map(|(_, p)| Some(p.clone())).collect();
    {
        let store = FileStore::open(dir.config()).await.unwrap();
        assert_eq!(store.put(&pages[..3]).await.unwrap(), [true; 3]);
        assert_eq!(store.put(&pages[3..]).await.unwrap(), [true; 4]);
        assert_eq!(store.get(&keys).await.unwrap(), expect);
        // Records follow each other with nothing between them.
        let mut at = RECORD_HEADER_BYTES;
        for (k, p) in &pages {
            let (_, off, len) = store.page_location(k).unwrap();
            assert_eq!((off, len), (at, p.len() as u64));
            at += len + RECORD_HEADER_BYTES;
        }
    }
    let store = FileStore::open(dir.config()).await.unwrap();
    assert_eq!(store.stats().pages, 7);
    assert_eq!(store.get(&keys).await.unwrap(), expect);
    // One byte of the last chunk of the 2 MiB page flipped on disk.
    let (path, off, len) = store.page_location(&key(4)).unwrap();
    let mut bytes = fs::read(&path).unwrap();
    bytes[(off + len) as usize - 3] ^= 0x01;
    fs::write(&path, &bytes).unwrap();
    let mut want = expect.clone();
    want[4] = None;
    assert_eq!(store.get(&keys).await.unwrap(), want);
    assert_eq!(store.stats().damaged_pages, 1);
}

/// Which of `keys` the store holds (without reading them: `exists_prefix` is not a use).
async fn held(store: &FileStore, keys: &[PageKey]) -> Vec<bool> {
    let mut out = Vec::new();
    for k in keys {
        out.push(store.exists_prefix(std::slice::from_ref(k)).await.unwrap() == 1);
    }
    out
}

/// Bytes of the files in `dir` whose names end in `suffix`.
fn bytes_ending(dir: &std::path::Path, suffix: &str) -> u64 {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

#[test]
fn file_store_cap_counts_the_bytes_on_disk_and_deletes_evicted_files() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let dir = TempDir::new("on-disk");
    // Tiny pages, where the record headers are a large share of the disk.
    let (cap, segment) = (3000, 600);
    let store = rt
        .block_on(FileStore::open(
            dir.config().with_cap(cap).with_segment_bytes(segment),
        ))
        .unwrap();
    let backlog = 4 * segment;
    for i in 0..200u64 {
        let len = 20 + (i as usize * 7) % 90;
        let batch: Vec<(PageKey, Vec<u8>)> = (0..1 + i % 3)
            .map(|j| (key(1000 * j + i), pattern(i, len)))
            .collect();
        let n = batch.len();
        assert_eq!(rt.block_on(store.put(&batch)).unwrap(), vec![true; n]);
        if i % 5 == 0 {
            rt.block_on(store.delete(&[key(i - i % 10)])).unwrap();
        }
        // The segments hold at most the cap, headers and tombstones included; evicted files
        // waiting for deletion at most the backlog.
        let segs = bytes_ending(&dir.0, ".seg");
        assert!(segs <= cap, "{segs} bytes of segments after batch {i}");
        assert!(store.removal_backlog_bytes() <= backlog);
        assert!(bytes_ending(&dir.0, ".evicted") <= backlog);
    }
    assert!(store.stats().evicted_pages > 100);
    store.wait_for_removals();
    assert_eq!(store.removal_backlog_bytes(), 0);
    assert_eq!(
        bytes_ending(&dir.0, ".evicted"),
        0,
        "every evicted file deleted"
    );
    // A page that cannot fit beside its header is refused.
    let big = (
        key(9999),
        pattern(9999, (cap - RECORD_HEADER_BYTES) as usize + 1),
    );
    assert_eq!(rt.block_on(store.put(&[big])).unwrap(), [false]);
    drop(store);
    drop(rt);
    // Outside a runtime, the evicting thread deletes what it evicts: a smaller cap at open.
    // (Less than the backlog goes, so only the inline deletion can leave nothing behind.)
    let before = bytes_ending(&dir.0, ".seg");
    assert!(before - cap / 3 < backlog);
    let store =
        FileStore::open_blocking(dir.config().with_cap(cap / 3).with_segment_bytes(segment))
            .unwrap();
    assert!(store.stats().evicted_pages > 0);
    assert_eq!(store.removal_backlog_bytes(), 0);
    assert_eq!(bytes_ending(&dir.0, ".evicted"), 0);
    assert!(bytes_ending(&dir.0, ".seg") <= cap / 3);
}

#[tokio::test]
async fn file_store_evicts_whole_segments_least_recently_used_first() {
    let dir = TempDir::new("evict");
    // Segments of two 300-byte pages (2 × 372 bytes); a cap of eight records.
    let store = FileStore::open(dir.config().with_segment_bytes(800).with_cap(2976))
        .await
        .unwrap();
    let page = |i: u64| (key(i), pattern(i, 300));
    // Four segments: {0, 1}, {2, 3}, {4, 5}, {6, 7}.
    for i in (0..8).step_by(2) {
        assert_eq!(store.put(&[page(i), page(i + 1)]).await.unwrap(), [true; 2]);
    }
    assert_eq!(segments(&dir.0).len(), 4);
    assert_eq!(store.stats().evicted_pages, 0);
    // Read page 1: its segment {0, 1} is now the most recently used.
    store.get(&[key(1)]).await.unwrap();
    // Two more pages: the least recently used segment, {2, 3}, goes, whole.
    store.put(&[page(8), page(9)]).await.unwrap();
    let s = store.stats();
    assert_eq!((s.pages, s.bytes, s.evicted_pages), (8, 2400, 2));
    let keys: Vec<PageKey> = (0..16).map(key).collect();
    let mut want = vec![true; 10];
    want.extend([false; 6]);
    want[2] = false;
    want[3] = false;
    assert_eq!(held(&store, &keys).await, want);
    assert_eq!(segments(&dir.0).len(), 4);
    // Then {4, 5} and {6, 7}.
    store.put(&[page(10), page(11)]).await.unwrap();
    store.put(&[page(12), page(13)]).await.unwrap();
    assert_eq!(store.stats().evicted_pages, 6);
    // Then {0, 1}: page 1, read since it was written, is appended again (a second chance);
    // page 0 goes. Still over the cap, {8, 9} goes too.
    store.put(&[page(14), page(15)]).await.unwrap();
    let s = store.stats();
    assert_eq!((s.pages, s.bytes, s.evicted_pages), (7, 2100, 9));
    let want: Vec<bool> = (0..16).map(|i| i == 1 || i >= 10).collect();
    assert_eq!(held(&store, &keys).await, want);
    assert_eq!(store.get(&[key(1)]).await.unwrap(), [Some(pattern(1, 300))]);
    // The copy lies in a newer segment, and survives a restart.
    drop(store);
    let store = FileStore::open(dir.config().with_segment_bytes(800).with_cap(2976))
        .await
        .unwrap();
    assert_eq!(held(&store, &keys).await, want);
}

#[tokio::test]
async fn file_store_a_delete_outlives_the_eviction_of_its_tombstone() {
    let dir = TempDir::new("tombstone");
    // Room for A, C and D below after C goes, with the tombstone written again (4 × 372 + 72
    // bytes), not for all three.
    let config = dir.config().with_segment_bytes(800).with_cap(1600);
    let page = |i: u64| (key(i), pattern(i, 300));
    {
        let store = FileStore::open(config.clone()).await.unwrap();
        store.put(&[page(1), page(3)]).await.unwrap(); // segment A: 1, 3
        assert_eq!(store.delete(&[key(1)]).await.unwrap(), 1); // segment C: tombstone of 1
        store.put(&[page(6)]).await.unwrap(); // C: tombstone of 1, 6
        store.get(&[key(3)]).await.unwrap(); // A is used after C
        // Segment D: 7, 8. Over the cap: C, the least recently used, goes (with page 6);
        // A, which still holds page 1's old record, stays.
        store.put(&[page(7), page(8)]).await.unwrap();
        let s = store.stats();
        assert_eq!((s.pages, s.evicted_pages), (3, 1));
        assert_eq!(store.get(&[key(1), key(6)]).await.unwrap(), [None, None]);
    }
    // After a restart page 1 is still deleted: its tombstone was written again.
    let store = FileStore::open(config).await.unwrap();
    let got = store
        .get(&[key(1), key(3), key(6), key(7), key(8)])
        .await
        .unwrap();
    let present: Vec<bool> = got.iter().map(Option::is_some).collect();
    assert_eq!(present, [false, true, false, true, true]);
}

#[tokio::test]
async fn file_store_restart_keeps_the_newest_record_of_a_key() {
    let dir = TempDir::new("newest");
    {
        let store = FileStore::open(dir.config().with_segment_bytes(500))
            .await
            .unwrap();
        // Several segments; key 1 written three times, key 2 deleted and written again.
        store
            .put(&[(key(1), pattern(1, 300)), (key(2), pattern(2, 300))])
            .await
            .unwrap();
        store.put(&[(key(1), pattern(10, 200))]).await.unwrap();
        store.delete(&[key(2)]).await.unwrap();
        store
            .put(&[(key(1), pattern(11, 100)), (key(2), pattern(12, 50))])
            .await
            .unwrap();
        assert!(segments(&dir.0).len() > 2);
    }
    let store = FileStore::open(dir.config()).await.unwrap();
    assert_eq!(
        store.get(&[key(1), key(2)]).await.unwrap(),
        [Some(pattern(11, 100)), Some(pattern(12, 50))]
    );
    let s = store.stats();
    assert_eq!((s.pages, s.bytes), (2, 150));
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
