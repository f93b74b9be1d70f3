//! The intermediate representation: a static-shape dataflow graph.
//!
//! Nodes are appended in creation order, so every node's inputs precede it: the node list is a
//! topological order, which emission, interpretation and autodiff all rely on.

use std::fmt;
use std::sync::Arc;

use crate::tree::{Array, DType, LeafType};

/// The index of a node in its [`Graph`].
pub type NodeId = u32;

/// Element-wise functions of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Hyperbolic tangent.
    Tanh,
    /// `1 / (1 + e^-x)`.
    Logistic,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// Absolute value.
    Abs,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// The error function (emitted as `chlo.erf`).
    Erf,
    /// The inverse error function on (−1, 1) (emitted as `chlo.erf_inv`).
    ErfInv,
    /// `ln(1 + x)`, accurate near 0.
    Log1p,
    /// `e^x − 1`, accurate near 0.
    Expm1,
    /// −1, 0 or 1 by sign (NaN stays NaN; −0 stays −0).
    Sign,
    /// Rounds toward −∞.
    Floor,
    /// Rounds toward +∞.
    Ceil,
    /// Rounds to the nearest integer, ties to even.
    RoundNearestEven,
    /// Bitwise not (logical not for `bool`).
    Not,
    /// The number of set bits.
    Popcnt,
}

impl UnaryOp {
    /// The op's name (as in StableHLO, without the dialect prefix).
    pub const fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "negate",
            UnaryOp::Exp => "exponential",
            UnaryOp::Log => "log",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Logistic => "logistic",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Sin => "sine",
            UnaryOp::Cos => "cosine",
            UnaryOp::Erf => "erf",
            UnaryOp::ErfInv => "erf_inv",
            UnaryOp::Log1p => "log_plus_one",
            UnaryOp::Expm1 => "exponential_minus_one",
            UnaryOp::Sign => "sign",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::RoundNearestEven => "round_nearest_even",
            UnaryOp::Not => "not",
            UnaryOp::Popcnt => "popcnt",
        }
    }

    /// Whether the op is defined only for floating-point operands.
    pub const fn float_only(self) -> bool {
        !matches!(
            self,
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Not | UnaryOp::Popcnt
        )
    }

    /// Whether the op is defined only for integer (and, for `not`, bool) operands.
    pub const fn bits_only(self) -> bool {
        matches!(self, UnaryOp::Not | UnaryOp::Popcnt)
    }

    /// The dialect the op is emitted in: `chlo` for the ops StableHLO lacks (XLA expands them).
    pub const fn dialect(self) -> &'static str {
        match self {
            UnaryOp::Erf | UnaryOp::ErfInv => "chlo",
            _ => "stablehlo",
        }
    }
}

/// Element-wise functions of two operands of one shape and dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (integer division truncates toward zero).
    Div,
    /// `a ^ b`.
    Pow,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// `atan2(a, b)`: the angle of the point `(b, a)`.
    Atan2,
    /// The remainder of truncating division, with the sign of `a` (C's `fmod` for floats).
    Rem,
    /// Bitwise and (logical for `bool`).
    And,
    /// Bitwise or (logical for `bool`).
    Or,
    /// Bitwise exclusive or (logical for `bool`).
    Xor,
    /// `a << b`; 0 when `b` is at least the bit width.
    ShiftLeft,
    /// `a >> b` filling with zeros; 0 when `b` is at least the bit width.
    ShiftRightLogical,
    /// `a >> b` filling with the sign bit; all sign bits when `b` is at least the bit width.
    ShiftRightArithmetic,
}

