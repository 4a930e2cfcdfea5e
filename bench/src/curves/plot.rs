//! Log-log line plots, drawn as SVG text with plotters' SVG backend.

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::{
    BLACK, ChartBuilder, Circle, Color, DashedLineSeries, DrawingArea, IntoDrawingArea, IntoFont,
    IntoLogRange, LineSeries, PathElement, RGBColor, SVGBackend, Text, TextStyle, WHITE,
};
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::nodeproxy::thousands;

/// One line of a plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: RGBColor,
    /// Dashed instead of solid: another kind of the same quantity, or a bound.
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{0}: nothing to plot (no point above zero on both axes)")]
    Empty(String),
    #[error("drawing {title}: {message}")]
    Draw { title: String, message: String },
}

/// Width and height in pixels.
const SIZE: (u32, u32) = (980, 520);
/// Width of the chart; the legend takes the rest, beside it, so it never hides a line.
const CHART_WIDTH: u32 = 700;
/// Room around the points, as a factor on the log axes.
const X_MARGIN: f64 = 1.25;
const Y_MARGIN: f64 = 2.0;

/// Colours that stay apart for most readers (the first of matplotlib's "tab10").
pub const BLUE: RGBColor = RGBColor(31, 119, 180);
pub const ORANGE: RGBColor = RGBColor(255, 127, 14);
pub const GREEN: RGBColor = RGBColor(44, 160, 44);
pub const GREY: RGBColor = RGBColor(127, 127, 127);

/// The plot as an SVG document, both axes logarithmic.
pub fn svg(plot: &Plot) -> Result<String, PlotError> {
    let (x, y) = ranges(plot).ok_or_else(|| PlotError::Empty(plot.title.clone()))?;
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        draw(&root, plot, x, y).map_err(|error| PlotError::Draw {
            title: plot.title.clone(),
            message: error.to_string(),
        })?;
    }
    Ok(text)
}

type Range = std::ops::Range<f64>;

/// The axes' ranges: every positive point, with some room around.
fn ranges(plot: &Plot) -> Option<(Range, Range)> {
    let points: Vec<(f64, f64)> = plot
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&(x, y)| x > 0.0 && y > 0.0)
        .collect();
    let span = |values: Vec<f64>, margin: f64| {
        let low = values.iter().copied().reduce(f64::min)?;
        let high = values.iter().copied().reduce(f64::max)?;
        Some(low / margin..high * margin)
    };
    Some((
        span(points.iter().map(|p| p.0).collect(), X_MARGIN)?,
        span(points.iter().map(|p| p.1).collect(), Y_MARGIN)?,
    ))
}

fn draw(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    plot: &Plot,
    x: Range,
    y: Range,
) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let (chart_area, legend_area) = root.split_horizontally(CHART_WIDTH);
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(&plot.title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x.log_scale(), y.log_scale())?;
    chart
        .configure_mesh()
        .x_desc(&plot.x_label)
        .y_desc(&plot.y_label)
        .x_label_formatter(&|v| number(*v))
        .y_label_formatter(&|v| number(*v))
        .label_style(("sans-serif", 13))
        .light_line_style(BLACK.mix(0.04))
        .draw()?;
    for (index, series) in plot.series.iter().enumerate() {
        let color = series.color;
        let line = color.stroke_width(2);
        let points = series.points.iter().copied();
        // The legend entry: a sample of the line, and the label.
        let y = 60 + 24 * i32::try_from(index)?;
        let sample = vec![(8, y), (40, y)];
        if series.dashed {
            chart.draw_series(DashedLineSeries::new(points, 8, 5, line))?;
            legend_area.draw(&DashedPathElement::new(sample, 6, 4, line))?;
        } else {
            chart.draw_series(LineSeries::new(points, line))?;
            legend_area.draw(&PathElement::new(sample, line))?;
        }
        chart.draw_series(
            series
                .points
                .iter()
                .map(|&point| Circle::new(point, 3, color.filled())),
        )?;
        legend_area.draw(&Circle::new((24, y), 3, color.filled()))?;
        legend_area.draw(&Text::new(
            series.label.as_str(),
            (50, y),
            TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    root.present()?;
    Ok(())
}

/// A tick label: `1,000` from one up, `0.05` below (as many decimals as the first digit
/// needs).
fn number(value: f64) -> String {
    if value >= 1.0 {
        return thousands(value.round() as usize);
    }
    let decimals = (-value.log10().floor()).clamp(1.0, 9.0) as usize;
    let text = format!("{value:.decimals$}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, dashed: bool, points: &[(f64, f64)]) -> Series {
        Series {
            label: label.into(),
            color: BLUE,
            dashed,
            points: points.to_vec(),
        }
    }

    #[test]
    fn a_plot_is_an_svg_with_its_title_axes_and_every_series() {
        let text = svg(&Plot {
            title: "one endpoint added".into(),
            x_label: "Services".into(),
            y_label: "ms".into(),
            series: vec![
                series("solid one", false, &[(100.0, 0.2), (10_000.0, 450.0)]),
                series("dashed one", true, &[(100.0, 0.3), (2_700.0, 140.0)]),
            ],
        })
        .unwrap();
        assert!(text.starts_with("<svg"), "{text}");
        assert!(text.trim_end().ends_with("</svg>"));
        for expected in [
            "one endpoint added",
            "Services",
            "ms",
            "solid one",
            "dashed one",
            "1,000",
        ] {
            assert!(text.contains(expected), "{expected} missing");
        }
        // A marker on each of the four points, and one in each legend entry.
        assert_eq!(text.matches("<circle").count(), 4 + 2);
    }

    #[test]
    fn nothing_above_zero_is_an_error() {
        let empty = Plot {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![series("zero", false, &[(0.0, 1.0), (10.0, 0.0)])],
        };
        assert!(matches!(svg(&empty), Err(PlotError::Empty(_))));
    }

    #[test]
    fn tick_labels_read_like_numbers() {
        assert_eq!(number(10_000.0), "10,000");
        assert_eq!(number(1.0), "1");
        assert_eq!(number(0.5), "0.5");
        assert_eq!(number(0.05), "0.05");
        assert_eq!(number(0.000_2), "0.0002");
    }
}
