//! The sans-IO core of Lily.
//!
//! Everything here takes inputs (time included) and returns decisions; nothing touches a socket,
//! a clock or a runtime. The transport crate drives it.
//!
//! - [`inspect`]: the gate, envelope validation and metadata bounds.
//! - [`Handler`], [`FromDelivery`] and the extractors, [`Router`], [`Hook`]: the application side.
//! - [`decide_at_gate`], [`decide`] and [`Settlement`]: the decision table of the design and the
//!   machine that carries a plan to its [`Outcome`].
//! - [`machine::Delivery`]: one delivery as a pure machine, from arrival to its outcome, with
//!   the [`machine::RequeueMemory`] it reads.
//! - [`Budget`], [`Policy`]: deadlines and retry policy.
//! - [`attribute_batch`]: which handoff of a batch each confirm and return belongs to.
//! - [`Ledger`]: evidence per delivery and totals.
//! - [`AckWindow`]: which ready ACKs one `multiple` ACK may write together.
//! - [`PhaseClock`] and [`ShutdownReport`]: shutdown phases and the report.

mod acks;
mod budget;
mod codec;
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
mod policy;
mod reason;
mod report;
mod resources;
mod router;
mod scope;
mod shutdown;
mod transaction;

pub use acks::AckWindow;
pub use budget::Budget;
pub use codec::{Codec, JsonCodec};
pub use decision::{
    Action, Authority, Cause, CleanupResult, Handoff, HandoffResult, Lane, Outcome, PipelineResult,
    Plan, RequeueCause, SettleResult, Settlement, Situation, TransactionOutcome, Unresolved,
    decide, decide_at_gate,
};
pub use envelope::{Envelope, GateRejection, Limits, PropertiesView, as_u32, inspect, is_token};
pub use error::{FailureKind, QueueHandlerError};
pub use extract::{
    Attempt, Cancellation, Context, DeliveryCancel, FromDelivery, Headers, Json, Meta, Payload,
    RawDelivery,
};
pub use handler::{BoxFuture, BoxedHandler, Handler, HandlerResult};
pub use handoff::{BatchVerdict, Confirm, HandoffId, attribute_batch};
pub use ledger::{EntryId, Evidence, Identity, Ledger, Totals, UnresolvedEntry};
pub use message::{Incoming, IncomingParts};
pub use policy::{Policy, PolicyError};
pub use reason::Reason;
pub use report::{
    EXIT_UNRESOLVED, SCHEMA, ShutdownReport, TERMINATION_MESSAGE_MAX, UnresolvedDelivery,
};
pub use resources::Resources;
pub use router::Router;
pub use scope::{CleanupError, DynHook, Hook};
pub use shutdown::{Phase, PhaseClock, PhaseTiming, ShutdownBudget, Trigger};
pub use transaction::{Begin, Committed, OpenTransaction, TransactionalScope};
