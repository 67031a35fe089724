//! The reference side of the session model: the operations, what the model remembers of the
//! sessions and requests between them, and which operations are valid in which state.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::marker::PhantomData;

use proptest::prelude::*;
use proptest_state_machine::ReferenceStateMachine;
use radixkv_radix::TokenId;

use super::Tier;

/// One step of a test run. `X` is what a tier adds (transfers, faults, host pressure).
#[derive(Clone, Debug)]
pub enum Op<X> {
    /// Opens session `id`, optionally with its own idle TTL.
    Open {
        /// Session id.
        id: u64,
        /// Streaming sessions keep their KV between turns.
        streaming: bool,
        /// Idle TTL override.
        ttl: Option<u64>,
    },
    /// Closing a session that is not open must be refused.
    CloseUnknown {
        /// A session id that is not open.
        id: u64,
    },
    /// A session turn: the history plus `new` tokens, then `generated` tokens of decode; or,
    /// with `diverge`, a prompt that rewrites that position of the history (refused).
    Turn {
        /// Session id.
        id: u64,
        /// Prompt tokens after the history (none: the turn re-asks its history).
        new: Vec<TokenId>,
        /// Decoded tokens (at least one).
        generated: Vec<TokenId>,
        /// A first turn opens with the shared system prompt.
        system: bool,
        /// Rewrite this position (modulo the history's length) of a streaming history.
        diverge: Option<usize>,
        /// Match twice: the second match must agree with the first.
        rematch: bool,
        /// Publish the prompt to the tree after the prefill.
        publish: bool,
        /// Also compute the last decoded token, so the turn commits its whole key.
        last: bool,
    },
    /// An ordinary request, optionally opening with `share.1` tokens of a session's history
    /// (`share.0` below the session count) or of an earlier finished request's tokens.
    Plain {
        /// Request id (from [`Profile::plain`](super::Profile::plain)).
        id: u64,
        /// Its own tokens, after the shared ones.
        tokens: Vec<TokenId>,
        /// Where the shared opening comes from, and how many tokens of it.
        share: Option<(usize, usize)>,
        /// Publish the prompt to the tree after the prefill.
        publish: bool,
        /// Decoded tokens (at least one).
        generated: Vec<TokenId>,
    },
    /// Ends the request in flight of `id` (a session turn or an ordinary request).
    Finish {
        /// Session or request id.
        id: u64,
        /// Aborted instead of finished.
        abort: bool,
        /// Tokens allocated past what was computed before the end.
        overshoot: usize,
    },
    /// Retracts (aborts and re-admits) the request in flight of `id`.
    Retract {
        /// Session or request id.
        id: u64,
    },
    /// Closes session `id` (deferred while a turn holds its slot).
    Close {
        /// Session id.
        id: u64,
    },
    /// Demotes an idle session's slot into the tree.
    Demote {
        /// Session id.
        id: u64,
    },
    /// Device memory pressure: evict this many tokens.
    Evict {
        /// Tokens asked for.
        tokens: usize,
    },
    /// The clock moves on, then expired and over-budget sessions are reaped.
    Tick {
        /// Clock ticks.
        ticks: u64,
    },
    /// New session bounds, then the sessions over them are reaped.
    Budget {
        /// Tokens all idle sessions may hold.
        tokens: usize,
        /// Tokens one session may hold.
        cap: usize,
    },
    /// What only this tier does.
    Tier(X),
}

/// What the reference remembers between operations: enough to draw only valid ones.
#[derive(Clone, Debug)]
pub struct Model<P> {
    /// How the tier under test is built.
    pub params: P,
    /// Open sessions.
    pub open: BTreeSet<u64>,
    /// Sessions and ordinary requests with a request in flight.
    pub busy: BTreeSet<u64>,
    /// Sessions whose close waits for their turn in flight.
    pub closing: BTreeSet<u64>,
}

/// The reference state machine of sessions over tier `T`.
pub struct Reference<T>(PhantomData<T>);

