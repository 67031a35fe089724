//! The plain-text rendering of an [`Analysis`].

use std::fmt;

use super::{Analysis, PrefixAnalysis, Quantiles};

impl fmt::Display for Analysis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "trace {}", self.trace)?;
        writeln!(
            f,
            "requests {}   input tokens {}   output tokens {}   duration {:.1} s   {:.2} req/s",
            self.requests,
            self.input_tokens,
            self.output_tokens,
            self.duration_s,
            self.arrival_rate
        )?;
        writeln!(f, "{:<22}{}", "", Quantiles::header())?;
        writeln!(
            f,
            "{:<22}{}",
            "input length (tokens)",
            self.input_len.row(0)
        )?;
        writeln!(
            f,
            "{:<22}{}",
            "output length (tokens)",
            self.output_len.row(0)
        )?;
        match &self.prefix {
            Some(p) => p.fmt(f),
            None => writeln!(
                f,
                "no prefix information (no hash blocks) in this trace: only lengths and arrivals \
                 can be analysed"
            ),
        }
    }
}

impl Quantiles {
    fn header() -> String {
        format!(
            "{:>9} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "count", "mean", "p10", "p50", "p90", "p99"
        )
    }

    fn row(&self, decimals: usize) -> String {
        let d = decimals;
        format!(
            "{:>9} {:>10.d$} {:>10.d$} {:>10.d$} {:>10.d$} {:>10.d$}",
            self.count, self.mean, self.p10, self.p50, self.p90, self.p99
        )
    }
}

impl fmt::Display for PrefixAnalysis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "\nblocks of {} tokens: total {}   unique {}",
            self.block_tokens, self.total_blocks, self.unique_blocks
        )?;
        writeln!(
            f,
            "infinite-cache ideal: block hit ratio {:.4}   token hit ratio {:.4} ({} tokens)",
            self.ideal_block_hit_ratio, self.ideal_token_hit_ratio, self.ideal_hit_tokens
        )?;
        writeln!(
            f,
            "new blocks never reused: {:.4}",
            self.never_reused_fraction
        )?;
        writeln!(f, "{:<22}{}", "", Quantiles::header())?;
        writeln!(f, "{:<22}{}", "reuse gap (s)", self.reuse_gap_s.row(1))?;

        writeln!(
            f,
            "\nconversations (parent = creator of the deepest hit block, >= 2 blocks hit)"
        )?;
        writeln!(
            f,
            "{:>6} {:>9} {:>9} {:>11}",
            "turn", "requests", "parents", "P(continue)"
        )?;
        for t in &self.turns {
            writeln!(
                f,
                "{:>6} {:>9} {:>9} {:>11.3}",
                t.turn, t.requests, t.continued, t.p_continue
            )?;
        }
        writeln!(
            f,
            "\ncontinuation hazard (age = time since the request's arrival; bins fully observed)"
        )?;
        writeln!(
            f,
            "{:>12} {:>9} {:>10} {:>20}",
            "age (s)", "at risk", "continued", "P(cont. | not yet)"
        )?;
        for h in &self.hazard {
            writeln!(
                f,
                "{:>12} {:>9} {:>10} {:>20.3}",
                format!("{}-{}", h.from_s, h.to_s),
                h.at_risk,
                h.continued,
                h.p_continue
            )?;
        }
        for c in &self.capacities {
            writeln!(
                f,
                "\ncapacity {} tokens = {} blocks (block-level replay, leaf eviction)",
                c.capacity_tokens, c.capacity_blocks
            )?;
            writeln!(
                f,
                "{:<16} {:>10} {:>10} {:>9} {:>10}",
                "policy", "token hit", "block hit", "of ideal", "evictions"
            )?;
            for p in &c.policies {
                writeln!(
                    f,
                    "{:<16} {:>10.4} {:>10.4} {:>9.3} {:>10}",
                    p.policy, p.token_hit_ratio, p.block_hit_ratio, p.of_ideal, p.evictions
                )?;
            }
        }
        Ok(())
    }
}
