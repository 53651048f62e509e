//! The shutdown handle: graceful and forced triggers from signals or the embedding application.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use lily_mq_core::{ShutdownBudget, Trigger};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::sync::lock;

/// Starts and forces a consumer's shutdown. Clone it freely.
///
/// The first trigger starts a graceful shutdown (draining, then cooperating, bounded by the
/// [`ShutdownBudget`]); a second trigger, [`force`](Self::force) or the budget's deadline
/// forces it (authority revoked, tasks aborted).
#[derive(Clone, Debug)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    budget: ShutdownBudget,
    graceful: CancellationToken,
    force: CancellationToken,
    /// The first trigger, whether it forced, and when it came: the budget runs from there.
    trigger: Mutex<Option<(Trigger, bool, Instant)>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new(ShutdownBudget::default())
    }
}

impl Shutdown {
    /// A handle with the given budget.
    pub fn new(budget: ShutdownBudget) -> Self {
        Self {
            inner: Arc::new(Inner {
                budget,
                graceful: CancellationToken::new(),
                force: CancellationToken::new(),
                trigger: Mutex::new(None),
            }),
        }
    }

    /// Starts a graceful shutdown; a second call forces it.
    pub fn trigger(&self, trigger: Trigger) {
        let mut slot = lock(&self.inner.trigger);
        if self.inner.graceful.is_cancelled() {
            drop(slot);
            self.force(trigger);
            return;
        }
        *slot = Some((trigger, false, Instant::now()));
        self.inner.graceful.cancel();
    }

    /// Forces the shutdown now: authority is revoked and in-flight tasks are aborted.
    pub fn force(&self, trigger: Trigger) {
        let mut slot = lock(&self.inner.trigger);
        if slot.is_none() {
            *slot = Some((trigger, true, Instant::now()));
        }
        self.inner.graceful.cancel();
        self.inner.force.cancel();
    }

    /// Starts a graceful shutdown on the first SIGTERM or SIGINT and forces it on the second.
    ///
    /// # Errors
    /// The signal handlers could not be installed.
    #[cfg(unix)]
    pub fn listen_for_signals(&self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let handle = self.clone();
        Ok(tokio::spawn(async move {
            loop {
                let trigger = tokio::select! {
                    Some(()) = term.recv() => Trigger::Sigterm,
                    Some(()) = int.recv() => Trigger::Sigint,
                    else => return,
                };
                let forced = handle.inner.graceful.is_cancelled();
                info!(?trigger, forced, "shutdown signal");
                handle.trigger(trigger);
                if forced {
                    return;
                }
            }
        }))
    }

    /// The budget.
    pub fn budget(&self) -> ShutdownBudget {
        self.inner.budget
    }

    /// Fires on the first trigger.
    pub fn graceful_token(&self) -> &CancellationToken {
        &self.inner.graceful
    }

    /// Fires when the shutdown is forced.
    pub fn force_token(&self) -> &CancellationToken {
        &self.inner.force
    }

    /// The first trigger, and whether it forced.
    pub fn first_trigger(&self) -> Option<(Trigger, bool)> {
        lock(&self.inner.trigger).map(|(trigger, forced, _)| (trigger, forced))
    }

    /// When the first trigger came.
    pub(crate) fn triggered_at(&self) -> Option<Instant> {
        lock(&self.inner.trigger).map(|(_, _, at)| at)
    }
}
