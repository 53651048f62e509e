//! The hook called after a commit, before the delivery is settled.

use std::sync::Arc;

use lily_mq_core::Meta;

/// Called after a commit succeeded, before the original delivery is settled.
pub type CommitObserver = Arc<dyn Fn(&Meta) + Send + Sync>;
