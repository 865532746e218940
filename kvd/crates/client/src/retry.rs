//! Client-side retries of `Overloaded` refusals: the policy, what the retries cost, and the
//! loop that applies one to a call.

use std::time::{Duration, Instant};

use kvd_core::protocol::Reply;
use kvd_core::{Error, Result};

/// How a client retries a call the daemon refused as `Overloaded` (a bound was reached and
/// nothing was done, so the call can be sent again as it was). Waits grow exponentially from
/// `base_delay_ms` up to `max_delay_ms`, each drawn at random below its ceiling ("full
/// jitter", so that many clients refused at once do not come back at once) but never shorter
/// than the daemon's retry-after hint; a call stops retrying after `max_attempts` sends in all
/// or when the next wait would end past `budget_ms` from its first send (the caller's
/// deadline), and then returns the last refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Sends of one call at most (the first one included), 1 to 64.
    pub max_attempts: u32,
    /// The first wait's ceiling, ms.
    pub base_delay_ms: u64,
    /// The largest wait's ceiling, ms.
    pub max_delay_ms: u64,
    /// The time one call may spend from its first send to its last, ms.
    pub budget_ms: u64,
}

impl Default for RetryPolicy {
    /// 8 sends within 2 s, waits from 5 ms up to 200 ms.
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 8,
            base_delay_ms: 5,
            max_delay_ms: 200,
            budget_ms: 2_000,
        }
    }
}

/// What a client's retries cost, for the retry amplification factor (`sends / calls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryStats {
    /// Calls made.
    pub calls: u64,
    /// Requests sent for them (a call refused and retried twice counts three).
    pub sends: u64,
    /// Calls that gave up retrying and returned the refusal.
    pub gave_up: u64,
}

/// A random wait in `[floor, ceiling]` ms (the kernel's random source: retries are rare).
fn jittered_ms(floor: u64, ceiling: u64) -> u64 {
    let mut b = [0u8; 8];
    let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
    let ceiling = ceiling.max(floor);
    floor + u64::from_le_bytes(b) % (ceiling - floor + 1)
}

/// Send a call with `send` and, under `policy`, send it again while the daemon refuses it as
/// `Overloaded`, counting calls and sends in `stats`.
pub(crate) fn with_retries(
    policy: Option<&RetryPolicy>,
    stats: &mut RetryStats,
    mut send: impl FnMut() -> Result<Reply>,
) -> Result<Reply> {
    stats.calls += 1;
    let Some(policy) = policy else {
        stats.sends += 1;
        return send();
    };
    let started = Instant::now();
    let budget = Duration::from_millis(policy.budget_ms);
    let mut ceiling = policy.base_delay_ms.max(1);
    let mut sends = 0u32;
    loop {
        stats.sends += 1;
        sends += 1;
        let refusal = match send() {
            Err(e @ Error::Overloaded { .. }) => e,
            other => return other,
        };
        let Error::Overloaded { retry_after_ms, .. } = &refusal else {
            unreachable!("matched above")
        };
        let wait = Duration::from_millis(jittered_ms(*retry_after_ms, ceiling));
        if sends >= policy.max_attempts.clamp(1, 64) || started.elapsed() + wait > budget {
            stats.gave_up += 1;
            return Err(refusal);
        }
        std::thread::sleep(wait);
        ceiling = (ceiling * 2).min(policy.max_delay_ms.max(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_wait_is_drawn_between_the_hint_and_its_ceiling_and_spreads_over_it() {
        let draws: Vec<u64> = (0..2000).map(|_| jittered_ms(10, 50)).collect();
        assert!(draws.iter().all(|&d| (10..=50).contains(&d)));
        let (lo, hi) = (draws.iter().min().unwrap(), draws.iter().max().unwrap());
        assert!(*lo <= 15 && *hi >= 45, "spread over the range: {lo}..{hi}");
        // a hint above the ceiling wins: never sooner than the daemon asked
        assert!((0..100).all(|_| jittered_ms(80, 50) == 80));
    }
}
