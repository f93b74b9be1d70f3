//! The handwritten digits data set (`examples/data/digits.csv.gz`), loaded into a
//! [`nitro::data::Dataset`].

use std::io::Read;
use std::path::Path;

use nitro::data::Dataset;
use nitro::Array;

/// Where the data set lives, relative to the workspace root.
pub const DIGITS_PATH: &str = "examples/data/digits.csv.gz";

/// The number of classes: the digits 0 to 9.
pub const CLASSES: usize = 10;

/// The loader of the digits data set. It produces a [`Dataset`] with two columns: `x`,
/// `f32[rows, 64]` pixels scaled to `0..=1`, and `y`, `i32[rows]` labels, checked to be in
/// `0..10` ([`Dataset::check_labels`]). The data set's identity is [`Dataset::digest`].
#[derive(Clone, Copy, Debug)]
pub struct Digits;

/// What can go wrong loading the data set.
#[derive(Debug)]
pub enum DataError {
    /// The file could not be read or decompressed.
    Io(std::io::Error),
    /// A line did not hold 64 pixels in 0..=16 and a label in 0..=9.
    BadRow {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        why: String,
    },
    /// The arrays could not be made into a data set.
    Data(nitro::Error),
}

impl std::fmt::Display for DataError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataError::Io(e) => write!(
                f,
                "cannot read the digits data set ({e}); run from the workspace root, where \
                 `{DIGITS_PATH}` lives"
            ),
            DataError::BadRow { line, why } => write!(f, "digits data set line {line}: {why}"),
            DataError::Data(e) => write!(f, "digits data set: {e}"),
        }
    }
}

impl std::error::Error for DataError {}

impl Digits {
    /// Loads the gzip-compressed CSV at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Dataset, DataError> {
        let file = std::fs::File::open(path).map_err(DataError::Io)?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(DataError::Io)?;
        Digits::parse(&text)
    }

    /// Parses the decompressed CSV text: one row per non-empty line, 64 pixels then the label.
    pub fn parse(text: &str) -> Result<Dataset, DataError> {
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
        let mut lines = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let bad = |why: String| DataError::BadRow { line: i + 1, why };
            let values: Vec<i32> = line
                .split(',')
                .map(|v| v.trim().parse::<i32>())
                .collect::<Result<_, _>>()
                .map_err(|e| bad(format!("not an integer: {e}")))?;
            if values.len() != 65 {
                return Err(bad(format!("expected 65 values, found {}", values.len())));
            }
            if let Some(p) = values[..64].iter().find(|p| !(0..=16).contains(*p)) {
                return Err(bad(format!("pixel {p} is outside 0..=16")));
            }
            pixels.extend(values[..64].iter().map(|&p| p as f32 / 16.0));
            labels.push(values[64]);
            lines.push(i + 1);
        }
        let rows = labels.len();
        let data = Dataset::new([
            (
                "x",
                Array::from_vec(&[rows, 64], pixels).map_err(DataError::Data)?,
            ),
            (
                "y",
                Array::from_vec(&[rows], labels).map_err(DataError::Data)?,
            ),
        ])
        .map_err(DataError::Data)?;
        // The label range is checked by the data set; its error names the row, and the row
        // names the line.
        match data.check_labels("y", CLASSES) {
            Ok(()) => Ok(data),
            Err(nitro::Error::LabelOutOfRange { row, value, .. }) => Err(DataError::BadRow {
                line: lines.get(row).copied().unwrap_or(0),
                why: format!("label {value} is outside 0..={}", CLASSES - 1),
            }),
            Err(e) => Err(DataError::Data(e)),
        }
    }
}
