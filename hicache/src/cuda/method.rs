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
    /// Per copy (the default), from the H200 measurements in the README: copies of fewer
    /// than [`AUTO_MIN_SPANS`] spans go as one memcpy per span; copies whose spans average
    /// less than [`CudaConfig::kernel_max_span`](super::CudaConfig::kernel_max_span) bytes
    /// (single pages, page-first host layouts, short runs) go to the kernel when it compiled
    /// and the host buffer is pinned; the others go to the batched call when the driver has
    /// it. Without the batched call, spans averaging under [`AUTO_MEMCPY_MIN_SPAN`] still go
    /// to the kernel and longer ones as memcpys; without the kernel, short spans go to the
    /// batched call, else as memcpys.
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

/// The default of [`CudaConfig::kernel_max_span`](super::CudaConfig::kernel_max_span): spans
/// shorter than 128 KiB on average go to the kernel. On an H200 (README) the batched call
/// moved spans of 4 and 16 KiB at 0.04–0.48× of one large memcpy's bandwidth and the kernel
/// at 0.86–0.92×; at 64 KiB both were at 0.90–0.95×; from 256 KiB the batched call reached
/// 0.96–1.00×, the kernel 0.91–0.95×.
pub const DEFAULT_KERNEL_MAX_SPAN: usize = 128 << 10;

/// Under [`CopyMethod::Auto`] on a driver without the batched call, spans averaging at least
/// this many bytes go as memcpys, shorter ones to the kernel (on an H200, one memcpy per span
/// moved 1 MiB spans at 0.86–0.88× against the kernel's 0.92–0.95×, and 4 MiB spans at
/// 0.96–0.97× against 0.92–0.94×).
pub const AUTO_MEMCPY_MIN_SPAN: usize = 2 << 20;

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
    kernel_max_span: usize,
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
            let average = bytes / spans.len();
            if kernel && average < kernel_max_span {
                Route::Kernel
            } else if have.batched {
                Route::Batched
            } else if kernel && average < AUTO_MEMCPY_MIN_SPAN {
                Route::Kernel
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

/// Spans one launch of the small kernel copies: its parameter block stays under the 4 KiB
/// every CUDA version accepts.
pub(crate) const KERNEL_SPANS_SMALL: usize = 160;

/// Spans one launch of the large kernel copies: its parameter block stays under the 32,764
/// bytes that drivers of CUDA 12.1 and later accept (NVRTC 12.1 and later compile it). On an
/// H200, single 4 KiB pages moved host → device at 0.71× of one memcpy with 160 spans per
/// launch (launch-bound) and at 0.87–0.90× with 1,360.
pub(crate) const KERNEL_SPANS_LARGE: usize = 1360;

/// The driver version from which the large kernel's parameter block is accepted.
pub(crate) const KERNEL_LARGE_MIN_DRIVER: i32 = 12010;

/// Bytes of a span one thread block copies at most in a host → device copy, before the span
/// is split over more blocks (grid rows): 256 threads × 4 loads of 16 bytes in flight each.
/// Reads of the host buffer wait on the bus, so loads go wide: one block per span and row.
pub(crate) const KERNEL_BLOCK_BYTES_H2D: usize = 16 << 10;

/// Bytes of a span one thread block copies at most in a device → host copy. Writes to the
/// host are posted and need no reads in flight: stores go one 16-byte word per thread and
/// step, in at most [`KERNEL_D2H_BLOCKS`] blocks that stride over the launch's spans (on an
/// H200 this moved 4 KiB to 256 KiB spans at 0.92–0.95× of one memcpy in a standalone CUDA
/// bench, as one block per span did, and at 0.90–0.95× through the backend).
pub(crate) const KERNEL_BLOCK_BYTES_D2H: usize = 64 << 10;

/// Blocks (grid columns) of a device → host launch at most.
pub(crate) const KERNEL_D2H_BLOCKS: usize = 160;

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

/// The kernel's only parameter, passed by value: `n` of `N` spans.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub(crate) struct KernelBatch<const N: usize> {
    pub(crate) n: u64,
    pub(crate) spans: [KernelSpan; N],
}

