//! What a command ends with: its output, its exit status, or the failure that stopped it.

/// Exit status when an input, the broker or a message cannot be read or written.
pub(crate) const EXIT_INPUT: u8 = 1;
/// Exit status for a usage error (clap's own).
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit status when some selected messages were left in their lane.
pub(crate) const EXIT_LEFT: u8 = 4;
/// Exit status when the lane is in use (a consumer, another lily command, or messages being
/// put back): nothing was done.
pub(crate) const EXIT_BUSY: u8 = 5;

/// What a command prints on stdout and the status it exits with.
pub(crate) struct Outcome {
    pub(crate) stdout: String,
    pub(crate) code: u8,
}

impl Outcome {
    /// Prints `stdout`, exits with `code`.
    pub(crate) fn text(stdout: String, code: u8) -> Self {
        Self { stdout, code }
    }

    /// Prints nothing (the problem went to stderr), exits with `code`.
    pub(crate) fn code(code: u8) -> Self {
        Self::text(String::new(), code)
    }
}

/// Why a lane command stopped: printed on stderr, with its exit status.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) message: String,
    pub(crate) code: u8,
}

impl Failure {
    /// The broker or an input failed.
    pub(crate) fn broker(message: String) -> Self {
        Self {
            message,
            code: EXIT_INPUT,
        }
    }

    /// The lane is in use: nothing was done.
    pub(crate) fn busy(message: String) -> Self {
        Self {
            message,
            code: EXIT_BUSY,
        }
    }

    /// The command line cannot work.
    pub(crate) fn usage(message: String) -> Self {
        Self {
            message,
            code: EXIT_USAGE,
        }
    }
}
