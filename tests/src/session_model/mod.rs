//! One reference model of streaming sessions, `SessionAwareCache` over any inner cache, driven
//! by random operation sequences (proptest state machines): sessions open, run turns (some
//! diverging from their history and refused, some re-asking it), close, expire on a fake
//! clock and get demoted by budgets and pressure; ordinary requests run beside them, some
//! sharing a session's history or an earlier request's tokens; requests abort, retract and
//! overshoot.
//!
//! The model is what the test itself computed: every KV slot it wrote holds a value derived
//! from the token prefix it belongs to (as a real forward pass would), and for each request the
//! tokens it computed, its allocation and its row; for each session its history and what its
//! slot should lend back. Every served prefix is read back and compared. After every operation:
//! the cache's invariants, the pool accounting, and each request's and slot's holdings against
//! the model. At teardown every request ends, every session closes and nothing may be left.
//!
//! What differs between inner caches is a [`Tier`]: how it is built, where its KV lives, how a
//! matched prefix reaches the device, and the operations only it has.

mod driver;
mod ops;

pub use driver::{Flight, Machine, Sut};
pub use ops::{Model, Op, Reference};

use proptest::strategy::BoxedStrategy;
use radixkv_radix::PrefixCache;

use crate::model_kv::KvModel;

/// Sizes of a test run, chosen per tier so that its pools are under pressure.
#[derive(Clone, Debug)]
pub struct Profile {
    /// Session ids are `0..sessions`.
    pub sessions: u64,
    /// Ids of ordinary requests that stay in flight across operations.
    pub plain: std::ops::Range<u64>,
    /// Device capacity in tokens (the most one eviction asks for).
    pub device_tokens: usize,
    /// Tokens all idle sessions may hold at first; budget changes draw around it.
    pub budget: usize,
    /// The default idle TTL of sessions.
    pub idle_ttl: Option<u64>,
    /// A turn's prompt adds fewer new tokens than this.
    pub prompt: usize,
    /// An ordinary request has fewer own tokens than this.
    pub plain_tokens: usize,
    /// An ordinary request shares fewer tokens than this.
    pub share: usize,
    /// Finished requests kept for later requests to share.
    pub past: usize,
}

/// What the session model needs of one kind of inner cache.
pub trait Tier: Sized + 'static {
    /// The cache under the session layer.
    type Inner: PrefixCache;
    /// Where the test writes and reads back the KV of the cache's pages.
    type Kv: KvModel;
    /// How a run builds it (drawn once per case).
    type Params: Clone + std::fmt::Debug + 'static;
    /// Operations only this tier has.
    type Extra: Clone + std::fmt::Debug + 'static;
    /// Sizes of a run.
    const PROFILE: Profile;
    /// True when the inner cache gives each request a running state that a session slot
    /// keeps across turns (a cache with Mamba slots): a slot whose next turn would use fewer
    /// tokens than it holds cannot cut that state back, so it is demoted and the turn matches
    /// the tree, and a request may find no free state slot (it is aborted then).
    const RUNNING_STATE: bool = false;
    /// True when the inner cache's requests hold sliding-window pages that a session slot
    /// keeps across turns: a slot whose next turn would use fewer tokens than it holds keeps
    /// serving it only while the window before the shorter end is still held, else it is
    /// demoted and the turn matches the tree (the model accepts either, and checks which).
    const WINDOW: bool = false;

    /// Draws the build parameters.
    fn params() -> BoxedStrategy<Self::Params>;
    /// The weighted strategies of the tier's own operations.
    fn extra_ops() -> Vec<(u32, BoxedStrategy<Self::Extra>)>;
    /// Builds the KV memory and the inner cache.
    fn build(params: &Self::Params) -> (Self::Kv, Self::Inner);
    /// After `begin_request`: brings the rest of the matched prefix onto the device. Returns
    /// false when the request had to be aborted.
    fn load_back(sut: &mut Sut<Self>, f: &mut Flight) -> bool;
    /// Runs one of the tier's own operations.
    fn apply_extra(sut: &mut Sut<Self>, op: Self::Extra);
    /// At teardown, once every request ended and every session closed: empties every tier.
    fn drain(sut: &mut Sut<Self>);
    /// After [`Tier::drain`]: the tier's own leak checks.
    fn check_drained(sut: &Sut<Self>);
}
