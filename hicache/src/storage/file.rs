//! [`FileStore`]: the default store, a directory of append-only segment files.
//!
//! # Layout
//! A store keeps its pages in *segments*: files named `<16 hex>-<8 hex>-<8 hex>.seg` (the
//! creating process's clock, id and a counter, so names never repeat) directly in its
//! directory. A segment is a log of records, each a 72-byte header — magic `RKVR`, kind (page,
//! page without a payload checksum, or tombstone), a write stamp, the key, the payload length,
//! an XXH3-64 of the payload (0 without one) and an XXH3-64 of the header's first 64 bytes —
//! followed by the payload, exactly the bytes given
//! to `put` ([`RECORD_HEADER_BYTES`]). Anything else in the directory is ignored (never
//! counted, never deleted; but see evicted segments below), including the one-file-per-page
//! layout of earlier versions.
//!
//! A batch `put` appends its pages to the store's current segment (a new segment is started
//! when the next record would take the current one past [`FileStoreConfig::segment_bytes`]; a
//! record larger than that gets a segment of its own), with one vectored write per group of
//! about 1 MiB of pages; each page's XXH3 is computed just before its group is written, so
//! the write copies bytes the checksum has just brought into the CPU cache and a page is read
//! from memory once. A page of more than 512 KiB is written on its own, 512 KiB at a time,
//! each chunk fed to a streaming XXH3 just before its write; its header, which holds the
//! checksum, is written last, into the 72 bytes left (as zeros) before the payload. A `get`
//! reads each page with one read and returns it only if its XXH3 matches the record's. A
//! store whose reader checks the bytes itself (the storage tier checks every page it loads
//! against the page format's XXH3-128) can leave both passes out
//! ([`FileStoreConfig::payload_checksums`]): its puts write records without a checksum, in
//! groups of about 1 MiB (a large page in one vectored write with its header), and its gets
//! check only lengths. The store keeps an in-memory index, key → (segment, offset, length,
//! checksum, stamp), rebuilt at open by reading every segment's record headers (not the
//! payloads).
//!
//! # Writes, crashes and durability
//! Records are never changed once written whole, and a store appends only to segments it created,
//! one batch at a time. A process that dies mid-write leaves a torn tail: a header that does
//! not check (a large page's header still zeros: it is written after its payload), or a
//! record longer than the file. Reading a segment stops there, so a torn
//! record is never indexed (the bytes stay until the segment is evicted; nobody appends to it
//! again). A page whose bytes were damaged on disk after its header checked fails its XXH3 at
//! `get`: a miss, counted in [`StoreStats::damaged_pages`] and dropped from the index —
//! never wrong bytes. (Without [`FileStoreConfig::payload_checksums`] the damaged bytes are
//! returned, and it is the reader's check that finds them: the storage tier then discards the
//! page through [`StorageBackend::discard_damaged`], which counts it the same way.) A failed
//! write is cut off again (the segment is truncated back to where the batch began).
//!
//! How much reaches the disk before `put` reports a page stored is the [`FileSync`] policy,
//! applied once per batch rather than once per page: [`FileSync::Never`] (the default) calls
//! no `fsync`; [`FileSync::Pages`] syncs the data of every segment the batch wrote;
//! [`FileSync::PagesAndDirs`] also syncs the directory after a batch that started a segment.
//! Deletes (tombstones) follow the same policy.
//!
//! # Replacing and deleting
//! A `put` of a stored key appends a new record; the index moves to it and the old record
//! becomes dead bytes. A `delete` appends a tombstone record and drops the key from the index.
//! Records carry a stamp (nanoseconds since the epoch, increasing within a process), and when
//! the index is rebuilt the newest record of a key wins, so a deleted page stays deleted after
//! a restart. When the segment holding a tombstone is evicted while an older segment remains,
//! the tombstone is appended again to the current segment. Dead bytes are reclaimed only when
//! their segment is evicted.
//!
//! # Size cap and eviction
//! The cap counts the bytes of the store's segments on disk: every record, header and payload,
//! live or dead (a replaced or deleted page counts until its segment goes), tombstones too. With
//! a cap, segments are by default at most a sixteenth of it, and after each batch (put or
//! delete) the store evicts whole segments, least recently used first, until it is under the
//! cap again: a segment's last use is the last `put` into it or `get` from it. The segment
//! being appended to is never evicted, so the newest page always stays; a page that does not
//! fit in the cap beside its header is refused. An evicted segment leaves the index and the
//! cap at once: it is renamed to `<name>.evicted` and queued for deletion, which a background
//! job on tokio's blocking pool does one file at a time, off the path of the operation that
//! evicted it (freeing a large file takes the file system a while; outside a runtime the
//! evicting thread deletes it). The queue is bounded: an eviction that would leave more than
//! four segments' bytes waiting for deletion waits for the deletions first, so the directory
//! holds at most the cap plus four segments. [`FileStore::removal_backlog_bytes`] says how
//! much waits, [`FileStore::wait_for_removals`] waits for it; a file left by a store that
//! stopped first is deleted at the next open.
//! Pages of the victim that a `get` read since they were written get a second chance: up
//! to half the victim's bytes of them are appended again (checked first) before it goes, and
//! their copies must be read again to survive the next eviction (on the README's Mooncake
//! replay, plain segment LRU reached 0.940 of the ideal hit ratio, this 0.973, a per-page LRU
//! 0.980). At open, the segments' modification times give the initial order (oldest first),
//! and a store opened with a smaller cap than the directory holds evicts down to it.
//!
//! # Sharing a directory
//! Several stores (processes, servers) may share one directory. Each appends only to its own
//! segments, so none ever reads a half-written record. A store's index holds the pages of the
//! segments it found at open and of its own writes; on a miss (`get` or `exists_prefix` of a
//! key it does not know) it lists the directory again, reads the segments it has not seen and
//! the records appended to known ones since, and drops the segments that are gone. So a page
//! another store wrote is found by `get` and `exists_prefix`; a page another store deleted or
//! evicted is still served (whole and correct) until this store's next miss triggers that
//! rescan, or, for an evicted segment, until a read finds the file gone. Each store enforces
//! its cap over the segments it knows, and may evict a segment another store is still
//! appending to: the writer's pages in it then stay readable to the writer only (through its
//! open file) until it starts its next segment. A store alone in its directory has an index
//! that matches its segments exactly.
//!
//! # Threads
//! Every operation is one blocking job on tokio's blocking pool
//! ([`tokio::task::spawn_blocking`]) per batch, so the thread polling the future never waits
//! for the disk. The store therefore needs a tokio runtime; polled outside one, an operation
//! fails with [`StoreError::Config`]. A future dropped before it completes (a deadline above)
//! lets its job finish in the background; the job keeps the index right either way. Puts and
//! deletes of one store append one batch at a time (checksums included); gets read outside
//! every lock.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, IoSlice, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use radixkv_radix::PageKey;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::backend::{Counters, StorageBackend, StoreError, StoreFuture, StoreStats};

