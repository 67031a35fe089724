//! Storage tier throughput: `FileStore` (and `RedisStore`) put and get of stored pages in
//! batches of 1, 32 and 128, against a plain sequential write and read of the same bytes to one
//! file in the same run.
//!
//! The file store is opened as the storage tier opens it, without payload checksums of its own
//! ([`FileStoreConfig::payload_checksums`] off: the tier checks the page format's checksum of
//! every page it loads); the summary also times a second store that writes and checks them
//! (`file+sum`).
//!
//! A page is a 16-token page of a Llama-3-8B-like model (32 layers, 8 KV heads of 128 dims,
//! fp16 K and V: 4 KiB per token per layer), so 2 MiB of KV plus the 136-byte header: the
//! objects the storage tier really moves. Criterion reports payload bytes/s (the encoded
//! pages' bytes). The summary at the end prints median-based ratios to the plain file from
//! interleaved rounds, so both sides see the same load on a shared machine.
//!
//! Each timed write stores new pages on both sides — the pages are deleted from the store, and
//! the plain side writes a new file, untimed before each round — because the tier backs up only
//! the pages a store lacks; puts hand their batch over (`put_owned`), as the tier's backups do.
//! The file store appends them to its segment files and, once at its cap, evicts whole
//! segments within the timed put; a delete does not discard a page's bytes (they stay dead in
//! their segment), so the plain side too keeps its earlier files up to the same cap, and both
//! meet the kernel's write-back of what they keep. Neither side's timing includes deleting
//! files: the plain side removes its oldest files untimed before a write, and the file store
//! deletes the segments it evicted in the background, which the bench waits for
//! ([`FileStore::wait_for_removals`]), untimed, before every timed write on either side (so
//! the deletions never overlap a timed operation). Reads find
//! the files in the page cache on both sides. The files live in the system temporary
//! directory, written without `fsync` on both sides (the file store's default
//! [`FileSync::Never`]). The Redis group runs when
//! the `redis` feature is on and `RADIXKV_REDIS_URL` names a server (it writes under a
//! `radixkv-bench:` prefix and deletes its pages afterwards); otherwise it prints that it
//! skipped.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fs::{self, File};
use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use radixkv_hicache::KvGeometry;
use radixkv_hicache::storage::{FileStore, FileStoreConfig, FileSync, PageFormat, StorageBackend};
use radixkv_radix::{KeySeed, KvIdentity, Namespace, PageKey};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use tokio::runtime::Runtime;

const LAYERS: usize = 32;
const PAGE_SIZE: usize = 16;
/// K and V of 8 heads × 128 dims in fp16.
const BYTES_PER_TOKEN_LAYER: usize = 2 * 8 * 128 * 2;
const BATCHES: [usize; 3] = [1, 32, 128];
const ROUNDS: usize = 11;
/// The file store's cap: the bench writes tens of gigabytes, and a store's deletes only mark
/// pages dead, so the cap (16 segments of 128 MiB) is what bounds the disk it takes. Puts on
/// the full store include evicting its least recently used segments, as they would in service.
/// The plain side keeps as many bytes (see [`Plain`]).
const FILE_CAP_BYTES: u64 = 2 << 30;

/// `n` encoded pages of one key chain, with seeded random KV.
fn pages(n: usize) -> Vec<(PageKey, Vec<u8>)> {
    let id = KvIdentity::new("llama-3-8b-like", "bench");
    let g = KvGeometry::new(LAYERS, PAGE_SIZE, BYTES_PER_TOKEN_LAYER).expect("a valid geometry");
    let format = PageFormat::new(g, &id, &[]).expect("a valid format");
    let seed = KeySeed::new(&Namespace::DEFAULT, &id);
    let tokens: Vec<u32> = (0..(n * PAGE_SIZE) as u32).collect();
    let mut keys = Vec::new();
    seed.extend_chain(None, &tokens, PAGE_SIZE, &mut keys);
    let mut rng = SplitMix64::seed_from_u64(12);
    let mut kv = vec![0u8; format.kv_bytes()];
    keys.into_iter()
        .map(|k| {
            rng.fill_bytes(&mut kv);
            let mut out = Vec::new();
            format.encode(&k, &kv, &[], &mut out).expect("encodes");
            (k, out)
        })
        .collect()
}

/// The plain baseline: the same bytes written to, and read back from, one file. Each write
/// makes a new file, and the files of earlier writes are kept up to the store's cap
/// ([`FILE_CAP_BYTES`]) — the oldest removed, untimed, before a write — so the plain side keeps
/// as much written data on disk as the store does and meets the same write-back of dirty pages.
struct Plain {
    dir: PathBuf,
    bytes: Vec<u8>,
    written: RefCell<VecDeque<PathBuf>>,
    next: Cell<u64>,
}

