//! [`FileStore`]: the default store, a directory of page files.
//!
//! # Layout
//! A page stored under key `k` is the file `<dir>/<first two hex digits of k>/<k in hex>` (64
//! lower-case hex digits), holding exactly the bytes given to `put`. The 256 fan-out
//! directories keep every directory listable when the store holds hundreds of thousands of
//! pages. Files in flight are named `.tmp.*` in the same fan-out directory; anything else in
//! the tree is ignored (never counted, never deleted).
//!
//! # Writes, crashes and durability
//! A page is written to a fresh temporary file beside its final name and then renamed over
//! it. A rename is atomic, so a reader sees the old page, the new page or no page, and a
//! process that dies mid-write leaves only a temporary file, which the next
//! [`FileStore::open`] removes. How much reaches the disk before a power loss is the
//! [`FileSync`] policy; the default, [`FileSync::Never`], does not call `fsync`: a power loss
//! may then leave a renamed page short or empty, and the stored page's checksum (see
//! [`super::PageFormat`]) turns that into a miss, never into wrong KV.
//!
//! # Size cap and eviction
//! With a cap, the store keeps an in-memory index of its pages (size and last use) and, after
//! each write, deletes the least recently used pages until it is under the cap again (a page
//! larger than the cap is refused). The index is rebuilt at open by scanning the directory,
//! oldest file (by modification time) first, so a restarted store finds its pages, their byte
//! count and a sensible eviction order; a store opened with a smaller cap than the directory
//! holds evicts down to it at open.
//!
//! # Sharing a directory
//! Several stores (processes, servers) may share one directory: every page appears by rename,
//! so none ever reads a half-written page. Each store indexes the pages it opened with, wrote
//! or read, and enforces its cap over those; a page another store deleted is a miss (and
//! leaves this store's index once seen missing), and a page another store wrote is found by
//! `get` and `exists_prefix`. A store alone in its directory keeps its index exactly in step
//! with the files, whatever its batches race (renames, deletes and evictions run under the
//! index's lock). A store opening the directory removes temporary files, including one
//! another store is writing at that instant: that page is then reported as not stored.
//!
//! # Threads
//! Every operation is one blocking job on tokio's blocking pool
//! ([`tokio::task::spawn_blocking`]) per batch, so the thread polling the future never waits
//! for the disk. The store therefore needs a tokio runtime; polled outside one, an operation
//! fails with [`StoreError::Config`]. A future dropped before it completes (a deadline above)
//! lets its job finish in the background; the job keeps the index right either way.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use radixkv_radix::PageKey;

use super::backend::{Counters, StorageBackend, StoreError, StoreFuture, StoreStats};

/// How much of a write reaches the disk before [`FileStore::put`] reports it stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum FileSync {
    /// No `fsync`: a crashed process never leaves a half page under a key (rename is atomic),
    /// but after a power loss a page may read back short or empty, which the page checksum
    /// turns into a miss. The fastest; right for a cache.
    #[default]
    Never,
    /// Each page's data is synced before its rename: after a power loss a page under a key
    /// is whole, though the rename itself may be lost (the page is then simply absent).
    Pages,
    /// As `Pages`, and each fan-out directory a batch renamed into (and the store's
    /// directory) is synced after the batch: a page reported stored survives a power loss.
    PagesAndDirs,
}

/// Where a [`FileStore`] keeps its pages and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileStoreConfig {
    /// The store's directory, created (with its parents) if missing.
    pub dir: PathBuf,
    /// Most bytes of pages the store keeps (`None`: no cap). Must not be 0.
    pub cap_bytes: Option<u64>,
    /// The durability policy.
    pub sync: FileSync,
}

impl FileStoreConfig {
    /// A store in `dir` without a cap and with the default [`FileSync`].
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileStoreConfig {
            dir: dir.into(),
            cap_bytes: None,
            sync: FileSync::default(),
        }
    }

    /// The same with a cap of `cap_bytes` bytes.
    pub fn with_cap(mut self, cap_bytes: u64) -> Self {
        self.cap_bytes = Some(cap_bytes);
        self
    }

    /// The same with durability policy `sync`.
    pub fn with_sync(mut self, sync: FileSync) -> Self {
        self.sync = sync;
        self
    }
}

/// The prefix of temporary files' names.
const TEMP_PREFIX: &str = ".tmp.";

/// Numbers temporary files within this process (several stores may share it).
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy, Debug)]
struct Entry {
    len: u64,
    used: u64,
}

/// The pages this store knows of, in least-recently-used order.
#[derive(Debug, Default)]
struct Index {
    pages: HashMap<PageKey, Entry>,
    /// Last use → key: the least recently used page first.
    order: BTreeMap<u64, PageKey>,
    bytes: u64,
    clock: u64,
}

