//! The copy planner of [`CudaBackend`](super::CudaBackend): turns a [`PageCopy`] or a
//! [`SlotCopy`] into the list of contiguous spans the driver copies, one asynchronous memcpy
//! each. Pure arithmetic, no driver call, so it is tested on machines without a GPU.
//!
//! Adjacent spans merge whenever they are contiguous on both sides, so a run of pages of one
//! layer is one memcpy when the host layout keeps those pages adjacent (layer-first) and the
//! device region packs its pages without gaps; a page-first host layout gives one span per
//! page and layer (and per region of the page).

use crate::backend::{PageCopy, PageRun};
use crate::geometry::KvGeometry;

/// Where one part of a device page lives: the page `p` of a layer has its bytes
/// `[offset, offset + bytes)` at device address `base + p × page_stride`, where `offset` is the
/// sum of the `bytes` of the regions listed before this one for the layer.
///
/// A pool allocated by the backend has one region per layer with `page_stride == bytes ==
/// page_bytes_per_layer`. An engine whose layer keeps K and V in two buffers describes the
/// layer as two regions (K then V); the host copy of a page holds the regions' bytes
/// back to back, in the order given.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    /// Device address of page 0 of this region.
    pub base: u64,
    /// Bytes from one page to the next (≥ `bytes`).
    pub page_stride: u64,
    /// Bytes of one page in this region.
    pub bytes: usize,
}

/// One contiguous span of a copy: `len` bytes at device address `device` and at byte
/// `host` of the host buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) device: u64,
    pub(crate) host: usize,
    pub(crate) len: usize,
}

/// Appends `span` to `out`, merging it into the last span when both sides continue it.
#[inline]
fn push(out: &mut Vec<Span>, span: Span) {
    if let Some(last) = out.last_mut()
        && last.device + last.len as u64 == span.device
        && last.host + last.len == span.host
    {
        last.len += span.len;
        return;
    }
    out.push(span);
}

/// The spans of `copy` (already validated against the geometry and pool sizes), in
/// submission order: layer by layer, run by run, page by page, region by region.
pub(crate) fn page_copy_spans(
    g: &KvGeometry,
    regions: &[Vec<DeviceRegion>],
    copy: &PageCopy,
    out: &mut Vec<Span>,
) {
    out.clear();
    for layer in copy.layers.clone() {
        push_layer_spans(g, regions, copy, layer, out);
    }
}

/// The spans of `copy` in one of its layers (see [`page_copy_spans`]).
pub(crate) fn page_copy_layer_spans(
    g: &KvGeometry,
    regions: &[Vec<DeviceRegion>],
    copy: &PageCopy,
    layer: usize,
    out: &mut Vec<Span>,
) {
    out.clear();
    push_layer_spans(g, regions, copy, layer, out);
}

fn push_layer_spans(
    g: &KvGeometry,
    regions: &[Vec<DeviceRegion>],
    copy: &PageCopy,
    layer: usize,
    out: &mut Vec<Span>,
) {
    let layout = copy.host.layout();
    let host_pages = copy.host.pages();
    for r in copy.runs.iter() {
        for i in 0..r.pages as usize {
            let dev_page = r.device as u64 + i as u64;
            let mut host = layout.offset(g, host_pages, layer, r.host as usize + i);
            for reg in &regions[layer] {
                push(
                    out,
                    Span {
                        device: reg.base + dev_page * reg.page_stride,
                        host,
                        len: reg.bytes,
                    },
                );
                host += reg.bytes;
            }
        }
    }
}

/// The spans of an extra-pool copy over a device buffer at `base` whose slot `s` starts at
/// `base + s × slot_stride`; the host side is packed (`item_bytes` per slot).
pub(crate) fn slot_copy_spans(
    base: u64,
    slot_stride: u64,
    item_bytes: usize,
    runs: &[PageRun],
    out: &mut Vec<Span>,
) {
    out.clear();
    for r in runs {
        for i in 0..r.pages as u64 {
            push(
                out,
                Span {
                    device: base + (r.device as u64 + i) * slot_stride,
                    host: (r.host as usize + i as usize) * item_bytes,
                    len: item_bytes,
                },
            );
        }
    }
}