impl BinaryOp {
    /// The op's name (as in StableHLO, without the dialect prefix).
    pub const fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "subtract",
            BinaryOp::Mul => "multiply",
            BinaryOp::Div => "divide",
            BinaryOp::Pow => "power",
            BinaryOp::Max => "maximum",
            BinaryOp::Min => "minimum",
            BinaryOp::Atan2 => "atan2",
            BinaryOp::Rem => "remainder",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::ShiftLeft => "shift_left",
            BinaryOp::ShiftRightLogical => "shift_right_logical",
            BinaryOp::ShiftRightArithmetic => "shift_right_arithmetic",
        }
    }

    /// Whether the op is defined only for integer (and, for the logical ops, bool) operands.
    pub const fn bits_only(self) -> bool {
        matches!(
            self,
            BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRightLogical
                | BinaryOp::ShiftRightArithmetic
        )
    }

    /// Whether the op is defined only for floats.
    pub const fn float_only(self) -> bool {
        matches!(self, BinaryOp::Atan2)
    }
}

/// Comparison directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    /// `==`.
    Eq,
    /// `!=`.
    Ne,
    /// `<`.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
}

impl CmpOp {
    /// The StableHLO comparison direction (`EQ`, `LT`, …).
    pub const fn direction(self) -> &'static str {
        match self {
            CmpOp::Eq => "EQ",
            CmpOp::Ne => "NE",
            CmpOp::Lt => "LT",
            CmpOp::Le => "LE",
            CmpOp::Gt => "GT",
            CmpOp::Ge => "GE",
        }
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (init 0).
    Sum,
    /// Maximum (init −∞, or the type's minimum).
    Max,
    /// Minimum (init +∞, or the type's maximum).
    Min,
}

/// Dimension numbers of a `dot_general`. Output dims are: batch dims (in `lhs_batch` order), then
/// the lhs free dims, then the rhs free dims, each in ascending order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DotDims {
    /// Batch dims of the lhs.
    pub lhs_batch: Vec<usize>,
    /// Batch dims of the rhs (paired with `lhs_batch`).
    pub rhs_batch: Vec<usize>,
    /// Contracting dims of the lhs.
    pub lhs_contract: Vec<usize>,
    /// Contracting dims of the rhs (paired with `lhs_contract`).
    pub rhs_contract: Vec<usize>,
}

/// A window sliding over every dim of an operand: the attributes of `reduce_window` and
/// `select_and_scatter` (one entry per operand dim in each list).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    /// The window's size per dim.
    pub dims: Vec<usize>,
    /// The step between windows per dim (≥ 1).
    pub strides: Vec<usize>,
    /// Elements added before and after each dim (negative removes).
    pub padding: Vec<(i64, i64)>,
    /// Dilation of the operand (`d − 1` holes between elements; 1 for none).
    pub base_dilation: Vec<usize>,
    /// Dilation of the window (`d − 1` skipped elements between taps; 1 for none).
    pub window_dilation: Vec<usize>,
}

/// Which dim of each operand and of the result plays which role in a convolution
/// (StableHLO's `dim_numbers`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    /// The input's batch dim.
    pub input_batch: usize,
    /// The input's feature (channel) dim.
    pub input_feature: usize,
    /// The input's spatial dims, in order.
    pub input_spatial: Vec<usize>,
    /// The kernel's input-feature dim.
    pub kernel_input: usize,
    /// The kernel's output-feature dim.
    pub kernel_output: usize,
    /// The kernel's spatial dims, paired with the input's.
    pub kernel_spatial: Vec<usize>,
    /// The result's batch dim.
    pub output_batch: usize,
    /// The result's feature dim.
    pub output_feature: usize,
    /// The result's spatial dims, paired with the input's.
    pub output_spatial: Vec<usize>,
}

/// A convolution's attributes (one entry per spatial dim in each list).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Conv {
    /// Which dim is which.
    pub dims: ConvDims,
    /// The step between windows.
    pub strides: Vec<usize>,
    /// Elements added before and after each spatial dim of the (dilated) input; negative
    /// removes.
    pub padding: Vec<(i64, i64)>,
    /// Input dilation (`d − 1` zeros between elements: a transposed convolution).
    pub lhs_dilation: Vec<usize>,
    /// Kernel dilation (atrous convolution).
    pub rhs_dilation: Vec<usize>,
    /// Groups of input features, each convolved with its own slice of the kernel's outputs
    /// (depthwise when it equals the input features).
    pub feature_groups: usize,
    /// Groups of the batch, each convolved with its own slice of the kernel's outputs (what
    /// the kernel gradient of a grouped convolution uses).
    pub batch_groups: usize,
    /// The result's dtype when it is not the operands' (`f32` for `bf16`/`f16` operands:
    /// products accumulated in f32), as JAX's `preferred_element_type`.
    pub preferred_element_type: Option<DType>,
}

