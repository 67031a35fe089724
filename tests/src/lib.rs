//! Cross-crate integration, model-based and end-to-end tests live in `tests/tests/`.
