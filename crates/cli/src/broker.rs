//! One pass over a lane: each message got without auto-ACK, so none is ever out of the broker's
//! hands. A message the pass does not take stays unacknowledged until the pass ends and is then
//! put back; one it takes is ACKed only after what replaces it is confirmed.
//!
//! A pass sees the whole lane or acts on nothing. A passive declare counts only the messages
//! ready in the queue, not those a consumer holds, so a pass begins only when the lane has no
//! consumer and its count is stable (nothing is being put back), and it holds the lane for
//! itself with an exclusive consumer while it runs: the broker refuses a second pass (or any
//! consumer) until it ends. The consumer takes at most one message (its prefetch of one),
//! which the pass reads last, after cancelling the consumer (acknowledged earlier, it would
//! make room for another); the pass reads the rest with `basic.get`, so it never holds more
//! than one message in memory. A pass ends only once the lane's count shows every message it
//! put back. Holders the broker does not count as consumers (another client's unacknowledged
//! `basic.get`s) are out of its sight.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, Consumer};

use crate::outcome::Failure;

/// The broker a pass reads from.
pub(crate) struct Broker<'a> {
    /// The AMQP URL; it may hold a password, so it is never shown.
    pub(crate) url: &'a str,
    /// PEM certificates to trust for `amqps://`.
    pub(crate) tls_ca: Option<&'a std::path::Path>,
    /// The work queue, for the connection's name.
    pub(crate) queue: &'a str,
}

/// How long one broker operation may take before the command gives up (a publish blocked by a
/// resource alarm waits here, and its message stays in the lane).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

/// What the broker said about one publish.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Published {
    /// Confirmed and not returned.
    Confirmed,
    /// Returned as unroutable.
    Returned,
    /// Nacked by the broker.
    Nacked,
}

/// How long the lane's count must hold still before a pass begins, and how long a pass waits for
/// it to, or for what it put back to show, before it says so.
const SETTLE: Duration = Duration::from_millis(300);
const SETTLE_WITHIN: Duration = Duration::from_secs(15);

/// The tag of the consumer that holds the lane for the pass.
const LOCK_TAG: &str = "lily-cli";

/// One message of a pass.
pub(crate) struct Got {
    pub(crate) delivery: Delivery,
}

/// A channel reading one lane, in confirm mode, holding the lane exclusively.
pub(crate) struct Pass {
    connection: Connection,
    channel: Channel,
    /// The exclusive consumer that keeps every other out, until the pass reads its message.
    lock: Option<Consumer>,
    /// The one message the lock took, read last.
    locked: Option<Delivery>,
    /// The lane's queue.
    queue: String,
    /// Messages the lane held when the pass began: the pass looks at no more. A queue hands
    /// out its messages in order and the pass puts none back before it ends, so these are the
    /// messages that were there: a replayed message that fails again at once, back at the tail,
    /// waits for the next pass.
    pub(crate) size: u32,
    /// Messages got so far.
    got: u32,
    /// Messages the pass removed (ACKed after their replay, or purged).
    removed: u32,
    /// The delivery tags got and not ACKed: put back when the pass ends.
    held: std::collections::BTreeSet<u64>,
}

