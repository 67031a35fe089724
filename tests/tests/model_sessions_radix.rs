//! Model test: streaming sessions over the device-only cache,
//! `SessionAwareCache<RadixCache>`, under the shared session model
//! ([`radixkv_tests::session_model`]): many interleaved sessions and ordinary requests over a
//! small pool, so budgets, TTL expiry and allocation pressure demote sessions all the time.
//! The device memory model is one value per KV slot; at teardown the pool must hold nothing
//! but free or evictable pages.

use std::convert::Infallible;

use proptest::prelude::*;
use proptest_state_machine::prop_state_machine;
use radixkv_radix::{PrefixCache, RadixCache, RadixConfig};
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
        let inner = RadixCache::new(RadixConfig {
            page_size: P,
            total_pages: PAGES,
            max_rows: 16,
            ..Default::default()
        })
        .unwrap();
        (SlotMemory::new(PAGES, P), inner)
    }

    fn load_back(_: &mut Sut<Self>, _: &mut Flight) -> bool {
        true
    }

    fn apply_extra(_: &mut Sut<Self>, op: Infallible) {
        match op {}
    }

    fn drain(_: &mut Sut<Self>) {}

    fn check_drained(sut: &Sut<Self>) {
        let pages = &sut.c.pools().pages;
        assert_eq!(pages.available() + pages.tree_pages(), PAGES);
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn sessions_under_pressure(sequential 1..80 => Machine<Device>);
}
