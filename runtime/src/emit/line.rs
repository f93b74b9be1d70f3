//! The text of one op: [`Line`], what an op family's emitter (in [`crate::ops`]) writes a node
//! with, the pieces of StableHLO text it is made of (types, lists, attributes), and whether
//! the module being emitted widens half-precision dots ([`widens_half_dots`]). A leaf module:
//! the op families and the emitter both use it, and it uses neither.

use std::fmt;

use crate::tree::{DType, LeafType};

/// One node's text as an op family's emitter (in [`crate::ops`]) writes it: the node's SSA name,
/// its number (for auxiliary values, `%padN`), its result type, and its operands' names and types.
pub(crate) struct Line<'a> {
    /// Where the text goes.
    pub(crate) out: &'a mut String,
    /// The node's SSA name (`%7`).
    pub(crate) me: String,
    /// The node's number, for auxiliary names.
    pub(crate) n: String,
    /// The result type (`tensor<2x3xf32>`).
    pub(crate) ty: String,
    /// The operands' SSA names, in order.
    pub(crate) args: Vec<String>,
    /// The operands' types, in order.
    pub(crate) arg_tys: Vec<String>,
    /// The operands' types as values, in order.
    pub(crate) arg_types: Vec<LeafType>,
}

/// The `bool` tensor type of `dims` (`tensor<2x3xi1>`).
pub(crate) fn bool_type(dims: &[usize]) -> String {
    Ty(Some(&LeafType {
        dtype: DType::Bool,
        dims: dims.to_vec(),
    }))
    .to_string()
}

/// A dims list as text (`[0, 1]`).
pub(crate) fn list(dims: &[usize]) -> String {
    List(dims).to_string()
}

/// A list of signed numbers as text (`[-1, 2]`).
pub(crate) fn signed_list(v: &[i64]) -> String {
    let parts: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// An `array<i64: …>` attribute.
pub(crate) fn i64_array(v: impl IntoIterator<Item = i64>) -> String {
    let parts: Vec<String> = v.into_iter().map(|x| x.to_string()).collect();
    if parts.is_empty() {
        "array<i64>".to_owned()
    } else {
        format!("array<i64: {}>", parts.join(", "))
    }
}

/// A padding attribute, `dense<[[lo, hi], ...]> : tensor<Nx2xi64>`.
pub(crate) fn padding_attr(padding: &[(i64, i64)]) -> String {
    let parts: Vec<String> = padding.iter().map(|(l, h)| format!("[{l}, {h}]")).collect();
    if parts.is_empty() {
        return "dense<> : tensor<0x2xi64>".to_owned();
    }
    format!(
        "dense<[{}]> : tensor<{}x2xi64>",
        parts.join(", "),
        padding.len()
    )
}

/// The scalar type of a dtype (`tensor<f32>`).
pub(crate) fn scalar_type(dtype: DType) -> String {
    format!("tensor<{}>", element_type(dtype))
}

/// The `compare` type of a dtype (`FLOAT`, `SIGNED`, `UNSIGNED`).
pub(crate) fn compare_type(dtype: DType) -> &'static str {
    comparison_type(dtype)
}

/// The MLIR element type of a dtype.
pub(super) const fn element_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U8 => "ui8",
        DType::Bool => "i1",
        DType::U32 => "ui32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
}

/// The `compare` type that suits a dtype (other pairings fail XLA's HLO verifier on some plugins).
pub(super) const fn comparison_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => "FLOAT",
        DType::I32 | DType::I64 => "SIGNED",
        DType::U8 | DType::U32 | DType::Bool => "UNSIGNED",
    }
}

/// A tensor type: `tensor<2x3xf32>`, `tensor<f32>`; `tensor<invalid>` for a missing node.
#[derive(Clone, Copy)]
pub(crate) struct Ty<'a>(pub(crate) Option<&'a LeafType>);

impl fmt::Display for Ty<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(ty) = self.0 else {
            return f.write_str("tensor<invalid>");
        };
        f.write_str("tensor<")?;
        for d in &ty.dims {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", element_type(ty.dtype))
    }
}

/// A list of dims: `[0, 1]`, `[]`.
pub(crate) struct List<'a>(pub(crate) &'a [usize]);

impl fmt::Display for List<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Writes the `dense<…>` literal of zeros of `ty` (a splat; `dense<>` without elements): a
/// float's zero as its bits in hex, as every float constant is written.
pub(crate) fn zero_splat(out: &mut String, ty: &LeafType) {
    if ty.element_count() == Some(0) {
        out.push_str("dense<>");
        return;
    }
    match ty.dtype {
        DType::Bool => out.push_str("dense<false>"),
        d if d.is_float() => {
            out.push_str("dense<0x");
            out.extend(std::iter::repeat_n('0', 2 * d.size_bytes()));
            out.push('>');
        }
        _ => out.push_str("dense<0>"),
    }
}

// ---- whether half-precision dots widen -----------------------------------------------------
//
// The rule lives here, below both its reader (the dot and convolution families, through
// `ops::linalg::Widened`) and its writer (the emitter, for one module at a time), so that
// neither imports the other for it.

thread_local! {
    /// [`EmitOptions::widen_half_dots`](crate::emit::EmitOptions::widen_half_dots) of the
    /// module being emitted on this thread.
    static WIDEN_HALF_DOTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the module being emitted widens half-precision dots and convolutions
/// ([`EmitOptions::widen_half_dots`](crate::emit::EmitOptions::widen_half_dots)).
pub(crate) fn widens_half_dots() -> bool {
    WIDEN_HALF_DOTS.with(|w| w.get())
}

/// Sets [`WIDEN_HALF_DOTS`] for one module's emission, and restores it when dropped.
pub(crate) struct WidenGuard(bool);

impl WidenGuard {
    /// Widens half dots (or not) until the guard is dropped.
    pub(crate) fn set(on: bool) -> WidenGuard {
        WidenGuard(WIDEN_HALF_DOTS.with(|w| w.replace(on)))
    }
}

impl Drop for WidenGuard {
    fn drop(&mut self) {
        WIDEN_HALF_DOTS.with(|w| w.set(self.0));
    }
}
