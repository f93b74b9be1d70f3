//! The handwritten digits data set (`examples/data/digits.csv.gz`), loaded into host arrays.

use std::io::Read;
use std::path::Path;

use nitro::{Array, Digest};

/// Where the data set lives, relative to the workspace root.
pub const DIGITS_PATH: &str = "examples/data/digits.csv.gz";

/// The digits data set: `x` is `[rows, 64]` f32 pixels scaled to `0..=1`, `y` is `[rows]` i32
/// labels in `0..10`.
#[derive(Clone, Debug)]
pub struct Digits {
    /// Pixels, `[rows, 64]`, scaled by 1/16.
    pub x: Array,
    /// Labels, `[rows]`.
    pub y: Array,
    /// blake3 of the decompressed CSV: the data set's identity.
    pub digest: Digest,
}

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
        }
    }
}

impl std::error::Error for DataError {}

impl Digits {
    /// Loads the gzip-compressed CSV at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Digits, DataError> {
        let file = std::fs::File::open(path).map_err(DataError::Io)?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(DataError::Io)?;
        Digits::parse(&text)
    }

    /// Parses the decompressed CSV text.
    pub fn parse(text: &str) -> Result<Digits, DataError> {
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
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
            if !(0..=9).contains(&values[64]) {
                return Err(bad(format!("label {} is outside 0..=9", values[64])));
            }
            pixels.extend(values[..64].iter().map(|&p| p as f32 / 16.0));
            labels.push(values[64]);
        }
        let rows = labels.len();
        let x = Array::from_vec(&[rows, 64], pixels).map_err(|e| DataError::BadRow {
            line: 0,
            why: e.to_string(),
        })?;
        let y = Array::from_vec(&[rows], labels).map_err(|e| DataError::BadRow {
            line: 0,
            why: e.to_string(),
        })?;
        Ok(Digits {
            x,
            y,
            digest: Digest::from(blake3::hash(text.as_bytes())),
        })
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.y.len()
    }
}