/// How much of a write reaches the disk before [`FileStore::put`] reports it stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum FileSync {
    /// No `fsync`: a crashed process leaves at most a torn record at a segment's end, which
    /// is never indexed; after a power loss a record may read back damaged, which its
    /// checksum turns into a miss. The fastest; right for a cache.
    #[default]
    Never,
    /// The data of every segment a batch wrote is synced before the batch is reported stored
    /// (one `fdatasync` per segment per batch): after a power loss its pages are whole, though
    /// a segment the batch started may be lost with its directory entry (its pages are then
    /// simply absent).
    Pages,
    /// As `Pages`, and the store's directory is synced after a batch that started a segment:
    /// a page reported stored survives a power loss.
    PagesAndDirs,
}

/// The most bytes of one segment file unless configured ([`FileStoreConfig::segment_bytes`]).
pub const DEFAULT_SEGMENT_BYTES: u64 = 256 << 20;

/// Bytes of the header before each record's payload in a segment.
pub const RECORD_HEADER_BYTES: u64 = 72;

/// Where a [`FileStore`] keeps its pages and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileStoreConfig {
    /// The store's directory, created (with its parents) if missing.
    pub dir: PathBuf,
    /// Most bytes the store's segments take on disk, record headers and tombstones included
    /// (`None`: no cap; see the module docs). Must not be 0.
    pub cap_bytes: Option<u64>,
    /// The durability policy.
    pub sync: FileSync,
    /// Most bytes of one segment file (a record larger than this gets a segment of its own).
    /// `None`: [`DEFAULT_SEGMENT_BYTES`], or a sixteenth of the cap if that is smaller (so an
    /// eviction frees a sixteenth of the store at most). Must not be 0.
    pub segment_bytes: Option<u64>,
    /// Whether the store checksums payloads (`true`, the default): a `put` writes each page's
    /// XXH3-64 into its record and a `get` returns a page only if it matches. `false`: puts
    /// write records without one and gets check only lengths; right where the reader checks
    /// the bytes itself — the storage tier decodes every page it loads against the page
    /// format's XXH3-128 and hands a page that fails back through
    /// [`StorageBackend::discard_damaged`], so the store's own checksum is a second pass over
    /// every page written and read (on the README's bench, a quarter of a put's and a third
    /// of a one-page get's time). Without it, a page damaged on disk is returned as it reads.
    /// Stores sharing a directory may differ: a record says whether it has a checksum, and a
    /// checking store returns a record without one as it reads.
    pub payload_checksums: bool,
}

impl FileStoreConfig {
    /// A store in `dir` without a cap, with the default [`FileSync`] and segment size.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileStoreConfig {
            dir: dir.into(),
            cap_bytes: None,
            sync: FileSync::default(),
            segment_bytes: None,
            payload_checksums: true,
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

    /// The same with segments of at most `segment_bytes` bytes, whatever the cap.
    pub fn with_segment_bytes(mut self, segment_bytes: u64) -> Self {
        self.segment_bytes = Some(segment_bytes);
        self
    }

    /// The same with payload checksums written and checked (`true`) or left to the reader
    /// (`false`; see [`FileStoreConfig::payload_checksums`]).
    pub fn with_payload_checksums(mut self, payload_checksums: bool) -> Self {
        self.payload_checksums = payload_checksums;
        self
    }
}

const RECORD_MAGIC: [u8; 4] = *b"RKVR";
const KIND_PAGE: u32 = 1;
const KIND_TOMB: u32 = 2;
/// A page record without a payload checksum (written with
/// [`FileStoreConfig::payload_checksums`] off).
const KIND_PAGE_UNSUMMED: u32 = 3;
const HEADER: usize = RECORD_HEADER_BYTES as usize;
const SEGMENT_SUFFIX: &str = ".seg";
/// Appended to the name of an evicted segment before it is deleted.
const DOOMED_SUFFIX: &str = ".evicted";
/// With a cap and no configured segment size, segments are at most this fraction of it (the
/// eviction granularity).
const SEGMENTS_PER_CAP: u64 = 16;
/// Evicted segments wait for deletion in the background up to this many segments' bytes; an
/// eviction beyond that waits for the deletions (so the directory holds at most the cap plus
/// this much).
const REAP_BACKLOG_SEGMENTS: u64 = 4;

/// Numbers segment files within this process (several stores may share it).
static SEGMENT_SEQ: AtomicU64 = AtomicU64::new(0);
/// The last record stamp this process gave out.
static LAST_STAMP: AtomicU64 = AtomicU64::new(0);

/// A record stamp: the wall clock in nanoseconds, strictly increasing within the process.
fn next_stamp() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut prev = LAST_STAMP.load(Ordering::Relaxed);
    loop {
        let next = now.max(prev.saturating_add(1));
        match LAST_STAMP.compare_exchange_weak(prev, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(p) => prev = p,
        }
    }
}

/// A record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    tomb: bool,
    stamp: u64,
    key: PageKey,
    len: u64,
    /// The payload's XXH3-64 where `summed`, else 0.
    hash: u64,
    /// Whether the record carries a payload checksum (a page's kind says so).
    summed: bool,
}

impl Record {
    fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0..4].copy_from_slice(&RECORD_MAGIC);
        let kind = match (self.tomb, self.summed) {
            (true, _) => KIND_TOMB,
            (false, true) => KIND_PAGE,
            (false, false) => KIND_PAGE_UNSUMMED,
        };
        h[4..8].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&self.stamp.to_le_bytes());
        h[16..48].copy_from_slice(&self.key.0);
        h[48..56].copy_from_slice(&self.len.to_le_bytes());
        h[56..64].copy_from_slice(&self.hash.to_le_bytes());
        let check = xxh3_64(&h[..64]);
        h[64..72].copy_from_slice(&check.to_le_bytes());
        h
    }

    /// The header in `h`, if it is one (magic, kind and checksum all right).
    fn decode(h: &[u8; HEADER]) -> Option<Record> {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if h[0..4] != RECORD_MAGIC || u64_at(64) != xxh3_64(&h[..64]) {
            return None;
        }
        let mut kind = [0u8; 4];
        kind.copy_from_slice(&h[4..8]);
        let (tomb, summed) = match u32::from_le_bytes(kind) {
            KIND_PAGE => (false, true),
            KIND_PAGE_UNSUMMED => (false, false),
            KIND_TOMB => (true, false),
            _ => return None,
        };
        let mut key = [0u8; 32];
        key.copy_from_slice(&h[16..48]);
        let r = Record {
            tomb,
            stamp: u64_at(8),
            key: PageKey(key),
            len: u64_at(48),
            hash: u64_at(56),
            summed,
        };
        (!tomb || r.len == 0).then_some(r)
    }
}

/// Where a page's payload lies.
#[derive(Clone, Copy, Debug)]
struct Loc {
    seg: u32,
    /// Byte offset of the payload in the segment.
    off: u64,
    len: u64,
    hash: u64,
    /// Whether `hash` is the payload's checksum (else the record has none).
    summed: bool,
    stamp: u64,
    /// Read by a `get` since this record was written.
    read: bool,
}

#[derive(Clone, Copy, Debug)]
struct Tomb {
    seg: u32,
    stamp: u64,
}

