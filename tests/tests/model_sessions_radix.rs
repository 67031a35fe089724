//! Model test: streaming sessions over the device-only cache,
//! `SessionAwareCache<RadixCache>`, under the shared session model
//! ([`radixkv_tests::session_model`]): many interleaved sessions and ordinary requests over a
//! small pool, so budgets, TTL expiry and allocation pressure demote sessions all the time.
//! The device memory model is one value per KV slot; at teardown the pool must hold nothing
//! but free or evictable pages.
//!
//! The hybrid variant ([`MambaDevice`]) runs the same model over a cache with Mamba state slots
//! (a small pool, either policy): session slots keep the running state across turns, demotion
//! and pressure hand it to the tree or free it, and at teardown no slot is request-held.

use std::convert::Infallible;

use proptest::prelude::*;
use proptest_state_machine::prop_state_machine;
use radixkv_radix::{MambaPolicy, MarconiParams, PrefixCache, RadixCache, RadixConfig};
use radixkv_tests::model_kv::SlotMemory;
use radixkv_tests::session_model::{Flight, Machine, Profile, Sut, Tier};

const P: usize = 4;
const PAGES: usize = 64;

/// The device-only tier: KV lives in a slot memory the test keeps beside the cache.
struct Device;

impl Tier for Device {
    type Inner = RadixCache;
    type Kv = SlotMemory;
    type Params = ();
    type Extra = Infallible;
    const PROFILE: Profile = Profile {
        sessions: 6,
        plain: 100..102,
        device_tokens: PAGES * P,
        budget: 320,
        idle_ttl: Some(30),
        prompt: 40,
        plain_tokens: 120,
        share: 200,
        past: 6,
    };

    fn params() -> BoxedStrategy<()> {
        Just(()).boxed()
    }

    fn extra_ops() -> Vec<(u32, BoxedStrategy<Infallible>)> {
        Vec::new()
    }

    fn build(_: &()) -> (SlotMemory, RadixCache) {
        device_cache(RadixConfig::default())
    }

    fn load_back(_: &mut Sut<Self>, _: &mut Flight) -> bool {
        true
    }

    fn apply_extra(_: &mut Sut<Self>, op: Infallible) {
        match op {}
    }

    fn drain(_: &mut Sut<Self>) {}

    fn check_drained(sut: &Sut<Self>) {
        Device::check_drained_pages(sut.c.pools());
    }
}

/// The device-only tier over a hybrid model: the cache also has a pool of Mamba state slots.
struct MambaDevice;

/// How a hybrid run is built: state slots, and Marconi (with prompt-end checkpoints) or the
/// SGLang-style policy.
#[derive(Clone, Debug)]
struct Hybrid {
    slots: u32,
    marconi: bool,
}

impl Tier for MambaDevice {
    type Inner = RadixCache;
    type Kv = SlotMemory;
    type Params = Hybrid;
    type Extra = Infallible;
    const PROFILE: Profile = Device::PROFILE;
    const RUNNING_STATE: bool = true;

    fn params() -> BoxedStrategy<Hybrid> {
        (3u32..24, any::<bool>())
            .prop_map(|(slots, marconi)| Hybrid { slots, marconi })
            .boxed()
    }

    fn extra_ops() -> Vec<(u32, BoxedStrategy<Infallible>)> {
        Vec::new()
    }

    fn build(h: &Hybrid) -> (SlotMemory, RadixCache) {
        let mamba_policy = if h.marconi {
            MambaPolicy::Marconi(MarconiParams {
                prompt_end: true,
                ..Default::default()
            })
        } else {
            MambaPolicy::Sglang
        };
        device_cache(RadixConfig {
            mamba_slots: Some(h.slots),
            mamba_policy,
            ..Default::default()
        })
    }

    fn load_back(_: &mut Sut<Self>, _: &mut Flight) -> bool {
        true
    }

    fn apply_extra(_: &mut Sut<Self>, op: Infallible) {
        match op {}
    }

    fn drain(_: &mut Sut<Self>) {}

    fn check_drained(sut: &Sut<Self>) {
        Device::check_drained_pages(sut.c.pools());
        check_no_state_held(sut);
    }
}

/// The device-only tier over a sliding-window model: the cache also has a pool of window
/// pages (small, so allocations run short of them and demote idle sessions' windows); session
/// slots keep their window tables across turns, and at teardown no window page is held.
struct SwaDevice;

impl Tier for SwaDevice {
    type Inner = RadixCache;
    type Kv = SlotMemory;
    /// Window (pages) and SWA pool pages.
    type Params = (usize, usize);
    type Extra = Infallible;
    const PROFILE: Profile = Device::PROFILE;
    const WINDOW: bool = true;

