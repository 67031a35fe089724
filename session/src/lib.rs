//! Session-aware cache: a decorator over any `PrefixCache` that keeps streaming sessions' KV
//! alive between turns (issue #3).
