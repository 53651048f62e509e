//! Errors of the transport.

/// Why a consumer could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The policy cannot work.
    #[error("invalid policy")]
    Policy(#[from] lily_mq_core::PolicyError),
    /// The configuration cannot work.
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// The broker refused the topology (missing in verify mode, or declared with other
    /// arguments).
    #[error("topology of queue {queue:?} refused by the broker")]
    Topology {
        /// The work queue.
        queue: String,
        /// The broker's error.
        #[source]
        source: lapin::Error,
    },
}