/// One launch: its parameter and its grid (`columns` blocks striding over the spans, and
/// `rows` blocks per span).
#[derive(Clone, Debug)]
pub(crate) struct Launch<const N: usize> {
    pub(crate) batch: KernelBatch<N>,
    pub(crate) columns: u32,
    pub(crate) rows: u32,
}

/// Calls `launch` for each launch of the kernel built for `N` spans that copies `spans` (the
/// host buffer mapped at `host`), in order; stops at the first error. One parameter block is
/// reused (boxed: the large one is 32 KiB), its unused slots zeroed.
pub(crate) fn kernel_launches<const N: usize, E>(
    dir: Direction,
    host: u64,
    spans: &[Span],
    mut launch: impl FnMut(usize, &Launch<N>) -> Result<(), E>,
) -> Result<(), E> {
    let mut l = Box::new(Launch {
        batch: KernelBatch {
            n: 0,
            spans: [KernelSpan::default(); N],
        },
        columns: 1,
        rows: 1,
    });
    let (block_bytes, max_columns) = match dir {
        Direction::HostToDevice => (KERNEL_BLOCK_BYTES_H2D, N),
        Direction::DeviceToHost => (KERNEL_BLOCK_BYTES_D2H, KERNEL_D2H_BLOCKS),
    };
    for (i, chunk) in spans.chunks(N).enumerate() {
        l.batch.n = chunk.len() as u64;
        l.batch.spans[chunk.len()..].fill(KernelSpan::default());
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
        l.columns = chunk.len().min(max_columns) as u32;
        l.rows = longest
            .div_ceil(block_bytes)
            .clamp(1, KERNEL_MAX_ROWS as usize) as u32;
        launch(i, &*l)?;
    }
    Ok(())
}

/// The virtual architectures the kernel may be compiled for, oldest first, with the compute
/// capability each needs (major × 10 + minor). The backend compiles for the oldest one that
/// the device runs and the installed NVRTC accepts (NVRTC 13 dropped `compute_70`); the
/// driver JIT-compiles that PTX for the device. A device older than the first cannot run the
/// kernel, and the backend then goes without it.
pub(crate) const KERNEL_ARCHES: &[(&str, u32)] = &[
    ("compute_70", 70),
    ("compute_75", 75),
    ("compute_80", 80),
    ("compute_90", 90),
];

/// The kernels' names in [`KERNEL_SRC`], host → device and device → host.
pub(crate) const KERNEL_NAMES: [&str; 2] = ["radixkv_copy_spans_h2d", "radixkv_copy_spans_d2h"];

/// The name of the kernel that copies in direction `dir`.
pub(crate) fn kernel_name(dir: Direction) -> &'static str {
    match dir {
        Direction::HostToDevice => KERNEL_NAMES[0],
        Direction::DeviceToHost => KERNEL_NAMES[1],
    }
}

/// The gather/scatter kernels (CUDA C++, compiled by NVRTC when a backend opens, with
/// `RADIXKV_SPANS` defined by [`kernel_source`]). Block (x, y) copies the y-th of `gridDim.y`
/// equal, 16-byte aligned parts of spans x, x + `gridDim.x`, …: 16-byte words when both ends
/// and the part are 16-byte aligned, bytes otherwise. Host → device, each thread loads four
/// words before it stores them (more reads of the host in flight); device → host, one word
/// per thread and step. The structs must match [`KernelSpan`] and [`KernelBatch`]. The
/// parameter is `__grid_constant__` (compute capability 7.0 and later, [`KERNEL_ARCHES`]) so
/// that indexing it reads the parameter in place instead of copying it into each thread's
/// local memory.
pub(crate) const KERNEL_SRC: &str = r#"
struct RadixkvSpan { unsigned long long dst, src, len; };
struct RadixkvBatch { unsigned long long n; RadixkvSpan s[RADIXKV_SPANS]; };

