//! Errors of the manager, the trace readers and the replay tool.

use radixkv_radix::{CacheError, InvariantViolation};

use crate::request::WaitReason;

/// Everything the manager and the replay tool can refuse. Messages name the problem so the
/// `radixkv` binary can print them as they are.
///
/// Non-exhaustive: new failure kinds may be added, so a `match` needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// An impossible or malformed configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A total device budget (`pools.total_bytes`) the Mamba policy's split rule cannot
    /// divide (see [`crate::split`]).
    #[error("invalid configuration: {0}")]
    Split(#[from] crate::split::SplitError),
    /// A cache kind whose crate is not wired into the factory yet. Every combination a
    /// configuration can express is wired in this build, so the factory does not return it
    /// now; it stays for callers that match on it.
    #[error("cache kind `{kind}` needs the `{needs}` crate, which this build does not wire in")]
    NotWired {
        /// The requested kind.
        kind: &'static str,
        /// The crate that implements it.
        needs: &'static str,
    },
    /// A feature a configuration asked for that radixkv does not have yet, in any build.
    #[error("{what} is not implemented yet")]
    NotImplemented {
        /// The feature.
        what: &'static str,
    },
    /// A configuration that needs a cargo feature this build of the crate leaves out.
    #[error(
        "{what} needs the `{feature}` cargo feature of radixkv-scheduler-api, which this build leaves out"
    )]
    FeatureOff {
        /// What the configuration asked for.
        what: &'static str,
        /// The feature.
        feature: &'static str,
    },
    /// The storage tier's store could not be opened or reached when the manager was built
    /// (a directory that cannot be created, a Redis server that does not answer). Once
    /// built, a store that fails only degrades the tier to recomputation.
    #[error("storage tier: {0}")]
    Storage(String),
    /// A device backend handed to the builder
    /// ([`ManagerBuilder::device_backend`](crate::ManagerBuilder::device_backend)) that does
    /// not fit the configuration.
    #[error("device backend `{backend}` does not fit this configuration: {mismatch}")]
    Backend {
        /// The backend's [`name`](radixkv_hicache::DeviceBackend::name).
        backend: &'static str,
        /// What does not fit.
        mismatch: BackendMismatch,
    },
    /// An error of the underlying cache (never [`CacheError::Session`]: that converts to
    /// [`ManagerError::Session`]).
    #[error(transparent)]
    Cache(CacheError),
    /// An error of the session layer (unknown session, already open, a turn that does not
    /// extend its session, ...), typed, whichever call reported it.
    #[error(transparent)]
    Session(#[from] radixkv_session::SessionError),
    /// A session call (a request tagged with a session, `open_session`, `close_session`) on a
    /// manager configured without sessions.
    #[error("session {session}: sessions are off in this configuration (no [sessions] section)")]
    SessionsOff {
        /// The session named.
        session: u64,
    },
    /// An error of the host tier (a failed or refused copy, a host-pool configuration).
    #[error("host tier: {0}")]
    Tier(#[from] radixkv_hicache::HiCacheError),
    /// A handle that names no live request of this manager (the raw [`crate::ReqId::get`]).
    /// Its request is gone, so only the handle can be named (`#slot.generation`).
    #[error("unknown request {}", crate::ReqId(*.0))]
    UnknownRequest(u64),
    /// A lifecycle call out of order (e.g. `extend` before `admit`). The message names the
    /// request by the engine's id when it gave one, else by its handle.
    #[error("request {}: {what}", request_name(*.id, .engine_id.as_deref()))]
    Lifecycle {
        /// The request's handle (the raw [`crate::ReqId::get`]).
        id: u64,
        /// The engine's id for the request ([`crate::Request::engine_id`]), if it gave one.
        engine_id: Option<String>,
        /// What was wrong.
        what: &'static str,
    },
    /// A lazy request's [`TokenSource`](crate::TokenSource) failed to give its prompt (its
    /// own error, or another number of tokens than it announced). The request stays
    /// registered and waiting, holding nothing: abort it.
    #[error("request {}: token source: {message}", request_name(*.id, .engine_id.as_deref()))]
    TokenSource {
        /// The request's handle (the raw [`crate::ReqId::get`]).
        id: u64,
        /// The engine's id for the request ([`crate::Request::engine_id`]), if it gave one.
        engine_id: Option<String>,
        /// What went wrong.
        message: String,
    },
    /// An operation that needs an idle manager (e.g. [`reset`](crate::KvCacheManager::reset))
    /// while requests are still registered.
    #[error("the manager is busy: {requests} requests are registered (finish or abort them first)")]
    Busy {
        /// Requests registered (running or waiting).
        requests: usize,
    },
    /// Not enough device memory even after evicting everything evictable.
    #[error("out of device memory: needed {needed} tokens, {available} available")]
    OutOfMemory {
        /// Tokens requested.
        needed: usize,
        /// Tokens that were available (free + evictable).
        available: usize,
    },
    /// A request that can never fit the device pool.
    #[error(
        "request {index} needs {needed} tokens of KV but the device pool holds only {capacity}"
    )]
    PoolTooSmall {
        /// Index of the request in the trace.
        index: usize,
        /// Tokens the request needs (prompt + output).
        needed: usize,
        /// Pool capacity in tokens.
        capacity: usize,
    },
    /// A replay that can make no more progress although every request fits the pool: the
    /// request at `index` cannot be admitted or allocated, and nothing is running whose finish
    /// or retraction would free memory. (A request that could never fit is
    /// [`ManagerError::PoolTooSmall`] instead.)
    #[error(
        "the replay stalled at request {index} ({needed} tokens of KV; the device pool holds \
         {capacity}): {cause}, and nothing running can free memory"
    )]
    Stalled {
        /// Index of the blocked request in the trace.
        index: usize,
        /// Tokens the request needs in all (prompt + output).
        needed: usize,
        /// Pool capacity in tokens.
        capacity: usize,
        /// The refusal that blocked it last.
        cause: StallCause,
    },
    /// A violated internal invariant (a bug).
    #[error(transparent)]
    Invariant(#[from] InvariantViolation),
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        message: String,
    },
    /// A malformed trace.
    #[error("{path}:{line}: {message}")]
    Trace {
        /// The file.
        path: String,
        /// 1-based line (0 when not line-oriented).
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// Why a replay stalled ([`ManagerError::Stalled`]): the last refusal the blocked request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StallCause {
    /// Its admission had to wait.
    Admission(WaitReason),
    /// The allocation of its next prefill chunk or decode token failed: out of device memory.
    OutOfMemory {
        /// Tokens the allocation asked for.
        needed: usize,
        /// Tokens that were available (free + evictable).
        available: usize,
    },
    /// No refusal was recorded (no manager call was refused, yet nothing ran).
    NoProgress,
}

