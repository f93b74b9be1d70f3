//! Content hashing: a digest of a value's contents, stable across processes and platforms.
//!
//! [`ContentHash`] feeds a value into a [`ContentHasher`] using a canonical encoding, and the
//! hasher produces a blake3 [`Digest`]. The encoding is part of nitro's contract, because digests
//! are stored in persistent caches and checkpoints:
//!
//! | value | encoding |
//! | --- | --- |
//! | `u8 u16 u32 u64 u128`, `i8 … i128` | little-endian, fixed width |
//! | `usize` / `isize` | as `u64` / `i64` |
//! | `bool` | one byte, `0` or `1` |
//! | `char` | its scalar value as `u32` |
//! | `f32` / `f64` / `bf16` / `f16` | the exact bit pattern (`to_bits`), little-endian — `0.0` and `-0.0` differ, NaN payloads differ |
//! | `str`, `String`, paths | length as `u64`, then the bytes |
//! | slices, arrays, `Vec`, `VecDeque` | length as `u64`, then each element; slices of plain numbers as one byte run |
//! | `BTreeMap` / `BTreeSet` | length, then each entry in order |
//! | `HashMap` / `HashSet` | length, then the blake3 digest of each entry's encoding, sorted — independent of iteration order |
//! | `Option` | `0`, or `1` then the value |
//! | `Result` | `0` then the `Ok` value, or `1` then the `Err` value |
//! | tuples | each element in order |
//! | `Box` / `Rc` / `Arc` / `&T` | the pointee's encoding (by content, never by address) |
//! | `()`, `PhantomData` | nothing |
//! | `Duration` | seconds as `u64`, then nanoseconds as `u32` |
//! | derived structs | each field in declaration order |
//! | derived enums | the variant's index as `u32`, then its fields |
//!
//! The digest is `blake3(encoding)`, with no prefix, so it can be checked by hand:
//!
//! ```
//! use nitro::{ContentHash, Digest};
//! assert_eq!(Digest::of(&7u32), Digest::from(blake3::hash(&[7, 0, 0, 0])));
//! assert_ne!(Digest::of(&0.0f32), Digest::of(&-0.0f32));
//! ```
//!
//! There is deliberately no implementation for values that are not determined by their contents:
//! `Cell`, `RefCell`, `Mutex`, `RwLock`, atomics, `UnsafeCell`, raw pointers, function pointers
//! and trait objects. A compile key built from them could not be trusted.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::hash::BuildHasher;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// A 32-byte blake3 digest.
///
/// `Display` prints all 64 hex digits; [`Digest::short`] prints the first 12 for logs.
///
/// ```
/// let d = nitro::Digest::of("hello");
/// assert_eq!(d.to_string().len(), 64);
/// assert_eq!(d.short().to_string(), d.to_string()[..12]);
/// assert_eq!(d.to_string().parse::<nitro::Digest>().unwrap(), d);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Digest([u8; 32]);

impl Digest {
    /// The digest of `value`'s canonical encoding.
    pub fn of<T: ContentHash + ?Sized>(value: &T) -> Digest {
        let mut h = ContentHasher::new();
        value.content_hash(&mut h);
        h.finish()
    }

    /// Wraps 32 raw bytes (usable in `const` items, which is how the macro emits schema digests).
    pub const fn from_bytes(bytes: [u8; 32]) -> Digest {
        Digest(bytes)
    }

    /// The 32 raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A short form for log lines: the first 12 hex digits (48 bits).
    pub fn short(&self) -> ShortDigest {
        ShortDigest(*self)
    }
}

