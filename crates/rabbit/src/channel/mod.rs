//! The consuming channel: its ACK window, paced by core's [`AckPacer`], and the frames that
//! settle its deliveries. One delivery reaches it through its [`Settler`]; the consume loop that
//! feeds it is [`crate::consume`]. Handoffs publish on a connection of their own (see
//! [`HandoffPublisher`](crate::copy::handoff::HandoffPublisher)).

mod settler;

use std::pin::Pin;
use std::sync::Mutex;
use std::time::Instant;

use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use lily_mq_core::transport::{AckPacer, Action, SettleResult};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::service::{Revoked, Shared};
use crate::sync::lock;
use crate::wire::Rewrites;

pub(crate) use settler::Settler;

/// One connection and its consuming channel.
pub(crate) struct Session {
    /// Identifies the consuming channel in the ledger's ACK evidence.
    pub(crate) id: u64,
    connection: Connection,
    consuming: Channel,
    /// The deliveries whose metadata the connection's stream rewrote (see [`crate::wire`]).
    rewrites: Rewrites,
    /// Deliveries open on the consuming channel, their ready ACKs and when those are written.
    acks: Mutex<AckPacer>,
    /// Woken after every ACK flush.
    flushed: Notify,
    /// Cancelled when the session ends: its periodic round trips stop.
    pub(crate) ended: CancellationToken,
}

impl Session {
    /// A session on `consuming`, a channel of `connection` with prefetch `prefetch`.
    pub(crate) fn new(
        id: u64,
        connection: Connection,
        consuming: Channel,
        rewrites: Rewrites,
        prefetch: u16,
    ) -> Self {
        Self {
            id,
            connection,
            consuming,
            rewrites,
            acks: Mutex::new(AckPacer::new(prefetch)),
            flushed: Notify::new(),
            ended: CancellationToken::new(),
        }
    }

    /// The consuming channel.
    pub(crate) fn consuming(&self) -> &Channel {
        &self.consuming
    }

    /// Ready ACKs that make a frame worth writing at once: half the prefetch.
    pub(crate) fn batch(&self) -> usize {
        lock(&self.acks).batch()
    }

