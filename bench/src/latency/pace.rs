//! The load: a paced publisher on its own connection, and a monitor of the work queue's depth.
//!
//! The publisher is raw lapin on a confirm channel, as cheap as a publisher gets, so it takes
//! little CPU from the contenders on a small machine. It keeps a schedule of `rate × elapsed`
//! messages: every [`TICK`] it publishes what the schedule owes (about `rate / 1000` messages,
//! persistent, mandatory, type `order.placed`, an id each) back to back, and hands their
//! confirms to a task that awaits them, so no confirm is awaited per message and a slow confirm
//! does not delay the next tick.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::latency::timer::Sent;

/// How often the publisher publishes what its schedule owes.
pub const TICK: Duration = Duration::from_millis(1);

/// What the paced publisher did.
#[derive(Clone, Copy, Debug)]
pub struct Paced {
    /// Messages published (handed to the broker).
    pub published: u64,
    /// Publishes that were not confirmed (failed, nacked or returned).
    pub unconfirmed: u64,
    /// Seconds from the first tick to the last publish.
    pub secs: f64,
}

/// Publishes `rate` messages a second of `body` to `queue` for `duration`, with ids
/// `{prefix}-{i}`, stamping each one's publish time in `sent_at`, and waits for every confirm.
///
/// # Panics
/// When the publisher cannot connect.
pub async fn publish_paced(
    url: &str,
    queue: &str,
    rate: f64,
    duration: Duration,
    body: Arc<[u8]>,
    prefix: &str,
    sent_at: &Sent,
) -> Paced {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect the paced publisher");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let (confirms, mut pending) = mpsc::unbounded_channel::<lapin::PublisherConfirm>();
    let awaiting = tokio::spawn(async move {
        let mut unconfirmed = 0;
        while let Some(confirm) = pending.recv().await {
            if !matches!(confirm.await, Ok(Confirmation::Ack(None))) {
                unconfirmed += 1;
            }
        }
        unconfirmed
    });
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let mut failed = 0;
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let started = Instant::now();
    let mut sent: u64 = 0;
    loop {
        ticks.tick().await;
        let elapsed = started.elapsed().min(duration);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let due = (rate * elapsed.as_secs_f64()) as u64;
        let publishes: Vec<_> = (sent..due)
            .map(|i| {
                sent_at.stamp(i);
                let properties = BasicProperties::default()
                    .with_message_id(format!("{prefix}-{i}").into())
                    .with_type("order.placed".into())
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2);
                Box::pin(channel.basic_publish("".into(), queue.into(), options, &body, properties))
            })
            .collect();
        sent = due.max(sent);
        for published in join_all(publishes).await {
            match published {
                Ok(confirm) => {
                    let _ = confirms.send(confirm);
                }
                Err(_) => failed += 1,
            }
        }
        if elapsed >= duration {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    drop(confirms);
    let unconfirmed = awaiting.await.unwrap_or(0) + failed;
    let _ = connection.close(200, "published".into()).await;
    Paced {
        published: sent,
        unconfirmed,
        secs,
    }
}

/// Awaits every future, polling all of them on each wake, and returns their outputs in order.
async fn join_all<F: Future + Unpin>(mut futures: Vec<F>) -> Vec<F::Output> {
    let mut done: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, slot) in futures.iter_mut().zip(done.iter_mut()) {
            if slot.is_none() {
                match Pin::new(&mut *future).poll(cx) {
                    Poll::Ready(output) => *slot = Some(output),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    done.into_iter().flatten().collect()
}

/// Ready messages of a queue, polled every [`Depth::EVERY`] on a connection of its own.
#[derive(Debug, Default)]
pub struct Depth {
    /// Largest depth seen.
    pub max: AtomicU32,
    /// Latest depth seen.
    pub last: AtomicU32,
}

impl Depth {
    /// How often the depth is read.
    pub const EVERY: Duration = Duration::from_millis(100);

    /// Polls `queue` until `stop` is cancelled.
    pub async fn watch(self: Arc<Self>, url: String, queue: String, stop: CancellationToken) {
        let Ok(connection) = Connection::connect(&url, ConnectionProperties::default()).await
        else {
            return;
        };
        let Ok(channel) = connection.create_channel().await else {
            return;
        };
        let mut ticks = tokio::time::interval(Self::EVERY);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = ticks.tick() => {}
            }
            let Some(depth) = crate::ready(&channel, &queue).await else {
                break;
            };
            self.last.store(depth, Ordering::Relaxed);
            self.max.fetch_max(depth, Ordering::Relaxed);
        }
        let _ = connection.close(200, "depth".into()).await;
    }
}
