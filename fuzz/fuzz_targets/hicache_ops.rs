//! `HiRadixCache` over `HostSim`, wrapped in `SessionAwareCache` (plain requests pass through
//! it untouched, so both the tiered cache alone and sessions over it are driven): every write
//! policy, both host layouts, host eviction policies, load-back limits, step boundaries,
//! flushes, host eviction, resets, injected copy failures and refused submissions on either
//! stream, and (sometimes) transfer queues one or two operations deep, so back-pressure paths
//! run: skipped backups, loads refused as `Busy`, submissions that block.
//!
//! KV bytes really move between the simulated device and the host, so the KV oracle reads the
//! device pool itself ([`radixkv_fuzz::kv::BackendKv`]): a load-back that copied the wrong
//! host page, or a failed copy served as KV, is a mismatch. The event shadow must agree with
//! both tiers: device pages in the tree, and host pages in the tree less the backups not
//! acknowledged yet (their host `BlockStored` comes with the ack).
//!
//! An input whose first byte is `M` runs the same operations over a cache with Mamba state
//! slots (the SGLang-style or Marconi policy, tracking slots on or off, few or many host state
//! slots): the driver also plays the engine's state pool in the simulated device's Mamba
//! buffer, so every hit's copy on write, a state loaded back from the host included, must read
//! the exact bytes of its own prefix's state; Mamba-only evictions run between the operations.
//!
//! An input whose first byte is `S` runs them over a cache with sliding-window layers (a small
//! window, few device window pages, sometimes few host window pages, a cap on the window pages
//! idle sessions own): backups carry the window KV, load-backs bring it back, session slots
//! keep their window tables across turns while demotions, window slides and window-only
//! evictions (tombstones) run between the operations.
//!
//! An input whose first byte is `B` runs a cache with both sliding-window layers and Mamba
//! state slots in one tree (few or many host SWA pages and host state slots): the state bytes
//! are checked as in the `M` mode, every pool balances, and window-KV-only and Mamba-only
//! device evictions and window slides run between the operations. Session operations are left
//! out of this mode: sessions over a tiered cache with both components are exercised by the
//! session model test (`tests/tests/model_sessions_hicache.rs`, its `SwaMambaTiered` tier).
//!
//! (Mode bytes rather than new fields, so the regression inputs under `seeds/` keep decoding
//! as they did.)
#![no_main]

use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::components::{MambaBytes, SwaBytes, state_bytes, with_components};
use radixkv_fuzz::driver::{
    Driver, DriverOp, Target, audit_host, evict_device_states, evict_device_window,
};
use radixkv_fuzz::input::Size;
use radixkv_fuzz::kv::{BackendKv, BackendStates};
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize, KvGeometry,
    StreamKind, WritePolicy,
};
use radixkv_radix::{PolicyKind, PrefixCache, RadixConfig};
use radixkv_session::SessionConfig;

#[derive(Arbitrary, Debug)]
struct Setup {
    page_size: u8,
    pages: u8,
    host_pages: u8,
    rows: u8,
    layers: u8,
    write_policy: u8,
    page_first: bool,
    policy: u8,
    host_policy: Option<u8>,
    load_back_min: u8,
    quota: Option<u8>,
    load_back_on_begin: bool,
    budget_pages: u8,
    ttl: Option<u8>,
    events: bool,
    /// Mostly the defaults; sometimes one or two pending operations per direction and a
    /// one-command stream queue, so back-pressure (skipped backups, `Busy` loads, blocked
    /// submissions) is exercised.
    tight_queues: u8,
}

/// A fault the backend can be told to inject. Each variant maps to one fault hook of
/// `HostSim`; a new hook is a new variant and one arm in [`inject`].
#[derive(Arbitrary, Debug)]
enum Fault {
    /// The next `n` copies on the stream fail (their destination is poisoned).
    FailCopies { write: bool, n: u8 },
    /// The backend refuses the next `n` submissions on the stream (nothing is queued).
    RefuseSubmissions { write: bool, n: u8 },
}

#[derive(Arbitrary, Debug)]
enum TierOp {
    /// A step boundary: start backups, apply acks.
    Step,
    /// Start everything, wait, apply acks.
    Flush,
    /// Host eviction.
    EvictHost {
        tokens: Size,
    },
    Fault(Fault),
}

/// An operation of the `M` mode: any operation, or a device eviction of up to `n` Mamba
/// states alone.
#[derive(Arbitrary, Debug)]
enum MambaOp {
    Op(Op),
    EvictMamba { n: u8 },
}

/// The input of the `M` mode.
#[derive(Arbitrary, Debug)]
struct MambaInput {
    mamba: MambaSetup,
    setup: Setup,
    ops: Vec<MambaOp>,
}

/// The Mamba component of the `M` mode.
#[derive(Arbitrary, Debug)]
struct MambaSetup {
    slots: u8,
    host_slots: Option<u8>,
    state_words: u8,
    marconi: bool,
    track: bool,
}

