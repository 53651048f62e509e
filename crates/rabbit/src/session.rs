//! The consuming connection: topology, the consuming channel, the consume loop and the round
//! trips that confirm ACKs. Handoffs publish on a connection of their own (see
//! [`HandoffPublisher`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use lily_mq_core::transport::{
    AckWindow, Action, Authority, HandoffId, HandoffResult, SettleResult,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::connect::{refused, tls_refusal};
use crate::crew::Crew;
use crate::error::{Error, MissingPermission, Needs, missing_permission};
use crate::handoff::HandoffPublisher;
use crate::inline::Inline;
use crate::service::{Revoked, Shared};
use crate::sync::lock;
use crate::topology::{Applied, QueueKind, TopologyError, TopologyMode};
use crate::wire::Rewrites;

/// How long the probe publish that checks the `write` permission at start may wait for its
/// confirm before the session goes on without it.
const WRITE_CHECK: Duration = Duration::from_secs(2);

/// How long the consumer's `basic.cancel` may wait for its reply at shutdown; the budget runs.
const CANCEL_WAIT: Duration = Duration::from_secs(1);

/// How long a ready ACK marked on a worker waits for others to share its frame (see
/// [`Session::ack`]); tokio's timer rounds a deadline up to its next millisecond tick, so 1–2
/// ms. The consume loop's own ACKs do not wait for a timer (see [`crate::inline`]).
pub(crate) const ACK_LINGER: Duration = Duration::from_millis(1);

/// Longest a ready ACK waits for others to share its frame while the work queue holds a
/// backlog: more deliveries are on their way (tokio's timer adds up to a millisecond).
pub(crate) const BACKLOG_HOLD: Duration = Duration::from_millis(3);

/// Longest a ready ACK above a delivery still being handled waits for that one to settle, so
/// one `multiple` frame covers both, before it is written on its own; in a backlog, after the
/// [`BACKLOG_HOLD`] (see [`Pace`]).
const ACK_HOLD: Duration = Duration::from_millis(2);

/// How often written ACKs are confirmed by a `basic.qos` round trip.
const ACK_CONFIRM_INTERVAL: Duration = Duration::from_millis(200);

/// One connection and its channels.
pub(crate) struct Session {
    /// Identifies the consuming channel in the ledger's ACK evidence.
    pub(crate) id: u64,
    connection: Connection,
    consuming: Channel,
    /// The deliveries whose metadata the connection's stream rewrote (see [`crate::wire`]).
    rewrites: Rewrites,
    /// Deliveries open on the consuming channel and their ready ACKs.
    acks: Mutex<Acks>,
    /// Woken after every ACK flush.
    flushed: Notify,
    /// Ready ACKs that make a frame worth writing at once: half the prefetch.
    batch: usize,
    /// Whether the work queue held at least `batch` ready messages when last asked: the broker
    /// goes on delivering, so the consume loop's ACKs wait to share frames.
    backlog: AtomicBool,
    ended: CancellationToken,
}

/// How long ready ACKs wait, counted from when the oldest of them was marked, and when waiting
/// for more gains nothing; both depend on whether the work queue holds a backlog.
#[derive(Clone, Copy, Debug)]
struct Pace {
    /// Whether the work queue held a backlog when last asked.
    backlog: bool,
    /// For others to share their frame.
    linger: Duration,
    /// Above a delivery still being handled, for that one to settle; then they are written one
    /// frame each.
    hold: Duration,
}

impl Pace {
    /// In a backlog the ACKs of a batch wait for each other longer, and only those a flush
    /// left above an open delivery then wait for it: the hold runs out after the backlog hold,
    /// not during it.
    fn new(backlog: bool) -> Self {
        if backlog {
            Self {
                backlog,
                linger: BACKLOG_HOLD,
                hold: BACKLOG_HOLD + ACK_HOLD,
            }
        } else {
            Self {
                backlog,
                linger: ACK_LINGER,
                hold: ACK_HOLD,
            }
        }
    }

    /// Whether the ready ACKs of `window` should be written before their due time: see
    /// [`AckWindow::ripe`]. In a backlog more deliveries are coming even when none is open, so
    /// only a full batch counts ([`AckWindow::full`]).
    fn ripe(self, window: &AckWindow, batch: usize) -> bool {
        if self.backlog {
            window.full(batch)
        } else {
            window.ripe(batch)
        }
    }

    /// Whether a flush at `now` writes every ready ACK, those above an open delivery one frame
    /// each, rather than only what one `multiple` frame covers.
    fn held(self, since: Instant, now: Instant) -> bool {
        now >= since + self.hold
    }