#[derive(Debug)]
struct Segment {
    name: String,
    /// The handle this store writes a segment it created through (at the end it keeps in
    /// `end`; the handle does not append).
    writer: Option<Arc<File>>,
    /// Bytes read (a segment of another store) or written (this store's) so far.
    end: u64,
    /// Bytes of its whole records (headers and payloads, live or dead, tombstones too): what
    /// it counts against the cap.
    held: u64,
    /// Last use (the store's clock).
    used: u64,
    /// The oldest stamp of its records.
    first_stamp: u64,
    /// The key of every record in it, in order (a key may repeat).
    keys: Vec<PageKey>,
}

/// The store's index of segments and pages.
#[derive(Debug, Default)]
struct State {
    pages: HashMap<PageKey, Loc>,
    tombs: HashMap<PageKey, Tomb>,
    segs: HashMap<u32, Segment>,
    names: HashMap<String, u32>,
    next_seg: u32,
    /// The segment this store appends to.
    active: Option<u32>,
    /// Payload bytes of the pages in `pages`.
    live_bytes: u64,
    /// Sum of the segments' `held`.
    held: u64,
    clock: u64,
}

/// What a removed segment leaves to do.
struct Removed {
    name: String,
    /// Bytes of its file this store knows of.
    bytes: u64,
    pages: u64,
    /// Its tombstones that an older segment still needs.
    carry: Vec<(PageKey, u64)>,
}

impl State {
    fn add_segment(&mut self, name: String, writer: Option<Arc<File>>, end: u64) -> u32 {
        let id = self.next_seg;
        self.next_seg = self.next_seg.wrapping_add(1);
        self.clock += 1;
        self.names.insert(name.clone(), id);
        self.segs.insert(
            id,
            Segment {
                name,
                writer,
                end,
                held: 0,
                used: self.clock,
                first_stamp: u64::MAX,
                keys: Vec::new(),
            },
        );
        id
    }

    fn touch(&mut self, seg: u32) {
        self.clock += 1;
        if let Some(s) = self.segs.get_mut(&seg) {
            s.used = self.clock;
        }
    }

    fn drop_page(&mut self, key: &PageKey) -> Option<Loc> {
        let loc = self.pages.remove(key)?;
        self.live_bytes -= loc.len;
        Some(loc)
    }

    /// Adds a record found at `off` (its payload's offset) in segment `seg`: the index follows
    /// it if it is the newest record of its key. A segment removed meanwhile takes nothing.
    fn add_record(&mut self, seg: u32, r: &Record, off: u64) {
        let Some(s) = self.segs.get_mut(&seg) else {
            return;
        };
        s.keys.push(r.key);
        s.first_stamp = s.first_stamp.min(r.stamp);
        let bytes = RECORD_HEADER_BYTES + r.len;
        s.held += bytes;
        self.held += bytes;
        if self.tombs.get(&r.key).is_some_and(|t| t.stamp >= r.stamp)
            || self.pages.get(&r.key).is_some_and(|l| l.stamp >= r.stamp)
        {
            return;
        }
        self.drop_page(&r.key);
        if r.tomb {
            self.tombs.insert(
                r.key,
                Tomb {
                    seg,
                    stamp: r.stamp,
                },
            );
        } else {
            self.tombs.remove(&r.key);
            self.pages.insert(
                r.key,
                Loc {
                    seg,
                    off,
                    len: r.len,
                    hash: r.hash,
                    summed: r.summed,
                    stamp: r.stamp,
                    read: false,
                },
            );
            self.live_bytes += r.len;
        }
    }

    /// Removes segment `id` and the pages and tombstones whose newest record is in it.
    fn remove_segment(&mut self, id: u32) -> Option<Removed> {
        let seg = self.segs.remove(&id)?;
        self.names.remove(&seg.name);
        self.held -= seg.held;
        if self.active == Some(id) {
            self.active = None;
        }
        let oldest_left = self
            .segs
            .values()
            .map(|s| s.first_stamp)
            .min()
            .unwrap_or(u64::MAX);
        let mut out = Removed {
            name: seg.name,
            bytes: seg.end,
            pages: 0,
            carry: Vec::new(),
        };
        for key in &seg.keys {
            if self.pages.get(key).is_some_and(|l| l.seg == id) {
                self.drop_page(key);
                out.pages += 1;
            }
            if self.tombs.get(key).is_some_and(|t| t.seg == id)
                && let Some(t) = self.tombs.remove(key)
                && oldest_left < t.stamp
            {
                out.carry.push((*key, t.stamp));
            }
        }
        Some(out)
    }

    /// The least recently used segment other than the one appended to.
    fn victim(&self) -> Option<u32> {
        self.segs
            .iter()
            .filter(|(id, _)| Some(**id) != self.active)
            .min_by_key(|(id, s)| (s.used, **id))
            .map(|(id, _)| *id)
    }
}

/// Deletes evicted segment files, one at a time, off the path of the operation that evicted
/// them (freeing a large file takes the file system a while).
#[derive(Debug, Default)]
struct Reaper {
    state: Mutex<ReaperState>,
    /// Notified whenever a file is deleted and when the deleting job stops.
    progress: Condvar,
}

#[derive(Debug, Default)]
struct ReaperState {
    /// Files to delete, oldest first, with their sizes.
    queue: VecDeque<(PathBuf, u64)>,
    /// Bytes of the files queued or being deleted.
    bytes: u64,
    /// A job is deleting (it drains the queue before it stops).
    running: bool,
}

/// The background job of a [`Reaper`]. If the runtime drops it without running it (a runtime
/// shutting down), it hands the queue back: the next eviction or wait deletes it.
struct ReapJob {
    reaper: Arc<Reaper>,
    finished: bool,
}

impl ReapJob {
    fn run(mut self) {
        self.reaper.drain();
        self.finished = true;
        drop(self);
    }
}

impl Drop for ReapJob {
    fn drop(&mut self) {
        if !self.finished {
            self.reaper.lock().running = false;
            self.reaper.progress.notify_all();
        }
    }
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, ReaperState> {
        // Every update of the state is finished before anything that could panic runs.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `path` (`bytes` long) for deletion on tokio's blocking pool (here, outside a
    /// runtime), then waits until at most `backlog` bytes are left to delete.
    fn delete(self: &Arc<Self>, path: PathBuf, bytes: u64, backlog: u64) {
        let background = {
            let mut st = self.lock();
            st.queue.push_back((path, bytes));
            st.bytes += bytes;
            if st.running {
                true
            } else if let Ok(h) = tokio::runtime::Handle::try_current() {
                st.running = true;
                let job = ReapJob {
                    reaper: Arc::clone(self),
                    finished: false,
                };
                drop(h.spawn_blocking(move || job.run()));
                true
            } else {
                false
            }
        };
        self.wait_until(if background { backlog } else { 0 });
    }

    /// Waits until at most `backlog` bytes are left to delete, deleting them here when no job
    /// does.
    fn wait_until(&self, backlog: u64) {
        let mut st = self.lock();
        while st.bytes > backlog {
            if st.running {
                st = self.progress.wait(st).unwrap_or_else(|p| p.into_inner());
            } else {
                st.running = true;
                drop(st);
                self.drain();
                st = self.lock();
            }
        }
    }

    /// Deletes the queued files until none is left, then stops (`running` was set by the
    /// caller).
    fn drain(&self) {
        loop {
            let (path, bytes) = {
                let mut st = self.lock();
                match st.queue.pop_front() {
                    Some(next) => next,
                    None => {
                        st.running = false;
                        self.progress.notify_all();
                        return;
                    }
                }
            };
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "file store: cannot delete an evicted segment");
            }
            self.lock().bytes -= bytes;
            self.progress.notify_all();
        }
    }
}

