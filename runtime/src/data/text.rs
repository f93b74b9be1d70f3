//! Character-level text for language models: a corpus, its character vocabulary, windows of
//! `T + 1` tokens as a data set (inputs and next-character targets), and the corpus's unigram
//! entropy — the bits per character a model must beat to have learned anything.
//!
//! [`fortunes`] reads the Debian package `fortunes` (`apt-get install fortunes`): plain-text
//! records separated by lines holding `%`, about 2.5 MB of English. Without it, the error names
//! the package.
//!
//! ```
//! use nitro::data::text::Vocab;
//! let v = Vocab::of("hello");
//! assert_eq!(v.len(), 4);
//! assert_eq!(v.decode(&v.encode("hell")?), "hell");
//! # Ok::<(), nitro::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::tree::Array;

/// Where the Debian package `fortunes` installs its files.
pub const FORTUNES_DIR: &str = "/usr/share/games/fortunes";

/// The text of the fortune files in `dir` (default [`FORTUNES_DIR`]), in file-name order, the
/// `%` separator lines removed (each record ends with a newline). The `.dat` index files and
/// the `.u8` links are skipped; bytes that are not UTF-8 are replaced.
pub fn fortunes(dir: Option<&Path>) -> Result<String> {
    Ok(fortune_records(dir)?.concat())
}

/// The records of the fortune files in `dir` (default [`FORTUNES_DIR`]), in file-name order:
/// each the lines between `%` separators, every line ending with a newline — documents of
/// varying length, for shape buckets ([`crate::data::buckets`]). [`fortunes`] is their
/// concatenation.
pub fn fortune_records(dir: Option<&Path>) -> Result<Vec<String>> {
    let dir = dir.map_or_else(|| PathBuf::from(FORTUNES_DIR), Path::to_path_buf);
    let entries = std::fs::read_dir(&dir).map_err(|e| {
        Error::data_file(
            &dir,
            format!(
                "cannot list it ({e}): install the Debian package `fortunes` (`apt-get install fortunes`), or pass the directory of the fortune files"
            ),
        )
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let ext = p.extension().and_then(|e| e.to_str());
            !matches!(ext, Some("dat") | Some("u8")) && p.is_file() && !p.is_symlink()
        })
        .collect();
    files.sort();
    let mut records = Vec::new();
    for f in &files {
        let bytes = Error::read_data_file(f)?;
        let mut record = String::new();
        for line in String::from_utf8_lossy(&bytes).lines() {
            if line == "%" {
                if !record.is_empty() {
                    records.push(std::mem::take(&mut record));
                }
            } else {
                record.push_str(line);
                record.push('\n');
            }
        }
        if !record.is_empty() {
            records.push(record);
        }
    }
    if records.is_empty() {
        return Err(Error::data_file(
            &dir,
            "it holds no fortune text: install the Debian package `fortunes`",
        ));
    }
    Ok(records)
}

/// A character vocabulary: every distinct character of a text, in code-point order, numbered
/// from 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    chars: Vec<char>,
    ids: BTreeMap<char, i32>,
}

impl Vocab {
    /// The characters of `text`.
    pub fn of(text: &str) -> Vocab {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as i32))
            .collect();
        Vocab { chars, ids }
    }

    /// How many characters.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The ids of `text`'s characters; a character outside the vocabulary is an
    /// [`Error::InvalidDataArgument`] naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<i32>> {
        text.chars()
            .map(|c| {
                self.ids
                    .get(&c)
                    .copied()
                    .ok_or_else(|| Error::InvalidDataArgument {
                        what: format!("the character {c:?} is not in the vocabulary"),
                    })
            })
            .collect()
    }

    /// The text of `ids` (an id outside the vocabulary reads as `?`).
    pub fn decode(&self, ids: &[i32]) -> String {
        ids.iter()
            .map(|&i| {
                usize::try_from(i)
                    .ok()
                    .and_then(|i| self.chars.get(i))
                    .copied()
                    .unwrap_or('?')
            })
            .collect()
    }
}

/// Windows of `window + 1` consecutive tokens, one every `stride` tokens, as a data set: `x`
/// (`i32 [n, window]`, the inputs) and `y` (`i32 [n, window]`, each position's next token).
///
/// [`Error::InvalidDataArgument`] when `window` or `stride` is 0, when there are not
/// `window + 1` tokens, or when the two columns would be over nitro's size limit
/// ([`MAX_TENSOR_BYTES`](crate::MAX_TENSOR_BYTES)); [`Error::OutOfMemory`] when their memory
/// cannot be reserved. Never an abort.
pub fn windows(tokens: &[i32], window: usize, stride: usize) -> Result<Dataset> {
    if window == 0 || stride == 0 || tokens.len() <= window {
        return Err(Error::InvalidDataArgument {
            what: format!(
                "windows of {window} tokens every {stride} need at least {} tokens and both at \
                 least 1, got {} tokens",
                window.saturating_add(1),
                tokens.len()
            ),
        });
    }
    let count = (tokens.len() - window - 1) / stride + 1;
    // Two columns of `count × window` i32s: checked against nitro's size limit and reserved
    // fallibly (overlapping windows of a large corpus multiply it by `window / stride`).
    let elems = count.checked_mul(window);
    let bytes = elems.and_then(|n| (n as u64).checked_mul(8));
    let too_large = || Error::InvalidDataArgument {
        what: format!(
            "{count} windows of {window} tokens (inputs and targets, i32) are over nitro's size \
             limit (nitro::MAX_TENSOR_BYTES); use a larger stride, a shorter window or less text"
        ),
    };
    let (Some(elems), Some(bytes)) = (elems, bytes) else {
        return Err(too_large());
    };
    if bytes > crate::MAX_TENSOR_BYTES {
        return Err(too_large());
    }
    let reserve = || -> Result<Vec<i32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(elems).map_err(|_| Error::OutOfMemory {
            what: format!("{count} windows of {window} tokens"),
            bytes,
        })?;
        Ok(v)
    };
    let (mut x, mut y) = (reserve()?, reserve()?);
    let starts = (0..count).map(|i| i * stride);
    for s in starts {
        x.extend_from_slice(&tokens[s..s + window]);
        y.extend_from_slice(&tokens[s + 1..s + window + 1]);
    }
    Dataset::new([
        ("x", Array::from_vec(&[count, window], x)?),
        ("y", Array::from_vec(&[count, window], y)?),
    ])
}

/// The unigram entropy of `tokens` in bits per token: what predicting each token from its
/// frequency alone achieves (`−Σ p log₂ p`).
pub fn unigram_bits(tokens: &[i32]) -> f64 {
    let mut counts: BTreeMap<i32, usize> = BTreeMap::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    let n = tokens.len().max(1) as f64;
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum()
}