impl MambaSetup {
    fn bytes(&self) -> MambaBytes {
        MambaBytes {
            slots: self.slots,
            host_slots: self.host_slots,
            state_words: self.state_words,
            marconi: self.marconi,
        }
    }
}

/// An operation of the `S` mode: any operation, a window slide of one of the driver's
/// requests, or a device eviction of up to `n` window pages alone (tombstones).
#[derive(Arbitrary, Debug)]
enum SwaOp {
    Op(Op),
    Slide(Target),
    EvictWindow { n: u8 },
}

/// The input of the `S` mode.
#[derive(Arbitrary, Debug)]
struct SwaInput {
    swa: SwaSetup,
    setup: Setup,
    ops: Vec<SwaOp>,
}

/// The sliding-window component of the `S` mode.
#[derive(Arbitrary, Debug)]
struct SwaSetup {
    window_pages: u8,
    pages: u8,
    host_pages: Option<u8>,
    held_pages: u8,
    page_words: u8,
}

impl SwaSetup {
    fn bytes(&self) -> SwaBytes {
        SwaBytes {
            window_pages: self.window_pages,
            pages: self.pages,
            host_pages: self.host_pages,
            page_words: self.page_words,
        }
    }
}

/// An operation of the `B` mode: any operation, a device eviction of up to `n` Mamba states
/// or window pages alone, or a window slide.
#[derive(Arbitrary, Debug)]
enum HybridOp {
    Op(Op),
    EvictMamba { n: u8 },
    EvictSwa { n: u8 },
    Slide(Target),
}

/// The input of the `B` mode.
#[derive(Arbitrary, Debug)]
struct BothInput {
    mamba: MambaSetup,
    swa: SwaSetup,
    setup: Setup,
    ops: Vec<HybridOp>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Drive(DriverOp),
    Tier(TierOp),
}

/// The component a run's cache carries besides the full KV.
#[derive(Clone, Copy)]
enum Component<'a> {
    None,
    Mamba(&'a MambaSetup),
    Swa(&'a SwaSetup),
    Both(&'a MambaSetup, &'a SwaSetup),
}

impl<'a> Component<'a> {
    fn mamba(self) -> Option<&'a MambaSetup> {
        match self {
            Component::Mamba(m) | Component::Both(m, _) => Some(m),
            _ => None,
        }
    }

    fn swa(self) -> Option<&'a SwaSetup> {
        match self {
            Component::Swa(w) | Component::Both(_, w) => Some(w),
            _ => None,
        }
    }
}

/// One operation of any mode.
enum ModeOp<'a> {
    Op(&'a Op),
    EvictMamba(u8),
    Slide(Target),
    EvictWindow(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

fn stream(write: bool) -> StreamKind {
    if write {
        StreamKind::Write
    } else {
        StreamKind::Load
    }
}

fn inject(backend: &HostSim, f: &Fault) {
    match *f {
        Fault::FailCopies { write, n } => backend.fail_next_copies(stream(write), u32::from(n % 4)),
        Fault::RefuseSubmissions { write, n } => {
            backend.refuse_next_submissions(stream(write), u32::from(n % 4));
        }
    }
}

fn build(s: &Setup, extra: Component<'_>) -> (HiRadixCache<HostSim>, Arc<HostSim>) {
    let p = 1 + usize::from(s.page_size % 4);
    let pages = 8 + usize::from(s.pages % 40);
    let geometry = KvGeometry::new(1 + usize::from(s.layers % 3), p, 8).expect("geometry");
    let tight = s.tight_queues % 4 == 1;
    let sim = HostSimConfig {
        stream_capacity: if tight {
            1
        } else {
            HostSimConfig::default().stream_capacity
        },
        ..HostSimConfig::default()
    };
    let backend = Arc::new(HostSim::new(geometry, pages, sim).expect("sim"));
    let policy = |b: u8| PolicyKind::ALL[usize::from(b) % PolicyKind::ALL.len()];
    let write_policy = match s.write_policy % 3 {
        0 => WritePolicy::WriteThrough,
        1 => WritePolicy::WriteThroughSelective {
            hits: 1 + u32::from(s.write_policy / 3 % 3),
        },
        _ => WritePolicy::WriteBack,
    };
    let cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: p,
            total_pages: pages,
            max_rows: 2 + usize::from(s.rows % 8),
            policy: policy(s.policy),
            events: s.events,
            disabled: false,
            ..Default::default()
        },
        host_size: HostSize::Pages(1 + usize::from(s.host_pages % 64)),
        host_layout: if s.page_first {
            HostLayout::PageFirst
        } else {
            HostLayout::LayerFirst
        },
        write_policy,
        host_policy: s.host_policy.map(policy),
        load_back_min_tokens: usize::from(s.load_back_min % 8),
        load_back_quota_tokens: s.quota.map(usize::from),
        load_back_on_begin: s.load_back_on_begin,
        max_pending_ops: if tight {
            1 + usize::from(s.tight_queues / 4 % 2)
        } else {
            HiCacheConfig::default().max_pending_ops
        },
        ..HiCacheConfig::default()
    };
    let mut cfg = with_components(
        cfg,
        p,
        extra.mamba().map(MambaSetup::bytes).as_ref(),
        extra.swa().map(SwaSetup::bytes).as_ref(),
    );
    if let Some(m) = extra.mamba() {
        cfg.radix.mamba_track = m.track;
    }
    let cache = HiRadixCache::new(cfg, backend.clone()).expect("a small tiered cache");
    (cache, backend)
}

