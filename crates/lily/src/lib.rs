//! Lily: consume RabbitMQ messages with typed handlers that never see ACK or NACK.
//!
//! A handler is an async function returning `Result<(), QueueHandlerError>`; its arguments are
//! extractors. Lily settles every delivery from evidence: ACK on success, a confirmed handoff to
//! a retry bucket, the dead-letter queue or the parking lane on failure, one bounded NACK with
//! requeue when a handoff fails.
//!
//! ```no_run
//! use lily::prelude::*;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { order_id: String, quantity: u32 }
//!
//! async fn place(Json(order): Json<OrderPlaced>, meta: Meta) -> Result<(), QueueHandlerError> {
//!     if order.quantity == 0 {
//!         return Err(QueueHandlerError::permanent("quantity must be positive"));
//!     }
//!     let _ = (order.order_id, meta.attempt());
//!     Ok(())
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<ShutdownReport, lily::Error> {
//!     let router = Router::new().route("order.placed", place);
//!     let config = ConsumerConfig::new("orders");
//!     // SIGTERM drains within 25 s, a second forces; the report is logged, printed and
//!     // written to /dev/termination-log. Exit status 0: clean; 3: something unresolved.
//!     Consumer::new("amqp://127.0.0.1:5672/%2f", config, router)
//!         .run_until_signal(ReportSinks::default())
//!         .await
//! }
//! ```
//!
//! [`prelude`] gathers what most services use; each module below holds one concern, and each
//! concept has one name. [`Publisher`](publish::Publisher) sends what a consumer takes,
//! each message with its own evidence; with feature `testing`, [`testing`] settles a synthetic
//! delivery through the consumer's own gate, handler and decision machine, with no broker.
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `health` | [`health::serve`]: `/livez`, `/readyz` and `/metrics` (Prometheus) over HTTP |
//! | `testing` | `lily::testing`: settle a synthetic delivery through the real gate, hooks, handler and decision machine, in process, with no broker |
//! | `otel` | a delivery's W3C `traceparent` header becomes the parent of its `delivery` span, through `tracing-opentelemetry`; the publisher writes the current span's context into what it sends. Copies carry the header with or without it |
//! | `mongo` | `lily::mongo`: the MongoDB transaction scope, transactional inbox and fenced lease; [`prelude`] gains `MongoScope`, `MongoConfig` and the `MongoTx` extractor |
//!
//! | `logging` | [`logging::init`] and [`logging::filter`]: a `tracing` subscriber with no message body in any line (on by default) |
//!
//! Only `logging` is on by default.

pub use lily_mq_rabbit::{BrokerError, ConfigError, Error, MissingPermission};

/// What most services need.
pub mod prelude {
    pub use lily_mq_core::{
        Attempt, Cancellation, CleanupError, FailureKind, HandlerResult, Headers, Hook, Json, Meta,
        Payload, Policy, QueueHandlerError, RawDelivery, Router, ShutdownBudget, ShutdownReport,
        State, Trigger,
    };
    pub use lily_mq_rabbit::{
        ClientCertificate, Consumer, ConsumerConfig, Destination, LeaderLocator, Outgoing,
        Published, Publisher, PublisherConfig, QueueKind, ReportSinks, Shutdown, TopologyMode,
        emit,
    };

    /// The Mongo scope and its extractor (feature `mongo`).
    #[cfg(feature = "mongo")]
    pub use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx, Outbox};
}

/// Handlers: the router, the extractors a handler takes, its result, and hooks around it.
pub mod handler {
    pub use lily_mq_core::{
        Attempt, BoxFuture, Cancellation, CleanupError, Codec, Context, FailureKind, FromDelivery,
        Handler, HandlerResult, Headers, Hook, Incoming, Json, JsonCodec, Meta, Payload,
        QueueHandlerError, RawDelivery, Resources, Router, State, StateNeed,
    };
}

/// The consumer, its configuration, its policy and what it counts.
pub mod consumer {
    pub use lily_mq_core::{HeaderKey, Limits, Policy, PolicyError, Totals};
    pub use lily_mq_rabbit::{ClientCertificate, Consumer, ConsumerConfig, Stats};
}

/// The queues Lily uses (work queue, retry buckets, DLQ, parking lane), declared or verified.
pub mod topology {
    pub use lily_mq_rabbit::{
        Applied, BrokerVersion, LeaderLocator, QueueKind, Topology, TopologyError, TopologyMode,
        broker_version,
    };
}

/// Publishing messages a Lily consumer takes, each with the evidence of its publish.
pub mod publish {
    pub use lily_mq_rabbit::{
        Destination, HeaderValue, Outgoing, PUBLISH_ID, Published, Publisher, PublisherConfig,
    };
}

/// Shutdown and its report: every delivery whose settlement is unresolved, and how each
/// delivery ended.
pub mod shutdown {
    pub use lily_mq_core::{
        EXIT_UNRESOLVED, Incidents, Lane, OutboxReport, Outcome, Phase, PhaseTiming, Reason,
        RequeueCause, SCHEMA, ShutdownBudget, ShutdownReport, Terminal, Trigger, Unresolved,
        UnresolvedDelivery,
    };
    pub use lily_mq_rabbit::{ReportSinks, Shutdown, emit};
}

/// A transactional scope of one's own: what a handler's transaction must answer.
pub mod scope {
    pub use lily_mq_core::{
        Begin, Committed, OpenTransaction, OutboxRelay, TransactionOutcome, TransactionalScope,
    };
}

/// The headers Lily reads and writes, and readers of header values.
pub mod headers {
    pub use lily_mq_core::headers::*;
}

/// Logging with no message body in any line: [`logging::init`] is how the examples set it up.
pub mod logging {
    pub use lily_mq_rabbit::NO_BODY_LOGS;
    #[cfg(feature = "logging")]
    pub use lily_mq_rabbit::logging::{filter, init};
}

/// Liveness, readiness and Prometheus metrics over HTTP (feature `health`).
#[cfg(feature = "health")]
pub mod health {
    pub use lily_mq_rabbit::health::*;
}

/// The MongoDB transaction scope, transactional inbox and fenced lease (feature `mongo`).
#[cfg(feature = "mongo")]
pub mod mongo {
    /// The MongoDB driver Lily is built on, for the client and the documents a handler writes.
    pub use lily_mq_mongo::mongodb;
    pub use lily_mq_mongo::{
        CommitObserver, ConnectError, MongoConfig, MongoScope, MongoTx, Outbox, OutboxStore, Relay,
        RelayConfig, StageError, handler_error,
    };
}

/// Settle a synthetic delivery through the consumer's own gate, handler and decision machine,
/// with no broker (feature `testing`).
#[cfg(feature = "testing")]
pub mod testing {
    pub use lily_mq_rabbit::testing::{
        Copy, MAX_NESTING, Rewrites, Sanitizer, Sanitizing, Settled, TestConsumer, TestDelivery,
    };
}
