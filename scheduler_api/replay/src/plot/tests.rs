use super::*;

fn bars(values: &[f64]) -> BarChart {
    let rows = values
        .iter()
        .enumerate()
        .map(|(i, &v)| BarRow {
            label: format!("config-{i}"),
            values: vec![v],
            note: format!("{v:.4}"),
        })
        .collect();
    let (axis_start, axis_end) = ratio_axis(values.iter().copied(), 0.95);
    BarChart {
        title: "token hit ratio per configuration".into(),
        axis: "token hit ratio".into(),
        series: vec!["hit on device".into()],
        rows,
        stacked: true,
        reference: Some(("ideal, infinite cache".into(), 0.95)),
        axis_start,
        axis_end,
    }
}

#[test]
fn charts_render_to_svg_and_png_with_lower_case_text() {
    let c = Chart::Bars(bars(&[0.88, 0.91]));
    let svg = c.to_svg("hit_ratio").unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for label in [
        "hit on device",
        "ideal, infinite cache",
        "config-1",
        "0.9100",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    let png = c.to_png("hit_ratio").unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[png.len() - 8..png.len() - 4], b"IEND");
}

#[test]
fn high_ratios_get_an_axis_that_does_not_start_at_zero() {
    let (start, end) = ratio_axis([0.88, 0.91].into_iter(), 0.93);
    assert!(start > 0.5 && start <= 0.88, "{start}");
    assert!((0.93..=1.0).contains(&end), "{end}");
    // 0.88 and 0.91 differ by at least a fifth of the axis.
    assert!((0.91 - 0.88) / (end - start) > 0.2, "{start}..{end}");
    // Low ratios keep zero.
    assert_eq!(ratio_axis([0.05, 0.06].into_iter(), 0.37).0, 0.0);
    assert_eq!(ratio_axis(std::iter::empty(), 0.0), (0.0, 1.0));
}

#[test]
fn moving_average_smooths_and_ends_with_the_data() {
    let samples: Vec<OccupancySample> = (0..10)
        .map(|i| OccupancySample {
            t_s: f64::from(i),
            in_use: if i % 2 == 0 { 1.0 } else { 0.0 },
            cached: 0.0,
            ..Default::default()
        })
        .collect();
    let avg = moving_average(&samples, 2, |o| o.in_use);
    assert_eq!(avg.len(), 10);
    assert_eq!(avg.last().unwrap().0, 9.0);
    assert!(
        avg[1..].iter().all(|p| (p.1 - 0.5).abs() < 1e-12),
        "{avg:?}"
    );
    assert_eq!(moving_average(&samples, 0, |o| o.in_use)[3].1, 0.0);
}

#[test]
fn alike_curves_are_drawn_once_and_named_for_the_others() {
    let curve = |name: &str, level: f64| Series {
        name: name.into(),
        points: (0..50).map(|i| (f64::from(i), level)).collect(),
    };
    let lines = distinct_lines(vec![
        curve("a", 0.5),
        curve("b", 0.503),
        curve("c", 0.1),
        curve("d", 0.5),
    ]);
    let names: Vec<&str> = lines.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a (+2 alike)", "c"]);
    let many: Vec<Series> = (0..9)
        .map(|i| curve(&format!("s{i}"), 0.1 * f64::from(i)))
        .collect();
    let lines = distinct_lines(many);
    assert_eq!(lines.len(), MAX_LINES);
    assert!(lines[MAX_LINES - 1].name.ends_with("3 more not drawn"));
}

#[test]
fn bars_start_at_zero_and_are_clipped_to_a_shifted_axis() {
    let mut b = bars(&[0.88, 0.91]);
    b.axis_start = 0.6;
    b.axis_end = 0.95;
    // Device 0.7 then host 0.2: the device part shows from the axis start, the host part
    // from 0.7 to 0.9.
    let s = draw::spans(&b, &[0.7, 0.2]);
    assert!(
        (s[0].0 - 0.6).abs() < 1e-12 && (s[0].1 - 0.7).abs() < 1e-12,
        "{s:?}"
    );
    assert!(
        (s[1].0 - 0.7).abs() < 1e-12 && (s[1].1 - 0.9).abs() < 1e-12,
        "{s:?}"
    );
    // A bar below the axis start has no length.
    assert_eq!(draw::spans(&b, &[0.0])[0].0, draw::spans(&b, &[0.0])[0].1);
    b.stacked = false;
    let s = draw::spans(&b, &[0.9, 0.7]);
    assert!(s[1].1 < s[0].1 && s[1].2 < s[0].2, "{s:?}");
}

