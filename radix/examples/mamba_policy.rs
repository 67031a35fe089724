//! Compares the Mamba policies on synthetic chat-like and agentic-like traffic at equal slot
//! counts: the token hit ratio a request can actually use (its prefix ends at a state), against
//! the ideal (the KV-only match with an unbounded pool). Prints the markdown table of the
//! `mamba_policy` module docs: per workload and slot count, the median over three seeds and,
//! for the ratios to the baseline (with tracking slots), their range. The "no tracking"
//! columns run without tracking slots (`RadixConfig::mamba_track` off).
//!
//! `cargo run --release -p radixkv-radix --example mamba_policy [convs]`

#[path = "../tests/common/mamba_traffic.rs"]
mod traffic;

use radixkv_radix::{MambaPolicy, MarconiParams};
use traffic::{Shape, drive, drive_tracking, generate};

const BATCH: usize = 4;
const SEEDS: [u64; 3] = [7, 8, 9];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let convs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(400);
    let d = MarconiParams::default();
    let policies = [
        ("sglang, no tracking", MambaPolicy::Sglang, false),
        ("marconi (default)", MambaPolicy::default(), true),
        ("marconi, no tracking", MambaPolicy::default(), false),
        (
            "no hit-driven admission",
            MambaPolicy::Marconi(MarconiParams {
                min_hit_ratio: 0.0,
                ..d
            }),
            true,
        ),
        (
            "+ prompt end",
            MambaPolicy::Marconi(MarconiParams {
                prompt_end: true,
                ..d
            }),
            true,
        ),
        (
            "alpha 0",
            MambaPolicy::Marconi(MarconiParams { alpha: 0.0, ..d }),
            true,
        ),
    ];
    print!("| workload | slots | ideal | sglang |");
    for (name, _, _) in &policies {
        print!(" {name} |");
    }
    println!();
    println!("|{}", " --- |".repeat(4 + policies.len()));
    for (name, pages) in [("chat", 8192), ("agentic", 16384)] {
        let shape = |_: u64| match name {
            "chat" => Shape::chat(convs),
            _ => Shape::agentic(convs / 4),
        };
        let workloads: Vec<_> = SEEDS
            .iter()
            .map(|&s| generate(shape(s), BATCH, s))
            .collect();
        let ideal = median(
            workloads
                .iter()
                .map(|w| {
                    drive(w, MambaPolicy::Sglang, None, 1 << 20, BATCH, false)
                        .0
                        .ratio()
                })
                .collect(),
        );
        for slots in [16u32, 32, 64, 128] {
            let run = |policy, track| -> Vec<f64> {
                workloads
                    .iter()
                    .map(|w| {
                        drive_tracking(w, policy, Some(slots), pages, BATCH, false, track)
                            .0
                            .ratio()
                    })
                    .collect()
            };
            let base = run(MambaPolicy::Sglang, true);
            print!(
                "| {name} | {slots} | {ideal:.3} | {:.3} |",
                median(base.clone())
            );
            for (_, policy, track) in policies {
                let got = run(policy, track);
                let x: Vec<f64> = got.iter().zip(&base).map(|(g, b)| g / b).collect();
                let (lo, hi) = x
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                print!(" {:.3} ({:.2}×, {lo:.2}–{hi:.2}) |", median(got), median(x));
            }
            println!();
        }
    }
}
