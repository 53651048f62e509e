//! A confirm pool: a connection of its own, and a few confirm channels that each carry one batch
//! of publishes at a time. The handoff publisher and the public [`Publisher`](crate::Publisher)
//! are both built on it.
//!
//! - **Own connection.** RabbitMQ blocks a publishing connection during a memory or disk alarm,
//!   and lapin then writes nothing on it. Publishing copies on the consuming connection would
//!   stall its ACKs, the `basic.qos` round trips that confirm them, `basic.cancel` and close.
//! - **Batches.** Publishes queue for [`WORKERS`] workers, each owning one confirm channel. A
//!   worker takes every publish waiting (up to [`MAX_BATCH`]), queues them back to back, each
//!   carrying its [`HandoffId`] in the pool's id header, without waiting for one to be written
//!   before the next, and awaits every confirm of the batch before it judges any of them with
//!   [`attribute_batch`]: a return counts only against the publish whose id it carries, and an
//!   ACK proves nothing until the whole batch is accounted for. While one worker waits for its
//!   confirms, the others publish, so messages stream as a hand-tuned publisher's do and the
//!   broker batches its confirms.
//! - **Channel errors.** A channel error fails every publish of its batch that has no evidence
//!   yet. No handoff copy is known to cause one: what RabbitMQ checks per message (`user_id`,
//!   `expiration`, `CC`/`BCC`) is moved aside on copies, copies go through the default exchange
//!   for every lane, and the broker's `max_message_size` counts the body, which is the
//!   original's.
//! - **Channels.** A channel whose batch was not accounted for in full (a timeout, a channel
//!   error, a stray return) is dropped, and lapin closes it with its last handle, which also
//!   discards the confirms it still kept for publishes nobody awaits any more; the worker opens
//!   a new one for its next batch. So is a channel that was nacked: a quorum queue with
//!   `overflow: reject-publish` tells each channel publishing to it that it is full, and
//!   RabbitMQ may never tell that channel otherwise once the queue takes messages again
//!   (rabbitmq-server#12206: a cleared `max-length` policy), so the lane would fail for good.
//! - **Blocked.** While the broker blocks the connection, no batch publishes: it waits for the
//!   unblock within its publishes' deadline and otherwise fails them as
//!   [`HandoffResult::Blocked`], so no message lands later, after its sender gave up on it.
//!   RabbitMQ only says a connection is blocked once it publishes during the alarm, and that
//!   publish stays unread until the alarm clears. So when the connection has had no confirm for
//!   [`PROBE_AFTER`], a batch first publishes a probe that RabbitMQ drops (not mandatory, to a
//!   queue name no queue can have) and awaits its confirm: if an alarm started in the quiet, the
//!   probe is what stays stuck, not a message. Under a steady stream of publishes their own
//!   confirms are the evidence and no probe is sent; a message published in the instant an
//!   alarm starts can still be held by the broker, time out and land later.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, Event, PublisherConfirm};
use lily_mq_core::transport::{Confirm, HandoffId, HandoffResult, attribute_batch};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::connect::{Dialer, Endpoint};
use crate::sync::lock;

/// Confirm channels publishing, one batch in flight on each.
const WORKERS: usize = 4;

/// The most publishes one batch carries.
const MAX_BATCH: usize = 256;

/// How often a batch waiting for the broker to unblock the connection looks again.
const BLOCKED_POLL: Duration = Duration::from_millis(25);

/// How long without a confirm on the connection before a batch probes it first.
const PROBE_AFTER: Duration = Duration::from_millis(100);

/// Routing key of the probe: RabbitMQ reserves `amq.` queue names, so nothing can route it.
const PROBE_ROUTE: &str = "amq.lily.probe";