#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    cap_bytes: Option<u64>,
    sync: FileSync,
    /// The effective most bytes of a segment.
    segment_bytes: u64,
    /// Whether gets check payload checksums.
    payload_checksums: bool,
    /// Held by a batch that appends (puts, deletes, evictions): one at a time.
    append: Mutex<()>,
    /// Held by a rescan of the directory.
    scan: Mutex<()>,
    state: Mutex<State>,
    counters: Counters,
    /// Deletes evicted segments.
    reaper: Arc<Reaper>,
}

/// A store of pages in append-only segment files in a directory, with an optional size cap
/// with least-recently-used eviction of whole segments, and an index rebuilt at open (see
/// the module docs for the layout, the crash and durability guarantees and sharing a
/// directory).
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

fn is_segment_name(name: &str) -> bool {
    name.strip_suffix(SEGMENT_SUFFIX).is_some_and(|stem| {
        !stem.is_empty()
            && stem
                .bytes()
                .all(|c| c == b'-' || c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
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

/// The names of the segment files in `dir`.
fn list_segments(dir: &Path) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| io_err("cannot list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err("cannot list", dir, e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if is_segment_name(&name) && entry.file_type().is_ok_and(|t| t.is_file()) {
            out.push(name);
        }
    }
    Ok(out)
}

/// Deletes evicted segments a store renamed but did not get to delete (it stopped first).
fn remove_doomed(dir: &Path) -> Result<(), StoreError> {
    let entries = fs::read_dir(dir).map_err(|e| io_err("cannot list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err("cannot list", dir, e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name
            .strip_suffix(DOOMED_SUFFIX)
            .is_some_and(is_segment_name)
            && entry.file_type().is_ok_and(|t| t.is_file())
        {
            match fs::remove_file(entry.path()) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("cannot remove", &entry.path(), e)),
            }
        }
    }
    Ok(())
}

/// What reading a segment from some offset found.
struct Scanned {
    /// Whole records and their payloads' offsets, in file order.
    records: Vec<(Record, u64)>,
    /// The end of the last whole record.
    end: u64,
    modified: SystemTime,
}

/// Reads the whole records of segment `path` from byte `from` on; `None` if the file is gone.
/// Reading stops at the first header that does not check or record that runs past the file's
/// end (a torn tail, or a record another store is still writing).
fn scan_segment(path: &Path, from: u64) -> Result<Option<Scanned>, StoreError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("cannot open", path, e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| io_err("cannot stat", path, e))?;
    let size = meta.len();
    let modified = meta.modified().unwrap_or(UNIX_EPOCH);
    let mut out = Scanned {
        records: Vec::new(),
        end: from,
        modified,
    };
    if size <= from {
        return Ok(Some(out));
    }
    let mut r = BufReader::with_capacity(64 << 10, file);
    r.seek(SeekFrom::Start(from))
        .map_err(|e| io_err("cannot read", path, e))?;
    let mut off = from;
    let mut h = [0u8; HEADER];
    while off + RECORD_HEADER_BYTES <= size {
        match r.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        let Some(rec) = Record::decode(&h) else {
            break;
        };
        let payload = off + RECORD_HEADER_BYTES;
        if rec.len > size - payload {
            break;
        }
        // `rec.len` fits in the file, so in an i64.
        r.seek_relative(rec.len as i64)
            .map_err(|e| io_err("cannot read", path, e))?;
        out.records.push((rec, payload));
        off = payload + rec.len;
        out.end = off;
    }
    Ok(Some(out))
}

/// Writes all of `bufs` to `file` at its position.
fn write_all_vectored(mut file: &File, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match file.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads up to `len` bytes of `file` from its position, in one read into a new buffer's
/// spare capacity (nothing zeroed first): fewer than `len` only where the file ends first.
fn read_up_to(file: &File, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len);
    file.take(len as u64).read_to_end(&mut buf)?;
    Ok(buf)
}

/// [`read_up_to`], and the XXH3-64 of the bytes read. (Reading 128 or 512 KiB at a time into a
/// streaming XXH3, so that each chunk is hashed while in cache, made gets of one page slower
/// in the bench: more read calls, and on the bench's CPU a 2 MiB page stays in the L3 for the
/// one-shot hash anyway. See the README's FileStore bench.)
fn read_hashed(file: &File, len: usize) -> io::Result<(Vec<u8>, u64)> {
    let buf = read_up_to(file, len)?;
    let hash = xxh3_64(&buf);
    Ok((buf, hash))
}

/// A record to append: its header and its payload (empty for a tombstone).
type Item<'a> = (Record, &'a [u8]);

/// Payload bytes checksummed and then written with one vectored write: a group is small
/// enough to still be in the CPU cache when the write copies it.
const WRITE_GROUP_BYTES: u64 = 1 << 20;

/// A page longer than this is checksummed and written chunk by chunk, this many bytes at a
/// time ([`write_chunked`]): a whole page of a few MiB would be out of the CPU's cache by the
/// time its write copied it.
const WRITE_CHUNK_BYTES: usize = 512 << 10;

/// Whether `write_groups` writes `item` with [`write_chunked`].
fn goes_chunked(item: &Item<'_>, hash: bool) -> bool {
    hash && !item.0.tomb && item.1.len() > WRITE_CHUNK_BYTES
}