impl Index {
    /// Records `key` (of `len` bytes) as just used.
    fn touch(&mut self, key: PageKey, len: u64) {
        self.forget(&key);
        self.clock += 1;
        self.pages.insert(
            key,
            Entry {
                len,
                used: self.clock,
            },
        );
        self.order.insert(self.clock, key);
        self.bytes += len;
    }

    /// Drops `key` from the index; whether it was there.
    fn forget(&mut self, key: &PageKey) -> bool {
        match self.pages.remove(key) {
            Some(e) => {
                self.order.remove(&e.used);
                self.bytes -= e.len;
                true
            }
            None => false,
        }
    }

    /// Drops the least recently used pages until the index holds at most `cap` bytes; the
    /// keys dropped, whose files the caller deletes.
    fn over_cap(&mut self, cap: Option<u64>) -> Vec<PageKey> {
        let mut victims = Vec::new();
        let Some(cap) = cap else {
            return victims;
        };
        while self.bytes > cap {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.pages.remove(&key) {
                self.bytes -= e.len;
            }
            victims.push(key);
        }
        victims
    }
}

#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    cap_bytes: Option<u64>,
    sync: FileSync,
    index: Mutex<Index>,
    counters: Counters,
}

/// A store of page files in a directory, with atomic writes, an optional size cap with
/// least-recently-used eviction, and an index rebuilt at open (see the module docs for the
/// layout, the crash and durability guarantees and sharing a directory).
///
/// ```
/// # use radixkv_hicache::storage::{FileStore, FileStoreConfig, StorageBackend};
/// # use radixkv_radix::PageKey;
/// # let dir = std::env::temp_dir().join(format!("radixkv-doc-{}", std::process::id()));
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = FileStore::open(FileStoreConfig::new(&dir).with_cap(1 << 30)).await?;
/// let key = PageKey([7; 32]);
/// assert_eq!(store.put(&[(key, b"a page".to_vec())]).await?, [true]);
/// assert_eq!(store.exists_prefix(&[key, PageKey([8; 32])]).await?, 1);
/// assert_eq!(store.get(&[key]).await?, [Some(b"a page".to_vec())]);
/// # Ok::<(), radixkv_hicache::storage::StoreError>(())
/// # }).unwrap();
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug)]
pub struct FileStore {
    shared: Arc<Shared>,
}

fn io_err(what: &str, path: &Path, e: io::Error) -> StoreError {
    StoreError::Io(format!("{what} {}: {e}", path.display()))
}

