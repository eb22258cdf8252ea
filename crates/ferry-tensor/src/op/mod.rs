//! The op vocabulary: what the kernels of every device and the ops above them share, and
//! nothing else. It imports no module of the crate but `error` and `layout`, so the backend and
//! its kernels (`cpu`, `cuda`) can name an op without knowing the ops that use it.
//!
//! The elementwise and reduction ops are declared once, in the table below: each row gives an
//! op's variant, name, CUDA op code, CPU function and CUDA C expression. From it come the enums,
//! `name()`, `code()`, the CPU kernels' per-op dispatch and the CUDA C device functions that the
//! kernels in kernels/ switch through (an unknown code traps). Beside the table: the geometry of
//! a convolution window ([`conv`]), the sizes and options of an attention call ([`attention`]), the scalars of an Adam step ([`optim`]), the scalar math the
//! CPU rows call ([`math`]), and the messages kernels of both devices report ([`message`]).

pub(crate) mod attention;
pub(crate) mod conv;
pub(crate) mod math;
pub(crate) mod message;
pub(crate) mod optim;
mod table;

pub use optim::AdamStep;

use ferry_memory::DType;

/// A loop over elements that a unary op hands its per-element function to, once per call: the
/// loop is compiled for each op, and no `match` runs per element (so it vectorises).
pub(crate) trait UnaryLoop<T> {
    type Output;
    fn run(self, f: impl Fn(T) -> T + Sync) -> Self::Output;
}

/// The same for functions of two elements (binary ops, comparisons).
pub(crate) trait BinaryLoop<T, U> {
    type Output;
    fn run(self, f: impl Fn(T, T) -> U + Sync) -> Self::Output;
}

