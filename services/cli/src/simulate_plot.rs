//! `duplex simulate --plot`: the prediction tables as an SVG chart, drawn
//! as `duplex bench --plot` draws its own (plotters, SVG only): prefill
//! tokens/s against prompt length per placement, and decode tokens/s
//! against context per placement and batch.

use crate::simulate::{DecodePoint, PrefillPoint};
use anyhow::Result;
use plotters::prelude::*;
use std::path::Path;

const SIZE: (u32, u32) = (1200, 460);
const COLORS: [RGBColor; 6] = [RGBColor(0x4c, 0x72, 0xb0), RGBColor(0xdd, 0x84, 0x52), RGBColor(0x55, 0xa8, 0x68), RGBColor(0xc4, 0x4e, 0x52), RGBColor(0x81, 0x72, 0xb3), RGBColor(0x93, 0x78, 0x60)];

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A placement's TTFT at one point of the sweep, if it ran.
type TtftOf = fn(&PrefillPoint) -> Option<std::time::Duration>;

/// A named line of `(x, y)` points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

pub fn write(path: &Path, title: &str, prefill: &[PrefillPoint], decode: &[DecodePoint]) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let panels = root.split_evenly((1, 2));
    let rate = |tokens: usize, t: std::time::Duration| tokens as f64 / t.as_secs_f64().max(1e-12);
    let placements: [(&str, TtftOf); 3] = [("CPU", |p| Some(p.cpu)), ("SLP, 1 device", |p| p.slp), ("DSLP", |p| p.dslp)];
    let prefill_series: Vec<Series> = placements
        .iter()
        .map(|(name, of)| Series { name: name.to_string(), points: prefill.iter().filter_map(|p| of(p).map(|t| (p.tokens as f64, rate(p.tokens, t)))).collect() })
        .filter(|s| !s.points.is_empty())
        .collect();
    lines(&panels[0], "prefill: prompt tokens/s", "prompt tokens", &prefill_series)?;
    let mut batches: Vec<usize> = decode.iter().map(|d| d.batch).collect();
    batches.dedup();
    batches.sort_unstable();
    batches.dedup();
    let mut decode_series = vec![];
    for &b in &batches {
        let of = |d: &&DecodePoint| d.batch == b;
        decode_series.push(Series { name: format!("CPU, batch {b}"), points: decode.iter().filter(of).map(|d| (d.context as f64, d.cpu)).collect() });
        let hybrid: Vec<(f64, f64)> = decode.iter().filter(of).filter_map(|d| d.hybrid.map(|h| (d.context as f64, h))).collect();
        if !hybrid.is_empty() {
            decode_series.push(Series { name: format!("hybrid, batch {b}"), points: hybrid });
        }
    }
    lines(&panels[1], "decode: tokens/s (all sequences)", "context", &decode_series)?;
    root.present()?;
    Ok(())
}

/// Lines on a log-x chart, with a legend.
fn lines(area: &Area, title: &str, x_label: &str, series: &[Series]) -> Result<()> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_min, x_max) = xs.fold((f64::MAX, 1.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let y_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(1e-9f64, f64::max) * 1.15;
    let (x_min, x_max) = if x_min >= x_max { (x_min.min(1.0), x_max * 2.0) } else { (x_min, x_max) };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(14)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d((x_min * 0.9..x_max * 1.1).log_scale(), 0.0..y_max)?;
    chart.configure_mesh().x_desc(x_label).y_desc("tokens/s").draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)).point_size(3))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::UpperLeft).draw()?;
    Ok(())
}
