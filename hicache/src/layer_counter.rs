//! [`LayerDoneCounter`]: lets the forward pass of layer `i` wait only for layer `i`'s load.
//!
//! A pipelined load records one event per layer. The counter keeps a small ring of producers
//! (one per load batch) so the next batch's loads can be prepared while one is in flight; the
//! forward pass names the batch it runs (`set_consumer`) and waits per layer (`wait_until`).
//! A batch may also wait for loads started by earlier batches that are still in flight (a
//! prefix they load can be matched by this batch's requests), so a layer holds several events.

use std::sync::Mutex;

use crate::backend::CopyEvent;
use crate::error::Result;

/// Producers in the ring: one batch in flight, one being prepared, one draining.
pub const PRODUCER_RING: usize = 3;

#[derive(Debug)]
struct Ring<E> {
    slots: Vec<Vec<Vec<E>>>,
    next: usize,
    consumer: Option<usize>,
}

/// Per-layer load completion for a ring of [`PRODUCER_RING`] producers. Thread-safe: the cache
/// thread produces, the forward pass (any thread) consumes.
#[derive(Debug)]
pub struct LayerDoneCounter<E> {
    layers: usize,
    ring: Mutex<Ring<E>>,
}

impl<E: CopyEvent> LayerDoneCounter<E> {
    /// A counter for `layers` layers.
    pub fn new(layers: usize) -> Self {
        LayerDoneCounter {
            layers,
            ring: Mutex::new(Ring {
                slots: (0..PRODUCER_RING)
                    .map(|_| (0..layers).map(|_| Vec::new()).collect())
                    .collect(),
                next: 0,
                consumer: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring<E>> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Layers tracked.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Claims the next producer slot for a new load batch and returns its index. Waits for the
    /// slot's previous batch first (it is [`PRODUCER_RING`] batches old), so events are never
    /// overwritten while someone could still wait on them. A failure of that old batch was
    /// reported to its own waiters and acks, so it does not fail the new batch.
    ///
    /// # Errors
    /// None today; kept fallible for backends whose waits can fail to complete.
    pub fn update_producer(&self) -> Result<usize> {
        let (idx, old) = {
            let mut r = self.lock();
            let idx = r.next;
            r.next = (idx + 1) % PRODUCER_RING;
            let old: Vec<E> = r.slots[idx].iter_mut().flat_map(std::mem::take).collect();
            (idx, old)
        };
        for e in old {
            // Only completion matters here; see above.
            let _ = e.wait();
        }
        Ok(idx)
    }

    /// Adds an event that must complete before `producer`'s `layer` may be read.
    pub(crate) fn add_event(&self, producer: usize, layer: usize, ev: E) {
        let mut r = self.lock();
        if let Some(slot) = r.slots.get_mut(producer).and_then(|s| s.get_mut(layer)) {
            slot.push(ev);
        }
    }

    fn events(&self, producer: Option<usize>, layer: usize) -> Vec<E> {
        let r = self.lock();
        producer
            .and_then(|p| r.slots.get(p))
            .and_then(|s| s.get(layer))
            .cloned()
            .unwrap_or_default()
    }

    /// Selects the batch the forward pass runs (the index `update_producer` returned).
    pub fn set_consumer(&self, producer: usize) {
        self.lock().consumer = Some(producer % PRODUCER_RING);
    }

    /// Blocks until the consumer batch's load of `layer` is complete. Returns at once when no
    /// consumer is set or the batch loads nothing for that layer.
    ///
    /// # Errors
    /// A failed copy.
    pub fn wait_until(&self, layer: usize) -> Result<()> {
        let consumer = self.lock().consumer;
        wait_all(&self.events(consumer, layer))
    }

    /// Blocks until `producer`'s load of `layer` is complete.
    ///
    /// # Errors
    /// A failed copy.
    pub fn wait_layer(&self, producer: usize, layer: usize) -> Result<()> {
        wait_all(&self.events(Some(producer), layer))
    }

    /// The events `producer`'s `layer` waits for (empty when it loads nothing for that
    /// layer). An engine makes its compute stream wait on them on the device (with the
    /// `cuda` feature, `CudaCopyEvent::make_stream_wait`) instead of blocking the CPU in [`LayerDoneCounter::wait_until`].
    pub fn layer_events(&self, producer: usize, layer: usize) -> Vec<E> {
        self.events(Some(producer), layer)
    }

    /// True when `producer`'s load of `layer` is complete (or there is none).
    pub fn is_layer_done(&self, producer: usize, layer: usize) -> bool {
        self.lock()
            .slots
            .get(producer)
            .and_then(|s| s.get(layer))
            .is_none_or(|evs| evs.iter().all(CopyEvent::is_complete))
    }
}

/// Waits for every event (all of them, even after a failure); the first failure is the result.
pub(crate) fn wait_all<E: CopyEvent>(evs: &[E]) -> Result<()> {
    let mut res = Ok(());
    for e in evs {
        res = res.and(e.wait());
    }
    res
}
