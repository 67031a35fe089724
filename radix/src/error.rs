//! Typed errors of the cache layer. Every bad input and exhausted resource reachable from the
//! public API ends here; none of them leaves the cache changed.

use crate::types::{NodeId, PageId, RowId};

/// Errors returned by the allocators, the tree and every [`crate::PrefixCache`].
///
/// Non-exhaustive: new failure kinds may be added, so a `match` needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// A key that must hold at least one page was empty.
    #[error("empty key")]
    EmptyKey,
    /// A key or length that must be page-aligned was not.
    #[error("length {len} is not a multiple of the page size {page_size}")]
    Misaligned {
        /// The offending length.
        len: usize,
        /// The page size.
        page_size: usize,
    },
    /// The number of pages does not cover the key.
    #[error("{pages} pages given for {tokens} tokens at page size {page_size}")]
    LengthMismatch {
        /// Tokens in the key.
        tokens: usize,
        /// Pages supplied.
        pages: usize,
        /// The page size.
        page_size: usize,
    },
    /// Not enough free pages, even after evicting everything evictable.
    #[error("out of device pages: needed {needed}, available {available}")]
    OutOfPages {
        /// Pages requested.
        needed: usize,
        /// Pages that could be made free (free plus evictable); nothing is evicted when short.
        available: usize,
    },
    /// No free request-pool row.
    #[error("out of request-pool rows ({capacity} in use)")]
    OutOfRows {
        /// The row capacity.
        capacity: usize,
    },
    /// A page index outside the pool.
    #[error("page {0:?} is outside the pool")]
    PageOutOfRange(PageId),
    /// A page freed twice, or freed/inserted while not owned by the caller.
    #[error("page {page:?} is not in the expected state ({expected})")]
    PageState {
        /// The page.
        page: PageId,
        /// What state the operation needed it in.
        expected: &'static str,
    },
    /// A node handle that no longer names a live node.
    #[error("stale node handle {0:?}")]
    StaleNode(NodeId),
    /// A row handle that no longer names a live row.
    #[error("stale row handle {0:?}")]
    StaleRow(RowId),
    /// A lock receipt that does not belong to this cache, or whose anchor is gone.
    #[error("lock receipt is stale or belongs to another cache")]
    StaleReceipt,
    /// A lock count would underflow: the receipt does not match the locks held on its path.
    #[error("lock count underflow on node {0:?}")]
    LockUnderflow(NodeId),
    /// The operation needs an idle cache (no outstanding locks or request rows).
    #[error("cache is busy: {0}")]
    Busy(&'static str),
    /// The request is not in a state that allows the operation.
    #[error("invalid request state: {0}")]
    InvalidRequestState(&'static str),
    /// A session-level refusal (unknown session, non-extending prompt, ...), typed, as a
    /// session cache reports it through the [`crate::PrefixCache`] methods.
    #[error("session error: {0}")]
    Session(SessionFault),
    /// A configuration value is impossible.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A size or count the caller passed would overflow the arithmetic of the request or pool
    /// it applies to (no pool can satisfy it).
    #[error("size overflow: {0}")]
    SizeOverflow(&'static str),
    /// A state slot index outside its pool.
    #[error("state slot {slot} is outside the pool of {total} slots")]
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// Slots in the pool.
        total: usize,
    },
    /// A state slot freed twice, or handed over while not held by the caller.
    #[error("state slot {slot} is not in the expected state ({expected})")]
    SlotState {
        /// The slot.
        slot: u32,
        /// What state the operation needed it in.
        expected: &'static str,
    },
    /// No free state slot, and every cached state is locked (nothing could be evicted).
    #[error("out of {component} state slots ({capacity} in the pool, none free or evictable)")]
    OutOfStateSlots {
        /// Which component's pool (`"mamba"`).
        component: &'static str,
        /// Slots in the pool.
        capacity: usize,
    },
    /// The operation needs a tree component that this cache was not configured with.
    #[error("the {0} component is not configured for this cache")]
    ComponentDisabled(&'static str),
    /// A parameter of a state admission / eviction policy is impossible (negative, NaN,
    /// infinite or out of range; see [`crate::mamba_policy::MarconiParams::validate`]).
    #[error("invalid policy parameter `{param}`: {reason}")]
    PolicyParam {
        /// The parameter's name.
        param: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An [`crate::EvictionPolicy`] answered with a node that is not an evictable leaf (a stale
    /// handle, a locked or inner node, one already given). The tree rebuilt the policy's
    /// contents from its own leaf set, so it stays consistent; the policy has a bug.
    #[error("eviction policy `{policy}` returned {node:?}, which is not an evictable leaf")]
    PolicyFault {
        /// The policy's name.
        policy: &'static str,
        /// What it returned.
        node: NodeId,
    },
}

/// Why a session layer refused an operation, carried by [`CacheError::Session`]. The session
/// crate's `SessionError` has the same cases (plus its inner cache's errors) and converts both
/// ways, so the reason keeps its type through a [`crate::PrefixCache`] method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionFault {
    /// No open session has this id.
    #[error("unknown session {0}")]
    Unknown(u64),
    /// A session with this id is already open.
    #[error("session {0} is already open")]
    AlreadyOpen(u64),
    /// A streaming turn whose prompt does not extend the session's previous tokens.
    #[error("turn of session {id} does not extend its previous {history_len} tokens")]
    NotExtending {
        /// The session.
        id: u64,
        /// Tokens of the previous turns (prompt + output).
        history_len: usize,
    },
    /// A streaming session already has a turn in flight.
    #[error("session {0} already has a turn in flight")]
    Busy(u64),
    /// The session is closing.
    #[error("session {0} is closing")]
    Closing(u64),
}

/// Shorthand result type.
pub type Result<T, E = CacheError> = std::result::Result<T, E>;

/// A violated internal invariant, found by `check_invariants`. Always a bug in radixkv (or a
/// caller that bypassed the API); the message says which invariant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// Returns `Err(InvariantViolation)` with a formatted message when `cond` is false.
#[macro_export]
#[doc(hidden)]
macro_rules! ensure_inv {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::InvariantViolation(format!($($arg)+)));
        }
    };
}
