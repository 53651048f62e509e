//! The Lily storm contender: a handler that always fails retryably.

use std::time::Duration;

use lily::prelude::{
    Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router, Shutdown,
};

use crate::Order;
use crate::storm::{MAX_ATTEMPTS, REASON, RETRY_DELAY};

/// The storm's policy: attempts enough never to dead-letter during the run, one bucket of
/// [`RETRY_DELAY`].
pub fn policy() -> Policy {
    Policy::default()
        .max_attempts(MAX_ATTEMPTS)
        .retry_delays([RETRY_DELAY])
}

/// A consumer of `queue` (prefetch = concurrency) whose handler deserializes the [`Order`] and
/// fails retryably, and the shutdown that stops it.
pub fn consumer(url: &str, queue: &str, prefetch: u16) -> (Consumer, Shutdown) {
    let router = Router::new().route("order.placed", |Json(o): Json<Order>| async move {
        std::hint::black_box(o);
        Err::<(), _>(QueueHandlerError::retryable(REASON))
    });
    let config = ConsumerConfig::new(queue)
        .queue_kind(QueueKind::Classic)
        .prefetch(prefetch)
        .concurrency(usize::from(prefetch))
        .policy(policy());
    (Consumer::new(url, config, router), Shutdown::default())
}

/// How long Lily gets to report ready before the storm starts anyway.
pub const READY_LIMIT: Duration = Duration::from_secs(20);
