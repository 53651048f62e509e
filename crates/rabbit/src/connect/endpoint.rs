//! Where to connect: the URL and the nodes, resolved again at every connect.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::tcp::{AsyncTcpStream, OwnedTLSConfig};
use lapin::types::LongString;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use tracing::debug;

use super::tls::{ClientCertificate, Tls, await_verdict, verdict_wait};
use crate::version::BrokerVersion;
use crate::wire::{Rewrites, Sanitizing, Silence, Transport, Wire};

/// Where and how to connect. Not `Debug`: the URL carries credentials.
#[derive(Clone)]
pub(crate) struct Endpoint {
    /// The parsed URL; its host is the first address.
    uri: AMQPUri,
    /// The nodes, in the order given: `(host, port)`.
    addresses: Vec<(String, u16)>,
    /// How `amqps://` connects.
    pub(super) tls: Tls,
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

    pub(super) fn display_node(&self, host: &str, port: u16, ip: Option<SocketAddr>) -> String {
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
    pub(super) async fn nodes(&self) -> (Vec<Node>, Option<std::io::Error>) {
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
    pub(super) async fn dial(
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
        // The silence of the stream the connection opened on: a stream that failed early is
        // dropped (its watch with it) and lapin asks for another.
        let latest: Arc<Mutex<Option<Silence>>> = Arc::default();
        let timed = Arc::clone(&latest);
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
                let silence = Silence::default();
                *crate::sync::lock(&timed) = Some(silence.clone());
                Ok(AsyncTcpStream::Plain(
                    Sanitizing::new(stream, rewritten.clone()).timing(silence),
                ))
            },
            props,
        );
        match tokio::time::timeout(self.connect_timeout, opening).await {
            Ok(result) => result.map(|connection| {
                // Open: the broker's silence is timed from here, at the negotiated heartbeat.
                if let Some(silence) = crate::sync::lock(&latest).take() {
                    silence.arm(connection.configuration().heartbeat());
                }
                (connection, rewrites)
            }),
            Err(_) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out").into())
            }
        }
    }
}

/// One node to try: an address and one of the IP addresses its name resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Node {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) ip: SocketAddr,
}

impl Node {
    pub(super) fn new(host: &str, port: u16, ip: SocketAddr) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn addresses_parse_with_the_scheme_port_as_default() {
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
    pub(super) fn the_urls_host_comes_first_and_duplicates_go() {
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
    pub(super) async fn a_name_that_resolves_to_several_addresses_is_several_nodes() {
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
}