/// What a pool is for: how its connection is named, the header its publishes carry their id
/// in, and the gauge that says the broker blocks it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Role {
    /// The connection's role, in its name `lily:<label>:<role>`.
    pub(crate) name: &'static str,
    /// The header each publish carries its [`HandoffId`] in, to attribute returns.
    pub(crate) id_header: &'static str,
    /// The gauge set to 1 while the broker blocks the connection, labelled `queue=<label>`.
    pub(crate) blocked_gauge: &'static str,
}

/// Where one publish goes: an exchange (`""` is the default one) and a routing key.
pub(crate) struct Route {
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
}

impl Route {
    /// The route, or `None` when a name is over 255 bytes.
    pub(crate) fn new(exchange: &str, routing_key: &str) -> Option<Self> {
        Some(Self {
            exchange: ShortString::try_new(exchange).ok()?,
            routing_key: ShortString::try_new(routing_key).ok()?,
        })
    }
}

/// One message to publish.
struct Copy {
    route: Route,
    id: HandoffId,
    body: Vec<u8>,
    properties: BasicProperties,
    until: Instant,
}

/// A message, and where its result goes.
struct Request {
    copy: Copy,
    reply: oneshot::Sender<HandoffResult>,
}

type Requests = Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Request>>>;

/// Publishes with confirms on a connection of its own.
pub(crate) struct Confirms {
    link: Arc<Link>,
    requests: mpsc::UnboundedSender<Request>,
    /// Taken by the first [`Confirms::warm`], which starts the workers.
    pending: Mutex<Option<mpsc::UnboundedReceiver<Request>>>,
    closed: CancellationToken,
}

/// The connection the workers share.
struct Link {
    role: Role,
    /// Set by the first [`Confirms::warm`].
    dialer: std::sync::OnceLock<Dialer>,
    /// The current connection; replaced when it is lost.
    current: Mutex<Option<Arc<Connection>>>,
    /// Held while connecting, so the workers open one connection, not one each.
    connecting: tokio::sync::Mutex<()>,
    /// The next [`HandoffId`], counted for the pool's life.
    next_id: AtomicU64,
    /// When the broker last confirmed a publish on the current connection: it was reading it.
    last_confirm: Mutex<Option<Instant>>,
    /// Whether the broker blocks the current connection, as its last notice said.
    blocked: Arc<AtomicBool>,
    /// Registered on first use, so a recorder installed after [`Confirms::new`] (by
    /// `health::serve`, say) still gets it.
    blocked_gauge: std::sync::OnceLock<metrics::Gauge>,
    label: String,
}

impl Confirms {
    /// A pool for `role`, labelled `label` (the work queue of a consumer) in connection names
    /// and metrics. It connects on [`Confirms::warm`].
    pub(crate) fn new(label: &str, role: Role) -> Self {
        let (requests, pending) = mpsc::unbounded_channel();
        Self {
            link: Arc::new(Link {
                role,
                dialer: std::sync::OnceLock::new(),
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                next_id: AtomicU64::new(0),
                last_confirm: Mutex::new(None),
                blocked: Arc::new(AtomicBool::new(false)),
                blocked_gauge: std::sync::OnceLock::new(),
                label: label.to_owned(),
            }),
            requests,
            pending: Mutex::new(Some(pending)),
            closed: CancellationToken::new(),
        }
    }

    /// Whether the broker blocks the connection (a resource alarm): publishes wait.
    pub(crate) fn blocked(&self) -> bool {
        self.link.blocked.load(Ordering::Acquire)
    }

    /// Opens the connection, so a broker that refuses it is known before the first publish,
    /// and the first time takes `endpoint`, which it dials on its own (the pool's connection may
    /// land on another node than a consumer's), and starts the workers.
    pub(crate) async fn warm(&self, endpoint: &Endpoint) -> lapin::Result<()> {
        self.link
            .dialer
            .get_or_init(|| Dialer::new(endpoint.clone(), self.link.role.name));
        self.link.connection().await?;
        if let Some(pending) = lock(&self.pending).take() {
            let requests: Requests = Arc::new(tokio::sync::Mutex::new(pending));
            for _ in 0..WORKERS {
                tokio::spawn(work(
                    Arc::clone(&self.link),
                    Arc::clone(&requests),
                    self.closed.clone(),
                ));
            }
        }
        Ok(())
    }