    /// When the ACKs a flush at `now` left ready are next due.
    fn next_due(self, since: Instant, now: Instant) -> Instant {
        (now + self.linger).min(since + self.hold)
    }
}

/// The ACK window, when its ready ACKs are next written, and since when the oldest of them
/// waits.
struct Acks {
    window: AckWindow,
    due: Option<Instant>,
    since: Option<Instant>,
}

/// What one delivery may do to settle itself, and the only way its executor reaches the
/// broker: ACK, NACK or reject on the session's consuming channel, and publish a copy on the
/// handoff connection. Nothing is written once authority is revoked.
pub(crate) struct Settler<'a> {
    session: &'a Session,
    publisher: &'a HandoffPublisher,
    revoked: &'a Revoked,
    delivery_tag: u64,
}

impl Settler<'_> {
    /// Whether the delivery may still be settled: its channel is open and authority was not
    /// revoked.
    pub(crate) fn authority(&self) -> Authority {
        if self.session.consuming_open() && !self.revoked.is_revoked() {
            Authority::Held
        } else {
            Authority::Lost
        }
    }

    /// The session whose ledger evidence the ACK belongs to.
    pub(crate) fn session_id(&self) -> u64 {
        self.session.id
    }

    /// ACKs the delivery; see [`Session::ack`].
    pub(crate) async fn ack(&self) -> SettleResult {
        if self.revoked.is_revoked() {
            return SettleResult::Refused;
        }
        self.session.ack(self.delivery_tag, self.revoked).await
    }

    /// NACKs the delivery with requeue; see [`Session::settle`].
    pub(crate) fn requeue(&self) -> SettleResult {
        self.settle(Action::Requeue)
    }

    /// Rejects the delivery to the queue's dead-letter exchange; see [`Session::settle`].
    pub(crate) fn reject(&self) -> SettleResult {
        self.settle(Action::Reject)
    }

    fn settle(&self, action: Action) -> SettleResult {
        if self.revoked.is_revoked() {
            return SettleResult::Refused;
        }
        self.session.settle(self.delivery_tag, action)
    }

    /// A fresh id for the next copy to carry.
    pub(crate) fn next_handoff_id(&self) -> HandoffId {
        self.publisher.next_id()
    }

    /// Publishes a copy carrying `id` to `queue`; see [`HandoffPublisher::publish`].
    pub(crate) async fn publish(
        &self,
        queue: &str,
        id: HandoffId,
        body: &[u8],
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        self.publisher
            .publish(queue, id, body, properties, deadline)
            .await
    }
}

pub(crate) enum SessionEnd {
    /// The consumer was cancelled for shutdown; the session is still open.
    Shutdown(Arc<Session>),
    /// The connection or the consumer was lost.
    Lost,
    /// `stop` fired before consuming started.
    Stopped,
}

pub(crate) enum SessionError {
    Fatal(Error),
    Connect(lapin::Error),
}

