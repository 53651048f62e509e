//! What one delivery may do to settle itself.

use std::time::Duration;

use lapin::BasicProperties;
use lily_mq_core::machine::Action;
use lily_mq_core::transport::{self, Authority, HandoffId, HandoffResult, SettleResult};

use super::Session;
use crate::copy::handoff::HandoffPublisher;
use crate::service::Revoked;

/// The only way a delivery's executor reaches the broker: the core's settle action applied on
/// the session's consuming channel, and a copy published on the handoff connection. Nothing is
/// written once authority is revoked.
pub(crate) struct Settler<'a> {
    session: &'a Session,
    publisher: &'a HandoffPublisher,
    revoked: &'a Revoked,
    delivery_tag: u64,
}

impl<'a> Settler<'a> {
    /// The settle handle of `delivery_tag`, one of `session`'s deliveries.
    pub(crate) fn new(
        session: &'a Session,
        delivery_tag: u64,
        publisher: &'a HandoffPublisher,
        revoked: &'a Revoked,
    ) -> Self {
        Self {
            session,
            publisher,
            revoked,
            delivery_tag,
        }
    }

    /// Whether the delivery may still be settled: its channel is open and authority was not
    /// revoked.
    pub(crate) fn authority(&self) -> Authority {
        if self.session.consuming_open() && !self.revoked.is_revoked() {
            Authority::Held
        } else {
            Authority::Lost
        }
    }

    /// The session whose ledger evidence the ACK belongs to.
    pub(crate) fn session_id(&self) -> u64 {
        self.session.id
    }

    /// Applies the machine's settle `action`: an ACK through the session's ACK window (see
    /// [`Session::ack`]), a NACK with requeue, or a reject to the queue's dead-letter exchange
    /// (see [`Session::settle`]). Any other action writes nothing and is refused.
    pub(crate) async fn apply(&self, action: Action) -> SettleResult {
        if self.revoked.is_revoked() {
            return SettleResult::Refused;
        }
        let frame = match action {
            Action::Ack => return self.session.ack(self.delivery_tag, self.revoked).await,
            Action::Requeue { .. } => transport::Action::Requeue,
            Action::Reject => transport::Action::Reject,
            _ => return SettleResult::Refused,
        };
        self.session.settle(self.delivery_tag, frame)
    }

    /// A fresh id for the next copy to carry.
    pub(crate) fn next_handoff_id(&self) -> HandoffId {
        self.publisher.next_id()
    }

    /// Publishes a copy carrying `id` to `queue`; see [`HandoffPublisher::publish`].
    pub(crate) async fn publish(
        &self,
        queue: &str,
        id: HandoffId,
        body: &[u8],
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        self.publisher
            .publish(queue, id, body, properties, deadline)
            .await
    }
}
