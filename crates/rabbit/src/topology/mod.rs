//! Queue topology: the work queue, its retry buckets, the dead-letter queue, the parking queue
//! and the dead-letter exchange for broker-native rejects.

mod declare;

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use self::declare::{Replies, Request, declaration, queue_requests};
use crate::error::{BrokerError, MissingPermission};
use crate::version::BrokerVersion;

/// The RabbitMQ queue type of the work queue and its companions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueKind {
    /// Classic queues.
    #[default]
    Classic,
    /// Quorum queues (replicated; `x-delivery-count` counts redeliveries).
    Quorum,
}

/// Where a quorum queue's leader is placed when it is declared (`x-queue-leader-locator`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderLocator {
    /// On the node the declaring connection is on (the broker's default).
    ClientLocal,
    /// On the node leading the fewest queues, so the work queue, its buckets and its lanes
    /// spread over the cluster and one node going down moves only some of their leaders.
    Balanced,
}

impl LeaderLocator {
    fn name(self) -> &'static str {
        match self {
            Self::ClientLocal => "client-local",
            Self::Balanced => "balanced",
        }
    }
}

/// Whether Lily declares the topology or only checks that it exists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TopologyMode {
    /// Declare every queue and exchange (idempotent when the arguments match).
    #[default]
    Declare,
    /// Check that every queue and the dead-letter exchange exist with the arguments Lily relies
    /// on; fail at start, naming the queue and the argument, if anything is missing or differs.
    /// Checking the arguments needs the `configure` permission on the queue names; a user
    /// without it gets its queues checked for existence only, and a warning naming the
    /// permission (see [`Topology::apply`]).
    Verify,
}

/// Names and arguments of one work queue's topology.
///
/// For a work queue `orders` with delays 5 s and 1 min:
/// `orders` (dead-letter exchange `orders.dlx`), `orders.retry.5s` and `orders.retry.1m`
/// (per-queue TTL, dead-lettering back to `orders`), `orders.dlq` (bound to `orders.dlx`) and
/// `orders.parking`.
///
/// A quorum work queue also carries the broker's own backstop: `x-delivery-limit` (see
/// [`Topology::delivery_limit`]) with at-least-once dead-lettering (`x-dead-letter-strategy`,
/// which needs `x-overflow: reject-publish`), so a message redelivered past the limit reaches
/// the DLQ, or waits for it, and is never dropped.
///
/// On RabbitMQ 4.0 and later every quorum queue has a delivery limit (20) unless declared
/// with `x-delivery-limit: -1`, and a queue with no dead-letter target drops a message at
/// it. So on such a broker (see [`Topology::broker`]) the DLQ, the parking lane and a work
/// queue without a limit of its own are declared with `-1`: a lane read and given back any
/// number of times keeps its messages. The buckets are not: each dead-letters, at least once,
/// to the work queue, so a bucket's limit sends a copy on early rather than dropping it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    kind: QueueKind,
    buckets: Vec<(String, Duration)>,
    delivery_limit: Option<u32>,
    leader_locator: Option<LeaderLocator>,
    unlimited: bool,
}

impl Topology {
    /// The topology of `queue` with one bucket per delay.
    pub fn new(queue: &str, kind: QueueKind, retry_delays: &[Duration]) -> Self {
        let buckets = retry_delays
            .iter()
            .map(|d| (format!("{queue}.retry.{}", delay_label(*d)), *d))
            .collect();
        Self {
            queue: queue.to_owned(),
            kind,
            buckets,
            delivery_limit: None,
            leader_locator: None,
            unlimited: false,
        }
    }

    /// Declares for a broker of `version`: on 4.0 and later, quorum queues that must have no
    /// delivery limit get `x-delivery-limit: -1` (see [`Topology`]). `None`, or a version
    /// before 4.0, declares no limit where none is configured, as before 4.0 no limit is the
    /// default and `-1` is not understood.
    #[must_use]
    pub fn broker(mut self, version: Option<BrokerVersion>) -> Self {
        self.unlimited = version.is_some_and(BrokerVersion::limits_deliveries_by_default);
        self
    }

    /// Whether quorum queues without a limit of their own are declared with
    /// `x-delivery-limit: -1` (see [`Topology::broker`]).
    pub fn declares_unlimited(&self) -> bool {
        self.unlimited && self.kind == QueueKind::Quorum
    }

    /// Declares quorum queues with `x-queue-leader-locator`; `None` declares none. Classic
    /// queues live on the node that declares them.
    #[must_use]
    pub fn leader_locator(mut self, locator: Option<LeaderLocator>) -> Self {
        self.leader_locator = locator;
        self
    }

    /// Declares a quorum work queue with `x-delivery-limit: limit` (and at-least-once
    /// dead-lettering); `None` declares neither. Classic queues have no delivery limit.
    #[must_use]
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The retry bucket for a delay index.
    pub fn bucket(&self, index: usize) -> Option<&str> {
        self.buckets.get(index).map(|(name, _)| name.as_str())
    }

