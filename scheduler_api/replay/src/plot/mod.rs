//! Plots of replay reports, drawn with `plotters` into SVG and PNG.
//!
//! Each chart is described once ([`Chart`]) and drawn by the same code onto plotters' SVG
//! backend and onto its in-memory bitmap backend, whose pixels the `png` crate encodes, so both
//! files show the same picture. Text is laid out and rasterized with a bundled DejaVu Sans
//! subset (see `assets/`), so no system font library is needed.

mod draw;

use std::path::Path;

use crate::sim::{OccupancySample, Report};
use radixkv_scheduler_api::error::{ManagerError, Result};

/// One labelled row of a horizontal bar chart.
#[derive(Clone, Debug, PartialEq)]
pub struct BarRow {
    /// The row's name, drawn left of the bars.
    pub label: String,
    /// One value per series: stacked end to end, or overlaid from the axis start (see
    /// [`BarChart::stacked`]).
    pub values: Vec<f64>,
    /// The figure printed right of the plot.
    pub note: String,
}

/// Horizontal bars, one row per configuration, with an optional reference line.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// Title above the chart.
    pub title: String,
    /// Caption of the value axis.
    pub axis: String,
    /// Legend name of each series (index matches [`BarRow::values`]).
    pub series: Vec<String>,
    /// Rows, drawn top to bottom in this order.
    pub rows: Vec<BarRow>,
    /// Series stack end to end (parts of a whole) rather than overlay (p50 inside p99).
    pub stacked: bool,
    /// A vertical reference line and its legend name.
    pub reference: Option<(String, f64)>,
    /// Start of the value axis; above 0 when every bar is high, so close values differ.
    pub axis_start: f64,
    /// End of the value axis.
    pub axis_end: f64,
}

/// One named line of (x, y) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// Points in x order.
    pub points: Vec<(f64, f64)>,
}

/// Lines over a numeric x axis that spans exactly the data.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Title above the chart.
    pub title: String,
    /// Caption of the x axis.
    pub x_axis: String,
    /// Caption of the y axis.
    pub y_axis: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Top of the y axis (the bottom is 0).
    pub y_max: f64,
}

/// A chart of a report.
#[derive(Clone, Debug, PartialEq)]
pub enum Chart {
    /// Horizontal bars per configuration.
    Bars(BarChart),
    /// Lines over time.
    Lines(LineChart),
}

impl Chart {
    /// The chart as an SVG document.
    ///
    /// # Errors
    /// [`ManagerError::Io`] if plotters fails to draw (named after `name`).
    pub fn to_svg(&self, name: &str) -> Result<String> {
        draw::svg(self).map_err(|e| drawing_error(name, "svg", &e))
    }

    /// The chart as a PNG file.
    ///
    /// # Errors
    /// [`ManagerError::Io`] if plotters fails to draw or the PNG encoder fails.
    pub fn to_png(&self, name: &str) -> Result<Vec<u8>> {
        draw::png(self).map_err(|e| drawing_error(name, "png", &e))
    }
}

fn drawing_error(name: &str, ext: &str, message: &str) -> ManagerError {
    ManagerError::Io {
        path: format!("{name}.{ext}"),
        message: format!("drawing the chart: {message}"),
    }
}

