//! [`FaultStore`]: a wrapper that makes any store fail, stall, lie and corrupt on purpose,
//! deterministically from a seed, so the tier above can be tested against every way a real
//! store misbehaves.
//!
//! Per operation, in this order (each drawn from the seeded stream; a fault that fires ends
//! the list):
//! 1. **Down** ([`FaultStore::set_down`]): every operation fails at once with
//!    [`StoreError::Unavailable`] until the store is set up again.
//! 2. **Error** (`error`): the operation fails, half the time with
//!    [`StoreError::Unavailable`] and half with [`StoreError::Io`], without reaching the
//!    wrapped store.
//! 3. **Hang** (`hang`): the operation never reaches the wrapped store and never completes;
//!    only dropping its future (the deadline of the tier above) ends it.
//! 4. **Partial batch** (`partial`, for a non-empty batch): `exists_prefix` answers a shorter
//!    prefix, `get` answers `None` for a suffix of the keys, `put` stores only a prefix of the
//!    pages and answers `false` for the rest.
//! 5. **Corruption** (`corrupt`, per page a `get` returns): one byte flipped, the page cut
//!    short, or a byte appended — a [`super::PageFormat`] decode of it always fails.
//! 6. **Slow** (`slow`): the operation runs, then its answer is held back `slow_ms`
//!    milliseconds (a put that answers late has stored its pages). The wait runs on tokio's
//!    blocking pool (no timer driver needed) and ends early when the future is dropped.
//!
//! Every fault that fires is counted ([`FaultCounts`]). With every probability 0 (the
//! default) and the store up, the wrapper is transparent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use radixkv_radix::PageKey;

use super::backend::{StorageBackend, StoreError, StoreFuture, StoreStats};

/// What a [`FaultStore`] injects: probabilities in `0.0..=1.0` and the seed of its stream.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultConfig {
    /// The seed of the pseudo-random stream every fault is drawn from.
    pub seed: u64,
    /// Chance that an operation fails (`Unavailable` or `Io`).
    pub error: f64,
    /// Chance that an operation never completes.
    pub hang: f64,
    /// Chance that a non-empty batch is answered in part.
    pub partial: f64,
    /// Chance that each page a `get` returns is corrupted.
    pub corrupt: f64,
    /// Chance that an operation's answer is held back [`FaultConfig::slow_ms`].
    pub slow: f64,
    /// How long a slow answer is held back, in milliseconds.
    pub slow_ms: u64,
}

impl FaultConfig {
    /// A transparent configuration with stream `seed` (set the probabilities on it).
    pub fn seeded(seed: u64) -> Self {
        FaultConfig {
            seed,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<(), StoreError> {
        for (name, p) in [
            ("error", self.error),
            ("hang", self.hang),
            ("partial", self.partial),
            ("corrupt", self.corrupt),
            ("slow", self.slow),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(StoreError::Config(format!(
                    "fault probability {name} = {p} is not within 0..=1"
                )));
            }
        }
        Ok(())
    }
}

/// How many faults of each kind a [`FaultStore`] injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Operations refused because the store was down.
    pub down: u64,
    /// Operations failed with an injected error.
    pub errors: u64,
    /// Operations that hung.
    pub hangs: u64,
    /// Batches answered in part.
    pub partial_batches: u64,
    /// Pages corrupted on their way out of `get`.
    pub corrupted_pages: u64,
    /// Answers held back.
    pub slow: u64,
}

