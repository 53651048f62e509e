//! The `lily` command's rendering of lane messages, as a library for its fuzz target; the
//! command itself is the `lily` binary (`src/main.rs`).

pub mod message;
