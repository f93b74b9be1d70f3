//! Fallible allocation: every buffer the interpreter makes is reserved with `try_reserve`, so a
//! value too large for the memory at hand is an [`Error::OutOfMemory`](crate::Error) naming the
//! node, never an abort.

use super::Fault;

/// An empty vector with room for exactly `n` elements, or [`Fault::Alloc`].
pub(crate) fn with_capacity<T>(n: usize) -> Result<Vec<T>, Fault> {
    let mut v = Vec::new();
    match v.try_reserve_exact(n) {
        Ok(()) => Ok(v),
        Err(_) => Err(Fault::Alloc {
            bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        }),
    }
}

/// The `n` elements of `items` in a vector allocated fallibly (`items` yields at most `n`, so
/// the vector never grows past what was reserved).
pub(crate) fn collect<T>(n: usize, items: impl IntoIterator<Item = T>) -> Result<Vec<T>, Fault> {
    let mut v = with_capacity(n)?;
    v.extend(items.into_iter().take(n));
    Ok(v)
}

/// `n` copies of `value`, allocated fallibly.
pub(crate) fn filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, Fault> {
    let mut v = with_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}
