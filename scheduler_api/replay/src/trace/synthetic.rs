//! The built-in synthetic multi-turn chat workload (no file needed).
//!
//! Conversations start by a Poisson process. Each opens with one of a few shared system
//! prompts; turn `k + 1`'s prompt is turn `k`'s prompt, turn `k`'s output and a new user
//! message, so later turns reuse everything before them. The next turn arrives after the
//! previous answer would have streamed plus a think time. Everything is drawn from one seed.
//!
//! The whole trace is built in memory (the replay sorts it by arrival and indexes it), and a
//! conversation of `k` turns stores `k` prompts of up to `2k` segments, so its size grows with
//! `conversations × max_turns²`. [`SyntheticChat::generate`] refuses parameters whose worst
//! case exceeds [`SyntheticChat::MAX_TRACE_BYTES`] instead of exhausting memory.

use super::{Rng, Segment, TAG_OUTPUT, TAG_SYNTH, Trace, TraceRequest};
use radixkv_scheduler_api::error::{ManagerError, Result};

/// Parameters of the synthetic chat workload.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SyntheticChat {
    /// Conversations.
    pub conversations: u32,
    /// Turns per conversation are uniform in `1..=max_turns`.
    pub max_turns: u32,
    /// Distinct shared system prompts.
    pub system_prompts: u32,
    /// System prompt length range (tokens).
    pub system_len: (u32, u32),
    /// User message length range (tokens).
    pub user_len: (u32, u32),
    /// Output length range (tokens).
    pub output_len: (u32, u32),
    /// Mean gap between conversation starts (seconds).
    pub conversation_gap_s: f64,
    /// Mean think time between an answer and the next turn (seconds).
    pub think_time_s: f64,
    /// Assumed streaming time per output token when placing the next turn (seconds).
    pub stream_s_per_token: f64,
    /// Seed.
    pub seed: u64,
}

impl Default for SyntheticChat {
    fn default() -> Self {
        SyntheticChat {
            conversations: 600,
            max_turns: 10,
            system_prompts: 4,
            system_len: (1024, 3072),
            user_len: (32, 768),
            output_len: (32, 512),
            conversation_gap_s: 0.4,
            think_time_s: 30.0,
            stream_s_per_token: 0.02,
            seed: 42,
        }
    }
}

impl SyntheticChat {
    /// The most memory a generated trace may take, worst case (every conversation at
    /// `max_turns`): 256 MiB, about 80,000 conversations of up to 10 turns (the default is
    /// 600). A bound, not a lazy trace, because the replay holds the whole trace anyway.
    pub const MAX_TRACE_BYTES: u64 = 256 << 20;

    /// Worst-case bytes of the trace these parameters generate (`None`: past `u64`).
    fn worst_case_bytes(&self) -> Option<u64> {
        let conversations = u64::from(self.conversations);
        let turns = u64::from(self.max_turns.max(1));
        // Turn k's prompt holds 2k segments (system, then user/output pairs, the last user
        // message unanswered): sum over k = 1..=turns of 2k = turns × (turns + 1).
        let segments = turns.checked_mul(turns + 1)?;
        let per_conversation = turns
            .checked_mul(size_of::<TraceRequest>() as u64)?
            .checked_add(segments.checked_mul(size_of::<Segment>() as u64)?)?;
        conversations.checked_mul(per_conversation)
    }