/// Tokens from a small alphabet, so unrelated requests still share short prefixes.
fn token_run(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<TokenId>> {
    prop::collection::vec(0..6 as TokenId, len)
}

impl<T: Tier> ReferenceStateMachine for Reference<T> {
    type State = Model<T::Params>;
    type Transition = Op<T::Extra>;

    fn init_state() -> BoxedStrategy<Self::State> {
        T::params()
            .prop_map(|params| Model {
                params,
                open: BTreeSet::new(),
                busy: BTreeSet::new(),
                closing: BTreeSet::new(),
            })
            .boxed()
    }

    fn transitions(m: &Self::State) -> BoxedStrategy<Self::Transition> {
        let pr = T::PROFILE;
        let sessions = pr.sessions as usize;
        // Draw ids from the sets where the op is valid, so few cases are rejected.
        let pick = |set: Vec<u64>| prop::sample::select(set);
        let closed: Vec<u64> = (0..pr.sessions).filter(|i| !m.open.contains(i)).collect();
        let idle: Vec<u64> = m
            .open
            .iter()
            .copied()
            .filter(|i| !m.busy.contains(i) && !m.closing.contains(i))
            .collect();
        let busy: Vec<u64> = m.busy.iter().copied().collect();
        let free_plain: Vec<u64> = pr.plain.filter(|i| !m.busy.contains(i)).collect();
        let closable: Vec<u64> = m.open.difference(&m.closing).copied().collect();
        let mut ops: Vec<(u32, BoxedStrategy<Self::Transition>)> = vec![
            (
                3,
                (1..pr.device_tokens)
                    .prop_map(|tokens| Op::Evict { tokens })
                    .boxed(),
            ),
            (2, (0..12u64).prop_map(|ticks| Op::Tick { ticks }).boxed()),
            (
                1,
                (0..pr.budget + pr.budget / 4, 0..pr.budget * 5 / 8)
                    .prop_map(|(tokens, cap)| Op::Budget { tokens, cap })
                    .boxed(),
            ),
        ];
        ops.extend(
            T::extra_ops()
                .into_iter()
                .map(|(w, s)| (w, s.prop_map(Op::Tier).boxed())),
        );
        if !closed.is_empty() {
            ops.push((
                3,
                (
                    pick(closed.clone()),
                    prop::bool::weighted(0.85),
                    prop::option::of(prop_oneof![Just(5u64), Just(20)]),
                )
                    .prop_map(|(id, streaming, ttl)| Op::Open { id, streaming, ttl })
                    .boxed(),
            ));
            ops.push((
                1,
                pick(closed).prop_map(|id| Op::CloseUnknown { id }).boxed(),
            ));
        }
        if !idle.is_empty() {
            ops.push((
                8,
                (
                    pick(idle.clone()),
                    token_run(0..pr.prompt),
                    token_run(1..6),
                    any::<bool>(),
                    prop::option::weighted(0.1, any::<usize>()),
                    prop::bool::weighted(0.2),
                    prop::bool::weighted(0.3),
                    prop::bool::weighted(0.2),
                )
                    .prop_map(
                        |(id, new, generated, system, diverge, rematch, publish, last)| Op::Turn {
                            id,
                            new,
                            generated,
                            system,
                            diverge,
                            rematch,
                            publish,
                            last,
                        },
                    )
                    .boxed(),
            ));
            ops.push((1, pick(idle).prop_map(|id| Op::Demote { id }).boxed()));
        }
        if !free_plain.is_empty() {
            // A past request asked again with a few more tokens: after pressure, a tiered
            // cache hits its host copy.
            ops.push((
                2,
                (
                    pick(free_plain.clone()),
                    token_run(1..6),
                    0..pr.past,
                    token_run(1..4),
                )
                    .prop_map(move |(id, tokens, k, generated)| Op::Plain {
                        id,
                        tokens,
                        share: Some((sessions + k, usize::MAX)),
                        publish: false,
                        generated,
                    })
                    .boxed(),
            ));
            ops.push((
                3,
                (
                    pick(free_plain),
                    token_run(1..pr.plain_tokens),
                    prop::option::weighted(
                        0.8,
                        (
                            prop_oneof![1 => 0..sessions, 2 => sessions..sessions + pr.past],
                            0..pr.share,
                        ),
                    ),
                    any::<bool>(),
                    token_run(1..4),
                )
                    .prop_map(|(id, tokens, share, publish, generated)| Op::Plain {
                        id,
                        tokens,
                        share,
                        publish,
                        generated,
                    })
                    .boxed(),
            ));
        }
        if !busy.is_empty() {
            ops.push((
                7,
                (pick(busy.clone()), prop::bool::weighted(0.25), 0..6usize)
                    .prop_map(|(id, abort, overshoot)| Op::Finish {
                        id,
                        abort,
                        overshoot,
                    })
                    .boxed(),
            ));
            ops.push((2, pick(busy).prop_map(|id| Op::Retract { id }).boxed()));
        }
        if !closable.is_empty() {
            ops.push((1, pick(closable).prop_map(|id| Op::Close { id }).boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn preconditions(m: &Self::State, op: &Self::Transition) -> bool {
        match op {
            Op::Open { id, .. } | Op::CloseUnknown { id } => !m.open.contains(id),
            Op::Turn { id, .. } | Op::Demote { id } => {
                m.open.contains(id) && !m.busy.contains(id) && !m.closing.contains(id)
            }
            Op::Plain { id, .. } => !m.busy.contains(id),
            Op::Finish { id, .. } | Op::Retract { id } => m.busy.contains(id),
            Op::Close { id } => m.open.contains(id) && !m.closing.contains(id),
            _ => true,
        }
    }

    fn apply(mut m: Self::State, op: &Self::Transition) -> Self::State {
        match *op {
            Op::Open { id, .. } => {
                m.open.insert(id);
            }
            Op::Turn { id, .. } | Op::Plain { id, .. } => {
                m.busy.insert(id);
            }
            Op::Finish { id, .. } => {
                m.busy.remove(&id);
                if m.closing.remove(&id) {
                    m.open.remove(&id);
                }
            }
            Op::Close { id } => {
                if m.busy.contains(&id) {
                    m.closing.insert(id);
                } else {
                    m.open.remove(&id);
                }
            }
            _ => {}
        }
        m
    }
}