impl From<blake3::Hash> for Digest {
    fn from(h: blake3::Hash) -> Digest {
        Digest(*h.as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

/// The error of parsing a [`Digest`] from text that is not 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a digest is 64 hex digits; got {len} characters{}", if *.bad { " including a non-hex one" } else { "" })]
pub struct ParseDigestError {
    len: usize,
    bad: bool,
}

impl std::str::FromStr for Digest {
    type Err = ParseDigestError;
    fn from_str(s: &str) -> Result<Digest, ParseDigestError> {
        let bytes = s.as_bytes();
        let bad = !bytes.iter().all(u8::is_ascii_hexdigit);
        if bytes.len() != 64 || bad {
            return Err(ParseDigestError { len: s.len(), bad });
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16).unwrap_or(0);
            let lo = (pair[1] as char).to_digit(16).unwrap_or(0);
            out[i] = (hi * 16 + lo) as u8;
        }
        Ok(Digest(out))
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The short form of a [`Digest`] (first 12 hex digits), for log lines.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ShortDigest(Digest);

impl fmt::Display for ShortDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 .0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ShortDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The sink of the canonical encoding: a blake3 hasher with typed writers.
///
/// Implementations of [`ContentHash`] call these writers; the encoding of each primitive is
/// listed in the [module docs](self).
pub struct ContentHasher {
    inner: blake3::Hasher,
    /// While [`ContentHasher::parts_of`] records: the parts open and done.
    parts: Option<Box<PartRecorder>>,
}

/// The most parts [`ContentHasher::parts_of`] records of one value: a value with more (a long
/// `Vec` of structs) has its first parts recorded, in walk order, and the rest counted in the
/// innermost recorded part.
const MAX_PARTS: usize = 256;

/// The longest print a part keeps as its [`Part::value`].
const MAX_PART_PRINT: usize = 40;

/// One part of a value as [`ContentHasher::parts_of`] saw it: a sub-field (`arch.hidden`), an
/// element (`arch.layers[1]`) or the value itself (`arch`), with the digest of exactly the bytes
/// the value's content hash wrote while in it — so two parts of one path differ exactly when
/// those bytes did — and its print where it printed short.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Part {
    /// The path, from the root the parts were recorded at (`arch.layers[1].width`).
    pub path: String,
    /// The digest of the bytes written in it.
    pub digest: Digest,
    /// Its value as printed where it is one short printable value (a number, a string, a
    /// variant without fields, a short slice of numbers): `48`, `Relu`, `[32, 64]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// The parts being recorded.
#[derive(Default)]
struct PartRecorder {
    /// Open parts, outermost first; `None` for a part past [`MAX_PARTS`], not recorded.
    open: Vec<Option<OpenPart>>,
    /// Parts closed, in the order they closed.
    done: Vec<Part>,
    /// Parts opened so far (recorded ones).
    opened: usize,
}

struct OpenPart {
    path: String,
    hasher: blake3::Hasher,
    /// Values shown while it was the innermost recorded part.
    shows: u32,
    shown: Option<String>,
}

impl Default for ContentHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ContentHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContentHasher")
            .field("bytes", &self.inner.count())
            .finish()
    }
}

impl ContentHasher {
    /// A hasher with nothing written.
    pub fn new() -> Self {
        ContentHasher {
            inner: blake3::Hasher::new(),
            parts: None,
        }
    }

    /// The parts of `value` rooted at `root`: `root` itself, then every sub-field, element and
    /// variant field its content hash walks (up to 256), each with the digest of the bytes
    /// written in it and its print where short. The bytes are those [`Digest::of`] hashes, so
    /// the parts of two values differ exactly where their encodings do: a miss reason names the
    /// sub-field that moved (`arch.hidden 32 → 48`) from the key's own bytes, not from a print.
    ///
    /// ```
    /// use nitro::{ContentHash, ContentHasher};
    ///
    /// #[derive(ContentHash)]
    /// struct Arch { hidden: usize, act: Act, widths: Vec<usize> }
    /// #[derive(ContentHash)]
    /// enum Act { Tanh, Relu }
    ///
    /// let parts = ContentHasher::parts_of("arch", &Arch { hidden: 32, act: Act::Relu, widths: vec![8, 4] });
    /// let paths: Vec<(&str, Option<&str>)> =
    ///     parts.iter().map(|p| (p.path.as_str(), p.value.as_deref())).collect();
    /// assert_eq!(paths, [
    ///     ("arch.hidden", Some("32")),
    ///     ("arch.act", Some("Relu")),
    ///     ("arch.widths", Some("[8, 4]")),
    ///     ("arch", None),
    /// ]);
    /// ```
    pub fn parts_of<T: ContentHash + ?Sized>(root: &str, value: &T) -> Vec<Part> {
        let mut h = ContentHasher {
            inner: blake3::Hasher::new(),
            parts: Some(Box::default()),
        };
        h.open_part(root.to_owned());
        value.content_hash(&mut h);
        h.close_part();
        h.parts.map(|r| r.done).unwrap_or_default()
    }

    /// Hashes the content `f` writes as the field `name` of the value being hashed (what
    /// `#[derive(ContentHash)]` calls for each field). The bytes are the same either way; while
    /// [`parts_of`](ContentHasher::parts_of) records, they also make the part `….name`.
    #[doc(hidden)]
    #[inline]
    pub fn field(&mut self, name: &str, f: impl FnOnce(&mut ContentHasher)) {
        self.sub_part(|parent| format!("{parent}.{name}"), f);
    }

    /// As [`field`](ContentHasher::field), for element `index` of a sequence (`…[index]`).
    #[doc(hidden)]
    #[inline]
    pub fn element(&mut self, index: usize, f: impl FnOnce(&mut ContentHasher)) {
        self.sub_part(|parent| format!("{parent}[{index}]"), f);
    }

    /// Runs `f` in a part whose path `path` makes from its parent's, while recording.
    #[inline]
    fn sub_part(&mut self, path: impl FnOnce(&str) -> String, f: impl FnOnce(&mut ContentHasher)) {
        match self.parts.as_deref().and_then(|r| r.open.last()) {
            None => f(self),
            Some(parent) => {
                let path = parent.as_ref().map_or_else(String::new, |p| path(&p.path));
                self.open_part(path);
                f(self);
                self.close_part();
            }
        }
    }

    /// Shows the value being hashed as `print` gives it, for the part it is in: a part that
    /// shows exactly one value keeps it as its [`Part::value`]. Nothing unless recording.
    #[doc(hidden)]
    #[inline]
    pub fn show(&mut self, print: impl FnOnce() -> String) {
        let Some(r) = self.parts.as_deref_mut() else {
            return;
        };
        if let Some(Some(part)) = r.open.last_mut() {
            part.shows += 1;
            part.shown = if part.shows == 1 {
                Some(print()).filter(|p| p.chars().count() <= MAX_PART_PRINT)
            } else {
                None
            };
        }
    }

    /// Opens a part at `path` (unrecorded past [`MAX_PARTS`], or under an unrecorded one).
    fn open_part(&mut self, path: String) {
        let Some(r) = self.parts.as_deref_mut() else {
            return;
        };
        let recorded = r.opened < MAX_PARTS && !matches!(r.open.last(), Some(None));
        if recorded {
            r.opened += 1;
            r.open.push(Some(OpenPart {
                path,
                hasher: blake3::Hasher::new(),
                shows: 0,
                shown: None,
            }));
        } else {
            r.open.push(None);
        }
    }

    /// Closes the innermost part.
    fn close_part(&mut self) {
        let Some(r) = self.parts.as_deref_mut() else {
            return;
        };
        if let Some(Some(part)) = r.open.pop() {
            r.done.push(Part {
                path: part.path,
                digest: Digest(*part.hasher.finalize().as_bytes()),
                value: part.shown,
            });
        } else if let Some(Some(parent)) = r.open.last_mut() {
            // An unrecorded part's values count in the recorded part around it.
            parent.shows += 2;
            parent.shown = None;
        }
    }

    /// Feeds `bytes` to the digest, and to every open part while recording.
    #[inline]
    fn update(&mut self, bytes: &[u8]) {
        self.inner.update(bytes);
        if let Some(r) = self.parts.as_deref_mut() {
            for part in r.open.iter_mut().flatten() {
                part.hasher.update(bytes);
            }
        }
    }

    /// Writes raw bytes, with no length prefix.
    pub fn write_bytes(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }

    /// Writes one byte.
    pub fn write_u8(&mut self, v: u8) {
        self.update(&[v]);
    }

    /// Writes a `u32`, little-endian.
    pub fn write_u32(&mut self, v: u32) {
        self.update(&v.to_le_bytes());
    }

    /// Writes a `u64`, little-endian.
    pub fn write_u64(&mut self, v: u64) {
        self.update(&v.to_le_bytes());
    }

    /// Writes a length (or any `usize`) as a `u64`.
    pub fn write_len(&mut self, len: usize) {
        self.write_u64(len as u64);
    }

    /// Writes a length-prefixed string.
    pub fn write_str(&mut self, s: &str) {
        self.write_len(s.len());
        self.write_bytes(s.as_bytes());
    }

    /// Writes an enum variant tag.
    pub fn write_variant(&mut self, index: u32) {
        self.write_u32(index);
    }

    /// Writes a digest's 32 bytes.
    pub fn write_digest(&mut self, d: &Digest) {
        self.write_bytes(&d.0);
    }

    /// Finishes, returning the digest of everything written.
    pub fn finish(&self) -> Digest {
        Digest(*self.inner.finalize().as_bytes())
    }
}

/// A value with a content hash: a canonical encoding that is stable across processes,
/// platforms and compiler versions (unlike [`std::hash::Hash`]).
///
/// Every `#[graph_const]` field of an [`experiment`](macro@crate::experiment) must be `ContentHash`,
/// because its digest is what the compile key sees of it. Derive it with
/// `#[derive(ContentHash)]` for structs and enums whose fields are all `ContentHash`.
///
/// ```
/// use nitro::{ContentHash, Digest};
///
/// #[derive(ContentHash)]
/// struct Arch { hidden: usize, activation: Activation }
///
/// #[derive(ContentHash)]
/// enum Activation { Tanh, Relu }
///
/// let a = Digest::of(&Arch { hidden: 128, activation: Activation::Tanh });
/// let b = Digest::of(&Arch { hidden: 128, activation: Activation::Relu });
/// assert_ne!(a, b);
/// ```
///
/// A type whose value is not determined by its contents is rejected while compiling:
///
/// ```compile_fail
/// #[derive(nitro::ContentHash)]
/// struct Cache { seen: std::cell::RefCell<Vec<u8>> }
/// ```
///
/// So is a trait object: a trait with `ContentHash` as a supertrait cannot be made into one
/// (unit structs `Tanh` and `Relu` behind `Box<dyn Layer>` would hash equal), and no impl can
/// give a `dyn Trait` a content hash. Use an enum with a variant per kind:
///
/// ```compile_fail
/// trait Layer: nitro::ContentHash {}
/// fn layers(_: Vec<Box<dyn Layer>>) {}
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no content hash, so it cannot be part of a compile key",
    label = "`{Self}` is not `ContentHash`",
    note = "nitro keys compiled programs on the contents of #[graph_const] values and of everything inside them; \
            interior mutability (`Cell`, `RefCell`, `Mutex`, `RwLock`, atomics), pointers, fn pointers and trait objects \
            have no stable contents to hash",
    note = "derive `nitro::ContentHash` for your own types and store plain values instead of cells or pointers; \
            a value that does not shape the graph belongs in a `#[device]` (traced input) or `#[host]` field"
)]
pub trait ContentHash: sealed::NotATraitObject {
    /// Makes `ContentHash` — and every trait that has it as a supertrait — impossible to use
    /// as a trait object (`dyn Layer` where `trait Layer: ContentHash` is a compile error).
    ///
    /// Two values of different concrete types behind one `dyn` type could encode equally
    /// (unit structs `Tanh` and `Relu`, or `Scale(2.0)` and `Shift(2.0)`) and so share a compile
    /// key while emitting different programs: a stale hit. Use an enum with one variant per
    /// kind instead — its variant tag is part of the encoding.
    #[doc(hidden)]
    const TRAIT_OBJECTS_HAVE_NO_CONTENT_HASH: () = ();