impl Session {
    /// The first property, routing field or header key of delivery `delivery_tag` whose bytes
    /// were not valid UTF-8 (rewritten before lapin parsed them: see [`crate::wire`]).
    pub(crate) fn not_utf8(&self, delivery_tag: u64) -> Option<&'static str> {
        self.rewrites.take(self.consuming.id(), delivery_tag)
    }

    /// The settle handle of `delivery_tag`, one of this session's deliveries.
    pub(crate) fn settler<'a>(
        &'a self,
        delivery_tag: u64,
        publisher: &'a HandoffPublisher,
        revoked: &'a Revoked,
    ) -> Settler<'a> {
        Settler {
            session: self,
            publisher,
            revoked,
            delivery_tag,
        }
    }

    /// Whether the consuming channel is still open: its deliveries can be settled.
    pub(crate) fn consuming_open(&self) -> bool {
        self.consuming.status().connected()
    }

    /// Registers a delivery of the consuming channel, in the order the broker sent them.
    pub(crate) fn delivered(&self, delivery_tag: u64) {
        lock(&self.acks).window.deliver(delivery_tag);
    }

    /// ACKs `delivery_tag` together with the other ACKs that become ready about the same time.
    ///
    /// The ACK is marked ready and the task yields once. Tokio wakes a yielded task only after
    /// its worker thread has run the tasks already queued there (or at its periodic driver
    /// poll), so deliveries that finish together are marked as well. Unless the window is
    /// [ripe](AckWindow::ripe) (no delivery open that could become ready soon, or half the
    /// prefetch ready), the task then waits for more, [`ACK_LINGER`] after the oldest unwritten
    /// ACK was marked. The first task to find the window ripe or its time up writes the ready
    /// ACKs and wakes the others, which find their result there: the ones below the first
    /// delivery still being handled in one `multiple` frame, the others one frame each once
    /// the oldest has waited [`ACK_HOLD`] (until then they wait for it to settle). Nothing is
    /// written once authority is revoked: `revoked` is checked for every frame, as late as
    /// possible.
    ///
    /// While the work queue holds a backlog ([`Session::backlogged`]) the wait is
    /// [`BACKLOG_HOLD`] instead of the linger, and the window counts as ripe only with half the
    /// prefetch ready: more deliveries are on their way even when none is open. The ACKs left
    /// above a delivery still being handled then wait [`ACK_HOLD`] more for it ([`Pace`]).
    ///
    /// So from its mark to its result a delivery waits at most the longer hold (5–6 ms in a
    /// backlog, 2–3 ms otherwise) and a few polls. That is why the delivery executor can let a
    /// delivery in this section finish when the abort comes. A delivery that marked its ACK
    /// during the consume loop's first poll is parked there and polled again after the loop
    /// writes the parked ACKs ([`crate::inline`]), which it does before it ends, so before any
    /// shutdown phase; one whose ACK must wait for a delivery below it still being handled goes
    /// on on a task of its own, within the same bound.
    ///
    /// A tag the window does not hold open (never delivered here, or settled already) is
    /// refused, and nothing is written for it.
    pub(crate) async fn ack(&self, delivery_tag: u64, revoked: &Revoked) -> SettleResult {
        {
            let mut acks = lock(&self.acks);
            if !acks.window.ready(delivery_tag) {
                return SettleResult::Refused;
            }
            // The clock is read only when one is unset: a busy window has both, and each read
            // is time every delivery pays.
            if acks.since.is_none() || acks.due.is_none() {
                let now = Instant::now();
                acks.since.get_or_insert(now);
                acks.due
                    .get_or_insert(now + Pace::new(self.backlogged()).linger);
            }
        }
        tokio::task::yield_now().await;
        loop {
            // Most often a flush wrote it while this task yielded.
            if let Some(result) = lock(&self.acks).window.take(delivery_tag) {
                return result;
            }
            let mut notified = std::pin::pin!(self.flushed.notified());
            // Registered before the window is read, so a flush in between is not missed.
            notified.as_mut().enable();
            let due = {
                let acks = &mut *lock(&self.acks);
                if let Some(result) = acks.window.take(delivery_tag) {
                    return result;
                }
                let now = Instant::now();
                let ripe = Pace::new(self.backlogged()).ripe(&acks.window, self.batch);
                match acks.due {
                    Some(due) if now < due && !ripe => due,
                    _ => {
                        self.flush(acks, now, revoked, false, false);
                        match acks.window.take(delivery_tag) {
                            Some(result) => return result,
                            None => continue,
                        }
                    }
                }
            };
            // Woken by a flush or at the due time; either way the window is read again.
            let _ = tokio::time::timeout_at(due.into(), notified).await;
        }
    }

    /// Whether the work queue held a backlog (at least half the prefetch ready) when last asked.
    pub(crate) fn backlogged(&self) -> bool {
        self.backlog.load(Ordering::Relaxed)
    }

    /// Asks the broker how many messages the work queue holds ready (a passive declare, which
    /// needs no permission) and notes whether that is a backlog. False when the channel failed.
    async fn measure_backlog(&self, shared: &Shared) -> bool {
        let ready = ready_count(&self.consuming, &shared.queue).await;
        self.note_backlog(ready.as_ref().ok().copied());
        ready.is_ok()
    }

    /// Notes whether `ready` messages (none when unknown) are a backlog.
    fn note_backlog(&self, ready: Option<u32>) {
        let backlog = ready.is_some_and(|ready| ready as usize >= self.batch);
        self.backlog.store(backlog, Ordering::Relaxed);
    }

    /// Whether the ACK of `delivery_tag` is marked ready (or written already): its delivery
    /// waits for nothing else.
    pub(crate) fn ack_marked(&self, delivery_tag: u64) -> bool {
        lock(&self.acks).window.marked(delivery_tag)
    }

    /// Writes the ready ACKs now, as [`Session::ack`]'s flush does (those above a delivery still
    /// being handled wait for it, up to the hold), and wakes the deliveries waiting for theirs.
    /// Returns the write of the last frame while lapin's I/O loop has not sent it yet.
    pub(crate) fn flush_ready(&self, revoked: &Revoked) -> Option<Sending<'_>> {
        let acks = &mut *lock(&self.acks);
        if !acks.window.has_ready() {
            return None;
        }
        self.flush(acks, Instant::now(), revoked, false, true)
    }

    /// Writes the ready ACKs that are due (see [`Session::ack`]), or with `all` every one, and
    /// wakes the deliveries waiting for theirs. With `keep`, returns the last frame's write,
    /// boxed, while it is not sent yet (the consume loop waits for it); otherwise each frame's
    /// write is polled once and dropped.
    fn flush(
        &self,
        acks: &mut Acks,
        now: Instant,
        revoked: &Revoked,
        all: bool,
        keep: bool,
    ) -> Option<Sending<'_>> {
        let channel = &self.consuming;
        let mut sending = None;
        let write = |tag, multiple| {
            if revoked.is_revoked() {
                return SettleResult::Refused;
            }
            let frame = channel.basic_ack(tag, BasicAckOptions { multiple });
            if !keep {
                return queued(first_poll(frame));
            }
            let mut frame = Box::pin(frame);
            let poll = first_poll(frame.as_mut());
            if poll.is_pending() {
                sending = Some(frame as Sending<'_>);
            }
            queued(poll)
        };
        let pace = Pace::new(self.backlogged());
        let held = acks.since.is_some_and(|since| pace.held(since, now));
        if all || held || !acks.window.coalescing() {
            acks.window.flush(write);
        } else {
            acks.window.flush_covered(write);
        }
        if acks.window.has_ready() {
            // The rest wait for the deliveries below them, until the hold runs out.
            acks.due = Some(acks.since.map_or(now, |since| pace.next_due(since, now)));
        } else {
            acks.due = None;
            acks.since = None;
        }
        self.flushed.notify_waiters();
        sending
    }

    /// Writes the NACK or reject of `delivery_tag`, which must have come from this session's
    /// consuming channel and be settled only once (the `Settlement` machine's rule).
    /// The frame is queued (see [`queued`]) under the ACK window's lock, and the delivery leaves
    /// the window only after that, so no `multiple` ACK can cover it first.
    pub(crate) fn settle(&self, delivery_tag: u64, action: Action) -> SettleResult {
        let channel = &self.consuming;
        let mut acks = lock(&self.acks);
        let result = queued(match action {
            Action::Requeue => first_poll(channel.basic_nack(
                delivery_tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )),
            Action::Reject => first_poll(
                channel.basic_reject(delivery_tag, BasicRejectOptions { requeue: false }),
            ),
            // ACKs go through `ack`; a handoff is published on the confirm channel.
            Action::Ack | Action::Publish { .. } | Action::Hold(_) => return SettleResult::Refused,
        });
        if result == SettleResult::Written {
            acks.window.settled(delivery_tag);
        }
        result
    }

    /// Proves the broker processed every ACK written on the consuming channel before now: frames
    /// on a channel are handled in order, so a `basic.qos` reply comes after them. If the channel
    /// is gone, those ACKs are uncertain.
    pub(crate) async fn confirm_acks(&self, shared: &Shared) -> bool {
        let mark = lock(&shared.books.ledger).ack_mark();
        let confirmed = self
            .consuming
            .basic_qos(shared.config.prefetch, BasicQosOptions::default())
            .await
            .is_ok();
        let mut ledger = lock(&shared.books.ledger);
        if confirmed {
            ledger.confirm_acks(self.id, mark);
        } else {
            ledger.acks_uncertain(Some(self.id));
        }
        confirmed
    }

    /// Confirms the ACKs written so far, then closes the channels and the connection.
    pub(crate) async fn close(&self, shared: &Shared) {
        self.ended.cancel();
        if self.confirm_acks(shared).await {
            debug!("acks confirmed by a basic.qos round trip before close");
        } else {
            warn!("channel closed before its acks were confirmed; they are uncertain");
        }
        let _ = self.consuming.close(200, "lily shutdown".into()).await;
        let _ = self.connection.close(200, "lily shutdown".into()).await;
    }
}

