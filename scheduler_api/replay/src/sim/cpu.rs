//! The replay's measure of the cache manager's CPU time.
//!
//! The manager's calls are timed with the monotonic clock ([`Instant`], a few tens of ns a
//! read), a whole phase of a step at once where its calls are adjacent. A wall-clock figure
//! counts the time the replay thread waited for a core (on a loaded machine, most of it), so
//! once per step the replay also reads the thread's own CPU clock (`CLOCK_THREAD_CPUTIME_ID`
//! on unix): the difference between the two clocks over the step is the time the thread did
//! not run (preempted, or blocked), and it is taken out of the step's timed region that held
//! it (the longest one, when that is long enough to hold it; a wait longer than every region
//! fell outside them). Reading the thread clock around every call instead would cost a system
//! call each (about 0.35 µs on the VM this was written on, more than many calls) and disturb
//! the caches the calls use.
//!
//! Each region's figure also has the monotonic clock's own cost (the smallest back-to-back
//! difference of two reads, measured when the clock is made) taken out. Where the platform has
//! no thread clock the figures are wall-clock time ([`CpuClock::kind`] says which).

use std::time::{Duration, Instant};

/// Where the manager's CPU time goes, by lifecycle phase, and the prompt fills timed inside
/// its calls (not the manager's: see [`CpuClock::fill`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Arrive,
    Admit,
    Extend,
    Decode,
    /// `begin_step`, `chunk_done`, `finish`, `end_step`, `take_events`, and the drain after
    /// each step of a tiered replay (its ack work; the wait for the copies before it is not
    /// the manager's and is not timed).
    Complete,
    /// A prompt source's token generation (the engine's prompt buffer's stand-in), timed
    /// inside an `arrive` or `admit` call.
    Fill,
}

/// The phases reported as the manager's (those before [`Phase::Fill`]).
const MANAGER_PHASES: usize = Phase::Fill as usize;
const BUCKETS: usize = MANAGER_PHASES + 1;

/// Waits shorter than this are left in (the two clocks' reads are not simultaneous).
const MIN_WAIT_NS: u64 = 2_000;

/// Reads the calling thread's CPU clock (ns), where the platform has one.
#[cfg(unix)]
fn thread_cpu_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and the clock id is the platform's constant;
    // clock_gettime writes nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return None;
    }
    let s = u64::try_from(ts.tv_sec).ok()?;
    let ns = u64::try_from(ts.tv_nsec).ok()?;
    s.checked_mul(1_000_000_000)?.checked_add(ns)
}

/// No thread clock: the figures stay wall-clock time.
#[cfg(not(unix))]
fn thread_cpu_ns() -> Option<u64> {
    None
}

/// Per-phase manager CPU time (see the module docs).
#[derive(Debug)]
pub(super) struct CpuClock {
    /// Totals per phase, ns, of the intervals already closed.
    totals: [u64; BUCKETS],
    /// The open interval's per-phase wall time, ns.
    open: [u64; BUCKETS],
    /// The open interval's longest region: (phase index, ns).
    longest: (usize, u64),
    /// The open interval's start on both clocks (`None` without a thread clock).
    mark: Option<(Instant, u64)>,
    /// The monotonic clock's own cost per region, ns.
    read_ns: u64,
    /// Intervals whose wait was taken out of a region, and the time taken out (ns).
    corrected: u64,
    wait_ns: u64,
}

impl CpuClock {
    /// A clock with nothing counted, its interval opening now.
    pub(super) fn new() -> Self {
        // The smallest of many back-to-back differences: a difference that a preemption
        // inflated is never the smallest.
        let read_ns = (0..256)
            .map(|_| {
                let a = Instant::now();
                let b = Instant::now();
                u64::try_from((b - a).as_nanos()).unwrap_or(u64::MAX)
            })
            .min()
            .unwrap_or(0);
        CpuClock {
            totals: [0; BUCKETS],
            open: [0; BUCKETS],
            longest: (0, 0),
            mark: thread_cpu_ns().map(|c| (Instant::now(), c)),
            read_ns,
            corrected: 0,
            wait_ns: 0,
        }
    }

