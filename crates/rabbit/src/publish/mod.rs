//! A confirm pool: a connection of its own, and a few confirm channels on which publishes are
//! pipelined. The handoff publisher and the public [`Publisher`](crate::Publisher) are both built
//! on it.
//!
//! - **Own connection.** RabbitMQ blocks a publishing connection during a memory or disk alarm, and
//!   lapin then writes nothing on it. Publishing copies on the consuming connection would stall its
//!   ACKs, the `basic.qos` round trips that confirm them, `basic.cancel` and close.
//! - **Pipelined.** Publishes take turns among [`WORKERS`] workers, each owning one confirm
//!   channel. A worker publishes what it is given at once, each carrying its [`HandoffId`] in the
//!   pool's id header, without waiting for earlier publishes' confirms or for one to be written
//!   before the next, so a copy that comes while the broker syncs its queues to disk joins the sync
//!   under way instead of waiting for the one after it. Each publish has a waker of its own, which
//!   notes it in its channel's wake list; the worker polls what woke, and at each quiet point
//!   (nothing left in the list) [`InFlight`] judges every publish whose evidence is complete: a
//!   return counts only against the publish whose id it carries, and an ACK proves the copy was
//!   stored only once its return, had there been one, must have been seen (see `lily_mq_core`'s
//!   `confirms` module for why the order of wake-ups proves that).
//! - **Channel errors.** A channel error fails every publish in flight on it that has no evidence
//!   yet. No handoff copy is known to cause one: what RabbitMQ checks per message (`user_id`,
//!   `expiration`, `CC`/`BCC`) is moved aside on copies, copies go through the default exchange for
//!   every lane, and the broker's `max_message_size` counts the body, which is the original's.
//! - **Channels.** A channel whose evidence is confused (a publish timed out or failed, a return
//!   without a known id) is dropped at once, and lapin closes it with its last handle, which also
//!   discards the confirms it still kept for publishes nobody awaits any more; the worker opens a
//!   new one for what comes next. A channel that was nacked takes nothing new and is dropped once
//!   what is in flight on it is judged: a quorum queue with `overflow: reject-publish` tells each
//!   channel publishing to it that it is full, and RabbitMQ may never tell that channel otherwise
//!   once the queue takes messages again (rabbitmq-server#12206: a cleared `max-length` policy), so
//!   the lane would fail for good.
//! - **Blocked.** While the broker blocks the connection, nothing is published: publishes wait for
//!   the unblock within their deadline and otherwise fail as [`HandoffResult::Blocked`], so no
//!   message lands later, after its sender gave up on it. RabbitMQ only says a connection is
//!   blocked once it publishes during the alarm, and that publish stays unread until the alarm
//!   clears. So when the connection has had no confirm for [`PROBE_AFTER`](link::PROBE_AFTER), a
//!   worker first publishes a probe that RabbitMQ drops (not mandatory, to a queue name no queue
//!   can have) and holds its publishes until the probe is confirmed: if an alarm started in the
//!   quiet, the probe is what stays stuck, not a message. Under a steady stream of publishes their
//!   own confirms are the evidence and no probe is sent; a message published in the instant an
//!   alarm starts can still be held by the broker, time out and land later.
//! - **Refused.** A publish the broker refuses for want of a permission (`ACCESS_REFUSED`: `write`
//!   on the exchange, taken from the user while Lily runs) closes its channel. The pool then knows
//!   it is refused and names the permission ([`Confirms::refused`]). One worker at a time, at most
//!   every [`REFUSED_RETRY`](link::REFUSED_RETRY), opens a channel and tries what it holds (a probe
//!   first, after a quiet spell); the others' publishes wait for that try's answer, at most
//!   [`TRY_WAIT`](link::TRY_WAIT), and are otherwise answered [`HandoffResult::Refused`] at once,
//!   without a channel. So a refusal costs the broker a few channels a second, not one per publish,
//!   and the first publish it confirms once the permission is granted again ends the refusal,
//!   without a reconnect. The refusal is the pool's, not one exchange's: the handoff copies all go
//!   through the default exchange; a [`Publisher`](crate::Publisher) publishing to several
//!   exchanges, one of them refused, publishes to all at that pace.