/// Whether the broker's answer to the topology is final: access refused, a precondition failed
/// (a queue exists with other arguments), or in Verify mode something missing. Anything else
/// (the connection dropped in the middle of a declare, as a broker restart looks) is retried
/// with backoff like any lost connection.
fn definitive(err: &lapin::Error, mode: TopologyMode) -> bool {
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return false;
    };
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED) => {
            true
        }
        AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => mode == TopologyMode::Verify,
        _ => false,
    }
}

/// A connect error as the session loop sees it: definitive when the broker refused us.
fn connect_error(shared: &Shared, source: lapin::Error) -> SessionError {
    if refused(&source) {
        SessionError::Fatal(Error::Refused {
            queue: shared.config.queue.clone(),
            source,
        })
    } else if let Some(problem) = tls_refusal(&source) {
        SessionError::Fatal(Error::Tls {
            node: shared.dialer.endpoint().display(),
            problem,
            source,
        })
    } else {
        SessionError::Connect(source)
    }
}

/// The session's end when the broker refused a permission: final.
fn lacking(missing: MissingPermission, source: lapin::Error) -> SessionError {
    SessionError::Fatal(Error::Permission {
        missing: Box::new(missing),
        source,
    })
}

/// `source` of a request that needs `needs`: final when the broker refused one of them, a
/// lost connection otherwise.
fn permission_error(
    source: lapin::Error,
    doing: impl FnOnce() -> String,
    needs: &[Needs<'_>],
) -> SessionError {
    match missing_permission(&source, doing, needs) {
        Some(missing) => lacking(missing, source),
        None => SessionError::Connect(source),
    }
}

/// A session's connection and consuming channel, from [`open`].
struct Opened {
    connection: Connection,
    consuming: Channel,
    rewrites: Rewrites,
    consumer: lapin::Consumer,
    /// The messages the work queue held ready just after `basic.consume`; `None` when the
    /// broker did not say.
    ready: Option<u32>,
}

/// Opens a session up to its consumer: the connection, the topology and the consuming channel
/// with its prefetch, the handoff publisher's connection, then `basic.consume`.
///
/// The handoff connection is readied while the consuming connection declares the topology:
/// neither waits for the other, which takes about a third off the start (a connection and a
/// confirmed probe, 5–13 ms on loopback). Their errors come in the order the steps have:
/// the consuming connection's and the topology's first, at once, and the handoff
/// connection's only once the topology is in place. Nothing is consumed before both are
/// ready.
async fn open(shared: &Shared) -> Result<Opened, SessionError> {
    let (connection, consuming, rewrites) =
        first_then(declare(shared), ready_handoffs(shared)).await?;
    // Sent together: the passive declare that measures the backlog goes out behind
    // `basic.consume` without waiting for its reply.
    let consume = consuming.basic_consume(
        shared.queue.as_ref().into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    );
    let (consumer, ready) = tokio::join!(consume, ready_count(&consuming, &shared.queue));
    let consumer = consumer.map_err(|source| {
        let needs = [Needs::queue(&shared.queue, "read")];
        let doing = || format!("consume from queue '{}'", shared.queue);
        permission_error(source, doing, &needs)
    })?;
    Ok(Opened {
        connection,
        consuming,
        rewrites,
        consumer,
        ready: ready.ok(),
    })
}

/// How many messages `queue` holds ready, by a passive declare on `channel` (which needs no
/// permission).
async fn ready_count(channel: &Channel, queue: &str) -> lapin::Result<u32> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?;
    Ok(declared.message_count())
}

