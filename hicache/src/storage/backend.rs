//! The [`StorageBackend`] trait every store implements, its errors and counters, and
//! [`MemStore`], the in-process store tests and single-process setups use.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use radixkv_radix::PageKey;

/// The future a [`StorageBackend`] method returns.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Why a store operation failed. Every failure is a miss (or a page not backed up) for the
/// cache above: the caller recomputes, never waits forever and never reads wrong KV.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached, or refused the request (connection refused or lost, disk
    /// gone, server shutting down).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// An I/O error on an operation the store accepted.
    #[error("store I/O error: {0}")]
    Io(String),
    /// The operation took longer than its deadline.
    #[error("store operation timed out")]
    Timeout,
    /// The store answered something that is not an answer to the request.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The store was set up wrongly (a bad address, directory or size).
    #[error("store misconfigured: {0}")]
    Config(String),
}

/// Counters every store keeps (monotonic since the store was made, except the two sizes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Pages stored now (where the store can tell; a shared store may count only its own).
    pub pages: u64,
    /// Bytes stored now (same caveat).
    pub bytes: u64,
    /// Pages asked for by `get`.
    pub get_pages: u64,
    /// Of those, pages found.
    pub get_hits: u64,
    /// Pages written by `put`.
    pub put_pages: u64,
    /// Bytes written by `put`.
    pub put_bytes: u64,
    /// Pages the store dropped to stay within its size cap.
    pub evicted_pages: u64,
    /// Pages removed because a reader found them damaged
    /// ([`StorageBackend::discard_damaged`]).
    pub damaged_pages: u64,
    /// Operations that failed.
    pub errors: u64,
}

/// A key-value store of encoded pages (see [`super::PageFormat`]): the storage tier's L3.
///
/// Stores are dumb: they keep whole encoded pages under their [`PageKey`] and know nothing of
/// trees, layouts or checksums — the storage tier above encodes pages from the host pool and
/// checks every page it reads back. Every method is a batch; a store should serve a batch in
/// as few round trips as it can (one pipeline, one directory scan). Methods take borrowed
/// batches and return boxed futures so the trait is object-safe (`Arc<dyn StorageBackend>`)
/// and runs on any tokio runtime; a store must never block the thread that polls it (wrap
/// blocking I/O in `spawn_blocking`).
pub trait StorageBackend: Send + Sync + 'static {
    /// A short name for logs and reports (`"file"`, `"redis"`, `"memory"`).
    fn name(&self) -> &'static str;

    /// How many of `keys`, from the first, the store holds: the longest stored prefix of a
    /// chain. A store that holds a later key but not an earlier one stops at the gap.
    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize>;

    /// The stored bytes of each key (`None` for a key the store lacks), in `keys`' order.
    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>>;

    /// Stores each page under its key, replacing any page stored there. Returns, per page in
    /// order, whether it is stored now (a store may refuse a page, e.g. one larger than its
    /// cap, without failing the batch).
    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>>;

    /// [`StorageBackend::put`] of a batch the caller hands over. A store whose I/O runs on
    /// other threads (such as [`super::FileStore`], on tokio's blocking pool) writes the
    /// caller's buffers there instead of copying the batch; the default borrows it and calls
    /// `put`. The storage tier's backups put this way.
    fn put_owned(&self, pages: Vec<(PageKey, Vec<u8>)>) -> StoreFuture<'_, Vec<bool>> {
        Box::pin(async move { self.put(&pages).await })
    }

    /// Removes `keys`; returns how many were stored.
    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize>;

    /// Removes `keys`, pages a reader found damaged (see [`super::PageError::is_damage`]), so
    /// that a damaged page is one miss rather than a miss on every later lookup; returns how
    /// many were stored. The stores of this crate count them in
    /// [`StoreStats::damaged_pages`]; the default deletes them without counting. A page
    /// rewritten whole between the read and this call is removed too (a lost page, never
    /// wrong KV).
    fn discard_damaged<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        self.delete(keys)
    }

    /// The store's counters.
    fn stats(&self) -> StoreStats;
}

/// Counters shared by the stores of this crate.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub get_pages: AtomicU64,
    pub get_hits: AtomicU64,
    pub put_pages: AtomicU64,
    pub put_bytes: AtomicU64,
    pub evicted_pages: AtomicU64,
    pub damaged_pages: AtomicU64,
    pub errors: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// The counters, with the store's current sizes.
    pub(crate) fn snapshot(&self, pages: u64, bytes: u64) -> StoreStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            pages,
            bytes,
            get_pages: r(&self.get_pages),
            get_hits: r(&self.get_hits),
            put_pages: r(&self.put_pages),
            put_bytes: r(&self.put_bytes),
            evicted_pages: r(&self.evicted_pages),
            damaged_pages: r(&self.damaged_pages),
            errors: r(&self.errors),
        }
    }
}

#[derive(Debug, Default)]
struct MemInner {
    /// Key → (bytes, last use).
    pages: HashMap<PageKey, (Vec<u8>, u64)>,
    /// Last use → key: the least recently used page first.
    order: BTreeMap<u64, PageKey>,
    bytes: u64,
    clock: u64,
}

