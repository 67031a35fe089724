//! The storage tier (L3) as the factory builds it: a [`StorageTier`] section opened into a
//! store and mapped onto `radixkv_hicache::StorageConfig`.

use std::sync::Arc;
use std::time::Duration;

use radixkv_hicache::storage::{
    FileStore, FileStoreConfig, MemStore, PageFormat, RECORD_HEADER_BYTES, StorageBackend,
    StoreError, TierOptions,
};
use radixkv_hicache::{KvGeometry, PoolName, StorageConfig};
use radixkv_radix::KvIdentity;

use crate::config::{ModelGeometry, StorageBackendKind, StorageTier};
use crate::error::{ManagerError, Result};

/// What a built storage tier keeps alive beside the cache (the Redis client's runtime), dropped
/// after it.
pub(crate) type Keepalive = Option<Box<dyn Send>>;

/// The identity under which pages of `model_id` are keyed: the model's name, its modeled KV
/// geometry and the layout of the bytes the store holds (the pools of `g`: the model's own
/// with an engine's backend, HostSim's simulated ones otherwise), and for a hybrid model the
/// extra-pool sections its stored pages carry (`sections`: pool and bytes of one item), so a
/// store never mixes the pages of layouts that differ only there.
pub(crate) fn identity(
    model_id: &str,
    model: &ModelGeometry,
    g: &KvGeometry,
    sections: &[(PoolName, usize)],
) -> KvIdentity {
    let mut layout = format!(
        "model kv {} layers x {} B/token/layer; stored {} layers x {} B/token/layer, pages of \
         {} tokens",
        model.layers,
        model.kv_bytes_per_token_per_layer,
        g.layers,
        g.bytes_per_token_layer,
        g.page_size
    );
    for (pool, bytes) in sections {
        layout.push_str(&format!("; {pool:?} sections of {bytes} B"));
    }
    KvIdentity::new(model_id, layout)
}

/// Opens the store `s` names for `model`'s KV in pools of geometry `g`, whose stored pages
/// carry `sections` (a hybrid model's Mamba states and window KV), or takes the engine's
/// `given` one, and maps the section onto the library's configuration.
///
/// # Errors
/// [`ManagerError::Config`] when the section and `given` disagree (an engine store without
/// `type = "engine"`, or `type = "engine"` without one); [`ManagerError::Storage`] when the
/// store cannot be opened or reached; [`ManagerError::FeatureOff`] for Redis in a build
/// without the `redis` feature.
pub(crate) fn open(
    s: &StorageTier,
    model: &ModelGeometry,
    g: &KvGeometry,
    sections: &[(PoolName, usize)],
    given: Option<Arc<dyn StorageBackend>>,
) -> Result<(StorageConfig, Keepalive)> {
    let identity = identity(&s.model_id, model, g, sections);
    // The capacity counts pages carrying every section (an upper bound on each page).
    let format = PageFormat::new(*g, &identity, sections)?;
    let pools: Vec<PoolName> = sections.iter().map(|&(p, _)| p).collect();
    let page_bytes = format.encoded_len(&pools) as u64;
    let cap = |tokens: Option<usize>| tokens.map(|t| (t / g.page_size.max(1)) as u64 * page_bytes);
    let mut tier = TierOptions {
        batch_pages: s.batch_pages,
        concurrency: s.concurrency,
        op_timeout: Duration::from_millis(s.op_timeout_ms),
        runtime: None,
        worker_threads: s.worker_threads,
    };
    let keep: Keepalive;
    let store: Arc<dyn StorageBackend> = match (&s.backend, given) {
        (StorageBackendKind::Engine, Some(store)) => {
            keep = None;
            store
        }
        (StorageBackendKind::Engine, None) => {
            return Err(ManagerError::Config(
                "cache.storage.backend type = \"engine\" needs a store handed to \
                 ManagerBuilder::storage_backend"
                    .into(),
            ));
        }
        (_, Some(store)) => {
            return Err(ManagerError::Config(format!(
                "a store ({}) was handed to ManagerBuilder::storage_backend but \
                 cache.storage.backend names another; set type = \"engine\"",
                store.name()
            )));
        }
        (
            StorageBackendKind::File {
                dir,
                capacity_tokens,
                sync,
            },
            None,
        ) => {
            // The tier checks every page it loads against the page format's checksum and
            // discards a damaged one through the store: the store's own read check would be
            // a second pass over each page.
            let mut c = FileStoreConfig::new(dir.clone())
                .with_sync(*sync)
                .with_payload_checksums(false);
            // The file store's cap counts its bytes on disk: each page's record header too.
            c.cap_bytes = capacity_tokens
                .map(|t| (t / g.page_size.max(1)) as u64 * (page_bytes + RECORD_HEADER_BYTES));
            keep = None;
            Arc::new(FileStore::open_blocking(c).map_err(|e| store_error("file", &e))?)
        }
        (StorageBackendKind::Memory { capacity_tokens }, None) => {
            keep = None;
            match cap(*capacity_tokens) {
                Some(b) => Arc::new(MemStore::with_cap(b)),
                None => Arc::new(MemStore::new()),
            }
        }
        (
            StorageBackendKind::Redis {
                url,
                cluster,
                key_prefix,
            },
            None,
        ) => {
            let (store, rt) = open_redis(url, *cluster, key_prefix, s, &mut tier)?;
            keep = Some(rt);
            store
        }
    };
    let cfg = StorageConfig {
        store,
        identity,
        prefetch_threshold_tokens: s.prefetch_threshold_tokens,
        prefetch_cap_tokens: s.prefetch_cap_tokens,
        stop: s.stop.to_hicache(),
        tier,
    };
    Ok((cfg, keep))
}

