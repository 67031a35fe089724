//! The [`Consensus`] hook: how ranks that run one model together (tensor or pipeline parallel)
//! agree on every asynchronous outcome before their trees change.
//!
//! Each rank runs its own cache over its own device, host pool and store, and must take
//! exactly the decisions the others take, although its copies and store operations finish at
//! their own pace. So every count or decision that depends on timing is reduced across the
//! ranks first — the minimum of the transfers each rank has finished, the minimum of the pages
//! each rank found in its store, the maximum of a "must stop" flag — and the reduced value is
//! what every rank applies. A [`HiRadixCache`](crate::HiRadixCache) calls the hook
//! unconditionally, in the same order on every rank, as long as the ranks call the cache's
//! methods in the same order (the scheduler is deterministic), so a collective implementation
//! (an all-reduce over a process group) never deadlocks on a skipped call. The one exception
//! is a single rank ([`Consensus::is_single_rank`]), which has nobody to agree with: the cache
//! then never calls the hook (every reduction is the identity), and its step with nothing to do
//! returns at once.

use std::fmt;
use std::sync::Arc;

/// A reduction across the ranks of one model. Every method is a collective: each rank calls it
/// once per decision, in the same order, and gets the same result.
pub trait Consensus: Send + Sync + fmt::Debug {
    /// The smallest `value` over all ranks.
    fn min(&self, value: u64) -> u64;
    /// The largest `value` over all ranks.
    fn max(&self, value: u64) -> u64;

    /// True when this is the only rank, so every reduction is the identity and a call that
    /// cannot change anything may be skipped (a cache's step with nothing queued, in flight or
    /// stored). Not a collective; the default, `false`, keeps every call. A cache reads it
    /// once, when it is built.
    fn is_single_rank(&self) -> bool {
        false
    }
}

/// One rank: every reduction is the identity. The default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SingleRank;

impl Consensus for SingleRank {
    fn min(&self, value: u64) -> u64 {
        value
    }

    fn max(&self, value: u64) -> u64 {
        value
    }

    fn is_single_rank(&self) -> bool {
        true
    }
}

/// A cache's view of its [`Consensus`]: on a single rank (read once, when the cache is built)
/// every reduction is the identity without a call through the hook, so the per-step reductions
/// cost no virtual call (its vtable was a cache miss a step).
#[derive(Clone, Debug)]
pub(crate) struct Ranks {
    hook: Arc<dyn Consensus>,
    single: bool,
}

impl Ranks {
    pub(crate) fn new(hook: Arc<dyn Consensus>) -> Self {
        let single = hook.is_single_rank();
        Ranks { hook, single }
    }

    /// [`Consensus::min`].
    #[inline]
    pub(crate) fn min(&self, value: u64) -> u64 {
        self.reduce(value, |hook, v| hook.min(v))
    }

    /// [`Consensus::max`].
    #[inline]
    pub(crate) fn max(&self, value: u64) -> u64 {
        self.reduce(value, |hook, v| hook.max(v))
    }

    /// `op` through the hook, or `value` itself on a single rank.
    #[inline]
    fn reduce(&self, value: u64, op: impl FnOnce(&dyn Consensus, u64) -> u64) -> u64 {
        if self.single {
            value
        } else {
            op(self.hook.as_ref(), value)
        }
    }

    /// [`Consensus::is_single_rank`], as read when the cache was built.
    #[inline]
    pub(crate) fn is_single_rank(&self) -> bool {
        self.single
    }
}
