//! Request drivers for the interleaving scenarios: every page of KV holds bytes derived from
//! the tokens up to its end (as a model's KV would), so a page that holds anything else —
//! another prefix's KV, a half-finished copy — is caught when a request reuses it.

use radixkv_hicache::{DeviceBackend, HiRadixCache, LoadStep};
use radixkv_radix::events::{chain_hashes, namespace_seed};
use radixkv_radix::{CacheError, FinishKind, PageId, PrefixCache, RadixKey, RequestKv, SessionTag};
use radixkv_session::{ManualClock, SessionAwareCache};

/// The bytes of one page in one layer: a function of the chain hash of the tokens up to the
/// page's end.
pub fn page_kv(hash: u64, layer: usize, len: usize) -> Vec<u8> {
    let seed = hash ^ (layer as u64 + 1).wrapping_mul(0xa076_1d64_78bd_642f);
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i / 64) as u8)
        .collect()
}

/// A tiered cache, possibly under a session layer: the requests go to `self`, the transfers
/// to its HiRadixCache.
pub trait Tiered: PrefixCache {
    /// The backend type.
    type B: DeviceBackend;
    /// The tiered cache underneath.
    fn hi(&mut self) -> &mut HiRadixCache<Self::B>;
}

impl<B: DeviceBackend> Tiered for HiRadixCache<B> {
    type B = B;
    fn hi(&mut self) -> &mut HiRadixCache<B> {
        self
    }
}

impl<B: DeviceBackend> Tiered for SessionAwareCache<HiRadixCache<B>, ManualClock> {
    type B = B;
    fn hi(&mut self) -> &mut HiRadixCache<B> {
        self.inner_mut()
    }
}

fn hashes(tokens: &[u32], page_size: usize) -> Vec<u64> {
    let whole = tokens.len() - tokens.len() % page_size;
    let mut h = Vec::new();
    chain_hashes(
        namespace_seed(&Default::default()),
        &tokens[..whole],
        page_size,
        &mut h,
    );
    h
}

/// Checks that `pages` hold the KV of the first pages of `tokens`.
///
/// # Errors
/// A description of the first page that holds other bytes.
pub fn check_kv<B: DeviceBackend>(b: &B, tokens: &[u32], pages: &[PageId]) -> Result<(), String> {
    let g = b.geometry();
    let h = hashes(tokens, g.page_size);
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    for (i, (&p, &x)) in pages.iter().zip(&h).enumerate() {
        for l in 0..g.layers {
            b.read_device_page(l, p, &mut buf)
                .map_err(|e| e.to_string())?;
            if buf != page_kv(x, l, buf.len()) {
                return Err(format!("wrong KV served: page {i} ({p:?}) layer {l}"));
            }
        }
    }
    Ok(())
}

/// Writes the KV of pages `from..` of `tokens` (whole pages only) into `pages`.
pub fn write_kv<B: DeviceBackend>(b: &B, tokens: &[u32], pages: &[PageId], from: usize) {
    let g = b.geometry();
    let h = hashes(tokens, g.page_size);
    for (&p, &x) in pages.iter().zip(&h).skip(from) {
        for l in 0..g.layers {
            // The pages come from the cache's own row: in range by construction.
            let _ = b.write_device_page(l, p, &page_kv(x, l, g.page_bytes_per_layer()));
        }
    }
}

/// How a request ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// Finished; this many prompt tokens were reused (device or host).
    Finished {
        /// Prompt tokens whose KV came from the cache.
        reused: usize,
    },
    /// Its loads failed (the batch must not run) or the device was full: aborted.
    Aborted,
}

/// A request that has begun: its KV state and tokens.
pub struct Begun {
    /// The request.
    pub req: RequestKv,
    /// Its prompt.
    pub tokens: Vec<u32>,
}

/// Matches and begins a request (queueing its load-back) and starts the queued loads without
/// waiting for them.
///
/// # Errors
/// A cache error.
pub fn begin<C: Tiered>(c: &mut C, tokens: &[u32], session: Option<u64>) -> Result<Begun, String> {
    let mut req = RequestKv::new(RadixKey::new(tokens.to_vec()));
    req.session = session.map(|id| SessionTag {
        id,
        streaming: true,
    });
    c.match_request(&mut req)
        .map_err(|e| format!("match: {e}"))?;
    c.begin_request(&mut req)
        .map_err(|e| format!("begin: {e}"))?;
    Ok(Begun {
        req,
        tokens: tokens.to_vec(),
    })
}

/// Starts the batch's loads (see [`HiRadixCache::start_loading`]): `Err(())` when they could
/// not be started (the batch must not run), else the step to wait for, if any.
#[allow(clippy::result_unit_err)]
pub fn start<C: Tiered>(c: &mut C) -> Result<Option<LoadStep>, ()> {
    c.hi().start_loading().map_err(|_| ())
}