type Harness = Driver<HiRadixCache<HostSim>, BackendKv<HostSim>>;

/// Runs a tier operation. Errors are only acceptable once a fault was injected.
fn tier(d: &mut Harness, backend: &HostSim, op: &TierOp, faulty: &mut bool) {
    let c = d.cache.inner_mut();
    match op {
        TierOp::Step => {
            let r = c.step();
            assert!(r.is_ok() || *faulty, "step failed without a fault: {r:?}");
        }
        TierOp::Flush => {
            let r = c.flush();
            assert!(r.is_ok() || *faulty, "flush failed without a fault: {r:?}");
        }
        TierOp::EvictHost { tokens } => {
            let before = c.host_tokens();
            let n = c.evict_host(tokens.0);
            assert!(
                n <= before && c.host_tokens() == before - n,
                "{n} of {before}"
            );
        }
        TierOp::Fault(f) => {
            *faulty = true;
            inject(backend, f);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((b'M', rest)) => {
            if let Ok(i) = MambaInput::arbitrary_take_rest(Unstructured::new(rest)) {
                let ops = i.ops.iter().map(|op| match op {
                    MambaOp::Op(op) => ModeOp::Op(op),
                    MambaOp::EvictMamba { n } => ModeOp::EvictMamba(*n),
                });
                run(&i.setup, Component::Mamba(&i.mamba), ops);
            }
        }
        Some((b'S', rest)) => {
            if let Ok(i) = SwaInput::arbitrary_take_rest(Unstructured::new(rest)) {
                let ops = i.ops.iter().map(|op| match op {
                    SwaOp::Op(op) => ModeOp::Op(op),
                    SwaOp::Slide(t) => ModeOp::Slide(*t),
                    SwaOp::EvictWindow { n } => ModeOp::EvictWindow(*n),
                });
                run(&i.setup, Component::Swa(&i.swa), ops);
            }
        }
        Some((b'B', rest)) => {
            if let Ok(i) = BothInput::arbitrary_take_rest(Unstructured::new(rest)) {
                // No session operations in this mode (see the module docs).
                let ops = i.ops.iter().filter_map(|op| match op {
                    HybridOp::Op(Op::Drive(op)) if op.is_session_op() => None,
                    HybridOp::Op(op) => Some(ModeOp::Op(op)),
                    HybridOp::EvictMamba { n } => Some(ModeOp::EvictMamba(*n)),
                    HybridOp::EvictSwa { n } => Some(ModeOp::EvictWindow(*n)),
                    HybridOp::Slide(t) => Some(ModeOp::Slide(*t)),
                });
                run(&i.setup, Component::Both(&i.mamba, &i.swa), ops);
            }
        }
        _ => {
            if let Ok(i) = Input::arbitrary_take_rest(Unstructured::new(data)) {
                run(&i.setup, Component::None, i.ops.iter().map(ModeOp::Op));
            }
        }
    }
});

fn run<'a>(s: &Setup, extra: Component<'_>, ops: impl Iterator<Item = ModeOp<'a>>) {
    let (cache, backend) = build(s, extra);
    let p = cache.page_size();
    let cfg = SessionConfig {
        max_held_tokens: usize::from(s.budget_pages) * p,
        max_session_tokens: usize::from(s.budget_pages).max(1) * p,
        idle_ttl: s.ttl.map(u64::from),
        max_held_state_slots: usize::MAX,
        max_held_window_pages: extra
            .swa()
            .map_or(usize::MAX, |w| usize::from(w.held_pages % 16)),
    };
    let mut d = Driver::new(cache, cfg, BackendKv::new(backend.clone()), s.events);
    if let Some(m) = extra.mamba() {
        d = d.with_states(Box::new(BackendStates::new(
            backend.clone(),
            state_bytes(&m.bytes()),
        )));
    }
    let mut faulty = false;
    for op in ops {
        match op {
            ModeOp::Op(Op::Drive(op)) => d.step(op),
            ModeOp::Op(Op::Tier(op)) => tier(&mut d, &backend, op, &mut faulty),
            ModeOp::EvictMamba(n) => evict_device_states(d.cache.inner_mut(), n),
            ModeOp::Slide(t) => d.slide(t),
            ModeOp::EvictWindow(n) => evict_device_window(d.cache.inner_mut(), n),
        }
        d.audit();
        audit_host(&d);
    }
    // Ends everything and flushes the tier: no transfer may keep a lock, nothing may leak.
    d.teardown();
    audit_host(&d);
    assert_eq!(c_unacked(&d), 0, "a backup was never acknowledged");
}

fn c_unacked(d: &Harness) -> usize {
    d.cache.inner().unacked_backup_pages()
}
