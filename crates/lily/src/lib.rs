//! Lily: consume RabbitMQ messages with typed handlers that never see ACK or NACK.
//!
//! A handler is an async function returning `Result<(), QueueHandlerError>`; its arguments are
//! extractors. Lily settles every delivery from evidence, through the decision table in
//! [`core`]: ACK on success, a confirmed handoff to a retry bucket, the dead-letter queue or the
//! parking lane on failure, one bounded NACK with requeue when a handoff fails.
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
//! async fn main() -> Result<ShutdownReport, lily::rabbit::Error> {
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
//! [`Publisher`](rabbit::Publisher) sends what a consumer takes, each message with its own
//! evidence ([`Published`](rabbit::Published)); with feature `testing`, `lily::testing` settles a
//! synthetic delivery through the consumer's own gate, handler and decision machine, with no
//! broker.
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `health` | `lily::rabbit::health::serve`: `/livez`, `/readyz` and `/metrics` (Prometheus) over HTTP |
//! | `testing` | `lily::testing`: settle a synthetic delivery through the real gate, hooks, handler and decision machine, in process, with no broker |
//! | `otel` | a delivery's W3C `traceparent` header becomes the parent of its `delivery` span, through `tracing-opentelemetry`; the publisher writes the current span's context into what it sends. Copies carry the header with or without it |
//! | `mongo` | `lily::mongo`: the MongoDB transaction scope, transactional inbox and fenced lease; [`prelude`] gains `MongoScope`, `MongoConfig` and the `MongoTx` extractor |
//!
//! None is on by default.

pub use lily_mq_core as core;
#[cfg(feature = "mongo")]
pub use lily_mq_mongo as mongo;
pub use lily_mq_rabbit as rabbit;
/// Logging with no message body in any line: [`logging::init`] is how the examples set it up.
pub use lily_mq_rabbit::logging;
#[cfg(feature = "testing")]
pub use lily_mq_rabbit::testing;

/// What most services need.
pub mod prelude {
    pub use lily_mq_core::{
        Attempt, Cancellation, CleanupError, FailureKind, Headers, Hook, Json, Meta, Payload,
        Policy, QueueHandlerError, RawDelivery, Router, State,
    };
    pub use lily_mq_core::{HandlerResult, ShutdownBudget, ShutdownReport, Trigger};
    pub use lily_mq_rabbit::{
        ClientCertificate, Consumer, ConsumerConfig, Destination, LeaderLocator, Outgoing,
        Published, Publisher, PublisherConfig, QueueKind, ReportSinks, Shutdown, TopologyMode,
        emit,
    };

    /// The Mongo scope and its extractor (feature `mongo`).
    #[cfg(feature = "mongo")]
    pub use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
}
