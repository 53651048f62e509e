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
//! # async fn run() -> Result<(), lily::rabbit::Error> {
//! let router = Router::new().route("order.placed", place);
//! let consumer = Consumer::new("amqp://127.0.0.1:5672/%2f", ConsumerConfig::new("orders"), router);
//! let shutdown = Shutdown::default(); // 25 s budget: fits Kubernetes' 30 s grace period
//! shutdown.listen_for_signals().expect("signal handlers"); // SIGTERM drains, a second forces
//! let report = consumer.run(shutdown).await?;
//! emit(&report, &ReportSinks::default()).expect("report written");
//! std::process::exit(report.exit_code()); // 0 clean, 3 unresolved
//! # Ok(()) }
//! ```

pub use lily_mq_core as core;
#[cfg(feature = "mongo")]
pub use lily_mq_mongo as mongo;
pub use lily_mq_rabbit as rabbit;

/// What most services need.
pub mod prelude {
    pub use lily_mq_core::{
        Attempt, Cancellation, CleanupError, FailureKind, Headers, Hook, Json, Meta, Payload,
        Policy, QueueHandlerError, RawDelivery, Router,
    };
    pub use lily_mq_core::{ShutdownBudget, ShutdownReport, Trigger};
    pub use lily_mq_rabbit::{
        Consumer, ConsumerConfig, LeaderLocator, QueueKind, ReportSinks, Shutdown, TopologyMode,
        emit,
    };
}
