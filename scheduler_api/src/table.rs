//! The manager's request table: a slab indexed by the handle itself.
//!
//! Every decode token looks its request up, so the lookup is an index and a generation check
//! instead of a hash; slots are reused (their generation bumps, so a stale handle never finds
//! the new occupant) and entries never move when the table grows past a rehash.
//!
//! A slot holds its value boxed: the table keeps the room of its busiest moment (a backlog of
//! thousands of waiting requests), and a free slot then costs 16 bytes, not a whole record
//! (544 bytes for the manager's).

/// A slab of `T` addressed by `u64` handles: low 32 bits slot index, high 32 bits generation.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    len: usize,
}

#[derive(Debug)]
struct Slot<T> {
    generation: u32,
    value: Option<Box<T>>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

fn split(id: u64) -> (usize, u32) {
    ((id & u64::from(u32::MAX)) as usize, (id >> 32) as u32)
}

impl<T> Table<T> {
    /// The handle the next [`Self::insert`] will return.
    pub(crate) fn next_handle(&self) -> u64 {
        match self.free.last() {
            Some(&i) => (u64::from(self.slots[i as usize].generation) << 32) | u64::from(i),
            None => self.slots.len() as u64,
        }
    }

    /// Stores `value`; returns its handle (never one returned before).
    pub(crate) fn insert(&mut self, value: T) -> u64 {
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                let s = &mut self.slots[i as usize];
                s.value = Some(Box::new(value));
                (u64::from(s.generation) << 32) | u64::from(i)
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    value: Some(Box::new(value)),
                });
                (self.slots.len() - 1) as u64
            }
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<&T> {
        let (i, g) = split(id);
        self.slots
            .get(i)
            .filter(|s| s.generation == g)
            .and_then(|s| s.value.as_deref())
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let (i, g) = split(id);
        self.slots
            .get_mut(i)
            .filter(|s| s.generation == g)
            .and_then(|s| s.value.as_deref_mut())
    }

    /// Takes the value out; its handle is dead from now on.
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        let (i, g) = split(id);
        let s = self.slots.get_mut(i).filter(|s| s.generation == g)?;
        let v = s.value.take()?;
        // A slot whose generation would wrap is retired instead of reused.
        if let Some(next) = s.generation.checked_add(1) {
            s.generation = next;
            self.free.push(i as u32);
        }
        self.len -= 1;
        Some(*v)
    }

    /// Puts a value back under the handle it was removed from (undoing a `remove`).
    pub(crate) fn restore(&mut self, id: u64, value: T) {
        let (i, g) = split(id);
        if let Some(s) = self.slots.get_mut(i)
            && s.value.is_none()
            && s.generation == g.wrapping_add(1)
        {
            s.generation = g;
            s.value = Some(Box::new(value));
            self.free.retain(|&f| f as usize != i);
            self.len += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> + '_ {
        self.slots.iter().filter_map(|s| s.value.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_costs_sixteen_bytes_whatever_its_record() {
        assert_eq!(std::mem::size_of::<Slot<[u8; 544]>>(), 16);
        let mut t = Table::default();
        let ids: Vec<u64> = (0..100u8).map(|i| t.insert([i; 544])).collect();
        assert_eq!(t.get(ids[7]).map(|v| v[0]), Some(7));
        assert_eq!(t.remove(ids[7]).map(|v| v[543]), Some(7));
        assert_eq!(t.len(), 99);
    }

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
}
