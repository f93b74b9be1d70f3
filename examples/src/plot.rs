//! Training curves as a PNG: loss per epoch (training, and validation when there is one) above,
//! validation accuracy per epoch below.
//!
//! Drawn with `plotters` on a bitmap, with the DejaVu Sans font embedded (no system fonts
//! needed).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Once;

use nitro::train::History;
use plotters::prelude::*;
use plotters::style::FontStyle;

/// The picture's size in pixels.
const SIZE: (u32, u32) = (900, 720);

/// Why a plot could not be drawn or written.
#[derive(Debug)]
pub struct PlotError {
    path: PathBuf,
    problem: String,
}

impl fmt::Display for PlotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot write the plot to `{}`: {}",
            self.path.display(),
            self.problem
        )
    }
}

impl std::error::Error for PlotError {}

impl PlotError {
    fn new(path: &Path, problem: impl fmt::Display) -> PlotError {
        PlotError {
            path: path.to_owned(),
            problem: problem.to_string(),
        }
    }
}

/// Checks, before any work is done, that a plot can be written to `path`: it names a `.png`
/// file in an existing directory, and is not a directory itself. (Nothing is created.)
pub fn check_path(path: &Path) -> Result<(), PlotError> {
    let png = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        return Err(PlotError::new(
            path,
            "the file name must end in `.png` (the plot is a PNG image)",
        ));
    }
    if path.is_dir() {
        return Err(PlotError::new(path, "it is a directory"));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(PlotError::new(
            path,
            format!(
                "the directory `{}` does not exist (it is not created)",
                parent.display()
            ),
        ));
    }
    Ok(())
}

/// Registers the embedded DejaVu Sans as the `sans-serif` family, once per process.
fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The embedded font is a valid TrueType file: registering it cannot fail.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

/// Draws `history` to the PNG file `path` under the caption `title`: training and validation
/// loss per epoch in the upper panel, validation accuracy (%) per epoch in the lower one, each
/// with a legend. An error names the path and what went wrong (a missing directory, a file
/// that cannot be written, an empty history).
pub fn training_curves(history: &History, title: &str, path: &Path) -> Result<(), PlotError> {
    check_path(path)?;
    if history.epochs.is_empty() {
        return Err(PlotError::new(path, "the history has no epochs to draw"));
    }
    register_font();
    draw(history, title, path).map_err(|e| PlotError::new(path, e))?;
    Ok(())
}

/// The x range: the epochs, with half an epoch of room on each side.
fn epoch_range(history: &History) -> std::ops::Range<f64> {
    let last = history.epochs.iter().map(|e| e.epoch).max().unwrap_or(1);
    0.5..last as f64 + 0.5
}

/// A range from `lo` to `hi` with a margin of 5% (or ±0.5 when they are equal).
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let span = hi - lo;
    if span.abs() < 1e-12 || !span.is_finite() {
        return lo - 0.5..hi + 0.5;
    }
    lo - 0.05 * span..hi + 0.05 * span
}

fn draw(history: &History, title: &str, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 26))?;
    let (upper, lower) = root.split_vertically(SIZE.1 as f64 * 0.5);
    let x = epoch_range(history);
    let x_labels = history.epochs.len().min(12);

    // Upper panel: losses.
    let train: Vec<(f64, f64)> = history
        .epochs
        .iter()
        .map(|e| (e.epoch as f64, e.train_loss))
        .collect();
    let val: Vec<(f64, f64)> = history
        .epochs
        .iter()
        .filter_map(|e| Some((e.epoch as f64, e.val_loss?)))
        .collect();
    let (lo, hi) = train
        .iter()
        .chain(&val)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, y)| {
            (lo.min(y), hi.max(y))
        });
    let mut chart = ChartBuilder::on(&upper)
        .caption("loss", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x.clone(), padded(lo.min(0.0), hi))?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("mean cross-entropy")
        .x_labels(x_labels)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    chart
        .draw_series(LineSeries::new(train, blue.stroke_width(2)).point_size(3))?
        .label("training loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val, orange.stroke_width(2)).point_size(3))?
            .label("validation loss")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], orange.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    // Lower panel: validation accuracy, in percent.
    let accuracy: Vec<(f64, f64)> = history
        .epochs
        .iter()
        .filter_map(|e| Some((e.epoch as f64, 100.0 * e.val_accuracy?)))
        .collect();
    let (lo, hi) = accuracy
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, y)| {
            (lo.min(y), hi.max(y))
        });
    let y = if accuracy.is_empty() {
        0.0..100.0
    } else {
        let r = padded(lo, hi);
        r.start.max(0.0)..r.end.min(100.0)
    };
    let mut chart = ChartBuilder::on(&lower)
        .caption("validation accuracy", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("accuracy (%)")
        .x_labels(x_labels)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    let green = RGBColor(44, 160, 44);
    if accuracy.is_empty() {
        lower.draw(&Text::new(
            "no validation set: no accuracy to draw",
            (SIZE.0 as i32 / 3, SIZE.1 as i32 / 5),
            ("sans-serif", 16),
        ))?;
    } else {
        chart
            .draw_series(LineSeries::new(accuracy, green.stroke_width(2)).point_size(3))?
            .label("validation accuracy")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], green.stroke_width(2))
            });
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nitro::train::EpochRecord;

    fn history(epochs: usize, validated: bool) -> History {
        History {
            epochs: (1..=epochs)
                .map(|e| EpochRecord {
                    epoch: e,
                    train_loss: 2.0 / e as f64,
                    val_loss: validated.then_some(2.2 / e as f64),
                    val_accuracy: validated.then_some(1.0 - 0.5 / e as f64),
                    metrics: Vec::new(),
                    steps: 45,
                    step_us_median: 40.0,
                    step_us_pipelined: 20.0,
                    step_us_median_saving: None,
                    seconds: 0.1,
                })
                .collect(),
        }
    }

    /// A fresh directory for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("nitro-examples-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    #[test]
    fn writes_a_png_with_and_without_validation() {
        let dir = scratch("png");
        for (epochs, validated) in [(5, true), (1, true), (3, false)] {
            let path = dir.join(format!("curves-{epochs}-{validated}.png"));
            training_curves(&history(epochs, validated), "test", &path).expect("plotted");
            let bytes = std::fs::read(&path).expect("the file exists");
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG signature");
            // The IHDR chunk holds the width and height, big-endian.
            let width = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes"));
            let height = u32::from_be_bytes(bytes[20..24].try_into().expect("4 bytes"));
            assert_eq!((width, height), SIZE);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn refuses_paths_it_cannot_write() {
        let dir = scratch("refuse");
        let missing = dir.join("no-such-dir").join("curves.png");
        let e = training_curves(&history(2, true), "t", &missing).expect_err("no directory");
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert!(!missing.exists());

        let not_png = dir.join("curves.jpg");
        let e = training_curves(&history(2, true), "t", &not_png).expect_err("not a png");
        assert!(e.to_string().contains(".png"), "{e}");

        let as_dir = dir.join("adir.png");
        std::fs::create_dir(&as_dir).expect("a directory");
        let e = training_curves(&history(2, true), "t", &as_dir).expect_err("a directory");
        assert!(e.to_string().contains("directory"), "{e}");

        let empty = dir.join("empty.png");
        let e = training_curves(&History::default(), "t", &empty).expect_err("nothing to draw");
        assert!(e.to_string().contains("no epochs"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
