//! The cost model that turns a step's work into simulated time.
//!
//! A step's compute is `prefill tokens × prefill cost + decode base + decode seqs × per-seq
//! cost`. Host→device loads run layer by layer beside it: layer `i`'s forward waits only for
//! layer `i`'s load, so with `L` layers, compute `c` and transfer `x` the step takes
//! `L · max(c, x) / L + min(c, x) / L` (the pipeline's fill plus its slower stage), which is
//! `c` when nothing is loaded and `x + c / L` when the copy dominates.
//!
//! With a storage tier, the pages a step's admissions took from the store were read from it at
//! `storage_gbps` before the step: a stored page holds every layer, so the read is charged in
//! full, before the layer-pipelined part (a conservative model: a real prefetch overlaps the
//! request's wait in the queue).

use serde::{Deserialize, Serialize};

/// Simulated costs. Defaults describe an 8B-class model on one modern GPU.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Prefill cost per recomputed token (µs).
    pub prefill_us_per_token: f64,
    /// Fixed cost of a step that decodes (µs).
    pub decode_step_us: f64,
    /// Extra decode cost per running sequence (µs).
    pub decode_us_per_seq: f64,
    /// Host↔device bandwidth (GB/s).
    pub transfer_gbps: f64,
    /// Storage→host read bandwidth of the storage tier (GB/s; default 5, a local NVMe SSD).
    pub storage_gbps: f64,
    /// Layers the transfer is pipelined over.
    pub layers: u32,
    /// Effective prefill throughput (TFLOP/s) for a model whose geometry has a compute shape
    /// (`[model.compute]`): a prefill chunk then costs its FLOPs (attention to everything
    /// before it included, see `ModelGeometry::prefill_flops`) at this rate, instead of
    /// `prefill_us_per_token` per token. The default is the rate at which an 8B dense model's
    /// ~16 GFLOP per token costs the default 12 µs.
    pub prefill_tflops: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            prefill_us_per_token: 12.0,
            decode_step_us: 12_000.0,
            decode_us_per_seq: 40.0,
            transfer_gbps: 25.0,
            storage_gbps: 5.0,
            layers: 32,
            prefill_tflops: 1333.0,
        }
    }
}

impl CostModel {
    /// Compute time of a step (µs).
    pub fn compute_us(&self, prefill_tokens: usize, decode_seqs: usize) -> f64 {
        self.prefill_us(prefill_tokens) + self.decode_us(decode_seqs)
    }

    /// Prefill time of `tokens` tokens at `prefill_us_per_token` (µs).
    pub fn prefill_us(&self, tokens: usize) -> f64 {
        tokens as f64 * self.prefill_us_per_token
    }

    /// Prefill time of `flops` FLOPs at `prefill_tflops` (µs); 0 for a rate that is not
    /// positive.
    pub fn prefill_us_of_flops(&self, flops: f64) -> f64 {
        if self.prefill_tflops > 0.0 {
            // 1 TFLOP/s = 1e6 FLOP per µs.
            flops / (self.prefill_tflops * 1e6)
        } else {
            0.0
        }
    }

    /// Decode time of a step decoding `seqs` sequences (µs; 0 without any).
    fn decode_us(&self, seqs: usize) -> f64 {
        if seqs > 0 {
            self.decode_step_us + self.decode_us_per_seq * seqs as f64
        } else {
            0.0
        }
    }

    /// Transfer time of `bytes` (µs).
    pub fn transfer_us(&self, bytes: u64) -> f64 {
        if self.transfer_gbps <= 0.0 {
            return 0.0;
        }
        bytes as f64 / (self.transfer_gbps * 1e3)
    }

    /// Read time of `bytes` from the storage tier (µs).
    pub fn storage_us(&self, bytes: u64) -> f64 {
        if self.storage_gbps <= 0.0 {
            return 0.0;
        }
        bytes as f64 / (self.storage_gbps * 1e3)
    }

    /// Time of a whole step (µs) with `load_bytes` loaded layer by layer beside the compute.
    pub fn step_us(&self, prefill_tokens: usize, decode_seqs: usize, load_bytes: u64) -> f64 {
        self.step_us_of(self.prefill_us(prefill_tokens), decode_seqs, load_bytes)
    }

    /// [`CostModel::step_us`] with the prefill time already known (`prefill_us`, e.g. from
    /// [`CostModel::prefill_us_of_flops`]).
    pub fn step_us_of(&self, prefill_us: f64, decode_seqs: usize, load_bytes: u64) -> f64 {
        let c = prefill_us + self.decode_us(decode_seqs);
        let x = self.transfer_us(load_bytes);
        if x == 0.0 {
            return c;
        }
        let l = f64::from(self.layers.max(1));
        c.max(x) + c.min(x) / l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_hides_the_smaller_stage_but_one_layer() {
        let m = CostModel {
            prefill_us_per_token: 1.0,
            decode_step_us: 0.0,
            decode_us_per_seq: 0.0,
            transfer_gbps: 1.0,
            storage_gbps: 0.5,
            layers: 10,
            prefill_tflops: 1.0,
        };
        assert_eq!(m.step_us(100, 0, 0), 100.0);
        // 1 GB/s: 1000 bytes per µs.
        assert_eq!(m.transfer_us(50_000), 50.0);
        assert_eq!(m.step_us(100, 0, 50_000), 105.0);
        assert_eq!(m.step_us(10, 0, 100_000), 101.0);
        assert!(m.step_us(0, 3, 0) == 0.0);
        // 1 TFLOP/s: 1e6 FLOPs per µs.
        assert_eq!(m.prefill_us_of_flops(5e6), 5.0);
        assert_eq!(m.step_us_of(5.0, 0, 0), 5.0);
        // 0.5 GB/s: 500 bytes per µs.
        assert_eq!(m.storage_us(50_000), 100.0);
    }
}
