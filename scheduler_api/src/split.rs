//! One device budget for a hybrid model's full-attention KV pool and its Mamba state slot
//! pool, split by each Mamba policy's own rule.
//!
//! Comparing two Mamba policies at equal *per-pool* bytes shows the policy effect alone; a
//! deployment has one amount of device memory, and each design decides how much of it the
//! states get. [`PoolBudgets::total_bytes`](crate::config::PoolBudgets::total_bytes) gives that
//! amount, and [`split_total`] turns it into a KV pool and a slot pool:
//!
//! - [`SplitRule::Sglang`], the baseline's: SGLang's `--mamba-full-memory-ratio` `r` (default
//!   [`SGLANG_MAMBA_FULL_MEMORY_RATIO`], 0.9): the state pool gets `total · r / (1 + r)`
//!   bytes, as many whole slots as fit, and the KV pool the rest (SGLang's
//!   `ModelRunner` sizes `max_mamba_cache_size` this way when no size is pinned, then gives
//!   the full-attention pool what the slots leave).
//! - [`SplitRule::Marconi`], the default policy's: the state pool holds
//!   `slots_per_request` slots for each of `running_requests` running requests, and the KV
//!   pool the rest. A running request holds at most [`RequestKv::MAX_MAMBA_SLOTS`] (4) slots
//!   at once — its own state, its tracking slot and the checkpoint slots of its branch point
//!   and prompt end — and the states Marconi admits are exactly those it leaves behind; so
//!   with 4 slots per running request the running batch is never state-bound, and every
//!   cached state beyond the running batch's competes for its slot through Marconi's FLOPs
//!   per byte eviction. Marconi (MLSys 2025) manages states and KV under one byte budget
//!   and only admits states where reuse is likely, so it has no use for a state pool sized
//!   for one state per page boundary of every cached prefix; every byte not needed for
//!   states goes to the KV, which is what the states make usable. The rule is the
//!   geometry's slot bytes times a count from the configuration only: nothing in it is
//!   fitted to a workload.
//!
//! The split is static: a state pool that runs short evicts states, a KV pool that runs short
//! evicts KV, and neither lends bytes to the other.
//!
//! [`RequestKv::MAX_MAMBA_SLOTS`]: radixkv_radix::RequestKv::MAX_MAMBA_SLOTS

/// SGLang's default `--mamba-full-memory-ratio` (`server_args.py`): the state pool's bytes
/// over the full-attention KV pool's.
pub const SGLANG_MAMBA_FULL_MEMORY_RATIO: f64 = 0.9;

/// The slots per running request the Marconi-style split provisions by default: the most a
/// running request holds at once ([`radixkv_radix::RequestKv::MAX_MAMBA_SLOTS`]).
pub const MARCONI_SLOTS_PER_REQUEST: u32 = radixkv_radix::RequestKv::MAX_MAMBA_SLOTS as u32;

/// How [`split_total`] divides the total bytes (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum SplitRule {
    /// SGLang's ratio split: states get `total · r / (1 + r)`, rounded down to whole slots.
    Sglang {
        /// `r`, the state bytes over the KV bytes (finite, positive).
        mamba_full_memory_ratio: f64,
    },
    /// The Marconi-style split: `running_requests × slots_per_request` slots, the rest KV.
    Marconi {
        /// Requests that run at once (at least 1).
        running_requests: usize,
        /// Slots provisioned per running request (at least 1; the pool needs at least 2).
        slots_per_request: u32,
    },
}

/// The two pools [`split_total`] made from one total.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HybridSplit {
    /// Full-attention KV pages.
    pub kv_pages: u64,
    /// Their tokens (`kv_pages × page_size`).
    pub kv_tokens: usize,
    /// Their bytes.
    pub kv_bytes: u64,
    /// Mamba state slots.
    pub mamba_slots: u64,
    /// Their bytes (`mamba_slots × slot_bytes`): the Mamba budget that yields exactly them.
    pub mamba_bytes: u64,
}

/// Why [`split_total`] refused a total.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SplitError {
    /// A total of zero bytes.
    #[error("pools.total_bytes is 0: a hybrid model needs a KV pool and a Mamba state pool")]
    ZeroTotal,
    /// A page or slot size of zero (an invalid geometry).
    #[error("a KV page or a Mamba slot of 0 bytes cannot be budgeted")]
    ZeroSize,
    /// `mamba_full_memory_ratio` not finite and positive.
    #[error("mamba_full_memory_ratio must be finite and positive")]
    BadRatio,
    /// A Marconi split for no running request, or one that provisions fewer than 2 slots (a
    /// hit holds the cached state and the request's copy of it).
    #[error(
        "the Marconi split provisions {slots} state slots ({running_requests} running requests \
         × {slots_per_request}); it needs at least 2"
    )]
    TooFewSlots {
        /// The running requests given.
        running_requests: usize,
        /// The slots per request given.
        slots_per_request: u32,
        /// Their product (saturating).
        slots: u64,
    },
    /// A total too small for the state slots the rule needs (the running batch's, or 2)
    /// plus one KV page.
    #[error(
        "pools.total_bytes = {total} is too small: the {policy} split needs at least {need} \
         bytes ({slots} state slots and one KV page)"
    )]
    TooSmall {
        /// The rule (`"sglang"`, `"marconi"`).
        policy: &'static str,
        /// The total given.
        total: u64,
        /// The smallest total the rule accepts (saturating at `u64::MAX`).
        need: u64,
        /// The slots the rule needs.
        slots: u64,
    },
    /// A byte or token count that overflows 64 bits or the address space.
    #[error("the split of pools.total_bytes overflows a 64-bit count ({what})")]
    Overflow {
        /// The count.
        what: &'static str,
    },
}