// The op table. In each row the CPU function is Rust over the element type `T` (scalars arrive as
// `T`); the CUDA expression is C over the type kernels compute in, `A` (`Num<T>::Acc` in
// kernels/common.cuh: float for f32/f16/bf16/u8, double for f64/i64), with the same names, and
// may call any CUDA math function (float and double overloads) or a helper of common.cuh.
// Codes are what the kernels receive; a family's codes must be unique (checked at compile time).
table::op_table! {
    /// Elementwise functions of one tensor (scalars travel inside the op).
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub enum UnaryOp {
        /// `-x`
        Neg => "neg", 0, |v| -v, "-v";
        /// `e^x`
        Exp => "exp", 1, |v| v.exp(), "m_exp(v)";
        /// natural log
        Log => "log", 2, |v| v.ln(), "m_log(v)";
        /// `max(x, 0)`
        Relu => "relu", 3,
            |v| if v > T::zero() { v } else { T::zero() }, "v > (A)0 ? v : (A)0";
        /// hyperbolic tangent
        Tanh => "tanh", 4, |v| v.tanh(), "m_tanh(v)";
        /// `1 / (1 + e^-x)`
        Sigmoid => "sigmoid", 5,
            |v| T::one() / (T::one() + (-v).exp()), "(A)1 / ((A)1 + m_exp(-v))";
        /// `√x`
        Sqrt => "sqrt", 6, |v| v.sqrt(), "m_sqrt(v)";
        /// `|x|`
        Abs => "abs", 7, |v| v.abs(), "v < (A)0 ? -v : v";
        /// `1` where `x > 0`, else `0` (relu's derivative)
        Step => "step", 8,
            |v| if v > T::zero() { T::one() } else { T::zero() }, "v > (A)0 ? (A)1 : (A)0";
        /// `x + c`
        AddScalar(c) => "add_scalar", 9, |v| v + c, "v + c";
        /// `x * c`
        MulScalar(c) => "mul_scalar", 10, |v| v * c, "v * c";
        /// `x^p`
        PowScalar(p) => "powf", 11, |v| v.powf(p), "m_pow(v, p)";
        /// sine
        Sin => "sin", 12, |v| v.sin(),
            "sizeof(A) == 4 ? (A)sinf((float)v) : (A)sin((double)v)";
        /// cosine
        Cos => "cos", 13, |v| v.cos(),
            "sizeof(A) == 4 ? (A)cosf((float)v) : (A)cos((double)v)";
        /// `x σ(x)` (SiLU, swish)
        Silu => "silu", 14, |v| v / (T::one() + (-v).exp()), "v / ((A)1 + m_exp(-v))";
        /// GELU, tanh approximation: `x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))`
        GeluTanh => "gelu_tanh", 15,
            |v| crate::op::math::gelu_tanh_cpu(v),
            "(A)0.5 * v * ((A)1 + m_tanh((A)0.7978845608028654 * (v + (A)0.044715 * v * v * v)))";
        /// GELU, exact: `x Φ(x) = x/2 (1 + erf(x / √2))`
        Gelu => "gelu", 16,
            |v| crate::op::math::gelu_erf_cpu(v),
            "(A)0.5 * v * ((A)1 + (sizeof(A) == 4 ? (A)erff((float)(v * (A)0.7071067811865476)) : (A)erf((double)(v * (A)0.7071067811865476))))";
        /// `max(x, c)` (NaN stays NaN)
        ClampMin(c) => "clamp_min", 17, |v| if v < c { c } else { v }, "v < c ? c : v";
        /// `min(x, c)` (NaN stays NaN)
        ClampMax(c) => "clamp_max", 18, |v| if v > c { c } else { v }, "v > c ? c : v";
        /// `1` where `x >= c`, else `0` (clamp_min's derivative)
        StepGe(c) => "step_ge", 19,
            |v| if v >= c { T::one() } else { T::zero() }, "v >= c ? (A)1 : (A)0";
        /// `1` where `x <= c`, else `0` (clamp_max's derivative)
        StepLe(c) => "step_le", 20,
            |v| if v <= c { T::one() } else { T::zero() }, "v <= c ? (A)1 : (A)0";
    }

    /// Elementwise functions of two broadcast tensors.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BinaryOp {
        /// `a + b`
        Add => "add", 0, |a, b| a + b, "a + b";
        /// `a - b`
        Sub => "sub", 1, |a, b| a - b, "a - b";
        /// `a * b`
        Mul => "mul", 2, |a, b| a * b, "a * b";
        /// `a / b`
        Div => "div", 3, |a, b| a / b, "a / b";
        /// `g` where `y > 0`, else 0: relu's backward, from its output `y`, in one pass
        ReluBackward => "relu_backward", 4,
            |g, y| if y > T::zero() { g } else { T::zero() }, "y > (A)0 ? g : (A)0";
        /// `g (1 - y²)`: tanh's backward, from its output `y`, in one pass
        TanhBackward => "tanh_backward", 5, |g, y| g * (T::one() - y * y), "g * ((A)1 - y * y)";
        /// `g y (1 - y)`: sigmoid's backward, from its output `y`, in one pass
        SigmoidBackward => "sigmoid_backward", 6,
            |g, y| g * y * (T::one() - y), "g * y * ((A)1 - y)";
        /// `g σ(x) (1 + x (1 - σ(x)))`: silu's backward, from its input `x`, in one pass
        SiluBackward => "silu_backward", 7,
            |g, x| crate::op::math::silu_backward_cpu(g, x),
            "g * ((A)1 / ((A)1 + m_exp(-x))) * ((A)1 + x * ((A)1 - (A)1 / ((A)1 + m_exp(-x))))";
        /// gelu_tanh's backward, from its input `x`, in one pass
        GeluTanhBackward => "gelu_tanh_backward", 8,
            |g, x| crate::op::math::gelu_tanh_backward_cpu(g, x),
            "g * ([](A x) { const A k = (A)0.7978845608028654, c = (A)0.044715; \
             const A t = m_tanh(k * (x + c * x * x * x)); \
             return (A)0.5 * ((A)1 + t) + (A)0.5 * x * ((A)1 - t * t) * k * ((A)1 + (A)3 * c * x * x); \
             })(x)";
        /// `g (Φ(x) + x φ(x))`: gelu's backward, from its input `x`, in one pass
        GeluBackward => "gelu_backward", 9,
            |g, x| crate::op::math::gelu_erf_backward_cpu(g, x),
            "g * ([](A x) { const A s = x * (A)0.7071067811865476; \
             const A e = sizeof(A) == 4 ? (A)erff((float)s) : (A)erf((double)s); \
             return (A)0.5 * ((A)1 + e) + x * (A)0.3989422804014327 * m_exp((A)-0.5 * x * x); \
             })(x)";
        /// `max(a, b)` (NaN if either is)
        Maximum => "maximum", 10,
            |a, b| if a.is_nan() || a > b { a } else { b }, "(a != a || a > b) ? a : b";
        /// `min(a, b)` (NaN if either is)
        Minimum => "minimum", 11,
            |a, b| if a.is_nan() || a < b { a } else { b }, "(a != a || a < b) ? a : b";
        /// `1` where `a > b`, `½` where `a == b`, else `0`: the share of maximum's gradient
        /// that reaches `a` (ties split evenly)
        MaxShare => "max_share", 12,
            |a, b| crate::op::math::max_share_cpu(a, b),
            "a > b ? (A)1 : (a == b ? (A)0.5 : (A)0)";
    }

    /// Elementwise comparisons; results are `u8` (1 true, 0 false).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CmpOp {
        /// `a == b`
        Eq => "eq", 0, |a, b| a == b, "a == b";
        /// `a != b`
        Ne => "ne", 1, |a, b| a != b, "a != b";
        /// `a < b`
        Lt => "lt", 2, |a, b| a < b, "a < b";
        /// `a <= b`
        Le => "le", 3, |a, b| a <= b, "a <= b";
        /// `a > b`
        Gt => "gt", 4, |a, b| a > b, "a > b";
        /// `a >= b`
        Ge => "ge", 5, |a, b| a >= b, "a >= b";
    }

    /// Reductions along one axis (or all elements). Their kernels differ in shape, not in one
    /// expression, so rows carry only the name and code (`reduce_op::<name>` in CUDA C).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ReduceOp {
        /// Sum.
        Sum => "sum", 0;
        /// Maximum.
        Max => "max", 1;
        /// Index of the maximum (first one on ties), as `i64`.
        ArgMax => "argmax", 2;
    }
}

