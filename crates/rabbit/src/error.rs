//! Errors of the transport.

/// Why a consumer could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The policy cannot work.
    #[error("invalid configuration: {0}")]
    Policy(#[from] lily_mq_core::PolicyError),
    /// A setting cannot work; the error names it.
    #[error("invalid configuration: {0}")]
    Config(ConfigError),
    /// The broker refused the connection: the credentials, or the user's access to the
    /// virtual host. Retrying cannot help.
    #[error("the broker refused the connection for queue {queue:?}")]
    Refused {
        /// The work queue.
        queue: String,
        /// The broker's error.
        #[source]
        source: lapin::Error,
    },
    /// TLS with the broker failed for good: it refused the client certificate, or its own
    /// certificate is not trusted. Retrying with the same certificates cannot help.
    #[error("TLS with {node} failed: {problem}")]
    Tls {
        /// The node, as `scheme://host:port/vhost`: never the credentials.
        node: String,
        /// What the handshake said, for example that the client certificate has expired.
        problem: String,
        /// The TLS error.
        #[source]
        source: lapin::Error,
    },
    /// The signal handlers could not be installed
    /// ([`Consumer::run_until_signal`](crate::Consumer::run_until_signal)).
    #[error("cannot listen for SIGTERM and SIGINT")]
    Signals(#[source] std::io::Error),
    /// No node took the connection (see [`connect`](crate::connect)).
    #[error("cannot connect to {node}")]
    Connect {
        /// The node, as `scheme://host:port/vhost`: never the credentials.
        node: String,
        /// The last node's error.
        #[source]
        source: lapin::Error,
    },
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

/// A setting that cannot work: its field and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct ConfigError {
    /// The field of [`ConsumerConfig`](crate::ConsumerConfig) (or `url`, `addresses`, `router`).
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: std::borrow::Cow<'static, str>,
}