    /// Publishes one probe on a channel of its own and awaits its confirm: the broker refuses
    /// it (`ACCESS_REFUSED`, closing that channel only) when the user may not write to the
    /// default exchange. The probe's routing key names no queue, so it goes nowhere.
    pub(crate) async fn check_write(&self) -> lapin::Result<()> {
        let connection = self.link.connection().await?;
        let channel = confirm_channel(&connection).await?;
        probe(&channel).await?;
        let _ = channel.close(200, "write checked".into()).await;
        Ok(())
    }

    /// A fresh id for the next publish to carry in the role's id header.
    pub(crate) fn next_id(&self) -> HandoffId {
        HandoffId::new(self.link.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Publishes `body` with `properties`, which carry `id` (from [`Self::next_id`]) in the
    /// role's id header, on `route` (mandatory, so an unroutable message comes back as a
    /// return) and awaits its confirm, all within `deadline`.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the message to its worker, which publishes it and judges it
    /// unobserved: the message may exist. Callers bound the wait with `deadline` instead.
    pub(crate) async fn publish(
        &self,
        route: Route,
        id: HandoffId,
        body: Vec<u8>,
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        let (reply, result) = oneshot::channel();
        let copy = Copy {
            route,
            id,
            body,
            properties,
            until: Instant::now() + deadline,
        };
        if self.requests.send(Request { copy, reply }).is_err() {
            return HandoffResult::Failed;
        }
        // A worker answers by its batch's deadline, at most shortly after this message's own
        // (one whose deadline passed while it waited for a worker fails at once, unpublished);
        // the worker is gone only once the pool closed.
        result.await.unwrap_or(HandoffResult::Failed)
    }

    /// Stops the workers and closes the connection, waiting at most `within`: a blocked
    /// connection writes nothing, not even its close.
    pub(crate) async fn close(&self, within: Duration) {
        self.closed.cancel();
        let Some(connection) = lock(&self.link.current).take() else {
            return;
        };
        let closing = connection.close(200, "lily shutdown".into());
        if tokio::time::timeout(within, closing).await.is_err() {
            warn!(
                role = self.link.role.name,
                "publishing connection did not close in time; dropping it"
            );
        }
    }
}

impl std::fmt::Debug for Confirms {
    // Not derived: the endpoint's URL may carry credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Confirms")
            .field("role", &self.link.role.name)
            .field("blocked", &self.blocked())
            .finish_non_exhaustive()
    }
}

/// A worker: takes every waiting request (up to [`MAX_BATCH`]), publishes them as one batch on
/// its channel and answers each, until the publisher closes.
async fn work(link: Arc<Link>, requests: Requests, closed: CancellationToken) {
    let mut channel = None;
    loop {
        let batch = {
            let mut requests = tokio::select! {
                guard = requests.lock() => guard,
                () = closed.cancelled() => return,
            };
            let first = tokio::select! {
                request = requests.recv() => request,
                () = closed.cancelled() => return,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match requests.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            batch
        };
        // A copy whose deadline passed while it waited for a worker is not published at all.
        let now = Instant::now();
        let (expired, batch): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|r| r.copy.until <= now);
        for request in expired {
            let _ = request.reply.send(link.timed_out());
        }
        if batch.is_empty() {
            continue;
        }
        let (copies, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|r| (r.copy, r.reply)).unzip();
        let results = link.publish_batch(&mut channel, copies).await;
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}

impl Link {
    /// Publishes `copies` back to back on `slot`'s channel (a new one if there is none), awaits
    /// every confirm by the earliest deadline and judges the batch. The channel goes back into
    /// `slot` only when the batch was accounted for in full.
    async fn publish_batch(
        &self,
        slot: &mut Option<Channel>,
        copies: Vec<Copy>,
    ) -> Vec<HandoffResult> {
        let until = copies
            .iter()
            .map(|c| c.until)
            .min()
            .unwrap_or_else(Instant::now);
        let all = |result| vec![result; copies.len()];
        let channel = match tokio::time::timeout_at(until, self.channel(slot)).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(_)) => return all(HandoffResult::Failed),
            Err(_) => return all(self.timed_out()),
        };
        if lock(&self.last_confirm).is_none_or(|at| at.elapsed() > PROBE_AFTER) {
            // The channel is dropped (and closed) unless the probe was confirmed.
            match tokio::time::timeout_at(until, probe(&channel)).await {
                Ok(Ok(())) => self.confirmed(),
                Ok(Err(_)) => return all(HandoffResult::Failed),
                Err(_) => return all(self.timed_out()),
            }
        }
        let ids: Vec<HandoffId> = copies.iter().map(|copy| copy.id).collect();
        let confirms = publish_all(&channel, copies, until).await;
        let mut members = Vec::with_capacity(ids.len());
        let mut returned = Vec::new();
        for (id, confirm) in ids.into_iter().zip(confirms) {
            let seen = match confirm {
                Err(seen) => seen,
                // Past the deadline this still takes a confirm that has arrived.
                Ok(confirm) => match tokio::time::timeout_at(until, confirm).await {
                    Err(_) => Confirm::TimedOut,
                    Ok(Err(_) | Ok(Confirmation::NotRequested)) => Confirm::Failed,
                    Ok(Ok(Confirmation::Ack(message))) => {
                        returned.extend(message.map(|m| self.returned_id(&m)));
                        Confirm::Ack
                    }
                    Ok(Ok(Confirmation::Nack(message))) => {
                        returned.extend(message.map(|m| self.returned_id(&m)));
                        Confirm::Nack
                    }
                },
            };
            members.push((id, seen));
        }
        let verdict = attribute_batch(&members, &returned);
        if verdict.channel_clean {
            self.confirmed();
            let nacked = members.iter().any(|(_, seen)| *seen == Confirm::Nack);
            if channel.status().connected() && !nacked {
                *slot = Some(channel);
            }
        }
        // Otherwise the channel is dropped here, and lapin closes it with its last handle,
        // discarding whatever it still kept for it.
        let blocked = self.blocked();
        verdict
            .results
            .into_iter()
            .map(|r| match r {
                HandoffResult::TimedOut if blocked => HandoffResult::Blocked,
                r => r,
            })
            .collect()
    }

