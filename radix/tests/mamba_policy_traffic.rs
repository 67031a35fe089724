//! The Mamba policies on small synthetic chat-like and agentic-like traffic (the shapes of the
//! `mamba_policy` example, fewer conversations): the cache stays consistent after every batch
//! under both, and the default Marconi policy's usable token hit ratio is at least the
//! baseline's, at equal slot counts, and never above the ideal. Requests end off page
//! boundaries, so the baseline's request-end states come from tracking slots.

mod common;

use common::mamba_traffic::{Shape, drive, generate};
use radixkv_radix::{CheckpointKind, MambaPolicy};

const BATCH: usize = 4;

fn compare(name: &str, shape: Shape, pages: usize, slots: u32) -> (f64, f64) {
    let reqs = generate(shape, BATCH, 11);
    let (ideal, _) = drive(&reqs, MambaPolicy::Sglang, None, 1 << 16, BATCH, false);
    let (base, base_cache) = drive(&reqs, MambaPolicy::Sglang, Some(slots), pages, BATCH, true);
    // Requests end off page boundaries: their request-end states come from tracking slots.
    assert!(
        base_cache.mamba_stats().unwrap().tracked_stored > 0,
        "{name}"
    );
    let (ours, cache) = drive(
        &reqs,
        MambaPolicy::default(),
        Some(slots),
        pages,
        BATCH,
        true,
    );
    assert_eq!(base.refused + ours.refused, 0, "{name}: every request ran");
    assert!(
        ours.ratio() >= base.ratio(),
        "{name}, {slots} slots: marconi {:.3} < sglang {:.3}",
        ours.ratio(),
        base.ratio()
    );
    assert!(ours.ratio() <= ideal.ratio() && base.ratio() <= ideal.ratio());
    let st = cache.mamba_stats().unwrap();
    assert!(
        st.kind(CheckpointKind::Branch).hits > 0,
        "{name}: branch states are hit"
    );
    (base.ratio(), ours.ratio())
}

#[test]
fn chat_like_traffic_marconi_is_at_least_the_baseline() {
    for slots in [16, 48] {
        let shape = Shape {
            open: 24,
            ..Shape::chat(80)
        };
        compare("chat", shape, 4096, slots);
    }
}

#[test]
fn agentic_like_traffic_marconi_is_at_least_the_baseline() {
    for slots in [16, 48] {
        let shape = Shape {
            open: 12,
            ..Shape::agentic(24)
        };
        compare("agentic", shape, 8192, slots);
    }
}
