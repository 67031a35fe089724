//! [`RedisStore`]: the storage tier on a Redis server (cargo feature `redis`); the details
//! are on the type.

use std::time::Duration;

use radixkv_radix::PageKey;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::backend::{Counters, StorageBackend, StoreError, StoreFuture, StoreStats};

/// Redis refuses strings longer than this (its `proto-max-bulk-len` default); larger pages are
/// refused by [`RedisStore`]'s `put` without a round trip.
pub const REDIS_MAX_VALUE_BYTES: usize = 512 * 1024 * 1024;

/// How a [`RedisStore`] reaches its server and names its pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    /// The server: `redis://[[user]:password@]host[:port][/db]`, or
    /// `redis+unix:///path/to/socket[?db=n]`. TLS (`rediss://`) is not built in and is
    /// refused with [`StoreError::Config`].
    pub url: String,
    /// Prepended to every page's hex key, so several caches (clusters of servers, models,
    /// test runs) share one server without seeing each other's pages. May be empty.
    pub key_prefix: String,
    /// How long a stored page lives after its last write (`SET … PX`); `None` keeps it until
    /// it is deleted or the server evicts it (`maxmemory-policy`). Must be at least 1 ms.
    pub ttl: Option<Duration>,
    /// The deadline of one operation (a whole batch, all its pipelines, and any reconnection
    /// it waits for); past it the operation fails with [`StoreError::Timeout`]. Must be
    /// non-zero.
    pub op_timeout: Duration,
    /// The most pages in one pipeline (one round trip). Must be at least 1.
    pub max_batch: usize,
}

impl RedisConfig {
    /// The configuration of a store at `url` with the defaults: key prefix `"radixkv:"`, no
    /// TTL, a 2 s operation deadline, pipelines of at most 128 pages.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            key_prefix: "radixkv:".to_owned(),
            ttl: None,
            op_timeout: Duration::from_secs(2),
            max_batch: 128,
        }
    }

    /// This configuration with another key prefix.
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// This configuration with a TTL on every page written.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// This configuration with another operation deadline.
    pub fn with_op_timeout(mut self, timeout: Duration) -> Self {
        self.op_timeout = timeout;
        self
    }

    /// This configuration with another pipeline size.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    fn check(&self) -> Result<(), StoreError> {
        let bad = |s: &str| Err(StoreError::Config(format!("redis store: {s}")));
        if self.max_batch == 0 {
            return bad("max_batch must be at least 1");
        }
        if self.op_timeout.is_zero() {
            return bad("op_timeout must be non-zero");
        }
        if let Some(ttl) = self.ttl
            && ttl.as_millis() == 0
        {
            return bad("a TTL must be at least 1 ms");
        }
        if self.url.starts_with("rediss:") || self.url.starts_with("valkeys:") {
            return bad("TLS (rediss://) is not built into this store");
        }
        Ok(())
    }
}

/// A store of encoded pages on one Redis server.
///
/// Every page is one Redis string: the key is the store's key prefix followed by the page key
/// in hex (`radixkv:` + 64 hex digits by default), the value is the encoded page
/// ([`super::PageFormat`]) as the tier above wrote it. A batch is cut into pipelines of at
/// most [`RedisConfig::max_batch`] pages, each one round trip:
///
/// | operation | commands |
/// | --- | --- |
/// | [`exists_prefix`](StorageBackend::exists_prefix) | `EXISTS k` per key; the next pipeline is sent only while no gap has been seen |
/// | [`get`](StorageBackend::get) | one `MGET k…` |
/// | [`put`](StorageBackend::put) | `SET k v` per page (`SET k v PX ttl` with a TTL) |
/// | [`delete`](StorageBackend::delete) | one `DEL k…` |
///
/// The connection is the `redis` crate's connection manager: one multiplexed connection that
/// is re-established in the background after it is lost, so a store outlives a restart of its
/// server (operations in between fail with [`StoreError::Unavailable`]).
///
/// # One server, not a cluster
///
/// This store speaks to **one Redis server**, or to anything on one address that speaks the
/// Redis protocol and accepts `EXISTS`, `SET`, and `MGET`/`DEL` over any set of keys (for
/// instance a proxy that splits multi-key commands across shards; no such proxy is tested
/// here). It is not a Redis Cluster client: it does not follow `MOVED`/`ASK` redirections,
/// and a cluster node refuses `MGET`/`DEL` over keys of several hash slots (`CROSSSLOT`), as a
/// batch's keys are. Pointed at a cluster node, batches fail with [`StoreError::Protocol`] (a
/// miss: the tier recomputes); they never return wrong pages. Do not put a hash tag (`{…}`)
/// in the key prefix to make a cluster accept the batches: that pins every page to one slot,
/// so to one node.
///
/// # Counters
///
/// [`StorageBackend::stats`] counts what this client did: pages asked for and found, pages
/// and bytes written, failed operations. The server is shared and expires pages by itself
/// (TTL, `maxmemory` eviction), so this client cannot know how many pages are stored:
/// `pages`, `bytes` and `evicted_pages` stay 0. [`RedisStore::count_pages`] asks the server
/// (a `SCAN` of the prefix: a tool for tests and operators, not for the hot path).
///
/// # Use
///
/// Made with [`RedisStore::connect`] inside a tokio runtime; its connection lives on that
/// runtime (use the store from tasks of the runtime that made it). Cheap to share as
/// `Arc<dyn StorageBackend>`.
pub struct RedisStore {
    conn: ConnectionManager,
    config: RedisConfig,
    counters: Counters,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.config.key_prefix)
            .field("ttl", &self.config.ttl)
            .field("op_timeout", &self.config.op_timeout)
            .field("max_batch", &self.config.max_batch)
            .finish_non_exhaustive()
    }
}

