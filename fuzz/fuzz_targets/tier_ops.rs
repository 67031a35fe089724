//! `HiRadixCache` over `HostSim` with a storage tier over `FaultStore<MemStore>`, driven by the
//! request and session driver plus the storage operations: prefetches started, checked,
//! terminated and aborted at any point of their query and fetch, waits for the store, step
//! boundaries, flushes, host and device eviction, and store faults drawn from the input
//! (errors, hangs cut by the tier's operation timeout, slow answers, corrupted pages, partial
//! batches, the store down and up again).
//!
//! KV bytes really move device → host → store → host → device, so the KV oracle
//! ([`radixkv_fuzz::kv::BackendKv`]) catches a page of another prefix or namespace, or a
//! corrupt page, served as KV. After every operation: the cache's invariant audit (the host
//! pool's pages are exactly the tree's plus those awaiting loads and those prefetches reserve),
//! the pool identity, and the event shadow on device and host. At the end the storage jobs
//! are drained and every prefetch ended (keeping what it loaded), the store faults switched
//! off and the warm-up prompts served again (their KV checked), every request ended: nothing
//! may leak and no prefetch may hold a host page.
//!
//! Before the operations, up to three warm-up prompts from the input are served and backed up
//! to the store, and (when the input says so) the device and host tiers emptied, so that
//! prefetches find pages without a long input.
//!
//! Store timings are real (the tier runs on a tokio runtime shared by all inputs, with an
//! operation timeout of a few milliseconds), so an input does not always take the same path.
//!
//! An input whose first byte is `M`, `S` or `B` runs over a hybrid tree: Mamba state slots
//! (`M`), sliding-window layers (`S`) or both (`B`), with few or many host state slots and host
//! window pages. Stored pages then carry the states and window KV their host copies hold, the
//! prefetches reserve host slots and window pages for them, and (besides the operations above)
//! device evictions of Mamba states or window pages alone (tombstones) and window slides run
//! between the operations, so states and windows reach the host, and the store, late too. The
//! driver plays the engine's state pool in the simulated device, so every hit's copy on write,
//! of a state brought back from the store included, must read its own prefix's state; the
//! audits cover every host slot and window page (none outside the tree, the loads awaited and
//! the prefetches' reservations), and at the end none may be left outside the tree. Session
//! operations are left out of the `B` mode, as in `hicache_ops`.
//!
//! (Mode bytes rather than new fields, so inputs of the plain mode keep decoding as they did.)
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::components::{
    MambaBytes, SwaBytes, state_bytes, window_page_bytes, with_components,
};
use radixkv_fuzz::driver::{
    Driver, DriverOp, Target, audit_host, evict_device_states, evict_device_window,
};
use radixkv_fuzz::input::{Size, Tokens, namespace};
use radixkv_fuzz::kv::{BackendKv, BackendStates};
use radixkv_hicache::storage::{FaultConfig, FaultStore, MemStore, StorageBackend};
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize, KvGeometry,
    PoolName, PrefetchStatus, PrefetchStop, StorageConfig, WritePolicy,
};
use radixkv_radix::{KeyRef, KvIdentity, PolicyKind, PrefixCache, RadixConfig};
use radixkv_session::SessionConfig;
use tokio::runtime::Runtime;

/// Prefetch ids the target uses.
const RIDS: u8 = 4;

#[derive(Arbitrary, Debug)]
struct Setup {
    page_size: u8,
    pages: u8,
    host_pages: u8,
    layers: u8,
    write_policy: u8,
    page_first: bool,
    policy: u8,
    events: bool,
    /// Prefetch stop policy: best effort, wait complete, or a timeout of a few milliseconds.
    stop: u8,
    /// The tier's operation timeout: 2, 5 or 10 ms.
    op_timeout: u8,
    /// Pages per store operation: 1 to 4.
    batch_pages: u8,
    /// Prefetch cap in pages (`None`: half the host pool).
    cap_pages: Option<u8>,
    /// The store's byte cap, in pages (0: none).
    store_cap_pages: u8,
    /// Prompts (and their namespaces) served, backed up to the store and waited for before
    /// the operations, so that prefetches find pages without a long input.
    warm: [Option<(Tokens, u8)>; 3],
    /// After the warm-up, evict everything from the device and the host (a cold cache over
    /// a warm store, as after a restart).
    cold: bool,
}