/// Writes `items` to `file` from byte `off` on (the segment's end: the store writes its
/// segments through a handle that does not append, at the offsets it keeps). With `hash`, a
/// page record's checksum is computed as it is written: a page of more than
/// [`WRITE_CHUNK_BYTES`] by [`write_chunked`]; the other records in groups of about
/// [`WRITE_GROUP_BYTES`] of payload, one vectored write each, each page's checksum computed
/// just before its group is written.
fn write_groups(
    mut file: &File,
    mut off: u64,
    items: &mut [Item<'_>],
    hash: bool,
) -> io::Result<()> {
    file.seek(SeekFrom::Start(off))?;
    let mut i = 0;
    while i < items.len() {
        if goes_chunked(&items[i], hash) {
            let (r, payload) = &mut items[i];
            write_chunked(file, off, r, payload)?;
            off += RECORD_HEADER_BYTES + r.len;
            i += 1;
            continue;
        }
        let mut j = i;
        let mut bytes = 0;
        let mut encoded = Vec::new();
        while j < items.len()
            && !goes_chunked(&items[j], hash)
            && (j == i || bytes + items[j].0.len <= WRITE_GROUP_BYTES)
        {
            let (r, payload) = &mut items[j];
            if hash && !r.tomb {
                r.hash = xxh3_64(payload);
            }
            encoded.push(r.encode());
            bytes += r.len;
            j += 1;
        }
        let mut slices = Vec::with_capacity(2 * (j - i));
        for (h, (_, payload)) in encoded.iter().zip(&items[i..j]) {
            slices.push(IoSlice::new(h));
            if !payload.is_empty() {
                slices.push(IoSlice::new(payload));
            }
        }
        write_all_vectored(file, &mut slices)?;
        off += bytes + (j - i) as u64 * RECORD_HEADER_BYTES;
        i = j;
    }
    Ok(())
}

/// Writes page record `r` with `payload` to `file` at byte `off` (where the file's position
/// is): zeros in the header's place, then the payload [`WRITE_CHUNK_BYTES`] at a time, each
/// chunk fed to a streaming XXH3 just before its write (so the write copies bytes still in
/// the CPU cache, and the page is read from memory once), then the header, with the checksum,
/// into its place; the position is left at the record's end. Until the header is in, the
/// record is a torn one (zeros are no header); the record written is the same as one written
/// header first.
fn write_chunked(mut file: &File, off: u64, r: &mut Record, payload: &[u8]) -> io::Result<()> {
    let mut hasher = Xxh3::new();
    let mut chunks = payload.chunks(WRITE_CHUNK_BYTES);
    let first = chunks.next().unwrap_or_default();
    hasher.update(first);
    let place = [0u8; HEADER];
    write_all_vectored(file, &mut [IoSlice::new(&place), IoSlice::new(first)])?;
    for chunk in chunks {
        hasher.update(chunk);
        file.write_all(chunk)?;
    }
    r.hash = hasher.digest();
    file.seek(SeekFrom::Start(off))?;
    file.write_all(&r.encode())?;
    file.seek(SeekFrom::Start(off + RECORD_HEADER_BYTES + r.len))?;
    Ok(())
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update of the index finishes before anything that could panic runs.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_append(&self) -> MutexGuard<'_, ()> {
        self.append.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn segment_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Creates a new segment file of this store.
    fn create_segment(&self) -> Result<(String, File), StoreError> {
        let pid = std::process::id();
        for _ in 0..16 {
            let seq = SEGMENT_SEQ.fetch_add(1, Ordering::Relaxed) as u32;
            let name = format!("{:016x}-{pid:08x}-{seq:08x}{SEGMENT_SUFFIX}", next_stamp());
            let path = self.segment_path(&name);
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => return Ok((name, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("cannot create", &path, e)),
            }
        }
        Err(StoreError::Io(format!(
            "no free segment name in {}",
            self.dir.display()
        )))
    }

    /// Appends `items` (called with the append lock held): the records that go to one segment
    /// are written with a vectored write per group of about [`WRITE_GROUP_BYTES`], then the
    /// [`FileSync`] policy runs, then the records written join the index. With `hash`, each
    /// page record's checksum is computed here, just before its group is written (so a page's
    /// bytes are read from memory once: the write finds them in the CPU cache). A failure
    /// leaves the records written before it in the index and cuts the failed segment's part
    /// of the batch off again.
    fn append_locked(&self, items: &mut [Item<'_>], hash: bool) -> Result<(), StoreError> {
        let mut written: Vec<(u32, usize, u64)> = Vec::with_capacity(items.len());
        let result = self.write_items(items, hash, &mut written);
        let mut st = self.lock();
        for &(seg, i, off) in &written {
            st.add_record(seg, &items[i].0, off);
        }
        let mut last = None;
        for &(seg, _, _) in &written {
            if last != Some(seg) {
                st.touch(seg);
                last = Some(seg);
            }
        }
        result
    }

    fn write_items(
        &self,
        items: &mut [Item<'_>],
        hash: bool,
        written: &mut Vec<(u32, usize, u64)>,
    ) -> Result<(), StoreError> {
        let mut synced: Vec<(Arc<File>, String)> = Vec::new();
        let mut created = false;
        let mut i = 0;
        while i < items.len() {
            let first = RECORD_HEADER_BYTES + items[i].0.len;
            let current = {
                let st = self.lock();
                st.active.and_then(|a| {
                    let s = st.segs.get(&a)?;
                    let w = s.writer.clone()?;
                    (s.end == 0 || s.end + first <= self.segment_bytes)
                        .then(|| (a, w, s.end, s.name.clone()))
                })
            };
            let (seg, file, start, name) = match current {
                Some(c) => c,
                None => {
                    let (name, f) = self.create_segment()?;
                    created = true;
                    let f = Arc::new(f);
                    let mut st = self.lock();
                    let id = st.add_segment(name.clone(), Some(Arc::clone(&f)), 0);
                    st.active = Some(id);
                    (id, f, 0, name)
                }
            };
            // The records that go to this segment.
            let mut end = start;
            let mut j = i;
            while j < items.len() {
                let size = RECORD_HEADER_BYTES + items[j].0.len;
                if end > 0 && end + size > self.segment_bytes {
                    break;
                }
                end += size;
                j += 1;
            }
            let path = self.segment_path(&name);
            if let Err(e) = write_groups(&file, start, &mut items[i..j], hash) {
                if file.set_len(start).is_err() {
                    // Cannot cut the failed write off: append no more to this segment.
                    let mut st = self.lock();
                    if st.active == Some(seg) {
                        st.active = None;
                    }
                }
                return Err(io_err("cannot write", &path, e));
            }
            {
                let mut st = self.lock();
                if let Some(s) = st.segs.get_mut(&seg) {
                    s.end = end;
                }
            }
            let mut off = start;
            for (k, item) in items.iter().enumerate().take(j).skip(i) {
                written.push((seg, k, off + RECORD_HEADER_BYTES));
                off += RECORD_HEADER_BYTES + item.0.len;
            }
            if self.sync != FileSync::Never && !synced.iter().any(|(_, n)| *n == name) {
                synced.push((file, name));
            }
            i = j;
        }
        for (file, name) in &synced {
            file.sync_data()
                .map_err(|e| io_err("cannot sync", &self.segment_path(name), e))?;
        }
        if created && self.sync == FileSync::PagesAndDirs {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io_err("cannot sync", &self.dir, e))?;
        }
        Ok(())
    }

    /// Deletes an evicted segment's file: renamed out of the segments' names at once (so no
    /// store reads it again), then handed to the reaper, which deletes it in the background.
    /// Waits while more than [`REAP_BACKLOG_SEGMENTS`] segments' bytes are left to delete.
    fn remove_segment_file(&self, name: &str, bytes: u64) {
        let path = self.segment_path(name);
        let doomed = self.segment_path(&format!("{name}{DOOMED_SUFFIX}"));
        match fs::rename(&path, &doomed) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "file store: cannot evict a segment");
                return;
            }
        }
        let backlog = REAP_BACKLOG_SEGMENTS.saturating_mul(self.segment_bytes);
        self.reaper.delete(doomed, bytes, backlog);
    }

    /// The pages `hot` of segment `name` that read back whole: (key, bytes, checksum). A page
    /// that cannot be read is left out (it goes with its segment).
    fn read_copies(
        &self,
        name: &str,
        hot: &[(PageKey, Loc)],
    ) -> Vec<(PageKey, Vec<u8>, u64, bool)> {
        let mut out = Vec::with_capacity(hot.len());
        if hot.is_empty() {
            return out;
        }
        let Ok(mut file) = File::open(self.segment_path(name)) else {
            return out;
        };
        for (key, loc) in hot {
            let Ok(len) = usize::try_from(loc.len) else {
                continue;
            };
            if file.seek(SeekFrom::Start(loc.off)).is_err() {
                continue;
            }
            // A copy carries its record's checksum, checked first; a record without one is
            // copied as it reads.
            let read = if loc.summed {
                read_hashed(&file, len).map(|(buf, hash)| (buf, hash == loc.hash))
            } else {
                read_up_to(&file, len).map(|buf| (buf, true))
            };
            if let Ok((buf, true)) = read
                && buf.len() == len
            {
                out.push((*key, buf, loc.hash, loc.summed));
            }
        }
        out
    }

    /// Evicts least recently used segments until the store is under its cap (called with the
    /// append lock held). The pages of a victim that were read since they were written, up to
    /// half its bytes, are appended again (a second chance), the rest go with it.
    fn enforce_cap_locked(&self) {
        let Some(cap) = self.cap_bytes else {
            return;
        };
        loop {
            // The victim, and its pages read since they were written (up to half its bytes).
            let (victim, name, hot) = {
                let st = self.lock();
                if st.held <= cap {
                    return;
                }
                let Some(victim) = st.victim() else {
                    return;
                };
                let Some(seg) = st.segs.get(&victim) else {
                    return;
                };
                let mut budget = seg.held / 2;
                let mut seen = HashSet::new();
                let mut hot: Vec<(PageKey, Loc)> = Vec::new();
                for key in &seg.keys {
                    if let Some(loc) = st.pages.get(key)
                        && loc.seg == victim
                        && loc.read
                        && RECORD_HEADER_BYTES + loc.len <= budget
                        && seen.insert(*key)
                    {
                        budget -= RECORD_HEADER_BYTES + loc.len;
                        hot.push((*key, *loc));
                    }
                }
                (victim, seg.name.clone(), hot)
            };
            let copies = self.read_copies(&name, &hot);
            let removed = self.lock().remove_segment(victim);
            let Some(removed) = removed else {
                return;
            };
            Counters::add(
                &self.counters.evicted_pages,
                removed.pages.saturating_sub(copies.len() as u64),
            );
            self.remove_segment_file(&removed.name, removed.bytes);
            let mut items: Vec<Item<'_>> = removed
                .carry
                .iter()
                .map(|&(key, stamp)| {
                    let r = Record {
                        tomb: true,
                        stamp,
                        key,
                        len: 0,
                        hash: 0,
                        summed: false,
                    };
                    (r, &[][..])
                })
                .collect();
            for (key, bytes, hash, summed) in &copies {
                let r = Record {
                    tomb: false,
                    stamp: next_stamp(),
                    key: *key,
                    len: bytes.len() as u64,
                    hash: *hash,
                    summed: *summed,
                };
                items.push((r, bytes.as_slice()));
            }
            if !items.is_empty()
                && let Err(e) = self.append_locked(&mut items, false)
            {
                tracing::warn!(error = %e, "file store: cannot carry records forward");
            }
        }
    }

    /// Lists the directory again and reads what other stores wrote since: new segments, and
    /// records appended to known ones; segments of other stores that are gone leave the index.
    /// Whether the index changed.
    fn refresh(&self) -> Result<bool, StoreError> {
        let _scan = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        let listed = list_segments(&self.dir)?;
        let listed_set: HashSet<&str> = listed.iter().map(String::as_str).collect();
        let mut fresh = Vec::new();
        let mut grown = Vec::new();
        let mut gone = Vec::new();
        {
            let st = self.lock();
            for name in &listed {
                match st.names.get(name) {
                    None => fresh.push(name.clone()),
                    Some(&id) => {
                        if let Some(s) = st.segs.get(&id).filter(|s| s.writer.is_none()) {
                            grown.push((id, name.clone(), s.end));
                        }
                    }
                }
            }
            for (id, s) in &st.segs {
                if s.writer.is_none() && !listed_set.contains(s.name.as_str()) {
                    gone.push(*id);
                }
            }
        }
        let mut found_new = Vec::new();
        for name in fresh {
            if let Some(sc) = scan_segment(&self.segment_path(&name), 0)? {
                found_new.push((name, sc));
            }
        }
        let mut found_more = Vec::new();
        for (id, name, end) in grown {
            match scan_segment(&self.segment_path(&name), end)? {
                Some(sc) if !sc.records.is_empty() => found_more.push((id, end, sc)),
                Some(_) => {}
                None => gone.push(id),
            }
        }
        let mut changed = false;
        {
            let mut st = self.lock();
            for id in gone {
                changed |= st.remove_segment(id).is_some();
            }
            for (name, sc) in found_new {
                if st.names.contains_key(&name) {
                    continue;
                }
                let id = st.add_segment(name, None, sc.end);
                for (r, off) in &sc.records {
                    st.add_record(id, r, *off);
                }
                changed = true;
            }
            for (id, end, sc) in found_more {
                if st.segs.get(&id).is_none_or(|s| s.end != end) {
                    continue;
                }
                for (r, off) in &sc.records {
                    st.add_record(id, r, *off);
                }
                if let Some(s) = st.segs.get_mut(&id) {
                    s.end = sc.end;
                }
                changed = true;
            }
        }
        if changed && self.cap_bytes.is_some_and(|cap| self.lock().held > cap) {
            let _append = self.lock_append();
            self.enforce_cap_locked();
        }
        Ok(changed)
    }

    fn prefix_known(&self, keys: &[PageKey]) -> usize {
        let st = self.lock();
        keys.iter().take_while(|k| st.pages.contains_key(k)).count()
    }

    fn exists_prefix(&self, keys: &[PageKey]) -> Result<usize, StoreError> {
        let n = self.prefix_known(keys);
        if n < keys.len() && self.refresh()? {
            return Ok(self.prefix_known(keys));
        }
        Ok(n)
    }

    /// Where each key's page lies: (location, segment name).
    fn locate(&self, keys: &[PageKey]) -> Vec<Option<(Loc, String)>> {
        let st = self.lock();
        keys.iter()
            .map(|k| {
                let loc = *st.pages.get(k)?;
                Some((loc, st.segs.get(&loc.seg)?.name.clone()))
            })
            .collect()
    }

    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let mut locs = self.locate(keys);
        if locs.iter().any(Option::is_none) && self.refresh()? {
            locs = self.locate(keys);
        }
        // Read outside every lock, one open file per segment and batch.
        let mut open: HashMap<u32, Option<(File, u64)>> = HashMap::new();
        let mut out = Vec::with_capacity(keys.len());
        let mut damaged: Vec<(PageKey, Loc)> = Vec::new();
        let mut missing: Vec<u32> = Vec::new();
        for (key, loc) in keys.iter().zip(&locs) {
            let Some((loc, name)) = loc else {
                out.push(None);
                continue;
            };
            let path = self.segment_path(name);
            let slot = match open.entry(loc.seg) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => match File::open(&path) {
                    Ok(f) => v.insert(Some((f, 0))),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        missing.push(loc.seg);
                        v.insert(None)
                    }
                    Err(e) => return Err(io_err("cannot open", &path, e)),
                },
            };
            let Some((file, pos)) = slot else {
                out.push(None);
                continue;
            };
            if *pos != loc.off {
                file.seek(SeekFrom::Start(loc.off))
                    .map_err(|e| io_err("cannot read", &path, e))?;
            }
            let len = usize::try_from(loc.len)
                .map_err(|_| StoreError::Io(format!("a page of {} bytes", loc.len)))?;
            let (buf, intact) = if self.payload_checksums && loc.summed {
                let (buf, hash) =
                    read_hashed(file, len).map_err(|e| io_err("cannot read", &path, e))?;
                (buf, hash == loc.hash)
            } else {
                let buf = read_up_to(file, len).map_err(|e| io_err("cannot read", &path, e))?;
                (buf, true)
            };
            *pos = loc.off + buf.len() as u64;
            if buf.len() != len || !intact {
                damaged.push((*key, *loc));
                out.push(None);
            } else {
                out.push(Some(buf));
            }
        }
        {
            let mut st = self.lock();
            for seg in missing {
                // Deleted by another store.
                st.remove_segment(seg);
            }
            let mut last = None;
            for (key, (loc, got)) in keys.iter().zip(locs.iter().zip(&out)) {
                let Some((loc, _)) = loc else {
                    continue;
                };
                if got.is_some()
                    && let Some(l) = st.pages.get_mut(key)
                    && l.stamp == loc.stamp
                {
                    l.read = true;
                }
                if last != Some(loc.seg) {
                    st.touch(loc.seg);
                    last = Some(loc.seg);
                }
            }
            for (key, loc) in &damaged {
                if st.pages.get(key).is_some_and(|l| l.stamp == loc.stamp) {
                    st.drop_page(key);
                    Counters::add(&self.counters.damaged_pages, 1);
                }
            }
        }
        if !damaged.is_empty() {
            tracing::warn!(
                pages = damaged.len(),
                dir = %self.dir.display(),
                "file store: pages failed their checksum"
            );
        }
        let hits = out.iter().filter(|p| p.is_some()).count();
        Counters::add(&self.counters.get_pages, keys.len() as u64);
        Counters::add(&self.counters.get_hits, hits as u64);
        Ok(out)
    }

    fn put(&self, pages: &[(PageKey, Vec<u8>)]) -> Result<Vec<bool>, StoreError> {
        let mut out = vec![false; pages.len()];
        // Checksums are computed as the pages are written.
        let mut items: Vec<Item<'_>> = Vec::with_capacity(pages.len());
        for ((key, bytes), ok) in pages.iter().zip(out.iter_mut()) {
            let len = bytes.len() as u64;
            if self
                .cap_bytes
                .is_some_and(|cap| len.saturating_add(RECORD_HEADER_BYTES) > cap)
            {
                continue;
            }
            *ok = true;
            let r = Record {
                tomb: false,
                stamp: 0,
                key: *key,
                len,
                hash: 0,
                summed: self.payload_checksums,
            };
            items.push((r, bytes.as_slice()));
        }
        if items.is_empty() {
            return Ok(out);
        }
        let _append = self.lock_append();
        for (r, _) in &mut items {
            r.stamp = next_stamp();
        }
        self.append_locked(&mut items, self.payload_checksums)?;
        self.enforce_cap_locked();
        let bytes: u64 = items.iter().map(|(r, _)| r.len).sum();
        Counters::add(&self.counters.put_pages, items.len() as u64);
        Counters::add(&self.counters.put_bytes, bytes);
        Ok(out)
    }

    fn delete(&self, keys: &[PageKey]) -> Result<usize, StoreError> {
        let _append = self.lock_append();
        let present: Vec<PageKey> = {
            let st = self.lock();
            let mut seen = HashSet::new();
            keys.iter()
                .filter(|k| st.pages.contains_key(k) && seen.insert(**k))
                .copied()
                .collect()
        };
        if present.is_empty() {
            return Ok(0);
        }
        let mut items: Vec<Item<'_>> = present
            .iter()
            .map(|&key| {
                let r = Record {
                    tomb: true,
                    stamp: next_stamp(),
                    key,
                    len: 0,
                    hash: 0,
                    summed: false,
                };
                (r, &[][..])
            })
            .collect();
        self.append_locked(&mut items, false)?;
        // Tombstones take disk too.
        self.enforce_cap_locked();
        Ok(present.len())
    }
}

