//! The code samples of Lily's book. Each chapter of `docs/src` includes its samples from these
//! files (mdBook anchors, `// ANCHOR: name`), so every sample the book shows compiles with the
//! workspace, and the one that can run without a broker runs as a test.
//!
//! `src/bin/handler.rs` is also the README's handler: `tests/readme.rs` checks that the two are
//! the same text. Samples never log or print a message body or a credential.

pub mod cluster;
pub mod extractors;
pub mod mongo;
pub mod outbox;
pub mod publishing;
pub mod security;
pub mod shutdown;
pub mod testing;
pub mod tracing_setup;
