//! Extra pools (Mamba state, SWA KV) move their bytes in the same merged operation as the KV.
//! Every test runs on every backend (`hostsim::*`, `cuda::*`).

mod common;

use std::sync::Arc;

use common::backends::{Factory, FailCopies, for_each_backend};
use radixkv_hicache::{
    DeviceBackend, ExtraPoolSpec, HiCacheError, HostLayout, HostPool, HybridCacheController,
    KvGeometry, PoolName, PoolTransfer, SlotOwner, StreamKind,
};
use radixkv_radix::{PageAllocator, PageId};

const MAMBA_ITEM: usize = 24;
const SWA_ITEM: usize = 40;

type Rig<B> = (Arc<B>, HybridCacheController<B>);

fn setup<F: Factory>(layout: HostLayout) -> Option<Rig<F::B>> {
    let g = KvGeometry::new(3, 4, 16).unwrap();
    let dev = F::make(g, 16)?;
    let pool = HostPool::new(g, 16, layout).unwrap();
    let extra = [
        ExtraPoolSpec {
            name: PoolName::Mamba,
            host_slots: 8,
            device_slots: 6,
            item_bytes: MAMBA_ITEM,
            device_owner: SlotOwner::Controller,
        },
        ExtraPoolSpec {
            name: PoolName::Swa,
            host_slots: 4,
            device_slots: 8,
            item_bytes: SWA_ITEM,
            device_owner: SlotOwner::Controller,
        },
    ];
    let ctrl = HybridCacheController::new(dev.clone(), pool, &extra).unwrap();
    Some((dev, ctrl))
}

fn item(pool: PoolName, slot: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (common::mix((pool as u64) << 32 | u64::from(slot) << 8 | i as u64) & 0xff) as u8)
        .collect()
}

fn transfer(name: PoolName, device: Vec<u32>, host: Vec<u32>) -> PoolTransfer {
    PoolTransfer {
        name,
        host_indices: host,
        device_indices: device,
    }
}

fn slot<B: DeviceBackend>(dev: &B, pool: PoolName, s: u32, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    dev.read_extra_slot(pool, s, &mut out).unwrap();
    out
}

for_each_backend! {
    extra_pools_round_trip_byte_exactly_with_the_kv => extra_pools_round_trip_byte_exactly_with_the_kv(),
    one_pool_short_rolls_back_every_pool_and_moves_nothing => one_pool_short_rolls_back_every_pool_and_moves_nothing(),
    a_failed_extra_pool_copy_fails_the_whole_operation => a_failed_extra_pool_copy_fails_the_whole_operation(),
}

fn extra_pools_round_trip_byte_exactly_with_the_kv<F: Factory>() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let Some((dev, mut ctrl)) = setup::<F>(layout) else {
            return;
        };
        let g = dev.geometry();
        let kv: Vec<PageId> = [3, 4, 9].map(PageId).to_vec();
        for (i, &p) in kv.iter().enumerate() {
            for l in 0..g.layers {
                let b = item(PoolName::Kv, (i * 10 + l) as u32, g.page_bytes_per_layer());
                dev.write_device_page(l, p, &b).unwrap();
            }
        }
        let (mamba_dev, swa_dev) = (vec![1, 2, 5], vec![7]);
        for &s in &mamba_dev {
            let data = item(PoolName::Mamba, s, MAMBA_ITEM);
            dev.write_extra_slot(PoolName::Mamba, s, &data).unwrap();
        }
        dev.write_extra_slot(PoolName::Swa, 7, &item(PoolName::Swa, 7, SWA_ITEM))
            .unwrap();
        // Two operations, each with its own extra pools, merge into one transfer.
        let op1 = ctrl
            .write(
                &kv[..2],
                0,
                vec![transfer(PoolName::Mamba, mamba_dev[..2].to_vec(), vec![])],
            )
            .unwrap()
            .clone();
        let op2 = ctrl
            .write(
                &kv[2..],
                0,
                vec![
                    transfer(PoolName::Mamba, mamba_dev[2..].to_vec(), vec![]),
                    transfer(PoolName::Swa, swa_dev.clone(), vec![]),
                ],
            )
            .unwrap()
            .clone();
        let stats = ctrl.start_writing().unwrap().unwrap();
        assert_eq!(stats.ops, 2);
        assert_eq!(stats.bytes, 3 * g.page_bytes() + 3 * MAMBA_ITEM + SWA_ITEM);
        ctrl.wait_all().unwrap();
        let acks = ctrl.poll_acks();
        assert_eq!(acks.writes, vec![op1.id, op2.id]);
        // The host-side buffers hold the device bytes.
        let mamba_host: Vec<u32> = op1.extra[0]
            .host_indices
            .iter()
            .chain(&op2.extra[0].host_indices)
            .copied()
            .collect();
        let host_mem = ctrl.extra_memory(PoolName::Mamba).unwrap().clone();
        for (&d, &h) in mamba_dev.iter().zip(&mamba_host) {
            let mut b = vec![0u8; MAMBA_ITEM];
            host_mem.read_slot(h, &mut b).unwrap();
            assert_eq!(b, item(PoolName::Mamba, d, MAMBA_ITEM));
        }
        // Load everything back into fresh device slots and pages.
        let mut device = PageAllocator::new(16).unwrap();
        device.alloc(10).unwrap();
        let host_kv: Vec<u32> = op1
            .host_pages
            .iter()
            .chain(&op2.host_pages)
            .copied()
            .collect();
        let swa_host = op2.extra[1].host_indices.clone();
        let load = ctrl
            .load(
                &host_kv,
                &mut device,
                vec![
                    transfer(PoolName::Mamba, vec![], mamba_host.clone()),
                    transfer(PoolName::Swa, vec![], swa_host),
                ],
            )
            .unwrap()
            .clone();
        ctrl.start_loading().unwrap().unwrap();
        ctrl.wait_all().unwrap();
        assert_eq!(ctrl.poll_acks().loads, vec![load.id]);
        for (&d_old, &d_new) in mamba_dev.iter().zip(&load.extra[0].device_indices) {
            assert_ne!(d_old, d_new, "a fresh slot, so the check is meaningful");
            assert_eq!(
                slot(&*dev, PoolName::Mamba, d_new, MAMBA_ITEM),
                item(PoolName::Mamba, d_old, MAMBA_ITEM),
                "{layout:?}"
            );
        }
        let swa_new = load.extra[1].device_indices[0];
        assert_eq!(
            slot(&*dev, PoolName::Swa, swa_new, SWA_ITEM),
            item(PoolName::Swa, 7, SWA_ITEM)
        );
        let mut buf = vec![0u8; g.page_bytes_per_layer()];
        for (i, &p) in load.device_pages.iter().enumerate() {
            for l in 0..g.layers {
                dev.read_device_page(l, p, &mut buf).unwrap();
                let want = item(PoolName::Kv, (i * 10 + l) as u32, g.page_bytes_per_layer());
                assert_eq!(buf, want);
            }
        }
    }
}