/// A gather's dimension numbers (StableHLO's, without batching dims).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GatherDims {
    /// Result dims that index within a slice (the others index the batch of starts).
    pub offset_dims: Vec<usize>,
    /// Operand dims whose slice size is 1 and that the result drops.
    pub collapsed_slice_dims: Vec<usize>,
    /// The operand dim each component of an index vector starts.
    pub start_index_map: Vec<usize>,
    /// The dim of the indices that holds index vectors (equal to its rank: one scalar each).
    pub index_vector_dim: usize,
    /// The size of the slice taken from each operand dim.
    pub slice_sizes: Vec<usize>,
}

/// A scatter's dimension numbers (StableHLO's, without batching dims).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScatterDims {
    /// Dims of the updates that index within a window.
    pub update_window_dims: Vec<usize>,
    /// Operand dims of size 1 that the window does not have.
    pub inserted_window_dims: Vec<usize>,
    /// The operand dim each component of an index vector starts.
    pub scatter_dims_to_operand_dims: Vec<usize>,
    /// The dim of the indices that holds index vectors (equal to its rank: one scalar each).
    pub index_vector_dim: usize,
}

/// How a scatter combines an update with the element it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScatterKind {
    /// `old + update` (repeated indices add up).
    Add,
    /// `update` (with repeated indices, one of them wins; which is unspecified).
    Replace,
}

