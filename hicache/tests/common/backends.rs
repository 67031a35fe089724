//! Every [`DeviceBackend`] the byte-exact suite runs on: [`HostSim`] always, the CUDA backend
//! with the `cuda` feature when a driver and a device are present. A suite is written once as
//! functions generic over a [`Factory`] and instantiated per backend by [`for_each_backend!`].

use std::sync::Arc;

use radixkv_hicache::{DeviceBackend, HostSim, HostSimConfig, KvGeometry, StreamKind};

/// Fault injection every backend under test has: the next `n` copies on `stream` fail (their
/// destination is poisoned, the next event fails).
pub trait FailCopies {
    fn fail_next_copies(&self, stream: StreamKind, n: u32);
}

impl FailCopies for HostSim {
    fn fail_next_copies(&self, stream: StreamKind, n: u32) {
        HostSim::fail_next_copies(self, stream, n);
    }
}

#[cfg(feature = "cuda")]
impl FailCopies for radixkv_hicache::cuda::CudaBackend {
    fn fail_next_copies(&self, stream: StreamKind, n: u32) {
        radixkv_hicache::cuda::CudaBackend::fail_next_copies(self, stream, n);
    }
}

/// Builds the backend under test.
pub trait Factory {
    /// The backend.
    type B: DeviceBackend + FailCopies;
    /// Its `DeviceBackend::name`.
    const NAME: &'static str;
    /// A device pool of `pages` pages, or `None` when this backend cannot run here (no GPU);
    /// the test then returns after saying so.
    fn make(g: KvGeometry, pages: usize) -> Option<Arc<Self::B>>;
}

/// The reference backend.
pub struct HostSimFactory;

impl Factory for HostSimFactory {
    type B = HostSim;
    const NAME: &'static str = "hostsim";
    fn make(g: KvGeometry, pages: usize) -> Option<Arc<HostSim>> {
        Some(Arc::new(
            HostSim::new(g, pages, HostSimConfig::default()).unwrap(),
        ))
    }
}

/// The CUDA backend on device 0. Without a driver or device the tests skip (the sentinel
/// test in `backends.rs` says so once), unless `RADIXKV_REQUIRE_GPU` is set: then a missing
/// GPU fails them.
#[cfg(feature = "cuda")]
pub struct CudaFactory;

#[cfg(feature = "cuda")]
impl Factory for CudaFactory {
    type B = radixkv_hicache::cuda::CudaBackend;
    const NAME: &'static str = "cuda";
    fn make(g: KvGeometry, pages: usize) -> Option<Arc<Self::B>> {
        use radixkv_hicache::HiCacheError;
        use radixkv_hicache::cuda::{CudaBackend, CudaConfig};
        match CudaBackend::new(g, pages, CudaConfig::default()) {
            Ok(b) => Some(Arc::new(b)),
            Err(HiCacheError::NoDevice(why))
                if std::env::var_os("RADIXKV_REQUIRE_GPU").is_none() =>
            {
                eprintln!("skipped on CUDA: {why}");
                None
            }
            Err(e) => panic!("CUDA backend: {e}"),
        }
    }
}

/// `for_each_backend! { name => generic_fn(args), ... }` defines `hostsim::name` and (with the
/// `cuda` feature) `cuda::name` tests that call `generic_fn::<Factory>(args)`.
#[allow(unused_macros)]
macro_rules! for_each_backend {
    ($($name:ident => $f:ident ( $($arg:expr),* $(,)? )),* $(,)?) => {
        mod hostsim {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    super::$f::<crate::common::backends::HostSimFactory>($($arg),*)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    super::$f::<crate::common::backends::CudaFactory>($($arg),*)
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use for_each_backend;