    fn params() -> BoxedStrategy<(usize, usize)> {
        (1usize..4, 24usize..64).boxed()
    }

    fn extra_ops() -> Vec<(u32, BoxedStrategy<Infallible>)> {
        Vec::new()
    }

    fn build(&(window, pages): &(usize, usize)) -> (SlotMemory, RadixCache) {
        device_cache(RadixConfig {
            swa: Some(radixkv_radix::SwaConfig {
                window: window * P,
                pages,
            }),
            ..Default::default()
        })
    }

    fn load_back(_: &mut Sut<Self>, _: &mut Flight) -> bool {
        true
    }

    fn apply_extra(_: &mut Sut<Self>, op: Infallible) {
        match op {}
    }

    fn drain(_: &mut Sut<Self>) {}

    fn check_drained(sut: &Sut<Self>) {
        Device::check_drained_pages(sut.c.pools());
        check_no_window_held(sut);
    }
}

/// The device-only tier over a model with all three kinds of layers: one tree carries both
/// the window pages and the Mamba states (small pools of each), and a session slot keeps its
/// running state and its window table across turns.
struct SwaMambaDevice;

impl Tier for SwaMambaDevice {
    type Inner = RadixCache;
    type Kv = SlotMemory;
    /// Window (pages), SWA pool pages, state slots.
    type Params = (usize, usize, u32);
    type Extra = Infallible;
    const PROFILE: Profile = Device::PROFILE;
    const RUNNING_STATE: bool = true;
    const WINDOW: bool = true;

    fn params() -> BoxedStrategy<(usize, usize, u32)> {
        (1usize..4, 24usize..64, 3u32..24).boxed()
    }

    fn extra_ops() -> Vec<(u32, BoxedStrategy<Infallible>)> {
        Vec::new()
    }

    fn build(&(window, pages, slots): &(usize, usize, u32)) -> (SlotMemory, RadixCache) {
        device_cache(RadixConfig {
            mamba_slots: Some(slots),
            mamba_policy: MambaPolicy::Sglang,
            swa: Some(radixkv_radix::SwaConfig {
                window: window * P,
                pages,
            }),
            ..Default::default()
        })
    }

    fn load_back(_: &mut Sut<Self>, _: &mut Flight) -> bool {
        true
    }

    fn apply_extra(_: &mut Sut<Self>, op: Infallible) {
        match op {}
    }

    fn drain(_: &mut Sut<Self>) {}

    fn check_drained(sut: &Sut<Self>) {
        Device::check_drained_pages(sut.c.pools());
        check_no_window_held(sut);
        check_no_state_held(sut);
    }
}

impl Device {
    fn check_drained_pages(pools: &radixkv_radix::DevicePools) {
        assert_eq!(pools.pages.available() + pools.pages.tree_pages(), PAGES);
    }
}

/// A radix cache of `PAGES` pages of `P` tokens and 16 rows, with `extra`'s components, and
/// the slot memory beside it.
fn device_cache(extra: RadixConfig) -> (SlotMemory, RadixCache) {
    let inner = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: PAGES,
        max_rows: 16,
        ..extra
    })
    .unwrap();
    (SlotMemory::new(PAGES, P), inner)
}

/// At teardown the SWA pool balances and no window page is request-held, protected or held
/// by a session slot.
fn check_no_window_held<T: Tier<Inner = RadixCache>>(sut: &Sut<T>) {
    let a = sut.c.inner().swa_accounting().unwrap();
    assert!(a.balanced(), "{a:?}");
    assert_eq!(
        a.request_owned + a.protected,
        0,
        "window pages leaked: {a:?}"
    );
    assert_eq!(sut.c.held_window_pages(), 0);
}

/// At teardown the Mamba pool balances and no state slot is request-held, protected or held
/// by a session slot.
fn check_no_state_held<T: Tier<Inner = RadixCache>>(sut: &Sut<T>) {
    let m = sut.c.inner().mamba_accounting().unwrap();
    assert!(m.balanced(), "{m:?}");
    assert_eq!(
        m.request_owned + m.protected,
        0,
        "state slots leaked: {m:?}"
    );
    assert_eq!(sut.c.held_state_slots(), 0);
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn sessions_under_pressure(sequential 1..80 => Machine<Device>);
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn hybrid_sessions_under_pressure(sequential 1..80 => Machine<MambaDevice>);
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn sliding_window_sessions_under_pressure(sequential 1..80 => Machine<SwaDevice>);
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn swa_and_mamba_sessions_under_pressure(sequential 1..80 => Machine<SwaMambaDevice>);
}
