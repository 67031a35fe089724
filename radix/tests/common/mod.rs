//! Shared by the reference-model property tests of this crate.

// Each test binary uses a part of these helpers.
#![allow(dead_code)]

use proptest::test_runner::Config;

/// Cases per property test: `PROPTEST_CASES` when set, else 64 (few enough for a debug build).
pub fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// The configuration of the state-machine tests: [`cases`] cases, and shrinking long enough to
/// reach a short failing sequence of transitions.
pub fn state_machine_config() -> Config {
    Config {
        cases: cases(),
        max_shrink_iters: 4096,
        ..Config::default()
    }
}
pub mod mamba_traffic;