#[derive(Debug, Default)]
struct AtomicCounts {
    down: AtomicU64,
    errors: AtomicU64,
    hangs: AtomicU64,
    partial_batches: AtomicU64,
    corrupted_pages: AtomicU64,
    slow: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// SplitMix64: a small, fast, seeded stream, good enough to draw faults from.
#[derive(Debug)]
struct Stream(u64);

impl Stream {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0.0..1.0`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

#[derive(Debug)]
struct State {
    config: FaultConfig,
    stream: Stream,
}

/// The faults drawn for one operation before it runs.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// Cut a non-empty batch of `n` at `cut(n)` (in `0..n`).
    partial: Option<u64>,
    slow: Option<Duration>,
}

impl Plan {
    fn cut(&self, n: usize) -> Option<usize> {
        self.partial
            .filter(|_| n > 0)
            .map(|r| (r % n as u64) as usize)
    }
}

/// A wrapper over any store injecting seeded faults (see the module docs for the kinds and
/// their order), with a switch to take the store down and bring it up again.
///
/// ```
/// # use radixkv_hicache::storage::{FaultConfig, FaultStore, MemStore, StorageBackend, StoreError};
/// # use radixkv_radix::PageKey;
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = FaultStore::new(MemStore::new(), FaultConfig::seeded(7))?;
/// store.set_down(true);
/// assert!(matches!(store.get(&[PageKey([1; 32])]).await, Err(StoreError::Unavailable(_))));
/// store.set_down(false);
/// assert_eq!(store.get(&[PageKey([1; 32])]).await?, [None]);
/// assert_eq!(store.counts().down, 1);
/// # Ok::<(), StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct FaultStore<S> {
    inner: S,
    state: Mutex<State>,
    down: AtomicBool,
    counts: AtomicCounts,
}

impl<S: StorageBackend> FaultStore<S> {
    /// Wraps `inner`, injecting the faults of `config`.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a probability outside `0.0..=1.0` (or NaN).
    pub fn new(inner: S, config: FaultConfig) -> Result<Self, StoreError> {
        config.validate()?;
        Ok(FaultStore {
            inner,
            state: Mutex::new(State {
                config,
                stream: Stream(config.seed),
            }),
            down: AtomicBool::new(false),
            counts: AtomicCounts::default(),
        })
    }

    /// Replaces the fault configuration and restarts the stream from its seed.
    ///
    /// # Errors
    /// As [`FaultStore::new`]; the old configuration stays on an error.
    pub fn set_config(&self, config: FaultConfig) -> Result<(), StoreError> {
        config.validate()?;
        let mut st = self.lock();
        st.config = config;
        st.stream = Stream(config.seed);
        Ok(())
    }

    /// The fault configuration.
    pub fn config(&self) -> FaultConfig {
        self.lock().config
    }

    /// Takes the store down (`true`: every operation fails with
    /// [`StoreError::Unavailable`]) or brings it up again (`false`). Operations already past
    /// the check finish normally.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Whether the store is down.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// The faults injected so far.
    pub fn counts(&self) -> FaultCounts {
        let c = &self.counts;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FaultCounts {
            down: r(&c.down),
            errors: r(&c.errors),
            hangs: r(&c.hangs),
            partial_batches: r(&c.partial_batches),
            corrupted_pages: r(&c.corrupted_pages),
            slow: r(&c.slow),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a config and a stream position: always consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The faults of one operation that come before it runs: `Err` to fail it now, `Ok(None)`
    /// to hang, `Ok(Some(plan))` to run it with the later faults of `plan`.
    fn before(&self) -> Result<Option<Plan>, StoreError> {
        if self.is_down() {
            bump(&self.counts.down);
            return Err(StoreError::Unavailable(
                "store is down (fault injection)".into(),
            ));
        }
        let mut st = self.lock();
        let c = st.config;
        // Always the same number of draws per operation, whatever fires.
        let (e, kind, h, p, cut, s) = (
            st.stream.unit(),
            st.stream.next_u64(),
            st.stream.unit(),
            st.stream.unit(),
            st.stream.next_u64(),
            st.stream.unit(),
        );
        drop(st);
        if e < c.error {
            bump(&self.counts.errors);
            return Err(if kind & 1 == 0 {
                StoreError::Unavailable("injected fault".into())
            } else {
                StoreError::Io("injected fault".into())
            });
        }
        if h < c.hang {
            bump(&self.counts.hangs);
            return Ok(None);
        }
        Ok(Some(Plan {
            partial: (p < c.partial).then_some(cut),
            slow: (s < c.slow).then(|| Duration::from_millis(c.slow_ms)),
        }))
    }

    /// Holds the answer back when the plan says so.
    async fn after(&self, plan: &Plan) -> Result<(), StoreError> {
        let Some(d) = plan.slow else {
            return Ok(());
        };
        bump(&self.counts.slow);
        if d.is_zero() {
            return Ok(());
        }
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            StoreError::Config("a slow fault waits on a tokio runtime; none is current".into())
        })?;
        // The sender lives in this future: dropping the future disconnects the channel and
        // ends the wait at once.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let waited = handle
            .spawn_blocking(move || {
                let _ = rx.recv_timeout(d);
            })
            .await;
        drop(tx);
        waited.map_err(|e| StoreError::Unavailable(format!("slow fault: {e}")))
    }

