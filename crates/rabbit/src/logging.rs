//! Logging set up the way Lily's examples do it, with no message body in any line.
//!
//! lapin logs every message the broker returns (a mandatory publish that no queue took) at WARN,
//! under the target `lapin::returned_messages`, with its body and headers. [`init`] and
//! [`filter`] always add [`NO_BODY_LOGS`](crate::NO_BODY_LOGS), whatever `RUST_LOG` says. A
//! [`Consumer`](crate::Consumer) or [`Publisher`](crate::Publisher) started under a subscriber
//! that would let those lines through says so once, at WARN.

#[cfg(feature = "logging")]
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "logging")]
use tracing_subscriber::EnvFilter;

/// The target lapin logs returned messages under, bodies included.
const RETURNS_TARGET: &str = "lapin::returned_messages";

/// `RUST_LOG` when it is set and parses, `default` otherwise, and always
/// [`NO_BODY_LOGS`](crate::NO_BODY_LOGS): for an application that builds its own subscriber.
///
/// # Panics
/// Never: `NO_BODY_LOGS` is a valid directive.
#[cfg(feature = "logging")]
#[must_use]
pub fn filter(default: &str) -> EnvFilter {
    EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(default))
        .add_directive(crate::NO_BODY_LOGS.parse().expect("a valid directive"))
}

/// Installs the global subscriber: lines on stderr (coloured when it is a terminal), filtered
/// by [`filter`]`(default)`, so `RUST_LOG` overrides `default` but never lets a returned
/// message's body through. Does nothing when a global subscriber is already installed.
///
/// ```no_run
/// lily_mq_rabbit::logging::init("warn,lily_mq_rabbit=info");
/// ```
#[cfg(feature = "logging")]
pub fn init(default: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter(default))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Whether the current subscriber would record lapin's log of a returned message (its body).
pub(crate) fn returned_bodies_logged() -> bool {
    tracing::enabled!(target: RETURNS_TARGET, tracing::Level::WARN)
}

/// Says once per process, at WARN, that the current subscriber would log returned messages'
/// bodies, and how to stop it.
pub(crate) fn warn_if_bodies_logged() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if returned_bodies_logged() && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "this log would show the body of every message the broker returns (lapin logs each at WARN under target {RETURNS_TARGET}): add NO_BODY_LOGS (lily::logging::NO_BODY_LOGS) to the filter, or set up logging with lily::logging::init"
        );
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::EnvFilter;

    use super::returned_bodies_logged;

    fn with_filter(filter: EnvFilter) -> bool {
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(subscriber, returned_bodies_logged)
    }

    #[test]
    fn a_filter_without_the_directive_is_caught_and_one_with_it_is_not() {
        assert!(with_filter(EnvFilter::new("warn")));
        assert!(with_filter(EnvFilter::new("info,lily_mq_rabbit=debug")));
        assert!(!with_filter(
            EnvFilter::new("warn").add_directive(crate::NO_BODY_LOGS.parse().unwrap())
        ));
        assert!(!with_filter(EnvFilter::new("error")));
        assert!(!with_filter(EnvFilter::new("trace,lapin=off")));
        // A `RUST_LOG` that names the target gives way to the directive.
        assert!(!with_filter(
            EnvFilter::new("lapin::returned_messages=warn")
                .add_directive(crate::NO_BODY_LOGS.parse().unwrap())
        ));
        // What `init` installs, whatever `RUST_LOG` asks for.
        #[cfg(feature = "logging")]
        assert!(!with_filter(super::filter("trace")));
    }
}