/// Splits `total` device bytes into full-attention KV pages of `page_bytes` bytes (of
/// `page_size` tokens) and Mamba state slots of `slot_bytes` bytes, by `rule` (see the module
/// docs). Bytes that fill no whole page or slot are left unused.
///
/// # Errors
/// [`SplitError::ZeroTotal`], [`SplitError::ZeroSize`], [`SplitError::BadRatio`],
/// [`SplitError::TooFewSlots`]; [`SplitError::TooSmall`] when the rule's slots and one KV
/// page do not fit; [`SplitError::Overflow`].
pub fn split_total(
    total: u64,
    page_bytes: u64,
    page_size: usize,
    slot_bytes: u64,
    rule: SplitRule,
) -> Result<HybridSplit, SplitError> {
    if total == 0 {
        return Err(SplitError::ZeroTotal);
    }
    if page_bytes == 0 || slot_bytes == 0 || page_size == 0 {
        return Err(SplitError::ZeroSize);
    }
    let (policy, slots) = match rule {
        SplitRule::Sglang {
            mamba_full_memory_ratio: r,
        } => {
            if !r.is_finite() || r <= 0.0 {
                return Err(SplitError::BadRatio);
            }
            // Whole slots of total · r / (1 + r); f64 rounding can only cost a slot.
            let budget = (total as f64) * (r / (1.0 + r));
            let slots = (budget / slot_bytes as f64).floor();
            let slots = if slots >= u64::MAX as f64 {
                u64::MAX
            } else {
                slots as u64
            };
            if slots < 2 {
                // The least total whose share fits 2 slots, plus a page.
                let need = (2.0 * slot_bytes as f64 * (1.0 + r) / r).ceil() + page_bytes as f64;
                let need = if need >= u64::MAX as f64 {
                    u64::MAX
                } else {
                    need as u64
                };
                return Err(SplitError::TooSmall {
                    policy: "sglang",
                    total,
                    need,
                    slots: 2,
                });
            }
            ("sglang", slots)
        }
        SplitRule::Marconi {
            running_requests,
            slots_per_request,
        } => {
            let slots = (running_requests as u64).saturating_mul(u64::from(slots_per_request));
            if slots < 2 {
                return Err(SplitError::TooFewSlots {
                    running_requests,
                    slots_per_request,
                    slots,
                });
            }
            ("marconi", slots)
        }
    };
    let mamba_bytes = slots.checked_mul(slot_bytes).ok_or(SplitError::Overflow {
        what: "state slot bytes",
    })?;
    let need = mamba_bytes.saturating_add(page_bytes);
    if total < need {
        return Err(SplitError::TooSmall {
            policy,
            total,
            need,
            slots,
        });
    }
    let kv_pages = (total - mamba_bytes) / page_bytes;
    let kv_bytes = kv_pages * page_bytes;
    let kv_tokens = usize::try_from(kv_pages)
        .ok()
        .and_then(|p| p.checked_mul(page_size))
        .ok_or(SplitError::Overflow { what: "KV tokens" })?;
    Ok(HybridSplit {
        kv_pages,
        kv_tokens,
        kv_bytes,
        mamba_slots: slots,
        mamba_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PAGE: u64 = 16 * 16384; // 16 tokens of 16 KiB
    const SLOT: u64 = 8_716_288;

    fn sglang() -> SplitRule {
        SplitRule::Sglang {
            mamba_full_memory_ratio: SGLANG_MAMBA_FULL_MEMORY_RATIO,
        }
    }

    fn marconi(running: usize) -> SplitRule {
        SplitRule::Marconi {
            running_requests: running,
            slots_per_request: MARCONI_SLOTS_PER_REQUEST,
        }
    }

    #[test]
    fn sglang_split_follows_the_ratio() {
        let total = 32u64 << 30;
        let s = split_total(total, PAGE, 16, SLOT, sglang()).unwrap();
        // 32 GiB · 0.9 / 1.9 = 16,275,754,554 bytes → 1,867 slots of 8,716,288.
        assert_eq!(s.mamba_slots, 1867);
        assert_eq!(s.mamba_bytes, 1867 * SLOT);
        assert_eq!(s.kv_pages, (total - s.mamba_bytes) / PAGE);
        assert_eq!(s.kv_tokens as u64, s.kv_pages * 16);
        assert!(total - s.mamba_bytes - s.kv_bytes < PAGE);
    }

    #[test]
    fn marconi_split_provisions_the_running_batch() {
        let total = 32u64 << 30;
        let s = split_total(total, PAGE, 16, SLOT, marconi(256)).unwrap();
        assert_eq!(s.mamba_slots, 1024);
        assert_eq!(s.mamba_bytes, 1024 * SLOT);
        assert_eq!(s.kv_pages, (total - 1024 * SLOT) / PAGE);
    }

    #[test]
    fn bad_totals_are_typed_errors() {
        assert_eq!(
            split_total(0, PAGE, 16, SLOT, sglang()),
            Err(SplitError::ZeroTotal)
        );
        assert_eq!(
            split_total(1 << 30, 0, 16, SLOT, sglang()),
            Err(SplitError::ZeroSize)
        );
        for r in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let rule = SplitRule::Sglang {
                mamba_full_memory_ratio: r,
            };
            assert_eq!(
                split_total(1 << 30, PAGE, 16, SLOT, rule),
                Err(SplitError::BadRatio)
            );
        }
        // Too small for the running batch: 256 × 4 slots do not fit 1 GiB.
        match split_total(1 << 30, PAGE, 16, SLOT, marconi(256)) {
            Err(SplitError::TooSmall { need, slots, .. }) => {
                assert_eq!(slots, 1024);
                assert_eq!(need, 1024 * SLOT + PAGE);
            }
            other => panic!("expected TooSmall, got {other:?}"),
        }
        // Exactly the slots and one page fit; one byte less does not.
        let need = 1024 * SLOT + PAGE;
        let s = split_total(need, PAGE, 16, SLOT, marconi(256)).unwrap();
        assert_eq!((s.mamba_slots, s.kv_pages), (1024, 1));
        assert!(matches!(
            split_total(need - 1, PAGE, 16, SLOT, marconi(256)),
            Err(SplitError::TooSmall { .. })
        ));
        // SGLang's share too small for 2 slots.
        assert!(matches!(
            split_total(SLOT, PAGE, 16, SLOT, sglang()),
            Err(SplitError::TooSmall { slots: 2, .. })
        ));
        assert!(matches!(
            split_total(1 << 40, PAGE, 16, SLOT, marconi(0)),
            Err(SplitError::TooFewSlots { .. })
        ));
        // Overflow: the slot bytes of the running batch, and tokens past the address space.
        assert_eq!(
            split_total(u64::MAX, PAGE, 16, SLOT, marconi(usize::MAX)),
            Err(SplitError::Overflow {
                what: "state slot bytes"
            })
        );
        assert_eq!(
            split_total(u64::MAX, 1, usize::MAX, SLOT, marconi(1 << 10)),
            Err(SplitError::Overflow { what: "KV tokens" })
        );
    }

    proptest! {
        /// Whatever the rule and the sizes, an accepted split fits the total, holds whole
        /// pages and slots, gives the KV what the slots leave (less than a page unused), and
        /// meets the rule's count; a refused one is a typed error, never a panic.
        #[test]
        fn split_fits_the_total(
            total in 0u64..(1u64 << 46),
            page in 1u64..(1 << 22),
            page_size in 1usize..64,
            slot in 1u64..(1 << 26),
            running in 0usize..600,
            per in 0u32..6,
            ratio in 0.01f64..4.0,
            sg in any::<bool>(),
        ) {
            let rule = if sg {
                SplitRule::Sglang { mamba_full_memory_ratio: ratio }
            } else {
                SplitRule::Marconi { running_requests: running, slots_per_request: per }
            };
            if let Ok(s) = split_total(total, page, page_size, slot, rule) {
                prop_assert!(s.mamba_slots >= 2 && s.kv_pages >= 1);
                prop_assert_eq!(s.mamba_bytes, s.mamba_slots * slot);
                prop_assert_eq!(s.kv_bytes, s.kv_pages * page);
                prop_assert_eq!(s.kv_tokens as u64, s.kv_pages * page_size as u64);
                prop_assert!(s.mamba_bytes + s.kv_bytes <= total);
                prop_assert!(total - s.mamba_bytes - s.kv_bytes < page);
                match rule {
                    SplitRule::Marconi { .. } => {
                        prop_assert_eq!(s.mamba_slots, running as u64 * u64::from(per));
                    }
                    SplitRule::Sglang { mamba_full_memory_ratio: r } => {
                        let share = total as f64 * r / (1.0 + r);
                        // Whole slots of the share: at most one slot off for f64 rounding.
                        prop_assert!(s.mamba_bytes as f64 <= share + slot as f64);
                        prop_assert!(s.mamba_bytes as f64 + 2.0 * slot as f64 > share);
                    }
                }
            }
        }
    }
}