#[derive(Arbitrary, Debug)]
enum StoreOp {
    /// Starts a prefetch of `tokens` in namespace `ns` for id `rid`.
    Prefetch { rid: u8, tokens: Tokens, ns: u8 },
    /// Starts a prefetch of a warm-up prompt followed by `extra`, in its namespace.
    PrefetchWarm { rid: u8, warm: u8, extra: Tokens },
    /// Starts a request of a warm-up prompt followed by `extra`, in its namespace (its KV is
    /// checked once its loads settle).
    StartWarm { warm: u8, extra: Tokens },
    /// Checks a prefetch (ends it when its policy allows).
    Check { rid: u8 },
    /// Ends a prefetch now, keeping what arrived.
    Terminate { rid: u8 },
    /// Ends a prefetch now, dropping what arrived.
    Abort { rid: u8 },
    /// Waits for every storage job and applies them.
    Wait,
    /// A step boundary.
    Step,
    /// Starts every transfer, waits, applies the acks.
    Flush,
    /// Host eviction.
    EvictHost { tokens: Size },
    /// Store faults: probabilities in sixteenths (error, hang, partial, corrupt, slow), the
    /// slow answers' delay (0 to 3 ms) and the seed.
    Faults([u8; 5], u8, u64),
    /// The store goes down (`true`) or comes back.
    Down(bool),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Drive(DriverOp),
    Store(StoreOp),
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

/// An operation of a hybrid mode: any operation, a device eviction of up to `n` Mamba states
/// or window pages alone, or a window slide of one of the driver's requests.
#[derive(Arbitrary, Debug)]
enum HybridOp {
    Op(Op),
    EvictMamba { n: u8 },
    EvictWindow { n: u8 },
    Slide(Target),
}

/// The input of the hybrid modes (the mode byte says which components are used).
#[derive(Arbitrary, Debug)]
struct HybridInput {
    mamba: MambaBytes,
    swa: SwaBytes,
    setup: Setup,
    ops: Vec<HybridOp>,
}

/// The components a run's tree carries besides the full KV.
#[derive(Clone, Copy)]
struct Components<'a> {
    mamba: Option<&'a MambaBytes>,
    swa: Option<&'a SwaBytes>,
}

impl Components<'_> {
    const NONE: Components<'static> = Components {
        mamba: None,
        swa: None,
    };
}

/// What a run does besides the plain operations.
enum ModeOp<'a> {
    Op(&'a Op),
    EvictMamba(u8),
    EvictWindow(u8),
    Slide(Target),
}

/// The runtime every input's storage tier runs on (starting one per input would cost two
/// threads each time).
fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

type Cache = HiRadixCache<HostSim>;
type Harness = Driver<Cache, BackendKv<HostSim>>;

