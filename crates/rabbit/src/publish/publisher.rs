//! [`Publisher`]: publishes messages a Lily consumer takes, and says what became of each.
//!
//! Every message is persistent and mandatory, published with a confirm on a connection of the
//! publisher's own, and checked first against the gate of the consumer that will read it: what the
//! gate would refuse is not published. Confirms are pipelined the way the handoff publisher
//! pipelines them (see the `publish` module): four channels, each publish sent at once without
//! waiting for earlier confirms, and a return counts only against the message whose publish id it
//! carries.

use std::time::Duration;

use lily_mq_core::transport::HandoffResult;
use lily_mq_core::{Limits, Reason};

use super::outgoing::{Destination, Outgoing, PUBLISH_ID};
use crate::connect::{ClientCertificate, Endpoint};
use crate::error::{ConfigError, Error};
use crate::publish::{Confirms, Role, Route};

/// What became of one message: the evidence of its publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Published {
    /// The broker confirmed it and did not return it: a queue holds it.
    Confirmed,
    /// The broker returned it: no queue was bound for its route. It is not in any queue.
    Returned,
    /// The broker nacked it: it could not take it (a full quorum queue with `reject-publish`).
    Nacked,
    /// The exchange does not exist: the broker closed the channel (`NOT_FOUND`) and the
    /// message is in no queue. Other publishes in flight on that channel end
    /// [`Published::Failed`].
    NoExchange,
    /// No confirm came within the publisher's timeout: it may or may not be in a queue.
    TimedOut,
    /// The broker blocked the connection (a resource alarm) for the whole timeout: it was not
    /// published.
    Blocked,
    /// The publish or its confirm failed on the channel or the connection: it may or may not
    /// be in a queue.
    Failed,
    /// The message breaks the consumer's gate (id, type, headers, body size) and was not
    /// published. The reason never quotes the body.
    Refused(Reason),
}

impl Published {
    /// Whether the broker confirmed the message into a queue.
    pub fn is_confirmed(&self) -> bool {
        *self == Self::Confirmed
    }

    /// Whether the message is certainly in no queue, so publishing it again cannot make a
    /// duplicate.
    pub fn is_absent(&self) -> bool {
        matches!(
            self,
            Self::Returned | Self::Nacked | Self::NoExchange | Self::Blocked | Self::Refused(_)
        )
    }
}

impl From<HandoffResult> for Published {
    fn from(result: HandoffResult) -> Self {
        match result {
            HandoffResult::Confirmed => Self::Confirmed,
            HandoffResult::Returned => Self::Returned,
            HandoffResult::Nacked => Self::Nacked,
            HandoffResult::NoExchange => Self::NoExchange,
            HandoffResult::TimedOut => Self::TimedOut,
            HandoffResult::Blocked => Self::Blocked,
            // On a channel the broker closed for a refused permission, a publish written
            // before the refused one (to another exchange) may be in a queue.
            HandoffResult::Failed | HandoffResult::Refused => Self::Failed,
        }
    }
}

/// How a [`Publisher`] connects and how long it waits.
#[derive(Clone)]
pub struct PublisherConfig {
    name: String,
    tls_ca_pem: Option<String>,
    tls_client: Option<ClientCertificate>,
    addresses: Vec<String>,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    limits: Limits,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            name: "app".to_owned(),
            tls_ca_pem: None,
            tls_client: None,
            addresses: Vec::new(),
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            limits: Limits::default(),
        }
    }
}

