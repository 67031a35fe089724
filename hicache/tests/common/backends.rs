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

/// The CUDA backend on device 0 with copy method `method`. Without a driver or device the
/// tests skip (the sentinel test in `backends.rs` says so once), unless `RADIXKV_REQUIRE_GPU`
/// is set: then a missing GPU fails them. A forced method this machine cannot use (an old
/// driver, no NVRTC) skips with a message.
#[cfg(feature = "cuda")]
fn make_cuda(
    g: KvGeometry,
    pages: usize,
    method: radixkv_hicache::cuda::CopyMethod,
) -> Option<Arc<radixkv_hicache::cuda::CudaBackend>> {
    use radixkv_hicache::HiCacheError;
    use radixkv_hicache::cuda::{CudaBackend, CudaConfig};
    let cfg = CudaConfig {
        copy_method: method,
        ..Default::default()
    };
    match CudaBackend::new(g, pages, cfg) {
        Ok(b) => Some(Arc::new(b)),
        Err(HiCacheError::NoDevice(why)) if std::env::var_os("RADIXKV_REQUIRE_GPU").is_none() => {
            eprintln!("skipped on CUDA: {why}");
            None
        }
        Err(e @ HiCacheError::CopyMethodUnavailable { .. }) => {
            eprintln!("skipped on CUDA ({}): {e}", method.name());
            None
        }
        Err(e) => panic!("CUDA backend ({}): {e}", method.name()),
    }
}

/// Factories of the CUDA backend, one per copy method.
macro_rules! cuda_factories {
    ($($(#[$doc:meta])* $name:ident => $method:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            #[cfg(feature = "cuda")]
            pub struct $name;

            #[cfg(feature = "cuda")]
            impl Factory for $name {
                type B = radixkv_hicache::cuda::CudaBackend;
                const NAME: &'static str = "cuda";
                fn make(g: KvGeometry, pages: usize) -> Option<Arc<Self::B>> {
                    make_cuda(g, pages, radixkv_hicache::cuda::CopyMethod::$method)
                }
            }
        )*
    };
}

cuda_factories! {
    /// The default configuration: the backend picks a method per copy.
    CudaFactory => Auto,
    /// One memcpy per span, always.
    CudaMemcpyFactory => Memcpy,
    /// The driver's batched copy call (skips on drivers older than CUDA 12.8).
    CudaBatchedFactory => Batched,
    /// The NVRTC gather/scatter kernel (skips without NVRTC).
    CudaKernelFactory => Kernel,
}

/// `for_each_backend! { name => generic_fn(args), ... }` defines `hostsim::name` and (with the
/// `cuda` feature) `cuda::name`, `cuda_memcpy::name`, `cuda_batched::name` and
/// `cuda_kernel::name` tests (the CUDA backend with each copy method) that call
/// `generic_fn::<Factory>(args)`.
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
        #[cfg(feature = "cuda")]
        mod cuda_memcpy {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    super::$f::<crate::common::backends::CudaMemcpyFactory>($($arg),*)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda_batched {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    super::$f::<crate::common::backends::CudaBatchedFactory>($($arg),*)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda_kernel {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    super::$f::<crate::common::backends::CudaKernelFactory>($($arg),*)
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use for_each_backend;