impl FileStore {
    /// Opens (creating if needed) the store of `config` on tokio's blocking pool: reads the
    /// record headers of every segment in the directory into the index and evicts down to
    /// the cap.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a cap or segment size of 0, a path that is not a directory
    /// or cannot be created, or no current tokio runtime; [`StoreError::Io`] when the
    /// directory or a segment cannot be read.
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
            segment_bytes,
            payload_checksums,
        } = config;
        if cap_bytes == Some(0) {
            return Err(StoreError::Config(
                "a file store's cap must be at least one byte".into(),
            ));
        }
        if segment_bytes == Some(0) {
            return Err(StoreError::Config(
                "a file store's segments must be at least one byte".into(),
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
        remove_doomed(&dir)?;
        let mut found = Vec::new();
        for name in list_segments(&dir)? {
            if let Some(sc) = scan_segment(&dir.join(&name), 0)? {
                found.push((name, sc));
            }
        }
        // The least recently written segment first; the name breaks ties.
        found.sort_unstable_by(|a, b| (a.1.modified, &a.0).cmp(&(b.1.modified, &b.0)));
        let mut st = State::default();
        for (name, sc) in found {
            let id = st.add_segment(name, None, sc.end);
            for (r, off) in &sc.records {
                st.add_record(id, r, *off);
            }
        }
        let segment_bytes = segment_bytes.unwrap_or(match cap_bytes {
            Some(cap) => DEFAULT_SEGMENT_BYTES.min((cap / SEGMENTS_PER_CAP).max(1)),
            None => DEFAULT_SEGMENT_BYTES,
        });
        let shared = Shared {
            dir,
            cap_bytes,
            sync,
            segment_bytes,
            payload_checksums,
            append: Mutex::new(()),
            scan: Mutex::new(()),
            reaper: Arc::default(),
            state: Mutex::new(st),
            counters: Counters::default(),
        };
        {
            let _append = shared.lock_append();
            shared.enforce_cap_locked();
        }
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

    /// The most bytes of one segment this store writes (see
    /// [`FileStoreConfig::segment_bytes`]).
    pub fn segment_bytes(&self) -> u64 {
        self.shared.segment_bytes
    }

    /// Bytes of evicted segment files still waiting for their deletion in the background
    /// (they left the index and the cap when they were evicted; see the module docs).
    pub fn removal_backlog_bytes(&self) -> u64 {
        self.shared.reaper.lock().bytes
    }

    /// Blocks until every evicted segment file queued for deletion is deleted (deleting them
    /// on this thread if no background job does): for tools, tests and benchmarks that want
    /// the disk settled. Do not call it on a tokio worker thread: it waits for the disk.
    pub fn wait_for_removals(&self) {
        self.shared.reaper.wait_until(0);
    }

    /// Where the page this store's index holds under `key` lies: its segment file, the byte
    /// offset of its payload there and its length (for tools and tests; no I/O).
    pub fn page_location(&self, key: &PageKey) -> Option<(PathBuf, u64, u64)> {
        let st = self.shared.lock();
        let loc = st.pages.get(key)?;
        let seg = st.segs.get(&loc.seg)?;
        Some((self.shared.segment_path(&seg.name), loc.off, loc.len))
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
        let st = self.shared.lock();
        self.shared
            .counters
            .snapshot(st.pages.len() as u64, st.live_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_headers_round_trip_and_refuse_damage() {
        let r = Record {
            tomb: false,
            stamp: 42,
            key: PageKey([9; 32]),
            len: 1234,
            hash: 77,
            summed: true,
        };
        let h = r.encode();
        assert_eq!(Record::decode(&h), Some(r));
        for i in 0..HEADER {
            let mut bad = h;
            bad[i] ^= 1;
            assert_eq!(Record::decode(&bad), None, "byte {i} flipped");
        }
        assert_eq!(Record::decode(&[0; HEADER]), None);
        // A page without a payload checksum keeps saying so.
        let u = Record {
            hash: 0,
            summed: false,
            ..r
        };
        assert_eq!(Record::decode(&u.encode()), Some(u));
        assert_ne!(u.encode()[4..8], r.encode()[4..8], "another kind");
        let t = Record {
            tomb: true,
            len: 0,
            hash: 0,
            summed: false,
            ..r
        };
        assert_eq!(Record::decode(&t.encode()), Some(t));
        // A tombstone with a payload is not a record.
        let t = Record { len: 5, ..t };
        assert_eq!(Record::decode(&t.encode()), None);
    }

    #[test]
    fn segment_names() {
        assert!(is_segment_name("0123456789abcdef-00000001-00000002.seg"));
        assert!(!is_segment_name(".seg"));
        assert!(!is_segment_name("notes.seg.txt"));
        assert!(!is_segment_name("ABC.seg"));
    }

    /// [`read_hashed`] gives the bytes asked for and their XXH3 (the checksum the records
    /// store), for lengths around XXH3's internal block sizes and a few large ones, and a file
    /// that ends early gives its bytes and their checksum.
    #[test]
    fn read_hashed_gives_the_bytes_and_their_checksum() {
        let dir =
            std::env::temp_dir().join(format!("radixkv-file-read-hashed-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bytes");
        let c = 512 << 10;
        let total = 3 * c + 2000;
        // Bytes that differ everywhere (a linear congruential sequence).
        let mut x = 0x9e37_79b9_u32;
        let bytes: Vec<u8> = (0..total)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        fs::write(&path, &bytes).unwrap();
        let file = File::open(&path).unwrap();
        let lens = [
            0,
            1,
            16,
            17,
            128,
            129,
            240,
            241,
            1023,
            1025,
            c - 1,
            c,
            c + 1,
            2 * c + 7,
            3 * c + 999,
        ];
        for len in lens {
            for start in [0usize, 1, 333] {
                (&file).seek(SeekFrom::Start(start as u64)).unwrap();
                let (got, hash) = read_hashed(&file, len).unwrap();
                assert_eq!(got, &bytes[start..start + len], "len {len} from {start}");
                assert_eq!(hash, xxh3_64(&bytes[start..start + len]), "len {len}");
            }
        }
        // Past the end: the bytes that are there and their checksum.
        for from in [total - 5, total - c - 3] {
            (&file).seek(SeekFrom::Start(from as u64)).unwrap();
            let (got, hash) = read_hashed(&file, 2 * c).unwrap();
            assert_eq!(got, &bytes[from..]);
            assert_eq!(hash, xxh3_64(&bytes[from..]));
        }
        drop(file);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Pages written chunk by chunk, header last, make the same bytes as records written
    /// header first with checksums computed beforehand (the stored format), at any offset;
    /// a large page whose header is still zeros (a crash before it went in) is a torn tail.
    #[test]
    fn chunked_writes_store_the_same_records() {
        let dir =
            std::env::temp_dir().join(format!("radixkv-file-write-chunked-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let c = WRITE_CHUNK_BYTES;
        let payloads: Vec<Vec<u8>> = [100, c + 1, 7, 3 * c + 17, c, 2 * c - 1, 0]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7 + j / 977) as u8).collect())
            .collect();
        let records = |hash: bool| -> Vec<Item<'_>> {
            let mut out: Vec<Item<'_>> = payloads
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let r = Record {
                        tomb: false,
                        stamp: 10 + i as u64,
                        key: PageKey([i as u8; 32]),
                        len: p.len() as u64,
                        hash: if hash { 0 } else { xxh3_64(p) },
                        summed: true,
                    };
                    (r, p.as_slice())
                })
                .collect();
            let tomb = Record {
                tomb: true,
                stamp: 99,
                key: PageKey([200; 32]),
                len: 0,
                hash: 0,
                summed: false,
            };
            out.insert(2, (tomb, &[]));
            out
        };
        let write = |name: &str, hash: bool| -> (PathBuf, Vec<Record>) {
            let path = dir.join(name);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap();
            // Two batches, the second from the end of the first.
            let mut items = records(hash);
            let (a, b) = items.split_at_mut(3);
            write_groups(&file, 0, a, hash).unwrap();
            let end = file.metadata().unwrap().len();
            write_groups(&file, end, b, hash).unwrap();
            (path, items.iter().map(|(r, _)| *r).collect())
        };
        let (chunked, written) = write("chunked", true);
        let (plain, _) = write("plain", false);
        assert!(written.iter().filter(|r| !r.tomb).all(|r| r.hash != 0));
        let bytes = fs::read(&chunked).unwrap();
        assert!(
            bytes == fs::read(&plain).unwrap(),
            "the same bytes either way"
        );
        let scanned = scan_segment(&chunked, 0).unwrap().unwrap();
        assert_eq!(scanned.end, bytes.len() as u64);
        let found: Vec<Record> = scanned.records.iter().map(|(r, _)| *r).collect();
        assert_eq!(found, written);
        for (r, off) in &scanned.records {
            let payload = &bytes[*off as usize..(off + r.len) as usize];
            if !r.tomb {
                assert_eq!(r.hash, xxh3_64(payload));
                assert_eq!(payload, payloads[r.key.0[0] as usize].as_slice());
            }
        }
        // A crash after a large page's payload, before its header: the records before it.
        let (_, big_off) = scanned.records[4];
        let header_at = (big_off - RECORD_HEADER_BYTES) as usize;
        let mut torn = bytes.clone();
        torn[header_at..big_off as usize].fill(0);
        for cut in [torn.len(), big_off as usize + c / 2, header_at + 5] {
            fs::write(&chunked, &torn[..cut]).unwrap();
            let s = scan_segment(&chunked, 0).unwrap().unwrap();
            assert_eq!(s.records.len(), 4, "cut at {cut}");
            assert_eq!(s.end, header_at as u64);
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stamps_increase() {
        let a = next_stamp();
        let b = next_stamp();
        assert!(b > a);
    }
}
