//! Sending the topology's requests: declarations and passive checks, pipelined on one channel.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use super::{Topology, TopologyError};
use crate::error::{Needs, missing_permission};

/// One request of [`Topology::apply`].
#[derive(Clone, Copy)]
pub(super) enum Request<'a> {
    /// The dead-letter exchange; a passive declare only checks that it exists.
    Exchange { passive: bool },
    /// A queue with the arguments it must have; a passive declare only checks that it exists.
    Queue {
        name: &'a str,
        args: &'a FieldTable,
        passive: bool,
    },
    /// The dead-letter queue's binding to the dead-letter exchange.
    Bind,
}

/// The declaring requests of [`TopologyMode::Declare`], in order: the exchange, every queue,
/// the binding.
pub(super) fn declaration(queues: &[(String, FieldTable)]) -> impl Iterator<Item = Request<'_>> {
    [Request::Exchange { passive: false }]
        .into_iter()
        .chain(queue_requests(queues, false))
        .chain([Request::Bind])
}

/// A request for each of `queues`; a passive one only checks that the queue exists.
pub(super) fn queue_requests(
    queues: &[(String, FieldTable)],
    passive: bool,
) -> impl Iterator<Item = Request<'_>> {
    queues.iter().map(move |(name, args)| Request::Queue {
        name,
        args,
        passive,
    })
}

/// Whether the requests of one step ask for their replies.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Replies {
    /// One each: a refusal is known, and which request it was.
    Each,
    /// None (`nowait`): see [`Topology::declare_unanswered`].
    None,
}

impl Topology {
    /// Sends `requests` one after the other on `channel` without waiting for each reply: the
    /// broker handles a channel's requests in order and, once it refuses one, closes the
    /// channel, so every later request fails too. The first failure in order is the refusal.
    pub(super) async fn pipelined(
        &self,
        channel: &Channel,
        requests: impl IntoIterator<Item = Request<'_>>,
        replies: Replies,
    ) -> Result<(), TopologyError> {
        // `join_all` polls them first in order, and lapin sends a request at its first poll.
        let sent = requests
            .into_iter()
            .map(|request| self.send(channel, request, replies));
        futures_util::future::join_all(sent)
            .await
            .into_iter()
            .collect()
    }

    /// Sends one request and awaits its reply; a refusal names the permission the request
    /// needs when the broker refused access.
    pub(super) async fn send(
        &self,
        channel: &Channel,
        request: Request<'_>,
        replies: Replies,
    ) -> Result<(), TopologyError> {
        let nowait = replies == Replies::None;
        let dlx = self.dead_letter_exchange();
        match request {
            Request::Exchange { passive } => {
                let options = ExchangeDeclareOptions {
                    durable: true,
                    passive,
                    nowait,
                    ..ExchangeDeclareOptions::default()
                };
                channel
                    .exchange_declare(
                        dlx.as_str().into(),
                        ExchangeKind::Fanout,
                        options,
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| {
                        refusal(
                            e,
                            || format!("declare exchange '{dlx}'"),
                            &[Needs::exchange(&dlx, "configure")],
                        )
                    })
            }
            Request::Queue {
                name,
                args,
                passive,
            } => {
                let options = QueueDeclareOptions {
                    durable: true,
                    passive,
                    nowait,
                    ..QueueDeclareOptions::default()
                };
                let declared = channel
                    .queue_declare(name.into(), options, args.clone())
                    .await;
                let Err(err) = declared else {
                    return Ok(());
                };
                if passive {
                    return Err(TopologyError::new(err, None));
                }
                let dead_letters_to = match args.inner().get("x-dead-letter-exchange") {
                    Some(AMQPValue::LongString(exchange)) => Some(exchange.to_string()),
                    _ => None,
                };
                let mut needs = vec![Needs::queue(name, "configure")];
                if let Some(exchange) = &dead_letters_to {
                    // The broker checks `configure`, then `read` on the queue, then `write` on
                    // its dead-letter exchange, and names only the resource when it refuses.
                    needs[0].permission = "configure and read";
                    needs.push(Needs::exchange(exchange, "write"));
                }
                Err(refusal(err, || format!("declare queue '{name}'"), &needs))
            }
            Request::Bind => {
                let dlq = self.dead_letter_queue();
                channel
                    .queue_bind(
                        dlq.as_str().into(),
                        dlx.as_str().into(),
                        "".into(),
                        QueueBindOptions { nowait },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| {
                        let needs = [Needs::queue(&dlq, "write"), Needs::exchange(&dlx, "read")];
                        refusal(
                            e,
                            || format!("bind queue '{dlq}' to exchange '{dlx}'"),
                            &needs,
                        )
                    })
            }
        }
    }
}

/// `err` of a request that needs `needs`, naming the permission when access was refused.
fn refusal(
    err: lapin::Error,
    doing: impl FnOnce() -> String,
    needs: &[Needs<'_>],
) -> TopologyError {
    let missing = missing_permission(&err, doing, needs);
    TopologyError::new(err, missing)
}
