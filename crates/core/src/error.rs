//! The error a handler returns.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::reason::Reason;

/// How a failure should be treated by settlement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// Trying again later may succeed: the message goes to a retry bucket while attempts remain.
    Retryable,
    /// Trying again cannot succeed: the message goes to the dead-letter queue.
    Permanent,
    /// The effect may have happened and cannot be looked up: the message is parked, never
    /// replayed automatically.
    Indeterminate,
}

impl FailureKind {
    /// The name used in headers, logs and reports.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Retryable => "retryable",
            Self::Permanent => "permanent",
            Self::Indeterminate => "indeterminate",
        }
    }

    /// Reads a name written by [`FailureKind::as_str`].
    pub fn parse(text: &str) -> Option<Self> {
        [Self::Retryable, Self::Permanent, Self::Indeterminate]
            .into_iter()
            .find(|k| k.as_str() == text)
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error a queue handler returns: a [`FailureKind`], a bounded [`Reason`], an optional
/// source error and an optional hint for how long to wait before retrying.
///
/// ```
/// use lily_mq_core::QueueHandlerError;
/// use std::time::Duration;
///
/// let err = QueueHandlerError::retryable("inventory service busy")
///     .with_retry_after(Duration::from_secs(30));
/// assert_eq!(err.to_string(), "retryable failure: inventory service busy");
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{kind} failure: {reason}")]
pub struct QueueHandlerError {
    kind: FailureKind,
    transient: bool,
    reason: Reason,
    retry_after: Option<Duration>,
    #[source]
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl QueueHandlerError {
    /// A failure of the given kind.
    pub fn new(kind: FailureKind, reason: impl Into<Reason>) -> Self {
        Self {
            kind,
            transient: false,
            reason: reason.into(),
            retry_after: None,
            source: None,
        }
    }

    /// A failure that may succeed when tried again.
    pub fn retryable(reason: impl Into<Reason>) -> Self {
        Self::new(FailureKind::Retryable, reason)
    }

    /// A failure that cannot succeed when tried again.
    pub fn permanent(reason: impl Into<Reason>) -> Self {
        Self::new(FailureKind::Permanent, reason)
    }

    /// A transient transaction error (a write conflict, an election, a transient network error
    /// inside the transaction): the scope's whole transaction runs again in-process, with
    /// backoff, within the settlement budget, and it never uses an application attempt; still
    /// transient at the budget, the delivery is deferred. Without a transactional scope it is a
    /// retryable failure.
    pub fn transient(reason: impl Into<Reason>) -> Self {
        Self {
            transient: true,
            ..Self::new(FailureKind::Retryable, reason)
        }
    }

    /// A failure whose effect may have happened and cannot be checked.
    pub fn indeterminate(reason: impl Into<Reason>) -> Self {
        Self::new(FailureKind::Indeterminate, reason)
    }

    /// Attaches the error that caused this failure.
    #[must_use]
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Asks for at least this delay before the next attempt. Lily picks the shortest retry
    /// bucket that is at least this long (or the longest bucket).
    #[must_use]
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// How settlement treats this failure.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// Whether this is a transient transaction error; see [`QueueHandlerError::transient`].
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    /// The bounded, sanitized reason.
    pub fn reason(&self) -> &Reason {
        &self.reason
    }

    /// The requested minimum delay before a retry, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_does_not_repeat_the_source() {
        let io = std::io::Error::other("socket reset");
        let err = QueueHandlerError::retryable("call failed").with_source(io);
        assert_eq!(err.to_string(), "retryable failure: call failed");
        assert_eq!(
            err.source().map(ToString::to_string).as_deref(),
            Some("socket reset")
        );
    }
}
