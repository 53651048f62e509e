//! The consumer: connects, declares the topology, consumes with prefetch and a concurrency
//! limit, runs each delivery through gate, dispatch, pipeline, decision and settlement, and
//! reconnects with backoff when the connection is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::types::{FieldTable, LongString};
use lapin::{Acker, BasicProperties, Channel, Connection, ConnectionProperties};
use lily_mq_core::{
    Action, Authority, BoxedHandler, CleanupResult, DynHook, EntryId, Evidence, GateRejection,
    Handoff, HandoffResult, Hook, Identity, Incoming, IncomingParts, Ledger, Outcome,
    PipelineResult, Plan, PropertiesView, QueueHandlerError, Reason, Router, SettleResult,
    Settlement, Situation, Totals, TransactionOutcome, UnresolvedEntry, as_u32, decide,
    decide_at_gate, headers, inspect, is_token,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::handoff::{FailureNote, Publisher, copy_properties, destination, sanitized_properties};
use crate::{ConsumerConfig, Error, Topology, pipeline};

/// Consumes one work queue with a [`Router`] of handlers.
///
/// ```no_run
/// use lily_mq_rabbit::{Consumer, ConsumerConfig};
/// use lily_mq_core::{Json, QueueHandlerError, Router};
/// use tokio_util::sync::CancellationToken;
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: String }
///
/// async fn place(Json(order): Json<OrderPlaced>) -> Result<(), QueueHandlerError> {
///     let _ = order.order_id;
///     Ok(())
/// }
///
/// # async fn run() -> Result<(), lily_mq_rabbit::Error> {
/// let router = Router::new().route("order.placed", place);
/// let consumer = Consumer::new("amqp://127.0.0.1:5672/%2f", ConsumerConfig::new("orders"), router);
/// let summary = consumer.run(CancellationToken::new()).await?;
/// println!("acked {}", summary.totals.acked);
/// # Ok(()) }
/// ```
pub struct Consumer {
    url: String,
    config: ConsumerConfig,
    router: Router,
    hooks: Vec<Arc<dyn DynHook>>,
    ledger: Arc<Mutex<Ledger>>,
}

/// A live view of a consumer's ledger.
#[derive(Clone, Debug)]
pub struct Stats(Arc<Mutex<Ledger>>);

impl Stats {
    /// Totals by outcome so far.
    pub fn totals(&self) -> Totals {
        lock(&self.0).totals()
    }

    /// Deliveries in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.0).in_flight()
    }
}

/// What a consumer run settled, and what it could not.
#[derive(Clone, Debug)]
pub struct Summary {
    /// Totals by outcome.
    pub totals: Totals,
    /// Deliveries whose settlement is unresolved (including those still in flight at the end).
    pub unresolved: Vec<UnresolvedEntry>,
    /// Unresolved deliveries not listed because the list was full.
    pub overflow: u64,
}

struct Shared {
    url: String,
    config: ConsumerConfig,
    router: Router,
    hooks: Vec<Arc<dyn DynHook>>,
    topology: Topology,
    queue: Arc<str>,
    ledger: Arc<Mutex<Ledger>>,
    requeues: Mutex<HashMap<Box<str>, u32>>,
    handlers_cancel: CancellationToken,
}

/// One connection and its channels.
struct Session {
    connection: Connection,
    consuming: Channel,
    publisher: Publisher,
}

impl Session {
    /// Closes the session after draining. A `basic.qos` round trip on the consuming channel
    /// first proves the broker processed every ACK written before it (frames on a channel are
    /// handled in order).
    async fn close(&self, prefetch: u16) {
        match self
            .consuming
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
        {
            Ok(()) => debug!("acks confirmed by a basic.qos round trip"),
            Err(err) => warn!(error = %err, "acks written before close are unconfirmed"),
        }
        let _ = self.consuming.close(200, "lily shutdown".into()).await;
        let _ = self.connection.close(200, "lily shutdown".into()).await;
    }
}

enum SessionEnd {
    Shutdown(Arc<Session>),
    Lost,
}

const REQUEUE_MEMORY: usize = 10_000;

