//! End-to-end tests live beside this crate.
