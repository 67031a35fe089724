//! Drawing a [`Chart`] with plotters onto any backend, and the two file formats.
//!
//! Title, legend and plot get separate bands of the picture, and row names and figures
//! separate columns, so no text can land on the data however long a name is.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, register_font};

use super::{BarChart, Chart, LineChart};

/// DejaVu Sans cut down to Latin-1 and a few symbols; licence beside it.
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];
const REFERENCE: RGBColor = RGBColor(214, 39, 40);
const INK: RGBColor = RGBColor(40, 40, 40);

const WIDTH: u32 = 960;
const TITLE_H: i32 = 36;
const LEGEND_ROW_H: i32 = 22;
const ROW_H: u32 = 24;
const X_AXIS_H: u32 = 48;
/// Room right of the bars for each row's figure.
const NOTE_W: i32 = 96;
const MARGIN: i32 = 12;

type Failure = String;

fn fail(e: impl std::fmt::Display) -> Failure {
    e.to_string()
}

fn font_ready() -> Result<(), Failure> {
    static READY: OnceLock<bool> = OnceLock::new();
    let ok = *READY.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err("the bundled font does not parse".into())
    }
}

/// The chart drawn as an SVG document.
pub(super) fn svg(chart: &Chart) -> Result<String, Failure> {
    font_ready()?;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size(chart)).into_drawing_area();
        render(chart, &root)?;
        root.present().map_err(fail)?;
    }
    Ok(out)
}

/// The chart drawn into RGB pixels and encoded as PNG.
pub(super) fn png(chart: &Chart) -> Result<Vec<u8>, Failure> {
    font_ready()?;
    let (w, h) = size(chart);
    let len = (w as usize)
        .checked_mul(h as usize)
        .and_then(|n| n.checked_mul(3))
        .ok_or("picture too large")?;
    let mut pixels = vec![0u8; len];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        render(chart, &root)?;
        root.present().map_err(fail)?;
    }
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(fail)?;
    writer.write_image_data(&pixels).map_err(fail)?;
    writer.finish().map_err(fail)?;
    Ok(out)
}

fn size(chart: &Chart) -> (u32, u32) {
    match chart {
        Chart::Bars(b) => {
            let rows = u32::try_from(b.rows.len().max(1)).unwrap_or(u32::MAX);
            let body = rows.saturating_mul(ROW_H).saturating_add(X_AXIS_H + 16);
            (WIDTH, body.saturating_add(header_h(legend_rows(chart))))
        }
        Chart::Lines(_) => (WIDTH, 420 + header_h(legend_rows(chart))),
    }
}

fn header_h(legend_rows: usize) -> u32 {
    let rows = i32::try_from(legend_rows).unwrap_or(8);
    (TITLE_H + LEGEND_ROW_H * rows + 6).unsigned_abs()
}

fn text(size: f64, h: HPos, v: VPos) -> TextStyle<'static> {
    TextStyle::from((FAMILY, size).into_font())
        .color(&INK)
        .pos(Pos::new(h, v))
}

/// A legend entry: a filled box for bars, a short line for lines.
struct Key {
    name: String,
    color: RGBColor,
    line: bool,
}

fn keys(chart: &Chart) -> Vec<Key> {
    match chart {
        Chart::Bars(b) => {
            let mut keys: Vec<Key> = b
                .series
                .iter()
                .enumerate()
                .map(|(k, name)| Key {
                    name: name.clone(),
                    color: PALETTE[k % PALETTE.len()],
                    line: false,
                })
                .collect();
            if let Some((name, _)) = &b.reference {
                keys.push(Key {
                    name: name.clone(),
                    color: REFERENCE,
                    line: true,
                });
            }
            keys
        }
        Chart::Lines(l) => l
            .series
            .iter()
            .enumerate()
            .map(|(k, s)| Key {
                name: s.name.clone(),
                color: PALETTE[k % PALETTE.len()],
                line: true,
            })
            .collect(),
    }
}

