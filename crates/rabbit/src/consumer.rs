//! The consumer: runs sessions (reconnecting with backoff when the connection is lost) and,
//! when shutdown is triggered, walks the phases draining → cooperating → aborting → closed and
//! builds the shutdown report.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily_mq_core::machine::RequeueMemory;
use lily_mq_core::transport::{Ledger, PhaseClock};
use lily_mq_core::{
    DynHook, Hook, Incidents, Phase, Router, ShutdownReport, Totals, TransactionalScope, Trigger,
};
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::channel::Session;
use crate::config::ConsumerConfig;
use crate::connect::{Dialer, Endpoint, EndpointError, jittered};
use crate::consume::crew::Crew;
use crate::consume::{SessionEnd, SessionError, consume};
use crate::copy::handoff::HandoffPublisher;
use crate::error::{ConfigError, Error, MissingPermission};
use crate::outbox::RelayTask;
use crate::report::ReportSinks;
use crate::service::{Books, Metrics, Shared, Signals};
use crate::shutdown::Shutdown;
use crate::sync::lock;
use crate::topology::Topology;

/// Consumes one work queue with a [`Router`] of handlers.
///
/// ```no_run
/// use lily_mq_rabbit::{Consumer, ConsumerConfig, Shutdown};
/// use lily_mq_core::{Json, QueueHandlerError, Router};
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: String }
///
/// async fn place(Json(order): Json<OrderPlaced>) -> Result<(), QueueHandlerError> {
///     let _ = order.order_id;
///     Ok(())
/// }
///
/// # async fn run() -> Result<lily_mq_core::ShutdownReport, lily_mq_rabbit::Error> {
/// let router = Router::new().route("order.placed", place);
/// let consumer = Consumer::new("amqp://127.0.0.1:5672/%2f", ConsumerConfig::new("orders"), router);
/// // Trigger it from anywhere: shutdown.trigger(Trigger::Api). Or use `run_until_signal`.
/// let shutdown = Shutdown::default();
/// consumer.run(shutdown).await
/// # }
/// ```
pub struct Consumer {
    /// `amqp://` or `amqps://`; it may hold credentials, so it is never logged.
    url: String,
    publisher: Arc<HandoffPublisher>,
    config: ConsumerConfig,
    router: Router,
    hooks: Vec<Arc<dyn DynHook>>,
    scope: Option<Arc<dyn TransactionalScope>>,
    ledger: Arc<Mutex<Ledger>>,
    ready: Arc<AtomicBool>,
}

/// A live view of a consumer: totals, deliveries in flight, readiness.
#[derive(Clone, Debug)]
pub struct Stats {
    ledger: Arc<Mutex<Ledger>>,
    ready: Arc<AtomicBool>,
    publisher: Arc<HandoffPublisher>,
}

impl Stats {
    /// Totals by outcome so far.
    pub fn totals(&self) -> Totals {
        lock(&self.ledger).totals()
    }

    /// Deliveries in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.ledger).in_flight()
    }

    /// True while the consumer is consuming (false before it connects, while reconnecting and
    /// from the start of draining).
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// True while the broker blocks the handoff connection (a memory or disk alarm): successful
    /// deliveries are still ACKed, but handoffs wait, within their budget, for the unblock.
    pub fn handoffs_blocked(&self) -> bool {
        self.publisher.blocked()
    }

    /// The permission the broker refuses handoff copies for, while it does (`write` on the
    /// default exchange, taken from the user while Lily runs): failures are held
    /// unacknowledged (see the guide's "A failing lane") and handoffs resume by themselves
    /// once it is granted again.
    pub fn handoffs_refused(&self) -> Option<MissingPermission> {
        self.publisher.refused()
    }

    /// The lanes (queue names: the DLQ, the parking lane, a retry bucket) whose latest handoff
    /// failed. While the DLQ or the parking lane fails, copies bound for it wait in a retry
    /// bucket as held copies and come back to try it again.
    pub fn failing_lanes(&self) -> Vec<String> {
        self.publisher.failing_lanes()
    }
}

