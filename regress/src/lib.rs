//! The CPU regression gate's parts: a scripted AMQP peer that serves a fixed backlog the same
//! way on every run, and the two consumers it measures. The gate itself is the `lily-regress`
//! binary.

pub mod consume;
pub mod peer;
