//! The built-in synthetic multi-turn chat workload (no file needed).
//!
//! Conversations start by a Poisson process. Each opens with one of a few shared system
//! prompts; turn `k + 1`'s prompt is turn `k`'s prompt, turn `k`'s output and a new user
//! message, so later turns reuse everything before them. The next turn arrives after the
//! previous answer would have streamed plus a think time. Everything is drawn from one seed.

use super::{Rng, Segment, TAG_OUTPUT, TAG_SYNTH, Trace, TraceRequest};

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
    /// Generates the workload.
    pub fn generate(&self) -> Trace {
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
        Trace {
            name: "synthetic-chat".into(),
            requests,
        }
        .finish()
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
        .generate();
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
        .generate();
        assert_eq!(t, again);
    }
}
