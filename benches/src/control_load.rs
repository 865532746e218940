//! The loaded controller both recovery-planning benchmarks measure: `kvd-bench plan` (its
//! curves against workers and requests) and the criterion bench `benches/benches/control.rs`
//! (which includes this file by path), so the two always plan over the same state.

use std::time::{Duration, Instant};

use kvd::control::{AdmitRequest, ControlConfig, Controller, PolicyKind};

/// W workers (each with `capacity` bytes) and R decoding requests with checkpoints, admitted
/// round-robin with varied prompts, reservations and timings; `None` past `limit`.
///
/// # Errors
/// The controller's error for the first call that fails (the message names it).
pub fn loaded(
    policy: PolicyKind,
    workers: u32,
    requests: u64,
    capacity: u64,
    limit: Duration,
) -> Result<Option<Controller>, String> {
    let t0 = Instant::now();
    let mut c = Controller::new(ControlConfig {
        policy,
        ..ControlConfig::default()
    })
    .map_err(|e| format!("controller: {e}"))?;
    for w in 0..workers {
        c.add_worker(w, capacity, 0)
            .map_err(|e| format!("add_worker {w}: {e}"))?;
    }
    for id in 0..requests {
        if id % 1024 == 0 && t0.elapsed() > limit {
            return Ok(None);
        }
        let serving = (id % u64::from(workers)) as u32;
        let a = c
            .admit(
                AdmitRequest {
                    request_id: id,
                    serving,
                    prompt_tokens: 512 + (id % 1024) as u32,
                    max_new_tokens: 512,
                    reserve_bytes: (1 << 26) + (id % 97) * (1 << 20),
                    deadline_ms: None,
                },
                id / 10,
            )
            .map_err(|e| format!("admit {id}: {e}"))?;
        let ev = |e: kvd::Error| format!("request {id}: {e}");
        c.prefill_started(id, a.epoch, id / 10 + (id * 7919) % 50)
            .map_err(ev)?;
        c.decoding_started(id, a.epoch, id / 10 + 60).map_err(ev)?;
        if a.holder.is_some() {
            c.checkpoint_stored(id, a.epoch, 256 + (id % 256) as u32, 1 << 20, id / 10 + 70)
                .map_err(ev)?;
        }
    }
    Ok(Some(c))
}
