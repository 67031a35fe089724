//! Bring your own device: a backend the engine defines, handed to the manager through the
//! builder, carries the host tier's copies; backends that do not fit are typed errors.

mod common;

use common::admitted;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use radixkv_hicache::{
    DeviceBackend, Direction, HostMemory, HostSim, HostSimConfig, KvGeometry, PageCopy, PoolName,
    SimEvent, SlotCopy, StreamKind,
};
use radixkv_radix::PageId;
use radixkv_scheduler_api::config::{BackendKind, CudaCopyMethod};
use radixkv_scheduler_api::{
    BackendMismatch, CacheKind, HostTier, KvCacheManager, ManagerConfig, ManagerError,
    ModelGeometry, Request, SessionBudget, WritePolicy,
};

const LAYERS: u32 = 2;
const BYTES_PER_TOKEN_LAYER: u64 = 8;
const PAGE: usize = 4;
const DEVICE_TOKENS: usize = 64;

fn model() -> ModelGeometry {
    ModelGeometry {
        layers: LAYERS,
        kv_bytes_per_token_per_layer: BYTES_PER_TOKEN_LAYER,
        page_size: PAGE,
        ..Default::default()
    }
}

/// An engine's own backend: HostSim underneath, counting the page copies submitted to it.
struct Counting {
    sim: HostSim,
    loads: AtomicUsize,
    backups: AtomicUsize,
}

impl Counting {
    fn new(layers: usize, page_size: usize, bytes: usize, pages: usize) -> Arc<Self> {
        let g = KvGeometry::new(layers, page_size, bytes).unwrap();
        Arc::new(Counting {
            sim: HostSim::new(g, pages, HostSimConfig::default()).unwrap(),
            loads: AtomicUsize::new(0),
            backups: AtomicUsize::new(0),
        })
    }

    /// A backend whose pools hold [`model`]'s KV in a `DEVICE_TOKENS` device pool.
    fn fitting() -> Arc<Self> {
        Self::new(
            LAYERS as usize,
            PAGE,
            BYTES_PER_TOKEN_LAYER as usize,
            DEVICE_TOKENS / PAGE,
        )
    }
}

impl DeviceBackend for Counting {
    type Event = SimEvent;

    fn name(&self) -> &'static str {
        "counting"
    }
    fn geometry(&self) -> KvGeometry {
        self.sim.geometry()
    }
    fn device_pages(&self) -> usize {
        self.sim.device_pages()
    }
    fn register_host(&self, host: &Arc<HostMemory>) -> radixkv_hicache::Result<()> {
        self.sim.register_host(host)
    }
    fn enqueue_copy(&self, stream: StreamKind, copy: PageCopy) -> radixkv_hicache::Result<()> {
        let counter = match copy.direction {
            Direction::HostToDevice => &self.loads,
            Direction::DeviceToHost => &self.backups,
        };
        self.sim.enqueue_copy(stream, copy)?;
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn record_event(&self, stream: StreamKind) -> radixkv_hicache::Result<SimEvent> {
        self.sim.record_event(stream)
    }
    fn register_extra_pool(
        &self,
        pool: PoolName,
        slots: u32,
        item_bytes: usize,
    ) -> radixkv_hicache::Result<()> {
        self.sim.register_extra_pool(pool, slots, item_bytes)
    }
    fn enqueue_slot_copy(&self, stream: StreamKind, copy: SlotCopy) -> radixkv_hicache::Result<()> {
        self.sim.enqueue_slot_copy(stream, copy)
    }
    fn read_extra_slot(
        &self,
        pool: PoolName,
        slot: u32,
        out: &mut [u8],
    ) -> radixkv_hicache::Result<()> {
        self.sim.read_extra_slot(pool, slot, out)
    }
    fn write_extra_slot(
        &self,
        pool: PoolName,
        slot: u32,
        data: &[u8],
    ) -> radixkv_hicache::Result<()> {
        self.sim.write_extra_slot(pool, slot, data)
    }
    fn read_device_page(
        &self,
        layer: usize,
        page: PageId,
        out: &mut [u8],
    ) -> radixkv_hicache::Result<()> {
        self.sim.read_device_page(layer, page, out)
    }
    fn write_device_page(
        &self,
        layer: usize,
        page: PageId,
        data: &[u8],
    ) -> radixkv_hicache::Result<()> {
        self.sim.write_device_page(layer, page, data)
    }
}

/// The KV bytes of one page of one layer whose positions hold `tokens`: a function of each
/// token, its position and the layer, so a page loaded into the wrong place reads wrong.
fn page_kv(tokens: &[u32], first_pos: usize, layer: usize) -> Vec<u8> {
    let per = BYTES_PER_TOKEN_LAYER as usize;
    let mut out = Vec::with_capacity(tokens.len() * per);
    for (i, t) in tokens.iter().enumerate() {
        for b in 0..per {
            let v = t.wrapping_mul(31) as usize + (first_pos + i) * 7 + layer * 13 + b;
            out.push(v as u8);
        }
    }
    out
}