/// Connects the consuming connection, declares the topology and readies the consuming
/// channel with its prefetch.
///
/// In [`TopologyMode::Declare`] the consuming channel carries the declarations, without
/// their replies (see [`crate::topology::Topology::declare_unanswered`]), and its
/// `basic.qos` proves them. Only when that fails are they declared again, one reply each, on
/// a channel of their own, to find the refusal and the permission it needs. Verification
/// always goes that way.
async fn declare(shared: &Shared) -> Result<(Connection, Channel, Rewrites), SessionError> {
    // Only quorum queues' arguments depend on the broker's version.
    let (connection, version, rewrites) = shared
        .dialer
        .connect_consuming(shared.config.queue_kind == QueueKind::Quorum)
        .await
        .map_err(|e| connect_error(shared, e))?;
    let topology = shared.topology.clone().broker(version);
    let prefetch = |channel: Channel| async move {
        channel
            .basic_qos(shared.config.prefetch, BasicQosOptions::default())
            .await
            .map(|()| channel)
    };
    if shared.config.topology == TopologyMode::Declare {
        let channel = connection
            .create_channel()
            .await
            .map_err(SessionError::Connect)?;
        if topology.declare_unanswered(&channel).await.is_ok()
            && let Ok(consuming) = prefetch(channel).await
        {
            return Ok((connection, consuming, rewrites));
        }
    }
    let setup = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    let mut applied = topology.apply(&setup, shared.config.topology).await;
    if let Err(TopologyError { source, .. }) = &applied
        && topology.declares_unlimited()
        && refuses_delivery_limit(source)
    {
        // Declared before the broker limited deliveries: declared again as they are.
        let setup = connection
            .create_channel()
            .await
            .map_err(SessionError::Connect)?;
        applied = shared.topology.apply(&setup, shared.config.topology).await;
        if applied.is_ok() {
            warn!(
                queue = %shared.queue,
                broker = %version.map(|v| v.to_string()).unwrap_or_default(),
                "the queues were declared without x-delivery-limit, before RabbitMQ 4.0: each has the broker's default delivery limit (20) unless a policy sets delivery-limit -1, and the DLQ and the parking lane drop a message read and given back that often; see the compatibility chapter"
            );
        }
    }
    let applied = applied.map_err(|TopologyError { missing, source }| match missing {
        Some(missing) => lacking(missing, source),
        None if definitive(&source, shared.config.topology) => {
            SessionError::Fatal(Error::Topology {
                queue: shared.config.queue.clone(),
                source,
            })
        }
        None => SessionError::Connect(source),
    })?;
    if let Applied::ExistenceOnly(missing) = applied {
        warn!(queue = %shared.queue, lacks = %missing, "topology verified by existence only: the queues' arguments (type, dead-lettering, TTLs) were not checked");
    }
    // Dropping the channel closes it without waiting for the broker's close-ok.
    drop(setup);
    let consuming = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    let consuming = prefetch(consuming).await.map_err(SessionError::Connect)?;
    Ok((connection, consuming, rewrites))
}