#[test]
fn a_single_run_reads_its_hit_ratio_against_the_whole_scale() {
    let mut r = Report {
        config: "radix-lru".into(),
        ..Default::default()
    };
    r.hit_ratio.overall = 0.8893;
    r.hit_ratio.device = 0.8893;
    let c = hit_ratio_chart(&[&r], 0.9123);
    assert_eq!((c.axis_start, c.axis_end), (0.0, 1.0));
    assert!(!c.axis.contains("not 0"), "{}", c.axis);
    assert!(c.title.contains("radix-lru"), "{}", c.title);
    // Two close runs still get the zoomed axis that tells them apart.
    let mut s = r.clone();
    s.hit_ratio.overall = 0.91;
    s.hit_ratio.device = 0.91;
    let c = hit_ratio_chart(&[&s, &r], 0.9123);
    assert!(c.axis_start > 0.5, "{}", c.axis_start);
    assert!(c.axis.contains("not 0"), "{}", c.axis);
}

fn hybrid_report(config: &str, usable: f64, matched: f64) -> Report {
    let mut r = Report {
        config: config.into(),
        mamba: Some(crate::sim::MambaReport {
            policy: "marconi",
            slots: 8,
            ..Default::default()
        }),
        prefill_flops: Some(crate::sim::PrefillFlops {
            prompt: 4.0e18,
            saved: 4.0e18 * usable,
        }),
        kv_match_ratio: matched,
        occupancy: (0..100)
            .map(|i| OccupancySample {
                t_s: f64::from(i),
                in_use: 0.5,
                cached: 0.3,
                mamba_in_use: Some(0.2),
                mamba_cached: Some(0.1 + usable / 2.0),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    r.hit_ratio.overall = usable;
    r.hit_ratio.device = usable;
    r
}

fn svg_of(charts: &[(&str, Chart)], name: &str) -> String {
    let (_, c) = charts
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no {name} chart"));
    let svg = c.to_svg(name).unwrap();
    let png = c.to_png(name).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}.png");
    svg
}

#[test]
fn a_hybrid_run_adds_the_pool_usable_hit_and_flops_charts() {
    let r = hybrid_report("radix-lru+mamba-marconi", 0.82, 0.91);
    let charts = report_charts(&[&r]);
    let names: Vec<&str> = charts.iter().map(|c| c.0).collect();
    assert_eq!(
        names,
        [
            "hit_ratio",
            "ttft",
            "occupancy",
            "pools",
            "usable_hit",
            "flops_saved"
        ]
    );
    let pools = svg_of(&charts, "pools");
    for label in [
        "occupancy per pool",
        "KV pages in use",
        "KV pages cached",
        "Mamba slots in use",
        "Mamba slots cached",
        "fraction of each pool",
        "simulated time (s)",
    ] {
        assert!(pools.contains(label), "pools: {label} missing");
    }
    assert!(!pools.contains("SWA"), "a pool the model lacks is drawn");
    let usable = svg_of(&charts, "usable_hit");
    for label in [
        "KV match",
        "usable hit (ends at a cached Mamba state)",
        "0.8200 of 0.9100",
        "ideal, infinite cache",
    ] {
        assert!(usable.contains(label), "usable_hit: {label} missing");
    }
    let flops = svg_of(&charts, "flops_saved");
    for label in ["prefill FLOPs saved", "82.0 %", "radix-lru+mamba-marconi"] {
        assert!(flops.contains(label), "flops_saved: {label} missing");
    }
    // The KV match bar is the longer one, the usable hit inside it.
    let Chart::Bars(b) = &charts[4].1 else {
        panic!("bars expected")
    };
    assert_eq!(b.rows[0].values, [0.91, 0.82]);
    assert!(!b.stacked);
}

#[test]
fn a_comparison_draws_the_cached_states_of_each_configuration() {
    let a = hybrid_report("radix-lru+mamba-marconi", 0.82, 0.91);
    let b = hybrid_report("radix-lru+mamba-sglang", 0.40, 0.91);
    let charts = report_charts(&[&b, &a]);
    let Some((_, Chart::Lines(pools))) = charts.iter().find(|c| c.0 == "pools") else {
        panic!("no pools chart")
    };
    let names: Vec<&str> = pools.series.iter().map(|s| s.name.as_str()).collect();
    // Best first, as in the hit-ratio chart.
    assert_eq!(
        names,
        [
            "radix-lru+mamba-marconi: Mamba slots cached",
            "radix-lru+mamba-sglang: Mamba slots cached"
        ]
    );
    let flops = svg_of(&charts, "flops_saved");
    assert!(flops.contains("40.0 %") && flops.contains("82.0 %"));
}

#[test]
fn a_model_without_extra_pools_gets_no_hybrid_chart() {
    let r = Report {
        config: "radix-lru".into(),
        prefill_flops: Some(crate::sim::PrefillFlops {
            prompt: 1.0,
            saved: 0.5,
        }),
        ..Default::default()
    };
    let names: Vec<&str> = report_charts(&[&r]).iter().map(|c| c.0).collect();
    assert_eq!(names, ["hit_ratio", "ttft", "occupancy"]);
}