/// What a node computes. Inputs are in [`Node::inputs`]; the result type is [`Node::ty`].
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Program input number `index`.
    Parameter {
        /// Position among the program's inputs.
        index: usize,
    },
    /// A constant array (shared, so cloning a graph does not copy large constants).
    Constant(Arc<Array>),
    /// Indices along `axis` (result type from the node).
    Iota {
        /// The dim that counts.
        axis: usize,
    },
    /// An element-wise unary function.
    Unary(UnaryOp),
    /// An element-wise binary function (operands of identical type).
    Binary(BinaryOp),
    /// An element-wise comparison, giving `bool`.
    Compare(CmpOp),
    /// `select(pred, on_true, on_false)`, element-wise.
    Select,
    /// Element type conversion to the node's dtype.
    Convert,
    /// Broadcast: operand dim `i` becomes result dim `dims[i]` (size equal, or 1).
    BroadcastInDim {
        /// Result dim of each operand dim.
        dims: Vec<usize>,
    },
    /// Same elements in row-major order, new dims.
    Reshape,
    /// Result dim `i` is operand dim `perm[i]`.
    Transpose {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// A strided window.
    Slice {
        /// First index per dim.
        start: Vec<usize>,
        /// One past the last index per dim.
        limit: Vec<usize>,
        /// Step per dim (≥ 1).
        strides: Vec<usize>,
    },
    /// Operands joined along `axis`.
    Concatenate {
        /// The joined dim.
        axis: usize,
    },
    /// A generalized matrix product.
    DotGeneral(DotDims),
    /// A reduction over `axes` (removed from the result).
    Reduce {
        /// Which reduction.
        kind: ReduceOp,
        /// Reduced dims, ascending.
        axes: Vec<usize>,
    },
    /// The element-wise sum of the operand over every replica of a replicated program
    /// ([`Graph::replicas`]): each replica gets the same result. With one replica it is the
    /// operand itself.
    AllReduce,
    /// The operand itself, constrained to be split over a partitioned program's mesh as the
    /// spec says (Shardy's `sdy.sharding_constraint`, JAX's `with_sharding_constraint`): see
    /// [`Tensor::shard`](crate::trace::Tensor::shard). In a program that is not partitioned it
    /// is the operand itself.
    Shard(crate::shard::PartitionSpec),
    /// The operand itself, through which no gradient flows: the reverse pass gives its
    /// operand no cotangent. Emitted as a same-shape reshape, which XLA removes.
    StopGradient,
    /// `clamp(min, x, max)` element-wise (inputs in that order; `min`/`max` may be scalars).
    Clamp,
    /// The operand's bits as another dtype of the same width.
    BitcastConvert,
    /// Padding with a scalar value (inputs: operand, value): `low`/`high` elements before and
    /// after each dim (negative removes), `interior` between neighbours.
    Pad {
        /// Before each dim.
        low: Vec<i64>,
        /// After each dim.
        high: Vec<i64>,
        /// Between each pair of neighbours.
        interior: Vec<usize>,
    },
    /// The operand with the order of `axes` reversed.
    Reverse {
        /// The reversed dims.
        axes: Vec<usize>,
    },
    /// A convolution (inputs: input, kernel).
    Convolution(Box<Conv>),
    /// A reduction over sliding windows.
    ReduceWindow {
        /// Which reduction (its init as in [`Op::Reduce`]).
        kind: ReduceOp,
        /// The windows.
        window: Window,
    },
    /// The gradient of a max (or min) `reduce_window` (inputs: operand, source): each window's
    /// source value is added at the position its selection picks (the first maximum, or
    /// minimum, in row-major window order); everything else is 0.
    SelectAndScatter {
        /// `Max` or `Min`: what a window selects.
        kind: ReduceOp,
        /// The windows (dilations of 1).
        window: Window,
    },
    /// Slices of the operand at start indices (inputs: operand, indices).
    Gather(GatherDims),
    /// Updates written into the operand at start indices (inputs: operand, indices, updates).
    Scatter {
        /// Dimension numbers.
        dims: ScatterDims,
        /// Add or replace.
        kind: ScatterKind,
    },
    /// A slice of static `sizes` at traced start indices (inputs: operand, then one integer
    /// scalar per dim), each start clamped to `0..=dim − size`.
    DynamicSlice {
        /// The slice's dims.
        sizes: Vec<usize>,
    },
    /// The operand with an update written at traced start indices (inputs: operand, update,
    /// then one integer scalar per dim), each start clamped to `0..=dim − update dim`.
    DynamicUpdateSlice,
    /// A loop with a static trip count over a body sub-graph ([`ScanOp`]). Inputs: the initial
    /// carry, the stacked inputs (`xs`, each with a leading axis of the trip count), then the
    /// loop-invariant values the body reads. It has several results — the final carry, then
    /// the stacked per-iteration outputs — read through [`Op::Result`] nodes; the node's own
    /// type is that of its first result.
    Scan(Box<ScanOp>),
    /// A loop while a traced condition holds ([`WhileOp`]): inputs are the initial carry,
    /// then the loop-invariant values its body reads; results (through [`Op::Result`]) are
    /// the final carry. Its trip count is not known when tracing, so it has no derivative.
    While(Box<WhileOp>),
    /// Result `index` of the multi-result node that is its one input (an [`Op::Scan`] or
    /// [`Op::While`]).
    Result {
        /// Which result.
        index: usize,
    },
}

/// The attributes of an [`Op::While`]: `while cond(carry) { carry = body(carry) }`.
#[derive(Clone, Debug, PartialEq)]
pub struct WhileOp {
    /// The condition and the body as one graph: inputs are the carry, then the invariants;
    /// outputs are the condition (`bool[]`), then the new carry (the carry's types).
    pub body: Arc<Graph>,
    /// How many carried values there are.
    pub carry: usize,
}

