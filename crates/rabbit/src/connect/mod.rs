//! Opening a connection to the broker, the consuming one and the handoff one, through one of
//! several addresses (the nodes of a cluster).
//!
//! The URL gives the scheme, the credentials, the virtual host and the query; the addresses
//! give the nodes: the URL's own host first, then [`ConsumerConfig::addresses`]. Each address
//! is resolved again at every connect, and a name that resolves to several IP addresses (a
//! Kubernetes headless service, say) counts as that many nodes. A [`Dialer`] walks them from
//! where its last success left off, so a connection lost with its node is opened again on
//! another one first. The consuming and the handoff connection dial on their own and may land
//! on different nodes.
//!
//! [`ConsumerConfig::addresses`]: crate::ConsumerConfig::addresses

mod endpoint;
mod tls;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use tracing::{debug, warn};

use crate::error::BrokerError;
use crate::version::BrokerVersion;
use crate::wire::Rewrites;

pub(crate) use self::endpoint::{Endpoint, EndpointError};
pub use self::tls::ClientCertificate;
use self::tls::{CERTIFICATE_REDIALS, reset};
pub(crate) use self::tls::{Tls, tls_refusal};

/// Connects one role (consuming or handoffs) through an endpoint's nodes in rotation.
pub(crate) struct Dialer {
    endpoint: Endpoint,
    role: &'static str,
    /// Where the next connect starts: just after the node of the last success.
    next: AtomicUsize,
    /// The node of the last success, for logs.
    last: std::sync::Mutex<String>,
}

impl Dialer {
    pub(crate) fn new(endpoint: Endpoint, role: &'static str) -> Self {
        Self {
            endpoint,
            role,
            next: AtomicUsize::new(0),
            last: std::sync::Mutex::new(String::new()),
        }
    }

    /// The node of the last connection opened, as `scheme://host:port/vhost (ip)`.
    pub(crate) fn node(&self) -> String {
        crate::sync::lock(&self.last).clone()
    }

    /// The endpoint dialled.
    pub(crate) fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Opens a connection on the first node that takes it, trying each once, starting after
    /// the node of the last success. A node that refuses the credentials or the virtual host
    /// ends the round at once: the nodes of a cluster share their users.
    ///
    /// # Errors
    /// Every node failed: the last node's error, or the refusal.
    pub(crate) async fn connect(&self) -> lapin::Result<Connection> {
        Ok(self.connect_reading(None).await?.0)
    }

    /// [`Dialer::connect`], and the version of the node connected to, read just before on a
    /// connection of its own (see [`crate::version`]); `None` when the node did not say.
    ///
    /// # Errors
    /// As [`Dialer::connect`].
    pub(crate) async fn connect_with_version(
        &self,
    ) -> lapin::Result<(Connection, Option<BrokerVersion>)> {
        let (connection, version, _) = self.connect_consuming(true).await?;
        Ok((connection, version))
    }

    /// [`Dialer::connect`] for consuming: with the deliveries whose metadata the connection's
    /// stream rewrote (see [`crate::wire`]), and, when `read_version`, the node's version as
    /// [`Dialer::connect_with_version`] reads it.
    ///
    /// # Errors
    /// As [`Dialer::connect`].
    pub(crate) async fn connect_consuming(
        &self,
        read_version: bool,
    ) -> lapin::Result<(Connection, Option<BrokerVersion>, Rewrites)> {
        let version = Arc::new(Mutex::new(None));
        let (connection, rewrites) = self
            .connect_reading(read_version.then_some(&version))
            .await?;
        let version = crate::sync::lock(&version).take();
        Ok((connection, version, rewrites))
    }

    async fn connect_reading(
        &self,
        version: Option<&Arc<Mutex<Option<BrokerVersion>>>>,
    ) -> lapin::Result<(Connection, Rewrites)> {
        let (nodes, unresolved) = self.endpoint.nodes().await;
        if nodes.is_empty() {
            let err = unresolved.unwrap_or_else(|| std::io::Error::other("no address resolved"));
            return Err(err.into());
        }
        let start = self.next.load(Ordering::Relaxed) % nodes.len();
        // The next round starts elsewhere, unless a node below takes the connection.
        self.next.store(start + 1, Ordering::Relaxed);
        let mut last = None;
        for offset in 0..nodes.len() {
            let index = (start + offset) % nodes.len();
            let node = &nodes[index];
            let shown = self
                .endpoint
                .display_node(&node.host, node.port, Some(node.ip));
            let mut dialed = self.endpoint.dial(node, self.role, version).await;
            for _ in 0..CERTIFICATE_REDIALS {
                match &dialed {
                    Err(err) if self.endpoint.tls.client.is_some() && reset(err) => {
                        dialed = self.endpoint.dial(node, self.role, version).await;
                    }
                    _ => break,
                }
            }
            match dialed {
                Ok(connection) => {
                    self.next.store(index + 1, Ordering::Relaxed);
                    debug!(role = self.role, node = %shown, "connected");
                    *crate::sync::lock(&self.last) = shown;
                    return Ok(connection);
                }
                Err(err) if refused(&err) || tls_refusal(&err).is_some() => return Err(err),
                Err(err) => {
                    if nodes.len() > 1 {
                        warn!(role = self.role, node = %shown, error = %err, "node unreachable; trying the next");
                    }
                    last = Some(err);
                }
            }
        }
        Err(last.expect("at least one node was tried"))
    }
}

