//! How [`CudaBackend`](super::CudaBackend) hands a copy's spans to the GPU: one
//! `cuMemcpyAsync` per span, one `cuMemcpyBatchAsync` for all of them (drivers of CUDA 12.8
//! and later), or a gather/scatter kernel compiled at run time with NVRTC that reads and
//! writes the pinned host buffer through its device mapping. The choice, the kernel's launch
//! parameters and the batched call's arrays are planned here without a driver call, so they
//! are tested on machines without a GPU.

use crate::backend::Direction;

use super::plan::Span;

/// How a [`CudaBackend`](super::CudaBackend) submits the spans of a copy
/// ([`CudaConfig::copy_method`](super::CudaConfig::copy_method)).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// Per copy (the default): copies of fewer than [`AUTO_MIN_SPANS`] spans, or whose spans
    /// average at least [`CudaConfig::memcpy_min_span`](super::CudaConfig::memcpy_min_span)
    /// bytes, go as one memcpy per span; other copies (many short spans: single pages,
    /// page-first host layouts) go to the kernel when it compiled and the host buffer is
    /// pinned, else to the batched call when the driver has it, else to one memcpy per span.
    #[default]
    Auto,
    /// One asynchronous memcpy per span, always.
    Memcpy,
    /// One `cuMemcpyBatchAsync` per copy. Refused at construction
    /// ([`HiCacheError::CopyMethodUnavailable`](crate::HiCacheError::CopyMethodUnavailable))
    /// when the driver is older than CUDA 12.8 or lacks the call.
    Batched,
    /// The gather/scatter kernel. Refused at construction when NVRTC (`libnvrtc`) is not
    /// installed or the kernel does not compile or load, and when host buffers are not pinned
    /// (`pin_host == false`); a host buffer that the driver refuses to pin is copied with one
    /// memcpy per span (the copy counts under [`CopyMethod::Memcpy`]).
    Kernel,
}

impl CopyMethod {
    /// The method's name, as the tests and the GPU check print it.
    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Memcpy => "memcpy",
            CopyMethod::Batched => "batched",
            CopyMethod::Kernel => "kernel",
        }
    }
}

/// Copies of fewer spans than this always go as memcpys under [`CopyMethod::Auto`]: a kernel
/// launch or a batched call saves nothing over so few driver calls.
pub const AUTO_MIN_SPANS: usize = 4;

/// The default of [`CudaConfig::memcpy_min_span`](super::CudaConfig::memcpy_min_span): spans
/// of at least 256 KiB on average go as memcpys (the copy engines' per-call cost is small
/// against them).
pub const DEFAULT_MEMCPY_MIN_SPAN: usize = 256 << 10;

/// What a copy is submitted as (never [`CopyMethod::Auto`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Memcpy,
    Batched,
    Kernel,
}

