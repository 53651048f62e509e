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

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::tcp::{AsyncTcpStream, OwnedIdentity, OwnedTLSConfig};
use lapin::types::LongString;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use tracing::{debug, warn};

use crate::version::BrokerVersion;
use crate::wire::{Rewrites, Sanitizing, Transport, Wire};

/// A client certificate for mutual TLS (`amqps://` to a broker with `fail_if_no_peer_cert`):
/// the PEM certificate chain, leaf first, and its PEM private key (PKCS#8, PKCS#1 or SEC1).
///
/// `Debug` shows neither: only the size of the chain, never the key.
#[derive(Clone)]
pub struct ClientCertificate {
    chain_pem: String,
    key_pem: String,
}

impl ClientCertificate {
    /// The certificate chain and key, both PEM, as read from `tls.crt` and `tls.key`.
    pub fn from_pem(chain_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        Self {
            chain_pem: chain_pem.into(),
            key_pem: key_pem.into(),
        }
    }

    /// Why the chain or the key cannot be used, without quoting either.
    pub(crate) fn problem(&self) -> Option<&'static str> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let mut certificates = CertificateDer::pem_slice_iter(self.chain_pem.as_bytes());
        match certificates.next() {
            Some(Ok(_)) if certificates.all(|c| c.is_ok()) => {}
            _ => return Some("has a certificate chain that is not PEM certificates"),
        }
        match PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()) {
            Ok(_) => None,
            Err(_) => Some("has a key that is not a PEM private key"),
        }
    }

    fn identity(&self) -> OwnedIdentity {
        OwnedIdentity::PKCS8 {
            pem: self.chain_pem.clone().into_bytes(),
            key: self.key_pem.clone().into_bytes(),
        }
    }
}

impl std::fmt::Debug for ClientCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCertificate")
            .field("chain_pem_bytes", &self.chain_pem.len())
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// How `amqps://` connections check the broker and present themselves.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tls {
    /// PEM certificates to trust besides the system roots.
    pub(crate) ca_pem: Option<String>,
    /// The client certificate, for mutual TLS.
    pub(crate) client: Option<ClientCertificate>,
}

/// Where and how to connect. Not `Debug`: the URL carries credentials.
#[derive(Clone)]
pub(crate) struct Endpoint {
    /// The parsed URL; its host is the first address.
    uri: AMQPUri,
    /// The nodes, in the order given: `(host, port)`.
    addresses: Vec<(String, u16)>,
    /// How `amqps://` connects.
    tls: Tls,
    /// The work queue, part of each connection's name.
    queue: String,
    /// How long one address may take to connect (TCP, TLS and the AMQP handshake).
    connect_timeout: Duration,
}

/// Why an endpoint cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointError {
    /// The URL does not parse (its text is not repeated: it may hold a password).
    Url,
    /// An address is not `host` or `host:port`.
    Address,
}

impl Endpoint {
    /// The endpoint of `url` and the further `addresses` (`host` or `host:port`, the port
    /// defaulting to the URL scheme's).
    pub(crate) fn new(
        url: &str,
        addresses: &[String],
        tls: Tls,
        queue: &str,
        connect_timeout: Duration,
    ) -> Result<Self, EndpointError> {
        let uri = AMQPUri::from_str(url).map_err(|_| EndpointError::Url)?;
        let default_port = match uri.scheme {
            AMQPScheme::AMQP => 5672,
            AMQPScheme::AMQPS => 5671,
        };
        let mut nodes = vec![(uri.authority.host.clone(), uri.authority.port)];
        for address in addresses {
            let node = parse_address(address, default_port).ok_or(EndpointError::Address)?;
            if !nodes.contains(&node) {
                nodes.push(node);
            }
        }
        Ok(Self {
            uri,
            addresses: nodes,
            tls,
            queue: queue.to_owned(),
            connect_timeout,
        })
    }

    /// The first address, as `scheme://host:port/vhost`, for logs.
    pub(crate) fn display(&self) -> String {
        let (host, port) = &self.addresses[0];
        self.display_node(host, *port, None)
    }

