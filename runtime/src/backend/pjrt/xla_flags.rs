//! `XLA_FLAGS`: the debug options XLA reads from the environment when a plugin starts.
//!
//! XLA plugins parse `XLA_FLAGS` once, when the client is created, and what it sets
//! (`--xla_backend_optimization_level=1`, `--xla_cpu_enable_fast_math=true`, …) changes the
//! code every later compile produces. Two things follow for nitro:
//!
//! - **The value is part of the backend identity** ([`BackendIdentity::xla_flags`]), so a
//!   program compiled under some flags is never served from the persistent cache to a process
//!   running under others.
//! - **It is checked before the plugin is loaded.** The plugin ends the process — exit status
//!   1, no message — on a token it cannot parse: an unknown flag, one dash instead of two,
//!   `--noflag`, a value of the wrong type. Nitro checks the shape of every token and that
//!   every flag name is one the plugin file contains, and refuses otherwise with
//!   [`Error::XlaFlags`] naming the token, so a typo is an error, not a silent exit. A value of
//!   the wrong type for a real flag (`--xla_backend_optimization_level=abc`) cannot be told
//!   apart without knowing each flag's type, and still ends the process inside XLA.
//!
//! [`BackendIdentity::xla_flags`]: super::BackendIdentity::xla_flags

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The environment variable XLA reads its debug options from.
pub const XLA_FLAGS_ENV: &str = "XLA_FLAGS";

/// The `XLA_FLAGS` value in effect, normalized: its tokens joined by one space (empty when the
/// variable is unset or blank). What XLA reads does not depend on the spacing, so neither does
/// the identity.
pub fn xla_flags_setting() -> String {
    normalize(&std::env::var(XLA_FLAGS_ENV).unwrap_or_default())
}

fn normalize(value: &str) -> String {
    value.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The flag name of one `XLA_FLAGS` token (`--name` or `--name=value`), or why XLA would not
/// parse it.
fn flag_name(token: &str) -> std::result::Result<&str, String> {
    let Some(rest) = token.strip_prefix("--") else {
        return Err(format!(
            "`{token}` does not start with `--`; write each flag as `--name=value`"
        ));
    };
    let name = rest.split_once('=').map_or(rest, |(name, _)| name);
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!(
            "`{token}` has no flag name XLA could read (lowercase letters, digits and `_`)"
        ));
    }
    if name == "flagfile" {
        return Err(format!(
            "`{token}`: nitro cannot check a flag file's contents; put the flags in XLA_FLAGS \
             itself"
        ));
    }
    Ok(name)
}

/// Checks `value` (an `XLA_FLAGS` setting) against the plugin file at `plugin`: every token
/// `--name` or `--name=value`, every name present in the file as a whole word (the plugin's
/// table of flag names is in it). [`Error::XlaFlags`] names the first token that fails.
///
/// Reads the plugin file once (a few tens of milliseconds for a 200 MB plugin); only called
/// when `XLA_FLAGS` is set.
pub fn check_xla_flags(plugin: &Path, value: &str) -> Result<()> {
    let refuse = |why: String| Error::XlaFlags {
        value: normalize(value),
        why,
    };
    let mut names = Vec::new();
    for token in value.split_whitespace() {
        let name = flag_name(token).map_err(refuse)?;
        names.push((token, name));
    }
    if names.is_empty() {
        return Ok(());
    }
    let found = find_words(plugin, names.iter().map(|(_, n)| *n)).map_err(|e| {
        refuse(format!(
            "the plugin file {} could not be read to check the flag names: {e}",
            plugin.display()
        ))
    })?;
    match names.iter().zip(&found).find(|(_, &f)| !f) {
        Some(((token, name), _)) => Err(refuse(format!(
            "`{token}`: the plugin {} has no flag `{name}` (check its spelling; flags differ \
             between XLA versions)",
            plugin.display()
        ))),
        None => Ok(()),
    }
}