impl Pass {
    /// Connects and opens a pass over `queue`.
    pub(crate) async fn open(broker: &Broker<'_>, queue: &str) -> Result<Self, Failure> {
        let ca = match broker.tls_ca {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                Failure::broker(format!("cannot read --tls-ca {}: {e}", path.display()))
            })?),
            None => None,
        };
        let connection = lily_mq_rabbit::connect(broker.url, ca, broker.queue, "cli")
            .await
            .map_err(|e| Failure::broker(describe(&e)))?;
        let channel = within("open a channel", connection.create_channel()).await?;
        within(
            "select confirms",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let size = settled_count(&channel, queue).await?;
        // One message at a time to the lock; the rest are read with basic.get.
        within(
            "set the prefetch",
            channel.basic_qos(1, BasicQosOptions::default()),
        )
        .await?;
        let options = BasicConsumeOptions {
            exclusive: true,
            ..Default::default()
        };
        let mut lock = channel
            .basic_consume(
                queue.into(),
                LOCK_TAG.into(),
                options,
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                Failure::busy(format!(
                    "{queue} is in use (another lily command or a consumer holds it): {e}; \
                     nothing was done"
                ))
            })?;
        // A lane with messages gives the lock one at once.
        let locked = if size > 0 {
            match tokio::time::timeout(SETTLE_WITHIN, lock.next()).await {
                Ok(Some(Ok(delivery))) => Some(delivery),
                _ => None,
            }
        } else {
            None
        };
        Ok(Self {
            connection,
            channel,
            lock: Some(lock),
            locked,
            queue: queue.to_owned(),
            size,
            got: 0,
            removed: 0,
            held: std::collections::BTreeSet::new(),
        })
    }

    /// The channel, for declarations.
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The next message of the pass, unacknowledged; `None` once the lane is empty or the pass
    /// has looked at as many messages as the lane held when it began.
    pub(crate) async fn next(&mut self) -> Result<Option<Got>, Failure> {
        if self.got >= self.size {
            return Ok(None);
        }
        // The lock's message comes last, once the lock is cancelled.
        if self.got + 1 == self.size
            && let Some(delivery) = self.locked.take()
        {
            self.release_lock().await?;
            self.got += 1;
            return Ok(Some(Got { delivery }));
        }
        let got = within(
            &format!("get from {:?}", self.queue),
            self.channel.basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            ),
        )
        .await?;
        match got {
            Some(m) => {
                self.got += 1;
                Ok(Some(Got {
                    delivery: m.delivery,
                }))
            }
            // Fewer ready than counted: the lock's message, if any, ends the pass.
            None => match self.locked.take() {
                Some(delivery) => {
                    self.release_lock().await?;
                    self.got = self.size;
                    Ok(Some(Got { delivery }))
                }
                None => Ok(None),
            },
        }
    }

    /// Cancels the lock: from now on nothing is pushed to the pass, and its message may be
    /// acknowledged.
    async fn release_lock(&mut self) -> Result<(), Failure> {
        if self.lock.take().is_some() {
            within(
                "stop holding the lane",
                self.channel
                    .basic_cancel(LOCK_TAG.into(), BasicCancelOptions::default()),
            )
            .await?;
        }
        Ok(())
    }

    /// Keeps a message in the lane: it is put back when the pass ends.
    pub(crate) fn hold(&mut self, tag: u64) {
        self.held.insert(tag);
    }

    /// Removes a message from the lane.
    pub(crate) async fn ack(&mut self, tag: u64) -> Result<(), Failure> {
        within(
            "ACK",
            self.channel.basic_ack(tag, BasicAckOptions::default()),
        )
        .await?;
        self.held.remove(&tag);
        self.removed += 1;
        Ok(())
    }

    /// Publishes mandatory and persistent and waits for the confirm.
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<Published, Failure> {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirm = within(
            "publish",
            self.channel.basic_publish(
                exchange.into(),
                routing_key.into(),
                options,
                body,
                properties,
            ),
        )
        .await?;
        // One publish in flight at a time: a return can only be this publish's.
        Ok(match within("confirm", confirm).await? {
            Confirmation::Ack(None) => Published::Confirmed,
            Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => Published::Returned,
            Confirmation::Nack(None) | Confirmation::NotRequested => Published::Nacked,
        })
    }

    /// Ends the pass: stops the lock, puts back every message held and closes the channel,
    /// then waits until the lane's count shows what was put back, so that the next command sees
    /// the whole lane. The close is a round trip, so every ACK sent before it has been
    /// processed once it returns.
    pub(crate) async fn close(mut self) -> Result<(), Failure> {
        self.release_lock().await?;
        // The lock's message, if the pass never read it, goes back with the rest.
        if let Some(locked) = self.locked.take() {
            self.held.insert(locked.delivery_tag);
        }
        // The highest tag still held, with every unacknowledged one below it.
        if let Some(&tag) = self.held.last() {
            let options = BasicNackOptions {
                multiple: true,
                requeue: true,
            };
            within("put messages back", self.channel.basic_nack(tag, options)).await?;
        }
        within("close the channel", self.channel.close(200, "done".into())).await?;
        // What the pass put back reaches the queue after the close: wait until it shows.
        let expected = self.size.saturating_sub(self.removed);
        let counting = within("open a channel", self.connection.create_channel()).await?;
        let started = tokio::time::Instant::now();
        let mut count = ready(&counting, &self.queue).await?.0;
        while count < expected && started.elapsed() < SETTLE_WITHIN {
            tokio::time::sleep(Duration::from_millis(50)).await;
            count = ready(&counting, &self.queue).await?.0;
        }
        let _ = self.connection.close(200, "done".into()).await;
        if count < expected {
            return Err(Failure::broker(format!(
                "{}: {count} messages ready {} s after the pass, {expected} expected: \
                 something else took messages meanwhile",
                self.queue,
                SETTLE_WITHIN.as_secs()
            )));
        }
        Ok(())
    }
}

/// The lane's ready messages and consumers, by a passive declare.
async fn ready(channel: &Channel, queue: &str) -> Result<(u32, u32), Failure> {
    let declared = within(
        &format!("find queue {queue:?}"),
        channel.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    Ok((declared.message_count(), declared.consumer_count()))
}

/// The lane's count, once it has no consumer and the count held still for [`SETTLE`]: messages
/// a consumer holds, or that are being put back, are not counted by the broker, and a pass over
/// them would see part of the lane.
async fn settled_count(channel: &Channel, queue: &str) -> Result<u32, Failure> {
    let started = tokio::time::Instant::now();
    let (mut count, mut consumers) = ready(channel, queue).await?;
    loop {
        if consumers > 0 {
            return Err(Failure::busy(format!(
                "{queue} has {consumers} consumer{}: the messages it holds are not in view; \
                 stop it first. Nothing was done",
                if consumers == 1 { "" } else { "s" }
            )));
        }
        tokio::time::sleep(SETTLE).await;
        let (again, now_consumers) = ready(channel, queue).await?;
        if again == count && now_consumers == 0 {
            return Ok(count);
        }
        if started.elapsed() > SETTLE_WITHIN {
            return Err(Failure::busy(format!(
                "{queue}: its count kept changing for {} s ({count}, then {again}): messages \
                 are being put back or added. Nothing was done; try again",
                SETTLE_WITHIN.as_secs()
            )));
        }
        (count, consumers) = (again, now_consumers);
    }
}

/// Runs one broker operation within [`OPERATION_TIMEOUT`].
async fn within<T>(
    what: &str,
    operation: impl Future<Output = lapin::Result<T>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(OPERATION_TIMEOUT, operation).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Failure::broker(format!("cannot {what}: {e}"))),
        Err(_) => Err(Failure::broker(format!(
            "cannot {what}: no answer within {} s (is the broker blocked by a resource alarm?)",
            OPERATION_TIMEOUT.as_secs()
        ))),
    }
}

/// A connect error with its cause, never the URL.
fn describe(e: &lily_mq_rabbit::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}
