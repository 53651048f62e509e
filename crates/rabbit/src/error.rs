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
        source: BrokerError,
    },
    /// TLS with the broker failed for good: it refused the client certificate, or its own
    /// certificate is not trusted. Retrying with the same certificates cannot help.
    #[error("TLS with {node} failed: {problem}")]
    Tls {
        /// The node, as `scheme://host:port/vhost`: never the credentials.
        node: String,
        /// What the handshake said, for example that the client certificate has expired.
        problem: &'static str,
        /// The TLS error, with the broker's alert.
        #[source]
        source: BrokerError,
    },
    /// The broker user lacks a permission Lily needs, on a queue or an exchange of its
    /// topology. Retrying cannot help until it is granted (see the security chapter's `rabbitmqctl
    /// set_permissions` lines).
    #[error("the broker user lacks {missing}")]
    Permission {
        /// The permission, the resource and what Lily was doing.
        missing: Box<MissingPermission>,
        /// The broker's error.
        #[source]
        source: BrokerError,
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
        source: BrokerError,
    },
    /// The broker refused the topology (missing in verify mode, or declared with other
    /// arguments).
    #[error("topology of queue {queue:?} refused by the broker")]
    Topology {
        /// The work queue.
        queue: String,
        /// The broker's error.
        #[source]
        source: BrokerError,
    },
}

/// What the broker or the connection answered, as the AMQP client reported it: its text, and
/// the errors beneath it through [`source`](std::error::Error::source). The client's own error
/// type is not part of Lily's API.
#[derive(Debug)]
pub struct BrokerError(pub(crate) lapin::Error);

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BrokerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
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

/// A permission the broker refused: which, on what, and what for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingPermission {
    /// `configure`, `write` or `read`, or two of them when the broker checks both for one
    /// request and its answer does not say which failed.
    pub permission: &'static str,
    /// The resource as the broker names it: `queue 'orders' in vhost '/'`.
    pub resource: String,
    /// What Lily was doing: `declare queue 'orders'`.
    pub doing: String,
}

impl std::fmt::Display for MissingPermission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the {} permission on {} (needed to {})",
            self.permission, self.resource, self.doing
        )
    }
}

/// A broker resource a request touches and the permission it needs there.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Needs<'a> {
    /// `queue` or `exchange`.
    pub(crate) kind: &'static str,
    /// Its name; `""` is the default exchange, which the broker calls `amq.default`.
    pub(crate) name: &'a str,
    pub(crate) permission: &'static str,
}

impl<'a> Needs<'a> {
    pub(crate) fn queue(name: &'a str, permission: &'static str) -> Self {
        Self {
            kind: "queue",
            name,
            permission,
        }
    }

    pub(crate) fn exchange(name: &'a str, permission: &'static str) -> Self {
        Self {
            kind: "exchange",
            name: if name.is_empty() { "amq.default" } else { name },
            permission,
        }
    }
}

/// The permission the broker refused, when `err` is its `ACCESS_REFUSED` to a request that
/// needs `needs` while `doing`. The broker's answer names the resource (`access to queue 'x'
/// in vhost '/' refused for user 'u'`) but not the permission: that comes from `needs`.
pub(crate) fn missing_permission(
    err: &lapin::Error,
    doing: impl FnOnce() -> String,
    needs: &[Needs<'_>],
) -> Option<MissingPermission> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return None;
    };
    if amqp.kind() != &AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) {
        return None;
    }
    let message = amqp.get_message().as_str();
    let named = message
        .split_once("access to ")
        .and_then(|(_, rest)| rest.split_once(" refused for user"))
        .map(|(resource, _)| resource.to_owned());
    let matching = named.as_deref().and_then(|resource| {
        needs
            .iter()
            .find(|n| resource.starts_with(&format!("{} '{}'", n.kind, n.name)))
    });
    let (permission, resource) = match (matching, named) {
        (Some(n), Some(resource)) => (n.permission, resource),
        (_, named) => {
            let first = needs.first()?;
            let resource = named.unwrap_or_else(|| format!("{} '{}'", first.kind, first.name));
            (first.permission, resource)
        }
    };
    Some(MissingPermission {
        permission,
        resource,
        doing: doing(),
    })
}
