//! Typed errors of the session API.

use radixkv_radix::{CacheError, SessionFault};

/// Errors of the session layer. Every one leaves the cache and the session unchanged.
///
/// Through the [`radixkv_radix::PrefixCache`] methods of a session cache these arrive as
/// [`CacheError::Session`] with a typed [`SessionFault`], which converts back into this type
/// (`SessionError::from(CacheError)`), so the reason is never reduced to a string.
/// Non-exhaustive: a `match` needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    Cache(CacheError),
}

impl From<SessionError> for CacheError {
    fn from(e: SessionError) -> Self {
        CacheError::Session(match e {
            SessionError::Cache(c) => return c,
            SessionError::Unknown(id) => SessionFault::Unknown(id),
            SessionError::AlreadyOpen(id) => SessionFault::AlreadyOpen(id),
            SessionError::NotExtending { id, history_len } => {
                SessionFault::NotExtending { id, history_len }
            }
            SessionError::Busy(id) => SessionFault::Busy(id),
            SessionError::Closing(id) => SessionFault::Closing(id),
        })
    }
}

impl From<SessionFault> for SessionError {
    fn from(f: SessionFault) -> Self {
        match f {
            SessionFault::Unknown(id) => SessionError::Unknown(id),
            SessionFault::AlreadyOpen(id) => SessionError::AlreadyOpen(id),
            SessionFault::NotExtending { id, history_len } => {
                SessionError::NotExtending { id, history_len }
            }
            SessionFault::Busy(id) => SessionError::Busy(id),
            SessionFault::Closing(id) => SessionError::Closing(id),
            // A fault this version of the session layer does not know keeps its message.
            other => SessionError::Cache(CacheError::Session(other)),
        }
    }
}

/// Recovers the typed session reason from a cache error: [`CacheError::Session`] becomes the
/// matching session error, anything else [`SessionError::Cache`].
impl From<CacheError> for SessionError {
    fn from(e: CacheError) -> Self {
        match e {
            CacheError::Session(f) => f.into(),
            other => SessionError::Cache(other),
        }
    }
}
