//! The charts the programs draw (`target/bench/<program>.svg`): panels of grouped bars
//! (`throughput`, `latency`, `mongo`) or of lines over time (`storm`), stacked in one SVG.
// Positions are computed from counts of panels, groups and series, far below f64's 2^53.
#![allow(clippy::cast_precision_loss)]

use std::fmt::Write as _;

const WIDTH: f64 = 960.0;
const LEFT: f64 = 80.0;
const PLOT_W: f64 = WIDTH - LEFT - 30.0;
const PLOT_H: f64 = 220.0;
/// A panel: its title and legend, the plot, the group labels below it.
const PANEL_H: f64 = PLOT_H + 90.0;
const COLORS: [&str; 6] = [
    "#4d4d4d", "#2ca02c", "#c2185b", "#8c8c8c", "#1f77b4", "#ff7f0e",
];

/// A chart being drawn, panel after panel.
pub struct Chart {
    body: String,
    top: f64,
}

/// The y axis of a panel: where a value lands, and the grid lines.
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Self {
        let values: Vec<f64> = values.filter(|v| v.is_finite() && *v > 0.0).collect();
        let max = values.iter().copied().fold(1e-9, f64::max);
        if log {
            let min = values.iter().copied().fold(max, f64::min);
            let lo = min.log10().floor();
            let hi = max.log10().ceil().max(lo + 1.0);
            return Self { lo, hi, log };
        }
        let step = 10f64.powf(max.log10().floor());
        let hi = [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .map(|k| k * step)
            .find(|&v| v >= max)
            .unwrap_or(10.0 * step);
        Self { lo: 0.0, hi, log }
    }

    /// The height of `value` above the plot's floor, in pixels.
    fn height(&self, value: f64) -> f64 {
        let v = if self.log {
            value.max(10f64.powf(self.lo)).log10()
        } else {
            value
        };
        ((v - self.lo) / (self.hi - self.lo) * PLOT_H).clamp(0.0, PLOT_H)
    }

    /// The grid lines' values.
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            #[allow(clippy::cast_possible_truncation)]
            let (lo, hi) = (self.lo as i32, self.hi as i32);
            (lo..=hi).map(|e| 10f64.powi(e)).collect()
        } else {
            (0..=5).map(|i| self.hi * f64::from(i) / 5.0).collect()
        }
    }
}

/// `12 345`, `0.5` or `1.25`: a value short enough for an axis or a bar.
fn short(value: f64) -> String {
    match value.abs() {
        v if v >= 100.0 => crate::group(&format!("{value:.0}")),
        v if v >= 1.0 => format!("{value:.1}"),
        _ => format!("{value:.2}"),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Chart {
    /// A chart titled `title`, with `subtitle` (the run's conditions) under it.
    pub fn new(title: &str, subtitle: &str) -> Self {
        let mut body = String::new();
        let (title, subtitle, mid) = (escape(title), escape(subtitle), WIDTH / 2.0);
        let _ = write!(
            body,
            r##"<text x="{mid}" y="24" text-anchor="middle" font-size="16" font-weight="bold">{title}</text><text x="{mid}" y="44" text-anchor="middle" fill="#555">{subtitle}</text>"##
        );
        Self { body, top: 60.0 }
    }

    /// A panel's title, legend and grid; returns the plot's floor (its lowest y).
    fn panel(&mut self, title: &str, series: &[&str], axis: &Axis, unit: &str) -> f64 {
        let (top, title, unit) = (self.top, escape(title), escape(unit));
        let _ = write!(
            self.body,
            r##"<text x="{LEFT}" y="{}" font-size="14" font-weight="bold">{title}</text><text x="{LEFT}" y="{}" fill="#555">{unit}</text>"##,
            top + 16.0,
            top + 34.0
        );
        for (i, name) in series.iter().enumerate() {
            let x = LEFT + 160.0 + 150.0 * i as f64;
            let _ = write!(
                self.body,
                r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
                top + 24.0,
                COLORS[i % COLORS.len()],
                x + 16.0,
                top + 34.0,
                escape(name)
            );
        }
        let floor = top + 50.0 + PLOT_H;
        for tick in axis.ticks() {
            let y = floor - axis.height(tick);
            let _ = write!(
                self.body,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
                LEFT + PLOT_W,
                LEFT - 6.0,
                y + 4.0,
                short(tick)
            );
        }
        self.top += PANEL_H;
        floor
    }

    /// A panel of bars: one group per `(label, values)`, one bar per series (`None`: no bar);
    /// `log` draws the axis in powers of ten.
    pub fn bars(
        &mut self,
        title: &str,
        unit: &str,
        series: &[&str],
        groups: &[(String, Vec<Option<f64>>)],
        log: bool,
    ) {
        let values = groups.iter().flat_map(|(_, v)| v.iter().flatten().copied());
        let axis = Axis::new(values, log);
        let floor = self.panel(title, series, &axis, unit);
        let group_w = PLOT_W / groups.len().max(1) as f64;
        let bar_w = group_w * 0.8 / series.len().max(1) as f64;
        for (g, (label, values)) in groups.iter().enumerate() {
            let x0 = LEFT + group_w * g as f64 + group_w * 0.1;
            for (i, value) in values.iter().enumerate() {
                let Some(value) = value.filter(|v| v.is_finite()) else {
                    continue;
                };
                let h = axis.height(value);
                let x = x0 + bar_w * i as f64;
                let _ = write!(
                    self.body,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"><title>{} {}: {}</title></rect>"#,
                    floor - h,
                    bar_w - 1.0,
                    COLORS[i % COLORS.len()],
                    escape(label),
                    escape(series.get(i).copied().unwrap_or("")),
                    short(value)
                );
            }
            let _ = write!(
                self.body,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x0 + group_w * 0.4,
                floor + 16.0,
                escape(label)
            );
        }
    }

    /// A panel of lines: each series' points `(x, y)`, `x` from 0 to the largest.
    pub fn lines(&mut self, title: &str, unit: &str, series: &[(&str, Vec<(f64, f64)>)]) {
        let points = || series.iter().flat_map(|(_, p)| p.iter());
        let axis = Axis::new(points().map(|p| p.1), false);
        let x_max = points().map(|p| p.0).fold(1e-9, f64::max);
        let names: Vec<&str> = series.iter().map(|(name, _)| *name).collect();
        let floor = self.panel(title, &names, &axis, unit);
        for (i, (_, line)) in series.iter().enumerate() {
            let points: Vec<String> = line
                .iter()
                .map(|&(x, y)| {
                    let x = LEFT + x / x_max * PLOT_W;
                    format!("{x:.1},{:.1}", floor - axis.height(y))
                })
                .collect();
            let _ = write!(
                self.body,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                COLORS[i % COLORS.len()],
                points.join(" ")
            );
        }
    }

    /// The SVG document.
    pub fn finish(self) -> String {
        let height = self.top + 10.0;
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>{}</svg>
"#,
            self.body
        )
    }
}