impl Consumer {
    /// A consumer of `config.queue` at `url` (`amqp://` or `amqps://`).
    pub fn new(url: impl Into<String>, config: ConsumerConfig, router: Router) -> Self {
        let ledger = Arc::new(Mutex::new(Ledger::new(config.unresolved_cap)));
        Self {
            url: url.into(),
            config,
            router,
            hooks: Vec::new(),
            ledger,
        }
    }

    /// Adds a hook around every handler call. Hooks run in the order added.
    #[must_use]
    pub fn hook(mut self, hook: impl Hook) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// A live view of the totals.
    pub fn stats(&self) -> Stats {
        Stats(Arc::clone(&self.ledger))
    }

    /// Consumes until `shutdown` fires, reconnecting with backoff when the connection is lost.
    /// On shutdown it cancels the consumer, lets in-flight deliveries settle within the drain
    /// timeout, fires their cancellation tokens, then closes the connection.
    ///
    /// # Errors
    /// The policy or configuration is invalid, or the broker refused the topology.
    ///
    /// # Cancel safety
    /// Not cancel safe: fire `shutdown` instead of dropping the future, or in-flight
    /// deliveries lose their settlement authority.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Summary, Error> {
        self.config.policy.validate()?;
        if self.config.prefetch == 0 {
            return Err(Error::Config("prefetch must be at least 1"));
        }
        if self.config.queue.is_empty() || self.config.queue.len() > 200 {
            return Err(Error::Config("queue name must be 1..=200 bytes"));
        }
        let topology = Topology::new(
            &self.config.queue,
            self.config.queue_kind,
            &self.config.policy.retry_delays,
        );
        let shared = Arc::new(Shared {
            queue: self.config.queue.as_str().into(),
            url: self.url,
            router: self.router,
            hooks: self.hooks,
            topology,
            ledger: self.ledger,
            requeues: Mutex::new(HashMap::new()),
            handlers_cancel: CancellationToken::new(),
            config: self.config,
        });
        let tracker = TaskTracker::new();
        let permits = Arc::new(Semaphore::new(shared.config.concurrency));
        let mut delay = shared.config.reconnect_min;
        let mut last_session = None;
        while !shutdown.is_cancelled() {
            let started = Instant::now();
            match consume(&shared, &tracker, &permits, &shutdown).await {
                Ok(SessionEnd::Shutdown(session)) => {
                    last_session = Some(session);
                    break;
                }
                Ok(SessionEnd::Lost) => {
                    warn!(queue = %shared.queue, "connection lost; in-flight deliveries lose authority");
                }
                Err(SessionError::Fatal(err)) => return Err(err),
                Err(SessionError::Connect(err)) => {
                    warn!(queue = %shared.queue, error = %err, host = %redact(&shared.url), "connect failed");
                }
            }
            if started.elapsed() > shared.config.reconnect_max * 2 {
                delay = shared.config.reconnect_min;
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.cancelled() => break,
            }
            delay = (delay * 2).min(shared.config.reconnect_max);
        }
        tracker.close();
        if tokio::time::timeout(shared.config.drain_timeout, tracker.wait())
            .await
            .is_err()
        {
            info!(queue = %shared.queue, "drain timeout: cancelling in-flight handlers");
            shared.handlers_cancel.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(1), tracker.wait()).await;
        }
        if let Some(session) = last_session {
            session.close(shared.config.prefetch).await;
        }
        let ledger = lock(&shared.ledger);
        Ok(Summary {
            totals: ledger.totals(),
            unresolved: ledger.unresolved().collect(),
            overflow: ledger.overflow(),
        })
    }
}

enum SessionError {
    Fatal(Error),
    Connect(lapin::Error),
}

