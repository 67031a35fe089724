//! Resident memory of the replaying process, so a long replay can show that memory stays flat
//! once the caches are full. Read from `/proc/self/status` (Linux); elsewhere nothing is
//! reported rather than a made-up figure.

use serde::Serialize;

use radixkv_scheduler_api::error::{ManagerError, Result};

/// Current and peak resident set of this process, in KiB.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rss {
    pub current_kib: u64,
    pub peak_kib: u64,
}

/// Reads `VmRSS` and `VmHWM`; `None` where the file or the fields do not exist.
pub(crate) fn read_rss() -> Option<Rss> {
    parse_status(&std::fs::read_to_string("/proc/self/status").ok()?)
}

fn parse_status(status: &str) -> Option<Rss> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|n| n.trim().parse::<u64>().ok())
    };
    Some(Rss {
        current_kib: field("VmRSS:")?,
        peak_kib: field("VmHWM:")?,
    })
}

/// One periodic reading.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RssSample {
    /// Requests finished when it was taken.
    pub requests_done: u64,
    /// Resident set (KiB).
    pub rss_kib: u64,
}

/// Resident memory of the process over one replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryUse {
    /// Resident set when the replay started, the trace already in memory (KiB).
    pub start_kib: u64,
    /// Resident set at the latest reading: once the replay is done, after the final drain and
    /// session closes (KiB).
    pub end_kib: u64,
    /// Peak resident set of the whole process so far (`VmHWM`, KiB): it includes reading the
    /// trace and, under `--compare`, the replays before this one.
    pub peak_kib: u64,
    /// Requests in the replay.
    pub requests: u64,
    /// A reading each time another twentieth of the requests finished.
    pub samples: Vec<RssSample>,
    /// The twentieth whose crossing takes the next reading.
    #[serde(skip)]
    next_mark: u64,
}

/// Readings per replay.
const SAMPLES: u64 = 20;

impl MemoryUse {
    /// Starts recording a replay of `requests` requests; `None` where resident memory cannot
    /// be read.
    pub(crate) fn start(requests: u64) -> Option<Self> {
        let r = read_rss()?;
        Some(MemoryUse {
            start_kib: r.current_kib,
            end_kib: r.current_kib,
            peak_kib: r.peak_kib,
            requests,
            samples: Vec::new(),
            next_mark: 1,
        })
    }

    /// Takes a reading if `done` requests crossed the next twentieth (one reading however
    /// many twentieths were crossed at once).
    pub(crate) fn on_progress(&mut self, done: u64) {
        // done / requests ≥ next_mark / SAMPLES, in integers.
        if self.next_mark > SAMPLES
            || done.saturating_mul(SAMPLES) < self.next_mark.saturating_mul(self.requests)
        {
            return;
        }
        self.next_mark = done.saturating_mul(SAMPLES) / self.requests.max(1) + 1;
        if let Some(r) = read_rss() {
            self.samples.push(RssSample {
                requests_done: done,
                rss_kib: r.current_kib,
            });
            self.end_kib = r.current_kib;
            self.peak_kib = self.peak_kib.max(r.peak_kib);
        }
    }

    /// Records the end of the replay.
    pub(crate) fn finish(&mut self) {
        if let Some(r) = read_rss() {
            self.end_kib = r.current_kib;
            self.peak_kib = self.peak_kib.max(r.peak_kib);
        }
    }

    /// The resident set after warm-up: the first reading once a quarter of the requests had
    /// finished (the caches have filled by then on any trace long enough to soak), or the
    /// start when there is none.
    pub fn warm_kib(&self) -> u64 {
        self.warm_reading().unwrap_or(self.start_kib)
    }

    fn warm_reading(&self) -> Option<u64> {
        self.samples
            .iter()
            .find(|s| s.requests_done.saturating_mul(4) >= self.requests)
            .map(|s| s.rss_kib)
    }

