//! One delivery: gate, dispatch, pipeline, decision and settlement.
//!
//! [`admit`] is the gate, [`pipeline`] runs the handler with its hooks under a timeout and a
//! panic guard, [`execute`] drives the core's settlement machine, and [`effects`] carries out
//! what the machine asks for on the broker and in the books.

pub(crate) mod admit;
mod effects;
pub(crate) mod execute;
pub(crate) mod pipeline;
mod timeout;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;

use lapin::message::Delivery;
use lily_mq_core::machine::{Arrival, Verdict};
use lily_mq_core::transport::{BoxedHandler, EntryId, Evidence, Identity};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info_span};

use self::admit::{Admitted, Raw, Source, admit};
use self::effects::Work;
use self::execute::{Setup, execute};
use crate::channel::{Session, Settler};
use crate::service::Shared;
use crate::sync::lock;

/// The whole work of one delivery of `session`, which the consume loop polls first and a crew
/// worker finishes if need be (see [`crate::consume::inline`], which boxes it).
///
/// The gate, dispatch and the delivery's ledger entry come first, here: the work holds what they
/// made of the delivery instead of the delivery itself, which keeps it small (it is written into
/// its box for every delivery), and work dropped before its first poll is still in the ledger, so
/// it is reported.
///
/// A panic in that first part is a bug in Lily, as one outside the handler's guard is when the work
/// is polled (see [`crate::consume::inline`]): it is logged, the consume loop goes on, and there is
/// no work. The delivery stays unsettled, and the broker delivers it again once the channel closes.
pub(crate) fn work(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    delivery: Delivery,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let arrived = match catch_unwind(AssertUnwindSafe(|| arrive(shared, session, delivery))) {
        Ok(arrived) => arrived,
        Err(_) => {
            error!(
                "a delivery panicked at the gate, outside its handler's guard; it stays unsettled"
            );
            return None;
        }
    };
    Some(handle(Arc::clone(shared), Arc::clone(session), arrived))
}

/// A delivery past the gate and dispatch, its ledger entry open.
struct Arrived {
    arrival: Arrival,
    source: Source,
    handler: Option<BoxedHandler>,
    entry: EntryId,
    delivery_tag: u64,
    span: tracing::Span,
}

/// Runs the gate and dispatch over `delivery` and opens its ledger entry.
fn arrive(shared: &Shared, session: &Session, delivery: Delivery) -> Arrived {
    let Delivery {
        delivery_tag,
        exchange,
        routing_key,
        redelivered,
        properties,
        data,
        // Settled on the session's channel instead: see `Session::settle`.
        acker: _,
    } = delivery;
    let raw = Raw {
        body: data,
        properties,
        exchange,
        routing_key,
        delivery_tag,
        redelivered,
        not_utf8: session.not_utf8(delivery_tag),
    };
    let limits = &shared.config.limits;
    let scoped = shared.scope.is_some();
    let Admitted {
        mut arrival,
        source,
        handler,
    } = admit(
        raw,
        &shared.router,
        limits,
        &shared.queue,
        scoped,
        &shared.config.header_key,
    );
    let valid_id = source.message_id(limits);
    let identity = Identity {
        queue: Arc::clone(&shared.queue),
        message_id: valid_id.map(Box::from),
        delivery_tag,
        attempt: arrival.attempt,
        redelivered,
    };
    let span = info_span!(
        "delivery",
        queue = %shared.queue,
        message_id = valid_id.unwrap_or("-"),
        attempt = arrival.attempt,
        delivery_tag,
        outcome = tracing::field::Empty,
    );
    crate::trace::adopt(&span, source.properties().headers().as_ref());
    let evidence = match arrival.verdict {
        Verdict::Dispatched => Evidence::Dispatched,
        _ => Evidence::Received,
    };
    let entry = lock(&shared.books.ledger).open_at(identity, evidence);
    // Only a redelivery can have been requeued.
    if let (true, Some(id)) = (redelivered, valid_id) {
        arrival.local_requeues = Some(lock(&shared.books.requeues).get(id));
    }
    Arrived {
        arrival,
        source,
        handler,
        entry,
        delivery_tag,
        span,
    }
}

