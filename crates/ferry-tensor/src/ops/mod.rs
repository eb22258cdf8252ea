//! The op set. Forward code per family; every gradient rule sits in the crate's `rules` module.

pub(crate) mod create;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod nn;
pub mod optim;
pub(crate) mod reduce;
pub(crate) mod shape;

/// Elementwise functions of one tensor (scalars travel inside the op).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// natural log
    Log,
    /// `max(x, 0)`
    Relu,
    /// hyperbolic tangent
    Tanh,
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `√x`
    Sqrt,
    /// `|x|`
    Abs,
    /// `1` where `x > 0`, else `0` (relu's derivative)
    Step,
    /// `x + c`
    AddScalar(f64),
    /// `x * c`
    MulScalar(f64),
    /// `x^p`
    PowScalar(f64),
}

impl UnaryOp {
    /// The op's name in graphs and errors.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Relu => "relu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Step => "step",
            UnaryOp::AddScalar(_) => "add_scalar",
            UnaryOp::MulScalar(_) => "mul_scalar",
            UnaryOp::PowScalar(_) => "powf",
        }
    }
}

/// Elementwise functions of two broadcast tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
}

impl BinaryOp {
    /// The op's name in graphs and errors.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// Elementwise comparisons; results are `u8` (1 true, 0 false).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl CmpOp {
    /// The op's name in errors.
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

/// Reductions along one axis (or all elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Index of the maximum (first one on ties), as `i64`.
    ArgMax,
}
