//! Environment settings, read strictly: a value nitro does not understand is an error naming the
//! variable, never silently ignored.
//!
//! Switches (`NITRO_CACHE`, `NITRO_VERIFY_KEYS`) accept `1 true yes on` and `0 false no off`, in
//! any case, with surrounding spaces ignored; an unset or empty variable takes the default.

use std::sync::Mutex;

use crate::error::{Error, Result};

/// The values a switch accepts, in words.
const SWITCH: &str =
    "expected one of 1, true, yes, on (enable) or 0, false, no, off (disable), in any case";

/// Reads the switch `variable`: `Ok(None)` when unset or empty.
pub fn switch(variable: &'static str) -> Result<Option<bool>> {
    match std::env::var(variable) {
        Ok(value) => parse_switch(variable, &value),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidSetting {
            variable,
            value: v.to_string_lossy().into_owned(),
            expected: SWITCH.into(),
        }),
    }
}

/// Parses `value` as the switch `variable`.
pub fn parse_switch(variable: &'static str, value: &str) -> Result<Option<bool>> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" => Ok(None),
        "1" | "true" | "yes" | "on" => Ok(Some(true)),
        "0" | "false" | "no" | "off" => Ok(Some(false)),
        _ => Err(Error::InvalidSetting {
            variable,
            value: value.to_owned(),
            expected: SWITCH.into(),
        }),
    }
}

/// Prints `message` to stderr once per process for each distinct `topic`: for defaults that
/// cannot be honoured, which a user must see even without a `tracing` subscriber.
pub fn notice_once(topic: &str, message: &str) {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.iter().any(|t| t == topic) {
        return;
    }
    seen.push(topic.to_owned());
    eprintln!("nitro: {message}");
    tracing::warn!("nitro: {message}");
}