/// Settles one delivery. At shutdown's abort the work is dropped wherever it is, and its ledger
/// entry stays open and is reported as aborted. There is one exception: a delivery whose ACK is
/// marked ready is let finish, because its frame may be written already. That takes at most the
/// ACK hold (5–6 ms while the queue holds a backlog, 2–3 ms otherwise) and a few polls, and the
/// rest of its work is synchronous (see [`Session::ack`]).
///
/// This and [`settle`] return `async` blocks rather than being `async fn`s: an `async fn`
/// keeps its arguments twice in its future, once as passed and once as its own variables.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice"
)]
fn handle(
    shared: Arc<Shared>,
    session: Arc<Session>,
    arrived: Arrived,
) -> impl Future<Output = ()> + Send {
    async move {
        shared.metrics.in_flight.increment(1.0);
        let acking = AtomicBool::new(false);
        // Pinned here, in place: moving the large future into `until_abort` would make this
        // task's state hold it twice.
        let work = std::pin::pin!(settle(&shared, session, arrived, &acking));
        until_abort(work, &shared.signals.abort, &acking).await;
        shared.metrics.in_flight.decrement(1.0);
    }
}

/// Runs `work` until it ends or `abort` fires, and then drops it unless `finishing` is set.
async fn until_abort(
    mut work: std::pin::Pin<&mut impl Future<Output = ()>>,
    abort: &CancellationToken,
    finishing: &AtomicBool,
) {
    // The work is polled first, so work that ends on its first poll never registers a waiter
    // for the abort signal, and neither does work that is finishing: the abort lets it end.
    let mut aborted = std::pin::pin!(abort.cancelled());
    std::future::poll_fn(|cx| {
        if work.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if finishing.load(Ordering::Acquire) {
            // Its own wake-up brings it back.
            return Poll::Pending;
        }
        // Once the abort fires, the work is dropped where it is.
        aborted.as_mut().poll(cx)
    })
    .await;
}

/// Runs the delivery's machine to its outcome and records it.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice"
)]
fn settle<'a>(
    shared: &'a Arc<Shared>,
    session: Arc<Session>,
    arrived: Arrived,
    acking: &'a AtomicBool,
) -> impl Future<Output = ()> + Send + 'a {
    async move {
        let setup = Setup::new(
            &shared.config,
            &shared.router,
            &shared.hooks,
            shared.scope.as_deref(),
            &shared.signals.handlers,
        );
        let settler = Settler::new(
            &session,
            arrived.delivery_tag,
            &shared.publisher,
            &shared.signals.revoked,
        );
        let source = &arrived.source;
        let mut work = Work {
            shared,
            settler,
            entry: arrived.entry,
            message_id: source.message_id(&shared.config.limits),
            source,
            acking,
        };
        let span = &arrived.span;
        // Pinned in place: instrumenting the future itself would move it into the wrapper.
        let run = std::pin::pin!(async {
            let handler = arrived.handler.as_ref();
            let finished = execute(&setup, arrived.arrival, source, handler, &mut work).await;
            work.finish(&finished, span);
        });
        run.instrument(span.clone()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work that marks itself finishing and then yields once, as an ACK does.
    async fn ack_like(finishing: &AtomicBool, ended: &AtomicBool) {
        finishing.store(true, Ordering::Release);
        tokio::task::yield_now().await;
        ended.store(true, Ordering::Release);
    }

    #[tokio::test]
    async fn an_abort_lets_work_that_is_finishing_end() {
        let abort = CancellationToken::new();
        abort.cancel();
        let (finishing, ended) = (AtomicBool::new(false), AtomicBool::new(false));
        let work = std::pin::pin!(ack_like(&finishing, &ended));
        until_abort(work, &abort, &finishing).await;
        assert!(ended.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn an_abort_drops_other_work_where_it_is() {
        let abort = CancellationToken::new();
        abort.cancel();
        let (finishing, ended) = (AtomicBool::new(false), AtomicBool::new(false));
        let work = async {
            tokio::task::yield_now().await;
            ended.store(true, Ordering::Release);
        };
        until_abort(std::pin::pin!(work), &abort, &finishing).await;
        assert!(!ended.load(Ordering::Acquire));
    }
}