/// Writes `name.svg` and `name.png` under `dir`.
///
/// # Errors
/// [`ManagerError::Io`].
pub fn write_chart(dir: &Path, name: &str, chart: &Chart) -> Result<()> {
    let write = |file: String, bytes: &[u8]| {
        let path = dir.join(file);
        std::fs::write(&path, bytes).map_err(|e| ManagerError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    };
    write(format!("{name}.svg"), chart.to_svg(name)?.as_bytes())?;
    write(format!("{name}.png"), &chart.to_png(name)?)
}

/// How many distinct curves the compare occupancy chart draws: more lines are unreadable.
const MAX_LINES: usize = 6;
/// Curves closer than this (mean distance, fraction of the pool) are drawn as one.
const ALIKE: f64 = 0.01;

/// The standard charts of a set of reports: hit ratio per configuration (with the ideal),
/// TTFT p50/p99 per configuration, device pool occupancy over time; for models with Mamba or
/// sliding-window layers also the occupancy of each pool over time (`pools`), the usable hit
/// against the KV match per configuration (`usable_hit`) and, with the model's compute shape,
/// the share of prefill FLOPs the hits saved (`flops_saved`).
pub fn report_charts(reports: &[&Report]) -> Vec<(&'static str, Chart)> {
    // Best first: the highest hit ratio on top, in both bar charts, so rows line up.
    let mut order: Vec<&Report> = reports.to_vec();
    order.sort_by(|a, b| b.hit_ratio.overall.total_cmp(&a.hit_ratio.overall));
    // The ideal is the trace's, the same for every configuration of a comparison (see
    // `sim::compare`), as the table's footer prints it.
    let ideal = reports.first().map_or(0.0, |r| r.ideal_hit_ratio);
    let mut charts = vec![
        ("hit_ratio", Chart::Bars(hit_ratio_chart(&order, ideal))),
        ("ttft", Chart::Bars(ttft_chart(&order))),
        ("occupancy", Chart::Lines(occupancy_chart(&order))),
    ];
    if order.iter().any(|r| r.mamba.is_some() || r.swa.is_some()) {
        charts.push(("pools", Chart::Lines(pools_chart(&order))));
        charts.push(("usable_hit", Chart::Bars(usable_hit_chart(&order, ideal))));
        if order.iter().any(|r| r.prefill_flops.is_some()) {
            charts.push(("flops_saved", Chart::Bars(flops_saved_chart(&order))));
        }
    }
    charts
}

/// One pool's occupancy: its name, and the fractions in use and cached of a sample (`None`
/// where the model lacks the pool).
type PoolColumns = (
    &'static str,
    fn(&OccupancySample) -> Option<f64>,
    fn(&OccupancySample) -> Option<f64>,
);

/// The pools a hybrid report samples: the full-attention KV pages, the Mamba state slots and
/// the sliding-window pages.
const POOLS: [PoolColumns; 3] = [
    ("KV pages", |o| Some(o.in_use), |o| Some(o.cached)),
    ("Mamba slots", |o| o.mamba_in_use, |o| o.mamba_cached),
    ("SWA pages", |o| o.swa_in_use, |o| o.swa_cached),
];

/// Per-pool occupancy over time. One configuration: every pool the model has, in use and
/// cached. Several: the cached part of each extra pool per configuration (the part the
/// policies decide; alike curves drawn once).
fn pools_chart(order: &[&Report]) -> LineChart {
    let (window, smoothing) = occupancy_smoothing(order);
    let has = |r: &Report, f: fn(&OccupancySample) -> Option<f64>| {
        r.occupancy.first().and_then(f).is_some()
    };
    let line = |name: String, r: &Report, f: fn(&OccupancySample) -> Option<f64>| Series {
        name,
        points: moving_average_opt(&r.occupancy, window, f),
    };
    let series = if let [r] = order {
        POOLS
            .iter()
            .filter(|(_, in_use, _)| has(r, *in_use))
            .flat_map(|&(pool, in_use, cached)| {
                [
                    line(format!("{pool} in use"), r, in_use),
                    line(format!("{pool} cached"), r, cached),
                ]
            })
            .collect()
    } else {
        let all = POOLS[1..]
            .iter()
            .flat_map(|&(pool, _, cached)| {
                order
                    .iter()
                    .filter(move |r| has(r, cached))
                    .map(move |r| line(format!("{}: {pool} cached", r.config), r, cached))
            })
            .collect();
        distinct_lines(all)
    };
    LineChart {
        title: format!("occupancy per pool ({smoothing})"),
        x_axis: "simulated time (s)".into(),
        y_axis: "fraction of each pool".into(),
        series,
        y_max: 1.0,
    }
}

/// [`moving_average`] of an optional column (0 where a sample lacks it).
fn moving_average_opt(
    samples: &[OccupancySample],
    window: usize,
    f: fn(&OccupancySample) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let window = window.max(1);
    let mut sum = 0.0;
    let mut out = Vec::with_capacity(samples.len());
    for (i, s) in samples.iter().enumerate() {
        sum += f(s).unwrap_or(0.0);
        if let Some(old) = i.checked_sub(window).and_then(|j| samples.get(j)) {
            sum -= f(old).unwrap_or(0.0);
        }
        out.push((s.t_s, sum / (i + 1).min(window) as f64));
    }
    out
}

/// Per configuration, the KV match (how far the device KV matched) with the usable hit (the
/// part that ends at a cached state, or a full window of live window KV) drawn inside it.
fn usable_hit_chart(order: &[&Report], ideal: f64) -> BarChart {
    let rows = order
        .iter()
        .map(|r| BarRow {
            label: r.config.clone(),
            values: vec![r.kv_match_ratio.max(r.hit_ratio.device), r.hit_ratio.device],
            note: format!(
                "{:.4} of {:.4}",
                r.hit_ratio.device,
                r.kv_match_ratio.max(r.hit_ratio.device)
            ),
        })
        .collect();
    let (start, end) = if order.len() == 1 {
        (0.0, 1.0)
    } else {
        ratio_axis(
            order
                .iter()
                .flat_map(|r| [r.kv_match_ratio, r.hit_ratio.device])
                .filter(|&v| v > 0.0),
            ideal,
        )
    };
    BarChart {
        title: "usable hit vs KV match (token ratios)".into(),
        axis: if start > 0.0 {
            format!(
                "fraction of prompt tokens (axis starts at {}, not 0)",
                fmt_ratio(start)
            )
        } else {
            "fraction of prompt tokens".into()
        },
        series: vec![
            "KV match".into(),
            if order.iter().any(|r| r.mamba.is_some()) {
                "usable hit (ends at a cached Mamba state)".into()
            } else {
                "usable hit (a full live window before its end)".into()
            },
        ],
        rows,
        stacked: false,
        reference: Some((format!("ideal, infinite cache ({ideal:.4})"), ideal)),
        axis_start: start,
        axis_end: end,
    }
}

/// Per configuration, the share of the prompts' prefill FLOPs the usable hits saved.
fn flops_saved_chart(order: &[&Report]) -> BarChart {
    let rows = order
        .iter()
        .map(|r| {
            let f = r.prefill_flops.unwrap_or_default();
            BarRow {
                label: r.config.clone(),
                values: vec![f.saved_fraction()],
                note: format!("{:.1} % of {:.2e}", 100.0 * f.saved_fraction(), f.prompt),
            }
        })
        .collect();
    let (start, end) = if order.len() == 1 {
        (0.0, 1.0)
    } else {
        ratio_axis(
            order
                .iter()
                .filter_map(|r| r.prefill_flops.map(|f| f.saved_fraction()))
                .filter(|&v| v > 0.0),
            0.0,
        )
    };
    BarChart {
        title: "prefill FLOPs saved by the hits".into(),
        axis: if start > 0.0 {
            format!(
                "fraction of the prompts' prefill FLOPs (axis starts at {}, not 0)",
                fmt_ratio(start)
            )
        } else {
            "fraction of the prompts' prefill FLOPs".into()
        },
        series: vec!["prefill FLOPs saved".into()],
        rows,
        stacked: true,
        reference: None,
        axis_start: start,
        axis_end: end,
    }
}

fn hit_ratio_chart(order: &[&Report], ideal: f64) -> BarChart {
    let with_host = order
        .iter()
        .any(|r| r.hit_ratio.overall > r.hit_ratio.device);
    let rows = order
        .iter()
        .map(|r| {
            let mut values = vec![r.hit_ratio.device];
            if with_host {
                values.push((r.hit_ratio.overall - r.hit_ratio.device).max(0.0));
            }
            BarRow {
                label: r.config.clone(),
                values,
                note: format!("{:.4}", r.hit_ratio.overall),
            }
        })
        .collect::<Vec<_>>();
    // A disabled cache (ratio 0) keeps its row and figure but does not pull the axis to 0.
    let totals = order
        .iter()
        .map(|r| r.hit_ratio.overall)
        .filter(|&v| v > 0.0);
    // One configuration has nothing to be told apart from: its bar is read against the whole
    // scale, so the axis is 0 to 1.
    let (start, end) = if order.len() == 1 {
        (0.0, 1.0)
    } else {
        ratio_axis(totals, ideal)
    };
    let mut series = vec!["hit on device".to_string()];
    if with_host {
        series.push("loaded back from host".to_string());
    }
    BarChart {
        title: match order {
            [r] => format!("token hit ratio of {}", r.config),
            _ => "token hit ratio per configuration".into(),
        },
        axis: if start > 0.0 {
            format!(
                "token hit ratio (axis starts at {}, not 0)",
                fmt_ratio(start)
            )
        } else {
            "token hit ratio".into()
        },
        series,
        rows,
        stacked: true,
        reference: Some((format!("ideal, infinite cache ({ideal:.4})"), ideal)),
        axis_start: start,
        axis_end: end,
    }
}

/// The value axis of a ratio chart: from 0 unless every bar is high, then from a round value
/// below the lowest bar so that 0.88 and 0.91 differ visibly; up to a round value at or above
/// the highest bar and the reference, at most 1.
fn ratio_axis(values: impl Iterator<Item = f64>, reference: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, reference), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || hi <= 0.0 {
        return (0.0, 1.0);
    }
    let lo = lo.min(reference);
    let span = (hi - lo).max(0.01);
    let step = round_step(span / 5.0);
    let end = ((hi + span * 0.05) / step).ceil() * step;
    let end = end.min(1.0).max(hi);
    // Bars that all reach past half the axis: zero wastes the width and hides the differences.
    if lo < 0.5 * end {
        return (0.0, end);
    }
    let start = ((lo - span * 0.5) / step).floor() * step;
    (start.max(0.0), end)
}