impl PublisherConfig {
    /// The name in the connection's name `lily:<name>:publisher` and in the
    /// `lily_publisher_blocked{queue=<name>}` gauge (`app` unless set).
    #[must_use]
    pub fn name(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// PEM certificates to trust for `amqps://` besides the system roots.
    #[must_use]
    pub fn tls_ca_pem(mut self, pem: String) -> Self {
        self.tls_ca_pem = Some(pem);
        self
    }

    /// Presents `certificate` to the broker on `amqps://` connections (mutual TLS).
    #[must_use]
    pub fn tls_client_cert(mut self, certificate: ClientCertificate) -> Self {
        self.tls_client = Some(certificate);
        self
    }

    /// Further nodes (`host` or `host:port`) to try when the URL's own does not answer.
    #[must_use]
    pub fn addresses(mut self, addresses: Vec<String>) -> Self {
        self.addresses = addresses;
        self
    }

    /// How long one publish may wait for its confirm, from the call (10 s unless set).
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long one node may take to connect (5 s unless set).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The gate limits of the consumers that read what this publisher sends
    /// ([`Limits::default`] unless set): a message that breaks them is refused unpublished.
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherConfig")
            .field("name", &self.name)
            .field("tls_ca_pem", &self.tls_ca_pem.is_some())
            .field("tls_client", &self.tls_client)
            .field("addresses", &self.addresses)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

/// Publishes messages a Lily consumer takes, each persistent and mandatory with a publisher
/// confirm, and returns the evidence of each: [`Published`]. It never logs bodies.
///
/// Calls may run concurrently (the publisher is `Sync`; share it in an `Arc`): concurrent
/// publishes are pipelined on four confirm channels, so many small publishes in flight share
/// the broker's confirms. The connection is opened again when it is lost.
///
/// A publish to an exchange that does not exist makes the broker close its channel: the
/// messages published to that exchange end [`Published::NoExchange`], and every other message
/// in flight on the channel still without evidence ends [`Published::Failed`] (maybe
/// published), other callers' included. Publish to exchanges your topology declares.
///
/// ```no_run
/// use lily_mq_rabbit::{Destination, Outgoing, Published, Publisher};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = Publisher::connect("amqp://127.0.0.1:5672/%2f").await?;
/// let orders = Destination::queue("orders");
/// let message = Outgoing::json("order.placed", "o-17", &serde_json::json!({"quantity": 2}))?;
/// match publisher.publish(&orders, message).await {
///     Published::Confirmed => {}
///     other if other.is_absent() => eprintln!("not published: {other:?}"),
///     other => eprintln!("unknown, publish again (the consumer deduplicates): {other:?}"),
/// }
/// publisher.close().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Publisher {
    confirms: Confirms,
    config: PublisherConfig,
}

impl Publisher {
    /// Connects to `url` with [`PublisherConfig::default`].
    ///
    /// # Errors
    /// See [`Publisher::connect_with`].
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::connect_with(url, PublisherConfig::default()).await
    }

    /// Connects to `url` (or one of the further addresses) with `config`.
    ///
    /// # Errors
    /// [`Error::Config`] when the URL or an address does not parse or a timeout is zero,
    /// [`Error::Refused`] when the broker refused the credentials or the virtual host,
    /// [`Error::Connect`] when no node answered.
    pub async fn connect_with(url: &str, config: PublisherConfig) -> Result<Self, Error> {
        let (publisher, endpoint) = Self::new(url, config)?;
        if let Err(source) = publisher.confirms.warm(&endpoint).await {
            return Err(Error::from_connect(
                source,
                &publisher.config.name,
                endpoint.display(),
            ));
        }
        Ok(publisher)
    }

    /// A publisher of `url` that connects on its first publish, for a consumer's outbox relay.
    pub(crate) fn unconnected(url: &str, config: PublisherConfig) -> Result<Self, Error> {
        let (publisher, endpoint) = Self::new(url, config)?;
        publisher.confirms.start(&endpoint);
        Ok(publisher)
    }

