//! The per-delivery scope: hooks around the handler and cleanup that always runs.

use std::future::Future;

use crate::decision::PipelineResult;
use crate::error::QueueHandlerError;
use crate::extract::Meta;
use crate::handler::BoxFuture;
use crate::reason::Reason;

/// A cleanup step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scope cleanup failed: {0}")]
pub struct CleanupError(pub Reason);

/// Code that runs around every handler call, opened after dispatch.
///
/// `before_delivery` runs before the handler; an error skips the handler and fails the
/// delivery. `after_delivery` always runs once the handler is done, whatever happened: success,
/// failure, panic or timeout. If it fails, a success becomes a retryable failure (the decision
/// sees pipeline and cleanup results separately).
///
/// ```
/// use lily_mq_core::transport::PipelineResult;
/// use lily_mq_core::{CleanupError, Hook, Meta};
///
/// /// Logs how each delivery went, by id (never the body).
/// struct Audit;
///
/// impl Hook for Audit {
///     async fn after_delivery(&self, meta: &Meta, result: PipelineResult) -> Result<(), CleanupError> {
///         eprintln!("{} handled: {result:?}", meta.message_id());
///         Ok(())
///     }
/// }
/// ```
pub trait Hook: Send + Sync + 'static {
    /// Runs before the handler.
    fn before_delivery(
        &self,
        meta: &Meta,
    ) -> impl Future<Output = Result<(), QueueHandlerError>> + Send {
        let _ = meta;
        async { Ok(()) }
    }

    /// Runs after the handler, always.
    fn after_delivery(
        &self,
        meta: &Meta,
        result: PipelineResult,
    ) -> impl Future<Output = Result<(), CleanupError>> + Send {
        let _ = (meta, result);
        async { Ok(()) }
    }
}

/// A hook with its type erased.
pub trait DynHook: Send + Sync + 'static {
    /// See [`Hook::before_delivery`].
    fn before<'a>(&'a self, meta: &'a Meta) -> BoxFuture<'a, Result<(), QueueHandlerError>>;
    /// See [`Hook::after_delivery`].
    fn after<'a>(
        &'a self,
        meta: &'a Meta,
        result: PipelineResult,
    ) -> BoxFuture<'a, Result<(), CleanupError>>;
}

impl<H: Hook> DynHook for H {
    fn before<'a>(&'a self, meta: &'a Meta) -> BoxFuture<'a, Result<(), QueueHandlerError>> {
        Box::pin(self.before_delivery(meta))
    }

    fn after<'a>(
        &'a self,
        meta: &'a Meta,
        result: PipelineResult,
    ) -> BoxFuture<'a, Result<(), CleanupError>> {
        Box::pin(self.after_delivery(meta, result))
    }
}
