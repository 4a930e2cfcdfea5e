//! Runtime fault injection for tests: rate limit (token bucket), added latency, errors
//! before a request is handled, and answers lost after a change was committed.

use std::time::{Duration, Instant};

use cloud_mock_sdk::{Faults, LostAnswer};

/// Upper bound of injected latency, so a bad setting cannot hang clients for ever.
pub const MAX_LATENCY_MS: u64 = 60_000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultsError {
    #[error("errorRate: must be between 0.0 and 1.0")]
    ErrorRate,
    #[error("latencyMs: must be at most {MAX_LATENCY_MS}")]
    Latency,
    #[error("rateLimitPerSecond: must be at least 1 (leave it out for no limit)")]
    RateLimit,
    #[error("lostAnswerRate: must be between 0.0 and 1.0")]
    LostAnswerRate,
}

pub fn validate_faults(faults: &Faults) -> Result<(), FaultsError> {
    if !(0.0..=1.0).contains(&faults.error_rate) {
        return Err(FaultsError::ErrorRate);
    }
    if faults.latency_ms > MAX_LATENCY_MS {
        return Err(FaultsError::Latency);
    }
    if faults.rate_limit_per_second == Some(0) {
        return Err(FaultsError::RateLimit);
    }
    if !(0.0..=1.0).contains(&faults.lost_answer_rate) {
        return Err(FaultsError::LostAnswerRate);
    }
    Ok(())
}

/// What to do with one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Answer 429 with this `Retry-After` (whole seconds, at least 1).
    RateLimited { retry_after_secs: u64 },
    /// Wait `latency`, then answer 503 if `fail`, else handle the request.
    Proceed { latency: Duration, fail: bool },
}

/// The active faults and the token bucket of the rate limit.
#[derive(Debug, Clone)]
pub struct FaultState {
    faults: Faults,
    tokens: f64,
    refilled_at: Instant,
}

impl FaultState {
    pub fn new(now: Instant) -> Self {
        Self {
            faults: Faults::default(),
            tokens: 0.0,
            refilled_at: now,
        }
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Replaces the faults; a new rate limit starts with a full bucket (one second's worth).
    pub fn set(&mut self, faults: Faults, now: Instant) {
        self.tokens = faults.rate_limit_per_second.map_or(0.0, f64::from);
        self.refilled_at = now;
        self.faults = faults;
    }

    /// Decides for one request arriving at `now`; `roll` in 0..1 decides injected errors.
    pub fn admit(&mut self, now: Instant, roll: f64) -> Verdict {
        if let Some(rate) = self.faults.rate_limit_per_second {
            let rate = f64::from(rate);
            let elapsed = now
                .saturating_duration_since(self.refilled_at)
                .as_secs_f64();
            self.tokens = (self.tokens + elapsed * rate).min(rate);
            self.refilled_at = now;
            if self.tokens >= 1.0 {
                self.tokens -= 1.0;
            } else {
                let wait = (1.0 - self.tokens) / rate;
                return Verdict::RateLimited {
                    retry_after_secs: (wait.ceil() as u64).max(1),
                };
            }
        }
        Verdict::Proceed {
            latency: Duration::from_millis(self.faults.latency_ms),
            fail: roll < self.faults.error_rate,
        }
    }

    /// Whether the answer to a committed change is lost, and how; `roll` in 0..1.
    pub fn lose_answer(&self, roll: f64) -> Option<LostAnswer> {
        (roll < self.faults.lost_answer_rate).then_some(self.faults.lost_answer)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn bucket_never_admits_more_than_its_rate_allows(
            rate in 1u32..50,
            gaps_ms in proptest::collection::vec(0u64..300, 1..300),
        ) {
            let start = Instant::now();
            let mut state = FaultState::new(start);
            state.set(Faults { rate_limit_per_second: Some(rate), ..Faults::default() }, start);
            let mut now = start;
            let mut admitted = 0u64;
            for gap in gaps_ms {
                now += Duration::from_millis(gap);
                match state.admit(now, 1.0) {
                    Verdict::Proceed { .. } => admitted += 1,
                    Verdict::RateLimited { retry_after_secs } => prop_assert!(retry_after_secs >= 1),
                }
            }
            let elapsed = now.duration_since(start).as_secs_f64();
            // One second's burst plus the refill over the elapsed time.
            let allowed = f64::from(rate) * (1.0 + elapsed);
            prop_assert!(admitted as f64 <= allowed + 1e-6, "{admitted} > {allowed}");
        }
    }

    #[test]
    fn no_faults_let_everything_through() {
        let now = Instant::now();
        let mut state = FaultState::new(now);
        for _ in 0..1000 {
            assert_eq!(
                state.admit(now, 0.0),
                Verdict::Proceed {
                    latency: Duration::ZERO,
                    fail: false
                }
            );
        }
    }

    #[test]
    fn token_bucket_limits_and_refills() {
        let start = Instant::now();
        let mut state = FaultState::new(start);
        state.set(
            Faults {
                rate_limit_per_second: Some(2),
                ..Faults::default()
            },
            start,
        );
        assert!(matches!(state.admit(start, 0.5), Verdict::Proceed { .. }));
        assert!(matches!(state.admit(start, 0.5), Verdict::Proceed { .. }));
        assert_eq!(
            state.admit(start, 0.5),
            Verdict::RateLimited {
                retry_after_secs: 1
            }
        );
        let later = start + Duration::from_millis(500);
        assert!(matches!(state.admit(later, 0.5), Verdict::Proceed { .. }));
        assert!(matches!(
            state.admit(later, 0.5),
            Verdict::RateLimited { .. }
        ));
    }

    #[test]
    fn error_rate_and_latency_apply() {
        let now = Instant::now();
        let mut state = FaultState::new(now);
        state.set(
            Faults {
                error_rate: 0.25,
                latency_ms: 30,
                ..Faults::default()
            },
            now,
        );
        assert_eq!(
            state.admit(now, 0.1),
            Verdict::Proceed {
                latency: Duration::from_millis(30),
                fail: true
            }
        );
        assert_eq!(
            state.admit(now, 0.3),
            Verdict::Proceed {
                latency: Duration::from_millis(30),
                fail: false
            }
        );
    }

    #[test]
    fn answers_are_lost_at_the_set_rate_in_the_set_way() {
        let now = Instant::now();
        let mut state = FaultState::new(now);
        assert_eq!(state.lose_answer(0.0), None, "off by default");
        state.set(
            Faults {
                lost_answer_rate: 0.5,
                lost_answer: LostAnswer::Hang,
                ..Faults::default()
            },
            now,
        );
        assert_eq!(state.lose_answer(0.49), Some(LostAnswer::Hang));
        assert_eq!(state.lose_answer(0.5), None);
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad_rate = Faults {
            error_rate: 1.5,
            ..Faults::default()
        };
        assert_eq!(validate_faults(&bad_rate), Err(FaultsError::ErrorRate));
        let nan = Faults {
            error_rate: f64::NAN,
            ..Faults::default()
        };
        assert_eq!(validate_faults(&nan), Err(FaultsError::ErrorRate));
        let zero = Faults {
            rate_limit_per_second: Some(0),
            ..Faults::default()
        };
        assert_eq!(validate_faults(&zero), Err(FaultsError::RateLimit));
        let lost = Faults {
            lost_answer_rate: -0.1,
            ..Faults::default()
        };
        assert_eq!(validate_faults(&lost), Err(FaultsError::LostAnswerRate));
        assert_eq!(validate_faults(&Faults::default()), Ok(()));
    }
}