impl Route {
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What this backend can use besides memcpys.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Have {
    pub(crate) batched: bool,
    pub(crate) kernel: bool,
}

/// The route of a copy of `spans` under `method`; `host_mapped` says whether the host buffer
/// is pinned and mapped into the device's address space (the kernel needs it).
pub(crate) fn choose(
    method: CopyMethod,
    spans: &[Span],
    have: Have,
    host_mapped: bool,
    memcpy_min_span: usize,
) -> Route {
    let kernel = have.kernel && host_mapped;
    match method {
        CopyMethod::Memcpy => Route::Memcpy,
        CopyMethod::Batched if have.batched => Route::Batched,
        CopyMethod::Kernel if kernel => Route::Kernel,
        CopyMethod::Batched | CopyMethod::Kernel => Route::Memcpy,
        CopyMethod::Auto => {
            if spans.len() < AUTO_MIN_SPANS {
                return Route::Memcpy;
            }
            let bytes: usize = spans.iter().map(|s| s.len).sum();
            if bytes / spans.len() >= memcpy_min_span {
                Route::Memcpy
            } else if kernel {
                Route::Kernel
            } else if have.batched {
                Route::Batched
            } else {
                Route::Memcpy
            }
        }
    }
}

/// The (destination, source) addresses of `span` for direction `dir`, with the host buffer
/// at `host` in the address space the callee uses.
#[inline]
fn ends(dir: Direction, host: u64, span: &Span) -> (u64, u64) {
    let h = host + span.host as u64;
    match dir {
        Direction::HostToDevice => (span.device, h),
        Direction::DeviceToHost => (h, span.device),
    }
}

/// The arrays of one `cuMemcpyBatchAsync` call for `spans` (the host buffer at `host`).
pub(crate) fn batch_arrays(
    dir: Direction,
    host: u64,
    spans: &[Span],
    dsts: &mut Vec<u64>,
    srcs: &mut Vec<u64>,
    sizes: &mut Vec<usize>,
) {
    dsts.clear();
    srcs.clear();
    sizes.clear();
    for s in spans {
        let (d, src) = ends(dir, host, s);
        dsts.push(d);
        srcs.push(src);
        sizes.push(s.len);
    }
}

/// Spans one kernel launch copies (its parameter block stays under the 4 KiB every CUDA
/// version accepts).
pub(crate) const KERNEL_SPANS: usize = 160;

/// Bytes of a span one thread block copies at most, before the span is split over more
/// blocks (grid rows).
pub(crate) const KERNEL_BLOCK_BYTES: usize = 64 << 10;

/// Grid rows at most: a span is split over at most this many blocks.
pub(crate) const KERNEL_MAX_ROWS: u32 = 64;

/// Threads per block.
pub(crate) const KERNEL_THREADS: u32 = 256;

/// One span as the kernel reads it.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KernelSpan {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
}

/// The kernel's only parameter, passed by value: `n` spans.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub(crate) struct KernelBatch {
    pub(crate) n: u64,
    pub(crate) spans: [KernelSpan; KERNEL_SPANS],
}

/// One launch: its parameter and its grid (`n` columns, one per span, and `rows` blocks per
/// span).
#[derive(Clone, Debug)]
pub(crate) struct Launch {
    pub(crate) batch: KernelBatch,
    pub(crate) rows: u32,
}

/// Calls `launch` for each launch that copies `spans` (the host buffer mapped at `host`), in
/// order; stops at the first error.
pub(crate) fn kernel_launches<E>(
    dir: Direction,
    host: u64,
    spans: &[Span],
    mut launch: impl FnMut(usize, &Launch) -> Result<(), E>,
) -> Result<(), E> {
    for (i, chunk) in spans.chunks(KERNEL_SPANS).enumerate() {
        let mut l = Launch {
            batch: KernelBatch {
                n: chunk.len() as u64,
                spans: [KernelSpan::default(); KERNEL_SPANS],
            },
            rows: 1,
        };
        let mut longest = 0;
        for (slot, s) in l.batch.spans.iter_mut().zip(chunk) {
            let (dst, src) = ends(dir, host, s);
            *slot = KernelSpan {
                dst,
                src,
                len: s.len as u64,
            };
            longest = longest.max(s.len);
        }
        l.rows = longest
            .div_ceil(KERNEL_BLOCK_BYTES)
            .clamp(1, KERNEL_MAX_ROWS as usize) as u32;
        launch(i, &l)?;
    }
    Ok(())
}

/// The virtual architecture the kernel is compiled for (the driver JIT-compiles the PTX for
/// the device; older devices cannot load it, and the backend then goes without the kernel).
pub(crate) const KERNEL_ARCH: &str = "compute_70";

/// The kernel's name in [`KERNEL_SRC`].
pub(crate) const KERNEL_NAME: &str = "radixkv_copy_spans";

/// The gather/scatter kernel (CUDA C++, compiled by NVRTC when a backend opens). Block
/// (x, y) copies the y-th of `gridDim.y` equal, 16-byte aligned parts of span x: 16 bytes per
/// thread and step when both ends and the part are 16-byte aligned, byte by byte otherwise.
/// The structs must match [`KernelSpan`] and [`KernelBatch`]. The parameter is
/// `__grid_constant__` (compute capability 7.0 and later, [`KERNEL_ARCH`]) so that indexing
/// it reads the parameter in place instead of copying 3.8 KiB into each thread's local
/// memory.
pub(crate) const KERNEL_SRC: &str = r#"
struct RadixkvSpan { unsigned long long dst, src, len; };
struct RadixkvBatch { unsigned long long n; RadixkvSpan s[160]; };