    fn display_node(&self, host: &str, port: u16, ip: Option<SocketAddr>) -> String {
        let scheme = match self.uri.scheme {
            AMQPScheme::AMQP => "amqp",
            AMQPScheme::AMQPS => "amqps",
        };
        let vhost = &self.uri.vhost;
        match ip {
            Some(ip) if ip.ip().to_string() != host => {
                format!("{scheme}://{host}:{port}/{vhost} ({ip})")
            }
            _ => format!("{scheme}://{host}:{port}/{vhost}"),
        }
    }

    /// How many addresses were given, the URL's own host included, duplicates dropped.
    pub(crate) fn address_count(&self) -> usize {
        self.addresses.len()
    }

    /// Every node to try, in the order given, each name resolved now (within the connect
    /// timeout: a resolver that does not answer must not hold a reconnect), and the error of
    /// the last name that did not resolve.
    async fn nodes(&self) -> (Vec<Node>, Option<std::io::Error>) {
        let mut nodes = Vec::new();
        let mut unresolved = None;
        for (host, port) in &self.addresses {
            let lookup = tokio::net::lookup_host((host.as_str(), *port));
            let resolved = tokio::time::timeout(self.connect_timeout, lookup)
                .await
                .unwrap_or_else(|_| {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "name resolution timed out",
                    ))
                });
            match resolved {
                Ok(ips) => {
                    let before = nodes.len();
                    for ip in ips {
                        let node = Node::new(host, *port, ip);
                        if !nodes[before..].contains(&node) {
                            nodes.push(node);
                        }
                    }
                }
                Err(err) => {
                    debug!(host = %host, error = %err, "address does not resolve");
                    unresolved = Some(err);
                }
            }
        }
        (nodes, unresolved)
    }

    /// Opens a connection to `node`, named `lily:<queue>:<role>` (the name the broker's tools
    /// show), within the connect timeout, on a stream that rewrites what lapin could not parse
    /// (see [`crate::wire`]); returns it with the deliveries so rewritten. With `version`,
    /// first reads the node's version on a connection of its own ([`crate::version`]) and
    /// writes it there (`None` when the node did not say).
    async fn dial(
        &self,
        node: &Node,
        role: &str,
        version: Option<&Arc<Mutex<Option<BrokerVersion>>>>,
    ) -> lapin::Result<(Connection, Rewrites)> {
        let version = version.cloned();
        let name = format!("lily:{}:{role}", self.queue);
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(name.into_bytes()));
        let mut uri = self.uri.clone();
        uri.authority.host.clone_from(&node.host);
        uri.authority.port = node.port;
        let presents_certificate = self.tls.client.is_some();
        // The verdict's wait counts against the connect timeout: half of it at most.
        let verdict_cap = self.connect_timeout / 2;
        let probe_wait = self.connect_timeout / 2;
        let tls = OwnedTLSConfig {
            identity: self.tls.client.as_ref().map(ClientCertificate::identity),
            cert_chain: self.tls.ca_pem.clone(),
        };
        let ip = node.ip;
        let tokio = async_rs::Tokio::current();
        let rewrites = Rewrites::default();
        let rewritten = rewrites.clone();
        let opening = Connection::connector(
            uri,
            Wire::runtime(),
            async move |uri: AMQPUri, _| {
                // TCP to the resolved address; TLS checks the certificate against the name.
                let open = async || {
                    let stream: Transport = AsyncTcpStream::connect(&tokio, ip).await?;
                    Ok::<_, lapin::Error>(match uri.scheme {
                        AMQPScheme::AMQP => stream,
                        AMQPScheme::AMQPS => {
                            let started = std::time::Instant::now();
                            let mut stream =
                                stream.into_tls(&uri.authority.host, tls.as_ref()).await?;
                            if presents_certificate {
                                let wait = verdict_wait(started.elapsed()).min(verdict_cap);
                                await_verdict(&mut stream, wait).await?;
                            }
                            stream
                        }
                    })
                };
                if let Some(version) = &version {
                    let mut probe = open().await?;
                    let read = crate::version::read_version(&mut probe, probe_wait).await;
                    *crate::sync::lock(version) = read;
                }
                let stream = open().await?;
                // A new stream: its channels and delivery tags start over.
                rewritten.clear();
                Ok(AsyncTcpStream::Plain(Sanitizing::new(
                    stream,
                    rewritten.clone(),
                )))
            },
            props,
        );
        match tokio::time::timeout(self.connect_timeout, opening).await {
            Ok(result) => result.map(|connection| (connection, rewrites)),
            Err(_) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out").into())
            }
        }
    }
}

