//! The per-delivery pipeline: hooks, the handler under a timeout and panic guard, and cleanup
//! that always runs.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use lily_mq_core::transport::{BoxedHandler, CleanupResult, DeliveryCancel, PipelineResult};
use lily_mq_core::{Context, DynHook, Incoming, Meta, Reason, Resources};

use super::timeout::within;

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
    cancel: &DeliveryCancel<'_>,
    resources: &Resources,
    state: &Resources,
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
            let cx = Context {
                incoming,
                cancel,
                resources,
                state,
            };
            let call = catch_unwind(AssertUnwindSafe(|| handler.call(cx)));
            match call {
                Err(_) => {
                    reason = Some(Reason::new("handler panicked while extracting arguments"));
                    PipelineResult::Panicked
                }
                Ok(future) => match within(timeout, CatchUnwind(future)).await {
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
    if err.is_transient() {
        return PipelineResult::Transient;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use tokio_util::sync::CancellationToken;

    use lapin::BasicProperties;
    use lily_mq_core::transport::IncomingParts;
    use lily_mq_core::{CleanupError, FailureKind, Hook, QueueHandlerError, Router};

    /// Records every hook call; fails cleanup when asked.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<String>>,
        fail_before: bool,
        fail_cleanup: bool,
    }

    /// The hook registered on the pipeline, sharing the recorder with the test.
    struct Probe(Arc<Recorder>);

    impl Hook for Probe {
        async fn before_delivery(&self, _meta: &Meta) -> Result<(), QueueHandlerError> {
            self.0.calls.lock().unwrap().push("before".into());
            if self.0.fail_before {
                return Err(QueueHandlerError::retryable("no database connection"));
            }
            Ok(())
        }

        async fn after_delivery(
            &self,
            _meta: &Meta,
            result: PipelineResult,
        ) -> Result<(), CleanupError> {
            self.0
                .calls
                .lock()
                .unwrap()
                .push(format!("after {result:?}"));
            if self.0.fail_cleanup {
                return Err(CleanupError(Reason::new("flush failed")));
            }
            Ok(())
        }
    }

    fn incoming() -> Arc<Incoming> {
        Arc::new(Incoming::from_parts(IncomingParts {
            body: b"{}".to_vec(),
            properties: BasicProperties::default(),
            exchange: "".into(),
            routing_key: "q".into(),
            queue: "q".into(),
            delivery_tag: 1,
            redelivered: false,
            attempt: 1,
            schema_version: 1,
        }))
    }

    async fn run_with<H, Args>(handler: H, recorder: &Arc<Recorder>) -> PipelineOutput
    where
        H: lily_mq_core::Handler<Args>,
        Args: 'static,
    {
        let router = Router::new().route("t", handler);
        let handler = router.dispatch("t", 1, None).unwrap().clone();
        let hooks: Vec<Arc<dyn DynHook>> = vec![Arc::new(Probe(Arc::clone(recorder)))];
        run(
            &handler,
            &hooks,
            &incoming(),
            &DeliveryCancel::new(&CancellationToken::new()),
            &Resources::new(),
            router.state(),
            Duration::from_millis(100),
        )
        .await
    }

    fn calls(recorder: &Recorder) -> Vec<String> {
        recorder.calls.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn cleanup_runs_after_success() {
        let rec = Arc::new(Recorder::default());
        let out = run_with(|| async { Ok(()) }, &rec).await;
        assert_eq!(out.result, PipelineResult::Succeeded);
        assert_eq!(out.cleanup, CleanupResult::Succeeded);
        assert_eq!(calls(&rec), ["before", "after Succeeded"]);
    }

    #[tokio::test]
    async fn cleanup_runs_after_failure_with_its_reason_kept() {
        let rec = Arc::new(Recorder::default());
        let out = run_with(
            || async { Err(QueueHandlerError::permanent("bad sku")) },
            &rec,
        )
        .await;
        assert_eq!(
            out.result,
            PipelineResult::Failed {
                kind: FailureKind::Permanent,
                retry_after: None
            }
        );
        assert_eq!(out.reason.unwrap().as_str(), "bad sku");
        assert_eq!(calls(&rec).len(), 2);
    }

    #[tokio::test]
    async fn cleanup_runs_after_panic_and_the_panic_is_contained() {
        let rec = Arc::new(Recorder::default());
        let out = run_with(|| async { panic!("handler bug") }, &rec).await;
        assert_eq!(out.result, PipelineResult::Panicked);
        assert_eq!(calls(&rec), ["before", "after Panicked"]);
    }

    #[tokio::test]
    async fn cleanup_runs_after_timeout_and_the_token_fires() {
        let rec = Arc::new(Recorder::default());
        let router = Router::new().route(
            "t",
            |lily_mq_core::Cancellation(token): lily_mq_core::Cancellation| async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                drop(token);
                Ok(())
            },
        );
        let handler = router.dispatch("t", 1, None).unwrap().clone();
        let hooks: Vec<Arc<dyn DynHook>> = vec![Arc::new(Probe(Arc::clone(&rec)))];
        let parent = CancellationToken::new();
        let cancel = DeliveryCancel::new(&parent);
        let out = run(
            &handler,
            &hooks,
            &incoming(),
            &cancel,
            &Resources::new(),
            router.state(),
            Duration::from_millis(50),
        )
        .await;
        assert_eq!(out.result, PipelineResult::TimedOut);
        assert!(cancel.is_cancelled());
        assert_eq!(calls(&rec), ["before", "after TimedOut"]);
    }

    #[tokio::test]
    async fn failing_cleanup_is_reported_separately_from_a_successful_handler() {
        let rec = Arc::new(Recorder {
            fail_cleanup: true,
            ..Recorder::default()
        });
        let out = run_with(|| async { Ok(()) }, &rec).await;
        assert_eq!(out.result, PipelineResult::Succeeded);
        assert_eq!(out.cleanup, CleanupResult::Failed);
        assert_eq!(
            out.reason.unwrap().as_str(),
            "after_delivery cleanup failed"
        );
    }

    #[tokio::test]
    async fn failing_before_hook_skips_the_handler_but_cleanup_still_runs() {
        let rec = Arc::new(Recorder {
            fail_before: true,
            ..Recorder::default()
        });
        let ran = Arc::new(Mutex::new(false));
        let flag = Arc::clone(&ran);
        let out = run_with(
            move || {
                let flag = Arc::clone(&flag);
                async move {
                    *flag.lock().unwrap() = true;
                    Ok(())
                }
            },
            &rec,
        )
        .await;
        assert!(!*ran.lock().unwrap(), "handler skipped");
        assert_eq!(
            out.result,
            PipelineResult::Failed {
                kind: FailureKind::Retryable,
                retry_after: None
            }
        );
        assert_eq!(calls(&rec).len(), 2);
    }
}
