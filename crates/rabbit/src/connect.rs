//! Opening a connection to the broker: the consuming one and the handoff one.

use lapin::types::LongString;
use lapin::{Connection, ConnectionProperties};

/// Where and how to connect.
#[derive(Clone)]
pub(crate) struct Endpoint {
    /// `amqp://` or `amqps://` URL; it may hold credentials, so it is never logged.
    pub(crate) url: String,
    /// PEM certificates to trust for `amqps://` besides the system roots.
    pub(crate) tls_ca_pem: Option<String>,
    /// The work queue, part of each connection's name.
    pub(crate) queue: String,
}

/// Opens a connection named `lily:<queue>:<role>` (the name the broker's tools show).
pub(crate) async fn connect(endpoint: &Endpoint, role: &str) -> lapin::Result<Connection> {
    let name = format!("lily:{}:{role}", endpoint.queue);
    let props =
        ConnectionProperties::default().with_connection_name(LongString::from(name.into_bytes()));
    match &endpoint.tls_ca_pem {
        None => Connection::connect(&endpoint.url, props).await,
        Some(ca) => {
            let tls = lapin::tcp::OwnedTLSConfig {
                identity: None,
                cert_chain: Some(ca.clone()),
            };
            let runtime = lapin::runtime::default_runtime()?;
            Connection::connect_with_config(&endpoint.url, props, tls, runtime).await
        }
    }
}

/// `scheme://host:port/vhost` without user or password.
pub(crate) fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host = rest.split(['?', '#']).next().unwrap_or(rest);
    format!("{scheme}://{host}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_logged_without_credentials() {
        assert_eq!(
            redact("amqp://user:s3cret@127.0.0.1:5672/%2f?heartbeat=10"),
            "amqp://127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqps://host/vh"), "amqps://host/vh");
    }
}