/// The forward's wait for every layer of `step`. Returns false when a layer failed: the batch
/// must not read its KV.
pub fn wait_layers<C: Tiered>(c: &mut C, step: Result<Option<LoadStep>, ()>) -> bool {
    let Ok(step) = step else { return false };
    let Some(step) = step else { return true };
    let counter = c.hi().layer_counter().clone();
    counter.set_consumer(step.producer);
    // A forward stops at the first layer that failed.
    (0..counter.layers()).all(|l| counter.wait_until(l).is_ok())
}

/// Starts the batch's loads and waits for every layer (see [`wait_layers`]).
pub fn load_all<C: Tiered>(c: &mut C) -> bool {
    let step = start(c);
    wait_layers(c, step)
}

/// Runs the forward of a begun request: checks the reused KV, computes and writes the rest,
/// finishes. A request whose loads failed is aborted instead.
///
/// # Errors
/// Wrong KV in the reused prefix, or a cache error.
pub fn finish<C: Tiered>(c: &mut C, mut b: Begun, loads_ok: bool) -> Result<Served, String> {
    if !loads_ok {
        c.cache_finished_req(&mut b.req, FinishKind::Aborted)
            .map_err(|e| format!("abort: {e}"))?;
        return Ok(Served::Aborted);
    }
    let reused = b.req.committed_len.max(b.req.prefix_len);
    let p = c.page_size();
    {
        let pages: Vec<PageId> = match b.req.row {
            Some(row) => c
                .pools()
                .rows
                .pages(row)
                .map_err(|e| e.to_string())?
                .to_vec(),
            None => b.req.prefix_pages.clone(),
        };
        let backend = c.hi().backend().clone();
        check_kv(&*backend, &b.tokens, &pages[..reused / p])?;
    }
    let rest = b.tokens.len() - reused;
    match c.alloc_tokens(&mut b.req, rest) {
        Ok(()) => {}
        Err(CacheError::OutOfPages { .. }) => {
            c.cache_finished_req(&mut b.req, FinishKind::Aborted)
                .map_err(|e| format!("abort: {e}"))?;
            return Ok(Served::Aborted);
        }
        Err(e) => return Err(format!("alloc: {e}")),
    }
    let row = b.req.row.ok_or("a running request without a row")?;
    let pages = c
        .pools()
        .rows
        .pages(row)
        .map_err(|e| e.to_string())?
        .to_vec();
    let backend = c.hi().backend().clone();
    write_kv(&*backend, &b.tokens, &pages, reused / p);
    b.req.commit(rest).map_err(|e| e.to_string())?;
    c.cache_finished_req(&mut b.req, FinishKind::Finished)
        .map_err(|e| format!("finish: {e}"))?;
    Ok(Served::Finished { reused })
}

/// One whole request: begin, load, check, compute, finish.
///
/// # Errors
/// As [`begin`] and [`finish`].
pub fn serve<C: Tiered>(c: &mut C, tokens: &[u32], session: Option<u64>) -> Result<Served, String> {
    let b = begin(c, tokens, session)?;
    let ok = load_all(c);
    finish(c, b, ok)
}

/// Steps until the cache reports no unrepaired failure (at most a few times), flushes, and
/// checks that nothing leaked: invariants, no transfer lock, nothing pending, no request row,
/// every device page free or in the tree.
///
/// # Errors
/// The first leak or violated invariant.
pub fn settle_and_audit<C: Tiered>(c: &mut C) -> Result<(), String> {
    let mut stepped = c.hi().step();
    for _ in 0..4 {
        if stepped.is_ok() {
            break;
        }
        stepped = c.hi().step();
    }
    stepped.map_err(|e| format!("step: {e}"))?;
    c.hi().flush().map_err(|e| format!("flush: {e}"))?;
    c.check_invariants().map_err(|e| e.to_string())?;
    let hi = c.hi();
    if hi.protected_tokens() != 0 || hi.unacked_backup_pages() != 0 {
        return Err(format!(
            "leak: {} protected tokens, {} unacknowledged backup pages",
            hi.protected_tokens(),
            hi.unacked_backup_pages()
        ));
    }
    if hi.controller().pending() != (0, 0) {
        return Err(format!("leak: pending {:?}", hi.controller().pending()));
    }
    let pools = c.pools();
    if pools.rows.live() != 0
        || pools.pages.available() + pools.pages.tree_pages() != pools.pages.total()
    {
        return Err(format!("leak: {:?}", c.accounting()));
    }
    Ok(())
}