fn build(
    s: &Setup,
    comps: Components<'_>,
    store: Arc<FaultStore<MemStore>>,
) -> (Cache, Arc<HostSim>) {
    let p = 1 + usize::from(s.page_size % 4);
    let pages = 8 + usize::from(s.pages % 40);
    let geometry = KvGeometry::new(1 + usize::from(s.layers % 3), p, 8).expect("geometry");
    let backend = Arc::new(HostSim::new(geometry, pages, HostSimConfig::default()).expect("sim"));
    let policy = PolicyKind::ALL[usize::from(s.policy) % PolicyKind::ALL.len()];
    let write_policy = match s.write_policy % 3 {
        0 => WritePolicy::WriteThrough,
        1 => WritePolicy::WriteThroughSelective {
            hits: 1 + u32::from(s.write_policy / 3 % 3),
        },
        _ => WritePolicy::WriteBack,
    };
    let store: Arc<dyn StorageBackend> = store;
    let mut storage = StorageConfig::new(store, KvIdentity::new("fuzz-model", "fuzz-layout"));
    storage.prefetch_threshold_tokens = p;
    storage.prefetch_cap_tokens = s.cap_pages.map(|c| usize::from(c % 32) * p);
    storage.stop = match s.stop % 3 {
        0 => PrefetchStop::BestEffort,
        1 => PrefetchStop::WaitComplete,
        _ => PrefetchStop::Timeout {
            base: Duration::from_millis(u64::from(s.stop / 3 % 4)),
            per_1k_tokens: Duration::from_millis(1),
            max: Duration::from_millis(5),
        },
    };
    storage.tier.op_timeout = Duration::from_millis([2, 5, 10][usize::from(s.op_timeout % 3)]);
    storage.tier.batch_pages = 1 + usize::from(s.batch_pages % 4);
    storage.tier.runtime = Some(runtime().handle().clone());
    let cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: p,
            total_pages: pages,
            max_rows: 8,
            policy,
            events: s.events,
            ..Default::default()
        },
        host_size: HostSize::Pages(1 + usize::from(s.host_pages % 64)),
        host_layout: if s.page_first {
            HostLayout::PageFirst
        } else {
            HostLayout::LayerFirst
        },
        write_policy,
        load_back_min_tokens: 1,
        storage: Some(storage),
        ..HiCacheConfig::default()
    };
    let cfg = with_components(cfg, p, comps.mamba, comps.swa);
    let cache = HiRadixCache::new(cfg, backend.clone()).expect("a small tiered cache");
    (cache, backend)
}

/// The faults a `Faults` operation configures.
fn faults(p: &[u8; 5], slow_ms: u8, seed: u64) -> FaultConfig {
    let f = |x: u8| f64::from(x % 17) / 16.0;
    FaultConfig {
        error: f(p[0]),
        hang: f(p[1]),
        partial: f(p[2]),
        corrupt: f(p[3]),
        slow: f(p[4]),
        slow_ms: u64::from(slow_ms % 4),
        ..FaultConfig::seeded(seed)
    }
}

/// A prefetch's end: the tokens it reports loaded are whole pages.
fn check_status(c: &Cache, st: PrefetchStatus) {
    if let PrefetchStatus::Done { tokens } = st {
        assert_eq!(
            tokens % c.page_size(),
            0,
            "a prefetch loaded part of a page"
        );
    }
}

/// Warm-up prompt `i` (of those present) followed by `extra` (cut at 40 tokens), and its
/// namespace byte.
fn warm_prompt(s: &Setup, i: u8, extra: &Tokens) -> Option<(Vec<u32>, u8)> {
    let warm: Vec<&(Tokens, u8)> = s.warm.iter().flatten().collect();
    let (t, ns) = warm.get(usize::from(i) % warm.len().max(1))?;
    // At most 40 tokens, as every prompt of the driver.
    let mut tokens = [&t.0[..], &extra.0[..]].concat();
    tokens.truncate(40);
    Some((tokens, *ns))
}

fn prefetch(c: &mut Cache, rid: u8, tokens: &[u32], ns: u8) {
    let ns = namespace(ns);
    let used = c.controller().host().used();
    // A prefetch reserves host pages only once its query found pages.
    c.prefetch(u64::from(rid % RIDS), KeyRef::with_namespace(tokens, &ns));
    assert_eq!(
        c.controller().host().used(),
        used,
        "a prefetch allocated at once"
    );
}

