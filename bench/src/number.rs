//! Numbers as the reports and the charts print them.

/// `12 345`: a rate rounded, thousands apart; `-` when not finite.
pub fn rate(value: f64) -> String {
    if !value.is_finite() {
        return "-".into();
    }
    group(&format!("{value:.0}"))
}

/// `12345.6` → `12 345.6`.
pub fn group(text: &str) -> String {
    let (sign, rest) = text.strip_prefix('-').map_or(("", text), |r| ("-", r));
    let (int, frac) = rest.split_once('.').unwrap_or((rest, ""));
    let mut out = String::from(sign);
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    if frac.is_empty() {
        out
    } else {
        format!("{out}.{frac}")
    }
}