impl std::fmt::Display for StallCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StallCause::Admission(WaitReason::NoRoom { needed, available }) => write!(
                f,
                "its admission waits for room ({needed} tokens needed, {available} available)"
            ),
            StallCause::Admission(WaitReason::RoomInFlight { needed }) => write!(
                f,
                "its admission waits for write-back evictions in flight ({needed} tokens needed)"
            ),
            StallCause::Admission(WaitReason::NoRow) => {
                f.write_str("its admission waits for a request row (every row is in use)")
            }
            StallCause::Admission(WaitReason::TransfersBusy) => {
                f.write_str("its admission waits for the host tier's pending loads")
            }
            StallCause::Admission(WaitReason::OpenStepLoadsNothing) => f.write_str(
                "its admission needs a load and waits for the next step (the open step began \
                 with nothing to load)",
            ),
            StallCause::Admission(WaitReason::NoStateSlot) => {
                f.write_str("its admission waits for a Mamba state slot (every slot is in use)")
            }
            StallCause::Admission(WaitReason::Prefetching) => {
                f.write_str("its admission waits for its prefetch from the storage tier")
            }
            StallCause::Admission(WaitReason::NoWindowRoom { needed, available }) => write!(
                f,
                "its admission waits for sliding-window KV room ({needed} tokens needed, \
                 {available} available)"
            ),
            StallCause::OutOfMemory { needed, available } => write!(
                f,
                "allocating {needed} tokens for it ran out of device memory ({available} \
                 available)"
            ),
            StallCause::NoProgress => f.write_str("no request could run"),
        }
    }
}

/// How an error names a request: the engine's id (quoted) when there is one, else the handle.
fn request_name(id: u64, engine_id: Option<&str>) -> String {
    match engine_id {
        Some(e) => format!("{e:?} ({})", crate::ReqId(id)),
        None => crate::ReqId(id).to_string(),
    }
}

/// A session refusal reported through a cache method keeps its type: it becomes
/// [`ManagerError::Session`], every other cache error [`ManagerError::Cache`].
impl From<CacheError> for ManagerError {
    fn from(e: CacheError) -> Self {
        match e {
            CacheError::Session(f) => ManagerError::Session(f.into()),
            other => ManagerError::Cache(other),
        }
    }
}

/// Shorthand result type.
pub type Result<T, E = ManagerError> = std::result::Result<T, E>;

/// Why a device backend handed to the builder does not fit the configuration
/// ([`ManagerError::Backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendMismatch {
    /// The cache has no host tier: a device-only cache never copies KV, so it would never use
    /// the backend.
    #[error(
        "the cache has no host tier, so it would never use a backend (configure a host tier or \
         give no backend)"
    )]
    NoHostTier,
    /// The backend's pools have another number of layers than the model.
    #[error("the backend has {backend} layers, the model {model}")]
    Layers {
        /// Layers of the backend's pools.
        backend: usize,
        /// `ModelGeometry::layers`.
        model: u32,
    },
    /// The backend stores another number of KV bytes per token per layer than the model.
    #[error("the backend holds {backend} KV bytes per token per layer, the model {model}")]
    BytesPerTokenPerLayer {
        /// The backend's bytes per token per layer.
        backend: usize,
        /// `ModelGeometry::kv_bytes_per_token_per_layer`.
        model: u64,
    },
    /// The backend's pages hold another number of tokens than the model's.
    #[error("the backend has pages of {backend} tokens, the model {model}")]
    PageSize {
        /// Tokens per page of the backend's pool.
        backend: usize,
        /// `ModelGeometry::page_size`.
        model: usize,
    },
    /// The backend's device pool has another number of pages than the configured one.
    #[error("the backend's device pool has {backend} pages, the configuration {config}")]
    DevicePages {
        /// Pages of the backend's device pool.
        backend: usize,
        /// `ManagerConfig::device_pages()`.
        config: usize,
    },
}
