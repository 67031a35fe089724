//! Cross-crate integration, model-based and end-to-end tests live in `tests/tests/`; this
//! library holds what several of them share.

pub mod model_kv;