mod link;
pub(crate) mod outgoing;
pub(crate) mod publisher;
mod request;
mod worker;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use lily_mq_core::transport::{HandoffId, HandoffResult};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

use self::link::{Link, confirm_channel, probe};
use self::request::{Copy, Request};
pub(crate) use self::request::{Role, Route};
use self::worker::work;
use crate::connect::{Dialer, Endpoint};
use crate::error::MissingPermission;
use crate::sync::lock;

/// Confirm channels publishing, each with many publishes in flight.
const WORKERS: usize = 4;

/// Publishes with confirms on a connection of its own.
pub(crate) struct Confirms {
    link: Arc<Link>,
    /// Each worker's queue; publishes take turns.
    requests: Vec<mpsc::UnboundedSender<Request>>,
    turn: AtomicUsize,
    /// Taken by the first [`Confirms::warm`], which starts the workers.
    pending: Mutex<Vec<mpsc::UnboundedReceiver<Request>>>,
    closed: CancellationToken,
    /// The workers, which [`Confirms::close`] waits for before it closes the connection.
    workers: TaskTracker,
}

impl Confirms {
    /// A pool for `role`, labelled `label` (the work queue of a consumer) in connection names
    /// and metrics. It connects on [`Confirms::warm`].
    pub(crate) fn new(label: &str, role: Role) -> Self {
        let (requests, pending) = (0..WORKERS).map(|_| mpsc::unbounded_channel()).unzip();
        Self {
            link: Arc::new(Link::new(label, role)),
            requests,
            turn: AtomicUsize::new(0),
            pending: Mutex::new(pending),
            closed: CancellationToken::new(),
            workers: TaskTracker::new(),
        }
    }

    /// Whether the broker blocks the connection (a resource alarm): publishes wait.
    pub(crate) fn blocked(&self) -> bool {
        self.link.blocked.load(Ordering::Acquire)
    }

    /// The permission the broker refuses the pool's publishes for, while it does: publishes
    /// answer [`HandoffResult::Refused`] until one is confirmed again.
    pub(crate) fn refused(&self) -> Option<MissingPermission> {
        lock(&self.link.refusal).missing.clone()
    }

    /// The permission the broker last refused the pool's publishes for, if it ever did.
    pub(crate) fn last_refused(&self) -> Option<MissingPermission> {
        lock(&self.link.refusal).last.clone()
    }

    /// How many times the broker came to refuse the pool's publishes, for its life.
    pub(crate) fn refusals(&self) -> u64 {
        lock(&self.link.refusal).spells
    }

    /// Opens the connection, so a broker that refuses it is known before the first publish,
    /// and the first time takes `endpoint`, which it dials on its own (the pool's connection may
    /// land on another node than a consumer's), and starts the workers.
    pub(crate) async fn warm(&self, endpoint: &Endpoint) -> lapin::Result<()> {
        self.link
            .dialer
            .get_or_init(|| Dialer::new(endpoint.clone(), self.link.role.name));
        self.link.connection().await?;
        self.start(endpoint);
        Ok(())
    }

    /// Takes `endpoint` the first time and starts the workers without connecting: the first
    /// publish dials.
    pub(crate) fn start(&self, endpoint: &Endpoint) {
        self.link
            .dialer
            .get_or_init(|| Dialer::new(endpoint.clone(), self.link.role.name));
        for requests in std::mem::take(&mut *lock(&self.pending)) {
            self.workers
                .spawn(work(Arc::clone(&self.link), requests, self.closed.clone()));
        }
    }

    /// Publishes one probe on a channel of its own and awaits its confirm: the broker refuses
    /// it (`ACCESS_REFUSED`, closing that channel only) when the user may not write to the
    /// default exchange. The probe's routing key names no queue, so it goes nowhere.
    pub(crate) async fn check_write(&self) -> lapin::Result<()> {
        let connection = self.link.connection().await?;
        let channel = confirm_channel(&connection).await?;
        // Dropping the channel closes it without waiting for the broker's close-ok.
        probe(&channel).await
    }