/// How the reverse pass of a [`scan`](crate::trace::Scan) gets the forward pass's
/// per-iteration values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, crate::ContentHash)]
pub enum Remat {
    /// The forward loop also stacks the per-iteration values the backward loop reads (its
    /// residuals): the results of products, reductions and other non-element-wise ops, and
    /// the carries; element-wise and layout ops are recomputed from them, fused by XLA. The
    /// fast backward pass, memory growing with the trip count times those intermediates,
    /// about what an unrolled loop keeps.
    #[default]
    Save,
    /// The forward loop stacks only its carries; each backward iteration recomputes its
    /// iteration's forward pass from the saved carry (`checkpoint` in JAX): about one more
    /// forward pass of compute, memory growing with the trip count times the carry only.
    Recompute,
}

/// The attributes of an [`Op::Scan`]: `carry, ys[t] = body(carry, xs[t], consts)` for `t` in
/// `0..length` (or backwards when `reverse`).
#[derive(Clone, Debug, PartialEq)]
pub struct ScanOp {
    /// The body: inputs are the carry, one slice of each stacked input (without the leading
    /// axis), then the invariants; outputs are the new carry (same types), then the
    /// per-iteration outputs.
    pub body: Arc<Graph>,
    /// The trip count (≥ 1; a scan of 0 iterations is never recorded).
    pub length: usize,
    /// Whether iteration `t` reads and writes index `length − 1 − t`.
    pub reverse: bool,
    /// How many carried values there are.
    pub carry: usize,
    /// How many stacked inputs there are.
    pub xs: usize,
    /// What the reverse pass saves.
    pub remat: Remat,
}

impl WhileOp {
    /// The types of the loop's results: the carry's.
    pub fn result_types(&self) -> Vec<LeafType> {
        self.body
            .input_types()
            .into_iter()
            .take(self.carry)
            .collect()
    }
}

impl ScanOp {
    /// How many per-iteration outputs the body has.
    pub fn ys(&self) -> usize {
        self.body.outputs.len().saturating_sub(self.carry)
    }

    /// The types of the scan's results: the carry's, then each per-iteration output's stacked
    /// with a leading axis of `length`.
    pub fn result_types(&self) -> Vec<LeafType> {
        let outs = self.body.output_types();
        outs.iter()
            .enumerate()
            .map(|(k, t)| {
                if k < self.carry {
                    t.clone()
                } else {
                    let mut dims = vec![self.length];
                    dims.extend(&t.dims);
                    with_dims(t.dtype, dims)
                }
            })
            .collect()
    }
}

impl Op {
    /// The op's name in errors and in StableHLO.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Constant(_) => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Compare(_) => "compare",
            Op::Select => "select",
            Op::Convert => "convert",
            Op::BroadcastInDim { .. } => "broadcast_in_dim",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concatenate { .. } => "concatenate",
            Op::DotGeneral(_) => "dot_general",
            Op::Reduce { .. } => "reduce",
            Op::AllReduce => "all_reduce",
            Op::Shard(_) => "sharding_constraint",
            Op::StopGradient => "stop_gradient",
            Op::Clamp => "clamp",
            Op::BitcastConvert => "bitcast_convert",
            Op::Pad { .. } => "pad",
            Op::Reverse { .. } => "reverse",
            Op::Convolution(_) => "convolution",
            Op::ReduceWindow { .. } => "reduce_window",
            Op::SelectAndScatter { .. } => "select_and_scatter",
            Op::Gather(_) => "gather",
            Op::Scatter { .. } => "scatter",
            Op::DynamicSlice { .. } => "dynamic_slice",
            Op::DynamicUpdateSlice => "dynamic_update_slice",
            Op::Scan(_) => "scan",
            Op::While(_) => "while_loop",
            Op::Result { .. } => "result",
        }
    }
}

/// One node: an op, its inputs and its result type.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What it computes.
    pub op: Op,
    /// Its operands, all earlier nodes.
    pub inputs: Vec<NodeId>,
    /// The result's dtype and dims.
    pub ty: LeafType,
}

