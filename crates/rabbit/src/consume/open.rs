//! Opening a session: the consuming connection, the topology, the consuming channel with its
//! prefetch, the handoff connection, then `basic.consume`.

use std::time::Duration;

use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tracing::{debug, warn};

use super::SessionError;
use crate::channel::ready_count;
use crate::error::{BrokerError, Error, MissingPermission, Needs, missing_permission};
use crate::service::Shared;
use crate::topology::{Applied, QueueKind, TopologyError, TopologyMode};
use crate::wire::Rewrites;

/// How long the probe publish that checks the `write` permission at start may wait for its
/// confirm before the session goes on without it.
const WRITE_CHECK: Duration = Duration::from_secs(2);

/// Whether the broker's answer to the topology is final: access refused, a precondition failed
/// (a queue exists with other arguments), or in Verify mode something missing. Anything else
/// (the connection dropped in the middle of a declare, as a broker restart looks) is retried
/// with backoff like any lost connection.
fn definitive(err: &lapin::Error, mode: TopologyMode) -> bool {
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return false;
    };
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED) => {
            true
        }
        AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => mode == TopologyMode::Verify,
        _ => false,
    }
}

/// A connect error as the session loop sees it: definitive when the broker refused us.
fn connect_error(shared: &Shared, source: lapin::Error) -> SessionError {
    let node = shared.dialer.endpoint().display();
    match Error::from_connect(source, &shared.config.queue, node) {
        Error::Connect { source, .. } => SessionError::Connect(source.0),
        fatal => SessionError::Fatal(fatal),
    }
}

/// The session's end when the broker refused a permission: final.
fn lacking(missing: MissingPermission, source: lapin::Error) -> SessionError {
    SessionError::Fatal(Error::Permission {
        missing: Box::new(missing),
        source: BrokerError(source),
    })
}

/// `source` of a request that needs `needs`: final when the broker refused one of them, a
/// lost connection otherwise.
fn permission_error(
    source: lapin::Error,
    doing: impl FnOnce() -> String,
    needs: &[Needs<'_>],
) -> SessionError {
    match missing_permission(&source, doing, needs) {
        Some(missing) => lacking(missing, source),
        None => SessionError::Connect(source),
    }
}

/// A session's connection and consuming channel, from [`open`].
pub(super) struct Opened {
    pub(super) connection: Connection,
    pub(super) consuming: Channel,
    pub(super) rewrites: Rewrites,
    pub(super) consumer: lapin::Consumer,
    /// The messages the work queue held ready just after `basic.consume`; `None` when the
    /// broker did not say.
    pub(super) ready: Option<u32>,
}

/// Opens a session up to its consumer: the connection, the topology and the consuming channel
/// with its prefetch, the handoff publisher's connection, then `basic.consume`.
///
/// The handoff connection is readied while the consuming connection declares the topology:
/// neither waits for the other, which takes about a third off the start (a connection and a
/// confirmed probe, 5–13 ms on loopback). Their errors come in the order the steps have:
/// the consuming connection's and the topology's first, at once, and the handoff
/// connection's only once the topology is in place. Nothing is consumed before both are
/// ready.
pub(super) async fn open(shared: &Shared) -> Result<Opened, SessionError> {
    let (connection, consuming, rewrites) =
        first_then(declare(shared), ready_handoffs(shared)).await?;
    // Sent together: the passive declare that measures the backlog goes out behind
    // `basic.consume` without waiting for its reply.
    let consume = consuming.basic_consume(
        shared.queue.as_ref().into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    );
    let (consumer, ready) = tokio::join!(consume, ready_count(&consuming, &shared.queue));
    let consumer = consumer.map_err(|source| {
        let needs = [Needs::queue(&shared.queue, "read")];
        let doing = || format!("consume from queue '{}'", shared.queue);
        permission_error(source, doing, &needs)
    })?;
    Ok(Opened {
        connection,
        consuming,
        rewrites,
        consumer,
        ready: ready.ok(),
    })
}

/// Connects the consuming connection, declares the topology and readies the consuming
/// channel with its prefetch.
///
/// In [`TopologyMode::Declare`] the consuming channel carries the declarations, without
/// their replies (see [`crate::topology::Topology::declare_unanswered`]), and its
/// `basic.qos` proves them. Only when that fails are they declared again, one reply each, on
/// a channel of their own, to find the refusal and the permission it needs. Verification
/// always goes that way.
async fn declare(shared: &Shared) -> Result<(Connection, Channel, Rewrites), SessionError> {
    // Only quorum queues' arguments depend on the broker's version.
    let (connection, version, rewrites) = shared
        .dialer
        .connect_consuming(shared.config.queue_kind == QueueKind::Quorum)
        .await
        .map_err(|e| connect_error(shared, e))?;
    let topology = shared.topology.clone().broker(version);
    let prefetch = |channel: Channel| async move {
        channel
            .basic_qos(shared.config.prefetch, BasicQosOptions::default())
            .await
            .map(|()| channel)
    };
    if shared.config.topology == TopologyMode::Declare {
        let channel = connection
            .create_channel()
            .await
            .map_err(SessionError::Connect)?;
        if topology.declare_unanswered(&channel).await.is_ok()
            && let Ok(consuming) = prefetch(channel).await
        {
            return Ok((connection, consuming, rewrites));
        }
    }
    let setup = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    let mut applied = topology.apply(&setup, shared.config.topology).await;
    if let Err(TopologyError { source, .. }) = &applied
        && topology.declares_unlimited()
        && refuses_delivery_limit(&source.0)
    {
        // Declared before the broker limited deliveries: declared again as they are.
        let setup = connection
            .create_channel()
            .await
            .map_err(SessionError::Connect)?;
        applied = shared.topology.apply(&setup, shared.config.topology).await;
        if applied.is_ok() {
            warn!(
                queue = %shared.queue,
                broker = %version.map(|v| v.to_string()).unwrap_or_default(),
                "the queues were declared without x-delivery-limit, before RabbitMQ 4.0: each has the broker's default delivery limit (20) unless a policy sets delivery-limit -1, and the DLQ and the parking lane drop a message read and given back that often; see the compatibility chapter"
            );
        }
    }
    let applied = applied.map_err(|TopologyError { missing, source }| match missing {
        Some(missing) => lacking(missing, source.0),
        None if definitive(&source.0, shared.config.topology) => {
            SessionError::Fatal(Error::Topology {
                queue: shared.config.queue.clone(),
                source,
            })
        }
        None => SessionError::Connect(source.0),
    })?;
    if let Applied::ExistenceOnly(missing) = applied {
        warn!(queue = %shared.queue, lacks = %missing, "topology verified by existence only: the queues' arguments (type, dead-lettering, TTLs) were not checked");
    }
    // Dropping the channel closes it without waiting for the broker's close-ok.
    drop(setup);
    let consuming = connection
        .create_channel()
        .await
        .map_err(SessionError::Connect)?;
    let consuming = prefetch(consuming).await.map_err(SessionError::Connect)?;
    Ok((connection, consuming, rewrites))
}

/// Whether the broker refused a declaration because an existing queue has another
/// `x-delivery-limit` (406 `inequivalent arg 'x-delivery-limit'`).
fn refuses_delivery_limit(err: &lapin::Error) -> bool {
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return false;
    };
    matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) && amqp
        .get_message()
        .to_string()
        .contains("'x-delivery-limit'")
}

