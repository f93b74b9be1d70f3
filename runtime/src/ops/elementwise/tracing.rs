//! The element-wise ops' tracing: operands (tensors or `f64` scalars), NumPy broadcasting made
//! explicit, dtype checks, and the `Tensor` methods and operators of the first element-wise ops,
//! comparisons, `select`, `convert`, constants, `stop_gradient` and `all_sum`.

use std::ops;
use std::panic::Location;
use std::sync::Arc;

use crate::trace::ir::{with_dims, BinaryOp, CmpOp, Op, UnaryOp};
use crate::trace::record::{with_recording, Recording, Tensor};
use crate::tree::{Array, DType, LeafType};

/// An operand of a binary op: a tensor, or an `f64` scalar that takes the other operand's dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Operand {
    /// A traced tensor.
    Tensor(Tensor),
    /// A scalar constant.
    Scalar(f64),
}

impl From<Tensor> for Operand {
    fn from(t: Tensor) -> Operand {
        Operand::Tensor(t)
    }
}

impl From<f64> for Operand {
    fn from(v: f64) -> Operand {
        Operand::Scalar(v)
    }
}

pub(crate) fn scalar_ty(dtype: DType) -> LeafType {
    LeafType {
        dtype,
        dims: Vec::new(),
    }
}

/// A host array of `dtype` holding `value`, or why it cannot.
pub(crate) fn scalar_array(value: f64, dtype: DType) -> Result<Array, String> {
    let int = |lo: f64, hi: f64| {
        if value.fract() == 0.0 && value >= lo && value <= hi {
            Ok(())
        } else {
            Err(format!("the scalar {value} is not a {dtype} value"))
        }
    };
    Ok(match dtype {
        DType::F32 => Array::scalar(value as f32),
        DType::F64 => Array::scalar(value),
        DType::I32 => {
            int(i32::MIN as f64, i32::MAX as f64)?;
            Array::scalar(value as i32)
        }
        DType::I64 => {
            int(-9.007_199_254_740_992e15, 9.007_199_254_740_992e15)?;
            Array::scalar(value as i64)
        }
        DType::U8 => {
            int(0.0, 255.0)?;
            Array::scalar(value as u8)
        }
        DType::U32 => {
            int(0.0, u32::MAX as f64)?;
            Array::scalar(value as u32)
        }
        DType::BF16 => Array::scalar(half::bf16::from_f32(value as f32)),
        DType::F16 => Array::scalar(half::f16::from_f32(value as f32)),
        DType::Bool => {
            int(0.0, 1.0)?;
            Array::scalar(value != 0.0)
        }
    })
}

pub(crate) fn check_axes(rank: usize, axes: &[usize]) -> Result<Vec<usize>, String> {
    let mut sorted = axes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != axes.len() {
        return Err(format!("axes {axes:?} repeat an axis"));
    }
    if let Some(a) = sorted.iter().find(|&&a| a >= rank) {
        return Err(format!("axis {a} is out of range for rank {rank}"));
    }
    Ok(sorted)
}

