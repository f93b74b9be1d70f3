//! Sizes, durations and JSON values, in words.

use serde_json::Value;

/// Parses a size: bytes, or a number with a suffix K, M, G or T (powers of 1024; `KiB`, `KB`,
/// `k`, … accepted alike). `1.5G` is allowed.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "unknown unit `{other}`: write bytes, or a number with K, M, G or T (like 500M)"
            ))
        }
    };
    let value: f64 = number.parse().map_err(|_| {
        format!("`{text}` is not a size: write bytes, or a number with K, M, G or T (like 500M)")
    })?;
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// `1.2 KiB`, `340 B`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `12.5 ms`, `3.2 s`; `?` when unknown.
pub(crate) fn compile_ms(ms: Option<f64>) -> String {
    match ms {
        None => "?".to_owned(),
        Some(ms) if ms >= 1000.0 => format!("{:.1} s", ms / 1000.0),
        Some(ms) => format!("{ms:.1} ms"),
    }
}

/// How long before `now` the moment `then` was (seconds since the Unix epoch): `just now`,
/// `42 s ago`, `5 min ago`, `3 h ago`, `2 d ago`.
pub(crate) fn ago(now: u64, then: u64) -> String {
    let s = now.saturating_sub(then);
    match s {
        0 => "just now".to_owned(),
        1..=119 => format!("{s} s ago"),
        120..=7199 => format!("{} min ago", s / 60),
        7200..=172_799 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86_400),
    }
}

/// A JSON value as lines: a string as is; a list of `[name, value]` pairs one `name = value`
/// per line; a signature (`{"entries": [{"path", "kind"}, …]}`) one `path: f32[2,3]` per line;
/// anything else as compact JSON.
pub(crate) fn render_lines(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) if items.is_empty() => vec!["(none)".to_owned()],
        Value::Array(items) if items.iter().all(is_pair) => items
            .iter()
            .map(|p| format!("{} = {}", scalar(&p[0]), scalar(&p[1])))
            .collect(),
        Value::Object(o) => match o.get("entries").and_then(Value::as_array) {
            Some(entries) if o.len() == 1 && entries.iter().all(|e| e.get("path").is_some()) => {
                entries
                    .iter()
                    .map(|e| {
                        let path = e["path"].as_str().unwrap_or("?");
                        format!(
                            "{}: {}",
                            if path.is_empty() { "(root)" } else { path },
                            kind(&e["kind"])
                        )
                    })
                    .collect()
            }
            _ => vec![v.to_string()],
        },
        other => vec![other.to_string()],
    }
}

/// A signature entry's kind: `f32[64,128]` for a leaf, `seq 2`, or compact JSON.
fn kind(k: &Value) -> String {
    if let Some(leaf) = k.get("leaf") {
        let dims: Vec<String> = leaf["dims"]
            .as_array()
            .map(|d| d.iter().map(Value::to_string).collect())
            .unwrap_or_default();
        return format!("{}[{}]", scalar(&leaf["dtype"]), dims.join(","));
    }
    match k
        .as_object()
        .and_then(|o| o.iter().next().filter(|_| o.len() == 1))
    {
        Some((name, value)) => format!("{name} {}", scalar(value)),
        None => scalar(k),
    }
}

/// A string without quotes; anything else as compact JSON.
fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn is_pair(v: &Value) -> bool {
    matches!(v, Value::Array(p) if p.len() == 2 && p[0].is_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("2K"), Ok(2048));
        assert_eq!(parse_size("1.5 MiB"), Ok(1_572_864));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("M").is_err());
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(bytes(340), "340 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn pairs_print_as_assignments() {
        let v = serde_json::json!([["k", "abc"], ["w", "def"]]);
        assert_eq!(render_lines(&v), ["k = abc", "w = def"]);
        assert_eq!(render_lines(&serde_json::json!([])), ["(none)"]);
    }

    #[test]
    fn signatures_print_one_leaf_per_line() {
        let v = serde_json::json!({"entries": [
            {"kind": {"seq": 2}, "path": "layers"},
            {"kind": {"leaf": {"dims": [64, 128], "dtype": "f32"}}, "path": "layers[0].w"},
            {"kind": {"leaf": {"dims": [], "dtype": "f32"}}, "path": "lr"},
        ]});
        assert_eq!(
            render_lines(&v),
            ["layers: seq 2", "layers[0].w: f32[64,128]", "lr: f32[]"]
        );
    }
}
