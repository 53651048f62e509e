//! The consume loop: one session from its start to its end, taking deliveries off the
//! consumer, polling each once itself ([`inline`]) and handing the rest to the [`crew`].

pub(crate) mod crew;
pub(crate) mod inline;
mod open;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_core::Stream;
use lapin::options::BasicCancelOptions;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use self::crew::Crew;
use self::inline::Inline;
use self::open::{Opened, open};
use crate::channel::{Session, first_poll};
use crate::delivery;
use crate::error::Error;
use crate::service::Shared;
use crate::sync::lock;

/// How long the consumer's `basic.cancel` may wait for its reply at shutdown; the budget runs.
const CANCEL_WAIT: Duration = Duration::from_secs(1);

/// How often written ACKs are confirmed by a `basic.qos` round trip.
const ACK_CONFIRM_INTERVAL: Duration = Duration::from_millis(200);

/// How a session ended.
pub(crate) enum SessionEnd {
    /// The consumer was cancelled for shutdown; the session is still open.
    Shutdown(Arc<Session>),
    /// The connection or the consumer was lost.
    Lost,
    /// `stop` fired before consuming started.
    Stopped,
}

/// Why a session could not start or go on.
pub(crate) enum SessionError {
    /// Retrying cannot help.
    Fatal(Error),
    /// The connection was lost or refused for now: connect again, with backoff.
    Connect(lapin::Error),
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
    let session = Arc::new(Session::new(
        shared.sessions.fetch_add(1, Ordering::Relaxed),
        connection,
        consuming,
        rewrites,
        shared.config.prefetch,
    ));
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
    let mut inline = Inline::new(session.batch());
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
                let gated = inline.gate_clock();
                match delivery::work(shared, &session, delivery)
                    .and_then(|work| inline.start(work, &session, tag, gated))
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
        .consuming()
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
