//! Plots of replay reports, written as SVG and PNG.
//!
//! A chart is laid out once into drawing primitives ([`Prim`]); the SVG writer and the PNG
//! rasterizer consume the same primitives, so both files show the same picture. The
//! rasterizer is a few dozen lines with a built-in 5×7 bitmap font and a minimal PNG encoder
//! over `flate2`, which keeps heavy graphics crates out of the build.

mod raster;

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{ManagerError, Result};
use crate::sim::Report;

/// An RGB colour.
pub type Rgb = [u8; 3];

const PALETTE: [Rgb; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];
const INK: Rgb = [40, 40, 40];
const GRID: Rgb = [225, 225, 225];

/// A drawing primitive in pixel coordinates (origin top left).
#[derive(Clone, Debug, PartialEq)]
pub enum Prim {
    /// A filled rectangle.
    Rect {
        /// Left.
        x: f64,
        /// Top.
        y: f64,
        /// Width.
        w: f64,
        /// Height.
        h: f64,
        /// Fill.
        fill: Rgb,
    },
    /// A straight line.
    Line {
        /// Start.
        from: (f64, f64),
        /// End.
        to: (f64, f64),
        /// Colour.
        color: Rgb,
        /// Width in pixels.
        width: f64,
    },
    /// A text label; `anchor` is 0 (start), 1 (middle) or 2 (end) horizontally, `y` is the
    /// baseline-ish bottom of the glyphs.
    Text {
        /// Anchor point x.
        x: f64,
        /// Anchor point y.
        y: f64,
        /// The text.
        text: String,
        /// Pixel scale of the 5×7 font (1 = 7 px high).
        scale: u32,
        /// Horizontal anchor.
        anchor: u8,
    },
}

/// A chart: size and primitives.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// What to draw, in order.
    pub prims: Vec<Prim>,
}

/// One named series of values.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// One value per category (bars) or (x, y) points (lines).
    pub points: Vec<(f64, f64)>,
}

const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

/// A grouped bar chart with an optional horizontal reference line.
pub fn bar_chart(
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[Series],
    reference: Option<(&str, f64)>,
) -> Chart {
    let group_w = 120.0;
    let width = (LEFT + RIGHT + group_w * categories.len().max(1) as f64).max(640.0);
    let height = 420.0;
    let ymax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(reference.map(|r| r.1))
        .fold(0.0f64, f64::max);
    let mut c = Frame::new(width, height, title, y_label, nice_max(ymax));
    let plot_w = width - LEFT - RIGHT;
    let gw = plot_w / categories.len().max(1) as f64;
    let bw = (gw * 0.8) / series.len().max(1) as f64;
    for (i, cat) in categories.iter().enumerate() {
        let gx = LEFT + gw * i as f64 + gw * 0.1;
        for (k, s) in series.iter().enumerate() {
            let v = s.points.get(i).map_or(0.0, |p| p.1);
            let y = c.y(v);
            c.prims.push(Prim::Rect {
                x: gx + bw * k as f64,
                y,
                w: (bw - 2.0).max(1.0),
                h: (height - BOTTOM - y).max(0.0),
                fill: PALETTE[k % PALETTE.len()],
            });
        }
        // Alternate two label rows so long configuration names do not overlap.
        let row = if i % 2 == 0 { 16.0 } else { 30.0 };
        c.text(gx + gw * 0.4, height - BOTTOM + row, cat, 1, 1);
    }
    if let Some((name, v)) = reference {
        let y = c.y(v);
        c.prims.push(Prim::Line {
            from: (LEFT, y),
            to: (width - RIGHT, y),
            color: PALETTE[3],
            width: 2.0,
        });
        c.text(width - RIGHT - 4.0, y - 4.0, name, 1, 2);
    }
    c.legend(series.iter().map(|s| s.name.as_str()));
    c.finish()
}

