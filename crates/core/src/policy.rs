//! Retry and requeue policy: plain data, checked and testable alone.

use std::time::Duration;

/// How failures are retried and how often an original may be requeued.
///
/// ```
/// use std::time::Duration;
/// use lily_mq_core::Policy;
///
/// // Three attempts: the first, then one after 5 s and one after 1 min; then the DLQ.
/// let policy = Policy::default()
///     .max_attempts(3)
///     .retry_delays([Duration::from_secs(5), Duration::from_secs(60)])
///     .max_requeues(3);
/// assert!(policy.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// Application attempts per message, counting the first. Attempt `max_attempts` failing
    /// retryably goes to the dead-letter queue.
    pub max_attempts: u32,
    /// Delays of the retry buckets, shortest first. Retry `n` (1-based) waits
    /// `retry_delays[min(n, len) - 1]` unless the handler asks for longer.
    pub retry_delays: Vec<Duration>,
    /// How many times one message may be NACKed with requeue (failed handoffs and deferrals)
    /// before it goes to the dead-letter queue instead.
    pub max_requeues: u32,
    /// Time a delivery may spend in settlement: handoff publish and confirm, then the ACK or
    /// the fallback NACK.
    pub settlement_budget: Duration,
    /// Part of the budget kept for the fallback NACK when a handoff fails or times out.
    pub nack_reserve: Duration,
    /// How long a deferred delivery is held before its NACK, by deferral number (the last
    /// entry repeats). Deferrals wait for something to change — a lease to expire, an
    /// abandoned transaction to be aborted — so an immediate requeue would only spin.
    pub deferral_delays: Vec<Duration>,
    /// How long a delivery at the requeue limit may be held while its DLQ (or parking) handoff
    /// keeps failing and no held copy can be published, before it is NACKed with requeue. Keep
    /// it well below the broker's `consumer_timeout` (30 minutes by default), which would
    /// otherwise close the channel and take every delivery in flight on it.
    pub release_held_after: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            retry_delays: vec![
                Duration::from_secs(5),
                Duration::from_secs(60),
                Duration::from_secs(600),
            ],
            max_requeues: 5,
            settlement_budget: Duration::from_secs(10),
            nack_reserve: Duration::from_secs(1),
            deferral_delays: vec![
                Duration::from_secs(1),
                Duration::from_secs(2),
                Duration::from_secs(5),
                Duration::from_secs(10),
                Duration::from_secs(30),
            ],
            release_held_after: Duration::from_secs(15 * 60),
        }
    }
}

/// A policy that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// `max_attempts` is zero.
    #[error("policy.max_attempts must be at least 1")]
    NoAttempts,
    /// Attempts above one need at least one retry bucket.
    #[error("policy.retry_delays must not be empty when policy.max_attempts is above 1")]
    NoRetryDelays,
    /// Retry delays must be increasing, non-zero and fit a queue TTL.
    #[error("policy.retry_delays must be increasing, above zero and at most 2^32-1 ms")]
    BadRetryDelays,
    /// The NACK reserve must leave time for the handoff.
    #[error("policy.nack_reserve must be shorter than policy.settlement_budget")]
    BadReserve,
    /// A delivery released at once would be redelivered at once: a requeue hot loop.
    #[error("policy.release_held_after must be at least 1 s")]
    BadRelease,
    /// A deferral without a wait would be a requeue hot loop.
    #[error("policy.deferral_delays must not be empty, and each must be above zero")]
    BadDeferralDelays,
}

impl Policy {
    /// Sets [`Policy::max_attempts`].
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Sets [`Policy::retry_delays`], shortest first.
    #[must_use]
    pub fn retry_delays(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.retry_delays = delays.into_iter().collect();
        self
    }

    /// Sets [`Policy::max_requeues`].
    #[must_use]
    pub fn max_requeues(mut self, requeues: u32) -> Self {
        self.max_requeues = requeues;
        self
    }

    /// Sets [`Policy::settlement_budget`] and [`Policy::nack_reserve`].
    #[must_use]
    pub fn settlement_budget(mut self, budget: Duration, nack_reserve: Duration) -> Self {
        self.settlement_budget = budget;
        self.nack_reserve = nack_reserve;
        self
    }

    /// Sets [`Policy::nack_reserve`] alone.
    #[must_use]
    pub fn nack_reserve(mut self, reserve: Duration) -> Self {
        self.nack_reserve = reserve;
        self
    }

    /// Sets [`Policy::deferral_delays`].
    #[must_use]
    pub fn deferral_delays(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.deferral_delays = delays.into_iter().collect();
        self
    }

    /// Sets [`Policy::release_held_after`].
    #[must_use]
    pub fn release_held_after(mut self, after: Duration) -> Self {
        self.release_held_after = after;
        self
    }

