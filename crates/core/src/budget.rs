//! Settlement budget: deadlines, with time passed in.

use std::time::{Duration, Instant};

/// The deadline of one delivery's settlement. Time is always passed in, never read here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    deadline: Instant,
    nack_reserve: Duration,
}

impl Budget {
    /// A budget of `total` starting at `now`, keeping `nack_reserve` for the fallback NACK.
    pub fn start(now: Instant, total: Duration, nack_reserve: Duration) -> Self {
        Self {
            deadline: now + total,
            nack_reserve: nack_reserve.min(total),
        }
    }

    /// Time left at `now`; zero once the deadline has passed.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.deadline.saturating_duration_since(now)
    }

    /// Time a handoff may take at `now` (publish and confirm), leaving the NACK reserve.
    pub fn for_handoff(&self, now: Instant) -> Duration {
        self.remaining(now).saturating_sub(self.nack_reserve)
    }

    /// The instant after which nothing more is sent for this delivery.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_time_keeps_the_nack_reserve() {
        let t0 = Instant::now();
        let b = Budget::start(t0, Duration::from_secs(10), Duration::from_secs(1));
        assert_eq!(b.for_handoff(t0), Duration::from_secs(9));
        assert_eq!(
            b.for_handoff(t0 + Duration::from_millis(9500)),
            Duration::ZERO
        );
        assert_eq!(
            b.remaining(t0 + Duration::from_millis(9500)),
            Duration::from_millis(500)
        );
        assert_eq!(b.remaining(t0 + Duration::from_secs(11)), Duration::ZERO);
    }
}