/// How many times a node is dialed again at once when a connection that presented a client
/// certificate was reset or closed: the broker refusing the certificate may have reset the
/// connection before its alert was read, and the next attempt usually reads it.
const CERTIFICATE_REDIALS: usize = 2;

/// Whether `err` is the connection reset, aborted or closed under the client.
fn reset(err: &lapin::Error) -> bool {
    use std::io::ErrorKind;
    let lapin::ErrorKind::IOError(io) = err.kind() else {
        return false;
    };
    matches!(
        io.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::UnexpectedEof
    )
}

/// How long a connection that presents a client certificate listens for the broker's verdict
/// on it before speaking AMQP (see [`await_verdict`]): four times as long as the handshake took,
/// since a busy broker takes longer to judge the certificate, and within 250 ms to 2 s.
fn verdict_wait(handshake: Duration) -> Duration {
    (handshake * 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
}

/// Waits up to `wait` for the broker to refuse the client certificate. Over TLS 1.3 the
/// broker judges it after the handshake is complete on this side, and answers a refused one
/// with an alert. Writing the AMQP header at once would race that alert: the broker, closed
/// by then, resets the connection, which can discard the alert unread, and a refused
/// certificate would look like a dropped connection. A broker that accepts says nothing before
/// the header, so the wait ends by its timeout, having read nothing.
async fn await_verdict<S>(stream: &mut AsyncTcpStream<S>, wait: Duration) -> std::io::Result<()>
where
    S: futures_io::AsyncRead + futures_io::AsyncWrite + Send + Unpin + 'static,
{
    use futures_io::AsyncRead;
    let mut byte = [0u8; 1];
    let read = std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_read(cx, &mut byte));
    match tokio::time::timeout(wait, read).await {
        Err(_) => Ok(()),
        Ok(Err(err)) => Err(err),
        Ok(Ok(0)) => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the broker closed the connection after the TLS handshake",
        )),
        Ok(Ok(_)) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the broker spoke before the AMQP protocol header",
        )),
    }
}

/// What a TLS handshake's error says, when it is final: the broker refused the client
/// certificate (its alert), or the broker's certificate is not trusted. Retrying with the same
/// certificates cannot help. `None` for anything else (a reset, a timeout). The alert or the
/// certificate problem itself is in `err`, the error's source.
pub(crate) fn tls_refusal(err: &lapin::Error) -> Option<&'static str> {
    use rustls::AlertDescription as Alert;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        let tls = current.downcast_ref::<rustls::Error>().or_else(|| {
            current
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        match tls {
            Some(rustls::Error::AlertReceived(alert)) => {
                return Some(match alert {
                    Alert::CertificateRequired => {
                        "the broker refused the client certificate: none was presented and the broker requires one"
                    }
                    Alert::CertificateExpired => {
                        "the broker refused the client certificate: it has expired or is not valid yet"
                    }
                    Alert::UnknownCA => {
                        "the broker refused the client certificate: it is not signed by a CA the broker trusts"
                    }
                    Alert::CertificateRevoked => {
                        "the broker refused the client certificate: it was revoked"
                    }
                    Alert::BadCertificate
                    | Alert::UnsupportedCertificate
                    | Alert::CertificateUnknown
                    | Alert::AccessDenied => "the broker refused the client certificate",
                    _ => "the broker ended the TLS handshake with an alert",
                });
            }
            Some(rustls::Error::InvalidCertificate(_)) => {
                return Some("the broker's certificate is not trusted");
            }
            _ => source = current.source(),
        }
    }
    None
}

/// One node to try: an address and one of the IP addresses its name resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    host: String,
    port: u16,
    ip: SocketAddr,
}