    /// The id a returned message carries (`None`: none, so not one of this pool's).
    fn returned_id(&self, message: &lapin::message::BasicReturnMessage) -> Option<HandoffId> {
        let headers = message.delivery.properties.headers().as_ref();
        HandoffId::from_header(headers, self.role.id_header)
    }

    /// A wait that ran out: blocked if the broker said so meanwhile.
    fn timed_out(&self) -> HandoffResult {
        if self.blocked() {
            HandoffResult::Blocked
        } else {
            HandoffResult::TimedOut
        }
    }

    fn blocked(&self) -> bool {
        self.blocked.load(Ordering::Acquire)
    }

    fn confirmed(&self) {
        *lock(&self.last_confirm) = Some(Instant::now());
    }

    /// `slot`'s channel if it is still open, or a new one; waits while the broker blocks the
    /// connection.
    async fn channel(&self, slot: &mut Option<Channel>) -> lapin::Result<Channel> {
        loop {
            let connection = self.connection().await?;
            if connection.status().blocked() {
                tokio::time::sleep(BLOCKED_POLL).await;
                continue;
            }
            // A channel of a lost connection is closed; it is simply dropped.
            return match slot.take().filter(|c| c.status().connected()) {
                Some(channel) => Ok(channel),
                None => confirm_channel(&connection).await,
            };
        }
    }

