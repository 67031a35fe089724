//! Errors of the manager, the trace readers and the replay tool.

use radixkv_radix::{CacheError, InvariantViolation};

/// Everything the manager and the replay tool can refuse. Messages name the problem so the
/// `radixkv` binary can print them as they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManagerError {
    /// An impossible or malformed configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A cache kind whose crate is not wired into the factory yet.
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
    /// An error of the underlying cache.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// An error of the session layer (unknown session, already open, ...).
    #[error(transparent)]
    Session(#[from] radixkv_session::SessionError),
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

/// How an error names a request: the engine's id (quoted) when there is one, else the handle.
fn request_name(id: u64, engine_id: Option<&str>) -> String {
    match engine_id {
        Some(e) => format!("{e:?} ({})", crate::ReqId(id)),
        None => crate::ReqId(id).to_string(),
    }
}

/// Shorthand result type.
pub type Result<T, E = ManagerError> = std::result::Result<T, E>;