/// Whether the broker refused a declaration because an existing queue has another
/// `x-delivery-limit` (406 `inequivalent arg 'x-delivery-limit'`).
fn refuses_delivery_limit(err: &lapin::Error) -> bool {
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return false;
    };
    matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) && amqp
        .get_message()
        .to_string()
        .contains("'x-delivery-limit'")
}

/// Opens the handoff publisher's connection and checks that it may publish.
async fn ready_handoffs(shared: &Shared) -> Result<(), SessionError> {
    shared
        .publisher
        .warm(shared.dialer.endpoint())
        .await
        .map_err(|e| connect_error(shared, e))?;
    // Publishing a probe now, rather than the first handoff, finds a missing `write` at start.
    // A node in a resource alarm reads nothing more from a publishing connection, so the check
    // then waits no longer than WRITE_CHECK: handoffs wait for the alarm anyway, and the
    // deliveries that succeed must still be consumed and ACKed.
    match tokio::time::timeout(WRITE_CHECK, shared.publisher.check_write()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(source)) => {
            let needs = [Needs::exchange("", "write")];
            Err(permission_error(
                source,
                || "publish handoff copies".into(),
                &needs,
            ))
        }
        Err(_) => {
            debug!(queue = %shared.queue, "write permission not checked: the handoff connection does not answer (a resource alarm?)");
            Ok(())
        }
    }
}

/// Runs `first` and `second` together and returns `first`'s value once both succeeded.
/// `first`'s error ends it at once (`second` is dropped, as a `stop` during the start drops
/// both); `second`'s is returned only once `first` succeeded, so the error is the one the two
/// would have met one after the other.
async fn first_then<T, E>(
    first: impl Future<Output = Result<T, E>>,
    second: impl Future<Output = Result<(), E>>,
) -> Result<T, E> {
    let mut first = std::pin::pin!(first);
    let mut second = std::pin::pin!(second);
    let mut seconded = None;
    let value = loop {
        tokio::select! {
            value = &mut first => break value?,
            done = &mut second, if seconded.is_none() => seconded = Some(done),
        }
    };
    match seconded {
        Some(done) => done?,
        None => second.await?,
    }
    Ok(value)
}