    /// The current connection, opened again when it was lost.
    async fn connection(&self) -> lapin::Result<Arc<Connection>> {
        if let Some(connection) = self.open() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.open() {
            return Ok(connection);
        }
        let dialer = self.dialer.get().ok_or_else(|| {
            lapin::Error::from(std::io::Error::other(
                "the publishing connection was not started",
            ))
        })?;
        let connection = Arc::new(dialer.connect().await?);
        *lock(&self.last_confirm) = None;
        self.blocked.store(false, Ordering::Release);
        let gauge = self.blocked_gauge.get_or_init(
            || metrics::gauge!(self.role.blocked_gauge, "queue" => self.label.clone()),
        );
        gauge.set(0.0);
        tokio::spawn(watch_blocked(
            self.role.name,
            connection.events_listener(),
            Arc::clone(&self.blocked),
            gauge.clone(),
        ));
        *lock(&self.current) = Some(Arc::clone(&connection));
        Ok(connection)
    }

    fn open(&self) -> Option<Arc<Connection>> {
        lock(&self.current)
            .as_ref()
            .filter(|c| c.status().connected())
            .cloned()
    }
}

/// Follows the broker's `connection.blocked` and `connection.unblocked` notices for logs,
/// the role's gauge and [`Confirms::blocked`], until the connection is gone.
async fn watch_blocked(
    role: &'static str,
    events: impl Stream<Item = Event> + Send + 'static,
    blocked: Arc<AtomicBool>,
    gauge: metrics::Gauge,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = std::future::poll_fn(|cx| events.as_mut().poll_next(cx)).await {
        match event {
            Event::ConnectionBlocked(reason) => {
                // The reason is the broker's own text (for example "low on memory").
                warn!(%reason, role, "broker blocked the publishing connection; publishes wait");
                blocked.store(true, Ordering::Release);
                gauge.set(1.0);
            }
            Event::ConnectionUnblocked => {
                info!(role, "broker unblocked the publishing connection");
                blocked.store(false, Ordering::Release);
                gauge.set(0.0);
            }
            Event::Error(_) => break,
            _ => {}
        }
    }
}

/// Publishes `copies` on `channel` back to back, in order, without waiting for one to be
/// written before the next is queued (lapin numbers a publish and queues its frames when it is
/// first polled, then waits for its I/O thread to write them). Each ends in its confirm to
/// await, or in why there is none.
async fn publish_all(
    channel: &Channel,
    copies: Vec<Copy>,
    until: Instant,
) -> Vec<Result<PublisherConfirm, Confirm>> {
    let mut publishes: Vec<_> = copies
        .into_iter()
        .map(|copy| {
            Box::pin(async move {
                channel
                    .basic_publish(
                        copy.route.exchange,
                        copy.route.routing_key,
                        BasicPublishOptions {
                            mandatory: true,
                            immediate: false,
                        },
                        &copy.body,
                        copy.properties,
                    )
                    .await
            })
        })
        .collect();
    let mut done: Vec<Option<Result<PublisherConfirm, Confirm>>> = std::iter::repeat_with(|| None)
        .take(publishes.len())
        .collect();
    // Polled in order, so the first round numbers and queues them in order.
    let all = std::future::poll_fn(|cx| {
        let mut pending = false;
        for (publish, slot) in publishes.iter_mut().zip(done.iter_mut()) {
            if slot.is_some() {
                continue;
            }
            match publish.as_mut().poll(cx) {
                Poll::Ready(result) => *slot = Some(result.map_err(|_| Confirm::Failed)),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    });
    // A publish not written by the deadline may still be: its handoff timed out.
    let _ = tokio::time::timeout_at(until, all).await;
    done.into_iter()
        .map(|slot| slot.unwrap_or(Err(Confirm::TimedOut)))
        .collect()
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
