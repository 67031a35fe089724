//! The streams of [`HostSim`](super::HostSim): one worker thread per stream fed by a bounded
//! channel, the events it completes, the copy gate that holds copies for tests, and the exit
//! guard that completes every event a dead worker leaves behind.
//!
//! # Completion guarantee
//! Every event handed out by `record_event` completes, whatever happens to the worker: the
//! command that carries it completes the event with [`HiCacheError::StreamClosed`] when it is
//! dropped without being executed (a worker that panicked, a channel torn down), and the
//! worker's exit guard marks the stream closed and drains what was queued, so every later
//! submission fails with the same typed error instead of queueing work nobody will run.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::backend::{CopyEvent, PageCopy, SlotCopy, SlotMemory, StreamKind};
use crate::error::{HiCacheError, Result};

use super::mem::{DeviceMem, execute_slots};

fn index(s: StreamKind) -> usize {
    match s {
        StreamKind::Load => 0,
        StreamKind::Write => 1,
    }
}

/// What the scheduler side can observe of one stream's worker.
#[derive(Copy, Clone, Debug, Default)]
struct Progress {
    /// Commands accepted by the channel.
    submitted: u64,
    /// Commands the worker finished (or dropped on exit).
    done: u64,
    /// The worker holds a copy and waits for a gate permit.
    parked: bool,
    /// The worker is exiting; nothing submitted will run, and submissions are refused.
    closed: bool,
    /// The worker has exited and its exit guard has completed what it left behind.
    exited: bool,
    /// Submissions that found the channel full and waited for room.
    blocked: u64,
}

#[derive(Debug, Default)]
struct SyncState {
    gated: bool,
    open: bool,
    /// Open the gate at the first wait on an incomplete event.
    open_on_wait: bool,
    /// Permits any stream may take.
    any: u64,
    /// Permits for one stream only.
    permits: [u64; 2],
    streams: [Progress; 2],
}

impl SyncState {
    fn can_pass(&self, s: usize) -> bool {
        !self.gated || self.open || self.any > 0 || self.permits[s] > 0
    }
}

/// State shared by a [`HostSim`](super::HostSim)'s streams and its gate.
#[derive(Debug, Default)]
pub(super) struct SimSync {
    state: Mutex<SyncState>,
    cv: Condvar,
}

