//! The sans-IO core of Lily.
//!
//! Everything here takes inputs (time included) and returns decisions; nothing touches a socket,
//! a clock or a runtime. The transport crate drives it.
//!
//! What services use is at the root:
//!
//! - [`Handler`], [`FromDelivery`] and the extractors, [`Router`], [`Hook`]: the application side.
//! - [`QueueHandlerError`] and [`FailureKind`]: how a handler fails.
//! - [`Policy`], [`Limits`], [`ShutdownBudget`]: retries, bounds and the shutdown budget.
//! - [`TransactionalScope`]: a scope around each handler (the MongoDB scope implements it).
//! - [`ShutdownReport`], [`Totals`], [`Outcome`]: what happened.
//!
//! What a transport needs is in [`transport`] and [`machine`]:
//!
//! - [`transport::inspect`]: the gate, envelope validation and metadata bounds.
//! - [`transport::decide_at_gate`], [`transport::decide`] and [`transport::Settlement`]: the
//!   decision table of the design and the machine that carries a plan to its [`Outcome`].
//! - [`machine::Delivery`]: one delivery as a pure machine, from arrival to its outcome, with
//!   the [`machine::RequeueMemory`] it reads.
//! - [`transport::InFlight`]: which handoff each confirm and return on a confirm channel
//!   belongs to, with many in flight at once.
//! - [`transport::Ledger`]: evidence per delivery and totals.
//! - [`transport::AckWindow`]: which ready ACKs one `multiple` ACK may write together.
//! - [`transport::PhaseClock`]: the shutdown phases.

mod acks;
mod budget;
mod codec;
mod confirms;
mod decision;
mod envelope;
mod error;
mod extract;
mod handler;
mod handoff;
pub mod headers;
mod ledger;
pub mod machine;
mod message;
mod pace;
mod policy;
mod reason;
mod report;
mod resources;
mod router;
mod scope;
mod seal;
mod shutdown;
mod transaction;

pub use codec::{Codec, JsonCodec};
pub use decision::{Lane, Outcome, RequeueCause, Terminal, TransactionOutcome, Unresolved};
pub use envelope::Limits;
pub use error::{FailureKind, QueueHandlerError};
pub use extract::{
    Attempt, Cancellation, Context, FromDelivery, Headers, Json, Meta, Payload, RawDelivery, State,
    StateNeed,
};
pub use handler::{BoxFuture, Handler, HandlerResult};
pub use ledger::Totals;
pub use message::Incoming;
pub use policy::{Policy, PolicyError};
pub use reason::Reason;
pub use report::{
    EXIT_UNRESOLVED, Incidents, OutboxReport, SCHEMA, ShutdownReport, UnresolvedDelivery,
};
pub use resources::Resources;
pub use router::Router;
pub use scope::{CleanupError, DynHook, Hook};
pub use seal::HeaderKey;
pub use shutdown::{Phase, PhaseTiming, ShutdownBudget, Trigger};
pub use transaction::{Begin, Committed, OpenTransaction, OutboxRelay, TransactionalScope};

/// What a transport needs and an application does not: the gate, the decision table and the
/// settlement machine, handoff attribution, the evidence ledger, the ACK window and the
/// shutdown clock. The rabbit crate is built on it; services never need it.
pub mod transport {
    pub use crate::acks::AckWindow;
    pub use crate::budget::Budget;
    pub use crate::confirms::{InFlight, Retired, Seq};
    pub use crate::decision::{
        Action, Authority, Cause, CleanupResult, Handoff, HandoffResult, PipelineResult, Plan,
        SettleResult, Settlement, Situation, decide, decide_at_gate,
    };
    pub use crate::envelope::{Envelope, GateRejection, Known, PropertiesView, inspect, is_token};
    pub use crate::extract::DeliveryCancel;
    pub use crate::handler::BoxedHandler;
    pub use crate::handoff::{Confirm, HandoffId};
    pub use crate::headers::{as_text, as_u32};
    pub use crate::ledger::{EntryId, Evidence, Identity, Ledger, UnresolvedEntry};
    pub use crate::message::IncomingParts;
    pub use crate::pace::{ACK_HOLD, ACK_LINGER, AckPacer, BACKLOG_HOLD};
    pub use crate::report::TERMINATION_MESSAGE_MAX;
    pub use crate::shutdown::PhaseClock;
}
