//! Cross-crate integration, model-based and end-to-end tests live in `tests/tests/`; this
//! library holds what several of them share: the deterministic-interleaving explorer and the
//! request drivers its scenarios use, and the model-KV helpers of the model-based tests.

pub mod interleave;
pub mod kv;
pub mod model_kv;