/// Connects, declares the topology and consumes until `stop` fires or the connection is lost.
/// A `stop` that comes while connecting or declaring ends it at once: a broker that does not
/// answer must not hold the shutdown there.
pub(crate) async fn consume(
    shared: &Arc<Shared>,
    tracker: &TaskTracker,
    crew: &Arc<Crew>,
    stop: &CancellationToken,
) -> Result<SessionEnd, SessionError> {
    let Opened {
        connection,
        consuming,
        rewrites,
        mut consumer,
        ready,
    } = tokio::select! {
        opened = open(shared) => opened?,
        () = stop.cancelled() => return Ok(SessionEnd::Stopped),
    };
    info!(queue = %shared.queue, node = %shared.dialer.node(), "consuming");
    let session = Arc::new(Session {
        id: shared.sessions.fetch_add(1, Ordering::Relaxed),
        connection,
        consuming,
        rewrites,
        acks: Mutex::new(Acks {
            window: AckWindow::new(),
            due: None,
            since: None,
        }),
        flushed: Notify::new(),
        batch: usize::from(shared.config.prefetch / 2).max(1),
        backlog: AtomicBool::new(false),
        ended: CancellationToken::new(),
    });
    // A backlog that waits for the consumer is known from its first delivery on.
    session.note_backlog(ready);
    tokio::spawn(confirm_periodically(
        Arc::clone(shared),
        Arc::clone(&session),
    ));
    shared.ready.store(true, Ordering::Release);
    // Registered once for the whole loop, not once per delivery.
    let mut stopped = std::pin::pin!(stop.cancelled());
    let revoked = &shared.signals.revoked;
    let mut inline = Inline::new(session.batch);
    // Hired for the next delivery; kept when the loop finished the last one itself.
    let mut worker = None;
    let mut unparseable = false;
    let end = loop {
        // Deliveries that finish on the loop never wait here: give other tasks their turn.
        tokio::task::consume_budget().await;
        if stop.is_cancelled() {
            break Some(());
        }
        // A worker first: it bounds how many deliveries are taken off the consumer, and the
        // loop runs a handler only while it holds one.
        let hired = match worker.take() {
            Some(hired) => hired,
            None => {
                // Parked ACKs do not wait for a worker to come free.
                inline.settle(&session, revoked, tracker);
                tokio::select! {
                    hired = crew.hire(tracker) => match hired {
                        Some(hired) => hired,
                        None => break Some(()),
                    },
                    () = &mut stopped => break Some(()),
                }
            }
        };
        let mut next = std::future::poll_fn(|cx| std::pin::Pin::new(&mut consumer).poll_next(cx));
        let next = match first_poll(&mut next) {
            std::task::Poll::Ready(next) => Some(next),
            // Nothing buffered: the parked ACKs go out once the last ACK frame has been sent
            // (at once when none is on its way); meanwhile more may join them.
            // While the queue holds a backlog, more are on their way: they share the frame,
            // which goes out once half the prefetch is parked or the oldest has waited
            // `BACKLOG_HOLD`.
            std::task::Poll::Pending => loop {
                let parked = inline.parked();
                // Set whenever something is parked: no clock read here.
                let until = inline.hold_until().filter(|_| session.backlogged());
                let hold = until.is_some();
                tokio::select! {
                    next = &mut next => break Some(next),
                    () = inline.sent(), if parked && !hold => inline.settle(&session, revoked, tracker),
                    () = async {
                        if let Some(at) = until {
                            tokio::time::sleep_until(at.into()).await;
                        }
                    }, if hold => {
                        inline.settle(&session, revoked, tracker);
                    }
                    () = &mut stopped => break None,
                }
            },
        };
        match next {
            Some(Some(Ok(delivery))) => {
                let tag = delivery.delivery_tag;
                session.delivered(tag);
                match crate::delivery::work(shared, &session, delivery)
                    .and_then(|work| inline.start(work, &session, tag))
                {
                    Some(job) => hired.assign(job),
                    None => worker = Some(hired),
                }
                if inline.full() {
                    inline.settle(&session, revoked, tracker);
                }
            }
            Some(Some(Err(err))) => {
                worker = Some(hired);
                if matches!(err.kind(), lapin::ErrorKind::ParsingError(_)) {
                    // Nothing of the frame is logged: it may hold a body.
                    warn!(queue = %shared.queue, "a frame from the broker could not be parsed");
                    unparseable = true;
                } else {
                    debug!(queue = %shared.queue, error = %err, "consumer error");
                }
            }
            Some(None) => {
                worker = Some(hired);
                break None;
            }
            None => {
                worker = Some(hired);
                break Some(());
            }
        }
    };
    if let Some(hired) = worker {
        crew.release(hired);
    }
    // Before the session ends, so that when every worker is done every delivery is.
    inline.settle(&session, revoked, tracker);
    drop(inline);
    shared.ready.store(false, Ordering::Release);
    if end.is_none() {
        session.ended.cancel();
        shared.metrics.connections_lost.increment(1);
        {
            let mut incidents = lock(&shared.books.incidents);
            incidents.connections_lost += 1;
            if unparseable {
                shared.metrics.unparseable_frames.increment(1);
                incidents.unparseable_frames += 1;
            }
        }
        // The channel may still be open (the broker cancelled the consumer): confirm what it
        // can; otherwise the ACKs written on it are uncertain.
        session.confirm_acks(shared).await;
        return Ok(SessionEnd::Lost);
    }
    // Bounded: a broker that stopped answering must not hold the shutdown here.
    let cancel = session
        .consuming
        .basic_cancel(consumer.tag(), BasicCancelOptions::default());
    if tokio::time::timeout(CANCEL_WAIT, cancel).await.is_err() {
        warn!(queue = %shared.queue, "the broker did not confirm the consumer's cancel in time");
    }
    Ok(SessionEnd::Shutdown(session))
}