/// Whether each of `words` occurs in the file as a whole word: not preceded or followed by a
/// letter, digit or `_`.
fn find_words<'a>(path: &Path, words: impl Iterator<Item = &'a str>) -> std::io::Result<Vec<bool>> {
    let finders: Vec<memchr::memmem::Finder<'_>> = words
        .map(|w| memchr::memmem::Finder::new(w.as_bytes()))
        .collect();
    let mut found = vec![false; finders.len()];
    let longest = finders.iter().map(|f| f.needle().len()).max().unwrap_or(0);
    // Chunks overlap by the longest word and one byte on each side, so no match (nor the
    // byte after it) is cut off at a chunk's end.
    let overlap = longest + 2;
    const CHUNK: usize = 8 << 20;
    let mut file = std::fs::File::open(path)?;
    let mut buffer = vec![0u8; CHUNK + overlap];
    let mut kept = 0;
    let mut at_start = true;
    loop {
        let read = file.read(&mut buffer[kept..])?;
        let end = kept + read;
        let last = read == 0;
        let window = &buffer[..end];
        for (finder, found) in finders.iter().zip(found.iter_mut()) {
            if *found {
                continue;
            }
            let len = finder.needle().len();
            *found = finder.find_iter(window).any(|at| {
                let before = at.checked_sub(1).map(|i| window[i]);
                let after = window.get(at + len).copied();
                // A match touching the window's end is judged in the next window, unless
                // this is the file's end.
                (after.is_some() || last)
                    && (before.is_some() || at_start)
                    && !before.is_some_and(is_word_byte)
                    && !after.is_some_and(is_word_byte)
            });
        }
        if last || found.iter().all(|&f| f) {
            return Ok(found);
        }
        let keep = overlap.min(end);
        buffer.copy_within(end - keep..end, 0);
        kept = keep;
        at_start = false;
    }
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin_with(contents: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "nitro-xla-flags-{}-{}",
            std::process::id(),
            blake3::hash(contents).to_hex()
        ));
        std::fs::write(&path, contents).unwrap();
        path
    }

    #[test]
    fn tokens_must_be_double_dashed_names_the_plugin_has() {
        let plugin = plugin_with(
            b"\x00xla_cpu_enable_fast_math\x00xla_backend_optimization_level\x00xla_cpu_multi_thread_eigenx",
        );
        for ok in [
            "",
            "  ",
            "--xla_cpu_enable_fast_math",
            " --xla_cpu_enable_fast_math=true   --xla_backend_optimization_level=1 ",
        ] {
            check_xla_flags(&plugin, ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        for (bad, names) in [
            ("--xla_bogus_flag=1", "`--xla_bogus_flag=1`: the plugin"),
            ("-xla_cpu_enable_fast_math=true", "does not start with `--`"),
            ("xla_cpu_enable_fast_math=true", "does not start with `--`"),
            ("--=1", "no flag name"),
            ("--Xla_cpu_enable_fast_math", "no flag name"),
            ("--flagfile=/tmp/f", "flag file"),
            // A prefix of a real flag is not that flag.
            ("--xla_cpu_enable_fast", "has no flag `xla_cpu_enable_fast`"),
            // Followed by a word byte in the file: not a whole word.
            ("--xla_cpu_multi_thread_eigen=false", "has no flag"),
            // The first bad token is named, after good ones.
            (
                "--xla_cpu_enable_fast_math=true --xla_typo=2",
                "`--xla_typo=2`",
            ),
        ] {
            let err = check_xla_flags(&plugin, bad).unwrap_err();
            assert!(matches!(err, Error::XlaFlags { .. }), "{err}");
            assert!(err.to_string().contains(names), "{bad}: {err}");
        }
        std::fs::remove_file(plugin).unwrap();
    }

    #[test]
    fn words_cut_by_a_chunk_boundary_are_found() {
        // The word straddles the first 8 MiB chunk's end, and another sits at the file's end.
        let mut contents = vec![0u8; (8 << 20) - 5];
        contents.extend_from_slice(b"xla_straddling_flag\x00");
        contents.extend_from_slice(&[7u8; 100]);
        contents.extend_from_slice(b"\x00xla_last");
        let plugin = plugin_with(&contents);
        let found = find_words(
            &plugin,
            ["xla_straddling_flag", "xla_last", "xla_absent"].into_iter(),
        )
        .unwrap();
        assert_eq!(found, [true, true, false]);
        std::fs::remove_file(plugin).unwrap();
    }
}
