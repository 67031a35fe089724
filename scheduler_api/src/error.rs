//! Errors of the manager, the trace readers and the replay tool.

use radixkv_radix::{CacheError, InvariantViolation};

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
    /// A handle that names no live request of this manager.
    #[error("unknown request {0}")]
    UnknownRequest(u64),
    /// A lifecycle call out of order (e.g. `extend` before `admit`).
    #[error("request {id}: {what}")]
    Lifecycle {
        /// The request.
        id: u64,
        /// What was wrong.
        what: &'static str,
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