    /// Writes this value's canonical encoding into `h`.
    fn content_hash(&self, h: &mut ContentHasher);

    /// Writes the encoding of every element of `items`, without a length prefix.
    ///
    /// The default calls [`content_hash`](ContentHash::content_hash) per element; plain number
    /// types override it to write the whole slice as one byte run, so hashing a 100 MB table
    /// runs at blake3's throughput.
    #[doc(hidden)]
    fn content_hash_slice(items: &[Self], h: &mut ContentHasher)
    where
        Self: Sized,
    {
        for (i, item) in items.iter().enumerate() {
            h.element(i, |h| item.content_hash(h));
        }
    }
}

/// The seal that keeps trait objects out of [`ContentHash`]: implemented for every sized type
/// and the unsized types whose contents are their bytes (`str`, slices, `OsStr`, `Path`), never
/// for a `dyn Trait`, and not implementable outside this crate.
mod sealed {
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is a trait object (or another unsized type), so it has no content hash",
        label = "`{Self}` cannot be `ContentHash`",
        note = "values of different concrete types behind one trait object can encode equally \
                and would share a compile key while emitting different programs",
        note = "use an enum with one variant per kind (its tag is part of the content hash), \
                or a generic parameter with a concrete type"
    )]
    pub trait NotATraitObject {}

    impl<T> NotATraitObject for T {}
    impl NotATraitObject for str {}
    impl<T> NotATraitObject for [T] {}
    impl NotATraitObject for std::ffi::OsStr {}
    impl NotATraitObject for std::path::Path {}
}