/// A named program input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Input {
    /// Where it comes from (`layers[0].w`, `x`).
    pub name: String,
    /// Its type.
    pub ty: LeafType,
    /// Its parameter node.
    pub node: NodeId,
}

/// A recorded program: nodes in topological order, inputs and outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// All nodes; inputs of a node always precede it.
    pub nodes: Vec<Node>,
    /// Program inputs, in parameter order.
    pub inputs: Vec<Input>,
    /// Program outputs, in order.
    pub outputs: Vec<NodeId>,
    /// How many replicas of the program run at once, one per device, each on its own inputs
    /// ([`Op::AllReduce`] sums over them). 1 for a program on one device.
    pub replicas: usize,
    /// Inputs the program reads as class indices (the labels of
    /// [`nn::softmax_cross_entropy`](crate::trace::nn::softmax_cross_entropy) and
    /// [`nn::correct`](crate::trace::nn::correct)): values outside `0..classes` would be
    /// silently wrong, so the training handle checks them on the host.
    pub class_inputs: Vec<ClassInput>,
    /// How the program is partitioned over a mesh of devices (XLA's SPMD partitioner), one
    /// spec per input and per output at their global shapes; `None` for a program that runs
    /// whole on each device it runs on.
    pub sharding: Option<crate::shard::ProgramSharding>,
}

/// A program input read as class indices in `0..classes` (see [`Graph::class_inputs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassInput {
    /// The input's position ([`Graph::inputs`]).
    pub input: usize,
    /// How many classes there are.
    pub classes: usize,
    /// The op that reads it.
    pub op: &'static str,
}

impl Default for Graph {
    fn default() -> Graph {
        Graph {
            nodes: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            replicas: 1,
            class_inputs: Vec::new(),
            sharding: None,
        }
    }
}

impl Graph {
    /// The node with this id.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// The type of a node's result.
    pub fn ty(&self, id: NodeId) -> &LeafType {
        &self.nodes[id as usize].ty
    }

    /// Appends a node, returning its id.
    pub fn push(&mut self, op: Op, inputs: Vec<NodeId>, ty: LeafType) -> NodeId {
        let id = self.nodes.len() as NodeId;
        self.nodes.push(Node { op, inputs, ty });
        id
    }

    /// The input types in parameter order.
    pub fn input_types(&self) -> Vec<LeafType> {
        self.inputs.iter().map(|i| i.ty.clone()).collect()
    }

    /// The output types in order.
    pub fn output_types(&self) -> Vec<LeafType> {
        self.outputs.iter().map(|&o| self.ty(o).clone()).collect()
    }

    /// The nodes that some output depends on (a mask indexed by node id).
    pub fn live(&self) -> Vec<bool> {
        let mut live = vec![false; self.nodes.len()];
        for &o in &self.outputs {
            live[o as usize] = true;
        }
        for id in (0..self.nodes.len()).rev() {
            if live[id] {
                for &i in &self.nodes[id].inputs {
                    live[i as usize] = true;
                }
            }
        }
        live
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (id, n) in self.nodes.iter().enumerate() {
            write!(f, "%{id} = {}", n.op.name())?;
            for i in &n.inputs {
                write!(f, " %{i}")?;
            }
            writeln!(f, " : {}", n.ty)?;
        }
        write!(f, "outputs:")?;
        for o in &self.outputs {
            write!(f, " %{o}")?;
        }
        Ok(())
    }
}

/// The float type of a node, when it has one.
pub(crate) fn is_float(ty: &LeafType) -> bool {
    ty.dtype.is_float()
}

/// Dims after removing `axes` (ascending).
pub(crate) fn reduced_dims(dims: &[usize], axes: &[usize]) -> Vec<usize> {
    dims.iter()
        .enumerate()
        .filter(|(i, _)| !axes.contains(i))
        .map(|(_, &d)| d)
        .collect()
}

/// The type with new dims.
pub(crate) fn with_dims(dtype: DType, dims: Vec<usize>) -> LeafType {
    LeafType { dtype, dims }
}