fn store_op(d: &mut Harness, s: &Setup, store: &FaultStore<MemStore>, op: &StoreOp) {
    if let StoreOp::StartWarm { warm, extra } = op {
        if let Some((tokens, ns)) = warm_prompt(s, *warm, extra) {
            d.step(&DriverOp::Start {
                tokens: Tokens(tokens),
                share: None,
                ns,
            });
        }
        return;
    }
    let c = d.cache.inner_mut();
    let rid = |r: u8| u64::from(r % RIDS);
    match op {
        StoreOp::StartWarm { .. } => {}
        StoreOp::Prefetch { rid: r, tokens, ns } => prefetch(c, *r, &tokens.0, *ns),
        StoreOp::PrefetchWarm {
            rid: r,
            warm,
            extra,
        } => {
            if let Some((tokens, ns)) = warm_prompt(s, *warm, extra) {
                prefetch(c, *r, &tokens, ns);
            }
        }
        StoreOp::Check { rid: r } => {
            let st = c.check_prefetch(rid(*r)).expect("checking a prefetch");
            check_status(c, st);
        }
        StoreOp::Terminate { rid: r } => {
            let st = c
                .terminate_prefetch(rid(*r))
                .expect("terminating a prefetch");
            assert_ne!(
                st,
                PrefetchStatus::Pending,
                "a terminated prefetch is pending"
            );
            check_status(c, st);
        }
        StoreOp::Abort { rid: r } => {
            c.abort_prefetch(rid(*r)).expect("aborting a prefetch");
            assert_eq!(
                c.check_prefetch(rid(*r)).expect("checking a prefetch"),
                PrefetchStatus::None,
                "an aborted prefetch is still there"
            );
        }
        StoreOp::Wait => c.wait_storage().expect("waiting for the store"),
        StoreOp::Step => {
            c.step().expect("a step without copy faults");
        }
        StoreOp::Flush => {
            c.flush().expect("a flush without copy faults");
        }
        StoreOp::EvictHost { tokens } => {
            let before = c.host_tokens();
            let n = c.evict_host(tokens.0);
            assert!(
                n <= before && c.host_tokens() == before - n,
                "{n} of {before}"
            );
        }
        StoreOp::Faults(p, slow_ms, seed) => {
            store
                .set_config(faults(p, *slow_ms, *seed))
                .expect("valid probabilities");
        }
        StoreOp::Down(down) => store.set_down(*down),
    }
}

/// Serves the warm-up prompts one at a time (so `Plain(0)` is the one in flight), backs them
/// up to the store, and with `cold` empties the device and host tiers.
fn warm_up(d: &mut Harness, s: &Setup) {
    for (tokens, ns) in s.warm.iter().flatten() {
        d.step(&DriverOp::Start {
            tokens: tokens.clone(),
            share: None,
            ns: *ns,
        });
        d.step(&DriverOp::Compute {
            target: Target::Plain(0),
            n: Size(tokens.0.len()),
        });
        d.step(&DriverOp::Finish {
            target: Target::Plain(0),
            abort: false,
            overshoot: 0,
        });
        d.audit();
    }
    let c = d.cache.inner_mut();
    c.flush().expect("a flush without copy faults");
    c.wait_storage().expect("waiting for the store");
    if s.cold {
        d.step(&DriverOp::Evict {
            tokens: Size(usize::MAX),
        });
        let c = d.cache.inner_mut();
        c.evict_host(usize::MAX);
    }
    d.audit();
    audit_host(d);
}

