//! Parsers of the benchmarks' command-line values.

use lily::prelude::QueueKind;

/// A count above zero; `_` separators allowed.
pub fn count(text: &str) -> Result<u64, String> {
    match text.replace('_', "").parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("not a count above zero: {text}")),
    }
}

/// A positive, finite number; `_` separators allowed.
pub fn positive(text: &str) -> Result<f64, String> {
    match text.replace('_', "").parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("not a positive number: {text}")),
    }
}

/// `classic` or `quorum`.
pub fn queue_kind(text: &str) -> Result<QueueKind, String> {
    match text {
        "classic" => Ok(QueueKind::Classic),
        "quorum" => Ok(QueueKind::Quorum),
        other => Err(format!("unknown queue type {other}")),
    }
}

/// A `usize` above zero; `_` separators allowed.
pub fn nonzero(text: &str) -> Result<usize, String> {
    match text.replace('_', "").parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("not a count above zero: {text}")),
    }
}