/// The store's error for a client error.
fn store_error(e: &RedisError) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout;
    }
    if e.is_connection_refusal() || e.is_connection_dropped() || e.is_io_error() {
        return StoreError::Unavailable(e.to_string());
    }
    match e.kind() {
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly,
        )
        | ErrorKind::AuthenticationFailed
        | ErrorKind::ClusterConnectionNotFound => StoreError::Unavailable(e.to_string()),
        ErrorKind::InvalidClientConfig => StoreError::Config(e.to_string()),
        // `OOM command not allowed` and the like: the server took the request and failed it.
        ErrorKind::Extension if e.code() == Some("OOM") => StoreError::Io(e.to_string()),
        _ => StoreError::Protocol(e.to_string()),
    }
}

impl RedisStore {
    /// A store on the server of `config`, checked with a `PING` within `config.op_timeout`.
    /// Must be called inside a tokio runtime (the connection's tasks run on it).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a bad configuration or URL, [`StoreError::Unavailable`] or
    /// [`StoreError::Timeout`] when the server does not answer.
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        config.check()?;
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| StoreError::Config(format!("redis store: {e}")))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.op_timeout))
            .set_response_timeout(Some(config.op_timeout))
            // Reconnection attempts back off from 10 ms to at most 1 s; a lost server is
            // retried again by the next operation after these are spent.
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_secs(1))
            .set_number_of_retries(3);
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| StoreError::Config(format!("redis store: {e}")))?;
        let store = RedisStore {
            conn,
            config,
            counters: Counters::default(),
        };
        store
            .timed(async {
                let mut c = store.conn.clone();
                redis::cmd("PING").query_async::<()>(&mut c).await
            })
            .await?;
        Ok(store)
    }

    /// The configuration the store was made with.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The Redis key of a page: the key prefix, then the page key in hex.
    pub fn redis_key(&self, key: &PageKey) -> String {
        let mut s = String::with_capacity(self.config.key_prefix.len() + 64);
        s.push_str(&self.config.key_prefix);
        s.push_str(&key.to_hex());
        s
    }

    /// How many pages under this store's key prefix the server holds now, by a `SCAN` of the
    /// whole keyspace (cost proportional to the server's keys: for tests and operators, not
    /// the hot path). Keys under the prefix that are not page keys (64 hex digits) are not
    /// counted. Bounded by `op_timeout` like every operation.
    ///
    /// # Errors
    /// As every operation: [`StoreError::Unavailable`], [`StoreError::Timeout`],
    /// [`StoreError::Protocol`].
    pub async fn count_pages(&self) -> Result<u64, StoreError> {
        let pattern = format!("{}*", glob_escape(&self.config.key_prefix));
        let plen = self.config.key_prefix.len();
        let r = self
            .timed(async {
                let mut c = self.conn.clone();
                let mut cursor = 0u64;
                let mut n = 0u64;
                loop {
                    let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut c)
                        .await?;
                    n += keys
                        .iter()
                        .filter(|k| {
                            k.len() == plen + 64 && k[plen..].iter().all(u8::is_ascii_hexdigit)
                        })
                        .count() as u64;
                    if next == 0 {
                        return Ok(n);
                    }
                    cursor = next;
                }
            })
            .await;
        self.count_error(r)
    }

    /// Runs `f` within the operation deadline, mapping the client's errors.
    async fn timed<T>(
        &self,
        f: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.config.op_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(store_error(&e)),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    fn count_error<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if r.is_err() {
            Counters::add(&self.counters.errors, 1);
        }
        r
    }
}