/// Width of a legend entry, estimated from the character count (the real width is measured
/// when drawing; this only decides how many legend rows to reserve, generously).
fn key_w(name: &str) -> i32 {
    let chars = i32::try_from(name.chars().count()).unwrap_or(200);
    30 + chars.saturating_mul(8) + 24
}

/// Legend entries wrapped into rows that fit the picture's width.
fn legend_layout(keys: &[Key]) -> Vec<Vec<usize>> {
    let avail = i32::try_from(WIDTH).unwrap_or(960) - 2 * MARGIN;
    let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0;
    for (i, k) in keys.iter().enumerate() {
        let w = key_w(&k.name);
        if used + w > avail
            && let Some(last) = rows.last()
            && !last.is_empty()
        {
            rows.push(Vec::new());
            used = 0;
        }
        if let Some(last) = rows.last_mut() {
            last.push(i);
        }
        used += w;
    }
    rows
}

fn legend_rows(chart: &Chart) -> usize {
    legend_layout(&keys(chart)).len()
}

fn render<DB: DrawingBackend>(chart: &Chart, root: &DrawingArea<DB, Shift>) -> Result<(), Failure> {
    root.fill(&WHITE).map_err(fail)?;
    let (w, _) = root.dim_in_pixel();
    let w = i32::try_from(w).unwrap_or(i32::MAX);
    let title = match chart {
        Chart::Bars(b) => &b.title,
        Chart::Lines(l) => &l.title,
    };
    root.draw(&Text::new(
        title.as_str(),
        (w / 2, TITLE_H / 2),
        text(18.0, HPos::Center, VPos::Center),
    ))
    .map_err(fail)?;
    let keys = keys(chart);
    let layout = legend_layout(&keys);
    for (r, row) in layout.iter().enumerate() {
        let y = TITLE_H + LEGEND_ROW_H * i32::try_from(r).unwrap_or(0) + LEGEND_ROW_H / 2;
        let mut x = MARGIN;
        for &i in row {
            let k = &keys[i];
            if k.line {
                root.draw(&PathElement::new(
                    vec![(x, y), (x + 22, y)],
                    k.color.stroke_width(3),
                ))
                .map_err(fail)?;
            } else {
                root.draw(&Rectangle::new(
                    [(x + 4, y - 6), (x + 18, y + 6)],
                    k.color.filled(),
                ))
                .map_err(fail)?;
            }
            let style = text(14.0, HPos::Left, VPos::Center);
            root.draw(&Text::new(k.name.as_str(), (x + 30, y), style.clone()))
                .map_err(fail)?;
            let (tw, _) = root.estimate_text_size(&k.name, &style).map_err(fail)?;
            x += 30 + i32::try_from(tw).unwrap_or(0) + 24;
        }
    }
    let header = header_h(layout.len());
    let (_, body) = root.split_vertically(header);
    match chart {
        Chart::Bars(b) => bars(b, root, &body),
        Chart::Lines(l) => lines(l, &body),
    }
}

/// Decimals for axis labels `step` apart.
fn decimals(step: f64) -> usize {
    if step >= 1.0 || !step.is_finite() || step <= 0.0 {
        0
    } else {
        usize::try_from((-step.log10().floor()) as i64).unwrap_or(0)
    }
}