/// A write-through HiCache manager over `backend` whose 64-token device pool holds one
/// 41-token request.
fn manager_over(backend: Arc<Counting>) -> KvCacheManager {
    KvCacheManager::builder()
        .model(model())
        .device_tokens(DEVICE_TOKENS)
        .max_rows(4)
        .host_tier(HostTier::ratio(DEVICE_TOKENS, 4.0).write_policy(WritePolicy::WriteThrough))
        .device_backend(backend)
        .build()
        .unwrap()
}

/// Runs `tokens` as one prefill step, the forward writing each computed page's KV through
/// `backend`, and finishes it. Returns (host tokens hit, pages the step loaded, loaded bytes).
fn serve(kv: &mut KvCacheManager, backend: &Counting, tokens: &[u32]) -> (usize, u64, u64) {
    let id = kv
        .arrive(Request::new(tokens.to_vec()).max_new_tokens(1))
        .unwrap();
    let adm = admitted(kv, id);
    let cached = tokens.len() - adm.extend_tokens;
    kv.extend(id, adm.extend_tokens).unwrap();
    let step = kv.begin_step();
    let loads = (step.load_pages(), step.load_bytes());
    let pages = kv.pages(id).unwrap().to_vec();
    for layer in 0..LAYERS {
        step.wait_layer(layer).unwrap();
        // The forward of this layer: the cached prefix is read, the rest computed.
        for (i, &page) in pages.iter().enumerate().skip(cached / PAGE) {
            let span = &tokens[i * PAGE..((i + 1) * PAGE).min(tokens.len())];
            let mut kv_bytes = page_kv(span, i * PAGE, layer as usize);
            kv_bytes.resize(PAGE * BYTES_PER_TOKEN_LAYER as usize, 0);
            backend
                .write_device_page(layer as usize, page, &kv_bytes)
                .unwrap();
        }
    }
    kv.chunk_done(id).unwrap();
    kv.end_step(step).unwrap();
    // The prefix the request hit holds the KV computed for it, whichever tier it came from.
    let mut got = vec![0; PAGE * BYTES_PER_TOKEN_LAYER as usize];
    for layer in 0..LAYERS as usize {
        for (i, &page) in pages.iter().enumerate().take(cached / PAGE) {
            backend.read_device_page(layer, page, &mut got).unwrap();
            let want = page_kv(&tokens[i * PAGE..(i + 1) * PAGE], i * PAGE, layer);
            assert_eq!(got, want, "layer {layer}, page {i} of the prefix");
        }
    }
    kv.finish(id).unwrap();
    kv.drain().unwrap();
    kv.check_invariants().unwrap();
    (adm.host_tokens, loads.0, loads.1)
}

#[test]
fn a_host_hit_loads_back_through_the_engines_backend() {
    let backend = Counting::fitting();
    let mut kv = manager_over(backend.clone());
    let a: Vec<u32> = (0..41).collect();
    serve(&mut kv, &backend, &a);
    assert!(
        backend.backups.load(Ordering::Relaxed) > 0,
        "write-through backed the prompt up through the engine's backend"
    );
    assert_eq!(backend.loads.load(Ordering::Relaxed), 0);
    // Another 41 tokens do not fit beside the first: the first is demoted to the host.
    serve(&mut kv, &backend, &(1000..1041).collect::<Vec<_>>());
    assert_eq!(backend.loads.load(Ordering::Relaxed), 0);
    let (host_hit, pages, bytes) = serve(&mut kv, &backend, &a);
    assert_eq!(host_hit, 40);
    assert_eq!(pages, 10);
    // The backend's geometry is the model's: modeled bytes are the bytes it really moved.
    let page_bytes = backend.geometry().page_bytes() as u64;
    assert_eq!(page_bytes, model().page_bytes());
    assert_eq!(bytes, 10 * page_bytes);
    assert!(
        backend.loads.load(Ordering::Relaxed) > 0,
        "the load-back went through the engine's backend"
    );
    let m = kv.metrics();
    assert_eq!(m.counters.hit_tokens_host, 40);
    assert_eq!(m.counters.transfers.pages_loaded, 10);
}