/// Confirms written ACKs every [`ACK_CONFIRM_INTERVAL`] while the session lives, and asks the
/// broker each time whether the work queue holds a backlog. When the channel dies, its
/// unconfirmed ACKs become uncertain.
async fn confirm_periodically(shared: Arc<Shared>, session: Arc<Session>) {
    loop {
        tokio::select! {
            () = session.ended.cancelled() => break,
            () = tokio::time::sleep(ACK_CONFIRM_INTERVAL) => {}
        }
        if lock(&shared.books.ledger).acks_awaiting() > 0 && !session.confirm_acks(&shared).await {
            break;
        }
        if !session.measure_backlog(&shared).await {
            break;
        }
    }
}

/// What the first poll of a frame write says: queued unless the channel refused it.
///
/// The frame joins the connection's frame queue during that poll, behind every frame queued
/// before it and ahead of any later `basic.qos` on the channel, so the round trip of
/// [`Session::confirm_acks`] proves it like any other. Waiting for the socket write would prove
/// nothing more and cost the delivery's task a wake-up, so the write's own completion is not
/// awaited; a closed channel refuses the frame at once. Settling on the channel rather than
/// through lapin's `Acker` also skips its hop through the connection's internal task. Channels
/// are never recovered under the same id (Lily reconnects with a new session), so a tag cannot
/// settle another delivery.
fn queued(poll: std::task::Poll<lapin::Result<()>>) -> SettleResult {
    match poll {
        std::task::Poll::Ready(Err(_)) => SettleResult::Refused,
        _ => SettleResult::Written,
    }
}

/// An ACK frame's write, which completes once lapin's I/O loop has sent the frame.
pub(crate) type Sending<'a> = Pin<Box<dyn Future<Output = lapin::Result<()>> + Send + 'a>>;

/// Polls `future` once, without a task to wake: what it does on its first poll is done.
pub(crate) fn first_poll<F: Future>(future: F) -> std::task::Poll<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    future.as_mut().poll(&mut cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Long enough for a future that is never woken to count as stuck.
    const STUCK: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn the_start_runs_the_topology_and_the_handoff_connection_together() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The first can finish only once the second ran: one after the other never ends.
        let first = async { rx.await.map_err(|_| "the second was dropped") };
        let second = async { tx.send(7).map_err(|_| "the first was dropped") };
        let started = tokio::time::timeout(STUCK, first_then(first, second)).await;
        assert_eq!(started, Ok(Ok(7)));
    }

    #[tokio::test]
    async fn an_error_of_the_topology_ends_the_start_at_once() {
        let first = async { Err::<(), _>("topology") };
        let second = std::future::pending::<Result<(), &str>>();
        let started = tokio::time::timeout(STUCK, first_then(first, second)).await;
        assert_eq!(started, Ok(Err("topology")));
    }

    #[tokio::test]
    async fn an_error_of_the_handoff_connection_waits_for_the_topology() {
        let later = |result: Result<(), &'static str>| async move {
            // The second has failed by the time the first ends.
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            result
        };
        let write = async { Err("write") };
        assert_eq!(
            first_then(later(Err("topology")), write).await,
            Err("topology")
        );
        let write = async { Err("write") };
        assert_eq!(first_then(later(Ok(())), write).await, Err("write"));
    }

    #[test]
    fn outside_a_backlog_acks_above_an_open_delivery_wait_the_hold_for_it() {
        let pace = Pace::new(false);
        let since = Instant::now();
        // The linger ran out: what one frame covers is written, the rest wait for the hold.
        assert!(!pace.held(since, since + ACK_LINGER));
        assert_eq!(pace.next_due(since, since + ACK_LINGER), since + ACK_HOLD);
        assert!(pace.held(since, since + ACK_HOLD));
    }

    #[test]
    fn in_a_backlog_the_hold_for_an_open_delivery_starts_after_the_backlog_hold() {
        let pace = Pace::new(true);
        let since = Instant::now();
        // The batch's wait ran out: what one frame covers is written, and the ACKs left above
        // an open delivery are not written one by one yet.
        assert!(!pace.held(since, since + BACKLOG_HOLD));
        assert_eq!(
            pace.next_due(since, since + BACKLOG_HOLD),
            since + BACKLOG_HOLD + ACK_HOLD
        );
        assert!(!pace.held(since, since + BACKLOG_HOLD + ACK_HOLD - MS));
        assert!(pace.held(since, since + BACKLOG_HOLD + ACK_HOLD));
        // Written early because a batch was full, the rest wait a backlog hold for the next.
        assert_eq!(pace.next_due(since, since + MS), since + MS + BACKLOG_HOLD);
    }
}
