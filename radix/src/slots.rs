//! A fixed-size pool of state slots: the bookkeeping of the Mamba state pool.
//!
//! One slot holds the recurrent state of every Mamba layer of the model for one sequence
//! position (conv + SSM state). The crate never touches the bytes; it only keeps track of which
//! slot ids are free, held by a tree node (a cached checkpoint) or held by a request (its
//! running state), exactly as [`crate::PageAllocator`] does for KV pages. The state byte per slot
//! makes a double free or a free of a tree-held slot a typed error.

use crate::alloc::{try_filled, try_with_capacity};
use crate::ensure_inv;
use crate::error::InvariantViolation;
use crate::error::{CacheError, Result};

/// Where one state slot is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// In the pool's free list.
    Free,
    /// A checkpoint held by a tree node.
    Tree,
    /// The running state of a request (or a copy-on-write destination handed to one).
    Request,
}

/// A fixed number of state slots, each [`SlotState::Free`], [`SlotState::Tree`] or
/// [`SlotState::Request`].
#[derive(Debug, Clone)]
pub struct StateSlotPool {
    states: Vec<SlotState>,
    free: Vec<u32>,
    tree: usize,
    request: usize,
}

impl StateSlotPool {
    /// A pool of `total` free slots.
    ///
    /// # Errors
    /// [`CacheError::Config`] for 0 slots or a pool the allocator cannot provide.
    pub fn new(total: u32) -> Result<Self> {
        if total == 0 {
            return Err(CacheError::Config(
                "a state slot pool needs at least one slot".into(),
            ));
        }
        let states = try_filled(total as usize, SlotState::Free, "the state slot pool")?;
        let mut free = try_with_capacity(total as usize, "the state slot free list")?;
        // Pop order hands out slot 0 first.
        free.extend((0..total).rev());
        Ok(StateSlotPool {
            states,
            free,
            tree: 0,
            request: 0,
        })
    }

    /// Slots in the pool.
    pub fn total(&self) -> usize {
        self.states.len()
    }

    /// Free slots.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Slots held by tree nodes.
    pub fn tree_slots(&self) -> usize {
        self.tree
    }

    /// Slots held by requests.
    pub fn request_slots(&self) -> usize {
        self.request
    }

    /// The state of `slot`.
    ///
    /// # Errors
    /// [`CacheError::SlotOutOfRange`].
    pub fn state(&self, slot: u32) -> Result<SlotState> {
        self.states
            .get(slot as usize)
            .copied()
            .ok_or(CacheError::SlotOutOfRange {
                slot,
                total: self.states.len(),
            })
    }

    /// Takes a free slot for a request, or `None` when none is free (the owner evicts and
    /// retries).
    pub(crate) fn alloc_request(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        self.states[s as usize] = SlotState::Request;
        self.request += 1;
        Some(s)
    }

    /// Returns a request's slot to the free list.
    ///
    /// # Errors
    /// [`CacheError::SlotOutOfRange`]; [`CacheError::SlotState`] when the slot is not held by a
    /// request (a double free, or a tree-held slot). Nothing changes on error.
    pub fn free_request(&mut self, slot: u32) -> Result<()> {
        self.expect(slot, SlotState::Request, "held by a request")?;
        self.states[slot as usize] = SlotState::Free;
        self.request -= 1;
        self.free.push(slot);
        Ok(())
    }

    /// Hands a request's slot to the tree.
    pub(crate) fn request_to_tree(&mut self, slot: u32) -> Result<()> {
        self.expect(slot, SlotState::Request, "held by a request")?;
        self.states[slot as usize] = SlotState::Tree;
        self.request -= 1;
        self.tree += 1;
        Ok(())
    }

    /// Frees a tree-held slot (its node lost the state).
    pub(crate) fn free_tree(&mut self, slot: u32) -> Result<()> {
        self.expect(slot, SlotState::Tree, "held by the tree")?;
        self.states[slot as usize] = SlotState::Free;
        self.tree -= 1;
        self.free.push(slot);
        Ok(())
    }

    fn expect(&self, slot: u32, want: SlotState, expected: &'static str) -> Result<()> {
        if self.state(slot)? == want {
            Ok(())
        } else {
            Err(CacheError::SlotState { slot, expected })
        }
    }

    /// Audits the pool: the free list holds exactly the free slots, once each, and the counters
    /// match the state bytes.
    pub fn check(&self) -> std::result::Result<(), InvariantViolation> {
        let mut seen = vec![false; self.states.len()];
        for &s in &self.free {
            let i = s as usize;
            ensure_inv!(
                i < self.states.len() && self.states[i] == SlotState::Free && !seen[i],
                "state slot {s} is in the free list twice or is not free"
            );
            seen[i] = true;
        }
        let count = |w: SlotState| self.states.iter().filter(|&&s| s == w).count();
        ensure_inv!(
            count(SlotState::Free) == self.free.len(),
            "state slots: {} free, free list holds {}",
            count(SlotState::Free),
            self.free.len()
        );
        ensure_inv!(
            count(SlotState::Tree) == self.tree && count(SlotState::Request) == self.request,
            "state slot counters (tree {}, request {}) disagree with the slots",
            self.tree,
            self.request
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_move_between_states_and_double_frees_are_typed() {
        assert!(StateSlotPool::new(0).is_err());
        let mut p = StateSlotPool::new(2).unwrap();
        let a = p.alloc_request().unwrap();
        let b = p.alloc_request().unwrap();
        assert_eq!((a, b), (0, 1));
        assert_eq!(p.alloc_request(), None);
        p.request_to_tree(a).unwrap();
        assert_eq!(
            p.free_request(a),
            Err(CacheError::SlotState {
                slot: a,
                expected: "held by a request"
            })
        );
        p.free_request(b).unwrap();
        assert!(p.free_request(b).is_err(), "double free");
        assert_eq!(
            p.free_request(9),
            Err(CacheError::SlotOutOfRange { slot: 9, total: 2 })
        );
        p.free_tree(a).unwrap();
        assert!(p.free_tree(a).is_err());
        assert_eq!(
            (p.available(), p.tree_slots(), p.request_slots()),
            (2, 0, 0)
        );
        p.check().unwrap();
    }
}
