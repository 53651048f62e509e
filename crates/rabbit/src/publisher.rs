//! The handoff publisher: a connection of its own, and confirm channels that each carry one
//! handoff at a time.
//!
//! - **Own connection.** RabbitMQ blocks a publishing connection during a memory or disk alarm,
//!   and lapin then writes nothing on it. Publishing copies on the consuming connection would
//!   stall its ACKs, the `basic.qos` round trips that confirm them, `basic.cancel` and close.
//! - **One handoff per channel.** A channel carries one publish in flight at a time, so its
//!   confirm, and any `basic.return` that came with it, can belong to nothing else; the copy
//!   also carries its [`HandoffId`] and [`PublishEvidence::attribute`] checks it. A channel
//!   error caused by one copy (a 406, say) closes that channel only. Channels are reused while
//!   their evidence is clean and closed otherwise, which also drops the confirms lapin keeps for
//!   a publish whose wait timed out.
//! - **Blocked.** While the broker blocks the connection, no handoff publishes: it waits for
//!   the unblock within its own deadline and otherwise fails as [`HandoffResult::Blocked`], so
//!   no copy lands later, after its original was requeued. RabbitMQ only says a connection is
//!   blocked once it publishes during the alarm, and that publish stays unread until the alarm
//!   clears. So when the connection has had no confirm for [`PROBE_AFTER`], a handoff first
//!   publishes a probe that RabbitMQ drops (not mandatory, to a queue name no queue can have)
//!   and awaits its confirm: if an alarm started in the quiet, the probe is what stays stuck,
//!   not a copy. Under a steady stream of handoffs their own confirms are the evidence and no
//!   probe is sent; a copy published in the instant an alarm starts can still be held by the
//!   broker, time out and land after its original was requeued.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, Event};
use lily_mq_core::{Confirm, HandoffId, HandoffResult, PublishEvidence, headers};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::connect::{Endpoint, connect};
use crate::consumer::lock;

/// How often a handoff waiting for the broker to unblock the connection looks again.
const BLOCKED_POLL: Duration = Duration::from_millis(25);

/// How long without a confirm on the connection before a handoff probes it first.
const PROBE_AFTER: Duration = Duration::from_millis(100);

/// Routing key of the probe: RabbitMQ reserves `amq.` queue names, so nothing can route it.
const PROBE_ROUTE: &str = "amq.lily.probe";

/// Publishes handoff copies on a connection of its own.
pub(crate) struct Publisher {
    endpoint: Endpoint,
    /// The current connection; replaced when it is lost.
    link: Mutex<Option<Arc<Connection>>>,
    /// Held while connecting, so concurrent handoffs open one connection, not one each.
    connecting: tokio::sync::Mutex<()>,
    /// Confirm channels with nothing in flight.
    idle: Mutex<Vec<Channel>>,
    next_id: AtomicU64,
    /// When the broker last confirmed a publish on the current connection: it was reading it.
    last_confirm: Mutex<Option<Instant>>,
    /// Whether the broker blocks the current connection, as its last notice said.
    blocked: Arc<AtomicBool>,
    blocked_gauge: metrics::Gauge,
}

impl Publisher {
    pub(crate) fn new(endpoint: Endpoint, queue: &str) -> Self {
        Self {
            endpoint,
            link: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            idle: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            last_confirm: Mutex::new(None),
            blocked: Arc::new(AtomicBool::new(false)),
            blocked_gauge: metrics::gauge!("lily_handoff_blocked", "queue" => queue.to_owned()),
        }
    }

    /// Whether the broker blocks the handoff connection (a resource alarm): handoffs wait.
    pub(crate) fn blocked(&self) -> bool {
        self.blocked.load(Ordering::Acquire)
    }

    /// Opens the connection and one channel ahead of the first handoff, so a broker that
    /// refuses them is known at start.
    pub(crate) async fn warm(&self) -> lapin::Result<()> {
        let connection = self.connection().await?;
        if lock(&self.idle).is_empty() {
            let channel = confirm_channel(&connection).await?;
            lock(&self.idle).push(channel);
        }
        Ok(())
    }

