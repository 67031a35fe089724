//! A deterministic-interleaving explorer for caches over [`HostSim`].
//!
//! A scenario runs on its own thread (the scheduler) as a fixed sequence of operations
//! separated by *gaps*. Every copy is held by HostSim's gate, so a copy runs only when the
//! explorer (the "device") lets it. At each gap the explorer chooses, one copy at a time, which
//! held copies complete now — or kills a stream's worker at its held copy — and when the
//! scheduler blocks on an event whose copy is held, the explorer releases it (there is no
//! choice then: the scheduler waits for it). Choices are enumerated depth first, re-running
//! the scenario from scratch for every prefix, so every order in which the copies can
//! complete relative to the scheduler's operations is run exactly once.
//!
//! The explorer makes every interleaving deterministic: before each choice both streams are
//! settled ([`HostSim::wait_settled`]), and the scheduler only ever runs while the explorer
//! waits for its next message. A hang (the scheduler waits for an event nothing will
//! complete) is reported as a failure, not waited out: either an event of a settled stream
//! that holds no copy stays incomplete, or nothing arrives within the watchdog's limit.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use radixkv_hicache::{
    CopyEvent, DeviceBackend, HostMemory, HostSim, HostSimConfig, KvGeometry, PageCopy, PoolName,
    SimEvent, SlotCopy, StreamKind,
};
use radixkv_radix::PageId;

/// What the scheduler thread tells the explorer.
enum Msg {
    /// At a gap, waiting for the explorer's go.
    Gap,
    /// Blocked on an incomplete event of `stream`; `done` says when it completed.
    Blocked {
        stream: StreamKind,
        done: Box<dyn Fn() -> bool + Send>,
    },
    /// The scenario ended with this verdict.
    Done(Result<(), String>),
}

#[derive(Default)]
struct Link(Mutex<Option<Sender<Msg>>>);

impl Link {
    fn send(&self, m: Msg) {
        if let Some(tx) = &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.send(m);
        }
    }
}

/// How the probe's events behave.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Events {
    /// As the backend reports them.
    Honest,
    /// Broken on purpose: every event claims completion at once, before its copies ran (a
    /// backend that acknowledges at submission).
    Eager,
}

/// A [`DeviceBackend`] over a gated [`HostSim`] that tells the explorer when the scheduler
/// blocks on an event.
pub struct Probe {
    sim: HostSim,
    link: Arc<Link>,
    events: Events,
}

impl Probe {
    /// The simulated device (gate, fault injection, device pages).
    pub fn sim(&self) -> &HostSim {
        &self.sim
    }
}

/// An event of a [`Probe`].
#[derive(Clone)]
pub struct ProbeEvent {
    inner: SimEvent,
    stream: StreamKind,
    link: Arc<Link>,
    eager: bool,
}

impl CopyEvent for ProbeEvent {
    fn is_complete(&self) -> bool {
        self.eager || self.inner.is_complete()
    }

    fn wait(&self) -> radixkv_hicache::Result<()> {
        if self.eager {
            return Ok(());
        }
        if !self.inner.is_complete() {
            let e = self.inner.clone();
            self.link.send(Msg::Blocked {
                stream: self.stream,
                done: Box::new(move || e.is_complete()),
            });
        }
        self.inner.wait()
    }
}

impl DeviceBackend for Probe {
    type Event = ProbeEvent;