impl UnaryOp {
    /// Steps: the gradient is zero wherever it exists, so these ops record no node.
    pub(crate) fn is_piecewise_constant(self) -> bool {
        matches!(
            self,
            UnaryOp::Step | UnaryOp::StepGe(_) | UnaryOp::StepLe(_)
        )
    }
}

impl BinaryOp {
    /// Piecewise constant in both inputs (maximum's gradient share): records no node.
    pub(crate) fn is_piecewise_constant(self) -> bool {
        matches!(self, BinaryOp::MaxShare)
    }
}

/// The dtype layer norm keeps its statistics in for a tensor of `dtype`.
pub(crate) fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every op of every family as (family, name, code).
    fn every_op() -> Vec<(&'static str, &'static str, i32)> {
        let unary = UnaryOp::ALL
            .iter()
            .map(|op| ("unary", op.name(), op.code()));
        let binary = BinaryOp::ALL
            .iter()
            .map(|op| ("binary", op.name(), op.code()));
        let compare = CmpOp::ALL
            .iter()
            .map(|op| ("compare", op.name(), op.code()));
        let reduce = ReduceOp::ALL
            .iter()
            .map(|op| ("reduce", op.name(), op.code()));
        unary.chain(binary).chain(compare).chain(reduce).collect()
    }

    /// The text of the generated CUDA device function (or enum) of `family`.
    fn cuda_family(family: &str) -> &'static str {
        let text = cuda_op_table!();
        let start = text
            .find(&format!("// family: {family}\n"))
            .unwrap_or_else(|| panic!("no CUDA text for {family}"));
        let len = text[start + 1..]
            .find("// family: ")
            .map_or(text.len() - start, |e| e + 1);
        &text[start..start + len]
    }

    #[test]
    fn names_are_unique_across_families() {
        let mut seen = HashSet::new();
        for (family, name, _) in every_op() {
            assert!(seen.insert(name), "{family} op name {name:?} used twice");
        }
    }

    #[test]
    fn each_code_has_exactly_one_cuda_case_naming_the_same_op() {
        for (family, name, code) in every_op() {
            let text = cuda_family(family);
            let label = format!("case {code}:");
            assert_eq!(
                text.matches(&label).count(),
                1,
                "{family} code {code} ({name}) in:\n{text}"
            );
            let line = text.lines().find(|l| l.contains(&label)).unwrap();
            assert!(
                line.ends_with(&format!("// {name}")),
                "{family} code {code} is {name} in Rust but the CUDA case says: {line}"
            );
        }
        for family in ["unary", "binary", "compare", "reduce"] {
            let ops = every_op().iter().filter(|(f, ..)| *f == family).count();
            let text = cuda_family(family);
            assert_eq!(
                text.matches("case ").count(),
                ops,
                "stray cases in:\n{text}"
            );
            assert_eq!(
                text.matches("default: __trap();").count(),
                1,
                "{family}: an unknown code must trap:\n{text}"
            );
        }
    }

    #[test]
    fn reduce_codes_have_cuda_names() {
        let text = cuda_family("reduce");
        for op in ReduceOp::ALL {
            let entry = format!("{} = {},", op.name(), op.code());
            assert!(text.contains(&entry), "{entry} missing from:\n{text}");
        }
    }

    /// Records which function a loop was handed by calling it on one probe value.
    struct Probe<T>(T, T);

    impl<T: Copy> UnaryLoop<T> for Probe<T> {
        type Output = T;
        fn run(self, f: impl Fn(T) -> T + Sync) -> T {
            f(self.0)
        }
    }

    impl<T: Copy, U> BinaryLoop<T, U> for Probe<T> {
        type Output = U;
        fn run(self, f: impl Fn(T, T) -> U + Sync) -> U {
            f(self.0, self.1)
        }
    }

    #[test]
    fn cpu_functions_follow_their_rows() {
        // One probe per op, worked by hand from each row.
        let x = 0.5f64;
        let unary = [
            (UnaryOp::Neg, -0.5),
            (UnaryOp::Exp, x.exp()),
            (UnaryOp::Log, x.ln()),
            (UnaryOp::Relu, 0.5),
            (UnaryOp::Tanh, x.tanh()),
            (UnaryOp::Sigmoid, 1.0 / (1.0 + (-x).exp())),
            (UnaryOp::Sqrt, x.sqrt()),
            (UnaryOp::Abs, 0.5),
            (UnaryOp::Step, 1.0),
            (UnaryOp::AddScalar(2.0), 2.5),
            (UnaryOp::MulScalar(3.0), 1.5),
            (UnaryOp::PowScalar(3.0), 0.125),
            (UnaryOp::Sin, x.sin()),
            (UnaryOp::Cos, x.cos()),
            (UnaryOp::Silu, 0.311_229_665_600_927_3),
            (UnaryOp::GeluTanh, 0.345_714_009_825_143_94),
            (UnaryOp::Gelu, 0.345_731_230_637_006_56),
            (UnaryOp::ClampMin(0.0), 0.5),
            (UnaryOp::ClampMax(0.0), 0.0),
            (UnaryOp::StepGe(0.5), 1.0),
            (UnaryOp::StepLe(0.25), 0.0),
        ];
        assert_eq!(unary.len(), UnaryOp::ALL.len(), "a unary op has no probe");
        for (op, want) in unary {
            let got = op.dispatch(Probe(x, 0.0));
            assert!(
                (got - want).abs() <= 1e-15,
                "{}: {got} vs {want}",
                op.name()
            );
            // Only the even functions give the same value at -x.
            let even = ["abs", "cos"].contains(&op.name());
            assert_eq!(op.dispatch(Probe(-x, 0.0)) == want, even, "{}", op.name());
        }
        let binary = [
            (BinaryOp::Add, 5.0),
            (BinaryOp::Sub, 1.0),
            (BinaryOp::Mul, 6.0),
            (BinaryOp::Div, 1.5),
            (BinaryOp::ReluBackward, 3.0),     // y = 2 > 0: g passes
            (BinaryOp::TanhBackward, -9.0),    // 3 (1 - 4)
            (BinaryOp::SigmoidBackward, -6.0), // 3 · 2 (1 - 2)
            (BinaryOp::SiluBackward, 3.272_352_7), // 3 σ(2) (1 + 2 (1 - σ(2)))
            (BinaryOp::GeluTanhBackward, 3.258_297_8), // 3 (½(1 + t) + ...) at x = 2
            (BinaryOp::GeluBackward, 3.255_695_4), // 3 (Φ(2) + 2 φ(2))
            (BinaryOp::Maximum, 3.0),
            (BinaryOp::Minimum, 2.0),
            (BinaryOp::MaxShare, 1.0), // 3 > 2
        ];
        assert_eq!(
            binary.len(),
            BinaryOp::ALL.len(),
            "a binary op has no probe"
        );
        for (op, want) in binary {
            let got = op.dispatch(Probe(3.0f32, 2.0));
            assert!((got - want).abs() <= 1e-6, "{}: {got} vs {want}", op.name());
        }
        assert_eq!(BinaryOp::MaxShare.dispatch(Probe(2.0f32, 2.0)), 0.5);
        assert_eq!(BinaryOp::MaxShare.dispatch(Probe(1.0f32, 2.0)), 0.0);
        assert!(BinaryOp::Maximum.dispatch(Probe(f32::NAN, 2.0)).is_nan());
        assert!(BinaryOp::Minimum.dispatch(Probe(2.0f32, f32::NAN)).is_nan());
        for op in CmpOp::ALL {
            let [lt, eq, gt] = [(1u8, 2u8), (2, 2), (3, 2)].map(|(a, b)| op.dispatch(Probe(a, b)));
            let want = match op {
                CmpOp::Eq => [false, true, false],
                CmpOp::Ne => [true, false, true],
                CmpOp::Lt => [true, false, false],
                CmpOp::Le => [true, true, false],
                CmpOp::Gt => [false, false, true],
                CmpOp::Ge => [false, true, true],
            };
            assert_eq!([lt, eq, gt], want, "{}", op.name());
        }
    }
}
