//! The simulated hardware, models and cluster: every figure the time model uses, with its
//! source in `docs/SIMULATION.md`.
//!
//! Units are carried in names (`_bytes`, `_us`, `_s`, `_bytes_per_s`). Simulated time is in
//! whole microseconds ([`SimTime`](super::events::SimTime)); the models are computed in `f64`
//! seconds and rounded up to the next microsecond once per event.

use serde::Serialize;

/// One served model as the time model sees it: its KV footprint, weights and iteration cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// A short name for tables and plots (`qwen3-14b`).
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads (grouped-query attention).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per KV element (2 for bf16).
    pub dtype_bytes: u32,
    /// Weights in bytes (what a restarted worker reloads).
    pub weights_bytes: u64,
    /// GPUs one worker spans (tensor parallel degree).
    pub tensor_parallel: u32,
    /// Iteration floor: the time of an iteration however few tokens it carries.
    pub iter_floor_s: f64,
    /// Fixed part of the linear iteration cost.
    pub iter_base_s: f64,
    /// Per-token part of the linear iteration cost.
    pub iter_per_token_s: f64,
    /// Weights of the small draft model a recovering worker loads first (Lumen's
    /// LOADING_DRAFT phase), in bytes.
    pub draft_weights_bytes: u64,
}

impl ModelConfig {
    /// Qwen3-14B on one H100-class GPU: 40 layers, 8 KV heads, head dim 128, bf16
    /// (163,840 bytes of KV per token), about 29.5 GB of weights;
    /// iteration `max(10.8 ms, 0.042 ms x tokens)`.
    pub fn qwen3_14b() -> Self {
        ModelConfig {
            name: "qwen3-14b",
            layers: 40,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            weights_bytes: 29_500_000_000,
            tensor_parallel: 1,
            iter_floor_s: 10.8e-3,
            iter_base_s: 0.0,
            iter_per_token_s: 0.042e-3,
            draft_weights_bytes: 1_200_000_000,
        }
    }

    /// Qwen3-32B on two H100-class GPUs (tensor parallel 2): 64 layers, 8 KV heads, head dim
    /// 128, bf16 (262,144 bytes of KV per token), about 65.5 GB of weights; iteration
    /// `max(13.1 ms, 5.0 ms + 0.048 ms x tokens)`.
    pub fn qwen3_32b() -> Self {
        ModelConfig {
            name: "qwen3-32b",
            layers: 64,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            weights_bytes: 65_500_000_000,
            tensor_parallel: 2,
            iter_floor_s: 13.1e-3,
            iter_base_s: 5.0e-3,
            iter_per_token_s: 0.048e-3,
            draft_weights_bytes: 1_200_000_000,
        }
    }

    /// KV bytes per token: K and V, every layer, every KV head.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

/// The hardware of one worker (all its GPUs together) and of the links around it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HardwareConfig {
    /// HBM memory per GPU, bytes.
    pub hbm_bytes_per_gpu: u64,
    /// The share of HBM the engine may use (weights + KV + activations), like vLLM's
    /// `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// Effective HBM bandwidth per GPU, bytes/s (decode attention reads every context's KV).
    pub hbm_bytes_per_s: f64,
    /// Host-to-device copy bandwidth (PCIe), bytes/s, per worker.
    pub pcie_h2d_bytes_per_s: f64,
    /// Network bandwidth per worker, bytes/s (checkpoint streaming, remote restores).
    pub network_bytes_per_s: f64,
    /// Weight reload bandwidth after a restart, bytes/s.
    pub reload_bytes_per_s: f64,
    /// Process and engine initialisation after a restart (CUDA context, graph capture).
    pub reload_init_s: f64,
    /// Time to swap the draft for the full model once loaded (Lumen's HOTSWAP phase).
    pub hotswap_s: f64,
    /// Host memory per worker for checkpoints it holds, bytes.
    pub host_checkpoint_bytes: u64,
    /// Share of a checkpoint's device-to-host copy time that stalls the iteration (the rest
    /// overlaps with compute).
    pub checkpoint_stall_fraction: f64,
    /// Speed-up of a survivor's iterations while a recovering worker assists it with a draft
    /// model (speculative decoding), as a divisor of its iteration time.
    pub assist_speedup: f64,
}

impl HardwareConfig {
    /// H100-class defaults for a model: 80 GB HBM at 2.8 TB/s effective, PCIe 35 GB/s,
    /// network 25 GB/s, reload 1.6 GB/s plus 30 s, and the host checkpoint budget that fits
    /// the model (80 GB for one GPU, 160 GB for two).
    pub fn h100_for(model: &ModelConfig) -> Self {
        HardwareConfig {
            hbm_bytes_per_gpu: 80_000_000_000,
            gpu_memory_utilization: 0.9,
            hbm_bytes_per_s: 2.8e12,
            pcie_h2d_bytes_per_s: 35e9,
            network_bytes_per_s: 25e9,
            reload_bytes_per_s: 1.6e9,
            reload_init_s: 30.0,
            hotswap_s: 1.0,
            host_checkpoint_bytes: 80_000_000_000 * u64::from(model.tensor_parallel),
            checkpoint_stall_fraction: 0.1,
            assist_speedup: 1.3,
        }
    }
}