/// A line chart over a numeric x axis.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Chart {
    let (width, height) = (820.0, 420.0);
    let pts = || series.iter().flat_map(|s| s.points.iter());
    let xmax = nice_max(pts().map(|p| p.0).fold(0.0, f64::max));
    let ymax = nice_max(pts().map(|p| p.1).fold(0.0, f64::max));
    let mut c = Frame::new(width, height, title, y_label, ymax);
    let plot_w = width - LEFT - RIGHT;
    let x = |v: f64| LEFT + plot_w * (v / xmax);
    for (k, s) in series.iter().enumerate() {
        for w in s.points.windows(2) {
            c.prims.push(Prim::Line {
                from: (x(w[0].0), c.y(w[0].1)),
                to: (x(w[1].0), c.y(w[1].1)),
                color: PALETTE[k % PALETTE.len()],
                width: 1.5,
            });
        }
    }
    for i in 0..=4 {
        let v = xmax * f64::from(i) / 4.0;
        c.text(x(v), height - BOTTOM + 16.0, &fmt_num(v), 1, 1);
    }
    c.text(LEFT + plot_w / 2.0, height - 12.0, x_label, 1, 1);
    c.legend(series.iter().map(|s| s.name.as_str()));
    c.finish()
}

struct Frame {
    width: f64,
    height: f64,
    ymax: f64,
    prims: Vec<Prim>,
}

impl Frame {
    fn new(width: f64, height: f64, title: &str, y_label: &str, ymax: f64) -> Self {
        let mut f = Frame {
            width,
            height,
            ymax,
            prims: vec![Prim::Rect {
                x: 0.0,
                y: 0.0,
                w: width,
                h: height,
                fill: [255, 255, 255],
            }],
        };
        for i in 0..=4 {
            let v = ymax * f64::from(i) / 4.0;
            let y = f.y(v);
            f.prims.push(Prim::Line {
                from: (LEFT, y),
                to: (width - RIGHT, y),
                color: GRID,
                width: 1.0,
            });
            f.text(LEFT - 6.0, y + 3.0, &fmt_num(v), 1, 2);
        }
        f.prims.push(Prim::Line {
            from: (LEFT, TOP),
            to: (LEFT, height - BOTTOM),
            color: INK,
            width: 1.0,
        });
        f.prims.push(Prim::Line {
            from: (LEFT, height - BOTTOM),
            to: (width - RIGHT, height - BOTTOM),
            color: INK,
            width: 1.0,
        });
        f.text(width / 2.0, 24.0, title, 2, 1);
        f.text(8.0, TOP - 10.0, y_label, 1, 0);
        f
    }

    fn y(&self, v: f64) -> f64 {
        let h = self.height - TOP - BOTTOM;
        self.height - BOTTOM - h * (v / self.ymax).clamp(0.0, 1.0)
    }

    fn text(&mut self, x: f64, y: f64, text: &str, scale: u32, anchor: u8) {
        self.prims.push(Prim::Text {
            x,
            y,
            text: text.to_string(),
            scale,
            anchor,
        });
    }

    fn legend<'a>(&mut self, names: impl Iterator<Item = &'a str>) {
        let mut y = TOP + 4.0;
        for (k, name) in names.enumerate() {
            let x = self.width - RIGHT - 190.0;
            self.prims.push(Prim::Rect {
                x,
                y,
                w: 10.0,
                h: 10.0,
                fill: PALETTE[k % PALETTE.len()],
            });
            self.text(x + 16.0, y + 9.0, name, 1, 0);
            y += 14.0;
        }
    }

    fn finish(self) -> Chart {
        Chart {
            width: self.width as u32,
            height: self.height as u32,
            prims: self.prims,
        }
    }
}

/// A round axis maximum at or above `v` (1, 2 or 5 × 10^k); 1 for nothing to show.
fn nice_max(v: f64) -> f64 {
    if !v.is_finite() || v <= 0.0 {
        return 1.0;
    }
    let e = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * e)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * e)
}

fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

