//! Handlers tested without a broker (feature `testing`).
//!
//! A [`TestConsumer`] takes a [`Router`], its hooks and the [`ConsumerConfig`] the service runs
//! with, and settles one synthetic delivery in process: through the same gate, dispatch,
//! pipeline (hooks, timeout, panic guard), decision machine and copy building as the real
//! consumer, with the broker's part played by a recording stand-in that confirms every handoff
//! (or fails those to a lane you name) and accepts every ACK and NACK. It answers what the
//! real consumer would do, [`Settled`], and the copy it would publish, headers included.
//!
//! It runs the consumer's own delivery loop (`delivery::execute`): only what would reach the broker is
//! played. Waits the consumer would sleep through (a deferral's hold, the backoff between
//! transaction runs) are added up in [`Settled::held_for`] instead. A transactional scope is
//! run as the consumer runs it ([`TestConsumer::scope`]): the MongoDB scope against a real
//! mongod, or a scope of your own that defers, suppresses a duplicate or commits ambiguously.
//!
//! ```
//! use lily_mq_rabbit::testing::{TestConsumer, TestDelivery};
//! use lily_mq_rabbit::ConsumerConfig;
//! use lily_mq_core::{Json, Lane, Outcome, QueueHandlerError, Router};
//!
//! #[derive(serde::Deserialize, serde::Serialize)]
//! struct OrderPlaced { quantity: u32 }
//!
//! async fn place(Json(order): Json<OrderPlaced>) -> Result<(), QueueHandlerError> {
//!     match order.quantity {
//!         0 => Err(QueueHandlerError::permanent("quantity must be positive")),
//!         _ => Err(QueueHandlerError::retryable("stock service unavailable")),
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let router = Router::new().route("order.placed", place);
//! let consumer = TestConsumer::new(ConsumerConfig::new("orders"), router).unwrap();
//!
//! let settled = consumer.deliver(TestDelivery::json("order.placed", "o-1", &OrderPlaced { quantity: 2 })).await;
//! assert_eq!(settled.outcome, Outcome::Retried);
//! let copy = settled.copy.unwrap();
//! assert_eq!(copy.lane, Lane::Retry { bucket: 0, next_attempt: 2 });
//! assert_eq!(copy.attempt(), Some(2));
//!
//! let settled = consumer.deliver(TestDelivery::json("order.placed", "o-2", &OrderPlaced { quantity: 0 })).await;
//! assert_eq!(settled.outcome, Outcome::DeadLettered);
//! assert_eq!(settled.copy.unwrap().queue, "orders.dlq");
//! # }
//! ```

/// The rewriter of what the broker sends, for the fuzz targets and the cost benchmark (see
/// the `wire` module).
pub use crate::wire::{MAX_NESTING, Rewrites, Sanitizer, Sanitizing};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lily_mq_core::machine::{Action, CopyOf, Delivery as Machine, RequeueMemory};
use lily_mq_core::transport::{
    Authority, Handoff, HandoffId, HandoffResult, SettleResult, as_text, as_u32,
};
use lily_mq_core::{DynHook, Hook, Lane, Outcome, Reason, Router, TransactionalScope, headers};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::ConsumerConfig;
use crate::copy::handoff::destination;
use crate::delivery::admit::{Admitted, CopyFacts, Raw, Source, admit, epoch_millis};
use crate::delivery::execute::{Effects, Setup, execute};
use crate::error::Error;
use crate::publish::outgoing::{HeaderValue, Outgoing};
use crate::sync::lock;
use crate::topology::Topology;

/// A consumer that settles synthetic deliveries in process; see the [module](self).
pub struct TestConsumer {
    config: ConsumerConfig,
    router: Router,
    hooks: Vec<Arc<dyn DynHook>>,
    topology: Topology,
    queue: Arc<str>,
    /// Lanes (queue names) whose handoffs come back returned.
    failing: BTreeSet<String>,
    scope: Option<Arc<dyn TransactionalScope>>,
    /// Requeues counted by message id, as the consumer keeps them.
    requeues: Mutex<RequeueMemory>,
    next_tag: AtomicU64,
}

impl std::fmt::Debug for TestConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestConsumer")
            .field("queue", &self.queue)
            .field("failing", &self.failing)
            .finish_non_exhaustive()
    }
}

