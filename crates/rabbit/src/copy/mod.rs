//! Copies of a delivery: the handoff copies the consumer publishes to its retry buckets, DLQ and
//! parking lane ([`handoff`]), and the replay of what a lane holds back to its work queue
//! ([`replay`]).

pub(crate) mod handoff;
pub mod replay;