impl MemInner {
    fn touch(&mut self, key: &PageKey) {
        self.clock += 1;
        let now = self.clock;
        if let Some((_, used)) = self.pages.get_mut(key) {
            self.order.remove(used);
            *used = now;
            self.order.insert(now, *key);
        }
    }

    fn remove(&mut self, key: &PageKey) -> bool {
        match self.pages.remove(key) {
            Some((b, used)) => {
                self.order.remove(&used);
                self.bytes -= b.len() as u64;
                true
            }
            None => false,
        }
    }
}

/// An in-process store: a map of pages with an optional byte cap, evicting the least recently
/// used pages to stay under it. Shared by cloning an `Arc` of it; gone with the process.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<MemInner>,
    cap_bytes: Option<u64>,
    counters: Counters,
}

impl MemStore {
    /// A store without a size cap.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that keeps at most `cap_bytes` bytes of pages (a page larger than the cap is
    /// refused).
    pub fn with_cap(cap_bytes: u64) -> Self {
        MemStore {
            cap_bytes: Some(cap_bytes),
            ..Self::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        // A panic while holding the lock cannot leave the map half-updated in a way that
        // matters to a cache (every method finishes its update before it can panic).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl StorageBackend for MemStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let inner = self.lock();
            Ok(keys
                .iter()
                .take_while(|k| inner.pages.contains_key(k))
                .count())
        })
    }

    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>> {
        Box::pin(async move {
            let mut inner = self.lock();
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                let v = inner.pages.get(k).map(|(b, _)| b.clone());
                if v.is_some() {
                    inner.touch(k);
                }
                out.push(v);
            }
            let hits = out.iter().filter(|v| v.is_some()).count();
            Counters::add(&self.counters.get_pages, keys.len() as u64);
            Counters::add(&self.counters.get_hits, hits as u64);
            Ok(out)
        })
    }

    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let mut inner = self.lock();
            let mut out = Vec::with_capacity(pages.len());
            for (k, b) in pages {
                let len = b.len() as u64;
                if self.cap_bytes.is_some_and(|cap| len > cap) {
                    out.push(false);
                    continue;
                }
                inner.remove(k);
                if let Some(cap) = self.cap_bytes {
                    while inner.bytes + len > cap {
                        let Some((_, victim)) = inner.order.pop_first() else {
                            break;
                        };
                        if let Some((vb, _)) = inner.pages.remove(&victim) {
                            inner.bytes -= vb.len() as u64;
                            Counters::add(&self.counters.evicted_pages, 1);
                        }
                    }
                }
                inner.clock += 1;
                let now = inner.clock;
                inner.pages.insert(*k, (b.clone(), now));
                inner.order.insert(now, *k);
                inner.bytes += len;
                Counters::add(&self.counters.put_pages, 1);
                Counters::add(&self.counters.put_bytes, len);
                out.push(true);
            }
            Ok(out)
        })
    }

    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let mut inner = self.lock();
            Ok(keys.iter().filter(|k| inner.remove(k)).count())
        })
    }

    fn discard_damaged<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let n = self.delete(keys).await?;
            Counters::add(&self.counters.damaged_pages, n as u64);
            Ok(n)
        })
    }

    fn stats(&self) -> StoreStats {
        let inner = self.lock();
        self.counters
            .snapshot(inner.pages.len() as u64, inner.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    fn run<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn mem_store_batches_prefixes_and_lru_cap() {
        run(async {
            let s = MemStore::with_cap(30);
            let put = s
                .put(&[
                    (key(1), vec![1; 10]),
                    (key(2), vec![2; 10]),
                    (key(9), vec![0; 31]),
                ])
                .await
                .unwrap();
            assert_eq!(put, [true, true, false], "a page over the cap is refused");
            assert_eq!(s.exists_prefix(&[key(1), key(2), key(3)]).await.unwrap(), 2);
            assert_eq!(s.exists_prefix(&[key(3), key(1)]).await.unwrap(), 0);
            // Touch 1, then overflow: 2 is the least recently used and goes.
            assert_eq!(s.get(&[key(1)]).await.unwrap(), [Some(vec![1; 10])]);
            s.put(&[(key(3), vec![3; 10]), (key(4), vec![4; 10])])
                .await
                .unwrap();
            assert_eq!(
                s.get(&[key(1), key(2), key(3), key(4)]).await.unwrap(),
                [
                    Some(vec![1; 10]),
                    None,
                    Some(vec![3; 10]),
                    Some(vec![4; 10])
                ]
            );
            let st = s.stats();
            assert_eq!((st.pages, st.bytes, st.evicted_pages), (3, 30, 1));
            assert_eq!((st.get_pages, st.get_hits, st.put_pages), (5, 4, 4));
            // Replacing a page does not count its old bytes twice.
            s.put(&[(key(3), vec![7; 5])]).await.unwrap();
            assert_eq!(s.stats().bytes, 25);
            assert_eq!(s.delete(&[key(3), key(3), key(2)]).await.unwrap(), 1);
            assert_eq!(s.stats().pages, 2);
        });
    }
}