    fn name(&self) -> &'static str {
        "probe"
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
        self.sim.enqueue_copy(stream, copy)
    }
    fn record_event(&self, stream: StreamKind) -> radixkv_hicache::Result<ProbeEvent> {
        Ok(ProbeEvent {
            inner: self.sim.record_event(stream)?,
            stream,
            link: self.link.clone(),
            eager: self.events == Events::Eager,
        })
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

/// The scenario's side of the gaps.
pub struct Gaps {
    link: Arc<Link>,
    go: Receiver<()>,
}

impl Gaps {
    /// Hands control to the explorer, which may complete (or kill) held copies now.
    pub fn gap(&mut self) {
        self.link.send(Msg::Gap);
        // A closed channel means the explorer gave up on this run: go on to the end.
        let _ = self.go.recv();
    }
}

/// What to explore.
#[derive(Clone, Debug)]
pub struct Explore {
    /// The device pool's geometry.
    pub geometry: KvGeometry,
    /// Pages in the device pool.
    pub device_pages: usize,
    /// Honest or broken events.
    pub events: Events,
    /// Also choose, at a gap, to kill a stream's worker at its held copy (once per stream).
    pub kills: bool,
    /// HostSim's test hook: dead workers leave their events pending.
    pub unguarded_worker_exit: bool,
    /// Stop after this many runs (the report says whether the enumeration was complete).
    pub max_runs: usize,
    /// Hang detector: a run fails when the scheduler sends nothing for this long.
    pub watchdog: Duration,
}

impl Explore {
    /// Honest events, no kills, a 10 s watchdog.
    pub fn new(geometry: KvGeometry, device_pages: usize) -> Self {
        Explore {
            geometry,
            device_pages,
            events: Events::Honest,
            kills: false,
            unguarded_worker_exit: false,
            max_runs: 20_000,
            watchdog: Duration::from_secs(10),
        }
    }
}

/// The outcome of an exploration.
#[derive(Debug, Default)]
pub struct Report {
    /// Interleavings run.
    pub runs: usize,
    /// True when every interleaving was run (the limit was not reached).
    pub complete: bool,
    /// Failed interleavings: the choices that led there and what failed.
    pub failures: Vec<String>,
}

/// Scenarios get the probe (build the cache over it) and the gaps.
pub type Scenario = dyn Fn(Arc<Probe>, &mut Gaps) -> Result<(), String> + Send + Sync;

/// Runs `scenario` under every interleaving of its held copies (see the module docs).
pub fn explore(opts: &Explore, scenario: Arc<Scenario>) -> Report {
    let mut report = Report::default();
    let mut prefix: Vec<usize> = Vec::new();
    loop {
        let (path, verdict) = run_once(opts, &scenario, &prefix);
        report.runs += 1;
        if let Err(m) = verdict {
            let choices: Vec<usize> = path.iter().map(|c| c.0).collect();
            report.failures.push(format!("choices {choices:?}: {m}"));
        }
        match next_prefix(&path) {
            Some(p) => prefix = p,
            None => {
                report.complete = true;
                return report;
            }
        }
        if report.runs >= opts.max_runs {
            return report;
        }
    }
}

/// The next unexplored choice sequence after `path` (depth first), if any.
fn next_prefix(path: &[(usize, usize)]) -> Option<Vec<usize>> {
    let i = path.iter().rposition(|&(c, n)| c + 1 < n)?;
    let mut p: Vec<usize> = path[..i].iter().map(|c| c.0).collect();
    p.push(path[i].0 + 1);
    Some(p)
}

#[derive(Copy, Clone, Debug)]
enum Choice {
    Stop,
    Release(StreamKind),
    Kill(StreamKind),
}

const STREAMS: [StreamKind; 2] = [StreamKind::Load, StreamKind::Write];

type Verdict = Result<(), String>;

fn run_once(
    opts: &Explore,
    scenario: &Arc<Scenario>,
    prefix: &[usize],
) -> (Vec<(usize, usize)>, Verdict) {
    let cfg = HostSimConfig {
        gated: true,
        unguarded_worker_exit: opts.unguarded_worker_exit,
        ..Default::default()
    };
    let sim = match HostSim::new(opts.geometry, opts.device_pages, cfg) {
        Ok(s) => s,
        Err(e) => return (Vec::new(), Err(format!("HostSim: {e}"))),
    };
    let (tx, rx) = channel();
    let link = Arc::new(Link(Mutex::new(Some(tx))));
    let probe = Arc::new(Probe {
        sim,
        link: link.clone(),
        events: opts.events,
    });
    let (go_tx, go_rx) = channel();
    let (p, sc, l) = (probe.clone(), scenario.clone(), link.clone());
    std::thread::spawn(move || {
        let mut gaps = Gaps { link: l, go: go_rx };
        let r = catch_unwind(AssertUnwindSafe(|| sc(p, &mut gaps)))
            .unwrap_or_else(|e| Err(panic_text(e.as_ref())));
        gaps.link.send(Msg::Done(r));
    });
    let mut path = Vec::new();
    let mut killed = [false; 2];
    let verdict = loop {
        let msg = match rx.recv_timeout(opts.watchdog) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                break Err(format!(
                    "hang: the scheduler made no progress for {:?}",
                    opts.watchdog
                ));
            }
            Err(RecvTimeoutError::Disconnected) => break Err("the scheduler vanished".into()),
        };
        match msg {
            Msg::Done(r) => break r,
            Msg::Gap => {
                gap(&probe, opts.kills, &mut killed, prefix, &mut path);
                let _ = go_tx.send(());
            }
            Msg::Blocked { stream, done } => {
                if let Err(e) = unblock(&probe, stream, done.as_ref()) {
                    break Err(e);
                }
            }
        }
    };
    // Detach the explorer: a scheduler stuck in a broken run keeps its thread, not ours.
    link.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    (path, verdict)
}

/// The explorer's turn at a gap: complete or kill held copies, one choice at a time.
fn gap(
    probe: &Probe,
    kills: bool,
    killed: &mut [bool; 2],
    prefix: &[usize],
    path: &mut Vec<(usize, usize)>,
) {
    let sim = probe.sim();
    let Some(gate) = sim.gate() else { return };
    loop {
        for s in STREAMS {
            sim.wait_settled(s);
        }
        let mut options = vec![Choice::Stop];
        for (i, s) in STREAMS.into_iter().enumerate() {
            if sim.is_held(s) {
                options.push(Choice::Release(s));
                if kills && !killed[i] {
                    options.push(Choice::Kill(s));
                }
            }
        }
        let at = path.len();
        let pick = prefix.get(at).copied().unwrap_or(0).min(options.len() - 1);
        path.push((pick, options.len()));
        match options[pick] {
            Choice::Stop => return,
            Choice::Release(s) => gate.release_on(s, 1),
            Choice::Kill(s) => {
                killed[STREAMS.iter().position(|&x| x == s).unwrap_or(0)] = true;
                sim.inject_worker_panic(s);
                gate.release_on(s, 1);
            }
        }
    }
}

/// The scheduler waits for an event of `stream`: release its held copies until it completes.
fn unblock(probe: &Probe, stream: StreamKind, done: &dyn Fn() -> bool) -> Result<(), String> {
    let sim = probe.sim();
    loop {
        sim.wait_settled(stream);
        if done() {
            return Ok(());
        }
        match sim.gate() {
            Some(g) if sim.is_held(stream) => g.release_on(stream, 1),
            _ => {
                return Err(format!(
                    "hang: the scheduler waits for a {stream:?} event that nothing will complete \
                     (stream closed: {})",
                    sim.is_stream_closed(stream)
                ));
            }
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    format!("panicked: {msg}")
}