/// A ratio with as many decimals as it needs (0.875, 0.6).
fn fmt_ratio(v: f64) -> String {
    let s = format!("{v:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// 1, 2 or 5 × 10^k at or above `v`.
fn round_step(v: f64) -> f64 {
    let e = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * e)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * e)
}

fn ttft_chart(order: &[&Report]) -> BarChart {
    let rows: Vec<BarRow> = order
        .iter()
        .map(|r| BarRow {
            label: r.config.clone(),
            values: vec![r.ttft_p99_ms, r.ttft_p50_ms],
            note: format!("{} / {}", fmt_ms(r.ttft_p50_ms), fmt_ms(r.ttft_p99_ms)),
        })
        .collect();
    let max = order.iter().map(|r| r.ttft_p99_ms).fold(0.0, f64::max);
    BarChart {
        title: "simulated time to first token (p50 / p99 ms)".into(),
        axis: "ms (rows in the hit-ratio chart's order)".into(),
        series: vec!["p99".into(), "p50".into()],
        rows,
        stacked: false,
        reference: None,
        axis_start: 0.0,
        axis_end: if max > 0.0 { max * 1.05 } else { 1.0 },
    }
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The moving-average window of the occupancy charts of `order` (the widest any run needs,
/// so that every curve is smoothed alike) and the caption that says so.
fn occupancy_smoothing(order: &[&Report]) -> (usize, String) {
    let window = order
        .iter()
        .map(|r| smoothing_window(r.occupancy.len()))
        .max()
        .unwrap_or(1);
    let seconds = order
        .iter()
        .map(|r| window_seconds(&r.occupancy, window))
        .fold(0.0, f64::max);
    let smoothing = if window > 1 {
        format!("moving average over {window} samples, about {seconds:.1} s")
    } else {
        "raw samples".into()
    };
    (window, smoothing)
}

fn occupancy_chart(order: &[&Report]) -> LineChart {
    let (window, smoothing) = occupancy_smoothing(order);
    let line = |name: String, r: &Report, f: fn(&OccupancySample) -> f64| Series {
        name,
        points: moving_average(&r.occupancy, window, f),
    };
    let (series, y_axis) = if let [r] = order {
        (
            vec![
                line("in use by requests".into(), r, |o| o.in_use),
                line("cached (evictable)".into(), r, |o| o.cached),
            ],
            "fraction of the device pool",
        )
    } else {
        // Several configurations: their caches all fill the pool, so the informative line is
        // the part running requests hold. Many configurations trace the same curve; each is
        // drawn once, named after the best of them, or the lines hide one another.
        let all: Vec<Series> = order
            .iter()
            .map(|r| line(r.config.clone(), r, |o| o.in_use))
            .collect();
        (
            distinct_lines(all),
            "fraction of the pool in use by requests",
        )
    };
    let title = format!("device pool occupancy ({smoothing})");
    LineChart {
        title,
        x_axis: "simulated time (s)".into(),
        y_axis: y_axis.into(),
        series,
        y_max: 1.0,
    }
}

/// The first series of each group of alike ones (best first), named "+N alike" for the ones it
/// stands for; at most [`MAX_LINES`] groups, the rest counted in the last name.
fn distinct_lines(all: Vec<Series>) -> Vec<Series> {
    let mut kept: Vec<(Series, usize)> = Vec::new();
    let mut left_out = 0;
    for s in all {
        if let Some(k) = kept.iter_mut().find(|k| mean_distance(&k.0, &s) < ALIKE) {
            k.1 += 1;
        } else if kept.len() < MAX_LINES {
            kept.push((s, 0));
        } else {
            left_out += 1;
        }
    }
    let last = kept.len().saturating_sub(1);
    kept.into_iter()
        .enumerate()
        .map(|(i, (mut s, alike))| {
            if alike > 0 {
                s.name = format!("{} (+{alike} alike)", s.name);
            }
            if i == last && left_out > 0 {
                s.name = format!("{}; {left_out} more not drawn", s.name);
            }
            s
        })
        .collect()
}

/// Mean vertical distance of two curves at 100 times across the longer one (a curve holds its
/// last value past its end).
fn mean_distance(a: &Series, b: &Series) -> f64 {
    let end = [a, b]
        .iter()
        .filter_map(|s| s.points.last().map(|p| p.0))
        .fold(0.0, f64::max);
    let at = |s: &Series, t: f64| {
        let i = s.points.partition_point(|p| p.0 <= t);
        s.points.get(i.saturating_sub(1)).map_or(0.0, |p| p.1)
    };
    (0..100)
        .map(|i| {
            let t = end * f64::from(i) / 99.0;
            (at(a, t) - at(b, t)).abs()
        })
        .sum::<f64>()
        / 100.0
}

/// About 1/40 of the series, so a few hundred noisy samples become a readable trend.
fn smoothing_window(samples: usize) -> usize {
    (samples / 40).max(1)
}

fn window_seconds(samples: &[OccupancySample], window: usize) -> f64 {
    match (samples.first(), samples.last()) {
        (Some(a), Some(b)) if samples.len() > 1 => {
            (b.t_s - a.t_s) * window as f64 / (samples.len() - 1) as f64
        }
        _ => 0.0,
    }
}

/// A trailing moving average over `window` samples (fewer at the start), one point per sample
/// at the sample's own time: the line ends where the data ends.
fn moving_average(
    samples: &[OccupancySample],
    window: usize,
    f: fn(&OccupancySample) -> f64,
) -> Vec<(f64, f64)> {
    let window = window.max(1);
    let mut sum = 0.0;
    let mut out = Vec::with_capacity(samples.len());
    for (i, s) in samples.iter().enumerate() {
        sum += f(s);
        if let Some(old) = i.checked_sub(window).and_then(|j| samples.get(j)) {
            sum -= f(old);
        }
        out.push((s.t_s, sum / (i + 1).min(window) as f64));
    }
    out
}

#[cfg(test)]
mod tests;
