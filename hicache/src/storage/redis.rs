//! [`RedisStore`]: the storage tier on a Redis server or a Redis Cluster (cargo feature
//! `redis`); the details are on the type.

use std::time::Duration;

use futures_util::future::try_join_all;
use radixkv_radix::PageKey;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};

use super::backend::{Counters, StorageBackend, StoreError, StoreFuture, StoreStats};

/// Redis refuses strings longer than this (its `proto-max-bulk-len` default); larger pages are
/// refused by [`RedisStore`]'s `put` without a round trip.
pub const REDIS_MAX_VALUE_BYTES: usize = 512 * 1024 * 1024;

/// The longest TTL accepted (Redis refuses expiry times that overflow its 64-bit clock).
const MAX_TTL_MS: u128 = 1 << 62;

/// How a [`RedisStore`] reaches its server and names its pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    /// The server: `redis://[[user]:password@]host[:port][/db]`, or
    /// `redis+unix:///path/to/socket[?db=n]`. With [`RedisConfig::cluster`], one or more
    /// nodes of the cluster separated by commas (`redis://kv-node-1:7000,redis://kv-node-2:7000`):
    /// the client learns the others from them. TLS (`rediss://`) is not built in and is
    /// refused with [`StoreError::Config`].
    pub url: String,
    /// Whether `url` names nodes of a Redis Cluster (see [`RedisStore`]'s "Redis Cluster").
    pub cluster: bool,
    /// Prepended to every page's hex key, so several caches (fleets, models, test runs) share
    /// one server without seeing each other's pages. May be empty. On a cluster it must not
    /// contain `{`: a hash tag would pin every page to one slot, so to one node.
    pub key_prefix: String,
    /// How long a stored page lives after its last write (`SET … PX`); `None` keeps it until
    /// it is deleted or the server evicts it (`maxmemory-policy`). Must be at least 1 ms (and
    /// at most 2^62 ms).
    pub ttl: Option<Duration>,
    /// The deadline of one operation (a whole batch, all its round trips, and any
    /// reconnection it waits for); past it the operation fails with [`StoreError::Timeout`].
    /// Must be non-zero.
    pub op_timeout: Duration,
    /// The most pages in one pipeline (one round trip) or, on a cluster, in one group of
    /// concurrent commands. Must be at least 1.
    pub max_batch: usize,
}

impl RedisConfig {
    /// The configuration of a store on the server at `url` with the defaults: not a cluster,
    /// key prefix `"radixkv:"`, no TTL, a 2 s operation deadline, batches of at most 128
    /// pages.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            cluster: false,
            key_prefix: "radixkv:".to_owned(),
            ttl: None,
            op_timeout: Duration::from_secs(2),
            max_batch: 128,
        }
    }

    /// The configuration of a store on the Redis Cluster whose nodes (some of them) are
    /// `urls`, with the defaults of [`RedisConfig::new`].
    pub fn cluster<S: AsRef<str>>(urls: impl IntoIterator<Item = S>) -> Self {
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_owned()).collect();
        RedisConfig {
            cluster: true,
            ..Self::new(urls.join(","))
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

    /// This configuration with another batch size.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// The node URLs of `url`.
    fn urls(&self) -> Vec<&str> {
        if self.cluster {
            self.url.split(',').map(str::trim).collect()
        } else {
            vec![self.url.as_str()]
        }
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
            && (ttl.as_millis() == 0 || ttl.as_millis() > MAX_TTL_MS)
        {
            return bad("a TTL must be at least 1 ms and at most 2^62 ms");
        }
        if self.cluster && self.key_prefix.contains('{') {
            return bad("the key prefix must not contain `{` (a hash tag)");
        }
        for url in self.urls() {
            if url.is_empty() {
                return bad("an empty server URL");
            }
            if url.starts_with("rediss:") || url.starts_with("valkeys:") {
                return bad("TLS (rediss://) is not built into this store");
            }
        }
        Ok(())
    }
}

/// The connection: one server through a connection manager, or a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> Result<T, RedisError> {
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
    }

    /// `cmds`' answers: one pipeline on a server; on a cluster, concurrent commands (a
    /// cluster pipeline must stay within one hash slot, and a batch's keys are in many).
    async fn each<T: FromRedisValue>(&mut self, cmds: Vec<Cmd>) -> Result<Vec<T>, RedisError> {
        match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query_async(c).await
            }
            Conn::Cluster(c) => {
                try_join_all(cmds.into_iter().map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<T>(&mut c).await }
                }))
                .await
            }
        }
    }
}