fn store_error(kind: &str, e: &StoreError) -> ManagerError {
    ManagerError::Storage(format!("cannot open the {kind} store: {e}"))
}

/// A tokio runtime shut down without waiting when dropped (the Redis client's tasks run on
/// it; dropping it inside an async context must not block).
#[cfg(feature = "redis")]
struct OwnedRuntime(tokio::runtime::Runtime);

#[cfg(feature = "redis")]
impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        let rt = std::mem::replace(
            &mut self.0,
            // A runtime with no threads: nothing to shut down.
            match tokio::runtime::Builder::new_current_thread().build() {
                Ok(rt) => rt,
                Err(_) => return,
            },
        );
        rt.shutdown_background();
    }
}

#[cfg(feature = "redis")]
fn open_redis(
    url: &str,
    cluster: bool,
    key_prefix: &str,
    s: &StorageTier,
    tier: &mut TierOptions,
) -> Result<(Arc<dyn StorageBackend>, Box<dyn Send>)> {
    use radixkv_hicache::storage::{RedisConfig, RedisStore};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(s.worker_threads)
        .thread_name("radixkv-storage")
        .enable_all()
        .build()
        .map_err(|e| ManagerError::Storage(format!("cannot start the storage runtime: {e}")))?;
    let rt = OwnedRuntime(rt);
    let mut cfg = if cluster {
        RedisConfig::cluster(url.split(','))
    } else {
        RedisConfig::new(url)
    };
    cfg = cfg
        .with_key_prefix(key_prefix)
        .with_op_timeout(Duration::from_millis(s.op_timeout_ms));
    let store =
        rt.0.block_on(RedisStore::connect(cfg))
            .map_err(|e| store_error("redis", &e))?;
    tier.runtime = Some(rt.0.handle().clone());
    Ok((Arc::new(store), Box::new(rt)))
}

#[cfg(not(feature = "redis"))]
fn open_redis(
    _url: &str,
    _cluster: bool,
    _key_prefix: &str,
    _s: &StorageTier,
    _tier: &mut TierOptions,
) -> Result<(Arc<dyn StorageBackend>, Box<dyn Send>)> {
    Err(ManagerError::FeatureOff {
        what: "cache.storage.backend type = \"redis\"",
        feature: "redis",
    })
}