impl Consumer {
    /// A consumer of `config.queue` at `url` (`amqp://` or `amqps://`), and at the further
    /// nodes of [`ConsumerConfig::addresses`].
    pub fn new(url: impl Into<String>, config: ConsumerConfig, router: Router) -> Self {
        let ledger = Arc::new(Mutex::new(Ledger::new(config.unresolved_cap)));
        Self {
            publisher: Arc::new(HandoffPublisher::new(&config.queue)),
            url: url.into(),
            config,
            router,
            hooks: Vec::new(),
            scope: None,
            ledger,
            ready: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Adds a hook around every handler call. Hooks run in the order added.
    #[must_use]
    pub fn hook(mut self, hook: impl Hook) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// Runs every handler inside `scope` (for example the MongoDB transaction and inbox scope).
    /// The scope opens after dispatch and before the hooks; its transaction is committed only
    /// after the handler and the cleanup hooks succeeded.
    #[must_use]
    pub fn scope(mut self, scope: impl TransactionalScope) -> Self {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// A live view of totals, in-flight count and readiness.
    pub fn stats(&self) -> Stats {
        Stats {
            ledger: Arc::clone(&self.ledger),
            ready: Arc::clone(&self.ready),
            publisher: Arc::clone(&self.publisher),
        }
    }

    /// Runs until SIGTERM or SIGINT, then shuts down within
    /// [`ConsumerConfig::shutdown_budget`] (a second signal forces it), writes the report to
    /// `sinks` ([`emit`](crate::emit)) and returns it. `ShutdownReport` is a
    /// [`Termination`](std::process::Termination), so `main` can return it: exit status 0 when
    /// settlement is clean, 3 when anything is unresolved.
    ///
    /// ```no_run
    /// use lily_mq_core::{Meta, QueueHandlerError, Router, ShutdownReport};
    /// use lily_mq_rabbit::{Consumer, ConsumerConfig, ReportSinks};
    ///
    /// async fn place(meta: Meta) -> Result<(), QueueHandlerError> {
    ///     let _ = meta.message_id();
    ///     Ok(())
    /// }
    ///
    /// #[tokio::main]
    /// async fn main() -> Result<ShutdownReport, lily_mq_rabbit::Error> {
    ///     let router = Router::new().route("order.placed", place);
    ///     Consumer::new("amqp://127.0.0.1:5672/%2f", ConsumerConfig::new("orders"), router)
    ///         .run_until_signal(ReportSinks::default())
    ///         .await
    /// }
    /// ```
    ///
    /// A report that cannot be written is logged as an error; the report is still returned.
    ///
    /// # Errors
    /// As [`Consumer::run`], and [`Error::Signals`] when the signal handlers cannot be
    /// installed.
    pub async fn run_until_signal(self, sinks: ReportSinks) -> Result<ShutdownReport, Error> {
        let shutdown = Shutdown::new(self.config.shutdown_budget);
        let signals = shutdown.listen_for_signals().map_err(Error::Signals)?;
        let report = self.run(shutdown).await;
        signals.abort();
        let report = report?;
        if let Err(err) = crate::report::emit(&report, &sinks) {
            error!(error = %err, "the shutdown report could not be written");
        }
        Ok(report)
    }

    /// Consumes until `shutdown` is triggered, reconnecting with backoff when the connection is
    /// lost, then shuts down in phases and returns the report:
    ///
    /// - **draining**: the consumer is cancelled and readiness drops; in-flight work settles.
    /// - **cooperating** (after the budget's drain time): handlers' cancellation tokens fire;
    ///   work that finishes is still settled on healthy channels.
    /// - **aborting** (near the deadline, or when forced): authority is revoked, tasks are
    ///   aborted and their joins observed; they are listed as unresolved.
    /// - **closed**: a round trip confirms the ACKs written, then channels and connection close.
    ///
    /// The budget runs from the trigger, and every wait on the way out (the consumer's cancel,
    /// the round trip, the closes) is bounded by what is left of it, so a broker that stopped
    /// answering cannot hold the exit; ACKs it did not confirm are reported uncertain.
    ///
    /// A lost connection, a connection refused at TCP or closed while opening, a topology
    /// declaration cut short (a broker restart looks like this) are retried with backoff. What
    /// retrying cannot fix (the broker refused the credentials or the virtual host, or the
    /// topology: access refused, a failed precondition, in Verify mode something missing) ends
    /// the consumer. Once it has consumed, that too ends in a report, with trigger
    /// [`Trigger::Error`] and the error's text, after the deliveries in flight settled or were
    /// listed.
    ///
    /// # Errors
    /// Before it ever consumed: the policy or configuration is invalid, or the broker refused
    /// the connection ([`Error::Refused`]) or the topology ([`Error::Topology`]).
    ///
    /// # Cancel safety
    /// Not cancel safe: trigger `shutdown` instead of dropping the future, or in-flight
    /// deliveries lose their settlement authority unreported.
    pub async fn run(self, shutdown: Shutdown) -> Result<ShutdownReport, Error> {
        self.config.validate_for(&self.router)?;
        let endpoint = Endpoint::new(
            &self.url,
            &self.config.addresses,
            self.config.tls(),
            &self.config.queue,
            self.config.connect_timeout,
        )
        .map_err(|err| {
            Error::Config(match err {
                EndpointError::Url => ConfigError {
                    field: "url",
                    problem: "does not parse as amqp:// or amqps://".into(),
                },
                EndpointError::Address => ConfigError {
                    field: "addresses",
                    problem: "must each be host, host:port or [v6]:port".into(),
                },
            })
        })?;
        info!(queue = %self.config.queue, node = %endpoint.display(), addresses = endpoint.address_count(), "starting");
        crate::logging::warn_if_bodies_logged();
        let topology = Topology::new(
            &self.config.queue,
            self.config.queue_kind,
            &self.config.policy.retry_delays,
        )
        .delivery_limit(self.config.delivery_limit)
        .leader_locator(self.config.leader_locator);
        let shared = Arc::new(Shared {
            queue: self.config.queue.as_str().into(),
            metrics: Metrics::new(&self.config.queue),
            dialer: Dialer::new(endpoint, "consuming"),
            publisher: self.publisher,
            router: self.router,
            hooks: self.hooks,
            scope: self.scope,
            topology,
            books: Books {
                ledger: self.ledger,
                requeues: Mutex::new(RequeueMemory::new(REQUEUE_MEMORY)),
                incidents: Mutex::new(Incidents::default()),
            },
            signals: Signals::new(),
            ready: self.ready,
            sessions: AtomicU64::new(0),
            config: self.config,
        });
        // The scope's outbox relay publishes beside the consumer until shutdown begins.
        let relay = match shared.scope.as_ref().and_then(|scope| scope.relay()) {
            Some(relay) => Some(RelayTask::start(
                relay,
                &self.url,
                &shared.config,
                shutdown.budget(),
            )?),
            None => None,
        };
        let tracker = TaskTracker::new();
        // The broker never has more than `prefetch` deliveries out on a channel.
        let crew = Crew::new(
            shared
                .config
                .concurrency
                .min(usize::from(shared.config.prefetch)),
        );
        let session = run_sessions(&shared, &tracker, &crew, &shutdown).await;
        crew.close();
        match session {
            Ok(session) => Ok(shut_down(&shared, &tracker, &shutdown, session, relay, None).await),
            // After consuming started, deliveries may be in flight: they settle or are listed,
            // and the report says why the consumer stopped.
            Err(err) if shared.sessions.load(Ordering::Relaxed) > 0 => {
                error!(queue = %shared.queue, error = %ErrorChain(&err), "the consumer cannot go on");
                Ok(shut_down(&shared, &tracker, &shutdown, None, relay, Some(err)).await)
            }
            Err(err) => {
                // The handoff workers hold the publisher's connection: close it on this way
                // out too.
                shared.publisher.close(PUBLISHER_CLOSE).await;
                if let Some(relay) = relay {
                    relay.finish(shutdown.budget().total).await;
                }
                Err(err)
            }
        }
    }
}

/// Runs sessions until the graceful token fires; returns the open session, if any.
async fn run_sessions(
    shared: &Arc<Shared>,
    tracker: &TaskTracker,
    crew: &Arc<Crew>,
    shutdown: &Shutdown,
) -> Result<Option<Arc<Session>>, Error> {
    let stop = shutdown.graceful_token();
    let mut delay = shared.config.reconnect_min;
    while !stop.is_cancelled() {
        let started = Instant::now();
        match consume(shared, tracker, crew, stop).await {
            Ok(SessionEnd::Shutdown(session)) => return Ok(Some(session)),
            Ok(SessionEnd::Stopped) => return Ok(None),
            Ok(SessionEnd::Lost) => {
                warn!(queue = %shared.queue, "connection lost; in-flight deliveries lose authority");
            }
            Err(SessionError::Fatal(err)) => return Err(err),
            Err(SessionError::Connect(err)) => {
                warn!(queue = %shared.queue, error = %err, "connect failed on every node");
            }
        }
        if started.elapsed() > shared.config.reconnect_max * 2 {
            delay = shared.config.reconnect_min;
        }
        tokio::select! {
            () = tokio::time::sleep(jittered(delay)) => {}
            () = stop.cancelled() => break,
        }
        delay = (delay * 2).min(shared.config.reconnect_max);
    }
    Ok(None)
}

/// How long closing the handoff connection may take: a blocked connection writes nothing.
const PUBLISHER_CLOSE: Duration = Duration::from_secs(1);

/// The least time given to closing once the budget is spent.
const CLOSE_FLOOR: Duration = Duration::from_millis(100);

/// Message ids whose requeues the consumer remembers (classic queues do not count them).
pub(crate) const REQUEUE_MEMORY: usize = 10_000;

/// Walks the shutdown phases and builds the report.
async fn shut_down(
    shared: &Arc<Shared>,
    tracker: &TaskTracker,
    shutdown: &Shutdown,
    session: Option<Arc<Session>>,
    relay: Option<RelayTask>,
    error: Option<Error>,
) -> ShutdownReport {
    tracker.close();
    if let Some(relay) = &relay {
        relay.stop();
    }
    let mut clock = PhaseClock::new(shutdown.budget());
    // The budget runs from the trigger, not from here: leaving the consume loop took some of it.
    let at = shutdown.triggered_at().unwrap_or_else(Instant::now);
    match (shutdown.first_trigger(), &error) {
        (Some((trigger, true)), _) => clock.handle_force(trigger, at),
        (Some((trigger, false)), _) => clock.handle_trigger(trigger, at),
        (None, Some(_)) => clock.handle_trigger(Trigger::Error, at),
        (None, None) => clock.handle_trigger(Trigger::Api, at),
    }
    let end = at + shutdown.budget().total;
    let mut phase = Phase::Running;
    while clock.phase() != Phase::Closed {
        if clock.phase() != phase {
            phase = clock.phase();
            let in_flight = lock(&shared.books.ledger).in_flight();
            info!(queue = %shared.queue, ?phase, in_flight, "shutdown phase");
            enter(shared, phase);
        }
        let deadline = clock.poll_deadline().unwrap_or_else(Instant::now);
        match phase {
            Phase::Draining | Phase::Cooperating => tokio::select! {
                () = tracker.wait() => clock.handle_idle(Instant::now()),
                () = tokio::time::sleep_until(deadline.into()) => clock.handle_timeout(Instant::now()),
                () = shutdown.force_token().cancelled() => {
                    let trigger = clock.trigger().unwrap_or(Trigger::Api);
                    clock.handle_force(trigger, Instant::now());
                }
            },
            Phase::Aborting => {
                // Joins are observed, bounded by what is left of the budget.
                let left = deadline.saturating_duration_since(Instant::now());
                let joined =
                    tokio::time::timeout(left.max(Duration::from_millis(100)), tracker.wait())
                        .await;
                if joined.is_err() {
                    let in_flight = lock(&shared.books.ledger).in_flight();
                    warn!(queue = %shared.queue, in_flight, "aborted tasks did not finish in time");
                }
                clock.handle_aborted(Instant::now());
            }
            Phase::Running | Phase::Closed => clock.handle_timeout(Instant::now()),
        }
    }
    info!(queue = %shared.queue, phase = ?Phase::Closed, "shutdown phase");
    // A broker that stopped answering must not hold the exit: what is left of the budget, and
    // a moment at least, for the round trip that confirms the ACKs and the closes.
    let left = || {
        end.saturating_duration_since(Instant::now())
            .max(CLOSE_FLOOR)
    };
    // The relay was told to stop at the trigger and has had the phases to finish its batch.
    let outbox = match relay {
        Some(relay) => relay.finish(left()).await,
        None => None,
    };
    if let Some(session) = session
        && tokio::time::timeout(left(), session.close(shared))
            .await
            .is_err()
    {
        warn!(queue = %shared.queue, "the broker did not answer the close in time; ACKs not confirmed are uncertain");
    }
    shared.publisher.close(left().min(PUBLISHER_CLOSE)).await;
    let mut ledger = lock(&shared.books.ledger);
    // ACKs written on channels that are gone were never confirmed.
    ledger.acks_uncertain(None);
    let mut incidents = *lock(&shared.books.incidents);
    incidents.handoffs_refused = shared.publisher.refusals();
    if let Some(missing) = shared.publisher.refused() {
        // Failures held for it were released (NACKed) by the shutdown: they wait in the queue.
        warn!(queue = %shared.queue, lacks = %missing, "shutting down while the broker refuses handoff copies");
    }
    let mut report =
        ShutdownReport::build(&shared.queue, &clock, &ledger, incidents, Instant::now());
    report.error = error.map(|err| error_text(&err));
    report.handoffs_refused_for = shared.publisher.last_refused().map(|m| m.to_string());
    report.outbox = outbox;
    report
}

/// The longest error text a report carries.
const ERROR_TEXT_MAX: usize = 1024;

/// `err` with its sources, bounded. The broker's reply texts carry no credentials, and the
/// errors of this crate never hold the URL.
fn error_text(err: &Error) -> String {
    let mut text = ErrorChain(err).to_string();
    if text.len() > ERROR_TEXT_MAX {
        let mut end = ERROR_TEXT_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// Displays an error followed by its sources.
struct ErrorChain<'a>(&'a Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = std::error::Error::source(self.0);
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

fn enter(shared: &Shared, phase: Phase) {
    match phase {
        Phase::Draining => shared.ready.store(false, Ordering::Release),
        Phase::Cooperating => shared.signals.handlers.cancel(),
        Phase::Aborting => {
            // The handlers' tokens fire with it.
            shared.signals.revoke();
            lock(&shared.books.ledger).abort_open();
            shared.signals.abort.cancel();
        }
        Phase::Running | Phase::Closed => {}
    }
}