fn bars<DB: DrawingBackend>(
    b: &BarChart,
    root: &DrawingArea<DB, Shift>,
    body: &DrawingArea<DB, Shift>,
) -> Result<(), Failure> {
    let label_style = text(13.0, HPos::Right, VPos::Center);
    let note_style = text(13.0, HPos::Left, VPos::Center);
    let (mut label_w, mut note_w) = (0, 0);
    for r in &b.rows {
        label_w = label_w.max(
            root.estimate_text_size(&r.label, &label_style)
                .map_err(fail)?
                .0,
        );
        note_w = note_w.max(
            root.estimate_text_size(&r.note, &note_style)
                .map_err(fail)?
                .0,
        );
    }
    // The notes right of the plot get the room the longest one needs.
    let note_w = NOTE_W.max(i32::try_from(note_w).unwrap_or(NOTE_W) + 16);
    let n = b.rows.len().max(1) as f64;
    let mut chart = ChartBuilder::on(body)
        .margin_left(MARGIN)
        .margin_right(note_w)
        .margin_top(4)
        .margin_bottom(8)
        .x_label_area_size(X_AXIS_H)
        .y_label_area_size(label_w + 16)
        .build_cartesian_2d(b.axis_start..b.axis_end, -0.5..n - 0.5)
        .map_err(fail)?;
    let prec = decimals((b.axis_end - b.axis_start) / 10.0);
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(10)
        .x_label_formatter(&|v| format!("{v:.prec$}"))
        .x_desc(b.axis.as_str())
        .axis_desc_style(text(14.0, HPos::Center, VPos::Center))
        .label_style(text(12.0, HPos::Center, VPos::Top))
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(fail)?;
    for (i, row) in b.rows.iter().enumerate() {
        let y = n - 1.0 - i as f64;
        for (k, (x0, x1, half)) in spans(b, &row.values).into_iter().enumerate() {
            if x1 > x0 {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x0, y - half), (x1, y + half)],
                        PALETTE[k % PALETTE.len()].filled(),
                    )))
                    .map_err(fail)?;
            }
        }
        let (left, py) = chart.backend_coord(&(b.axis_start, y));
        let (right, _) = chart.backend_coord(&(b.axis_end, y));
        root.draw(&Text::new(
            row.label.as_str(),
            (left - 8, py),
            label_style.clone(),
        ))
        .map_err(fail)?;
        root.draw(&Text::new(
            row.note.as_str(),
            (right + 8, py),
            note_style.clone(),
        ))
        .map_err(fail)?;
    }
    if let Some((_, v)) = b.reference
        && (b.axis_start..=b.axis_end).contains(&v)
    {
        chart
            .draw_series(DashedLineSeries::new(
                [(v, -0.5), (v, n - 0.5)],
                8,
                5,
                REFERENCE.stroke_width(2),
            ))
            .map_err(fail)?;
    }
    Ok(())
}

/// Where each series' bar of a row lies on the value axis, clipped to it, and its half
/// height in rows: stacked bars end to end from 0, overlaid ones from 0 and thinner each.
pub(super) fn spans(b: &BarChart, values: &[f64]) -> Vec<(f64, f64, f64)> {
    let clip = |v: f64| v.clamp(b.axis_start, b.axis_end);
    let mut sum = 0.0;
    values
        .iter()
        .enumerate()
        .map(|(k, &v)| {
            if b.stacked {
                let from = sum;
                sum += v;
                (clip(from), clip(sum), 0.36)
            } else {
                (clip(0.0), clip(v), 0.36 - 0.14 * k.min(2) as f64)
            }
        })
        .collect()
}

fn lines<DB: DrawingBackend>(l: &LineChart, body: &DrawingArea<DB, Shift>) -> Result<(), Failure> {
    let xs = || l.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let x0 = xs().fold(f64::INFINITY, f64::min);
    let x1 = xs().fold(f64::NEG_INFINITY, f64::max);
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        (x0, x1)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(body)
        .margin_left(MARGIN)
        .margin_right(3 * MARGIN)
        .margin_top(4)
        .margin_bottom(8)
        .x_label_area_size(X_AXIS_H)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, 0.0..l.y_max)
        .map_err(fail)?;
    let xprec = decimals((x1 - x0) / 10.0);
    let yprec = decimals(l.y_max / 10.0);
    chart
        .configure_mesh()
        .x_labels(10)
        .y_labels(6)
        .x_label_formatter(&|v| format!("{v:.xprec$}"))
        .y_label_formatter(&|v| format!("{v:.yprec$}"))
        .x_desc(l.x_axis.as_str())
        .y_desc(l.y_axis.as_str())
        .axis_desc_style(text(14.0, HPos::Center, VPos::Center))
        .label_style(text(12.0, HPos::Center, VPos::Center))
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(fail)?;
    for (k, s) in l.series.iter().enumerate() {
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                PALETTE[k % PALETTE.len()].stroke_width(2),
            ))
            .map_err(fail)?;
    }
    Ok(())
}