impl TestConsumer {
    /// A test consumer of `config.queue` with `router`.
    ///
    /// # Errors
    /// What [`Consumer::run`](crate::Consumer::run) refuses at start: a setting that cannot
    /// work, or state a handler extracts that the router was not given.
    pub fn new(config: ConsumerConfig, router: Router) -> Result<Self, Error> {
        config.validate_for(&router)?;
        let topology = Topology::new(
            &config.queue,
            config.queue_kind,
            &config.policy.retry_delays,
        );
        Ok(Self {
            queue: config.queue.as_str().into(),
            requeues: Mutex::new(RequeueMemory::new(crate::consumer::REQUEUE_MEMORY)),
            config,
            router,
            hooks: Vec::new(),
            scope: None,
            topology,
            failing: BTreeSet::new(),
            next_tag: AtomicU64::new(1),
        })
    }

    /// Adds a hook around every handler call, as [`Consumer::hook`](crate::Consumer::hook).
    #[must_use]
    pub fn hook(mut self, hook: impl Hook) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// Makes every handoff to `queue` (the DLQ, the parking lane or a retry bucket, by name)
    /// come back returned, as if the lane were missing.
    #[must_use]
    pub fn failing_lane(mut self, queue: &str) -> Self {
        self.failing.insert(queue.to_owned());
        self
    }

    /// Runs every handler inside `scope`, as [`Consumer::scope`](crate::Consumer::scope): a
    /// real one (the MongoDB scope against a real mongod) or one of your own, to test what
    /// a deferral, a duplicate or an ambiguous commit does.
    #[must_use]
    pub fn scope(mut self, scope: impl TransactionalScope) -> Self {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// Settles `delivery` as the consumer would.
    pub async fn deliver(&self, delivery: TestDelivery) -> Settled {
        let raw = Raw {
            body: delivery.body,
            properties: delivery.properties,
            exchange: ShortString::from(""),
            routing_key: ShortString::from(&*self.queue),
            delivery_tag: self.next_tag.fetch_add(1, Ordering::Relaxed),
            redelivered: delivery.redelivered,
            not_utf8: None,
        };
        let limits = &self.config.limits;
        let scoped = self.scope.is_some();
        let Admitted {
            mut arrival,
            source,
            handler,
        } = admit(
            raw,
            &self.router,
            limits,
            &self.queue,
            scoped,
            &self.config.header_key,
        );
        let message_id = source.message_id(limits);
        if let (true, Some(id)) = (delivery.redelivered, message_id) {
            arrival.local_requeues = Some(lock(&self.requeues).get(id));
        }
        let shutdown = CancellationToken::new();
        let setup = Setup::new(
            &self.config,
            &self.router,
            &self.hooks,
            self.scope.as_deref(),
            &shutdown,
        );
        let mut recorder = Recorder {
            consumer: self,
            source: &source,
            message_id,
            now: Instant::now(),
            held_for: Duration::ZERO,
            copy: None,
            next_id: 0,
        };
        let finished = execute(&setup, arrival, &source, handler.as_ref(), &mut recorder).await;
        if let (true, Some(id)) = (finished.forgets_requeues, message_id) {
            lock(&self.requeues).forget(id);
        }
        Settled {
            outcome: finished.outcome,
            reason: finished.reason,
            copy: recorder.copy,
            held_for: recorder.held_for,
        }
    }
}

/// The broker's part, played in process: every handoff is confirmed (or returned, for a lane
/// set to fail), every ACK and NACK written; waits move a virtual clock on.
struct Recorder<'a> {
    consumer: &'a TestConsumer,
    source: &'a Source,
    message_id: Option<&'a str>,
    /// Virtual time: the real clock plus every wait so far.
    now: Instant,
    held_for: Duration,
    copy: Option<Copy>,
    next_id: u64,
}

impl Effects for Recorder<'_> {
    fn authority(&self) -> Authority {
        Authority::Held
    }

    fn now(&self) -> Instant {
        Instant::now().max(self.now)
    }

    fn note(&self, machine: &mut Machine<'_>) {
        while machine.poll_evidence().is_some() {}
    }

    async fn wait(&mut self, wait: Duration, _backoff: bool) {
        self.held_for += wait;
        self.now = self.now() + wait;
    }

    async fn publish(
        &mut self,
        handoff: Handoff,
        reason: &Reason,
        copy: CopyOf,
        _deadline: Duration,
    ) -> HandoffResult {
        let consumer = self.consumer;
        let Some(queue) = destination(&consumer.topology, handoff.lane) else {
            return HandoffResult::Failed;
        };
        if consumer.failing.contains(&queue) {
            return HandoffResult::Returned;
        }
        self.next_id += 1;
        let facts = CopyFacts {
            source_queue: &consumer.queue,
            id: HandoffId::new(self.next_id),
            at_millis: epoch_millis(),
            limits: &consumer.config.limits,
            key: &consumer.config.header_key,
        };
        let (body, properties) = self.source.copy(handoff, reason, copy, &facts);
        self.copy = Some(Copy {
            queue,
            lane: handoff.lane,
            body: body.to_vec(),
            properties,
        });
        HandoffResult::Confirmed
    }

    async fn settle(&mut self, action: Action) -> SettleResult {
        if let (Action::Requeue { counted: true }, Some(id)) = (action, self.message_id) {
            lock(&self.consumer.requeues).count(id);
        }
        SettleResult::Written
    }
}

