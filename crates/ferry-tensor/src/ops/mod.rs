//! The op set. Forward code per family; every gradient rule sits in the crate's `rules` module.
//!
//! The elementwise and reduction ops are declared once, in the table below: each row gives an
//! op's variant, name, CUDA op code, CPU function and CUDA C expression. From it come the enums,
//! `name()`, `code()`, the CPU kernels' per-op dispatch and the CUDA C device functions that the
//! kernels in kernels/ switch through (an unknown code traps). A new elementwise op is a row here,
//! its gradient rule in `rules`, and its public method in `elementwise`.

pub(crate) mod create;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod nn;
pub mod optim;
pub(crate) mod reduce;
pub(crate) mod shape;

mod table;

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
        ];
        assert_eq!(unary.len(), UnaryOp::ALL.len(), "a unary op has no probe");
        for (op, want) in unary {
            assert_eq!(op.dispatch(Probe(x, 0.0)), want, "{}", op.name());
            assert_eq!(op.dispatch(Probe(-x, 0.0)) == want, op.name() == "abs");
        }
        let binary = [
            (BinaryOp::Add, 5.0),
            (BinaryOp::Sub, 1.0),
            (BinaryOp::Mul, 6.0),
            (BinaryOp::Div, 1.5),
            (BinaryOp::ReluBackward, 3.0),     // y = 2 > 0: g passes
            (BinaryOp::TanhBackward, -9.0),    // 3 (1 - 4)
            (BinaryOp::SigmoidBackward, -6.0), // 3 · 2 (1 - 2)
        ];
        assert_eq!(
            binary.len(),
            BinaryOp::ALL.len(),
            "a binary op has no probe"
        );
        for (op, want) in binary {
            assert_eq!(op.dispatch(Probe(3.0f32, 2.0)), want, "{}", op.name());
        }
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
