//! The RabbitMQ transport of Lily, built on lapin.
//!
//! [`Consumer`] drives the sans-IO core of `lily-mq-core`: it declares or verifies the
//! [`Topology`], consumes with prefetch and a concurrency limit, gates every delivery, runs the
//! handler under a timeout and panic guard, and carries out the plan the decision table chose:
//! ACK, a confirmed handoff (mandatory publish → publisher confirm → original ACK), one bounded
//! NACK with requeue, or a reject to the dead-letter exchange. Nothing is sent for a delivery
//! whose channel is gone; that is recorded as lost authority. [`Shutdown`] starts the phased
//! shutdown whose [`ShutdownReport`](lily_mq_core::ShutdownReport) lists every delivery whose
//! settlement is unresolved; [`emit`] writes it out.

mod channel;
mod config;
mod connect;
mod consume;
mod consumer;
mod copy;
mod delivery;
mod error;
#[cfg(feature = "health")]
pub mod health;
pub mod logging;
mod outbox;
mod publish;
mod report;
mod service;
mod shutdown;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
mod topology;
mod trace;
mod version;
// Public to the fuzz targets through `testing`.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
mod wire;

pub use config::ConsumerConfig;
pub use connect::{ClientCertificate, broker_version, connect};
pub use consumer::{Consumer, Stats};
pub use copy::replay;
pub use error::{BrokerError, ConfigError, Error, MissingPermission};
pub use publish::outgoing::{Destination, HeaderValue, Outgoing, PUBLISH_ID};
pub use publish::publisher::{Published, Publisher, PublisherConfig};
pub use report::{ReportSinks, emit};
pub use shutdown::Shutdown;
pub use topology::{Applied, LeaderLocator, QueueKind, Topology, TopologyError, TopologyMode};
pub use version::BrokerVersion;

/// A `tracing` filter directive that silences lapin's log of returned messages: lapin logs each
/// message the broker returns, body and headers included, at WARN. [`logging::init`] and
/// [`logging::filter`] always add it; an application that builds its own filter adds it to every
/// one, also one taken from `RUST_LOG` (a consumer or publisher started without it says so):
///
/// ```
/// # use tracing_subscriber::EnvFilter;
/// let filter = EnvFilter::try_from_default_env()
///     .unwrap_or_else(|_| EnvFilter::new("warn,lily_mq_rabbit=info"))
///     .add_directive(lily_mq_rabbit::NO_BODY_LOGS.parse().expect("a valid directive"));
/// ```
pub const NO_BODY_LOGS: &str = "lapin::returned_messages=off";