async fn consume(
    shared: &Arc<Shared>,
    tracker: &TaskTracker,
    permits: &Arc<Semaphore>,
    shutdown: &CancellationToken,
) -> Result<SessionEnd, SessionError> {
    let props = ConnectionProperties::default().with_connection_name(LongString::from(
        format!("lily:{}", shared.queue).into_bytes(),
    ));
    let connection = Connection::connect(&shared.url, props)
        .await
        .map_err(SessionError::Connect)?;
    let setup = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    shared
        .topology
        .apply(&setup, shared.config.topology)
        .await
        .map_err(|source| {
            SessionError::Fatal(Error::Topology {
                queue: shared.config.queue.clone(),
                source,
            })
        })?;
    let _ = setup.close(200, "topology ready".into()).await;
    let publisher = Publisher::open(&connection)
        .await
        .map_err(SessionError::Connect)?;
    let channel = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    channel
        .basic_qos(shared.config.prefetch, BasicQosOptions::default())
        .await
        .map_err(SessionError::Connect)?;
    let mut consumer = channel
        .basic_consume(
            shared.queue.as_ref().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(SessionError::Connect)?;
    info!(queue = %shared.queue, host = %redact(&shared.url), "consuming");
    let session = Arc::new(Session {
        connection,
        consuming: channel,
        publisher,
    });
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return Ok(SessionEnd::Lost),
            },
            () = shutdown.cancelled() => break,
        };
        let next = tokio::select! {
            next = std::future::poll_fn(|cx| std::pin::Pin::new(&mut consumer).poll_next(cx)) => next,
            () = shutdown.cancelled() => break,
        };
        match next {
            Some(Ok(delivery)) => {
                let shared = Arc::clone(shared);
                let session = Arc::clone(&session);
                tracker.spawn(handle(shared, session, delivery, permit));
            }
            Some(Err(err)) => debug!(queue = %shared.queue, error = %err, "consumer error"),
            None => return Ok(SessionEnd::Lost),
        }
    }
    let _ = session
        .consuming
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    Ok(SessionEnd::Shutdown(session))
}

async fn handle(
    shared: Arc<Shared>,
    session: Arc<Session>,
    delivery: Delivery,
    _permit: OwnedSemaphorePermit,
) {
    let Delivery {
        delivery_tag,
        exchange,
        routing_key,
        redelivered,
        properties,
        data,
        acker,
    } = delivery;
    let view = PropertiesView {
        message_id: properties.message_id().as_ref().map(|s| s.as_str()),
        kind: properties.kind().as_ref().map(|s| s.as_str()),
        content_type: properties.content_type().as_ref().map(|s| s.as_str()),
        headers: properties.headers().as_ref(),
    };
    let limits = &shared.config.limits;
    let (verdict, attempt, route) = match inspect(&view, data.len(), limits) {
        Ok(env) => {
            let route = shared
                .router
                .dispatch(env.kind, env.schema_version, env.content_type)
                .cloned();
            (
                Ok((env.schema_version, env.delivery_count)),
                env.attempt,
                Some(route),
            )
        }
        Err(rejection) => (Err(rejection), 1, None),
    };
    let message_id = view
        .message_id
        .filter(|id| is_token(id, limits.max_message_id_len))
        .map(Box::<str>::from);
    let message_id = message_id.as_deref();
    let identity = Identity {
        queue: Arc::clone(&shared.queue),
        message_id: message_id.map(Box::from),
        delivery_tag,
        attempt,
        redelivered,
    };
    let span = info_span!(
        "delivery",
        queue = %shared.queue,
        message_id = message_id.unwrap_or("-"),
        attempt,
        delivery_tag,
        outcome = tracing::field::Empty,
    );
    let entry = lock(&shared.ledger).open(identity);
    let work = Work {
        shared: &shared,
        session: &session,
        acker: &acker,
        entry,
    };
    match (verdict, route) {
        (Err(rejection), _) => {
            let plan = decide_at_gate(&rejection);
            let reason = match rejection {
                GateRejection::Oversized { len } => Reason::new(format!(
                    "body of {len} bytes is over the {} byte limit",
                    limits.max_body_bytes
                )),
                GateRejection::Invalid(reason) => reason,
            };
            // Without a valid id the message cannot be counted across requeues: no requeue.
            let delivery_count = properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(headers::DELIVERY_COUNT))
                .and_then(as_u32);
            let requeues = match message_id {
                Some(id) => work.local_requeues(id).max(delivery_count.unwrap_or(0)),
                None => shared.config.policy.max_requeues,
            };
            let copy = Copy::Sanitized {
                body: &data,
                properties: &properties,
                exchange: exchange.as_str(),
                routing_key: routing_key.as_str(),
            };
            async {
                let outcome = work.settle(plan, requeues, &reason, copy, message_id).await;
                if let (Some(id), true) = (message_id, redelivered) {
                    work.forget_requeues(id, outcome);
                }
                work.finish(outcome, &reason);
            }
            .instrument(span)
            .await;
        }
        (Ok((schema_version, delivery_count)), route) => {
            let incoming = Arc::new(Incoming::from_parts(IncomingParts {
                body: data,
                properties,
                exchange,
                routing_key,
                queue: Arc::clone(&shared.queue),
                delivery_tag,
                redelivered,
                attempt,
                schema_version,
            }));
            let route =
                route.unwrap_or_else(|| Err(QueueHandlerError::permanent("not dispatched")));
            work.process(incoming, delivery_count, route, redelivered)
                .instrument(span)
                .await;
        }
    }
}

