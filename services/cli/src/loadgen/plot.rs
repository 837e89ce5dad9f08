//! `duplex bench --plot`: an SVG chart. For the scenarios, bars of each
//! kind's slowdown against its solo baseline, annotated with the absolute
//! mean, as the paper's Figure 18 draws them; for an open-loop run, the
//! distributions (CDFs) of TTFT, TPOT and end-to-end latency.

use super::report::{ms, KindReport, Report, RunReport, Stats, Workload};
use anyhow::Result;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const SIZE: (u32, u32) = (1200, 420);
const P_COLOR: RGBColor = RGBColor(0x4c, 0x72, 0xb0);
const D_COLOR: RGBColor = RGBColor(0xdd, 0x84, 0x52);
const OPEN_COLOR: RGBColor = RGBColor(0x55, 0xa8, 0x68);

fn color(kind: &str) -> RGBColor {
    match kind {
        "P" => P_COLOR,
        "D" => D_COLOR,
        _ => OPEN_COLOR,
    }
}

pub fn write(path: &Path, report: &Report) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    match report.workload {
        Workload::Closed(_) => {
            let pick = |kind: &'static str, metric: fn(&KindReport) -> (Option<f64>, Option<Stats>)| {
                move |run: &RunReport| -> Vec<Bar> { run.kind(kind).map(|k| Bar::of(k, metric)).into_iter().flatten().collect() }
            };
            let ttft = pick("P", |k| (k.slowdown.as_ref().and_then(|s| s.ttft), k.ttft_ms));
            let tpot = pick("D", |k| (k.slowdown.as_ref().and_then(|s| s.tpot), k.tpot_ms));
            let e2e = |run: &RunReport| -> Vec<Bar> {
                run.kinds.iter().filter_map(|k| Bar::of(k, |k| (k.slowdown.as_ref().and_then(|s| s.e2e), k.e2e_ms))).collect()
            };
            bars(&panels[0], "P: mean TTFT vs 1P", &report.runs, ttft)?;
            bars(&panels[1], "D: mean TPOT vs 1D", &report.runs, tpot)?;
            bars(&panels[2], "e2e latency vs solo (P blue, D orange)", &report.runs, e2e)?;
        }
        Workload::Open(_) | Workload::Chat(_) => {
            let samples: Vec<_> = report.runs.iter().flat_map(|r| &r.samples).filter(|s| s.error.is_none()).collect();
            cdf(&panels[0], "TTFT (ms)", samples.iter().filter_map(|s| s.ttft_ms).collect())?;
            cdf(&panels[1], "TPOT per request (ms)", samples.iter().filter_map(|s| s.tpot_ms).collect())?;
            cdf(&panels[2], "end-to-end latency (ms)", samples.iter().map(|s| s.e2e_ms).collect())?;
        }
    }
    root.present()?;
    Ok(())
}

/// One bar: a kind's slowdown, labelled with its absolute mean.
struct Bar {
    kind: String,
    ratio: f64,
    label: String,
}

impl Bar {
    fn of(k: &KindReport, metric: fn(&KindReport) -> (Option<f64>, Option<Stats>)) -> Option<Bar> {
        let (ratio, stats) = metric(k);
        let (ratio, stats) = (ratio?, stats?);
        Some(Bar { kind: k.kind.clone(), ratio, label: format!("{} ms", ms(stats.mean)) })
    }
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// Groups of bars, one group per run that has any.
fn bars(area: &Area, title: &str, runs: &[RunReport], bars_of: impl Fn(&RunReport) -> Vec<Bar>) -> Result<()> {
    let groups: Vec<(&str, Vec<Bar>)> = runs.iter().map(|r| (r.name.as_str(), bars_of(r))).filter(|(_, b)| !b.is_empty()).collect();
    let n = groups.len().max(1) as f64;
    let top = groups.iter().flat_map(|(_, b)| b.iter().map(|b| b.ratio)).fold(1.0f64, f64::max) * 1.25;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(44)
        .build_cartesian_2d(0.0..n, 0.0..top)?;
    // Category names are drawn under their groups below; a numeric axis has no place for them.
    chart.configure_mesh().disable_x_mesh().x_labels(0).y_desc("slowdown (×)").y_label_formatter(&|y| format!("{y:.1}")).draw()?;
    let (base_x, base_y) = area.get_base_pixel();
    let name_style = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, (name, _)) in groups.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        area.draw(&Text::new(name.to_string(), (x - base_x, y - base_y + 6), name_style.clone()))?;
    }
    // The baseline.
    chart.draw_series(LineSeries::new([(0.0, 1.0), (n, 1.0)], BLACK.mix(0.4)))?;
    let label_style = TextStyle::from(("sans-serif", 11).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (i, (_, group)) in groups.iter().enumerate() {
        let width = 0.7 / group.len() as f64;
        for (j, bar) in group.iter().enumerate() {
            let x0 = i as f64 + 0.15 + j as f64 * width;
            chart.draw_series([Rectangle::new([(x0, 0.0), (x0 + width * 0.9, bar.ratio)], color(&bar.kind).filled())])?;
            chart.draw_series([Text::new(bar.label.clone(), (x0 + width * 0.45, bar.ratio), label_style.clone())])?;
        }
    }
    Ok(())
}

/// The empirical CDF of `values`.
fn cdf(area: &Area, title: &str, mut values: Vec<f64>) -> Result<()> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    let right = values.last().copied().unwrap_or(1.0).max(1e-3) * 1.05;
    let mut chart = ChartBuilder::on(area)
        .caption(if values.is_empty() { format!("{title}: no data") } else { title.to_string() }, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(44)
        .build_cartesian_2d(0.0..right, 0.0..1.0)?;
    let decimals = if right >= 10.0 { 0 } else { 1 };
    chart.configure_mesh().x_labels(6).x_label_formatter(&|x| format!("{x:.decimals$}")).y_desc("fraction of requests").draw()?;
    let n = values.len() as f64;
    // A step function: each value lifts the curve by 1/n.
    let steps = values.iter().enumerate().flat_map(|(i, &v)| [(v, i as f64 / n), (v, (i + 1) as f64 / n)]);
    chart.draw_series(LineSeries::new(steps, OPEN_COLOR.stroke_width(2)))?;
    Ok(())
}