    /// How long to hold a delivery before requeueing its deferral number `requeues` (0-based).
    pub fn deferral_delay(&self, requeues: u32) -> Duration {
        let last = self.deferral_delays.len().saturating_sub(1);
        self.deferral_delays
            .get((requeues as usize).min(last))
            .copied()
            .unwrap_or_default()
    }

    /// Checks the policy.
    ///
    /// # Errors
    /// Returns the first rule the policy breaks.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.max_attempts == 0 {
            return Err(PolicyError::NoAttempts);
        }
        if self.max_attempts > 1 && self.retry_delays.is_empty() {
            return Err(PolicyError::NoRetryDelays);
        }
        let ttl_ok = |d: &Duration| !d.is_zero() && d.as_millis() <= u128::from(u32::MAX);
        if !self.retry_delays.iter().all(ttl_ok)
            || self.retry_delays.windows(2).any(|w| w[0] >= w[1])
        {
            return Err(PolicyError::BadRetryDelays);
        }
        if self.nack_reserve >= self.settlement_budget {
            return Err(PolicyError::BadReserve);
        }
        if self.release_held_after < Duration::from_secs(1) {
            return Err(PolicyError::BadRelease);
        }
        if self.deferral_delays.is_empty() || self.deferral_delays.iter().any(Duration::is_zero) {
            return Err(PolicyError::BadDeferralDelays);
        }
        Ok(())
    }

    /// Index of the retry bucket for the retry that follows `attempt`, honouring the handler's
    /// `retry_after` hint by picking the shortest bucket at least that long.
    pub fn bucket_for(&self, attempt: u32, retry_after: Option<Duration>) -> usize {
        let last = self.retry_delays.len().saturating_sub(1);
        let by_attempt = (attempt.max(1) as usize - 1).min(last);
        match retry_after {
            Some(hint) => self
                .retry_delays
                .iter()
                .position(|d| *d >= hint)
                .unwrap_or(last)
                .max(by_attempt),
            None => by_attempt,
        }
    }

    /// The retry bucket a message waits in for another owner's lease that can expire in
    /// `expires_in`: the shortest at least that long, else the longest; `None` without buckets.
    pub fn wait_bucket(&self, expires_in: Duration) -> Option<usize> {
        let last = self.retry_delays.len().checked_sub(1)?;
        Some(
            self.retry_delays
                .iter()
                .position(|d| *d >= expires_in)
                .unwrap_or(last),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_is_valid() {
        assert_eq!(Policy::default().validate(), Ok(()));
    }

    #[test]
    fn invalid_policies_are_named() {
        let p = Policy {
            max_attempts: 0,
            ..Policy::default()
        };
        assert_eq!(p.validate(), Err(PolicyError::NoAttempts));
        let p = Policy {
            retry_delays: vec![],
            ..Policy::default()
        };
        assert_eq!(p.validate(), Err(PolicyError::NoRetryDelays));
        let p = Policy {
            retry_delays: vec![Duration::from_secs(5), Duration::from_secs(5)],
            ..Policy::default()
        };
        assert_eq!(p.validate(), Err(PolicyError::BadRetryDelays));
        let p = Policy {
            nack_reserve: Duration::from_secs(10),
            ..Policy::default()
        };
        assert_eq!(p.validate(), Err(PolicyError::BadReserve));
        let p = Policy::default().release_held_after(Duration::ZERO);
        assert_eq!(p.validate(), Err(PolicyError::BadRelease));
        for delays in [vec![], vec![Duration::from_secs(1), Duration::ZERO]] {
            let p = Policy::default().deferral_delays(delays);
            assert_eq!(p.validate(), Err(PolicyError::BadDeferralDelays));
        }
        let p = Policy::default().nack_reserve(Duration::from_secs(30));
        assert_eq!(p.validate(), Err(PolicyError::BadReserve));
        // Every message names the field it is about.
        for e in [
            PolicyError::NoAttempts,
            PolicyError::NoRetryDelays,
            PolicyError::BadRetryDelays,
            PolicyError::BadReserve,
            PolicyError::BadRelease,
            PolicyError::BadDeferralDelays,
        ] {
            assert!(e.to_string().starts_with("policy."), "{e}");
        }
    }

    #[test]
    fn buckets_follow_attempts_and_hints() {
        let p = Policy::default();
        assert_eq!(p.bucket_for(1, None), 0);
        assert_eq!(p.bucket_for(2, None), 1);
        assert_eq!(p.bucket_for(9, None), 2);
        assert_eq!(p.bucket_for(1, Some(Duration::from_secs(30))), 1);
        assert_eq!(p.bucket_for(1, Some(Duration::from_secs(3600))), 2);
        assert_eq!(p.bucket_for(3, Some(Duration::from_secs(1))), 2);
    }
}
