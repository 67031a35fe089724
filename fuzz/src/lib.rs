//! Oracles and input helpers shared by the radixkv fuzz targets.
//!
//! A target that only checks "no panic" finds little in a library whose errors are typed. Each
//! target here checks what the caches promise instead, with the help of three oracles:
//! - [`kv`]: the KV content of every token slot is a function of its whole token prefix, so a
//!   cache hit that hands out a page of another prefix, or a page freed and rewritten, is
//!   caught at the first read.
//! - [`events`]: a shadow of what is stored on each medium, built only from drained KV events,
//!   which must be self-consistent (no double store, no removal of what was never stored,
//!   chain hashes that match the tokens) and agree with the cache.
//! - [`footprint`]: what an error must leave unchanged.
//!
//! [`components`] sizes the Mamba and sliding-window components of a tiered cache.
//! [`input`] decodes the small sizes, huge sizes and token runs the operation sequences use;
//! [`trace`] checks decoded traces.

pub mod components;
pub mod driver;
pub mod events;
pub mod footprint;
pub mod input;
pub mod kv;
pub mod trace;

/// Panics with the message of a failed oracle check (the fuzzer reports the panic).
#[track_caller]
pub fn ok(r: Result<(), String>) {
    if let Err(m) = r {
        panic!("{m}");
    }
}