template <int WIDE>
__device__ __forceinline__ void radixkv_copy_part(const RadixkvSpan& sp) {
    unsigned long long part = (sp.len + gridDim.y - 1) / gridDim.y;
    part = (part + 15ULL) & ~15ULL;
    const unsigned long long lo = part * blockIdx.y;
    if (lo >= sp.len) return;
    const unsigned long long hi = lo + part < sp.len ? lo + part : sp.len;
    char* __restrict__ d = (char*)sp.dst;
    const char* __restrict__ s = (const char*)sp.src;
    if (((sp.dst | sp.src | hi) & 15ULL) == 0) {
        const unsigned long long step = 16ULL * blockDim.x;
        unsigned long long i = lo + 16ULL * threadIdx.x;
        if (WIDE) {
            for (; i + 3 * step < hi; i += 4 * step) {
                const uint4 w0 = *(const uint4*)(s + i);
                const uint4 w1 = *(const uint4*)(s + i + step);
                const uint4 w2 = *(const uint4*)(s + i + 2 * step);
                const uint4 w3 = *(const uint4*)(s + i + 3 * step);
                *(uint4*)(d + i) = w0;
                *(uint4*)(d + i + step) = w1;
                *(uint4*)(d + i + 2 * step) = w2;
                *(uint4*)(d + i + 3 * step) = w3;
            }
        }
        for (; i < hi; i += step) {
            *(uint4*)(d + i) = *(const uint4*)(s + i);
        }
    } else {
        for (unsigned long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
radixkv_copy_spans_h2d(const __grid_constant__ RadixkvBatch b) {
    for (unsigned long long x = blockIdx.x; x < b.n; x += gridDim.x) {
        radixkv_copy_part<1>(b.s[x]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
radixkv_copy_spans_d2h(const __grid_constant__ RadixkvBatch b) {
    for (unsigned long long x = blockIdx.x; x < b.n; x += gridDim.x) {
        radixkv_copy_part<0>(b.s[x]);
    }
}
"#;

/// [`KERNEL_SRC`] for a parameter block of `spans` spans.
pub(crate) fn kernel_source(spans: usize) -> String {
    format!("#define RADIXKV_SPANS {spans}\n{KERNEL_SRC}")
}

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
    fn auto_sends_few_spans_as_memcpys_short_ones_to_the_kernel_long_ones_batched() {
        let spans = |len: usize| -> Vec<Span> {
            (0..8)
                .map(|i| span(i << 30, i as usize * len, len))
                .collect()
        };
        let (short, middle, long) = (spans(4096), spans(256 << 10), spans(4 << 20));
        let max = DEFAULT_KERNEL_MAX_SPAN;
        let auto =
            |spans: &[Span], have, mapped| choose(CopyMethod::Auto, spans, have, mapped, max);
        assert_eq!(auto(&short[..3], BOTH, true), Route::Memcpy);
        assert_eq!(auto(&long[..3], BOTH, true), Route::Memcpy);
        assert_eq!(auto(&short, BOTH, true), Route::Kernel);
        assert_eq!(auto(&middle, BOTH, true), Route::Batched);
        assert_eq!(auto(&long, BOTH, true), Route::Batched);
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
        assert_eq!(auto(&long, neither, true), Route::Memcpy);
        // Without the batched call: the kernel up to AUTO_MEMCPY_MIN_SPAN, then memcpys.
        let no_batched = Have {
            batched: false,
            kernel: true,
        };
        assert_eq!(auto(&short, no_batched, true), Route::Kernel);
        assert_eq!(auto(&middle, no_batched, true), Route::Kernel);
        assert_eq!(auto(&long, no_batched, true), Route::Memcpy);
        // The threshold is the configured one.
        assert_eq!(
            choose(CopyMethod::Auto, &middle, BOTH, true, 512 << 10),
            Route::Kernel
        );
        assert_eq!(
            choose(CopyMethod::Auto, &short, BOTH, true, 1),
            Route::Batched
        );
    }

    #[test]
    fn forced_methods_are_kept_where_possible() {
        let spans = [span(0, 0, 16)];
        let c = |m, have, mapped| choose(m, &spans, have, mapped, DEFAULT_KERNEL_MAX_SPAN);
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

    fn launches_cover_every_span_once_in_order<const N: usize>(dir: Direction) {
        let spans: Vec<Span> = (0..(2 * N + 7))
            .map(|i| span(i as u64 * 100_000, i * 70_000, 1 + (i * 977) % 300_000))
            .collect();
        let (block_bytes, max_columns) = match dir {
            Direction::HostToDevice => (KERNEL_BLOCK_BYTES_H2D, N),
            Direction::DeviceToHost => (KERNEL_BLOCK_BYTES_D2H, KERNEL_D2H_BLOCKS),
        };
        let mut seen = Vec::new();
        let mut launches = 0;
        kernel_launches::<N, ()>(dir, 7 << 32, &spans, |i, l| {
            assert_eq!(i, launches);
            launches += 1;
            let n = l.batch.n as usize;
            assert!((1..=N).contains(&n));
            let longest = l.batch.spans[..n].iter().map(|s| s.len).max().unwrap();
            // Enough rows that no block copies more than its share, within the cap; the
            // columns stride over the spans (device → host: at most KERNEL_D2H_BLOCKS).
            assert!(l.rows == KERNEL_MAX_ROWS || longest <= u64::from(l.rows) * block_bytes as u64);
            assert!(l.rows >= 1 && l.rows <= KERNEL_MAX_ROWS);
            assert_eq!(l.columns as usize, n.min(max_columns));
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
            .map(|s| {
                let (dst, src) = ends(dir, 7 << 32, s);
                KernelSpan {
                    dst,
                    src,
                    len: s.len as u64,
                }
            })
            .collect();
        assert_eq!(seen, want);
        if dir == Direction::DeviceToHost {
            assert_eq!(want[1].dst, (7 << 32) + spans[1].host as u64);
            assert_eq!(want[1].src, spans[1].device);
        }
        // An error stops the launches.
        let mut calls = 0;
        let r = kernel_launches::<N, _>(dir, 0, &spans, |_, _| {
            calls += 1;
            Err("refused")
        });
        assert_eq!((r, calls), (Err("refused"), 1));
    }

    #[test]
    fn kernel_launches_cover_every_span_once_in_order() {
        for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
            launches_cover_every_span_once_in_order::<KERNEL_SPANS_SMALL>(dir);
            launches_cover_every_span_once_in_order::<KERNEL_SPANS_LARGE>(dir);
        }
    }

    #[test]
    fn the_kernel_parameters_fit_their_cuda_versions_and_match_the_source() {
        assert_eq!(std::mem::size_of::<KernelSpan>(), 24);
        let small = std::mem::size_of::<KernelBatch<KERNEL_SPANS_SMALL>>();
        assert_eq!(small, 8 + 24 * KERNEL_SPANS_SMALL);
        assert!(small <= 4096, "{small}");
        let large = std::mem::size_of::<KernelBatch<KERNEL_SPANS_LARGE>>();
        assert_eq!(large, 8 + 24 * KERNEL_SPANS_LARGE);
        assert!(large <= 32_764, "{large}");
        assert!(
            kernel_source(KERNEL_SPANS_LARGE)
                .starts_with(&format!("#define RADIXKV_SPANS {KERNEL_SPANS_LARGE}\n"))
        );
        assert!(KERNEL_SRC.contains("RadixkvSpan s[RADIXKV_SPANS]"));
        for name in KERNEL_NAMES {
            assert!(KERNEL_SRC.contains(&format!("{name}(")));
        }
        assert_eq!(kernel_name(Direction::HostToDevice), KERNEL_NAMES[0]);
        assert_eq!(kernel_name(Direction::DeviceToHost), KERNEL_NAMES[1]);
    }

    /// The kernel's part arithmetic, run on the CPU: every byte of every span is copied
    /// exactly once, for lengths around the alignment and the block size.
    #[test]
    fn the_kernel_parts_cover_each_span_exactly_once() {
        for (len, block_bytes) in [
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
        ]
        .into_iter()
        .flat_map(|len| [(len, KERNEL_BLOCK_BYTES_H2D), (len, KERNEL_BLOCK_BYTES_D2H)])
        {
            let rows = len.div_ceil(block_bytes).clamp(1, KERNEL_MAX_ROWS as usize) as u64;
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