    /// All retry buckets with their delays.
    pub fn buckets(&self) -> impl Iterator<Item = (&str, Duration)> {
        self.buckets.iter().map(|(n, d)| (n.as_str(), *d))
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// The parking queue.
    pub fn parking_queue(&self) -> String {
        format!("{}.parking", self.queue)
    }

    /// The work queue's dead-letter exchange (broker-native rejects land in the DLQ through it).
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.queue)
    }

    /// The work queue's replay exchange: a direct exchange whose only binding routes the work
    /// queue's name to the work queue. Replays publish through it (see [`crate::copy::replay`]).
    pub fn replay_exchange(&self) -> String {
        format!("{}.replay", self.queue)
    }

    /// Declares the replay exchange and its binding (idempotent). Lily itself never publishes
    /// to it; `lily dlq replay` calls this before it replays. Needs `configure` on the exchange,
    /// and for the binding `read` on the exchange and `write` on the work queue.
    ///
    /// # Errors
    /// The broker refused the declaration or the binding.
    pub async fn declare_replay(&self, channel: &Channel) -> lapin::Result<String> {
        let exchange = self.replay_exchange();
        let options = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                options,
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                self.queue.as_str().into(),
                exchange.as_str().into(),
                self.queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(exchange)
    }

    /// Declares or verifies everything.
    ///
    /// In [`TopologyMode::Verify`] the exchange and each queue must exist (passive declares,
    /// which need no permission), and then each queue must hold the arguments Lily relies on:
    /// a passive declare ignores arguments, and a bucket without its dead-letter exchange back
    /// to the work queue would silently discard every retry copy after its original was ACKed.
    /// So each queue is declared again with exactly the expected arguments, which RabbitMQ
    /// refuses (406, naming the queue and the argument) when the existing queue lacks one or
    /// has another value, its type included. That second declare changes nothing on a queue
    /// that passes, but needs `configure` (and `read` on the queue, `write` on its dead-letter
    /// exchange). A user without them gets [`Applied::ExistenceOnly`], naming what it lacks.
    ///
    /// The requests of each step go out together, without waiting for each reply, so a step
    /// takes one round trip however many buckets there are; the first refusal, in the order
    /// above, is the one reported.
    ///
    /// # Errors
    /// The broker refused a declaration (for example, a queue exists with other arguments, or
    /// the user lacks a permission: [`TopologyError::missing`] names it) or, in
    /// [`TopologyMode::Verify`], something is missing or differs. The channel is closed by the
    /// broker.
    pub async fn apply(
        &self,
        channel: &Channel,
        mode: TopologyMode,
    ) -> Result<Applied, TopologyError> {
        let queues = self.queues(mode);
        if mode == TopologyMode::Verify {
            // Existence first, so a missing queue is refused rather than created.
            let exists = [Request::Exchange { passive: true }]
                .into_iter()
                .chain(queue_requests(&queues, true));
            self.pipelined(channel, exists, Replies::Each).await?;
            let declares = queue_requests(&queues, false);
            return match self.pipelined(channel, declares, Replies::Each).await {
                Ok(()) => Ok(Applied::Complete),
                // The user may not configure: existence is all that can be known.
                Err(TopologyError {
                    missing: Some(missing),
                    ..
                }) => Ok(Applied::ExistenceOnly(missing)),
                Err(err) => Err(err),
            };
        }
        self.pipelined(channel, declaration(&queues), Replies::Each)
            .await?;
        Ok(Applied::Complete)
    }

    /// Sends the requests of [`TopologyMode::Declare`] on `channel` without asking for their
    /// replies (`nowait`) and returns once they are queued, knowing nothing yet: the broker
    /// handles a channel's requests in order and closes the channel at the first refusal, so
    /// the next request with a reply on `channel` succeeds only if every one of them did.
    /// Which one was refused, and the permission it needs, that request cannot tell; declaring
    /// again with [`Topology::apply`] on another channel does.
    ///
    /// Cheaper than [`Topology::apply`] for the broker, and much faster when it is busy: a
    /// declare that asks for no reply does not ask the queue how many messages it holds, and a
    /// busy queue (or quorum queue leader) answers that late. Each queue's answer took 2–5 ms
    /// just after a backlog was published here, one after the other on the channel.
    ///
    /// # Errors
    /// Only a channel that is closed already: the broker's refusals come later.
    pub(crate) async fn declare_unanswered(&self, channel: &Channel) -> Result<(), TopologyError> {
        let queues = self.queues(TopologyMode::Declare);
        self.pipelined(channel, declaration(&queues), Replies::None)
            .await
    }

    /// Every queue with the arguments it must have. Verification also names the type of a
    /// classic queue, so a quorum queue of the same name is refused.
    fn queues(&self, mode: TopologyMode) -> Vec<(String, FieldTable)> {
        let base = || {
            let mut args = FieldTable::default();
            let kind = match (self.kind, mode) {
                (QueueKind::Quorum, _) => Some("quorum"),
                (QueueKind::Classic, TopologyMode::Verify) => Some("classic"),
                (QueueKind::Classic, TopologyMode::Declare) => None,
            };
            if let Some(kind) = kind {
                args.insert("x-queue-type".into(), long(kind));
            }
            if let (QueueKind::Quorum, Some(locator)) = (self.kind, self.leader_locator) {
                args.insert("x-queue-leader-locator".into(), long(locator.name()));
            }
            args
        };
        // A lane, or a work queue without a limit of its own, must have none.
        let unlimited = || {
            let mut args = base();
            if self.declares_unlimited() {
                args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(-1));
            }
            args
        };
        let mut work = match (self.kind, self.delivery_limit) {
            (QueueKind::Quorum, Some(limit)) => {
                let mut work = base();
                work.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(limit.into()),
                );
                work.insert("x-dead-letter-strategy".into(), long("at-least-once"));
                work.insert("x-overflow".into(), long("reject-publish"));
                work
            }
            _ => unlimited(),
        };
        work.insert(
            "x-dead-letter-exchange".into(),
            long(&self.dead_letter_exchange()),
        );
        let mut queues = vec![
            (self.dead_letter_queue(), unlimited()),
            (self.parking_queue(), unlimited()),
            (self.queue.clone(), work),
        ];
        for (name, delay) in &self.buckets {
            let mut args = base();
            let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
            args.insert("x-dead-letter-exchange".into(), long(""));
            args.insert("x-dead-letter-routing-key".into(), long(&self.queue));
            if self.kind == QueueKind::Quorum {
                // Quorum dead-lettering is at-most-once unless asked otherwise.
                args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
                args.insert("x-overflow".into(), long("reject-publish"));
            }
            queues.push((name.clone(), args));
        }
        queues
    }
}

