//! Typed errors of the host tier and the transfer machinery.

use radixkv_radix::{CacheError, PageId};

use crate::backend::StreamKind;
use crate::controller::PoolName;

/// Errors of the host pool, the device backends and the controller.
///
/// Non-exhaustive: new failure kinds may be added, so a `match` needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HiCacheError {
    /// Not enough free host pages.
    #[error("host pool full: needed {needed} pages, {available} free")]
    HostFull {
        /// Pages requested.
        needed: usize,
        /// Pages free.
        available: usize,
    },
    /// Not enough free device pages.
    #[error("device pool full: needed {needed} pages, {available} free")]
    DeviceFull {
        /// Pages requested.
        needed: usize,
        /// Pages free.
        available: usize,
    },
    /// An extra pool (Mamba, SWA, ...) could not allocate; the whole operation rolled back.
    #[error("extra pool {pool:?} full: needed {needed} slots, {available} free")]
    ExtraPoolFull {
        /// The pool.
        pool: PoolName,
        /// Slots requested.
        needed: usize,
        /// Slots free.
        available: usize,
    },
    /// An operation named an extra pool the controller does not have.
    #[error("unknown extra pool {0:?}")]
    UnknownPool(PoolName),
    /// A host page index outside the pool.
    #[error("host page {0} is outside the pool")]
    HostPageOutOfRange(u32),
    /// A host page (or extra-pool slot) freed twice or never allocated.
    #[error("host page or slot {0} freed while not allocated (double free?)")]
    DoubleFree(u32),
    /// A device page outside the device pool.
    #[error("device page {0:?} is outside the device pool")]
    DevicePageOutOfRange(PageId),
    /// A layer index outside the geometry.
    #[error("layer {layer} out of range ({layers} layers)")]
    LayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// Layers in the geometry.
        layers: usize,
    },
    /// A buffer of the wrong size.
    #[error("buffer of {got} bytes where {expected} are needed")]
    BufferSize {
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Impossible configuration (zero sizes, mismatched geometry, ...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The backend failed or refused a copy.
    #[error("transfer failed: {0}")]
    Transfer(String),
    /// The stream's worker has exited: nothing submitted to it will run, and every event
    /// still pending on it completed with this error. Retrying cannot succeed.
    #[error("the {0:?} stream is closed (its worker exited)")]
    StreamClosed(StreamKind),
    /// The controller already holds its limit of pending operations (queued or in flight, not
    /// yet acknowledged) in this direction; nothing was allocated or queued.
    #[error("{stream:?} queue full: {limit} operations pending")]
    QueueFull {
        /// The direction (its stream).
        stream: StreamKind,
        /// The limit ([`HiCacheConfig::max_pending_ops`](crate::HiCacheConfig::max_pending_ops)).
        limit: usize,
    },
    /// The allocator refused a buffer (a pool larger than the machine's memory).
    #[error("could not allocate {bytes} bytes for the {what}")]
    AllocFailed {
        /// What the buffer was for.
        what: &'static str,
        /// Its size.
        bytes: usize,
    },
    /// No usable GPU: the CUDA driver library is not installed, the driver found no device,
    /// or the device asked for does not exist. Detected without touching the driver's
    /// functions when the library is missing, so it is an error, never a panic.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// The copy method a CUDA backend was configured with cannot run here (the driver lacks
    /// the batched call, NVRTC is missing, the kernel did not compile); nothing was set up.
    #[error("CUDA copy method {method} is not available: {why}")]
    CopyMethodUnavailable {
        /// The method's name (`batched`, `kernel`).
        method: &'static str,
        /// Why.
        why: String,
    },
    /// A CUDA driver call failed while setting a backend up or tearing one down (copies that
    /// fail report [`HiCacheError::Transfer`] instead).
    #[error("CUDA driver call {call} failed: {error}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error name and description.
        error: String,
    },
    /// An error of the radix layer.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Shorthand result type.
pub type Result<T, E = HiCacheError> = std::result::Result<T, E>;

impl From<HiCacheError> for CacheError {
    fn from(e: HiCacheError) -> Self {
        match e {
            HiCacheError::Cache(c) => c,
            HiCacheError::DeviceFull { needed, available } => {
                CacheError::OutOfPages { needed, available }
            }
            HiCacheError::Config(s) => CacheError::Config(s),
            e @ HiCacheError::AllocFailed { .. } => CacheError::Config(e.to_string()),
            // Transient: the pending transfers complete and are acknowledged at the next step.
            HiCacheError::QueueFull { .. } => CacheError::Busy("host tier transfer queue is full"),
            other => {
                // The radix error type has no transfer variant; keep the detail in the log.
                tracing::warn!(error = %other, "host tier operation failed");
                CacheError::InvalidRequestState("host tier operation failed")
            }
        }
    }
}