    /// `"thread"` when waits are taken out by the thread's CPU clock, `"wall"` otherwise.
    pub(super) fn kind(&self) -> &'static str {
        if self.mark.is_some() {
            "thread"
        } else {
            "wall"
        }
    }

    /// Charges a region of `ns` of wall time to `phase`.
    pub(super) fn charge(&mut self, phase: Phase, ns: u64) {
        let i = phase as usize;
        self.open[i] += ns;
        if ns > self.longest.1 {
            self.longest = (i, ns);
        }
    }

    /// Charges `since..now` (less the clock's own cost) to `phase`.
    pub(super) fn add(&mut self, phase: Phase, since: Instant) {
        self.lap(phase, since);
    }

    /// Charges `since..now` to `phase` and returns `now`, so that back-to-back manager calls of
    /// different phases share one clock read at their boundary.
    pub(super) fn lap(&mut self, phase: Phase, since: Instant) -> Instant {
        let now = Instant::now();
        let ns = u64::try_from((now - since).as_nanos()).unwrap_or(u64::MAX);
        self.charge(phase, ns.saturating_sub(self.read_ns));
        now
    }

    /// Moves `ns` (a prompt source's fill, timed inside a call of `phase`) from `phase` to
    /// [`Phase::Fill`].
    pub(super) fn fill(&mut self, phase: Phase, ns: u64) {
        let i = phase as usize;
        let moved = ns.min(self.open[i]);
        self.open[i] -= moved;
        if self.longest.0 == i {
            self.longest.1 = self.longest.1.saturating_sub(moved);
        }
        self.charge(Phase::Fill, moved);
    }

    /// Closes the interval that started at the last tick: the time the thread did not run in
    /// it leaves the region that held it, and the regions join the totals. Call once a step,
    /// outside the timed regions.
    pub(super) fn tick(&mut self) {
        let mut wait = 0;
        if let Some((wall0, cpu0)) = self.mark
            && let Some(cpu) = thread_cpu_ns()
        {
            let now = Instant::now();
            let wall = u64::try_from((now - wall0).as_nanos()).unwrap_or(u64::MAX);
            wait = wall.saturating_sub(cpu.saturating_sub(cpu0));
            self.mark = Some((now, cpu));
        }
        self.close(wait);
    }

    /// Closes the interval, in which the thread did not run for `wait` ns: a wait that fits
    /// in the interval's longest region is taken out of it (a wait longer than every region
    /// was outside them: the regions are left whole).
    fn close(&mut self, wait: u64) {
        let (i, longest) = self.longest;
        if wait >= MIN_WAIT_NS && longest >= wait {
            self.open[i] -= wait;
            self.corrected += 1;
            self.wait_ns += wait;
        }
        for (t, o) in self.totals.iter_mut().zip(&mut self.open) {
            *t += std::mem::take(o);
        }
        self.longest = (0, 0);
    }

    /// The time charged to `phase` so far (closed intervals only: [`CpuClock::tick`] first).
    pub(super) fn total(&self, phase: Phase) -> Duration {
        Duration::from_nanos(self.totals[phase as usize])
    }

    /// The manager's time over every phase.
    pub(super) fn manager_total(&self) -> Duration {
        Duration::from_nanos(self.totals[..MANAGER_PHASES].iter().sum())
    }

    /// Intervals whose wait was taken out, and the time taken out.
    pub(super) fn waits(&self) -> (u64, Duration) {
        (self.corrected, Duration::from_nanos(self.wait_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_leaves_the_longest_region_when_it_fits_there() {
        let mut c = CpuClock::new();
        c.charge(Phase::Decode, 3_000);
        c.charge(Phase::Admit, 50_000);
        c.charge(Phase::Complete, 4_000);
        c.close(40_000);
        assert_eq!(c.total(Phase::Admit), Duration::from_nanos(10_000));
        assert_eq!(c.total(Phase::Decode), Duration::from_nanos(3_000));
        assert_eq!(c.waits(), (1, Duration::from_nanos(40_000)));
        // Longer than every region: it was outside them.
        c.charge(Phase::Decode, 3_000);
        c.close(40_000);
        assert_eq!(c.total(Phase::Decode), Duration::from_nanos(6_000));
        // Too short to tell from the clocks' skew: left in.
        c.charge(Phase::Extend, 5_000);
        c.close(MIN_WAIT_NS - 1);
        assert_eq!(c.total(Phase::Extend), Duration::from_nanos(5_000));
        assert_eq!(c.waits().0, 1);
        assert_eq!(
            c.manager_total(),
            Duration::from_nanos(10_000 + 6_000 + 4_000 + 5_000)
        );
    }

    #[test]
    fn fills_are_not_the_managers_and_take_their_waits_with_them() {
        let mut c = CpuClock::new();
        // An admission of 30 µs, 25 of them a prompt fill that waited 20 µs for a core.
        c.charge(Phase::Admit, 30_000);
        c.fill(Phase::Admit, 25_000);
        c.charge(Phase::Decode, 8_000);
        c.close(20_000);
        assert_eq!(c.total(Phase::Admit), Duration::from_nanos(5_000));
        assert_eq!(c.total(Phase::Fill), Duration::from_nanos(5_000));
        assert_eq!(c.total(Phase::Decode), Duration::from_nanos(8_000));
        assert_eq!(c.manager_total(), Duration::from_nanos(13_000));
    }

    #[cfg(unix)]
    #[test]
    fn unix_has_the_thread_clock() {
        let c = CpuClock::new();
        assert_eq!(c.kind(), "thread");
        let a = thread_cpu_ns().unwrap();
        // Spin until the thread's CPU clock moves (it counts this thread's running time).
        let mut x = 0_u64;
        while thread_cpu_ns().unwrap() == a {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(thread_cpu_ns().unwrap() > a);
    }
}