fn one_pool_short_rolls_back_every_pool_and_moves_nothing<F: Factory>() {
    let Some((dev, mut ctrl)) = setup::<F>(HostLayout::PageFirst) else {
        return;
    };
    let host_free = ctrl.host().available();
    dev.write_extra_slot(PoolName::Mamba, 0, &item(PoolName::Mamba, 0, MAMBA_ITEM))
        .unwrap();
    // SWA has 4 host slots: asking for 5 fails after KV and Mamba allocated.
    let e = ctrl
        .write(
            &[PageId(0), PageId(1)],
            0,
            vec![
                transfer(PoolName::Mamba, vec![0], vec![]),
                transfer(PoolName::Swa, vec![0, 1, 2, 3, 4], vec![]),
            ],
        )
        .unwrap_err();
    assert!(matches!(
        e,
        HiCacheError::ExtraPoolFull {
            pool: PoolName::Swa,
            ..
        }
    ));
    assert_eq!(ctrl.host().available(), host_free);
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (8, 6));
    assert_eq!(ctrl.extra_available(PoolName::Swa).unwrap(), (4, 8));
    assert_eq!(ctrl.queued(), (0, 0));
    assert_eq!(ctrl.start_writing().unwrap(), None, "nothing to move");
    // Load side: the KV device pages are allocated first, then a Mamba shortage (6 device
    // slots, 7 asked) rolls them back.
    let ok = ctrl
        .write(
            &[PageId(0)],
            0,
            vec![transfer(PoolName::Mamba, vec![0], vec![])],
        )
        .unwrap()
        .clone();
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();
    ctrl.poll_acks();
    let mut device = PageAllocator::new(16).unwrap();
    let many: Vec<u32> = std::iter::repeat_n(ok.extra[0].host_indices[0], 7).collect();
    let e = ctrl
        .load(
            &ok.host_pages,
            &mut device,
            vec![transfer(PoolName::Mamba, vec![], many)],
        )
        .unwrap_err();
    assert!(matches!(
        e,
        HiCacheError::ExtraPoolFull {
            pool: PoolName::Mamba,
            ..
        }
    ));
    assert_eq!(device.available(), 16, "KV device pages rolled back");
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (7, 6));
}

fn a_failed_extra_pool_copy_fails_the_whole_operation<F: Factory>() {
    let Some((dev, mut ctrl)) = setup::<F>(HostLayout::LayerFirst) else {
        return;
    };
    // Without a fault the operation is acknowledged as written.
    let op = ctrl
        .write(
            &[PageId(2)],
            0,
            vec![transfer(PoolName::Mamba, vec![3], vec![])],
        )
        .unwrap()
        .clone();
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().writes, vec![op.id]);
    let op = ctrl
        .write(
            &[PageId(3)],
            0,
            vec![transfer(PoolName::Mamba, vec![4], vec![])],
        )
        .unwrap()
        .clone();
    // One copy of the merged operation fails: the whole operation (KV and Mamba) is failed.
    dev.fail_next_copies(StreamKind::Write, 1);
    ctrl.start_writing().unwrap();
    assert!(ctrl.wait_all().is_err());
    let acks = ctrl.poll_acks();
    assert!(acks.writes.is_empty());
    assert_eq!(acks.failed_writes, vec![op.id]);
}
