//! The load: a paced publisher (raw lapin on a confirm channel, as cheap as a publisher gets:
//! every [`TICK`] what its schedule of `rate × elapsed` owes, back to back, the confirms awaited
//! by a task of their own).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use crate::Order;
use crate::latency::run::QUEUE;

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

/// Publishes `rate` 512-byte orders a second to [`QUEUE`] for `duration`, with ids `p-{i}`,
/// stamping each one's publish time in `sent_at[i]`, and waits for every confirm.
///
/// # Panics
/// When the publisher cannot connect.
pub async fn publish_paced(
    url: &str,
    rate: f64,
    duration: Duration,
    sent_at: &[OnceLock<Instant>],
) -> Paced {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect the paced publisher");
    let channel = crate::raw::confirm_channel(&connection).await;
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
    let (body, mut failed) = (Order::body(), 0);
    let properties = BasicProperties::default()
        .with_type("order.placed".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let started = Instant::now();
    let mut sent: u64 = 0;
    loop {
        ticks.tick().await;
        let elapsed = started.elapsed().min(duration);
        let due = (rate * elapsed.as_secs_f64()) as u64;
        let publishes: Vec<_> = (sent..due)
            .map(|i| {
                if let Some(slot) = usize::try_from(i).ok().and_then(|i| sent_at.get(i)) {
                    let _ = slot.set(Instant::now());
                }
                let properties = properties.clone().with_message_id(format!("p-{i}").into());
                let options = crate::raw::MANDATORY;
                channel.basic_publish("".into(), QUEUE.into(), options, &body, properties)
            })
            .collect();
        sent = due.max(sent);
        for published in futures_util::future::join_all(publishes).await {
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