/// The NumPy broadcast of two dims lists, or `None` when some pair differs and neither is 1.
pub(crate) fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl Recording {
    pub(crate) fn ty_of(&self, t: Tensor) -> LeafType {
        self.graph.ty(t.node).clone()
    }

    pub(crate) fn constant(&mut self, array: Array) -> Tensor {
        let ty = array.leaf_type();
        // Every `Array` is within the size limit, so no check is needed here.
        let node = self
            .graph
            .push(Op::Constant(Arc::new(array)), Vec::new(), ty);
        Tensor {
            node,
            trace: self.id,
        }
    }

    pub(crate) fn scalar(
        &mut self,
        value: f64,
        dtype: DType,
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        match scalar_array(value, dtype) {
            Ok(a) => self.constant(a),
            Err(msg) => self.fail(op, msg, at, scalar_ty(dtype)),
        }
    }

    /// Resolves operands to tensors of one dtype and one (broadcast) shape.
    pub(crate) fn unify(
        &mut self,
        operands: &[Operand],
        op: &'static str,
        at: &Location<'_>,
    ) -> Option<Vec<Tensor>> {
        for o in operands {
            if let Operand::Tensor(t) = o {
                if !self.owns(*t, op, at) {
                    return None;
                }
            }
        }
        let Some(dtype) = operands.iter().find_map(|o| match o {
            Operand::Tensor(t) => Some(self.ty_of(*t).dtype),
            Operand::Scalar(_) => None,
        }) else {
            self.fail(
                op,
                "every operand is a scalar, so the dtype is unknown; make one a tensor \
                 (e.g. `Tensor::scalar(v, DType::F32)`)"
                    .into(),
                at,
                scalar_ty(DType::F32),
            );
            return None;
        };
        let mut tensors = Vec::with_capacity(operands.len());
        for o in operands {
            tensors.push(match *o {
                Operand::Tensor(t) => t,
                Operand::Scalar(v) => self.scalar(v, dtype, op, at),
            });
        }
        let types: Vec<LeafType> = tensors.iter().map(|t| self.ty_of(*t)).collect();
        if let Some(other) = types.iter().find(|t| t.dtype != dtype) {
            let shown = types
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" and ");
            self.fail(
                op,
                format!(
                    "operands have different dtypes ({shown}); convert one with `.convert(DType::{:?})`",
                    other.dtype
                ),
                at,
                types[0].clone(),
            );
            return None;
        }
        let mut dims = types[0].dims.clone();
        for t in &types[1..] {
            match broadcast_dims(&dims, &t.dims) {
                Some(d) => dims = d,
                None => {
                    let shown = types
                        .iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(" and ");
                    self.fail(
                        op,
                        format!(
                            "cannot broadcast {shown}: aligned from the right, each pair of dims \
                             must be equal or 1"
                        ),
                        at,
                        types[0].clone(),
                    );
                    return None;
                }
            }
        }
        Some(
            tensors
                .into_iter()
                .map(|t| self.broadcast_to(t, &dims, op, at))
                .collect(),
        )
    }

    pub(crate) fn binary(
        &mut self,
        op: BinaryOp,
        a: Operand,
        b: Operand,
        at: &Location<'_>,
    ) -> Tensor {
        let Some(ts) = self.unify(&[a, b], op.name(), at) else {
            return self.stand_in_for(&[a, b]);
        };
        let ty = self.ty_of(ts[0]);
        if let Err(msg) = crate::ops::elementwise::binary_defined(op, &ty) {
            return self.fail(op.name(), msg, at, ty);
        }
        self.push(
            Op::Binary(op),
            vec![ts[0].node, ts[1].node],
            ty,
            op.name(),
            at,
        )
    }

    fn compare(&mut self, op: CmpOp, a: Operand, b: Operand, at: &Location<'_>) -> Tensor {
        let Some(ts) = self.unify(&[a, b], "compare", at) else {
            let t = self.stand_in_for(&[a, b]);
            let dims = self.ty_of(t).dims;
            return self.stand_in(with_dims(DType::Bool, dims));
        };
        let dims = self.ty_of(ts[0]).dims;
        self.push(
            Op::Compare(op),
            vec![ts[0].node, ts[1].node],
            with_dims(DType::Bool, dims),
            "compare",
            at,
        )
    }

    fn stand_in_for(&mut self, operands: &[Operand]) -> Tensor {
        let ty = operands
            .iter()
            .find_map(|o| match o {
                Operand::Tensor(t) if self.sees(*t) => Some(self.ty_of(*t)),
                _ => None,
            })
            .unwrap_or_else(|| scalar_ty(DType::F32));
        self.stand_in(ty)
    }

    pub(crate) fn unary(&mut self, op: UnaryOp, a: Tensor, at: &Location<'_>) -> Tensor {
        if !self.owns(a, op.name(), at) {
            return self.stand_in(scalar_ty(DType::F32));
        }
        let ty = self.ty_of(a);
        if let Err(msg) = crate::ops::elementwise::unary_defined(op, &ty) {
            return self.fail(op.name(), msg, at, ty);
        }
        self.push(Op::Unary(op), vec![a.node], ty, op.name(), at)
    }

    /// `a` itself, with no gradient flowing back through it.
    pub(super) fn stop_gradient(&mut self, a: Tensor, at: &Location<'_>) -> Tensor {
        let op = "stop_gradient";
        if !self.owns(a, op, at) {
            return self.stand_in(scalar_ty(DType::F32));
        }
        let ty = self.ty_of(a);
        self.push(Op::StopGradient, vec![a.node], ty, op, at)
    }

    /// `a`, constrained to `spec` on a partitioned program's mesh.
    pub(super) fn shard(
        &mut self,
        a: Tensor,
        spec: crate::shard::PartitionSpec,
        at: &Location<'_>,
    ) -> Tensor {
        let op = "shard";
        if !self.owns(a, op, at) {
            return self.stand_in(scalar_ty(DType::F32));
        }
        let ty = self.ty_of(a);
        if spec.0.len() > ty.dims.len() {
            return self.fail(
                op,
                format!(
                    "the spec {spec} names {} dims, the tensor {ty} has {}",
                    spec.0.len(),
                    ty.dims.len()
                ),
                at,
                ty,
            );
        }
        self.push(Op::Shard(spec), vec![a.node], ty, op, at)
    }

    /// The sum of `a` over every replica of the program being traced.
    pub(super) fn all_reduce(&mut self, a: Tensor, op: &'static str, at: &Location<'_>) -> Tensor {
        if !self.owns(a, op, at) {
            return self.stand_in(scalar_ty(DType::F32));
        }
        let ty = self.ty_of(a);
        if ty.dtype == DType::Bool {
            return self.fail(
                op,
                format!("cannot sum a bool tensor over replicas ({ty}); convert it first"),
                at,
                ty,
            );
        }
        self.push(Op::AllReduce, vec![a.node], ty, op, at)
    }

    pub(super) fn convert(&mut self, a: Tensor, dtype: DType, at: &Location<'_>) -> Tensor {
        let ty = self.ty_of(a);
        if ty.dtype == dtype {
            return a;
        }
        // A wider dtype can take a type over the size limit.
        self.push(
            Op::Convert,
            vec![a.node],
            with_dims(dtype, ty.dims),
            "convert",
            at,
        )
    }

    pub(super) fn select(
        &mut self,
        pred: Tensor,
        on_true: Operand,
        on_false: Operand,
        at: &Location<'_>,
    ) -> Tensor {
        if !self.owns(pred, "select", at) {
            return self.stand_in_for(&[on_true, on_false]);
        }
        let pt = self.ty_of(pred);
        if pt.dtype != DType::Bool {
            let t = self.stand_in_for(&[on_true, on_false]);
            let ty = self.ty_of(t);
            return self.fail(
                "select",
                format!("the predicate must be a bool tensor, got {pt}"),
                at,
                ty,
            );
        }
        let Some(vals) = self.unify(&[on_true, on_false], "select", at) else {
            return self.stand_in_for(&[on_true, on_false]);
        };
        let vt = self.ty_of(vals[0]);
        let Some(dims) = broadcast_dims(&pt.dims, &vt.dims) else {
            return self.fail(
                "select",
                format!("cannot broadcast the predicate {pt} with the values {vt}"),
                at,
                vt,
            );
        };
        let p = self.broadcast_to(pred, &dims, "select", at);
        let a = self.broadcast_to(vals[0], &dims, "select", at);
        let b = self.broadcast_to(vals[1], &dims, "select", at);
        self.push(
            Op::Select,
            vec![p.node, a.node, b.node],
            with_dims(vt.dtype, dims),
            "select",
            at,
        )
    }
}