impl Node {
    fn new(host: &str, port: u16, ip: SocketAddr) -> Self {
        Self {
            host: host.to_owned(),
            port,
            ip,
        }
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn parse_address(address: &str, default_port: u16) -> Option<(String, u16)> {
    let address = address.trim();
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let (host, rest) = rest.split_once(']')?;
        match rest {
            "" => (host, None),
            rest => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match address.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            Some(_) => return None,
            None => (address, None),
        }
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    if host.is_empty() || !host.chars().all(valid) {
        return None;
    }
    let port = match port {
        Some(port) => port.parse().ok().filter(|p| *p != 0)?,
        None => default_port,
    };
    Some((host.to_owned(), port))
}

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
    fn addresses_parse_with_the_scheme_port_as_default() {
        assert_eq!(
            parse_address("rabbit-1", 5672),
            Some(("rabbit-1".into(), 5672))
        );
        assert_eq!(
            parse_address(" rabbit-1:5673 ", 5672),
            Some(("rabbit-1".into(), 5673))
        );
        assert_eq!(
            parse_address("10.0.0.2:5671", 5672),
            Some(("10.0.0.2".into(), 5671))
        );
        assert_eq!(
            parse_address("[::1]:5673", 5672),
            Some(("::1".into(), 5673))
        );
        assert_eq!(parse_address("[::1]", 5671), Some(("::1".into(), 5671)));
        for bad in [
            "",
            ":5672",
            "host:",
            "host:0",
            "host:99999",
            "::1",
            "a b:1",
            "u:p@h:1",
            "[::1]x",
        ] {
            assert_eq!(parse_address(bad, 5672), None, "{bad:?}");
        }
    }

    #[test]
    fn the_urls_host_comes_first_and_duplicates_go() {
        let endpoint = Endpoint::new(
            "amqp://user:s3cret@node-a:5680/vh",
            &["node-b".into(), "node-a:5680".into(), "node-c:5690".into()],
            Tls::default(),
            "orders",
            Duration::from_secs(1),
        )
        .expect("valid");
        assert_eq!(
            endpoint.addresses,
            [
                ("node-a".to_owned(), 5680),
                ("node-b".to_owned(), 5672),
                ("node-c".to_owned(), 5690)
            ]
        );
        assert_eq!(endpoint.display(), "amqp://node-a:5680/vh");
        let shown = endpoint.display_node("node-b", 5672, Some("10.1.2.3:5672".parse().unwrap()));
        assert_eq!(shown, "amqp://node-b:5672/vh (10.1.2.3:5672)");
        assert!(matches!(
            Endpoint::new("http://x", &[], Tls::default(), "q", Duration::from_secs(1)),
            Err(EndpointError::Url)
        ));
        assert!(matches!(
            Endpoint::new(
                "amqp://x",
                &["a:b:c".into()],
                Tls::default(),
                "q",
                Duration::from_secs(1)
            ),
            Err(EndpointError::Address)
        ));
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_several_addresses_is_several_nodes() {
        let endpoint = Endpoint::new(
            "amqp://127.0.0.1:5672/%2f",
            &["127.0.0.1:5673".into(), "localhost:5674".into()],
            Tls::default(),
            "orders",
            Duration::from_secs(1),
        )
        .expect("valid");
        let (nodes, unresolved) = endpoint.nodes().await;
        assert!(unresolved.is_none());
        let ips: Vec<_> = nodes.iter().map(|n| n.ip).collect();
        assert_eq!(ips[0], "127.0.0.1:5672".parse().unwrap());
        assert_eq!(ips[1], "127.0.0.1:5673".parse().unwrap());
        // `localhost` is one node per address it resolves to (127.0.0.1, often ::1 too).
        let resolved: Vec<_> = tokio::net::lookup_host(("localhost", 5674))
            .await
            .unwrap()
            .collect();
        assert_eq!(nodes.len(), 2 + resolved.len());
        assert!(
            nodes[2..]
                .iter()
                .all(|n| n.host == "localhost" && n.port == 5674)
        );
    }

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