impl Plain {
    fn new(dir: &Path, pages: &[(PageKey, Vec<u8>)]) -> Self {
        Plain {
            dir: dir.to_owned(),
            bytes: pages
                .iter()
                .map(|(_, b)| b.as_slice())
                .collect::<Vec<_>>()
                .concat(),
            written: RefCell::new(VecDeque::new()),
            next: Cell::new(0),
        }
    }

    /// Removes the oldest files until the next write keeps at most the cap on disk.
    fn remove(&self) {
        let mut written = self.written.borrow_mut();
        let len = self.bytes.len() as u64;
        while (written.len() as u64 + 1) * len > FILE_CAP_BYTES {
            let Some(old) = written.pop_front() else {
                break;
            };
            let _ = fs::remove_file(old);
        }
    }

    fn write(&self) {
        let n = self.next.get();
        self.next.set(n + 1);
        let path = self.dir.join(format!("plain.{n}"));
        let mut f = File::create(&path).expect("creates the plain file");
        f.write_all(black_box(&self.bytes))
            .expect("writes the plain file");
        self.written.borrow_mut().push_back(path);
    }

    /// Writes a file if none is written yet (so a read bench can run on its own).
    fn ensure_written(&self) {
        if self.written.borrow().is_empty() {
            self.write();
        }
    }

    /// Reads the file written last.
    fn read(&self) {
        let path = self
            .written
            .borrow()
            .back()
            .cloned()
            .expect("a plain file written");
        black_box(fs::read(path).expect("reads the plain file"));
    }
}

/// A fresh directory for one batch size (removed when dropped).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "radixkv-bench-storage-{name}-{}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("creates the bench directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Makes room for a round of puts: the pages of `keys` are deleted (the tier writes only pages
/// a store lacks, so every timed put writes new files), and a copy of the batch to hand over.
fn fresh(
    rt: &Runtime,
    store: &dyn StorageBackend,
    pages: &[(PageKey, Vec<u8>)],
) -> Vec<(PageKey, Vec<u8>)> {
    let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
    rt.block_on(store.delete(&keys)).expect("deletes");
    pages.to_vec()
}

/// Puts a batch the way the tier does (handing it over).
fn put(rt: &Runtime, store: &dyn StorageBackend, pages: Vec<(PageKey, Vec<u8>)>) {
    let stored = rt.block_on(store.put_owned(pages)).expect("puts");
    assert!(stored.iter().all(|&s| s), "every page stored");
}

fn get(rt: &Runtime, store: &dyn StorageBackend, keys: &[PageKey]) {
    let got = rt.block_on(store.get(keys)).expect("gets");
    assert!(got.iter().all(Option::is_some), "every page found");
    black_box(got);
}

/// Stores `pages` if the store lacks any of them (so a get bench can run on its own).
fn ensure_stored(rt: &Runtime, store: &dyn StorageBackend, pages: &[(PageKey, Vec<u8>)]) {
    let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
    if rt.block_on(store.exists_prefix(&keys)).expect("looks up") < keys.len() {
        put(rt, store, fresh(rt, store, pages));
    }
}

fn bytes_of(pages: &[(PageKey, Vec<u8>)]) -> u64 {
    pages.iter().map(|(_, b)| b.len() as u64).sum()
}

/// Times `a` and `b` alternately, `ROUNDS` times each, each after its untimed `prep`:
/// (median of `a`, median of `b`).
fn paired_medians<A, B>(
    mut prep_a: impl FnMut() -> A,
    mut a: impl FnMut(A),
    mut prep_b: impl FnMut() -> B,
    mut b: impl FnMut(B),
) -> (Duration, Duration) {
    let (mut ta, mut tb) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        let x = prep_a();
        let t = Instant::now();
        a(x);
        ta.push(t.elapsed());
        let y = prep_b();
        let t = Instant::now();
        b(y);
        tb.push(t.elapsed());
    }
    ta.sort();
    tb.sort();
    (ta[ROUNDS / 2], tb[ROUNDS / 2])
}

fn ratio_line(store: &str, op: &str, batch: usize, bytes: u64, (s, p): (Duration, Duration)) {
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "  {store:8} {op:3} batch {batch:3}: {:6.2} GB/s  plain file {:6.2} GB/s  ratio {:.2}",
        gbps(s),
        gbps(p),
        p.as_secs_f64() / s.as_secs_f64()
    );
}