/// A store of encoded pages on a Redis server or a Redis Cluster.
///
/// Every page is one Redis string: the key is the store's key prefix followed by the page key
/// in hex (`radixkv:` + 64 hex digits by default), the value is the encoded page
/// ([`super::PageFormat`]) as the tier above wrote it. A batch is cut into groups of at most
/// [`RedisConfig::max_batch`] pages; on one server each group is one round trip:
///
/// | operation | commands per group |
/// | --- | --- |
/// | [`exists_prefix`](StorageBackend::exists_prefix) | `EXISTS k` per key, pipelined; the next group is sent only while no gap has been seen |
/// | [`get`](StorageBackend::get) | one `MGET k…` |
/// | [`put`](StorageBackend::put) | `SET k v` per page (`SET k v PX ttl` with a TTL), pipelined |
/// | [`delete`](StorageBackend::delete) | one `DEL k…` |
///
/// On one server the connection is the `redis` crate's connection manager: one multiplexed
/// connection, re-established in the background after it is lost, so a store outlives a
/// restart of its server (operations in between fail with [`StoreError::Unavailable`]).
///
/// # Redis Cluster
///
/// [`RedisConfig::cluster`] (or `cluster: true` with a comma-separated `url`) makes the store a
/// Redis Cluster client (the `redis` crate's async cluster connection): it learns the slot map
/// from the nodes given, sends each key's command to the node that owns the key's slot,
/// follows `MOVED`/`ASK` redirections and refreshes the map when slots move. `MGET` and `DEL`
/// are split by the client into one command per node; `EXISTS` and `SET` are sent as
/// concurrent single-key commands (a pipeline cannot span slots), at most
/// [`RedisConfig::max_batch`] at a time. Pages spread over the cluster by their keys' hash
/// slots, so a cluster store's key prefix must not contain a hash tag (`{…}`; refused). Pointing a
/// single-server store (`cluster: false`) at a cluster node fails every batch with keys on
/// other nodes with [`StoreError::Protocol`] (`MOVED`, `CROSSSLOT`): a miss, never wrong
/// pages. Tested here on a three-primary cluster without replicas; reading from replicas,
/// TLS and cluster-wide [`RedisStore::count_pages`] are not built.
///
/// # Counters
///
/// [`StorageBackend::stats`] counts what this client did: pages asked for and found, pages
/// and bytes written, failed operations. The server is shared and drops pages by itself (TTL,
/// `maxmemory` eviction), so this client cannot know how many pages are stored: `pages`,
/// `bytes` and `evicted_pages` stay 0. [`RedisStore::count_pages`] asks a server (a `SCAN` of
/// the prefix: a tool for tests and operators, not for the hot path).
///
/// # Use
///
/// Made with [`RedisStore::connect`] inside a tokio runtime; its connection lives on that
/// runtime (use the store from tasks of the runtime that made it). Cheap to share as
/// `Arc<dyn StorageBackend>`.
pub struct RedisStore {
    conn: Conn,
    config: RedisConfig,
    counters: Counters,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &self.config.cluster)
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

fn protocol(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::UnexpectedReturnType, what))
}