struct Work<'a> {
    shared: &'a Arc<Shared>,
    session: &'a Arc<Session>,
    acker: &'a Acker,
    entry: EntryId,
}

/// The copy a handoff publishes.
enum Copy<'a> {
    Original(&'a Incoming),
    Sanitized {
        body: &'a [u8],
        properties: &'a BasicProperties,
        exchange: &'a str,
        routing_key: &'a str,
    },
}

impl Work<'_> {
    fn note(&self, evidence: Evidence) {
        lock(&self.shared.ledger).note(self.entry, evidence);
    }

    fn authority(&self) -> Authority {
        if self.acker.usable() && self.session.connection.status().connected() {
            Authority::Held
        } else {
            Authority::Lost
        }
    }

    async fn process(
        self,
        incoming: Arc<Incoming>,
        delivery_count: Option<u32>,
        route: Result<BoxedHandler, QueueHandlerError>,
        redelivered: bool,
    ) {
        let (pipeline, cleanup, reason) = match route {
            Err(err) => (
                PipelineResult::NotDispatched,
                CleanupResult::Succeeded,
                Some(err.reason().clone()),
            ),
            Ok(handler) => {
                self.note(Evidence::Dispatched);
                let cancel = self.shared.handlers_cancel.child_token();
                let out = pipeline::run(
                    &handler,
                    &self.shared.hooks,
                    &incoming,
                    &cancel,
                    self.shared.config.handler_timeout,
                )
                .await;
                self.note(Evidence::HandlerReturned);
                (out.result, out.cleanup, out.reason)
            }
        };
        let local = if redelivered {
            self.local_requeues(incoming.message_id())
        } else {
            0
        };
        let requeues = delivery_count.unwrap_or(0).max(local);
        let situation = Situation {
            pipeline,
            cleanup,
            transaction: TransactionOutcome::NotRequired,
            attempt: incoming.attempt(),
            requeues,
            authority: self.authority(),
        };
        let plan = decide(&situation, &self.shared.config.policy);
        let reason = reason.unwrap_or_else(|| Reason::new("ok"));
        let outcome = self
            .settle(
                plan,
                requeues,
                &reason,
                Copy::Original(&incoming),
                Some(incoming.message_id()),
            )
            .await;
        if redelivered {
            self.forget_requeues(incoming.message_id(), outcome);
        }
        self.finish(outcome, &reason);
    }

    /// Carries `plan` out. `requeue_key` names the message in the classic-queue requeue count.
    async fn settle(
        &self,
        plan: Plan,
        requeues: u32,
        reason: &Reason,
        copy: Copy<'_>,
        requeue_key: Option<&str>,
    ) -> Outcome {
        self.note(Evidence::Planned);
        let policy = &self.shared.config.policy;
        let mut settlement = Settlement::start(plan, requeues, policy, Instant::now());
        while let Some(action) = settlement.poll_action() {
            match action {
                Action::Publish { handoff, deadline } => {
                    let authority = self.authority();
                    let result = if authority == Authority::Lost {
                        HandoffResult::Failed
                    } else {
                        self.note(Evidence::HandoffPublished);
                        self.publish(handoff, reason, &copy, deadline).await
                    };
                    let confirmed = result == HandoffResult::Confirmed;
                    self.note(if confirmed {
                        Evidence::HandoffConfirmed
                    } else {
                        Evidence::HandoffFailed
                    });
                    if !confirmed {
                        warn!(handoff = ?handoff.lane, ?result, "handoff failed");
                    }
                    settlement.handle_handoff(result, self.authority(), Instant::now());
                }
                Action::Ack | Action::Requeue | Action::Reject => {
                    if let (Action::Requeue, Some(key)) = (action, requeue_key) {
                        // Counted before the NACK is written: the redelivery can arrive before
                        // this task runs again.
                        self.count_requeue(key);
                    }
                    let left = settlement.budget().remaining(Instant::now());
                    let result = self.write(action, left).await;
                    if result == SettleResult::Written {
                        self.note(Evidence::SettleWritten);
                    }
                    settlement.handle_settled(result);
                }
            }
        }
        settlement.outcome().unwrap_or(Outcome::AuthorityLost)
    }

    async fn publish(
        &self,
        handoff: Handoff,
        reason: &Reason,
        copy: &Copy<'_>,
        deadline: Duration,
    ) -> HandoffResult {
        let Some(queue) = destination(&self.shared.topology, handoff.lane) else {
            return HandoffResult::Failed;
        };
        let reason = Reason::new(format!("{}: {reason}", handoff.cause.as_str()));
        let note = FailureNote {
            lane: handoff.lane,
            kind: handoff.kind.map_or("rejected", |k| k.as_str()),
            reason: &reason,
            source_queue: &self.shared.queue,
        };
        let (body, properties) = match copy {
            Copy::Original(incoming) => (incoming.body(), copy_properties(incoming, &note)),
            Copy::Sanitized {
                body,
                properties,
                exchange,
                routing_key,
            } => (
                *body,
                sanitized_properties(
                    properties,
                    exchange,
                    routing_key,
                    &note,
                    &self.shared.config.limits,
                ),
            ),
        };
        self.session
            .publisher
            .publish(&self.session.connection, &queue, body, properties, deadline)
            .await
    }

    async fn write(&self, action: Action, left: Duration) -> SettleResult {
        if left.is_zero() {
            return SettleResult::Refused;
        }
        let sent = async {
            match action {
                Action::Ack => self.acker.ack(BasicAckOptions::default()).await,
                Action::Requeue => {
                    self.acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await
                }
                _ => {
                    self.acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await
                }
            }
        };
        // `Ok(false)` means the acker was used or its channel poisoned: lost authority.
        match tokio::time::timeout(left, sent).await {
            Ok(Ok(true)) => SettleResult::Written,
            _ => SettleResult::Refused,
        }
    }

    fn local_requeues(&self, message_id: &str) -> u32 {
        lock(&self.shared.requeues)
            .get(message_id)
            .copied()
            .unwrap_or(0)
    }

    fn count_requeue(&self, message_id: &str) {
        let mut counts = lock(&self.shared.requeues);
        if counts.len() >= REQUEUE_MEMORY && !counts.contains_key(message_id) {
            let evict = counts.keys().next().cloned();
            if let Some(key) = evict {
                counts.remove(&key);
            }
        }
        *counts.entry(message_id.into()).or_insert(0) += 1;
    }

    /// Drops the requeue count of a message that left the queue for good.
    fn forget_requeues(&self, message_id: &str, outcome: Outcome) {
        if !matches!(outcome, Outcome::Requeued(_)) {
            lock(&self.shared.requeues).remove(message_id);
        }
    }

    fn finish(&self, outcome: Outcome, reason: &Reason) {
        let span = tracing::Span::current();
        span.record("outcome", tracing::field::debug(&outcome));
        match outcome {
            Outcome::Acked => debug!("settled"),
            Outcome::Unresolved(_) | Outcome::AuthorityLost => {
                warn!(?outcome, reason = %reason, "settlement unresolved");
            }
            _ => info!(?outcome, reason = %reason, "settled"),
        }
        lock(&self.shared.ledger).close(self.entry, outcome, || match outcome {
            Outcome::Unresolved(u) => Reason::new(format!("{u:?}: {reason}")),
            _ => reason.clone(),
        });
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `scheme://host:port/vhost` without user or password.
pub(crate) fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host = rest.split(['?', '#']).next().unwrap_or(rest);
    format!("{scheme}://{host}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_logged_without_credentials() {
        assert_eq!(
            redact("amqp://user:s3cret@127.0.0.1:5672/%2f?heartbeat=10"),
            "amqp://127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqps://host/vh"), "amqps://host/vh");
    }
}