/// Executes `spans` on plain memory, standing in for the driver's memcpys: the device
/// address space is `device` (address = index). Used by the tests to check that a plan moves
/// exactly HostSim's bytes.
#[cfg(test)]
pub(crate) fn execute_on_memory(
    spans: &[Span],
    direction: crate::backend::Direction,
    device: &mut [u8],
    host: &mut [u8],
) {
    for s in spans {
        let d = s.device as usize;
        match direction {
            crate::backend::Direction::HostToDevice => {
                device[d..d + s.len].copy_from_slice(&host[s.host..s.host + s.len]);
            }
            crate::backend::Direction::DeviceToHost => {
                host[s.host..s.host + s.len].copy_from_slice(&device[d..d + s.len]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::{Direction, HostMemory};
    use crate::geometry::HostLayout;

    fn packed(g: &KvGeometry, pages: usize) -> Vec<Vec<DeviceRegion>> {
        let pbl = g.page_bytes_per_layer() as u64;
        (0..g.layers)
            .map(|l| {
                vec![DeviceRegion {
                    base: l as u64 * pages as u64 * pbl,
                    page_stride: pbl,
                    bytes: pbl as usize,
                }]
            })
            .collect()
    }

    #[test]
    fn layer_first_runs_are_one_span_per_run_and_layer() {
        let g = KvGeometry::new(3, 4, 8).unwrap();
        let host = Arc::new(HostMemory::new(g, 16, HostLayout::LayerFirst).unwrap());
        let runs = [
            PageRun {
                device: 2,
                host: 5,
                pages: 4,
            },
            PageRun {
                device: 9,
                host: 0,
                pages: 1,
            },
        ];
        let mut out = Vec::new();
        let c = PageCopy::new(&host, Direction::HostToDevice, 0..3, &runs);
        page_copy_spans(&g, &packed(&g, 16), &c, &mut out);
        assert_eq!(out.len(), 6, "{out:?}");
        assert_eq!(
            out[0],
            Span {
                device: 2 * 32,
                host: 5 * 32,
                len: 4 * 32
            }
        );
        // Page-first: one span per page and layer (the pages of a layer are strided).
        let host = Arc::new(HostMemory::new(g, 16, HostLayout::PageFirst).unwrap());
        let c = PageCopy::new(&host, Direction::HostToDevice, 0..3, &runs);
        page_copy_spans(&g, &packed(&g, 16), &c, &mut out);
        assert_eq!(out.len(), 15);
        // Runs that continue each other on both sides merge into one span.
        let host = Arc::new(HostMemory::new(g, 16, HostLayout::LayerFirst).unwrap());
        let joined = [
            PageRun {
                device: 0,
                host: 0,
                pages: 2,
            },
            PageRun {
                device: 2,
                host: 2,
                pages: 3,
            },
        ];
        let c = PageCopy::new(&host, Direction::DeviceToHost, 1..2, &joined);
        page_copy_spans(&g, &packed(&g, 16), &c, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len, 5 * 32);
    }

    #[test]
    fn extra_pool_runs_merge_only_when_packed() {
        let runs = [PageRun {
            device: 3,
            host: 1,
            pages: 4,
        }];
        let mut out = Vec::new();
        slot_copy_spans(1000, 24, 24, &runs, &mut out);
        assert_eq!(
            out,
            vec![Span {
                device: 1000 + 72,
                host: 24,
                len: 96
            }]
        );
        slot_copy_spans(1000, 32, 24, &runs, &mut out);
        assert_eq!(out.len(), 4);
        assert_eq!(out[3].device, 1000 + 6 * 32);
    }

    /// Every plan, executed on plain memory, moves exactly the bytes HostSim's reference
    /// copy moves: both layouts, page sizes 1 and 16, packed and split (K/V, strided) device
    /// regions, both directions.
    #[test]
    fn plans_move_the_same_bytes_as_the_reference_layout() {
        let runs = [
            PageRun {
                device: 6,
                host: 1,
                pages: 3,
            },
            PageRun {
                device: 0,
                host: 7,
                pages: 1,
            },
            PageRun {
                device: 9,
                host: 4,
                pages: 2,
            },
        ];
        let pages = 12usize;
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            for page_size in [1usize, 16] {
                let g = KvGeometry::new(3, page_size, 6).unwrap();
                let pbl = g.page_bytes_per_layer();
                // K and V halves in two buffers per layer with a gap after each page.
                let stride = pbl as u64; // half a page plus a gap of half a page
                let split: Vec<Vec<DeviceRegion>> = (0..g.layers)
                    .map(|l| {
                        let k = (2 * l * pages * pbl) as u64;
                        let v = k + (pages * pbl) as u64;
                        vec![
                            DeviceRegion {
                                base: k,
                                page_stride: stride,
                                bytes: pbl / 2,
                            },
                            DeviceRegion {
                                base: v,
                                page_stride: stride,
                                bytes: pbl - pbl / 2,
                            },
                        ]
                    })
                    .collect();
                for (name, regions, dev_len) in [
                    ("packed", packed(&g, pages), g.layers * pages * pbl),
                    ("split", split, 2 * g.layers * pages * pbl),
                ] {
                    let host = Arc::new(HostMemory::new(g, 10, layout).unwrap());
                    let host_len = host.len_bytes();
                    // Device → host: fill the device, copy, compare with the reference.
                    let device: Vec<u8> = (0..dev_len).map(|i| (i * 7 + 3) as u8).collect();
                    let mut dev = device.clone();
                    let mut h = vec![0u8; host_len];
                    let mut spans = Vec::new();
                    let c = PageCopy::new(&host, Direction::DeviceToHost, 0..3, &runs);
                    page_copy_spans(&g, &regions, &c, &mut spans);
                    execute_on_memory(&spans, Direction::DeviceToHost, &mut dev, &mut h);
                    // Planned layer by layer (as the backend submits), the same bytes move.
                    let mut by_layer = vec![0u8; host_len];
                    let mut layer_spans = Vec::new();
                    for l in 0..3 {
                        page_copy_layer_spans(&g, &regions, &c, l, &mut layer_spans);
                        execute_on_memory(
                            &layer_spans,
                            Direction::DeviceToHost,
                            &mut dev,
                            &mut by_layer,
                        );
                    }
                    assert_eq!(
                        by_layer, h,
                        "{name} {layout:?} p{page_size}: per-layer plan"
                    );
                    let page_of = |dev: &[u8], layer: usize, page: usize| -> Vec<u8> {
                        let mut v = Vec::new();
                        for r in &regions[layer] {
                            let a = (r.base + page as u64 * r.page_stride) as usize;
                            v.extend_from_slice(&dev[a..a + r.bytes]);
                        }
                        v
                    };
                    let mut moved = 0;
                    for l in 0..3 {
                        for r in &runs {
                            for i in 0..r.pages as usize {
                                let o = layout.offset(&g, 10, l, r.host as usize + i);
                                assert_eq!(
                                    h[o..o + pbl],
                                    page_of(&device, l, r.device as usize + i)[..],
                                    "{name} {layout:?} p{page_size} layer {l}"
                                );
                                moved += pbl;
                            }
                        }
                    }
                    assert_eq!(spans.iter().map(|s| s.len).sum::<usize>(), moved);
                    // Host → device into other pages: the device pages equal the host pages.
                    let back = [PageRun {
                        device: 2,
                        host: 1,
                        pages: 3,
                    }];
                    let c = PageCopy::new(&host, Direction::HostToDevice, 1..3, &back);
                    let mut dev2 = vec![0u8; dev_len];
                    page_copy_spans(&g, &regions, &c, &mut spans);
                    execute_on_memory(&spans, Direction::HostToDevice, &mut dev2, &mut h);
                    for l in 0..3 {
                        for i in 0..3 {
                            let got = page_of(&dev2, l, 2 + i);
                            if l == 0 {
                                assert!(got.iter().all(|&b| b == 0), "layer 0 not copied");
                            } else {
                                assert_eq!(got, page_of(&device, l, 6 + i), "{name} {layout:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}