/// The criterion group `name`: plain write, `put`, plain read and `get` of each batch size.
/// `settle` waits for the store's background work (the file store's deletion of evicted
/// segments, which a put or the deletes that make room for one may start), untimed before
/// every timed write on either side.
fn group(
    c: &mut Criterion,
    name: &str,
    rt: &Runtime,
    store: &dyn StorageBackend,
    settle: &dyn Fn(),
    all: &[(PageKey, Vec<u8>)],
) {
    let mut g = c.benchmark_group(name);
    for batch in BATCHES {
        let pages = &all[..batch];
        let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
        let dir = TempDir::new(&format!("{name}-{batch}"));
        let plain = Plain::new(&dir.0, pages);
        // A batch of 128 pages is 256 MiB: criterion's minimum of 10 samples is plenty.
        g.sample_size(if batch >= 32 { 10 } else { 30 });
        g.throughput(Throughput::Bytes(bytes_of(pages)));
        g.bench_function(BenchmarkId::new("plain_write", batch), |b| {
            b.iter_batched(
                || {
                    settle();
                    plain.remove()
                },
                |()| plain.write(),
                BatchSize::PerIteration,
            )
        });
        g.bench_function(BenchmarkId::new("put", batch), |b| {
            b.iter_batched(
                || {
                    let batch = fresh(rt, store, pages);
                    settle();
                    batch
                },
                |batch| put(rt, store, batch),
                BatchSize::PerIteration,
            )
        });
        g.bench_function(BenchmarkId::new("plain_read", batch), |b| {
            plain.ensure_written();
            b.iter(|| plain.read())
        });
        g.bench_function(BenchmarkId::new("get", batch), |b| {
            ensure_stored(rt, store, pages);
            b.iter(|| get(rt, store, &keys))
        });
    }
    g.finish();
}

/// Prints each batch size's put and get throughput beside the plain file's, from interleaved
/// rounds (`settle` as in [`group`]).
fn summary(
    label: &str,
    rt: &Runtime,
    store: &dyn StorageBackend,
    settle: &dyn Fn(),
    all: &[(PageKey, Vec<u8>)],
) {
    for batch in BATCHES {
        let pages = &all[..batch];
        let keys: Vec<PageKey> = pages.iter().map(|(k, _)| *k).collect();
        let dir = TempDir::new(&format!("summary-{label}-{batch}"));
        let plain = Plain::new(&dir.0, pages);
        let bytes = bytes_of(pages);
        let w = paired_medians(
            || {
                let batch = fresh(rt, store, pages);
                settle();
                batch
            },
            |batch| put(rt, store, batch),
            || {
                settle();
                plain.remove()
            },
            |()| plain.write(),
        );
        ratio_line(label, "put", batch, bytes, w);
        let r = paired_medians(|| (), |()| get(rt, store, &keys), || (), |()| plain.read());
        ratio_line(label, "get", batch, bytes, r);
    }
}

/// The Redis store of `RADIXKV_REDIS_URL`, or why there is none.
#[cfg(feature = "redis")]
fn redis_store(rt: &Runtime) -> Result<Box<dyn StorageBackend>, &'static str> {
    use radixkv_hicache::storage::{RedisConfig, RedisStore};
    let url = std::env::var("RADIXKV_REDIS_URL").map_err(|_| "RADIXKV_REDIS_URL is not set")?;
    let config = RedisConfig::new(url)
        .with_key_prefix(format!("radixkv-bench:{}:", std::process::id()))
        .with_op_timeout(Duration::from_secs(60));
    Ok(Box::new(
        rt.block_on(RedisStore::connect(config))
            .expect("connects to RADIXKV_REDIS_URL"),
    ))
}

#[cfg(not(feature = "redis"))]
fn redis_store(_: &Runtime) -> Result<Box<dyn StorageBackend>, &'static str> {
    Err("built without the `redis` feature")
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let all = pages(BATCHES[BATCHES.len() - 1]);
    let keys: Vec<PageKey> = all.iter().map(|(k, _)| *k).collect();
    let open = |dir: &TempDir, payload_checksums: bool| {
        rt.block_on(FileStore::open(
            FileStoreConfig::new(&dir.0)
                .with_sync(FileSync::Never)
                .with_cap(FILE_CAP_BYTES)
                .with_payload_checksums(payload_checksums),
        ))
        .expect("opens the file store")
    };
    // As the storage tier opens it: the tier checks every page it loads against the page
    // format's checksum, so the store writes and checks none of its own.
    let dir = TempDir::new("store");
    let file = open(&dir, false);
    // The same with the store's own payload checksums, in the summary only.
    let summed_dir = TempDir::new("store-summed");
    let summed = open(&summed_dir, true);
    let settle_summed = || summed.wait_for_removals();
    let settle_file = || file.wait_for_removals();
    group(&mut c, "storage_file", &rt, &file, &settle_file, &all);
    let redis = redis_store(&rt);
    match &redis {
        Ok(store) => group(&mut c, "storage_redis", &rt, store.as_ref(), &|| (), &all),
        Err(why) => println!("storage_redis: skipped ({why})"),
    }

    println!(
        "\nstore throughput vs a plain sequential file of the same bytes \
         ({} KiB pages, medians of {ROUNDS} interleaved rounds):",
        all[0].1.len() >> 10
    );
    summary("file", &rt, &file, &settle_file, &all);
    summary("file+sum", &rt, &summed, &settle_summed, &all);
    if let Ok(store) = &redis {
        summary("redis", &rt, store.as_ref(), &|| (), &all);
        rt.block_on(store.delete(&keys))
            .expect("deletes the bench pages");
    }
    c.final_summary();
}
