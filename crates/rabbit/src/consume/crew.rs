//! The crew: long-lived workers that run deliveries one at a time.
//!
//! The crew knows nothing of deliveries: a job is a future, which a worker polls to its end.
//!
//! A delivery the consume loop cannot finish itself (see [`crate::consume::inline`]) is handed to
//! an idle worker instead of being spawned as a task of its own, so it allocates no task. The crew
//! grows on demand up to its limit (the concurrency, at most the prefetch), which also bounds how
//! many handlers run at once: the consume loop runs a handler only while it holds a hired worker.
//! When the crew closes, idle workers end at once and busy ones after their delivery, so the task
//! tracker's `wait` means "every delivery finished".

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::task::TaskTracker;

use crate::sync::lock;

/// One unit of work: a delivery, polled to its end by a worker.
pub(crate) type Job = Pin<Box<dyn Future<Output = ()> + Send>>;

pub(crate) struct Crew {
    limit: usize,
    state: Mutex<State>,
    /// A worker went idle; the consume loop may be waiting for one.
    freed: Notify,
}

struct State {
    idle: Vec<Arc<Worker>>,
    started: usize,
    closed: bool,
}

/// One worker's mailbox: at most one job, handed over with a wake-up.
pub(crate) struct Worker {
    job: Mutex<Option<Job>>,
    wake: Notify,
}

impl Worker {
    /// Hands `job` to this worker, which [`Crew::hire`] returned.
    pub(crate) fn assign(&self, job: Job) {
        *lock(&self.job) = Some(job);
        self.wake.notify_one();
    }
}

impl Crew {
    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            state: Mutex::new(State {
                idle: Vec::new(),
                started: 0,
                closed: false,
            }),
            freed: Notify::new(),
        })
    }

    /// An idle worker, a new one while the crew is below its limit, or the next one to finish.
    /// `None` once the crew is closed. Cancel safe: a worker is taken only on completion.
    pub(crate) async fn hire(self: &Arc<Self>, tracker: &TaskTracker) -> Option<Arc<Worker>> {
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            // Registered before the check, so a worker freed in between is not missed.
            freed.as_mut().enable();
            {
                let mut state = lock(&self.state);
                if state.closed {
                    return None;
                }
                if let Some(worker) = state.idle.pop() {
                    return Some(worker);
                }
                if state.started < self.limit {
                    state.started += 1;
                    let worker = Arc::new(Worker {
                        job: Mutex::new(None),
                        wake: Notify::new(),
                    });
                    tracker.spawn(work(Arc::clone(self), Arc::clone(&worker)));
                    return Some(worker);
                }
            }
            freed.await;
        }
    }

    /// Gives back a hired worker that got no delivery.
    pub(crate) fn release(&self, worker: Arc<Worker>) {
        let mut state = lock(&self.state);
        if state.closed {
            worker.wake.notify_one();
            return;
        }
        state.idle.push(worker);
        drop(state);
        self.freed.notify_one();
    }

    /// No more deliveries: idle workers end now, busy ones after their delivery.
    pub(crate) fn close(&self) {
        let idle = {
            let mut state = lock(&self.state);
            state.closed = true;
            std::mem::take(&mut state.idle)
        };
        for worker in idle {
            worker.wake.notify_one();
        }
        self.freed.notify_waiters();
    }
}

/// A worker's life: wait for a job, run it, go idle; end when the crew closes.
async fn work(crew: Arc<Crew>, me: Arc<Worker>) {
    let _place = Place(&crew);
    loop {
        me.wake.notified().await;
        let Some(job) = lock(&me.job).take() else {
            // Woken without a job: the crew closed.
            return;
        };
        job.await;
        let mut state = lock(&crew.state);
        if state.closed {
            return;
        }
        state.idle.push(Arc::clone(&me));
        drop(state);
        crew.freed.notify_one();
    }
}

/// A worker's place in the crew, given back however the worker ends (a panic outside the
/// handler's guard included), so the crew can start another instead of shrinking for good.
struct Place<'a>(&'a Crew);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).started -= 1;
        self.0.freed.notify_one();
    }
}
