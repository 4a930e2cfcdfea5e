//! The cloud-API token bucket shared by every cloud call, plus the per-Service backoff.
//! The arithmetic is pure (time is passed in); [`SharedTokenBucket`] is the thin async edge.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// A token bucket that can also be paused until a deadline (a 429's `Retry-After`).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    capacity: f64,
    refill_per_sec: f64,
    tokens: f64,
    updated: Instant,
    paused_until: Option<Instant>,
}

impl TokenBucket {
    pub fn new(rate_per_sec: f64, burst: u32, now: Instant) -> Self {
        let capacity = f64::from(burst.max(1));
        Self {
            capacity,
            refill_per_sec: rate_per_sec.max(0.001),
            tokens: capacity,
            updated: now,
            paused_until: None,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.refill_per_sec).min(self.capacity);
        self.updated = now;
    }

    /// Takes a token, or says how long to wait before asking again.
    pub fn try_acquire(&mut self, now: Instant) -> Result<(), Duration> {
        if let Some(until) = self.paused_until {
            if now < until {
                return Err(until - now);
            }
            self.paused_until = None;
        }
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            let missing = 1.0 - self.tokens;
            Err(Duration::from_secs_f64(missing / self.refill_per_sec))
        }
    }

    /// The cloud said "slow down": nobody calls before `now + retry_after`, and the bucket
    /// restarts empty so callers do not stampede when the pause ends.
    pub fn pause(&mut self, now: Instant, retry_after: Duration) {
        let until = self
            .paused_until
            .map_or(now + retry_after, |current| current.max(now + retry_after));
        self.paused_until = Some(until);
        self.tokens = 0.0;
        self.updated = until;
    }
}

/// The bucket shared by all tasks that call the cloud.
#[derive(Debug, Clone)]
pub struct SharedTokenBucket(Arc<Mutex<TokenBucket>>);

impl SharedTokenBucket {
    pub fn new(rate_per_sec: f64, burst: u32) -> Self {
        Self(Arc::new(Mutex::new(TokenBucket::new(
            rate_per_sec,
            burst,
            Instant::now(),
        ))))
    }

    /// Waits for a token.
    pub async fn acquire(&self) {
        loop {
            let wait = {
                // A poisoned lock only means another task panicked mid-update; the bucket's
                // numbers are still usable.
                let mut bucket = self.0.lock().unwrap_or_else(|e| e.into_inner());
                match bucket.try_acquire(Instant::now()) {
                    Ok(()) => return,
                    Err(wait) => wait,
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    pub fn pause(&self, retry_after: Duration) {
        let mut bucket = self.0.lock().unwrap_or_else(|e| e.into_inner());
        bucket.pause(Instant::now(), retry_after);
    }
}

/// The slowest per-Service retry.
const MAX_SERVICE_BACKOFF_SECS: u64 = 300;

/// Per-Service exponential backoff: 5 s, 10 s, 20 s … capped at 300 s.
pub fn service_backoff(consecutive_failures: u32) -> Duration {
    const BASE: u64 = 5;
    let exp = consecutive_failures.saturating_sub(1).min(16);
    Duration::from_secs(BASE.saturating_mul(1 << exp).min(MAX_SERVICE_BACKOFF_SECS))
}

/// The retry after a permanent error (a refused address, an invalid Service): a change of
/// the Service or its Namespace retries at once, so this is only the backstop for the
/// cloud changing meanwhile (an address freed), at the slow end of the backoff.
pub const PERMANENT_ERROR_RETRY: Duration = Duration::from_secs(MAX_SERVICE_BACKOFF_SECS);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bucket_allows_burst_then_paces() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, 3, t0);
        assert!(b.try_acquire(t0).is_ok());
        assert!(b.try_acquire(t0).is_ok());
        assert!(b.try_acquire(t0).is_ok());
        let wait = b.try_acquire(t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(b.try_acquire(t0 + Duration::from_millis(500)).is_ok());
    }

    #[test]
    fn retry_after_pauses_everyone() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100.0, 10, t0);
        b.pause(t0, Duration::from_secs(2));
        assert_eq!(
            b.try_acquire(t0 + Duration::from_secs(1)).unwrap_err(),
            Duration::from_secs(1)
        );
        // A shorter later Retry-After never shortens the pause.
        b.pause(t0 + Duration::from_millis(100), Duration::from_millis(100));
        assert!(b.try_acquire(t0 + Duration::from_millis(1500)).is_err());
        // After the pause the bucket restarts empty and refills at its rate.
        let after = t0 + Duration::from_secs(2);
        assert!(b.try_acquire(after).is_err());
        assert!(b.try_acquire(after + Duration::from_millis(10)).is_ok());
    }

    #[test]
    fn backoff_doubles_from_5s_to_300s() {
        let steps: Vec<u64> = (1..=8).map(|n| service_backoff(n).as_secs()).collect();
        assert_eq!(steps, vec![5, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(service_backoff(0).as_secs(), 5);
        assert_eq!(service_backoff(u32::MAX).as_secs(), 300);
    }

    proptest! {
        // Over any window, grants never exceed burst + rate * elapsed.
        #[test]
        fn bucket_never_exceeds_rate(rate in 1u32..50, burst in 1u32..20, steps in prop::collection::vec(0u64..200, 1..200)) {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(f64::from(rate), burst, t0);
            let mut now = t0;
            let mut granted = 0u64;
            for step in steps {
                now += Duration::from_millis(step);
                if b.try_acquire(now).is_ok() {
                    granted += 1;
                }
            }
            let elapsed = (now - t0).as_secs_f64();
            prop_assert!(granted as f64 <= f64::from(burst) + f64::from(rate) * elapsed + 1e-6);
        }
    }
}
