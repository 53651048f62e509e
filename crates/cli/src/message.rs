//! How `lily dlq list` and `lily dlq show` write what a lane message carries: header values,
//! times and ages. Every value comes from a stranger (a publisher, or a forger of Lily's
//! headers), so each is bounded, without control characters, and never fails to render: the
//! `lane` fuzz target feeds these functions arbitrary headers.

use lapin::types::AMQPValue;
use lily_mq_core::Reason;
use lily_mq_core::transport::as_text;

/// Text from a message, bounded and without control characters: it came from a stranger.
pub fn clean(text: &str) -> String {
    Reason::new(text.to_owned()).as_str().to_owned()
}

/// A header value as text, bounded; times also as RFC 3339, tables and arrays by their size.
pub fn value_text(key: &str, value: &AMQPValue) -> String {
    if let Some(text) = as_text(value) {
        return if text.is_empty() {
            "\"\"".into()
        } else {
            clean(text)
        };
    }
    match value {
        AMQPValue::LongLongInt(ms) if key.ends_with("-at") => time_text(*ms),
        AMQPValue::FieldTable(t) => format!("(table of {})", t.inner().len()),
        AMQPValue::FieldArray(a) => format!("(array of {})", a.as_slice().len()),
        AMQPValue::ByteArray(b) => format!("({} bytes)", b.as_slice().len()),
        AMQPValue::Boolean(b) => b.to_string(),
        other => match lily_mq_core::transport::as_u32(other) {
            Some(n) => n.to_string(),
            None => match other {
                AMQPValue::LongLongInt(n) => n.to_string(),
                _ => "(not shown)".into(),
            },
        },
    }
}

/// The last millisecond RFC 3339 can write: 9999-12-31T23:59:59.999Z.
pub const LAST_RFC3339_MS: i64 = 253_402_300_799_999;

/// Milliseconds since the Unix epoch, with the time they name when RFC 3339 can write it; a
/// time before 1970 or after 9999 is named as such, never formatted.
pub fn time_text(ms: i64) -> String {
    match ms {
        ..0 => format!("{ms} (before 1970: not a time Lily writes)"),
        0..=LAST_RFC3339_MS => {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.unsigned_abs());
            format!("{ms} ({})", humantime::format_rfc3339_millis(at))
        }
        _ => format!("{ms} (after the year 9999: not a time Lily writes)"),
    }
}

/// `3m`, `2h 5m`, `4d 1h`: how long ago `at` was.
pub fn age(now: i64, at: Option<i64>) -> String {
    let Some(at) = at else {
        return "-".into();
    };
    let seconds = now.saturating_sub(at).max(0) / 1000;
    let (d, h, m) = (seconds / 86_400, seconds / 3600 % 24, seconds / 60 % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{seconds}s"),
        (0, 0, m) => format!("{m}m"),
        (0, h, m) => format!("{h}h {m}m"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        let now = 1_000_000_000;
        assert_eq!(age(now, None), "-");
        assert_eq!(age(now, Some(now - 42_000)), "42s");
        assert_eq!(age(now, Some(now - 3 * 60_000)), "3m");
        assert_eq!(age(now, Some(now - 7_500_000)), "2h 5m");
        assert_eq!(age(now, Some(now - 90_000_000)), "1d 1h");
    }

    #[test]
    fn times_outside_what_rfc3339_writes_are_named_not_formatted() {
        assert_eq!(time_text(0), "0 (1970-01-01T00:00:00.000Z)");
        assert!(time_text(LAST_RFC3339_MS).contains("9999-12-31T23:59:59.999Z"));
        assert!(time_text(LAST_RFC3339_MS + 1).contains("after the year 9999"));
        assert!(time_text(i64::MAX).contains("after the year 9999"));
        assert!(time_text(-1).contains("before 1970"));
        assert!(time_text(i64::MIN).contains("before 1970"));
    }

    proptest::proptest! {
        /// Whatever a lane message's header holds, its text is bounded and nothing panics.
        #[test]
        fn any_header_value_renders_bounded(
            key in "x-lily-[a-z-]{0,12}(-at)?",
            n in proptest::prelude::any::<i64>(),
            u in proptest::prelude::any::<u32>(),
            text in "\\PC{0,600}",
        ) {
            for value in [
                AMQPValue::LongLongInt(n),
                AMQPValue::LongInt(n as i32),
                AMQPValue::LongUInt(u),
                AMQPValue::Timestamp(n.unsigned_abs()),
                AMQPValue::Double(n as f64),
                AMQPValue::LongString(text.as_bytes().to_vec().into()),
                AMQPValue::ShortString(text.chars().take(60).collect::<String>().into()),
                AMQPValue::LongString(vec![0xff, 0xfe, 0x00, b'a'].into()),
            ] {
                let rendered = value_text(&key, &value);
                proptest::prop_assert!(rendered.len() <= 600, "{}", rendered.len());
            }
            let _ = age(n, Some(n.wrapping_neg()));
            let _ = age(i64::MAX, Some(n));
        }
    }
}
