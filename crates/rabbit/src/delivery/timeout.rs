//! A handler's time limit.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::coop;

/// `tokio::time::timeout`, but the timer is armed only once `future` is pending: most handlers
/// finish on their first poll, and a timer costs a clock read and a wheel entry. Each poll
/// polls `future` once, so a handler that yields gives the thread up.
pub(crate) fn within<F: Future + Unpin>(limit: Duration, future: F) -> Within<F> {
    Within {
        future,
        limit,
        timer: None,
    }
}

/// The future of [`within`].
pub(crate) struct Within<F> {
    future: F,
    limit: Duration,
    /// Boxed: only slow futures arm it, and an inline timer would grow every delivery's future.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// [`within`]'s limit passed before its future finished.
#[derive(Debug)]
pub(crate) struct Elapsed;

impl<F: Future + Unpin> Future for Within<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let had_budget = coop::has_budget_remaining();
        if let Poll::Ready(output) = Pin::new(&mut this.future).poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let limit = this.limit;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        // A timer polled without budget left never fires: a handler that spends the task's
        // whole budget on every poll would never time out. As `tokio::time::timeout` does, the
        // timer is then polled outside the budget.
        let elapsed = if had_budget && !coop::has_budget_remaining() {
            std::pin::pin!(coop::unconstrained(timer.as_mut())).poll(cx)
        } else {
            timer.as_mut().poll(cx)
        };
        elapsed.map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_future_that_yields_gives_the_thread_up() {
        let yielding = Box::pin(tokio::task::yield_now());
        let mut within = std::pin::pin!(within(Duration::from_secs(5), yielding));
        // Polled once, not again at once behind the timer it armed.
        assert!(crate::channel::first_poll(within.as_mut()).is_pending());
        assert!(matches!(within.await, Ok(())));
    }

    #[tokio::test]
    async fn a_future_past_its_limit_has_elapsed() {
        let stuck = std::future::pending::<()>();
        let limit = Duration::from_millis(20);
        assert!(matches!(within(limit, stuck).await, Err(Elapsed)));
    }

    /// Spends the task's whole budget on every poll and never finishes, as a handler draining
    /// a channel that is never empty does.
    fn greedy() -> impl Future<Output = ()> + Unpin {
        std::future::poll_fn(|cx| {
            while std::pin::pin!(coop::consume_budget()).poll(cx).is_ready() {}
            cx.waker().wake_by_ref();
            Poll::Pending
        })
    }

    #[tokio::test]
    async fn a_future_that_spends_the_whole_budget_still_times_out() {
        let limit = Duration::from_millis(20);
        let outcome = tokio::time::timeout(Duration::from_secs(5), within(limit, greedy())).await;
        assert!(matches!(outcome, Ok(Err(Elapsed))), "the limit never fired");
    }
}