fn is_fanout(name: &str) -> bool {
    name.len() == 2
        && name
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// Runs `f` on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let handle = tokio::runtime::Handle::try_current().map_err(|_| {
        StoreError::Config("the file store runs its I/O on a tokio runtime; none is current".into())
    })?;
    handle
        .spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Unavailable(format!("file store I/O job: {e}")))?
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Index> {
        // Every update of the index finishes before anything that could panic runs.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn page_path(&self, key: &PageKey) -> PathBuf {
        let hex = key.to_hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// Deletes the files of evicted pages (called with the index locked, so no other batch of
    /// this store rewrites a victim in between). A file already gone is fine (another store
    /// deleted it); a failure to delete leaves an unindexed file the next open counts again.
    fn remove_victims(&self, victims: &[PageKey]) {
        for key in victims {
            let path = self.page_path(key);
            match fs::remove_file(&path) {
                Ok(()) => Counters::add(&self.counters.evicted_pages, 1),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "file store: cannot evict a page");
                }
            }
        }
    }

    /// Opens a fresh temporary file in `sub` for `key`, creating `sub` when missing.
    fn temp_file(&self, sub: &Path, hex: &str) -> Result<(PathBuf, File), StoreError> {
        let pid = std::process::id();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        for _ in 0..16 {
            let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
            let path = sub.join(format!("{TEMP_PREFIX}{hex}.{pid}.{nanos}.{seq}"));
            match File::create_new(&path) {
                Ok(f) => return Ok((path, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir_all(sub).map_err(|e| io_err("cannot create", sub, e))?;
                }
                Err(e) => return Err(io_err("cannot create a file in", sub, e)),
            }
        }
        Err(StoreError::Io(format!(
            "no free temporary file name in {}",
            sub.display()
        )))
    }

    /// Writes `bytes` to a fresh temporary file beside `key`'s file; its path.
    fn write_temp(&self, key: &PageKey, bytes: &[u8]) -> Result<PathBuf, StoreError> {
        let hex = key.to_hex();
        let sub = self.dir.join(&hex[..2]);
        let (tmp, mut file) = self.temp_file(&sub, &hex)?;
        let written = file.write_all(bytes).and_then(|()| {
            if self.sync == FileSync::Never {
                Ok(())
            } else {
                file.sync_data()
            }
        });
        drop(file);
        match written {
            Ok(()) => Ok(tmp),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(io_err("cannot write", &tmp, e))
            }
        }
    }

    // Index discipline: every change to a page file by this store (rename into place, delete,
    // eviction) and the index update that goes with it happen under the index lock, and a
    // read joins the index only if its file is still there under the lock. So the index of a
    // store that does not share its directory always matches the directory; the expensive
    // part (reading and writing page bytes) runs outside the lock.

    fn exists_prefix(&self, keys: &[PageKey]) -> Result<usize, StoreError> {
        for (i, key) in keys.iter().enumerate() {
            let path = self.page_path(key);
            match fs::metadata(&path) {
                Ok(m) if m.is_file() => {}
                Ok(_) => return Ok(i),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    // Gone (deleted by another store)? Check again under the lock: a put of
                    // this store may have renamed it into place since.
                    let mut index = self.lock();
                    if fs::metadata(&path).is_err() {
                        index.forget(key);
                    }
                    return Ok(i);
                }
                Err(e) => return Err(io_err("cannot stat", &path, e)),
            }
        }
        Ok(keys.len())
    }

    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let path = self.page_path(key);
            match fs::read(&path) {
                Ok(b) => out.push(Some(b)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => out.push(None),
                Err(e) => return Err(io_err("cannot read", &path, e)),
            }
        }
        {
            let mut index = self.lock();
            for (key, page) in keys.iter().zip(&out) {
                // What is on disk now, not what was read: a delete or a rewrite may have come
                // in between.
                match fs::metadata(self.page_path(key)) {
                    Ok(m) if m.is_file() && page.is_some() => index.touch(*key, m.len()),
                    Ok(m) if m.is_file() => {
                        // Written since our read missed it: know it, without a use.
                        if !index.pages.contains_key(key) {
                            index.touch(*key, m.len());
                        }
                    }
                    _ => {
                        index.forget(key);
                    }
                }
            }
            // A page another store wrote joins the index and may take it over the cap.
            let victims = index.over_cap(self.cap_bytes);
            self.remove_victims(&victims);
        }
        let hits = out.iter().filter(|p| p.is_some()).count();
        Counters::add(&self.counters.get_pages, keys.len() as u64);
        Counters::add(&self.counters.get_hits, hits as u64);
        Ok(out)
    }

    fn put(&self, pages: &[(PageKey, Vec<u8>)]) -> Result<Vec<bool>, StoreError> {
        let mut out = Vec::with_capacity(pages.len());
        let mut dirs: Vec<PathBuf> = Vec::new();
        for (key, bytes) in pages {
            let len = bytes.len() as u64;
            if self.cap_bytes.is_some_and(|cap| len > cap) {
                out.push(false);
                continue;
            }
            let tmp = self.write_temp(key, bytes)?;
            let path = self.page_path(key);
            {
                let mut index = self.lock();
                match fs::rename(&tmp, &path) {
                    Ok(()) => {}
                    // Another store opening the directory removed the temporary file.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        out.push(false);
                        continue;
                    }
                    Err(e) => {
                        drop(index);
                        let _ = fs::remove_file(&tmp);
                        return Err(io_err("cannot rename into", &path, e));
                    }
                }
                index.touch(*key, len);
                let victims = index.over_cap(self.cap_bytes);
                self.remove_victims(&victims);
            }
            out.push(true);
            Counters::add(&self.counters.put_pages, 1);
            Counters::add(&self.counters.put_bytes, len);
            if self.sync == FileSync::PagesAndDirs
                && let Some(sub) = path.parent().filter(|s| !dirs.iter().any(|d| d == s))
            {
                dirs.push(sub.to_owned());
            }
        }
        if !dirs.is_empty() {
            // The root too: a batch may have created a fan-out directory.
            dirs.push(self.dir.clone());
        }
        for dir in dirs {
            File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io_err("cannot sync", &dir, e))?;
        }
        Ok(out)
    }

    fn delete(&self, keys: &[PageKey]) -> Result<usize, StoreError> {
        let mut removed = 0;
        let mut index = self.lock();
        for key in keys {
            let path = self.page_path(key);
            match fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("cannot delete", &path, e)),
            }
            index.forget(key);
        }
        Ok(removed)
    }
}

impl FileStore {
    /// Opens (creating if needed) the store of `config` on tokio's blocking pool: removes
    /// leftover temporary files, indexes the pages present and evicts down to the cap.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a cap of 0, a path that is not a directory or cannot be
    /// created, or no current tokio runtime; [`StoreError::Io`] when the directory cannot be
    /// scanned.
    pub async fn open(config: FileStoreConfig) -> Result<FileStore, StoreError> {
        blocking(move || FileStore::open_blocking(config)).await
    }