fn run<'a>(setup: &Setup, comps: Components<'_>, ops: impl Iterator<Item = ModeOp<'a>>) {
    // A page of this geometry is at most 136 + 3 layers × 4 tokens × 8 bytes, plus 8 bytes of
    // header and the item per section.
    let page_cap = 232
        + comps.mamba.map_or(0, |m| 8 + state_bytes(m))
        + comps.swa.map_or(0, |w| 8 + window_page_bytes(w));
    let store = Arc::new(
        FaultStore::new(
            match setup.store_cap_pages % 32 {
                0 => MemStore::new(),
                n => MemStore::with_cap((usize::from(n) * page_cap) as u64),
            },
            FaultConfig::seeded(1),
        )
        .expect("no faults"),
    );
    let (cache, backend) = build(setup, comps, store.clone());
    let cfg = SessionConfig {
        max_held_tokens: 64,
        max_session_tokens: 64,
        idle_ttl: None,
        max_held_state_slots: usize::MAX,
        max_held_window_pages: usize::MAX,
    };
    let mut d = Driver::new(cache, cfg, BackendKv::new(backend.clone()), setup.events);
    if let Some(m) = comps.mamba {
        d = d.with_states(Box::new(BackendStates::new(backend, state_bytes(m))));
    }
    warm_up(&mut d, setup);
    for op in ops.take(96) {
        match op {
            ModeOp::Op(Op::Drive(op)) => d.step(op),
            ModeOp::Op(Op::Store(op)) => store_op(&mut d, setup, &store, op),
            ModeOp::EvictMamba(n) => evict_device_states(d.cache.inner_mut(), n),
            ModeOp::EvictWindow(n) => evict_device_window(d.cache.inner_mut(), n),
            ModeOp::Slide(t) => d.slide(t),
        }
        d.audit();
        audit_host(&d);
    }
    // Let every job finish (the faults still on: hangs end at their timeout), end every
    // prefetch keeping what it loaded, then, the store healthy again, serve the warm-up
    // prompts once more: their KV, loaded back from what the prefetches brought, is checked.
    let c = d.cache.inner_mut();
    c.wait_storage().expect("waiting for the store");
    for r in 0..RIDS {
        let st = c
            .terminate_prefetch(u64::from(r))
            .expect("terminating a prefetch");
        check_status(c, st);
    }
    store.set_down(false);
    store.set_config(FaultConfig::seeded(0)).expect("no faults");
    for i in 0..setup.warm.len() as u8 {
        store_op(
            &mut d,
            setup,
            &store,
            &StoreOp::StartWarm {
                warm: i,
                extra: Tokens(Vec::new()),
            },
        );
        d.audit();
        audit_host(&d);
    }
    d.cache
        .inner_mut()
        .wait_storage()
        .expect("waiting for the store");
    d.teardown();
    audit_host(&d);
    let c = d.cache.inner_mut();
    c.wait_storage().expect("waiting for the store");
    assert_eq!(
        c.unacked_backup_pages(),
        0,
        "a backup was never acknowledged"
    );
    assert_eq!(
        c.storage_tier().map_or(0, |t| t.in_flight()),
        0,
        "a storage job is still in flight"
    );
    let tree = c.device_cache().tree();
    assert_eq!(
        c.controller().host().used(),
        tree.host_page_count(),
        "host pages outside the tree"
    );
    if let Ok(a) = c.controller().extra_host(PoolName::Mamba) {
        let held = tree.mamba_host_states().expect("the Mamba component").len();
        assert_eq!(a.used(), held, "host state slots outside the tree");
    }
    if let Ok(a) = c.controller().extra_host(PoolName::Swa) {
        let held = tree.swa_host_page_count();
        assert_eq!(a.used(), held, "host window pages outside the tree");
    }
}

fuzz_target!(|data: &[u8]| {
    let (mode, rest) = match data.split_first() {
        Some((&m @ (b'M' | b'S' | b'B'), rest)) => (m, rest),
        _ => {
            if let Ok(i) = Input::arbitrary_take_rest(Unstructured::new(data)) {
                run(&i.setup, Components::NONE, i.ops.iter().map(ModeOp::Op));
            }
            return;
        }
    };
    let Ok(i) = HybridInput::arbitrary_take_rest(Unstructured::new(rest)) else {
        return;
    };
    let comps = Components {
        mamba: (mode != b'S').then_some(&i.mamba),
        swa: (mode != b'M').then_some(&i.swa),
    };
    let ops = i.ops.iter().filter_map(|op| match op {
        // No session operations with both components (see the module docs).
        HybridOp::Op(Op::Drive(op)) if mode == b'B' && op.is_session_op() => None,
        HybridOp::Op(op) => Some(ModeOp::Op(op)),
        HybridOp::EvictMamba { n } => Some(ModeOp::EvictMamba(*n)),
        HybridOp::EvictWindow { n } => Some(ModeOp::EvictWindow(*n)),
        HybridOp::Slide(t) => Some(ModeOp::Slide(*t)),
    });
    run(&i.setup, comps, ops);
});