    fn new(url: &str, config: PublisherConfig) -> Result<(Self, Endpoint), Error> {
        let refuse = |field, problem: &'static str| {
            Error::Config(ConfigError {
                field,
                problem: problem.into(),
            })
        };
        if config.confirm_timeout.is_zero() {
            return Err(refuse("confirm_timeout", "must be positive"));
        }
        if config.connect_timeout.is_zero() {
            return Err(refuse("connect_timeout", "must be positive"));
        }
        if let Some(problem) = config
            .tls_client
            .as_ref()
            .and_then(ClientCertificate::problem)
        {
            return Err(refuse("tls_client", problem));
        }
        let endpoint = Endpoint::new(
            url,
            &config.addresses,
            crate::connect::Tls {
                ca_pem: config.tls_ca_pem.clone(),
                client: config.tls_client.clone(),
            },
            &config.name,
            config.connect_timeout,
        )
        .map_err(|e| match e {
            crate::connect::EndpointError::Url => {
                refuse("url", "does not parse as amqp:// or amqps://")
            }
            crate::connect::EndpointError::Address => {
                refuse("addresses", "an address is not host or host:port")
            }
        })?;
        let role = Role {
            name: "publisher",
            id_header: PUBLISH_ID,
            blocked_gauge: "lily_publisher_blocked",
            refused_gauge: "lily_publisher_refused",
            doing: "publish messages",
        };
        crate::logging::warn_if_bodies_logged();
        let confirms = Confirms::new(&config.name, role);
        Ok((Self { confirms, config }, endpoint))
    }

    /// Publishes `message` to `to` and waits for its evidence, at most the confirm timeout.
    ///
    /// # Cancel safety
    /// Dropping the future does not withdraw the message: it may still be published.
    pub async fn publish(&self, to: &Destination, message: Outgoing) -> Published {
        let Some(route) = Route::new(&to.exchange, &to.routing_key) else {
            return Published::Refused(Reason::new("exchange or routing key over 255 bytes"));
        };
        let id = self.confirms.next_id();
        let properties = match message.properties(id, &self.config.limits) {
            Ok(properties) => properties,
            Err(reason) => return Published::Refused(reason),
        };
        let deadline = self.config.confirm_timeout;
        self.confirms
            .publish(route, id, message.body, properties, deadline)
            .await
            .into()
    }

    /// Publishes every message to `to`, concurrently, and returns their evidence in order.
    pub async fn publish_all(
        &self,
        to: &Destination,
        messages: impl IntoIterator<Item = Outgoing>,
    ) -> Vec<Published> {
        let publishes: Vec<_> = messages
            .into_iter()
            .map(|message| Box::pin(self.publish(to, message)))
            .collect();
        join_all(publishes).await
    }

    /// The permission the broker refuses the publisher's publishes for (`ACCESS_REFUSED`), while
    /// it does: publishes end [`Published::Failed`] until one is confirmed again.
    pub fn refused(&self) -> Option<crate::MissingPermission> {
        self.confirms.refused()
    }

    /// Whether the broker blocks the publisher's connection (a resource alarm): publishes wait,
    /// and end [`Published::Blocked`] if it lasts their whole timeout.
    pub fn blocked(&self) -> bool {
        self.confirms.blocked()
    }

    /// Closes the connection, waiting at most the confirm timeout. Publishes still waiting end
    /// [`Published::Failed`].
    pub async fn close(self) {
        self.confirms.close(self.config.confirm_timeout).await;
    }
}

/// Awaits every future, polling all of them on each wake, and returns their outputs in order.
async fn join_all<F: Future + Unpin>(mut futures: Vec<F>) -> Vec<F::Output> {
    let mut done: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, slot) in futures.iter_mut().zip(done.iter_mut()) {
            if slot.is_none() {
                match std::pin::Pin::new(&mut *future).poll(cx) {
                    std::task::Poll::Ready(output) => *slot = Some(output),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    done.into_iter()
        .map(|slot| slot.expect("every future is ready"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_means_in_no_queue() {
        let absent = [
            Published::Returned,
            Published::Nacked,
            Published::NoExchange,
            Published::Blocked,
            Published::Refused(Reason::new("x")),
        ];
        assert!(absent.iter().all(Published::is_absent));
        let maybe = [Published::Confirmed, Published::TimedOut, Published::Failed];
        assert!(!maybe.iter().any(Published::is_absent));
    }
}