macro_rules! at {
    () => {
        Location::caller()
    };
}

impl Tensor {
    // ---- constants and creation ------------------------------------------------------------

    /// A constant tensor holding `array` (large arrays are emitted compactly, as hex).
    pub fn constant(array: Array) -> Tensor {
        with_recording(|r| r.constant(array))
    }

    /// A rank-0 constant of `dtype`.
    #[track_caller]
    pub fn scalar(value: f64, dtype: DType) -> Tensor {
        let at = at!();
        with_recording(|r| r.scalar(value, dtype, "constant", at))
    }

    /// A tensor of `dims` filled with `value`.
    #[track_caller]
    pub fn full(dims: &[usize], value: f64, dtype: DType) -> Tensor {
        let at = at!();
        with_recording(|r| {
            let s = r.scalar(value, dtype, "constant", at);
            r.broadcast_to(s, dims, "full", at)
        })
    }

    /// Zeros of this tensor's type.
    pub fn zeros_like(self) -> Tensor {
        let ty = self.ty();
        Tensor::full(&ty.dims, 0.0, ty.dtype)
    }

    // ---- element-wise ----------------------------------------------------------------------

    /// `e^x`.
    #[track_caller]
    pub fn exp(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Exp, self, at))
    }

    /// Natural logarithm.
    #[track_caller]
    pub fn log(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Log, self, at))
    }

    /// Hyperbolic tangent.
    #[track_caller]
    pub fn tanh(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Tanh, self, at))
    }

    /// The logistic sigmoid `1 / (1 + e^-x)`.
    #[track_caller]
    pub fn logistic(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Logistic, self, at))
    }

    /// Square root.
    #[track_caller]
    pub fn sqrt(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Sqrt, self, at))
    }

    /// `1 / sqrt(x)`.
    #[track_caller]
    pub fn rsqrt(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Rsqrt, self, at))
    }

    /// Absolute value.
    #[track_caller]
    pub fn abs(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Abs, self, at))
    }

    /// `self ^ rhs`, broadcasting.
    #[track_caller]
    pub fn pow(self, rhs: impl Into<Operand>) -> Tensor {
        let at = at!();
        with_recording(|r| r.binary(BinaryOp::Pow, self.into(), rhs.into(), at))
    }

    /// Element-wise maximum, broadcasting. A NaN operand gives NaN (as NumPy's `maximum`), on
    /// every backend; `-0` orders below `+0`.
    #[track_caller]
    pub fn maximum(self, rhs: impl Into<Operand>) -> Tensor {
        let at = at!();
        with_recording(|r| r.binary(BinaryOp::Max, self.into(), rhs.into(), at))
    }

    /// Element-wise minimum, broadcasting. A NaN operand gives NaN (as NumPy's `minimum`), on
    /// every backend; `-0` orders below `+0`.
    #[track_caller]
    pub fn minimum(self, rhs: impl Into<Operand>) -> Tensor {
        let at = at!();
        with_recording(|r| r.binary(BinaryOp::Min, self.into(), rhs.into(), at))
    }

    /// `max(x, 0)`, with derivative 0 at 0 — as JAX's `jax.nn.relu` and PyTorch's `relu`
    /// define it, and unlike `maximum(x, 0)`, whose gradient splits a tie evenly (½ at 0, which
    /// a zero-initialised bias over blank input meets everywhere). A NaN stays NaN.
    #[track_caller]
    pub fn relu(self) -> Tensor {
        Tensor::select(self.less_equal(0.0), 0.0, self)
    }

    /// Converts to another element type (floats to ints truncate toward zero; to bool is `x != 0`).
    #[track_caller]
    pub fn convert(self, dtype: DType) -> Tensor {
        let at = at!();
        with_recording(|r| r.convert(self, dtype, at))
    }

    // ---- comparisons and selection ---------------------------------------------------------

    fn cmp(self, op: CmpOp, rhs: Operand, at: &Location<'_>) -> Tensor {
        with_recording(|r| r.compare(op, self.into(), rhs, at))
    }

    /// `self == rhs`, element-wise (bool result).
    #[track_caller]
    pub fn equal(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Eq, rhs.into(), at!())
    }

    /// `self != rhs`, element-wise.
    #[track_caller]
    pub fn not_equal(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Ne, rhs.into(), at!())
    }

    /// `self < rhs`, element-wise.
    #[track_caller]
    pub fn less(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Lt, rhs.into(), at!())
    }

    /// `self <= rhs`, element-wise.
    #[track_caller]
    pub fn less_equal(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Le, rhs.into(), at!())
    }

    /// `self > rhs`, element-wise.
    #[track_caller]
    pub fn greater(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Gt, rhs.into(), at!())
    }

    /// `self >= rhs`, element-wise.
    #[track_caller]
    pub fn greater_equal(self, rhs: impl Into<Operand>) -> Tensor {
        self.cmp(CmpOp::Ge, rhs.into(), at!())
    }

    /// `on_true` where `pred` holds, else `on_false`; all three broadcast together.
    #[track_caller]
    pub fn select(
        pred: Tensor,
        on_true: impl Into<Operand>,
        on_false: impl Into<Operand>,
    ) -> Tensor {
        let at = at!();
        with_recording(|r| r.select(pred, on_true.into(), on_false.into(), at))
    }

    /// This tensor's value, as a constant to differentiation: no gradient flows back through
    /// it to what it was computed from. For a shift that cancels out of the result (the
    /// maximum subtracted in a stable softmax) or a target held fixed.
    #[track_caller]
    pub fn stop_gradient(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.stop_gradient(self, at))
    }

    /// The element-wise sum of this tensor over every replica of a replicated program (one
    /// replica per device, see [`crate::train::Config::devices`]): every replica gets the same
    /// sum. In a program traced for one device it is the tensor itself. The gradient of a
    /// replica's input is the sum of the cotangents over all replicas.
    #[track_caller]
    pub fn all_sum(self) -> Tensor {
        let at = at!();
        if with_recording(|r| r.graph.replicas) == 1 {
            return self;
        }
        with_recording(|r| r.all_reduce(self, "all_sum", at))
    }

    /// This tensor, constrained to be split over the mesh of a partitioned program as `spec`
    /// says (JAX's `with_sharding_constraint`): XLA's partitioner then lays the value out so,
    /// and propagates from it — to split an activation along the batch axis, say, or to keep a
    /// tensor-parallel layer's output split. The gradient is constrained the same way. In a
    /// program that is not partitioned (one device, replicas, the interpreter) it is the tensor
    /// itself. A spec naming an axis the mesh lacks, or a dim that does not divide, is an
    /// error when the program is traced for that mesh.
    ///
    /// ```
    /// use nitro::shard::PartitionSpec;
    /// use nitro::trace::{grad, trace};
    /// use nitro::{DType, LeafType};
    ///
    /// let x = LeafType::new(DType::F32, &[8, 4]);
    /// let graph = trace(&[("x".into(), x)], |i| {
    ///     let h = i[0].shard(PartitionSpec::new([Some("data"), None])).tanh();
    ///     grad(h.sum_all(), &[i[0]])
    /// })?;
    /// assert_eq!(graph.output_types()[0].dims, vec![8, 4]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    #[track_caller]
    pub fn shard(self, spec: crate::shard::PartitionSpec) -> Tensor {
        let at = at!();
        with_recording(|r| r.shard(self, spec, at))
    }

    /// The element-wise mean of this tensor over every replica (float tensors): [`Tensor::all_sum`]
    /// divided by the replica count ([`crate::trace::replicas`]).
    #[track_caller]
    pub fn all_mean(self) -> Tensor {
        let at = at!();
        let n = with_recording(|r| r.graph.replicas);
        if n == 1 {
            return self;
        }
        with_recording(|r| r.all_reduce(self, "all_mean", at)) / n as f64
    }
}

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl<R: Into<Operand>> ops::$trait<R> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: R) -> Tensor {
                let at = at!();
                with_recording(|r| r.binary($op, self.into(), rhs.into(), at))
            }
        }

        impl ops::$trait<Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                let at = at!();
                with_recording(|r| r.binary($op, Operand::Scalar(self), rhs.into(), at))
            }
        }
    };
}

binary_operator!(Add, add, BinaryOp::Add);
binary_operator!(Sub, sub, BinaryOp::Sub);
binary_operator!(Mul, mul, BinaryOp::Mul);
binary_operator!(Div, div, BinaryOp::Div);

impl ops::Neg for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        let at = at!();
        with_recording(|r| r.unary(UnaryOp::Neg, self, at))
    }
}
