//! Leaf-path patterns: the small language that names leaves by their paths — `*` any run of
//! characters, `|` alternatives — shared by [`AdamW::no_decay`](crate::optim::AdamW::no_decay),
//! [`Sharding::leaf`](crate::shard::Sharding::leaf) and the training handle's checks. It sits
//! below all of them and imports nothing of the crate.

/// Whether the leaf path `path` matches `pattern`: any of its `|`-separated alternatives, in
/// which `*` matches any run of characters (none included) and every other character itself.
///
/// ```
/// use nitro::pattern::path_match;
/// assert!(path_match("*.b", "blocks[0].fc1.b"));
/// assert!(path_match("*.b|*.gain", "norm.gain"));
/// assert!(!path_match("*.b", "blocks[0].fc1.w"));
/// ```
pub fn path_match(pattern: &str, path: &str) -> bool {
    pattern.split('|').any(|p| glob_match(p, path))
}

/// Whether `text` matches `pattern`, in which `*` matches any run of characters.
fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    // Greedy with backtracking to the last star: linear in practice, no recursion.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some((i, j));
            i += 1;
        } else if i < p.len() && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}