impl RedisStore {
    /// A store on the server or cluster of `config`, checked with a `PING` within
    /// `config.op_timeout`. Must be called inside a tokio runtime (the connection's tasks run
    /// on it).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a bad configuration or URL, [`StoreError::Unavailable`] or
    /// [`StoreError::Timeout`] when the server does not answer.
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        config.check()?;
        let cfg_err = |e: RedisError| StoreError::Config(format!("redis store: {e}"));
        let timeout = config.op_timeout;
        let conn = if config.cluster {
            let client = ClusterClient::builder(config.urls())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(3)
                .build()
                .map_err(cfg_err)?;
            let conn = tokio::time::timeout(timeout, client.get_async_connection())
                .await
                .map_err(|_| StoreError::Timeout)?
                .map_err(|e| store_error(&e))?;
            Conn::Cluster(conn)
        } else {
            let client = redis::Client::open(config.url.as_str()).map_err(cfg_err)?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                // Reconnection attempts back off from 10 ms to at most 1 s; a lost server is
                // retried again by the next operation after these are spent.
                .set_min_delay(Duration::from_millis(10))
                .set_max_delay(Duration::from_secs(1))
                .set_number_of_retries(3);
            Conn::Single(
                ConnectionManager::new_lazy_with_config(client, manager_config).map_err(cfg_err)?,
            )
        };
        let store = RedisStore {
            conn,
            config,
            counters: Counters::default(),
        };
        store
            .timed(async { store.conn.clone().query::<()>(&redis::cmd("PING")).await })
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
    /// [`StoreError::Config`] on a cluster (a scan of every node is not built); otherwise as
    /// every operation: [`StoreError::Unavailable`], [`StoreError::Timeout`],
    /// [`StoreError::Protocol`].
    pub async fn count_pages(&self) -> Result<u64, StoreError> {
        if self.config.cluster {
            return Err(StoreError::Config(
                "redis store: count_pages scans one server; it is not built for a cluster"
                    .to_owned(),
            ));
        }
        let pattern = format!("{}*", glob_escape(&self.config.key_prefix));
        let plen = self.config.key_prefix.len();
        let r = self
            .timed(async {
                let mut c = self.conn.clone();
                let mut cursor = 0u64;
                let mut n = 0u64;
                loop {
                    let mut scan = redis::cmd("SCAN");
                    scan.arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000);
                    let (next, keys): (u64, Vec<Vec<u8>>) = c.query(&scan).await?;
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

    /// One multi-key command (`MGET`, `DEL`) over `keys`.
    fn multi_key(&self, name: &str, keys: &[PageKey]) -> Cmd {
        let mut cmd = redis::cmd(name);
        for k in keys {
            cmd.arg(self.redis_key(k));
        }
        cmd
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
                        let cmds = chunk
                            .iter()
                            .map(|k| redis::cmd("EXISTS").arg(self.redis_key(k)).clone())
                            .collect();
                        let there: Vec<i64> = c.each(cmds).await?;
                        if there.len() != chunk.len() {
                            return Err(protocol("EXISTS answers do not match the keys"));
                        }
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
                        let got: Vec<Option<Vec<u8>>> =
                            c.query(&self.multi_key("MGET", chunk)).await?;
                        if got.len() != chunk.len() {
                            return Err(protocol("MGET answered another number of values"));
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
            let fits = |b: &Vec<u8>| b.len() <= REDIS_MAX_VALUE_BYTES;
            let stored: Vec<bool> = pages.iter().map(|(_, b)| fits(b)).collect();
            let ttl_ms = self
                .config
                .ttl
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(1 << 62));
            let r = self
                .timed(async {
                    let mut c = self.conn.clone();
                    let todo: Vec<&(PageKey, Vec<u8>)> =
                        pages.iter().filter(|(_, b)| fits(b)).collect();
                    for chunk in todo.chunks(self.config.max_batch) {
                        let cmds = chunk
                            .iter()
                            .map(|(k, b)| {
                                let mut cmd = redis::cmd("SET");
                                cmd.arg(self.redis_key(k)).arg(b.as_slice());
                                if let Some(ms) = ttl_ms {
                                    cmd.arg("PX").arg(ms);
                                }
                                cmd
                            })
                            .collect();
                        c.each::<()>(cmds).await?;
                    }
                    Ok(())
                })
                .await;
            self.count_error(r)?;
            let written = pages.iter().filter(|(_, b)| fits(b));
            let (n, bytes) =
                written.fold((0u64, 0u64), |(n, by), (_, b)| (n + 1, by + b.len() as u64));
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
                        let n: usize = c.query(&self.multi_key("DEL", chunk)).await?;
                        removed += n;
                    }
                    Ok(removed)
                })
                .await;
            self.count_error(r)
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
        let cluster = RedisConfig::cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]);
        assert_eq!(cluster.check(), Ok(()));
        assert_eq!(cluster.urls().len(), 2);
        assert_eq!(ok.clone().with_key_prefix("cache{a}:").check(), Ok(()));
        for bad in [
            ok.clone().with_max_batch(0),
            ok.clone().with_op_timeout(Duration::ZERO),
            ok.clone().with_ttl(Duration::from_micros(999)),
            ok.clone().with_ttl(Duration::MAX),
            cluster.clone().with_key_prefix("cache{a}:"),
            RedisConfig::new("rediss://127.0.0.1:6379"),
            RedisConfig::new(""),
            RedisConfig::cluster(["redis://127.0.0.1:7000", ""]),
            RedisConfig::cluster(["redis://127.0.0.1:7000", "rediss://127.0.0.1:7001"]),
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
            let r = rt.block_on(RedisStore::connect(RedisConfig::cluster([url])));
            assert!(
                matches!(r, Err(StoreError::Config(_))),
                "cluster {url}: {r:?}"
            );
        }
    }

    #[test]
    fn glob_escape_escapes_patterns() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(glob_escape("radixkv:"), "radixkv:");
    }
}