/// The engine's scheduler limits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineConfig {
    /// Prefill tokens per iteration (chunked prefill, shared by all prefilling requests).
    pub prefill_chunk_tokens: u32,
    /// Requests in one batch at most.
    pub max_batch_requests: u32,
    /// Stream a checkpoint chunk every this many decoded tokens (after the prompt's).
    pub checkpoint_every_tokens: u32,
    /// The output cap a checkpoint reservation assumes (max context = prompt + this).
    pub max_output_tokens: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk_tokens: 512,
            max_batch_requests: 128,
            checkpoint_every_tokens: 16,
            max_output_tokens: 1024,
        }
    }
}

/// Everything one simulated cluster needs except the workload and the failures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterConfig {
    /// Workers (each spans `model.tensor_parallel` GPUs).
    pub workers: u32,
    /// The served model.
    pub model: ModelConfig,
    /// The hardware under it.
    pub hardware: HardwareConfig,
    /// The engine's scheduler.
    pub engine: EngineConfig,
}

impl ClusterConfig {
    /// `workers` workers of `model` on H100-class hardware with default engine settings.
    pub fn new(workers: u32, model: ModelConfig) -> Self {
        let hardware = HardwareConfig::h100_for(&model);
        ClusterConfig {
            workers,
            model,
            hardware,
            engine: EngineConfig::default(),
        }
    }

    /// KV tokens a worker's GPUs hold: usable HBM minus weights, over KV bytes per token.
    pub fn gpu_kv_budget_tokens(&self) -> u64 {
        let hbm = self.hardware.hbm_bytes_per_gpu as f64
            * f64::from(self.model.tensor_parallel)
            * self.hardware.gpu_memory_utilization;
        let free = (hbm - self.model.weights_bytes as f64).max(0.0);
        (free / self.model.kv_bytes_per_token() as f64) as u64
    }

    /// HBM bandwidth of one worker (tensor parallel shards the KV over its GPUs).
    pub fn worker_hbm_bytes_per_s(&self) -> f64 {
        self.hardware.hbm_bytes_per_s * f64::from(self.model.tensor_parallel)
    }

    /// Seconds from a restart to serving the full model again, without Lumen's phases:
    /// initialisation plus loading the weights.
    pub fn reload_s(&self) -> f64 {
        self.hardware.reload_init_s
            + self.model.weights_bytes as f64 / self.hardware.reload_bytes_per_s
    }

    /// Checks the figures make sense before a run.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming the bad field.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |what: &str| Err(crate::Error::InvalidArgument(format!("sim config: {what}")));
        if self.workers < 2 {
            return bad("at least 2 workers are needed (a checkpoint holder is never the server)");
        }
        if self.workers > 4096 {
            return bad("at most 4096 workers");
        }
        if self.engine.prefill_chunk_tokens == 0 || self.engine.max_batch_requests == 0 {
            return bad("prefill chunk and batch cap must be positive");
        }
        if self.engine.checkpoint_every_tokens == 0 {
            return bad("checkpoint_every_tokens must be positive");
        }
        let h = &self.hardware;
        for (name, v) in [
            ("hbm_bytes_per_s", h.hbm_bytes_per_s),
            ("pcie_h2d_bytes_per_s", h.pcie_h2d_bytes_per_s),
            ("network_bytes_per_s", h.network_bytes_per_s),
            ("reload_bytes_per_s", h.reload_bytes_per_s),
            ("assist_speedup", h.assist_speedup),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(&format!("{name} must be a positive number"));
            }
        }
        if self.gpu_kv_budget_tokens() < 16_384 {
            return bad("the GPU KV budget is under 16,384 tokens: the weights do not leave room");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_per_token_match_the_qwen3_configs() {
        assert_eq!(ModelConfig::qwen3_14b().kv_bytes_per_token(), 163_840);
        assert_eq!(ModelConfig::qwen3_32b().kv_bytes_per_token(), 262_144);
    }

    #[test]
    fn the_gpu_kv_budget_is_what_the_weights_leave() {
        let c = ClusterConfig::new(8, ModelConfig::qwen3_14b());
        // 72 GB usable - 29.5 GB weights = 42.5 GB / 163,840 B = 259,399 tokens.
        assert_eq!(c.gpu_kv_budget_tokens(), 259_399);
        let c = ClusterConfig::new(4, ModelConfig::qwen3_32b());
        // 144 GB - 65.5 GB = 78.5 GB / 262,144 B = 299,453 tokens.
        assert_eq!(c.gpu_kv_budget_tokens(), 299_453);
    }

    #[test]
    fn reload_takes_init_plus_weights_over_bandwidth() {
        let c = ClusterConfig::new(8, ModelConfig::qwen3_14b());
        assert!((c.reload_s() - (30.0 + 29.5 / 1.6)).abs() < 1e-9);
    }
}