    /// Corrupts `page` in one of three ways.
    fn corrupt(&self, page: &mut Vec<u8>) {
        let mut st = self.lock();
        let (how, at, x) = (
            st.stream.below(3),
            st.stream.next_u64(),
            st.stream.next_u64(),
        );
        drop(st);
        bump(&self.counts.corrupted_pages);
        match how {
            0 if !page.is_empty() => {
                let i = (at % page.len() as u64) as usize;
                // A non-zero mask: the byte always changes.
                page[i] ^= 1 + (x % 255) as u8;
            }
            1 if !page.is_empty() => page.truncate((at % page.len() as u64) as usize),
            _ => page.push(x as u8),
        }
    }

    /// A put of `len` pages: the faults, then `put(n)`, which stores the first `n` pages in
    /// the wrapped store.
    fn put_with<'a>(
        &'a self,
        len: usize,
        put: impl FnOnce(usize) -> StoreFuture<'a, Vec<bool>> + Send + 'a,
    ) -> StoreFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let Some(plan) = self.before()? else {
                return hang().await;
            };
            let cut = plan.cut(len);
            let stored = cut.unwrap_or(len);
            if cut.is_some() {
                bump(&self.counts.partial_batches);
            }
            let mut out = put(stored).await?;
            out.resize(len, false);
            self.after(&plan).await?;
            Ok(out)
        })
    }
}

async fn hang<T>() -> Result<T, StoreError> {
    std::future::pending().await
}

impl<S: StorageBackend> StorageBackend for FaultStore<S> {
    fn name(&self) -> &'static str {
        "fault"
    }

    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let Some(plan) = self.before()? else {
                return hang().await;
            };
            let mut n = self.inner.exists_prefix(keys).await?;
            if let Some(cut) = plan.cut(keys.len()) {
                bump(&self.counts.partial_batches);
                n = n.min(cut);
            }
            self.after(&plan).await?;
            Ok(n)
        })
    }

    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>> {
        Box::pin(async move {
            let Some(plan) = self.before()? else {
                return hang().await;
            };
            let mut pages = self.inner.get(keys).await?;
            if let Some(cut) = plan.cut(pages.len()) {
                bump(&self.counts.partial_batches);
                pages[cut..].iter_mut().for_each(|p| *p = None);
            }
            let p = self.lock().config.corrupt;
            if p > 0.0 {
                for page in pages.iter_mut().flatten() {
                    let u = self.lock().stream.unit();
                    if u < p {
                        self.corrupt(page);
                    }
                }
            }
            self.after(&plan).await?;
            Ok(pages)
        })
    }

    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>> {
        self.put_with(pages.len(), move |stored| self.inner.put(&pages[..stored]))
    }

    fn put_owned(&self, mut pages: Vec<(PageKey, Vec<u8>)>) -> StoreFuture<'_, Vec<bool>> {
        self.put_with(pages.len(), move |stored| {
            pages.truncate(stored);
            self.inner.put_owned(pages)
        })
    }

    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let Some(plan) = self.before()? else {
                return hang().await;
            };
            let n = self.inner.delete(keys).await?;
            self.after(&plan).await?;
            Ok(n)
        })
    }

    fn discard_damaged<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let Some(plan) = self.before()? else {
                return hang().await;
            };
            let n = self.inner.discard_damaged(keys).await?;
            self.after(&plan).await?;
            Ok(n)
        })
    }

    /// The wrapped store's counters, with the operations failed by injected errors and by
    /// the store being down added to `errors`.
    fn stats(&self) -> StoreStats {
        let mut s = self.inner.stats();
        let c = self.counts();
        s.errors += c.errors + c.down;
        s
    }
}
