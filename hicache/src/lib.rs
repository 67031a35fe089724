//! Hierarchical cache: host pool, device backends, `HybridCacheController`, `HiRadixCache`
//! (issue #4).
