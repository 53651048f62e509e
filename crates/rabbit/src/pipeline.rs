//! The per-delivery pipeline: hooks, the handler under a timeout and panic guard, and cleanup
//! that always runs.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use lily_mq_core::{
    BoxedHandler, CleanupResult, Context, DynHook, Incoming, Meta, PipelineResult, Reason,
};
use tokio_util::sync::CancellationToken;

/// What the pipeline produced, with the reason of a failure.
#[derive(Debug)]
pub(crate) struct PipelineOutput {
    pub(crate) result: PipelineResult,
    pub(crate) cleanup: CleanupResult,
    pub(crate) reason: Option<Reason>,
}

/// Runs `before_delivery` hooks, the handler (bounded by `timeout`, panics caught), then every
/// `after_delivery` hook whatever happened.
pub(crate) async fn run(
    handler: &BoxedHandler,
    hooks: &[Arc<dyn DynHook>],
    incoming: &Arc<Incoming>,
    cancel: &CancellationToken,
    timeout: Duration,
) -> PipelineOutput {
    let meta = Meta::new(Arc::clone(incoming));
    let mut reason = None;
    let mut result = None;
    for hook in hooks {
        match CatchUnwind(hook.before(&meta)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                result = Some(failed(&err));
                reason = Some(err.reason().clone());
                break;
            }
            Err(_) => {
                result = Some(PipelineResult::Panicked);
                reason = Some(Reason::new("before_delivery hook panicked"));
                break;
            }
        }
    }
    let result = match result {
        Some(result) => result,
        None => {
            let cx = Context { incoming, cancel };
            let call = catch_unwind(AssertUnwindSafe(|| handler.call(cx)));
            match call {
                Err(_) => {
                    reason = Some(Reason::new("handler panicked while extracting arguments"));
                    PipelineResult::Panicked
                }
                Ok(future) => match tokio::time::timeout(timeout, CatchUnwind(future)).await {
                    Ok(Ok(Ok(()))) => PipelineResult::Succeeded,
                    Ok(Ok(Err(err))) => {
                        reason = Some(err.reason().clone());
                        failed(&err)
                    }
                    Ok(Err(_)) => {
                        reason = Some(Reason::new("handler panicked"));
                        PipelineResult::Panicked
                    }
                    Err(_) => {
                        cancel.cancel();
                        reason = Some(Reason::new("handler timed out"));
                        PipelineResult::TimedOut
                    }
                },
            }
        }
    };
    let mut cleanup = CleanupResult::Succeeded;
    for hook in hooks {
        let ok = matches!(CatchUnwind(hook.after(&meta, result)).await, Ok(Ok(())));
        if !ok {
            cleanup = CleanupResult::Failed;
            if result == PipelineResult::Succeeded {
                reason = Some(Reason::new("after_delivery cleanup failed"));
            }
        }
    }
    PipelineOutput {
        result,
        cleanup,
        reason,
    }
}

fn failed(err: &lily_mq_core::QueueHandlerError) -> PipelineResult {
    PipelineResult::Failed {
        kind: err.kind(),
        retry_after: err.retry_after(),
    }
}

/// Catches a panic while polling the inner future.
struct CatchUnwind<F>(F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