/// Opens the handoff publisher's connection and checks that it may publish.
async fn ready_handoffs(shared: &Shared) -> Result<(), SessionError> {
    shared
        .publisher
        .warm(shared.dialer.endpoint())
        .await
        .map_err(|e| connect_error(shared, e))?;
    // Publishing a probe now, rather than the first handoff, finds a missing `write` at start.
    // A node in a resource alarm reads nothing more from a publishing connection, so the check
    // then waits no longer than WRITE_CHECK: handoffs wait for the alarm anyway, and the
    // deliveries that succeed must still be consumed and ACKed.
    match tokio::time::timeout(WRITE_CHECK, shared.publisher.check_write()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(source)) => {
            let needs = [Needs::exchange("", "write")];
            Err(permission_error(
                source,
                || "publish handoff copies".into(),
                &needs,
            ))
        }
        Err(_) => {
            debug!(queue = %shared.queue, "write permission not checked: the handoff connection does not answer (a resource alarm?)");
            Ok(())
        }
    }
}

/// Runs `first` and `second` together and returns `first`'s value once both succeeded.
/// `first`'s error ends it at once (`second` is dropped, as a `stop` during the start drops
/// both); `second`'s is returned only once `first` succeeded, so the error is the one the two
/// would have met one after the other.
async fn first_then<T, E>(
    first: impl Future<Output = Result<T, E>>,
    second: impl Future<Output = Result<(), E>>,
) -> Result<T, E> {
    let mut first = std::pin::pin!(first);
    let mut second = std::pin::pin!(second);
    let mut seconded = None;
    let value = loop {
        tokio::select! {
            value = &mut first => break value?,
            done = &mut second, if seconded.is_none() => seconded = Some(done),
        }
    };
    match seconded {
        Some(done) => done?,
        None => second.await?,
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Long enough for a future that is never woken to count as stuck.
    const STUCK: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn the_start_runs_the_topology_and_the_handoff_connection_together() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The first can finish only once the second ran: one after the other never ends.
        let first = async { rx.await.map_err(|_| "the second was dropped") };
        let second = async { tx.send(7).map_err(|_| "the first was dropped") };
        let started = tokio::time::timeout(STUCK, first_then(first, second)).await;
        assert_eq!(started, Ok(Ok(7)));
    }

    #[tokio::test]
    async fn an_error_of_the_topology_ends_the_start_at_once() {
        let first = async { Err::<(), _>("topology") };
        let second = std::future::pending::<Result<(), &str>>();
        let started = tokio::time::timeout(STUCK, first_then(first, second)).await;
        assert_eq!(started, Ok(Err("topology")));
    }

    #[tokio::test]
    async fn an_error_of_the_handoff_connection_waits_for_the_topology() {
        let later = |result: Result<(), &'static str>| async move {
            // The second has failed by the time the first ends.
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            result
        };
        let write = async { Err("write") };
        assert_eq!(
            first_then(later(Err("topology")), write).await,
            Err("topology")
        );
        let write = async { Err("write") };
        assert_eq!(first_then(later(Ok(())), write).await, Err("write"));
    }
}