macro_rules! plain_numbers {
    ($($t:ty),*) => {$(
        impl ContentHash for $t {
            #[inline]
            fn content_hash(&self, h: &mut ContentHasher) {
                h.show(|| self.to_string());
                h.write_bytes(&self.to_le_bytes());
            }
            fn content_hash_slice(items: &[Self], h: &mut ContentHasher) {
                show_slice(items, h);
                #[cfg(target_endian = "little")]
                h.write_bytes(bytemuck::cast_slice(items));
                #[cfg(not(target_endian = "little"))]
                for item in items {
                    h.write_bytes(&item.to_le_bytes());
                }
            }
        }
    )*};
}
plain_numbers!(u8, u16, u32, u64, u128, i8, i16, i32, i64, i128);

/// Shows a short slice of numbers (`[8, 4]`) for the part it is in
/// ([`ContentHasher::parts_of`]).
fn show_slice<T: fmt::Debug>(items: &[T], h: &mut ContentHasher) {
    if items.len() <= 8 {
        h.show(|| format!("{items:?}"));
    }
}

macro_rules! floats {
    ($($t:ty),*) => {$(
        impl ContentHash for $t {
            #[inline]
            fn content_hash(&self, h: &mut ContentHasher) {
                h.show(|| format!("{self:?}"));
                h.write_bytes(&self.to_bits().to_le_bytes());
            }
            fn content_hash_slice(items: &[Self], h: &mut ContentHasher) {
                show_slice(items, h);
                // A float's little-endian bytes are its bit pattern's little-endian bytes.
                #[cfg(target_endian = "little")]
                h.write_bytes(bytemuck::cast_slice(items));
                #[cfg(not(target_endian = "little"))]
                for item in items {
                    h.write_bytes(&item.to_bits().to_le_bytes());
                }
            }
        }
    )*};
}
floats!(f32, f64);

