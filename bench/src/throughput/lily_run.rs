//! Lily contenders: a handler doing the same work, settled by Lily.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lily::prelude::{
    Consumer, ConsumerConfig, Json, Policy, QueueHandlerError, QueueKind, Router, Shutdown, Trigger,
};

use crate::Order;
use crate::throughput::{FAILURE_REASON, FirstDelivery, HANDOFF_DELAY, POLL, Sample, run_limit};

/// Retry delays of the success path (Lily's default policy): its topology is the same for every
/// contender.
pub fn success_delays() -> Vec<Duration> {
    Policy::default().retry_delays
}

/// The policy of the handoff path: one retry, parked for [`HANDOFF_DELAY`].
pub fn handoff_policy() -> Policy {
    Policy::default()
        .max_attempts(2)
        .retry_delays([HANDOFF_DELAY])
}

fn config(queue: &str, kind: QueueKind, prefetch: u16, policy: Policy) -> ConsumerConfig {
    ConsumerConfig::new(queue)
        .queue_kind(kind)
        .prefetch(prefetch)
        .concurrency(usize::from(prefetch))
        .policy(policy)
}

/// Consumes `n` messages with a handler that deserializes and succeeds.
pub async fn success(url: &str, queue: &str, kind: QueueKind, prefetch: u16, n: u64) -> Sample {
    let first = Arc::new(FirstDelivery::new());
    let seen = Arc::clone(&first);
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| {
        seen.get_or_init(Instant::now);
        async move {
            std::hint::black_box(o);
            Ok(())
        }
    });
    let consumer = Consumer::new(
        url,
        config(queue, kind, prefetch, Policy::default()),
        router,
    );
    measure(consumer, n, false, &first).await
}

/// Consumes `n` messages with a handler that deserializes and fails retryably: Lily hands each
/// off to the retry bucket (confirmed) and ACKs it.
pub async fn handoff(url: &str, queue: &str, kind: QueueKind, prefetch: u16, n: u64) -> Sample {
    let first = Arc::new(FirstDelivery::new());
    let seen = Arc::clone(&first);
    let router = Router::new().route("order.placed", move |Json(o): Json<Order>| {
        seen.get_or_init(Instant::now);
        async move {
            std::hint::black_box(o);
            Err::<(), _>(QueueHandlerError::retryable(FAILURE_REASON))
        }
    });
    let consumer = Consumer::new(url, config(queue, kind, prefetch, handoff_policy()), router);
    measure(consumer, n, true, &first).await
}

async fn measure(consumer: Consumer, n: u64, retried: bool, first: &FirstDelivery) -> Sample {
    let stats = consumer.stats();
    let shutdown = Shutdown::default();
    let started = Instant::now();
    let run = tokio::spawn(consumer.run(shutdown.clone()));
    let limit = run_limit(n);
    let settled = || {
        let totals = stats.totals();
        if retried {
            totals.retried
        } else {
            totals.acked
        }
    };
    while settled() < n && started.elapsed() < limit && !run.is_finished() {
        tokio::time::sleep(POLL).await;
    }
    let elapsed = started.elapsed();
    let count = settled();
    shutdown.trigger(Trigger::Api);
    match run.await {
        Ok(Ok(report)) if report.exit_code() == 0 => {}
        Ok(Ok(report)) => eprintln!("Lily shutdown report exit code {}", report.exit_code()),
        Ok(Err(err)) => eprintln!("Lily consumer failed: {err}"),
        Err(err) => eprintln!("Lily consumer task: {err}"),
    }
    let totals = stats.totals();
    let other = totals.requeued + totals.dead_lettered + totals.parked + totals.unresolved;
    if std::env::var_os("LILY_BENCH_DEBUG").is_some() {
        eprintln!("Lily totals after shutdown: {totals:?}");
    }
    if other > 0 {
        eprintln!("Lily: unexpected outcomes {totals:?}");
    }
    Sample::new(count, n, elapsed).first_seen(started, first)
}