    /// [`FileStore::open`] on the calling thread (for setups before a runtime runs; do not
    /// call it on a tokio worker thread: the scan of a large store takes a while).
    ///
    /// # Errors
    /// As [`FileStore::open`], without the runtime requirement.
    pub fn open_blocking(config: FileStoreConfig) -> Result<FileStore, StoreError> {
        let FileStoreConfig {
            dir,
            cap_bytes,
            sync,
        } = config;
        if cap_bytes == Some(0) {
            return Err(StoreError::Config(
                "a file store's cap must be at least one byte".into(),
            ));
        }
        match fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(StoreError::Config(format!(
                    "file store path {} is not a directory",
                    dir.display()
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(&dir).map_err(|e| {
                    StoreError::Config(format!(
                        "cannot create the file store directory {}: {e}",
                        dir.display()
                    ))
                })?;
            }
            Err(e) => {
                return Err(StoreError::Config(format!(
                    "file store path {}: {e}",
                    dir.display()
                )));
            }
        }
        let mut found = scan(&dir)?;
        // The oldest page first; the key breaks ties so the order is deterministic.
        found.sort_unstable_by_key(|&(mtime, key, _)| (mtime, key));
        let mut index = Index::default();
        for (_, key, len) in found {
            index.touch(key, len);
        }
        let victims = index.over_cap(cap_bytes);
        let shared = Shared {
            dir,
            cap_bytes,
            sync,
            index: Mutex::new(index),
            counters: Counters::default(),
        };
        shared.remove_victims(&victims);
        Ok(FileStore {
            shared: Arc::new(shared),
        })
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The cap in bytes, if any.
    pub fn cap_bytes(&self) -> Option<u64> {
        self.shared.cap_bytes
    }

    /// The file a page stored under `key` lives in (whether or not it is stored).
    pub fn page_path(&self, key: &PageKey) -> PathBuf {
        self.shared.page_path(key)
    }

    /// Runs `op` over the shared state on the blocking pool, counting a failure.
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Shared) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let shared = Arc::clone(&self.shared);
        let r = blocking(move || op(&shared)).await;
        if r.is_err() {
            Counters::add(&self.shared.counters.errors, 1);
        }
        r
    }
}

/// Removes temporary files and lists the pages of the store in `dir`: (modified, key, bytes).
fn scan(dir: &Path) -> Result<Vec<(SystemTime, PageKey, u64)>, StoreError> {
    let mut found = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| io_err("cannot list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err("cannot list", dir, e))?;
        let name = entry.file_name();
        let Some(prefix) = name.to_str().filter(|n| is_fanout(n)) else {
            continue;
        };
        let sub = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let pages = fs::read_dir(&sub).map_err(|e| io_err("cannot list", &sub, e))?;
        for page in pages {
            let page = page.map_err(|e| io_err("cannot list", &sub, e))?;
            let name = page.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            if name.starts_with(TEMP_PREFIX) {
                match fs::remove_file(page.path()) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err("cannot remove", &page.path(), e)),
                }
                continue;
            }
            let Some(key) = PageKey::from_hex(name).filter(|_| name.starts_with(prefix)) else {
                continue;
            };
            let meta = match page.metadata() {
                Ok(m) => m,
                // Deleted by another store since the listing.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("cannot stat", &page.path(), e)),
            };
            if !meta.is_file() {
                continue;
            }
            let mtime = meta.modified().unwrap_or(UNIX_EPOCH);
            found.push((mtime, key, meta.len()));
        }
    }
    Ok(found)
}

impl StorageBackend for FileStore {
    fn name(&self) -> &'static str {
        "file"
    }

    // The blocking job must own its input, so each borrowed batch is copied — in the future,
    // on the thread that polls it, not in the caller that makes it.

    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let keys = keys.to_vec();
            self.run(move |s| s.exists_prefix(&keys)).await
        })
    }

    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>> {
        Box::pin(async move {
            let keys = keys.to_vec();
            self.run(move |s| s.get(&keys)).await
        })
    }

    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let pages = pages.to_vec();
            self.run(move |s| s.put(&pages)).await
        })
    }

    // A page is megabytes: copying a batch costs about as much as writing it to the page
    // cache, so the tier hands its batches over.
    fn put_owned(&self, pages: Vec<(PageKey, Vec<u8>)>) -> StoreFuture<'_, Vec<bool>> {
        Box::pin(async move { self.run(move |s| s.put(&pages)).await })
    }

    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let keys = keys.to_vec();
            self.run(move |s| s.delete(&keys)).await
        })
    }

    fn discard_damaged<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let n = self.delete(keys).await?;
            Counters::add(&self.shared.counters.damaged_pages, n as u64);
            Ok(n)
        })
    }

    fn stats(&self) -> StoreStats {
        let index = self.shared.lock();
        self.shared
            .counters
            .snapshot(index.pages.len() as u64, index.bytes)
    }
}