    /// A fresh id for the next publish to carry in the role's id header.
    pub(crate) fn next_id(&self) -> HandoffId {
        self.link.next_id()
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
        let turn = self.turn.fetch_add(1, Ordering::Relaxed) % self.requests.len();
        if self.requests[turn].send(Request { copy, reply }).is_err() {
            return HandoffResult::Failed;
        }
        // Its worker answers by this message's deadline (one whose deadline passed before it
        // could be published fails unpublished); the worker is gone only once the pool closed.
        result.await.unwrap_or(HandoffResult::Failed)
    }

    /// Stops the workers and closes the connection, waiting at most `within`: a blocked
    /// connection writes nothing, not even its close.
    pub(crate) async fn close(&self, within: Duration) {
        let until = Instant::now() + within;
        self.closed.cancel();
        // The workers close their channels first: lapin logs a channel that closes while the
        // connection does (as one dropped then) as a connection error.
        self.workers.close();
        let _ = tokio::time::timeout_at(until, self.workers.wait()).await;
        let Some(connection) = lock(&self.link.current).take() else {
            return;
        };
        let closing = connection.close(200, "lily shutdown".into());
        if tokio::time::timeout_at(until, closing).await.is_err() {
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

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    use super::link::{Gate, REFUSED_PER_CONNECTION, REFUSED_RETRY, TRY_WAIT};
    use super::*;

    fn pool() -> Confirms {
        Confirms::new(
            "orders",
            Role {
                name: "handoffs",
                id_header: "x-test-id",
                blocked_gauge: "lily_test_blocked",
                refused_gauge: "lily_test_refused",
                doing: "publish handoff copies",
            },
        )
    }

    fn refused_write() -> lapin::Error {
        let message = "ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused \
                       for user 'lily'";
        lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED),
            message.into(),
        ))
        .into()
    }

    #[test]
    fn a_refusal_is_named_and_lets_one_channel_try_at_a_time_every_retry_until_a_confirm() {
        let pool = pool();
        let link = &pool.link;
        assert_eq!(
            link.gate(Instant::now()),
            Gate::Open,
            "accepted: channels open"
        );

        assert!(link.refuses(&refused_write(), ""));
        let missing = pool.refused().expect("refused");
        assert_eq!(
            missing.to_string(),
            "the write permission on exchange 'amq.default' in vhost '/' (needed to publish \
             handoff copies)"
        );
        assert_eq!(pool.refusals(), 1);

        let now = Instant::now();
        assert_eq!(
            link.gate(now),
            Gate::Shut,
            "the refused channel was the try"
        );
        assert!(!link.trying(now));
        let later = now + REFUSED_RETRY;
        assert_eq!(link.gate(later), Gate::Open, "one try every REFUSED_RETRY");
        assert!(link.trying(later));
        assert_eq!(link.gate(later), Gate::Wait, "the others wait for it");
        let late = later + TRY_WAIT;
        assert_eq!(
            link.gate(late),
            Gate::Open,
            "a try that says nothing is given up"
        );
        assert_eq!(link.gate(late), Gate::Wait);
        // Refused again: still one spell, and the waiting publishes are answered.
        assert!(link.refuses(&refused_write(), ""));
        assert_eq!(pool.refusals(), 1);
        assert_eq!(link.gate(Instant::now()), Gate::Shut);

        assert!(!link.worn(), "publishes refused, no channel counted");
        for _ in 0..REFUSED_PER_CONNECTION {
            link.channel_refused();
        }
        assert!(link.worn(), "the next channel goes on a new connection");

        link.accepted();
        assert_eq!(pool.refused(), None);
        assert_eq!(link.gate(now), Gate::Open, "accepted again: channels open");
        assert!(!link.trying(now));
        assert!(link.refuses(&refused_write(), ""));
        assert_eq!(pool.refusals(), 2);
    }

    #[test]
    fn other_channel_errors_are_no_refusal() {
        let pool = pool();
        let not_found: lapin::Error = lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        ))
        .into();
        assert!(!pool.link.refuses(&not_found, "x"));
        assert_eq!(pool.refused(), None);
        assert_eq!(pool.link.gate(Instant::now()), Gate::Open);
    }
}
