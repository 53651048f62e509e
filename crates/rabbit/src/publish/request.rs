//! What a pool is for, and one publish handed to it.

use lapin::BasicProperties;
use lapin::types::ShortString;
use lily_mq_core::transport::{HandoffId, HandoffResult};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// What a pool is for: how its connection is named, the header its publishes carry their id
/// in, and the gauge that says the broker blocks it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Role {
    /// The connection's role, in its name `lily:<label>:<role>`.
    pub(crate) name: &'static str,
    /// The header each publish carries its [`HandoffId`] in, to attribute returns.
    pub(crate) id_header: &'static str,
    /// The gauge set to 1 while the broker blocks the connection, labelled `queue=<label>`.
    pub(crate) blocked_gauge: &'static str,
    /// The gauge set to 1 while the broker refuses the pool's publishes (a permission),
    /// labelled `queue=<label>`.
    pub(crate) refused_gauge: &'static str,
    /// What the publishes are for, in the text naming a refused permission: `publish handoff
    /// copies`.
    pub(crate) doing: &'static str,
}

/// Where one publish goes: an exchange (`""` is the default one) and a routing key.
pub(crate) struct Route {
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
}

impl Route {
    /// The route, or `None` when a name is over 255 bytes.
    pub(crate) fn new(exchange: &str, routing_key: &str) -> Option<Self> {
        Some(Self {
            exchange: ShortString::try_new(exchange).ok()?,
            routing_key: ShortString::try_new(routing_key).ok()?,
        })
    }
}

/// One message to publish.
pub(super) struct Copy {
    pub(super) route: Route,
    pub(super) id: HandoffId,
    pub(super) body: Vec<u8>,
    pub(super) properties: BasicProperties,
    pub(super) until: Instant,
}

/// A message, and where its result goes.
pub(super) struct Request {
    pub(super) copy: Copy,
    pub(super) reply: oneshot::Sender<HandoffResult>,
}
