//! The children of a node: inline up to a few, then an open-addressing table keyed by the
//! child's first-page hash.
//!
//! The table removes lazily: an evicted child's entry stays behind and is recognised as stale
//! by its generation (the arena bumps a slot's generation when it frees it). Eviction therefore
//! never probes a random bucket of a large fan-out table — the cost that dominates eviction
//! from a root with a million children — and the stale entries are dropped by a sequential
//! rebuild once they outnumber the live ones (amortised `O(1)` per removal).
//!
//! Why not `hashbrown::HashTable`: measured in the radix benches (callgrind, per 1,000
//! evictions from 1M single-page leaves), the same lazy scheme on a `HashTable` runs as many
//! instructions (524.6K against 523.0K) but misses the simulated last-level cache 22% more
//! often (3,839 against 3,134) and took 1.33× the time on the wall clock (median of four
//! interleaved runs, range 0.82–1.39×); removing each evicted child from the `HashTable`, its
//! ordinary use, costs 13% more instructions and 5.4× the time (4.0–8.5×) — the random probe
//! this table exists to avoid. Match and insert were equal within 1%.

use smallvec::SmallVec;

pub(super) const NIL: u32 = u32::MAX;
/// Children are kept inline (scanned, loading each child) up to this many, then move to a
/// table (probed by hash). 4 is what a `union` `SmallVec` of `u32` holds in the 16 bytes its
/// heap pointer and length take anyway, so the node does not grow; 8 inline would add 16 bytes
/// to every node. Measured with callgrind on `match_fanout` (six children per node, 46,656
/// leaves): 4 costs 2,948 instructions and 55 L1 data misses per match against 2,962 and 70
/// for 8 inline (and 2,974 and 74 for the former 8 over a 4-slot `SmallVec`, which spilled to
/// the heap between 5 and 8); every other bench group is unchanged within 1%.
const INLINE_CHILDREN: usize = 4;

#[derive(Copy, Clone, Debug)]
pub(super) struct Slot {
    pub(super) hash: u64,
    pub(super) idx: u32,
    pub(super) generation: u32,
}

const EMPTY: Slot = Slot {
    hash: 0,
    idx: NIL,
    generation: 0,
};

#[derive(Debug)]
pub(super) struct ChildTable {
    slots: Box<[Slot]>,
    /// Live children.
    live: usize,
    /// Occupied slots (live + stale).
    used: usize,
}

impl ChildTable {
    fn with_capacity(n: usize) -> Self {
        let cap = (n * 2).next_power_of_two().max(16);
        ChildTable {
            slots: vec![EMPTY; cap].into_boxed_slice(),
            live: 0,
            used: 0,
        }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Probes for `hash`; `is_live(idx, generation)` filters stale entries and `matches(idx)`
    /// confirms a live candidate (the first page really is equal).
    #[inline]
    pub(super) fn find(
        &self,
        hash: u64,
        is_live: impl Fn(u32, u32) -> bool,
        matches: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let s = self.slots[i];
            if s.idx == NIL {
                return None;
            }
            if s.hash == hash && is_live(s.idx, s.generation) && matches(s.idx) {
                return Some(s.idx);
            }
            i = (i + 1) & mask;
        }
    }

    fn put(&mut self, slot: Slot) {
        let mask = self.mask();
        let mut i = slot.hash as usize & mask;
        while self.slots[i].idx != NIL {
            i = (i + 1) & mask;
        }
        self.slots[i] = slot;
        self.used += 1;
    }

    /// Points the live entry of `old` at `new` (same first page, so same hash).
    fn replace(&mut self, hash: u64, old: u32, old_gen: u32, new: u32, new_gen: u32) {
        let mask = self.mask();
        let mut i = hash as usize & mask;
        while self.slots[i].idx != NIL {
            let s = &mut self.slots[i];
            if s.idx == old && s.generation == old_gen {
                s.idx = new;
                s.generation = new_gen;
                return;
            }
            i = (i + 1) & mask;
        }
        debug_assert!(false, "child {old} not found for replacement");
    }

    /// Live entries, by `is_live`.
    pub(super) fn live_entries<'a>(
        &'a self,
        is_live: impl Fn(u32, u32) -> bool + 'a,
    ) -> impl Iterator<Item = Slot> + 'a {
        self.slots
            .iter()
            .copied()
            .filter(move |s| s.idx != NIL && is_live(s.idx, s.generation))
    }

    fn rebuild(&mut self, is_live: impl Fn(u32, u32) -> bool, extra: usize) {
        let mut fresh = ChildTable::with_capacity(self.live + extra);
        for s in self
            .slots
            .iter()
            .filter(|s| s.idx != NIL && is_live(s.idx, s.generation))
        {
            fresh.put(*s);
        }
        fresh.live = fresh.used;
        debug_assert_eq!(fresh.live, self.live);
        *self = fresh;
    }
}

#[derive(Debug)]
pub(super) enum Children {
    Inline(SmallVec<[u32; INLINE_CHILDREN]>),
    Table(Box<ChildTable>),
}

impl Default for Children {
    fn default() -> Self {
        Children::Inline(SmallVec::new())
    }
}

impl Children {
    /// Number of live children.
    pub(super) fn len(&self) -> usize {
        match self {
            Children::Inline(v) => v.len(),
            Children::Table(t) => t.live,
        }
    }

    /// Adds a child. `hash_of(idx)` gives an existing child's hash when spilling to a table.
    pub(super) fn add(
        &mut self,
        child: Slot,
        hash_of: impl Fn(u32) -> (u64, u32),
        is_live: impl Fn(u32, u32) -> bool,
    ) {
        match self {
            Children::Inline(v) if v.len() < INLINE_CHILDREN => v.push(child.idx),
            Children::Inline(v) => {
                let mut t = ChildTable::with_capacity(INLINE_CHILDREN * 2);
                for &c in v.iter() {
                    let (hash, generation) = hash_of(c);
                    t.put(Slot {
                        hash,
                        idx: c,
                        generation,
                    });
                }
                t.put(child);
                t.live = t.used;
                *self = Children::Table(Box::new(t));
            }
            Children::Table(t) => {
                if (t.used + 1) * 8 > t.slots.len() * 7 {
                    t.rebuild(&is_live, 1);
                }
                t.put(child);
                t.live += 1;
            }
        }
    }

    /// Removes a child. Tables only count it out: its entry turns stale once the arena frees
    /// the child (the caller's contract), and stale entries are dropped by the rebuild that the
    /// next `add` into a full table triggers (which also shrinks a table that emptied).
    pub(super) fn remove(&mut self, child: u32) {
        match self {
            Children::Inline(v) => {
                if let Some(pos) = v.iter().position(|&c| c == child) {
                    v.swap_remove(pos);
                }
            }
            Children::Table(t) => t.live -= 1,
        }
    }

    /// Re-points `old`'s entry at `new` (a split inserted `new` above `old`).
    pub(super) fn replace(&mut self, hash: u64, old: (u32, u32), new: (u32, u32)) {
        match self {
            Children::Inline(v) => {
                for c in v.iter_mut() {
                    if *c == old.0 {
                        *c = new.0;
                    }
                }
            }
            Children::Table(t) => t.replace(hash, old.0, old.1, new.0, new.1),
        }
    }
}