/// What [`Topology::apply`] established.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Applied {
    /// Everything declared or, in [`TopologyMode::Verify`], every queue exists with the
    /// arguments Lily relies on.
    Complete,
    /// [`TopologyMode::Verify`] only: the exchange and every queue exist, but the queues'
    /// arguments (type, dead-lettering, TTLs) were not checked, because the user may not
    /// declare: the permission named is the one the broker refused.
    ExistenceOnly(MissingPermission),
}

/// Why [`Topology::apply`] failed.
#[derive(Debug, thiserror::Error)]
#[error("the broker refused the topology")]
pub struct TopologyError {
    /// The permission the user lacks, when the broker refused access.
    pub missing: Option<MissingPermission>,
    /// The broker's error.
    #[source]
    pub source: BrokerError,
}

impl TopologyError {
    fn new(source: lapin::Error, missing: Option<MissingPermission>) -> Self {
        Self {
            missing,
            source: BrokerError(source),
        }
    }
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// `5s`, `1m`, `10m`, `1h`, `1500ms`.
fn delay_label(delay: Duration) -> String {
    let ms = delay.as_millis();
    match ms {
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_queue_and_delays() {
        let t = Topology::new(
            "orders",
            QueueKind::Classic,
            &[
                Duration::from_millis(1500),
                Duration::from_secs(5),
                Duration::from_secs(60),
                Duration::from_secs(7200),
            ],
        );
        let names: Vec<_> = t.buckets().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "orders.retry.1500ms",
                "orders.retry.5s",
                "orders.retry.1m",
                "orders.retry.2h"
            ]
        );
        assert_eq!(t.dead_letter_queue(), "orders.dlq");
        assert_eq!(t.parking_queue(), "orders.parking");
        assert_eq!(t.dead_letter_exchange(), "orders.dlx");
        assert_eq!(t.replay_exchange(), "orders.replay");
    }

    #[test]
    fn a_leader_locator_is_declared_on_every_quorum_queue_and_never_on_classic_ones() {
        let delays = [Duration::from_secs(5)];
        let locator = |kind| {
            Topology::new("orders", kind, &delays)
                .leader_locator(Some(LeaderLocator::Balanced))
                .queues(TopologyMode::Declare)
                .into_iter()
                .map(|(name, args)| (name, args.inner().get("x-queue-leader-locator").cloned()))
                .collect::<Vec<_>>()
        };
        let quorum = locator(QueueKind::Quorum);
        assert_eq!(quorum.len(), 4);
        assert!(
            quorum.iter().all(|(_, l)| *l == Some(long("balanced"))),
            "{quorum:?}"
        );
        assert!(locator(QueueKind::Classic).iter().all(|(_, l)| l.is_none()));
        let none = Topology::new("orders", QueueKind::Quorum, &delays).queues(TopologyMode::Verify);
        assert!(
            none.iter()
                .all(|(_, a)| !a.inner().contains_key("x-queue-leader-locator"))
        );
    }
}
