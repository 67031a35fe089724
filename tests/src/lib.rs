//! Cross-crate integration, model-based and end-to-end tests live in `tests/tests/`; this
//! library holds what several of them share: the deterministic-interleaving explorer and the
//! request drivers its scenarios use.

pub mod interleave;
pub mod kv;