/// Opens one connection to `url` the way a consumer opens its own (TLS trusting `tls_ca_pem`
/// besides the system roots, within 5 s), named `lily:<queue>:<role>` in the broker's tools.
/// For tools such as `lily dlq`.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) when the URL does not parse,
/// [`Error::Refused`](crate::Error::Refused) when the broker refused the credentials or the
/// virtual host, [`Error::Connect`](crate::Error::Connect) otherwise.
pub async fn connect(
    url: &str,
    tls_ca_pem: Option<String>,
    queue: &str,
    role: &'static str,
) -> Result<Connection, crate::Error> {
    let tls = Tls {
        ca_pem: tls_ca_pem,
        client: None,
    };
    let endpoint = Endpoint::new(url, &[], tls, queue, Duration::from_secs(5)).map_err(|_| {
        crate::Error::Config(crate::error::ConfigError {
            field: "url",
            problem: "does not parse as amqp:// or amqps://".into(),
        })
    })?;
    let node = endpoint.display();
    let dialer = Dialer::new(endpoint, role);
    dialer
        .connect()
        .await
        .map_err(|source| crate::Error::from_connect(source, queue, node))
}

/// The version of the broker at `url` (see [`BrokerVersion`]), read from the `connection.start`
/// of a connection that ends there: what [`Topology::broker`](crate::Topology::broker) takes
/// when an application declares a topology itself. The consumer reads it on its own.
///
/// # Errors
/// As [`connect`]; `Ok(None)` when the broker answered without a version.
pub async fn broker_version(
    url: &str,
    tls_ca_pem: Option<String>,
) -> Result<Option<BrokerVersion>, crate::Error> {
    let tls = Tls {
        ca_pem: tls_ca_pem,
        client: None,
    };
    let endpoint = Endpoint::new(url, &[], tls, "", Duration::from_secs(5)).map_err(|_| {
        crate::Error::Config(crate::error::ConfigError {
            field: "url",
            problem: "does not parse as amqp:// or amqps://".into(),
        })
    })?;
    let node = endpoint.display();
    let dialer = Dialer::new(endpoint, "version");
    match dialer.connect_with_version().await {
        Ok((connection, version)) => {
            let _ = connection.close(200, "version read".into()).await;
            Ok(version)
        }
        Err(source) => Err(crate::Error::from_connect(source, "", node)),
    }
}

impl crate::Error {
    /// A failed connect, classified once for every caller: [`Error::Refused`] when the broker
    /// refused the credentials or the virtual host, [`Error::Tls`] when TLS failed for good,
    /// [`Error::Connect`] (worth retrying) otherwise. `queue` names what the connection was for,
    /// `node` where it went (never with credentials).
    pub(crate) fn from_connect(source: lapin::Error, queue: &str, node: String) -> Self {
        if refused(&source) {
            Self::Refused {
                queue: queue.to_owned(),
                source: BrokerError(source),
            }
        } else if let Some(problem) = tls_refusal(&source) {
            Self::Tls {
                node,
                problem,
                source: BrokerError(source),
            }
        } else {
            Self::Connect {
                node,
                source: BrokerError(source),
            }
        }
    }
}

/// Whether the broker refused a connection for good: wrong credentials (403) or no access to
/// the virtual host (530). Anything else (refused at TCP, closed while opening, as a broker
/// restart looks) is retried with backoff.
pub(crate) fn refused(err: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return false;
    };
    matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
    )
}

/// `delay` with equal jitter: somewhere in `[delay / 2, delay]`, so consumers that lost the
/// same node do not all come back in the same instant.
pub(crate) fn jittered(delay: Duration) -> Duration {
    use std::hash::BuildHasher;
    // `RandomState` is seeded randomly for each instance: enough entropy for a jitter.
    let random = std::collections::hash_map::RandomState::new().hash_one(0u8);
    spread(delay, random)
}

/// The jitter arithmetic: `random` picks a point of `[delay / 2, delay]`.
fn spread(delay: Duration, random: u64) -> Duration {
    let half = delay / 2;
    let span = u64::try_from((delay - half).as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(random.checked_rem(span.saturating_add(1)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_between_half_the_delay_and_the_delay() {
        let delay = Duration::from_millis(800);
        for random in [0, 1, 399_999_999, 400_000_000, 400_000_001, u64::MAX] {
            let d = spread(delay, random);
            assert!(d >= delay / 2 && d <= delay, "{d:?}");
        }
        assert_eq!(spread(Duration::ZERO, 7), Duration::ZERO);
        assert_ne!(
            jittered(delay),
            jittered(delay),
            "two draws differ (1 in 4e8 they don't)"
        );
    }
}