extern "C" __global__ void radixkv_copy_spans(const __grid_constant__ RadixkvBatch b) {
    if (blockIdx.x >= b.n) return;
    const RadixkvSpan sp = b.s[blockIdx.x];
    unsigned long long part = (sp.len + gridDim.y - 1) / gridDim.y;
    part = (part + 15ULL) & ~15ULL;
    const unsigned long long lo = part * blockIdx.y;
    if (lo >= sp.len) return;
    const unsigned long long hi = lo + part < sp.len ? lo + part : sp.len;
    char* d = (char*)sp.dst;
    const char* s = (const char*)sp.src;
    if (((sp.dst | sp.src | hi) & 15ULL) == 0) {
        for (unsigned long long i = lo + 16ULL * threadIdx.x; i < hi; i += 16ULL * blockDim.x) {
            *(uint4*)(d + i) = *(const uint4*)(s + i);
        }
    } else {
        for (unsigned long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn span(device: u64, host: usize, len: usize) -> Span {
        Span { device, host, len }
    }

    const BOTH: Have = Have {
        batched: true,
        kernel: true,
    };

    #[test]
    fn auto_sends_few_or_long_spans_as_memcpys_and_short_ones_to_the_kernel() {
        let short: Vec<Span> = (0..8)
            .map(|i| span(i << 20, i as usize * 4096, 4096))
            .collect();
        let long: Vec<Span> = (0..8)
            .map(|i| span(i << 30, (i as usize) << 20, 1 << 20))
            .collect();
        let min = DEFAULT_MEMCPY_MIN_SPAN;
        let auto =
            |spans: &[Span], have, mapped| choose(CopyMethod::Auto, spans, have, mapped, min);
        assert_eq!(auto(&short[..3], BOTH, true), Route::Memcpy);
        assert_eq!(auto(&short, BOTH, true), Route::Kernel);
        assert_eq!(auto(&long, BOTH, true), Route::Memcpy);
        // Without a mapped host buffer or a kernel: the batched call, then memcpys.
        assert_eq!(auto(&short, BOTH, false), Route::Batched);
        let no_kernel = Have {
            batched: true,
            kernel: false,
        };
        assert_eq!(auto(&short, no_kernel, true), Route::Batched);
        let neither = Have {
            batched: false,
            kernel: false,
        };
        assert_eq!(auto(&short, neither, true), Route::Memcpy);
        // The threshold is the configured one.
        assert_eq!(
            choose(CopyMethod::Auto, &long, BOTH, true, 2 << 20),
            Route::Kernel
        );
    }

    #[test]
    fn forced_methods_are_kept_where_possible() {
        let spans = [span(0, 0, 16)];
        let c = |m, have, mapped| choose(m, &spans, have, mapped, DEFAULT_MEMCPY_MIN_SPAN);
        assert_eq!(c(CopyMethod::Memcpy, BOTH, true), Route::Memcpy);
        assert_eq!(c(CopyMethod::Batched, BOTH, true), Route::Batched);
        assert_eq!(c(CopyMethod::Kernel, BOTH, true), Route::Kernel);
        // A buffer the driver would not pin cannot be read by the kernel.
        assert_eq!(c(CopyMethod::Kernel, BOTH, false), Route::Memcpy);
    }

    #[test]
    fn batch_arrays_put_the_host_on_the_side_of_the_direction() {
        let spans = [span(1000, 8, 16), span(5000, 64, 32)];
        let (mut d, mut s, mut n) = (Vec::new(), Vec::new(), Vec::new());
        batch_arrays(
            Direction::HostToDevice,
            1 << 40,
            &spans,
            &mut d,
            &mut s,
            &mut n,
        );
        assert_eq!(d, [1000, 5000]);
        assert_eq!(s, [(1 << 40) + 8, (1 << 40) + 64]);
        assert_eq!(n, [16, 32]);
        batch_arrays(
            Direction::DeviceToHost,
            1 << 40,
            &spans,
            &mut d,
            &mut s,
            &mut n,
        );
        assert_eq!(s, [1000, 5000]);
        assert_eq!(d, [(1 << 40) + 8, (1 << 40) + 64]);
        assert_eq!(n, [16, 32]);
    }

    #[test]
    fn kernel_launches_cover_every_span_once_in_order() {
        let spans: Vec<Span> = (0..(2 * KERNEL_SPANS + 7))
            .map(|i| span(i as u64 * 100_000, i * 70_000, 1 + (i * 977) % 300_000))
            .collect();
        let mut seen = Vec::new();
        let mut launches = 0;
        kernel_launches::<()>(Direction::DeviceToHost, 7 << 32, &spans, |i, l| {
            assert_eq!(i, launches);
            launches += 1;
            let n = l.batch.n as usize;
            assert!((1..=KERNEL_SPANS).contains(&n));
            let longest = l.batch.spans[..n].iter().map(|s| s.len).max().unwrap();
            // Enough rows that no block copies more than its share, within the cap.
            assert!(
                l.rows == KERNEL_MAX_ROWS
                    || longest <= u64::from(l.rows) * KERNEL_BLOCK_BYTES as u64
            );
            assert!(l.rows >= 1 && l.rows <= KERNEL_MAX_ROWS);
            assert!(
                l.batch.spans[n..]
                    .iter()
                    .all(|s| *s == KernelSpan::default())
            );
            seen.extend_from_slice(&l.batch.spans[..n]);
            Ok(())
        })
        .unwrap();
        assert_eq!(launches, 3);
        let want: Vec<KernelSpan> = spans
            .iter()
            .map(|s| KernelSpan {
                dst: (7 << 32) + s.host as u64,
                src: s.device,
                len: s.len as u64,
            })
            .collect();
        assert_eq!(seen, want);
        // An error stops the launches.
        let mut calls = 0;
        let r = kernel_launches(Direction::HostToDevice, 0, &spans, |_, _| {
            calls += 1;
            Err("refused")
        });
        assert_eq!((r, calls), (Err("refused"), 1));
    }

    #[test]
    fn the_kernel_parameter_fits_every_cuda_version_and_matches_the_source() {
        assert_eq!(std::mem::size_of::<KernelSpan>(), 24);
        assert_eq!(std::mem::size_of::<KernelBatch>(), 8 + 24 * KERNEL_SPANS);
        assert!(std::mem::size_of::<KernelBatch>() <= 4096);
        assert!(KERNEL_SRC.contains(&format!("RadixkvSpan s[{KERNEL_SPANS}]")));
        assert!(KERNEL_SRC.contains(&format!("void {KERNEL_NAME}(")));
    }

    /// The kernel's part arithmetic, run on the CPU: every byte of every span is copied
    /// exactly once, for lengths around the alignment and the block size.
    #[test]
    fn the_kernel_parts_cover_each_span_exactly_once() {
        for len in [
            1usize,
            15,
            16,
            17,
            4096,
            65_535,
            65_536,
            65_537,
            1 << 22,
            (1 << 22) + 3,
        ] {
            let rows = len
                .div_ceil(KERNEL_BLOCK_BYTES)
                .clamp(1, KERNEL_MAX_ROWS as usize) as u64;
            let len = len as u64;
            let mut part = len.div_ceil(rows);
            part = (part + 15) & !15;
            let mut covered = 0;
            for y in 0..rows {
                let lo = part * y;
                if lo >= len {
                    continue;
                }
                assert_eq!(lo, covered, "len {len}: parts leave a gap or overlap");
                assert_eq!(lo % 16, 0);
                covered = (lo + part).min(len);
            }
            assert_eq!(covered, len, "len {len}");
        }
    }
}