    /// Publishes the copy `body` with `properties` to `queue` through the default exchange
    /// (mandatory, so a missing queue comes back as a return) and awaits its confirm, all
    /// within `deadline`. The copy carries a fresh [`HandoffId`].
    ///
    /// # Cancel safety
    /// Dropping the future after the publish was written leaves the confirm unobserved: the
    /// copy may exist. Callers bound it with `deadline` instead of dropping it.
    pub(crate) async fn publish(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        let Ok(routing_key) = ShortString::try_new(queue) else {
            return HandoffResult::Failed;
        };
        let until = Instant::now() + deadline;
        let channel = match tokio::time::timeout_at(until, self.channel()).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(_)) => return HandoffResult::Failed,
            Err(_) => return self.timed_out(),
        };
        if lock(&self.last_confirm).is_none_or(|at| at.elapsed() > PROBE_AFTER) {
            // The channel is dropped (and closed) unless the probe was confirmed.
            match tokio::time::timeout_at(until, probe(&channel)).await {
                Ok(Ok(())) => self.confirmed(),
                Ok(Err(_)) => return HandoffResult::Failed,
                Err(_) => return self.timed_out(),
            }
        }
        let id = HandoffId::new(self.next_id.fetch_add(1, Ordering::Relaxed));
        let properties = stamped(properties, id);
        let attempt = async {
            channel
                .basic_publish(
                    ShortString::from(""),
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    body,
                    properties,
                )
                .await?
                .await
        };
        let result = match tokio::time::timeout_at(until, attempt).await {
            Err(_) => HandoffResult::TimedOut,
            Ok(Err(_) | Ok(Confirmation::NotRequested)) => HandoffResult::Failed,
            Ok(Ok(Confirmation::Ack(returned))) => evidence(Confirm::Ack, returned).attribute(id),
            Ok(Ok(Confirmation::Nack(returned))) => evidence(Confirm::Nack, returned).attribute(id),
        };
        if result.leaves_channel_clean() {
            self.confirmed();
            if channel.status().connected() {
                lock(&self.idle).push(channel);
            }
        }
        // Otherwise the channel is dropped here, and lapin closes it with its last handle,
        // discarding whatever it still kept for it.
        result
    }

    /// A wait that ran out: blocked if the broker said so meanwhile.
    fn timed_out(&self) -> HandoffResult {
        if self.blocked() {
            HandoffResult::Blocked
        } else {
            HandoffResult::TimedOut
        }
    }

    fn confirmed(&self) {
        *lock(&self.last_confirm) = Some(Instant::now());
    }

    /// An idle channel of the current connection, or a new one; waits while the broker blocks
    /// the connection.
    async fn channel(&self) -> lapin::Result<Channel> {
        loop {
            let connection = self.connection().await?;
            if connection.status().blocked() {
                tokio::time::sleep(BLOCKED_POLL).await;
                continue;
            }
            let reused = {
                let mut idle = lock(&self.idle);
                // Channels of a lost connection are closed; they are simply dropped.
                std::iter::from_fn(|| idle.pop()).find(|c| c.status().connected())
            };
            return match reused {
                Some(channel) => Ok(channel),
                None => confirm_channel(&connection).await,
            };
        }
    }

    /// The current connection, opened again when it was lost.
    async fn connection(&self) -> lapin::Result<Arc<Connection>> {
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let connection = Arc::new(connect(&self.endpoint, "handoffs").await?);
        *lock(&self.last_confirm) = None;
        self.blocked.store(false, Ordering::Release);
        self.blocked_gauge.set(0.0);
        tokio::spawn(watch_blocked(
            connection.events_listener(),
            Arc::clone(&self.blocked),
            self.blocked_gauge.clone(),
        ));
        *lock(&self.link) = Some(Arc::clone(&connection));
        Ok(connection)
    }

    fn current(&self) -> Option<Arc<Connection>> {
        lock(&self.link)
            .as_ref()
            .filter(|c| c.status().connected())
            .cloned()
    }

    /// Closes the channels and the connection, waiting at most `within`: a blocked connection
    /// writes nothing, not even its close.
    pub(crate) async fn close(&self, within: Duration) {
        lock(&self.idle).clear();
        let Some(connection) = lock(&self.link).take() else {
            return;
        };
        let closing = connection.close(200, "lily shutdown".into());
        if tokio::time::timeout(within, closing).await.is_err() {
            warn!("handoff connection did not close in time; dropping it");
        }
    }
}

impl std::fmt::Debug for Publisher {
    // Not derived: the endpoint's URL may carry credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("blocked", &self.blocked())
            .finish_non_exhaustive()
    }
}

/// Follows the broker's `connection.blocked` and `connection.unblocked` notices for logs,
/// the `lily_handoff_blocked` gauge and [`Publisher::blocked`], until the connection is gone.
async fn watch_blocked(
    events: impl Stream<Item = Event> + Send + 'static,
    blocked: Arc<AtomicBool>,
    gauge: metrics::Gauge,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = std::future::poll_fn(|cx| events.as_mut().poll_next(cx)).await {
        match event {
            Event::ConnectionBlocked(reason) => {
                // The reason is the broker's own text (for example "low on memory").
                warn!(%reason, "broker blocked the handoff connection; handoffs wait");
                blocked.store(true, Ordering::Release);
                gauge.set(1.0);
            }
            Event::ConnectionUnblocked => {
                info!("broker unblocked the handoff connection");
                blocked.store(false, Ordering::Release);
                gauge.set(0.0);
            }
            Event::Error(_) => break,
            _ => {}
        }
    }
}

fn evidence(
    confirm: Confirm,
    returned: Option<lapin::message::BasicReturnMessage>,
) -> PublishEvidence {
    PublishEvidence {
        confirm,
        returned: returned
            .map(|message| HandoffId::from_headers(message.delivery.properties.headers().as_ref())),
    }
}

/// `properties` with the handoff id header set.
fn stamped(properties: BasicProperties, id: HandoffId) -> BasicProperties {
    let mut table = properties.headers().clone().unwrap_or_default();
    table.insert(headers::HANDOFF_ID.into(), id.header_value());
    properties.with_headers(table)
}

/// Publishes a probe that RabbitMQ confirms and drops, and awaits the confirm.
async fn probe(channel: &Channel) -> lapin::Result<()> {
    channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(PROBE_ROUTE),
            BasicPublishOptions::default(),
            &[],
            BasicProperties::default(),
        )
        .await?
        .await
        .map(drop)
}

async fn confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