impl Chart {
    /// The chart as an SVG document.
    pub fn to_svg(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="monospace">"#,
            w = self.width,
            h = self.height
        );
        let hex = |c: &Rgb| format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2]);
        for p in &self.prims {
            let _ = match p {
                Prim::Rect { x, y, w, h, fill } => writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{}"/>"#,
                    hex(fill)
                ),
                Prim::Line {
                    from,
                    to,
                    color,
                    width,
                } => writeln!(
                    s,
                    r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="{width}"/>"#,
                    from.0,
                    from.1,
                    to.0,
                    to.1,
                    hex(color)
                ),
                Prim::Text {
                    x,
                    y,
                    text,
                    scale,
                    anchor,
                } => writeln!(
                    s,
                    r#"<text x="{x:.1}" y="{y:.1}" font-size="{}" text-anchor="{}" fill="{}">{}</text>"#,
                    9 * scale,
                    ["start", "middle", "end"][usize::from((*anchor).min(2))],
                    hex(&INK),
                    xml_escape(text)
                ),
            };
        }
        s.push_str("</svg>\n");
        s
    }

    /// The chart as a PNG file.
    pub fn to_png(&self) -> Vec<u8> {
        raster::render_png(self)
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
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
    write(format!("{name}.svg"), chart.to_svg().as_bytes())?;
    write(format!("{name}.png"), &chart.to_png())
}

/// The standard charts of a set of reports: hit ratio per configuration (with the ideal),
/// TTFT p50/p99 per configuration, device pool occupancy over time.
pub fn report_charts(reports: &[&Report]) -> Vec<(&'static str, Chart)> {
    let cats: Vec<String> = reports.iter().map(|r| r.config.clone()).collect();
    let per = |f: fn(&Report) -> f64| -> Vec<(f64, f64)> {
        reports
            .iter()
            .enumerate()
            .map(|(i, r)| (i as f64, f(r)))
            .collect()
    };
    let ideal = reports.first().map_or(0.0, |r| r.ideal_hit_ratio);
    let hit = bar_chart(
        "Token hit ratio per configuration",
        "hit ratio",
        &cats,
        &[
            Series {
                name: "device".into(),
                points: per(|r| r.hit_ratio.device),
            },
            Series {
                name: "all tiers".into(),
                points: per(|r| r.hit_ratio.overall),
            },
        ],
        Some(("ideal (infinite cache)", ideal)),
    );
    let ttft = bar_chart(
        "Simulated TTFT per configuration",
        "ms",
        &cats,
        &[
            Series {
                name: "p50".into(),
                points: per(|r| r.ttft_p50_ms),
            },
            Series {
                name: "p99".into(),
                points: per(|r| r.ttft_p99_ms),
            },
        ],
        None,
    );
    let occupancy: Vec<Series> = if let [r] = reports {
        vec![
            Series {
                name: "in use".into(),
                points: r.occupancy.iter().map(|o| (o.t_s, o.in_use)).collect(),
            },
            Series {
                name: "cached (evictable)".into(),
                points: r.occupancy.iter().map(|o| (o.t_s, o.cached)).collect(),
            },
        ]
    } else {
        reports
            .iter()
            .take(PALETTE.len())
            .map(|r| Series {
                name: r.config.clone(),
                points: r.occupancy.iter().map(|o| (o.t_s, o.in_use)).collect(),
            })
            .collect()
    };
    // Several configurations: their caches all fill the pool, so the informative line is the
    // part running requests hold.
    let occ = line_chart(
        "Device pool occupancy",
        "simulated time (s)",
        if reports.len() == 1 {
            "fraction of pool"
        } else {
            "fraction in use by requests"
        },
        &occupancy,
    );
    vec![("hit_ratio", hit), ("ttft", ttft), ("occupancy", occ)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_render_to_svg_and_png() {
        let c = bar_chart(
            "t",
            "y",
            &["a".into(), "b".into()],
            &[Series {
                name: "s".into(),
                points: vec![(0.0, 0.5), (1.0, 0.25)],
            }],
            Some(("ideal", 0.75)),
        );
        let svg = c.to_svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<rect").count(), 1 + 2 + 1);
        let png = c.to_png();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[png.len() - 8..png.len() - 4], b"IEND");
    }

    #[test]
    fn nice_axis_maxima() {
        assert_eq!(nice_max(0.37), 0.5);
        assert_eq!(nice_max(730.0), 1000.0);
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(2.0), 2.0);
    }
}
