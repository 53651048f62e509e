//! One pass over a lane: each message got without auto-ACK, so none is ever out of the broker's
//! hands. A message the pass does not take stays unacknowledged until the pass ends and is then
//! put back; one it takes is ACKed only after what replaces it is confirmed.

use std::future::Future;
use std::time::Duration;

use lapin::Confirmation;
use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

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

/// A channel reading one lane, in confirm mode.
pub(crate) struct Pass {
    connection: Connection,
    channel: Channel,
    /// The lane's queue.
    queue: String,
    /// Messages the lane held when the pass began: the pass looks at no more. A queue hands
    /// out its messages in order and the pass puts none back before it ends, so these are the
    /// messages that were there: a replayed message that fails again at once, back at the tail,
    /// waits for the next pass.
    pub(crate) size: u32,
    /// Messages got so far.
    got: u32,
    /// The highest delivery tag got and not ACKed: put back when the pass ends.
    held: Option<u64>,
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
        let declared = within(
            &format!("find queue {queue:?}"),
            channel.queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
        Ok(Self {
            connection,
            channel,
            queue: queue.to_owned(),
            size: declared.message_count(),
            got: 0,
            held: None,
        })
    }

    /// The channel, for declarations.
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The next message of the pass, unacknowledged; `None` once the lane is empty or the pass
    /// has looked at as many messages as the lane held when it began.
    pub(crate) async fn next(&mut self) -> Result<Option<BasicGetMessage>, Failure> {
        if self.got >= self.size {
            return Ok(None);
        }
        let got = within(
            &format!("get from {:?}", self.queue),
            self.channel.basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            ),
        )
        .await?;
        if got.is_some() {
            self.got += 1;
        }
        Ok(got)
    }

    /// Keeps a message in the lane: it is put back when the pass ends.
    pub(crate) fn hold(&mut self, tag: u64) {
        self.held = self.held.max(Some(tag));
    }

    /// Removes a message from the lane.
    pub(crate) async fn ack(&self, tag: u64) -> Result<(), Failure> {
        within(
            "ACK",
            self.channel.basic_ack(tag, BasicAckOptions::default()),
        )
        .await
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

    /// Purges the lane; returns how many messages went.
    pub(crate) async fn purge(&self) -> Result<u32, Failure> {
        within(
            "purge",
            self.channel
                .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default()),
        )
        .await
    }

    /// Ends the pass: puts back every message held and closes the channel. The close is a
    /// round trip, so every ACK sent before it has been processed once it returns.
    pub(crate) async fn close(self) -> Result<(), Failure> {
        if let Some(tag) = self.held {
            let options = BasicNackOptions {
                multiple: true,
                requeue: true,
            };
            within("put messages back", self.channel.basic_nack(tag, options)).await?;
        }
        within("close the channel", self.channel.close(200, "done".into())).await?;
        let _ = self.connection.close(200, "done".into()).await;
        Ok(())
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
