//! The scheduler facade `KvCacheManager` and the reference scheduler (issue #5).