/// Half-precision floats hash as their bit patterns, little-endian (as `f32`).
macro_rules! half_floats {
    ($($t:ty),*) => {$(
        impl ContentHash for $t {
            #[inline]
            fn content_hash(&self, h: &mut ContentHasher) {
                h.show(|| format!("{self:?}"));
                h.write_bytes(&self.to_bits().to_le_bytes());
            }
        }
    )*};
}
half_floats!(half::bf16, half::f16);

/// `usize` / `isize` encode as `u64` / `i64`, so digests agree across pointer widths; on a
/// 64-bit little-endian target that is their memory layout, and slices go as one byte run.
macro_rules! pointer_sized {
    ($($t:ty => $wide:ty),*) => {$(
        impl ContentHash for $t {
            fn content_hash(&self, h: &mut ContentHasher) {
                h.show(|| self.to_string());
                h.write_bytes(&(*self as $wide).to_le_bytes());
            }
            fn content_hash_slice(items: &[Self], h: &mut ContentHasher) {
                show_slice(items, h);
                #[cfg(all(target_endian = "little", target_pointer_width = "64"))]
                h.write_bytes(bytemuck::cast_slice(items));
                #[cfg(not(all(target_endian = "little", target_pointer_width = "64")))]
                for item in items {
                    h.write_bytes(&(*item as $wide).to_le_bytes());
                }
            }
        }
    )*};
}
pointer_sized!(usize => u64, isize => i64);

impl ContentHash for bool {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.show(|| self.to_string());
        h.write_u8(u8::from(*self));
    }
    fn content_hash_slice(items: &[Self], h: &mut ContentHasher) {
        show_slice(items, h);
        // A bool is one byte, 0 or 1: the same as its encoding.
        let bytes: Vec<u8> = items.iter().map(|&b| u8::from(b)).collect();
        h.write_bytes(&bytes);
    }
}

impl ContentHash for char {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.show(|| format!("{self:?}"));
        h.write_u32(u32::from(*self));
    }
}

impl ContentHash for str {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.show(|| format!("{self:?}"));
        h.write_str(self);
    }
}

impl ContentHash for String {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_str().content_hash(h);
    }
}

impl ContentHash for OsStr {
    fn content_hash(&self, h: &mut ContentHasher) {
        let bytes = self.as_encoded_bytes();
        h.write_len(bytes.len());
        h.write_bytes(bytes);
    }
}

impl ContentHash for OsString {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_os_str().content_hash(h);
    }
}

impl ContentHash for Path {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_os_str().content_hash(h);
    }
}

impl ContentHash for PathBuf {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_os_str().content_hash(h);
    }
}

impl ContentHash for () {
    fn content_hash(&self, _: &mut ContentHasher) {}
}

impl<T: ?Sized> ContentHash for PhantomData<T> {
    fn content_hash(&self, _: &mut ContentHasher) {}
}

impl ContentHash for Duration {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_u64(self.as_secs());
        h.write_u32(self.subsec_nanos());
    }
}