/// `s` with the glob characters of Redis's `MATCH` patterns escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^' | '-') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl StorageBackend for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let r = self
                .timed(async {
                    let mut c = self.conn.clone();
                    let mut found = 0usize;
                    for chunk in keys.chunks(self.config.max_batch) {
                        let mut p = redis::pipe();
                        for k in chunk {
                            p.cmd("EXISTS").arg(self.redis_key(k));
                        }
                        let there: Vec<i64> = p.query_async(&mut c).await?;
                        let run = there.iter().take_while(|&&n| n == 1).count();
                        found += run;
                        if run < chunk.len() {
                            break;
                        }
                    }
                    Ok(found)
                })
                .await;
            self.count_error(r)
        })
    }

    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>> {
        Box::pin(async move {
            let r = self
                .timed(async {
                    let mut c = self.conn.clone();
                    let mut out = Vec::with_capacity(keys.len());
                    for chunk in keys.chunks(self.config.max_batch) {
                        let names: Vec<String> = chunk.iter().map(|k| self.redis_key(k)).collect();
                        let got: Vec<Option<Vec<u8>>> =
                            redis::cmd("MGET").arg(&names).query_async(&mut c).await?;
                        if got.len() != chunk.len() {
                            return Err(RedisError::from((
                                ErrorKind::UnexpectedReturnType,
                                "MGET answered another number of values than keys",
                            )));
                        }
                        out.extend(got);
                    }
                    Ok(out)
                })
                .await;
            let out = self.count_error(r)?;
            Counters::add(&self.counters.get_pages, keys.len() as u64);
            Counters::add(
                &self.counters.get_hits,
                out.iter().filter(|v| v.is_some()).count() as u64,
            );
            Ok(out)
        })
    }

    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let stored: Vec<bool> = pages
                .iter()
                .map(|(_, b)| b.len() <= REDIS_MAX_VALUE_BYTES)
                .collect();
            let ttl_ms = self
                .config
                .ttl
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
            let r = self
                .timed(async {
                    let mut c = self.conn.clone();
                    let todo = pages
                        .iter()
                        .filter(|(_, b)| b.len() <= REDIS_MAX_VALUE_BYTES);
                    let todo: Vec<&(PageKey, Vec<u8>)> = todo.collect();
                    for chunk in todo.chunks(self.config.max_batch) {
                        let mut p = redis::pipe();
                        for (k, b) in chunk {
                            let cmd = p.cmd("SET").arg(self.redis_key(k)).arg(b.as_slice());
                            if let Some(ms) = ttl_ms {
                                cmd.arg("PX").arg(ms);
                            }
                        }
                        p.query_async::<()>(&mut c).await?;
                    }
                    Ok(())
                })
                .await;
            self.count_error(r)?;
            let written = pages.iter().zip(&stored).filter(|&(_, &s)| s);
            let (n, bytes) = written.fold((0u64, 0u64), |(n, by), ((_, b), _)| {
                (n + 1, by + b.len() as u64)
            });
            Counters::add(&self.counters.put_pages, n);
            Counters::add(&self.counters.put_bytes, bytes);
            Ok(stored)
        })
    }

    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            let r = self
                .timed(async {
                    let mut c = self.conn.clone();
                    let mut removed = 0usize;
                    for chunk in keys.chunks(self.config.max_batch) {
                        let names: Vec<String> = chunk.iter().map(|k| self.redis_key(k)).collect();
                        let n: usize = redis::cmd("DEL").arg(&names).query_async(&mut c).await?;
                        removed += n;
                    }
                    Ok(removed)
                })
                .await;
            self.count_error(r)
        })
    }

    fn stats(&self) -> StoreStats {
        self.counters.snapshot(0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_refusals() {
        let ok = RedisConfig::new("redis://127.0.0.1:6379");
        assert_eq!(ok.check(), Ok(()));
        for bad in [
            ok.clone().with_max_batch(0),
            ok.clone().with_op_timeout(Duration::ZERO),
            ok.clone().with_ttl(Duration::from_micros(999)),
            RedisConfig::new("rediss://127.0.0.1:6379"),
        ] {
            assert!(matches!(bad.check(), Err(StoreError::Config(_))), "{bad:?}");
        }
    }

    #[test]
    fn connect_refuses_bad_urls_without_a_server() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for url in ["http://127.0.0.1:1", "not a url", "redis://"] {
            let r = rt.block_on(RedisStore::connect(RedisConfig::new(url)));
            assert!(matches!(r, Err(StoreError::Config(_))), "{url}: {r:?}");
        }
    }

    #[test]
    fn glob_escape_escapes_patterns() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(glob_escape("radixkv:"), "radixkv:");
    }
}