    /// Growth of the resident set from warm-up to the latest reading, in KiB (negative: it
    /// shrank).
    pub fn growth_after_warmup_kib(&self) -> i64 {
        self.end_kib as i64 - self.warm_kib() as i64
    }

    /// Fails when the resident set grew by more than `limit_mib` since warm-up (never
    /// before warm-up: the caches are still filling).
    ///
    /// # Errors
    /// [`ManagerError::Invariant`] naming the growth and the replay `label`.
    pub(crate) fn check_growth(&self, limit_mib: Option<u64>, label: &str) -> Result<()> {
        let Some(limit) = limit_mib else {
            return Ok(());
        };
        let Some(warm) = self.warm_reading() else {
            return Ok(());
        };
        let growth = self.end_kib as i64 - warm as i64;
        if growth <= i64::try_from(limit.saturating_mul(1024)).unwrap_or(i64::MAX) {
            return Ok(());
        }
        Err(ManagerError::Invariant(radixkv_radix::InvariantViolation(
            format!(
                "{label}: memory is not flat: the resident set grew by {:.1} MiB since warm-up \
                 ({:.1} MiB once a quarter of the requests were done), more than the limit of \
                 {limit} MiB",
                growth as f64 / 1024.0,
                warm as f64 / 1024.0
            ),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse_and_missing_ones_give_none() {
        let s = "Name:\tradixkv\nVmHWM:\t  204800 kB\nVmRSS:\t   102400 kB\nThreads:\t3\n";
        assert_eq!(
            parse_status(s),
            Some(Rss {
                current_kib: 102_400,
                peak_kib: 204_800
            })
        );
        assert_eq!(parse_status("Name:\tx\nVmRSS:\t5 kB\n"), None);
        assert_eq!(parse_status("VmRSS:\tlots kB\nVmHWM:\t1 kB\n"), None);
    }

    #[test]
    fn readings_come_once_per_twentieth_and_warm_up_is_the_quarter_mark() {
        let Some(mut m) = MemoryUse::start(1000) else {
            // No /proc here: nothing to check but that nothing is made up.
            assert!(read_rss().is_none());
            return;
        };
        for done in 1..=1000 {
            m.on_progress(done);
        }
        let at: Vec<u64> = m.samples.iter().map(|s| s.requests_done).collect();
        assert_eq!(at, (1..=20).map(|k| k * 50).collect::<Vec<_>>());
        m.end_kib = m.samples[4].rss_kib + 10;
        assert_eq!(m.warm_kib(), m.samples[4].rss_kib);
        assert_eq!(m.growth_after_warmup_kib(), 10);
        // Jumps past several marks take one reading; fewer requests than marks still work.
        let mut few = MemoryUse::start(3).unwrap();
        few.on_progress(3);
        few.on_progress(3);
        assert_eq!(few.samples.len(), 1);
        let mut jump = MemoryUse::start(100).unwrap();
        jump.on_progress(12);
        jump.on_progress(14);
        jump.on_progress(15);
        let at: Vec<u64> = jump.samples.iter().map(|s| s.requests_done).collect();
        assert_eq!(at, [12, 15]);
    }

    #[test]
    fn growth_fails_only_past_the_limit_and_only_after_warm_up() {
        let reading = |requests_done, rss_kib| RssSample {
            requests_done,
            rss_kib,
        };
        let mut m = MemoryUse {
            start_kib: 1000,
            end_kib: 50_000,
            requests: 100,
            samples: vec![reading(10, 50_000)],
            ..Default::default()
        };
        // Still filling: no verdict, whatever the growth.
        assert!(m.check_growth(Some(1), "x").is_ok());
        m.samples.push(reading(25, 60_000));
        m.end_kib = 60_000 + 2048;
        assert!(m.check_growth(Some(2), "x").is_ok());
        assert!(m.check_growth(None, "x").is_ok());
        let e = m.check_growth(Some(1), "cfg").unwrap_err().to_string();
        assert!(
            e.contains("cfg: memory is not flat") && e.contains("2.0 MiB"),
            "{e}"
        );
    }
}