impl SimSync {
    pub(super) fn new(gated: bool) -> Arc<Self> {
        Arc::new(SimSync {
            state: Mutex::new(SyncState {
                gated,
                ..SyncState::default()
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SyncState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, SyncState>) -> MutexGuard<'a, SyncState> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks the worker of stream `s` until a permit lets its next copy run.
    fn acquire(&self, s: usize) {
        let mut g = self.lock();
        if !g.gated {
            return;
        }
        g.streams[s].parked = true;
        self.cv.notify_all();
        while !g.can_pass(s) {
            g = self.wait(g);
        }
        if !g.open {
            if g.permits[s] > 0 {
                g.permits[s] -= 1;
            } else {
                g.any -= 1;
            }
        }
        g.streams[s].parked = false;
    }

    fn update(&self, s: usize, f: impl FnOnce(&mut Progress)) {
        f(&mut self.lock().streams[s]);
        self.cv.notify_all();
    }

    /// Counts a submission about to enter the channel; refuses it on a closed stream.
    fn begin_submit(&self, kind: StreamKind) -> Result<()> {
        let mut g = self.lock();
        let p = &mut g.streams[index(kind)];
        if p.closed {
            return Err(HiCacheError::StreamClosed(kind));
        }
        p.submitted += 1;
        Ok(())
    }

    /// Blocks until stream `kind` can make no progress by itself: idle, parked at the gate
    /// without a permit, or closed.
    pub(super) fn wait_settled(&self, kind: StreamKind) {
        let s = index(kind);
        let mut g = self.lock();
        loop {
            let p = g.streams[s];
            if p.exited || p.done == p.submitted || (p.parked && !g.can_pass(s)) {
                return;
            }
            g = self.wait(g);
        }
    }

    /// True when the worker of `kind` holds a copy that waits for a gate permit.
    pub(super) fn is_held(&self, kind: StreamKind) -> bool {
        let s = index(kind);
        let g = self.lock();
        g.streams[s].parked && !g.can_pass(s)
    }

    fn blocked(&self, kind: StreamKind) -> u64 {
        self.lock().streams[index(kind)].blocked
    }

    fn is_closed(&self, kind: StreamKind) -> bool {
        self.lock().streams[index(kind)].closed
    }

    /// Someone is about to wait on an incomplete event.
    fn waiting(&self) {
        let mut g = self.lock();
        if g.open_on_wait {
            g.open = true;
            self.cv.notify_all();
        }
    }
}

/// Permits that let held copies run (see
/// [`HostSimConfig::gated`](super::HostSimConfig::gated)). Tests hold copies with it to choose
/// the exact point at which each copy completes.
#[derive(Clone, Debug)]
pub struct CopyGate(pub(super) Arc<SimSync>);

impl CopyGate {
    /// Lets `n` more copies run, on whichever stream takes them first.
    pub fn release(&self, n: u64) {
        self.0.lock().any += n;
        self.0.cv.notify_all();
    }

    /// Lets `n` more copies run on `stream` only (deterministic with both streams busy).
    pub fn release_on(&self, stream: StreamKind, n: u64) {
        self.0.lock().permits[index(stream)] += n;
        self.0.cv.notify_all();
    }

    /// Lets every copy run from now on.
    pub fn open(&self) {
        self.0.lock().open = true;
        self.0.cv.notify_all();
    }

    /// Holds copies again after [`CopyGate::open`] or [`CopyGate::open_when_waited`]
    /// (permits released before are kept).
    pub fn close(&self) {
        let mut g = self.0.lock();
        g.open = false;
        g.open_on_wait = false;
    }

    /// Keeps holding copies until some thread waits on an event that is not complete yet,
    /// then opens the gate (as [`CopyGate::open`]). A test can so tell, without timing, an
    /// operation that waits for held copies (it completes them) from one that returns without
    /// waiting (the copies are still held when it returns).
    pub fn open_when_waited(&self) {
        self.0.lock().open_on_wait = true;
    }
}

/// `None` until the stream reaches the event, then the outcome of the copies before it.
type EventSlot = Mutex<Option<Result<()>>>;

/// Completion event of a [`HostSim`](super::HostSim) stream.
#[derive(Clone, Debug)]
pub struct SimEvent {
    slot: Arc<(EventSlot, Condvar)>,
    /// The gate, told when someone waits (see [`CopyGate::open_when_waited`]).
    sync: Arc<SimSync>,
}

impl SimEvent {
    fn new(sync: Arc<SimSync>) -> Self {
        SimEvent {
            slot: Arc::new((Mutex::new(None), Condvar::new())),
            sync,
        }
    }

    /// Completes the event unless it already is (the first outcome wins).
    fn complete(&self, r: Result<()>) {
        let (m, cv) = &*self.slot;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(r);
        }
        cv.notify_all();
    }
}

impl CopyEvent for SimEvent {
    fn is_complete(&self) -> bool {
        self.slot
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn wait(&self) -> Result<()> {
        let (m, cv) = &*self.slot;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = &*g {
            // Complete: one lock, as a GPU event that remembers its completion costs a read.
            return r.clone();
        }
        // Tell the gate outside the slot's lock (a worker completes events under the gate's).
        drop(g);
        self.sync.waiting();
        g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*g {
                Some(r) => return r.clone(),
                None => g = cv.wait(g).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }
}

/// An event travelling through a stream's queue. Dropped unexecuted (the worker died, the
/// channel was torn down), it completes its event with [`HiCacheError::StreamClosed`], so no
/// `wait` can outlive the worker.
pub(super) struct PendingEvent {
    event: SimEvent,
    stream: StreamKind,
    armed: bool,
}

impl PendingEvent {
    fn fire(mut self, r: Result<()>) {
        self.armed = false;
        self.event.complete(r);
    }
}

impl Drop for PendingEvent {
    fn drop(&mut self) {
        if self.armed {
            self.event
                .complete(Err(HiCacheError::StreamClosed(self.stream)));
        }
    }
}

pub(super) enum Cmd {
    Copy(PageCopy),
    Slots(SlotCopy, Arc<SlotMemory>),
    Record(PendingEvent),
}

/// Fault-injection counters of one stream.
#[derive(Debug, Default)]
pub(super) struct Faults {
    /// Copies still to fail.
    pub(super) copies: AtomicU32,
    /// Submissions still to refuse.
    pub(super) refusals: AtomicU32,
    /// Copies after which the worker dies (test hook).
    pub(super) panics: AtomicU32,
}

fn take(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// One stream: its channel, worker and faults.
pub(super) struct Stream {
    kind: StreamKind,
    pub(super) faults: Arc<Faults>,
    sync: Arc<SimSync>,
    tx: Mutex<Option<SyncSender<Cmd>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Test hook: events dropped by a dead worker are left pending (the bug the exit guard
    /// fixes), so a hang detector can be shown to catch it.
    unguarded: bool,
}

/// How a stream's worker runs.
pub(super) struct WorkerOptions {
    pub(super) capacity: usize,
    pub(super) delay: Duration,
    pub(super) unguarded: bool,
}

impl Stream {
    pub(super) fn spawn(
        kind: StreamKind,
        mem: Arc<DeviceMem>,
        sync: Arc<SimSync>,
        opts: &WorkerOptions,
    ) -> Result<Self> {
        let (tx, rx) = sync_channel(opts.capacity);
        let faults = Arc::new(Faults::default());
        let worker = Worker {
            kind,
            mem,
            sync: sync.clone(),
            faults: faults.clone(),
            delay: opts.delay,
            failed: None,
        };
        let guard = ExitGuard {
            rx: Some(rx),
            sync: sync.clone(),
            stream: index(kind),
            guarded: !opts.unguarded,
        };
        let name = match kind {
            StreamKind::Load => "hostsim-load",
            StreamKind::Write => "hostsim-write",
        };
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || worker.run(guard))
            .map_err(|e| HiCacheError::Transfer(format!("spawning a stream: {e}")))?;
        Ok(Stream {
            kind,
            faults,
            sync,
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(handle)),
            unguarded: opts.unguarded,
        })
    }

    /// Submits an event and returns it.
    pub(super) fn record(&self) -> Result<SimEvent> {
        let event = SimEvent::new(self.sync.clone());
        self.submit(Cmd::Record(PendingEvent {
            event: event.clone(),
            stream: self.kind,
            armed: !self.unguarded,
        }))?;
        Ok(event)
    }

    /// Submits `cmd`, waiting for room when the channel is full (back-pressure, like a GPU's
    /// launch queue). A dropped `cmd` completes its event, if it carries one.
    pub(super) fn submit(&self, cmd: Cmd) -> Result<()> {
        if take(&self.faults.refusals) {
            return Err(HiCacheError::Transfer(format!(
                "{:?} stream refused the submission (injected fault)",
                self.kind
            )));
        }
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else {
            return Err(HiCacheError::StreamClosed(self.kind));
        };
        self.sync.begin_submit(self.kind)?;
        let s = index(self.kind);
        let sent = match tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(cmd)) => {
                self.sync.update(s, |p| p.blocked += 1);
                tx.send(cmd).map_err(|_| ())
            }
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        sent.map_err(|()| {
            self.sync.update(s, |p| p.submitted -= 1);
            HiCacheError::StreamClosed(self.kind)
        })
    }

    /// Submissions that waited for room in the channel.
    pub(super) fn blocked_submissions(&self) -> u64 {
        self.sync.blocked(self.kind)
    }

    /// True once the worker has exited.
    pub(super) fn is_closed(&self) -> bool {
        self.sync.is_closed(self.kind)
    }

    /// Closes the channel and joins the worker (it drains what was submitted first).
    pub(super) fn shut_down(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // A worker that panicked already completed its events through its exit guard.
            let _ = h.join();
        }
    }
}

/// Runs on the worker thread's stack; its drop (normal exit or unwinding) closes the stream
/// and completes every event still queued.
struct ExitGuard {
    rx: Option<Receiver<Cmd>>,
    sync: Arc<SimSync>,
    stream: usize,
    guarded: bool,
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else { return };
        // Closed first: a submission racing with this drain then fails instead of queueing.
        self.sync.update(self.stream, |p| p.closed = true);
        // Without the guard (the test hook) the queued commands were built unarmed: dropping
        // them leaves their events pending.
        let mut dropped = 0;
        while self.guarded
            && let Ok(cmd) = rx.try_recv()
        {
            drop(cmd);
            dropped += 1;
        }
        // Commands that slip in before `rx` is gone are dropped with it, completing their
        // events the same way.
        drop(rx);
        self.sync.update(self.stream, |p| {
            p.done += dropped;
            p.exited = true;
        });
    }
}

struct Worker {
    kind: StreamKind,
    mem: Arc<DeviceMem>,
    sync: Arc<SimSync>,
    faults: Arc<Faults>,
    delay: Duration,
    /// The first failure since the last event; the next event reports it (sticky until then,
    /// like a CUDA stream error).
    failed: Option<String>,
}

impl Worker {
    fn run(mut self, guard: ExitGuard) {
        let s = index(self.kind);
        let Some(rx) = guard.rx.as_ref() else { return };
        while let Ok(cmd) = rx.recv() {
            self.execute(cmd);
            self.sync.update(s, |p| p.done += 1);
        }
        drop(guard);
    }

    fn execute(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Copy(c) => {
                self.sync.acquire(index(self.kind));
                if take(&self.faults.panics) {
                    // The worker dies as a bug in a copy would kill it; `resume_unwind` skips
                    // the panic hook, so the injected fault does not pollute the output.
                    std::panic::resume_unwind(Box::new("injected HostSim worker panic"));
                }
                if !self.delay.is_zero() {
                    std::thread::sleep(self.delay);
                }
                let _span = tracing::trace_span!("hostsim_copy", layers = ?c.layers).entered();
                let poison = take(&self.faults.copies);
                self.mem.execute(&c, poison);
                if poison {
                    self.failed
                        .get_or_insert_with(|| format!("injected fault in {:?} copy", c.direction));
                }
            }
            Cmd::Slots(c, dev) => {
                let poison = take(&self.faults.copies);
                execute_slots(&c, &dev, poison);
                if poison {
                    self.failed
                        .get_or_insert_with(|| format!("injected fault in {:?} copy", c.pool));
                }
            }
            Cmd::Record(ev) => ev.fire(
                self.failed
                    .take()
                    .map_or(Ok(()), |e| Err(HiCacheError::Transfer(e))),
            ),
        }
    }
}
