//! Typed errors of the session API.

use radixkv_radix::CacheError;

/// Errors of the session layer. Every one leaves the cache and the session unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// No open session has this id.
    #[error("unknown session {0}")]
    Unknown(u64),
    /// A session with this id is already open.
    #[error("session {0} is already open")]
    AlreadyOpen(u64),
    /// A streaming turn whose prompt does not extend the previous turn's tokens
    /// (prompt + output), or whose namespace differs.
    #[error("turn of session {id} does not extend its previous {history_len} tokens")]
    NotExtending {
        /// The session.
        id: u64,
        /// Tokens of the previous turns (prompt + output).
        history_len: usize,
    },
    /// A streaming session already has a turn in flight (one at a time).
    #[error("session {0} already has a turn in flight")]
    Busy(u64),
    /// The session is closing (a close arrived while its turn was in flight).
    #[error("session {0} is closing")]
    Closing(u64),
    /// An error of the inner cache.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl From<SessionError> for CacheError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Cache(c) => c,
            other => CacheError::Session(other.to_string()),
        }
    }
}
