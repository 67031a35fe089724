//! Shared by the manager's integration tests.

use radixkv_scheduler_api::{Admission, Admitted, KvCacheManager, ReqId};

/// Admits `id`, which must not have to wait (or be refused for good).
pub fn admitted(kv: &mut KvCacheManager, id: ReqId) -> Admitted {
    match kv.admit(id).unwrap() {
        Admission::Ready(a) => a,
        other => panic!("expected admission, got {other:?}"),
    }
}
