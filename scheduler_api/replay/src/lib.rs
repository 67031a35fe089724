//! # radixkv-replay — the reference scheduler and the `radixkv` binary
//!
//! The tool that replays real request traces through [`radixkv_scheduler_api::KvCacheManager`],
//! kept apart from the facade so that an engine embedding `radixkv-scheduler-api` compiles none
//! of the tool's dependencies (CLI, progress bar, trace decompression and parsing, plots).
//!
//! - [`sim`] holds a continuous-batching scheduler (FCFS admission, chunked prefill under a
//!   per-step token budget, a decode batch, retraction on decode OOM) that drives the manager
//!   under a cost model, and reports hit ratios per tier against the infinite-cache ideal,
//!   recomputed tokens, transfer bytes, simulated TTFT and throughput, and the manager's CPU
//!   time per request.
//! - [`trace`] reads Mooncake, agentic multi-turn and Azure traces and generates a synthetic
//!   multi-turn chat workload; hash blocks become deterministic token runs so the cache sees
//!   real token sequences.
//! - [`analysis`] is offline capacity planning over a trace (`radixkv analyze`).
//! - [`plot`] draws the charts (with plotters) as SVG and PNG.
//!
//! ```
//! use radixkv_replay::sim::{SimConfig, replay};
//! use radixkv_replay::trace::SyntheticChat;
//!
//! let trace = SyntheticChat { conversations: 3, ..Default::default() }.generate()?;
//! let mut cfg = SimConfig::default();
//! cfg.manager.device_tokens = 64 << 10;
//! let report = replay(&trace, &cfg, &mut ())?;
//! assert!(report.hit_ratio.overall <= report.ideal_hit_ratio);
//! assert_eq!(report.leaked_tokens, 0);
//! # Ok::<(), radixkv_scheduler_api::ManagerError>(())
//! ```
//!
//! ## Errors
//! Every bad input (malformed trace, unknown format, impossible configuration) returns a typed
//! [`radixkv_scheduler_api::ManagerError`]; nothing reachable from the public API panics.

#![warn(missing_docs)]

pub mod analysis;
pub mod plot;
pub mod sim;
pub mod trace;
