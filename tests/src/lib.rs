//! Cross-crate integration, model-based and end-to-end tests live in `tests/tests/`; this
//! library holds what several of them share: the deterministic-interleaving explorer and the
//! request drivers its scenarios use, the model-KV helpers of the model-based tests, and the
//! reference model of sessions that the session model tests run over each inner cache.

pub mod interleave;
pub mod kv;
pub mod model_kv;
pub mod session_model;