    /// The first property, routing field or header key of delivery `delivery_tag` whose bytes
    /// were not valid UTF-8 (rewritten before lapin parsed them: see [`crate::wire`]).
    pub(crate) fn not_utf8(&self, delivery_tag: u64) -> Option<&'static str> {
        self.rewrites.take(self.consuming.id(), delivery_tag)
    }

    /// Whether the consuming channel is still open: its deliveries can be settled.
    pub(crate) fn consuming_open(&self) -> bool {
        self.consuming.status().connected()
    }

    /// Registers a delivery of the consuming channel, in the order the broker sent them.
    pub(crate) fn delivered(&self, delivery_tag: u64) {
        lock(&self.acks).deliver(delivery_tag);
    }

    /// ACKs `delivery_tag` together with the other ACKs that become ready about the same time.
    ///
    /// The ACK is marked ready and the task yields once. Tokio wakes a yielded task only after its
    /// worker thread has run the tasks already queued there (or at its periodic driver poll), so
    /// deliveries that finish together are marked as well. Unless the window is
    /// [ripe](lily_mq_core::transport::AckWindow::ripe) (no delivery open that could become ready
    /// soon, or half the prefetch ready), the task then waits for more,
    /// [`ACK_LINGER`](lily_mq_core::transport::ACK_LINGER) after the oldest unwritten ACK was
    /// marked. The first task to find the window ripe or its time up writes the ready ACKs and
    /// wakes the others, which find their result there: the ones below the first delivery still
    /// being handled in one `multiple` frame, the others one frame each once the oldest has waited
    /// [`ACK_HOLD`](lily_mq_core::transport::ACK_HOLD) (until then they wait for it to settle).
    /// Nothing is written once authority is revoked: `revoked` is checked for every frame, as late
    /// as possible.
    ///
    /// While the work queue holds a backlog ([`Session::backlogged`]) the wait is
    /// [`BACKLOG_HOLD`](lily_mq_core::transport::BACKLOG_HOLD) instead of the linger, and the
    /// window counts as ripe only with half the prefetch ready: more deliveries are on their way
    /// even when none is open. The ACKs left above a delivery still being handled then wait
    /// [`ACK_HOLD`](lily_mq_core::transport::ACK_HOLD) more for it ([`AckPacer`]).
    ///
    /// So from its mark to its result a delivery waits at most the longer hold (5–6 ms in a
    /// backlog, 2–3 ms otherwise) and a few polls. That is why the delivery executor can let a
    /// delivery in this section finish when the abort comes. A delivery that marked its ACK during
    /// the consume loop's first poll is parked there and polled again after the loop writes the
    /// parked ACKs ([`crate::consume::inline`]), which it does before it ends, so before any
    /// shutdown phase; one whose ACK must wait for a delivery below it still being handled goes on
    /// on a task of its own, within the same bound.
    ///
    /// A tag the window does not hold open (never delivered here, or settled already) is refused,
    /// and nothing is written for it.
    pub(crate) async fn ack(&self, delivery_tag: u64, revoked: &Revoked) -> SettleResult {
        if !lock(&self.acks).ready(delivery_tag, Instant::now) {
            return SettleResult::Refused;
        }
        tokio::task::yield_now().await;
        loop {
            // Most often a flush wrote it while this task yielded.
            if let Some(result) = lock(&self.acks).take(delivery_tag) {
                return result;
            }
            let mut notified = std::pin::pin!(self.flushed.notified());
            // Registered before the window is read, so a flush in between is not missed.
            notified.as_mut().enable();
            let due = {
                let acks = &mut *lock(&self.acks);
                if let Some(result) = acks.take(delivery_tag) {
                    return result;
                }
                let written = acks.poll_flush(Instant::now(), |tag, multiple| {
                    self.write_ack(tag, multiple, revoked)
                });
                if written {
                    self.flushed.notify_waiters();
                }
                match (acks.take(delivery_tag), acks.poll_timeout()) {
                    (Some(result), _) => return result,
                    (None, Some(due)) if !written => due,
                    (None, _) => continue,
                }
            };
            // Woken by a flush or at the due time; either way the window is read again.
            let _ = tokio::time::timeout_at(due.into(), notified).await;
        }
    }

    /// Writes one ACK frame, unless authority is revoked; its write is polled once and dropped
    /// (see [`queued`]).
    fn write_ack(&self, tag: u64, multiple: bool, revoked: &Revoked) -> SettleResult {
        if revoked.is_revoked() {
            return SettleResult::Refused;
        }
        queued(first_poll(
            self.consuming.basic_ack(tag, BasicAckOptions { multiple }),
        ))
    }

    /// Whether the work queue held a backlog (at least half the prefetch ready) when last asked.
    pub(crate) fn backlogged(&self) -> bool {
        lock(&self.acks).backlogged()
    }

    /// Asks the broker how many messages the work queue holds ready (a passive declare, which
    /// needs no permission) and notes whether that is a backlog. False when the channel failed.
    pub(crate) async fn measure_backlog(&self, shared: &Shared) -> bool {
        let ready = ready_count(&self.consuming, &shared.queue).await;
        self.note_backlog(ready.as_ref().ok().copied());
        ready.is_ok()
    }

    /// Notes whether `ready` messages (none when unknown) are a backlog.
    pub(crate) fn note_backlog(&self, ready: Option<u32>) {
        lock(&self.acks).set_backlog(ready);
    }

    /// Whether the ACK of `delivery_tag` is marked ready (or written already): its delivery
    /// waits for nothing else.
    pub(crate) fn ack_marked(&self, delivery_tag: u64) -> bool {
        lock(&self.acks).marked(delivery_tag)
    }

    /// Writes the ready ACKs now, as [`Session::ack`]'s flush does (those above a delivery still
    /// being handled wait for it, up to the hold), and wakes the deliveries waiting for theirs.
    /// Returns the write of the last frame while lapin's I/O loop has not sent it yet.
    pub(crate) fn flush_ready(&self, revoked: &Revoked) -> Option<Sending<'_>> {
        let acks = &mut *lock(&self.acks);
        if !acks.has_ready() {
            return None;
        }
        let mut sending = None;
        acks.flush(Instant::now(), |tag, multiple| {
            if revoked.is_revoked() {
                return SettleResult::Refused;
            }
            let mut frame = Box::pin(self.consuming.basic_ack(tag, BasicAckOptions { multiple }));
            let poll = first_poll(frame.as_mut());
            if poll.is_pending() {
                sending = Some(frame as Sending<'_>);
            }
            queued(poll)
        });
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
            acks.settled(delivery_tag);
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

/// How many messages `queue` holds ready, by a passive declare on `channel` (which needs no
/// permission).
pub(crate) async fn ready_count(channel: &Channel, queue: &str) -> lapin::Result<u32> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?;
    Ok(declared.message_count())
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