/// A synthetic delivery: body, properties (headers included) and the `redelivered` flag.
#[derive(Clone, Debug)]
pub struct TestDelivery {
    body: Vec<u8>,
    properties: BasicProperties,
    redelivered: bool,
}

impl TestDelivery {
    /// `value` as JSON, of type `kind`, with id `message_id`, exactly as a
    /// [`Publisher`](crate::Publisher) sends it (`schema-version` 1, a publish id, a
    /// timestamp).
    ///
    /// # Panics
    /// When `value` does not serialize to JSON, or `kind` or `message_id` is over 255 bytes.
    pub fn json<T: Serialize + ?Sized>(kind: &str, message_id: &str, value: &T) -> Self {
        let message =
            Outgoing::json(kind, message_id, value).expect("the test payload serializes to JSON");
        Self::from(message)
    }

    /// `body` with `properties` exactly as given: for deliveries the gate should refuse.
    pub fn new(body: Vec<u8>, properties: BasicProperties) -> Self {
        Self {
            body,
            properties,
            redelivered: false,
        }
    }

    /// Sets a header; a header of the same key is replaced.
    #[must_use]
    pub fn header(mut self, key: &str, value: impl Into<HeaderValue>) -> Self {
        let mut table = self.properties.headers().clone().unwrap_or_default();
        table.insert(key.into(), value.into().0);
        self.properties = self.properties.with_headers(table);
        self
    }

    /// The application attempt, as a retry copy carries it in `x-lily-attempt`.
    #[must_use]
    pub fn attempt(self, attempt: u32) -> Self {
        self.header(headers::ATTEMPT, AMQPValue::LongUInt(attempt))
    }

    /// The `schema-version` header.
    #[must_use]
    pub fn schema_version(self, version: u32) -> Self {
        self.header(headers::SCHEMA_VERSION, AMQPValue::LongUInt(version))
    }

    /// Its properties, headers included.
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The broker's `redelivered` flag.
    #[must_use]
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }
}

impl From<Outgoing> for TestDelivery {
    /// The message exactly as a [`Publisher`](crate::Publisher) sends it, before the gate: a
    /// message the gate refuses is delivered, and refused, as the consumer would refuse it.
    ///
    /// # Panics
    /// When its type, id or a header key is over 255 bytes, or a header is named `x-lily-*`:
    /// no publisher can send it.
    fn from(message: Outgoing) -> Self {
        let properties = message
            .build(HandoffId::new(0))
            .unwrap_or_else(|reason| panic!("no publisher can send this message: {reason}"));
        Self::new(message.body, properties)
    }
}

/// What the consumer would do with a delivery.
#[derive(Debug)]
#[non_exhaustive]
pub struct Settled {
    /// How it would settle.
    pub outcome: Outcome,
    /// Why it took its path (`ok` after a success). Never the body.
    pub reason: Reason,
    /// The copy it would publish and have confirmed before it ACKs the original: to a retry
    /// bucket, the DLQ or the parking lane.
    pub copy: Option<Copy>,
    /// How long it would wait in all before settling: a deferral's hold before its NACK.
    pub held_for: Duration,
}

/// A copy a handoff would publish.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Copy {
    /// The queue it goes to.
    pub queue: String,
    /// The lane that queue is.
    pub lane: Lane,
    /// Its body: the original's.
    pub body: Vec<u8>,
    /// Its properties: the original's and Lily's failure headers.
    pub properties: BasicProperties,
}

impl Copy {
    /// A header of the copy.
    pub fn header(&self, key: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(key)
    }

    /// A text header of the copy.
    pub fn header_text(&self, key: &str) -> Option<&str> {
        as_text(self.header(key)?)
    }

    /// The attempt it carries (`x-lily-attempt`).
    pub fn attempt(&self) -> Option<u32> {
        as_u32(self.header(headers::ATTEMPT)?)
    }

    /// The failure's reason it carries (`x-lily-reason`).
    pub fn reason(&self) -> Option<&str> {
        self.header_text(headers::REASON)
    }

    /// The failure's kind it carries (`x-lily-failure-kind`).
    pub fn failure_kind(&self) -> Option<&str> {
        self.header_text(headers::FAILURE_KIND)
    }

    fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }
}