#[test]
fn the_config_names_the_built_in_backend_as_before() {
    // The enum is `BackendKind` now (the trait is `DeviceBackend`); its TOML shape is unchanged.
    let parse = |t: &str| ManagerConfig::from_toml_str(t).unwrap().backend;
    assert_eq!(parse(""), BackendKind::HostSim);
    assert_eq!(
        parse("[backend]\ntype = \"host_sim\"\n"),
        BackendKind::HostSim
    );
    assert_eq!(
        parse("[backend]\ntype = \"cuda\"\ndevice = 1\n"),
        BackendKind::Cuda {
            device: 1,
            copy_method: CudaCopyMethod::Auto
        }
    );
    assert_eq!(
        parse("[backend]\ntype = \"cuda\"\ndevice = 0\ncopy_method = \"kernel\"\n"),
        BackendKind::Cuda {
            device: 0,
            copy_method: CudaCopyMethod::Kernel
        }
    );
    assert!(
        ManagerConfig::from_toml_str(
            "[backend]\ntype = \"cuda\"\ndevice = 0\ncopy_method = \"dma\"\n"
        )
        .is_err()
    );
    assert!(ManagerConfig::from_toml_str("[backend]\ntype = \"rocm\"\n").is_err());
}

#[test]
fn the_engines_backend_serves_sessions_and_takes_the_place_of_cuda() {
    // A config naming the CUDA backend: without the `cuda` feature refused on its own (a
    // typed error naming the feature, never HostSim instead), built over the engine's
    // backend, which takes its place.
    let cfg = ManagerConfig {
        model: model(),
        device_tokens: DEVICE_TOKENS,
        max_rows: 4,
        cache: CacheKind::HiCache(HostTier::ratio(DEVICE_TOKENS, 4.0)),
        sessions: Some(SessionBudget {
            max_held_tokens: DEVICE_TOKENS / 2,
            ..Default::default()
        }),
        backend: BackendKind::Cuda {
            device: 0,
            copy_method: Default::default(),
        },
        ..Default::default()
    };
    if !cfg!(feature = "cuda") {
        let e = KvCacheManager::new(cfg.clone()).unwrap_err();
        assert!(
            matches!(
                e,
                ManagerError::FeatureOff {
                    feature: "cuda",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("device_backend"), "{e}");
    }
    let backend = Counting::fitting();
    let mut kv = KvCacheManager::builder()
        .config(cfg)
        .device_backend(backend.clone())
        .build()
        .unwrap();
    kv.open_session(7, true, None).unwrap();
    assert_eq!(kv.open_sessions(), 1);
    kv.close_session(7).unwrap();
    assert_eq!(kv.open_sessions(), 0);
}

#[test]
fn a_backend_that_does_not_fit_is_a_typed_error() {
    let refused = |backend: Arc<Counting>, want: BackendMismatch| {
        let e = KvCacheManager::builder()
            .model(model())
            .device_tokens(DEVICE_TOKENS)
            .host_tier(HostTier::ratio(DEVICE_TOKENS, 4.0))
            .device_backend(backend)
            .build()
            .unwrap_err();
        assert_eq!(
            e,
            ManagerError::Backend {
                backend: "counting",
                mismatch: want
            }
        );
        assert!(e.to_string().contains("`counting`"), "{e}");
    };
    let (l, p, b, n) = (LAYERS as usize, PAGE, BYTES_PER_TOKEN_LAYER as usize, 16);
    refused(
        Counting::new(l + 1, p, b, n),
        BackendMismatch::Layers {
            backend: 3,
            model: LAYERS,
        },
    );
    refused(
        Counting::new(l, p, b * 2, n),
        BackendMismatch::BytesPerTokenPerLayer {
            backend: 16,
            model: BYTES_PER_TOKEN_LAYER,
        },
    );
    refused(
        Counting::new(l, p * 2, b, n),
        BackendMismatch::PageSize {
            backend: 8,
            model: PAGE,
        },
    );
    refused(
        Counting::new(l, p, b, n - 1),
        BackendMismatch::DevicePages {
            backend: 15,
            config: 16,
        },
    );
    // A cache without a host tier never copies KV: a backend handed to it would go unused. A
    // configuration set after the backend keeps it.
    for cache in [CacheKind::Radix, CacheKind::Disabled] {
        let cfg = ManagerConfig {
            model: model(),
            device_tokens: DEVICE_TOKENS,
            cache,
            ..Default::default()
        };
        let e = KvCacheManager::builder()
            .device_backend(Counting::fitting())
            .config(cfg)
            .build()
            .unwrap_err();
        assert_eq!(
            e,
            ManagerError::Backend {
                backend: "counting",
                mismatch: BackendMismatch::NoHostTier
            }
        );
    }
    // The same backend that fits builds, and the default (HostSim on the simulated geometry)
    // needs none of this.
    manager_over(Counting::fitting());
    KvCacheManager::builder()
        .model(model())
        .device_tokens(DEVICE_TOKENS)
        .host_tier(HostTier::ratio(DEVICE_TOKENS, 4.0))
        .build()
        .unwrap();
}