    /// Checks the parameters: at least one conversation, a trace within
    /// [`Self::MAX_TRACE_BYTES`], finite non-negative times.
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming the bad parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        if self.conversations == 0 {
            return bad(
                "the synthetic workload needs at least one conversation (an empty workload has \
                 no requests to replay)"
                    .into(),
            );
        }
        match self.worst_case_bytes() {
            Some(b) if b <= Self::MAX_TRACE_BYTES => {}
            b => {
                return bad(format!(
                    "a synthetic workload of {} conversations of up to {} turns could take {} \
                     of memory, more than the {} MiB cap; use fewer conversations or turns",
                    self.conversations,
                    self.max_turns,
                    b.map_or_else(
                        || "more than 2^64 bytes".into(),
                        |b| format!("{} MiB", b >> 20)
                    ),
                    Self::MAX_TRACE_BYTES >> 20
                ));
            }
        }
        for (name, v) in [
            ("conversation_gap_s", self.conversation_gap_s),
            ("think_time_s", self.think_time_s),
            ("stream_s_per_token", self.stream_s_per_token),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(format!(
                    "synthetic workload: {name} must be a finite non-negative number (got {v})"
                ));
            }
        }
        Ok(())
    }

    /// Generates the workload.
    ///
    /// # Errors
    /// As [`Self::validate`]; nothing is generated then.
    pub fn generate(&self) -> Result<Trace> {
        self.validate()?;
        let mut rng = Rng::new(self.seed);
        let pick = |rng: &mut Rng, (lo, hi): (u32, u32)| {
            rng.range(u64::from(lo.min(hi)), u64::from(hi.max(lo)))
                .max(1)
        };
        let systems: Vec<Segment> = (0..self.system_prompts.max(1))
            .map(|i| Segment {
                first: TAG_SYNTH | u64::from(i) << 32,
                block: u32::MAX,
                len: pick(&mut rng, self.system_len),
            })
            .collect();
        let mut requests = Vec::new();
        let mut fresh = 1u64 << 40;
        let mut start = 0.0f64;
        for conv in 0..u64::from(self.conversations) {
            start += rng.exp(self.conversation_gap_s);
            let mut at = start;
            let mut prompt = vec![systems[(rng.next_u64() % systems.len() as u64) as usize]];
            let turns = rng.range(1, u64::from(self.max_turns.max(1)));
            for _ in 0..turns {
                fresh += 1;
                prompt.push(Segment {
                    first: TAG_SYNTH | fresh,
                    block: u32::MAX,
                    len: pick(&mut rng, self.user_len),
                });
                let out = pick(&mut rng, self.output_len) as u32;
                let index = requests.len() as u64;
                let output_id = TAG_OUTPUT | index;
                requests.push(TraceRequest {
                    arrival_us: (at * 1e6) as u64,
                    prompt: prompt.clone(),
                    prompt_len: prompt.iter().map(|s| s.len).sum(),
                    output_len: out,
                    output_id,
                    session: Some(conv),
                });
                // The answer becomes part of the next turn's prompt: the last output token is
                // sampled but never fed back, so its KV is not cached and it ends the answer.
                prompt.push(Segment {
                    first: output_id,
                    block: u32::MAX,
                    len: u64::from(out),
                });
                at += f64::from(out) * self.stream_s_per_token + rng.exp(self.think_time_s);
            }
        }
        Ok(Trace {
            name: "synthetic-chat".into(),
            requests,
            conversations_disjoint: false,
        }
        .finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_turns_extend_earlier_ones_including_outputs() {
        let t = SyntheticChat {
            conversations: 3,
            max_turns: 4,
            ..Default::default()
        }
        .generate()
        .unwrap();
        let mut checked = 0;
        for (i, a) in t.requests.iter().enumerate() {
            let Some(b) = t.requests[i + 1..]
                .iter()
                .find(|b| b.session == a.session && b.prompt_len > a.prompt_len)
            else {
                continue;
            };
            let (pa, pb) = (a.prompt_tokens(), b.prompt_tokens());
            assert_eq!(&pb[..pa.len()], &pa[..]);
            let out = a.output_tokens();
            assert_eq!(&pb[pa.len()..pa.len() + out.len()], &out[..]);
            checked += 1;
        }
        assert!(checked > 0);
        let again = SyntheticChat {
            conversations: 3,
            max_turns: 4,
            ..Default::default()
        }
        .generate()
        .unwrap();
        assert_eq!(t, again);
    }

    #[test]
    fn empty_oversized_and_nonsense_workloads_are_refused() {
        let refused = |c: SyntheticChat, needle: &str| match c.generate() {
            Err(ManagerError::Config(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{other:?}"),
        };
        let base = SyntheticChat::default();
        refused(
            SyntheticChat {
                conversations: 0,
                ..base.clone()
            },
            "at least one conversation",
        );
        refused(
            SyntheticChat {
                conversations: u32::MAX,
                ..base.clone()
            },
            "MiB cap",
        );
        refused(
            SyntheticChat {
                conversations: 64,
                max_turns: u32::MAX,
                ..base.clone()
            },
            "MiB cap",
        );
        refused(
            SyntheticChat {
                think_time_s: f64::NAN,
                ..base.clone()
            },
            "think_time_s",
        );
        refused(
            SyntheticChat {
                conversation_gap_s: -1.0,
                ..base.clone()
            },
            "conversation_gap_s",
        );
        // The cap sits well above the default workload and is a real bound: the largest
        // accepted workload at the default turns is close to it.
        let one = SyntheticChat {
            conversations: 1,
            ..base.clone()
        };
        let fits = (SyntheticChat::MAX_TRACE_BYTES / one.worst_case_bytes().unwrap()) as u32;
        assert!(fits > 50_000, "{fits}");
        let at_cap = SyntheticChat {
            conversations: fits,
            ..base.clone()
        };
        at_cap.validate().unwrap();
        refused(
            SyntheticChat {
                conversations: fits + 1,
                ..base
            },
            "MiB cap",
        );
    }
}
