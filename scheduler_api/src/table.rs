//! The manager's request table: a slab indexed by the handle itself.
//!
//! Every decode token looks its request up, so the lookup is an index and a generation check
//! instead of a hash; slots are reused (their generation bumps, so a stale handle never finds
//! the new occupant) and entries never move when the table grows past a rehash.
//!
//! Free slots are reused lowest first, so the live entries gather at the front, and
//! [`Table::compact`] cuts the free tail once the table holds at most a quarter of its slots:
//! a drained backlog (thousands of waiting requests, 544 bytes a record in the manager) does
//! not keep its room for the rest of the run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A slab of `T` addressed by `u64` handles: low 32 bits slot index, high 32 bits generation.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Slot<T>>,
    /// Free slots, lowest first.
    free: BinaryHeap<Reverse<u32>>,
    len: usize,
    /// The generation of a slot added from now on: above every generation a cut slot reached
    /// (so a stale handle to a cut slot never finds the slot made in its place).
    floor: u32,
}

#[derive(Debug)]
struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: Vec::new(),
            free: BinaryHeap::new(),
            len: 0,
            floor: 0,
        }
    }
}

fn split(id: u64) -> (usize, u32) {
    ((id & u64::from(u32::MAX)) as usize, (id >> 32) as u32)
}

impl<T> Table<T> {
    /// The handle the next [`Self::insert`] will return.
    pub(crate) fn next_handle(&self) -> u64 {
        match self.free.peek() {
            Some(&Reverse(i)) => {
                (u64::from(self.slots[i as usize].generation) << 32) | u64::from(i)
            }
            None => (u64::from(self.floor) << 32) | self.slots.len() as u64,
        }
    }

    /// Stores `value`; returns its handle (never one returned before).
    pub(crate) fn insert(&mut self, value: T) -> u64 {
        self.len += 1;
        match self.free.pop() {
            Some(Reverse(i)) => {
                let s = &mut self.slots[i as usize];
                s.value = Some(value);
                (u64::from(s.generation) << 32) | u64::from(i)
            }
            None => {
                self.slots.push(Slot {
                    generation: self.floor,
                    value: Some(value),
                });
                (u64::from(self.floor) << 32) | (self.slots.len() - 1) as u64
            }
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<&T> {
        let (i, g) = split(id);
        self.slots
            .get(i)
            .filter(|s| s.generation == g)
            .and_then(|s| s.value.as_ref())
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let (i, g) = split(id);
        self.slots
            .get_mut(i)
            .filter(|s| s.generation == g)
            .and_then(|s| s.value.as_mut())
    }

    /// Takes the value out; its handle is dead from now on.
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        let (i, g) = split(id);
        let s = self.slots.get_mut(i).filter(|s| s.generation == g)?;
        let v = s.value.take()?;
        // A slot whose generation would wrap is retired instead of reused.
        if let Some(next) = s.generation.checked_add(1) {
            s.generation = next;
            self.free.push(Reverse(i as u32));
        }
        self.len -= 1;
        Some(v)
    }

    /// Puts a value back under the handle it was removed from (undoing a `remove`).
    pub(crate) fn restore(&mut self, id: u64, value: T) {
        let (i, g) = split(id);
        if let Some(s) = self.slots.get_mut(i)
            && s.value.is_none()
            && s.generation == g.wrapping_add(1)
        {
            s.generation = g;
            s.value = Some(value);
            self.free.retain(|&Reverse(f)| f as usize != i);
            self.len += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Cuts the free slots at the end when the table holds at most a quarter of its slots and
    /// they are at least half of it. Call it where no removed entry waits to be restored.
    pub(crate) fn compact(&mut self) {
        let n = self.slots.len();
        if n < Self::MIN_COMPACT || self.len * 4 > n {
            return;
        }
        // A retired slot (its generation would wrap) stays: it must never be made again.
        let keep = self
            .slots
            .iter()
            .rposition(|s| s.value.is_some() || s.generation == u32::MAX)
            .map_or(0, |i| i + 1);
        if keep > n / 2 {
            return;
        }
        for s in &self.slots[keep..] {
            self.floor = self.floor.max(s.generation);
        }
        self.slots.truncate(keep);
        self.slots.shrink_to(2 * keep);
        self.free.retain(|&Reverse(i)| (i as usize) < keep);
        self.free.shrink_to_fit();
    }

    /// Tables smaller than this are never compacted (their room costs next to nothing).
    const MIN_COMPACT: usize = 64;

    #[cfg(test)]
    fn slots(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> + '_ {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_handles_never_find_the_new_occupant() {
        let mut t = Table::default();
        let a = t.insert("a");
        assert_eq!(t.next_handle(), 1);
        let b = t.insert("b");
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(t.get(a), None);
        let next = t.next_handle();
        let c = t.insert("c");
        assert_eq!(c, next);
        assert_ne!(c, a);
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(c), Some(&"c"));
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a), None);
        let v = t.remove(b).unwrap();
        t.restore(b, v);
        assert_eq!(t.get(b), Some(&"b"));
        assert_eq!(t.values().count(), 2);
        *t.get_mut(b).unwrap() = "bb";
        assert_eq!(t.get(b), Some(&"bb"));
    }

    #[test]
    fn a_drained_table_gives_back_its_room_and_stale_handles_stay_dead() {
        let mut t = Table::default();
        let ids: Vec<u64> = (0..1000).map(|i| t.insert(i)).collect();
        // Freed slots are reused lowest first.
        t.remove(ids[500]).unwrap();
        t.remove(ids[3]).unwrap();
        let again = t.insert(1003);
        assert_eq!(again & u64::from(u32::MAX), 3);
        // Not a quarter live: nothing is cut.
        for &id in &ids[600..] {
            t.remove(id).unwrap();
        }
        t.compact();
        assert_eq!(t.slots(), 1000);
        // Drained to the first 100 (the backlog served): the tail goes.
        for &id in &ids[100..600] {
            t.remove(id);
        }
        assert_eq!(t.len(), 100);
        t.compact();
        assert_eq!(t.slots(), 100);
        assert_eq!(t.get(again), Some(&1003));
        assert_eq!(t.get(ids[99]), Some(&99));
        // Slots made again in the cut range never answer a handle from before.
        let next = t.next_handle();
        let fresh: Vec<u64> = (0..1000).map(|i| t.insert(2000 + i)).collect();
        assert_eq!(fresh[0], next);
        for (k, &old) in ids[100..].iter().enumerate() {
            assert_eq!(t.get(old), None, "stale handle {k}");
        }
        assert_eq!(t.get(fresh[999]), Some(&2999));
        // A retired slot is never cut (it must not be made again).
        let mut r = Table::default();
        let h: Vec<u64> = (0..200).map(|i| r.insert(i)).collect();
        r.slots[80].generation = u32::MAX;
        let retired = (u64::from(u32::MAX) << 32) | 80;
        assert_eq!(r.remove(retired), Some(80));
        for &id in &h[1..] {
            r.remove(id);
        }
        r.compact();
        assert_eq!(r.slots(), 81);
        assert_eq!(r.get(retired), None);
    }
}