impl<T: ContentHash> ContentHash for [T] {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_len(self.len());
        T::content_hash_slice(self, h);
    }
}

impl<T: ContentHash, const N: usize> ContentHash for [T; N] {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_slice().content_hash(h);
    }
}

impl<T: ContentHash> ContentHash for Vec<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.as_slice().content_hash(h);
    }
}

impl<T: ContentHash> ContentHash for VecDeque<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_len(self.len());
        let (a, b) = self.as_slices();
        if h.parts.is_some() {
            // Recording parts: one index per element across both halves (the same bytes).
            for (i, item) in self.iter().enumerate() {
                h.element(i, |h| item.content_hash(h));
            }
            return;
        }
        T::content_hash_slice(a, h);
        T::content_hash_slice(b, h);
    }
}

impl<T: ContentHash> ContentHash for Option<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        match self {
            None => h.write_u8(0),
            Some(v) => {
                h.write_u8(1);
                v.content_hash(h);
            }
        }
    }
}

impl<T: ContentHash, E: ContentHash> ContentHash for Result<T, E> {
    fn content_hash(&self, h: &mut ContentHasher) {
        match self {
            Ok(v) => {
                h.write_u8(0);
                v.content_hash(h);
            }
            Err(e) => {
                h.write_u8(1);
                e.content_hash(h);
            }
        }
    }
}

impl<T: ContentHash + ?Sized> ContentHash for &T {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<T: ContentHash + ?Sized> ContentHash for &mut T {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<T: ContentHash + ?Sized> ContentHash for Box<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<T: ContentHash + ?Sized> ContentHash for Rc<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<T: ContentHash + ?Sized> ContentHash for Arc<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<T: ContentHash + ToOwned + ?Sized> ContentHash for std::borrow::Cow<'_, T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        (**self).content_hash(h);
    }
}

impl<K: ContentHash, V: ContentHash> ContentHash for BTreeMap<K, V> {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_len(self.len());
        for (k, v) in self {
            k.content_hash(h);
            v.content_hash(h);
        }
    }
}

impl<T: ContentHash> ContentHash for BTreeSet<T> {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_len(self.len());
        for v in self {
            v.content_hash(h);
        }
    }
}

/// Writes an unordered collection: its length, then the sorted digests of its entries.
fn write_unordered<I: Iterator<Item = Digest>>(h: &mut ContentHasher, len: usize, entries: I) {
    let mut digests: Vec<Digest> = entries.collect();
    digests.sort_unstable();
    h.write_len(len);
    for d in &digests {
        h.write_digest(d);
    }
}

impl<K: ContentHash, V: ContentHash, S: BuildHasher> ContentHash for HashMap<K, V, S> {
    fn content_hash(&self, h: &mut ContentHasher) {
        write_unordered(
            h,
            self.len(),
            self.iter().map(|(k, v)| {
                let mut entry = ContentHasher::new();
                k.content_hash(&mut entry);
                v.content_hash(&mut entry);
                entry.finish()
            }),
        );
    }
}

impl<T: ContentHash, S: BuildHasher> ContentHash for HashSet<T, S> {
    fn content_hash(&self, h: &mut ContentHasher) {
        write_unordered(h, self.len(), self.iter().map(Digest::of));
    }
}

macro_rules! tuples {
    ($(($($name:ident . $idx:tt),+))*) => {$(
        impl<$($name: ContentHash),+> ContentHash for ($($name,)+) {
            fn content_hash(&self, h: &mut ContentHasher) {
                $(self.$idx.content_hash(h);)+
            }
        }
    )*};
}
tuples! {
    (A.0)
    (A.0, B.1)
    (A.0, B.1, C.2)
    (A.0, B.1, C.2, D.3)
    (A.0, B.1, C.2, D.3, E.4)
    (A.0, B.1, C.2, D.3, E.4, F.5)
    (A.0, B.1, C.2, D.3, E.4, F.5, G.6)
    (A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7)
}

macro_rules! nonzero {
    ($($t:ty),*) => {$(
        impl ContentHash for $t {
            fn content_hash(&self, h: &mut ContentHasher) {
                self.get().content_hash(h);
            }
        }
    )*};
}
nonzero!(
    std::num::NonZeroU8,
    std::num::NonZeroU16,
    std::num::NonZeroU32,
    std::num::NonZeroU64,
    std::num::NonZeroUsize,
    std::num::NonZeroI32,
    std::num::NonZeroI64
);

impl ContentHash for Digest {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_digest(self);
    }
}
