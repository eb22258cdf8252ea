//! What the op table in `op` expands to. Rows are read once and give, per family: the enum,
//! `name()`, `code()`, a compile-time check that codes are unique, the CPU dispatch (`dispatch`,
//! which hands a loop the op's function once per call) and, for all families together, the
//! CUDA C text `cuda_op_table!()` that cuda/kernels.rs puts in front of every kernel module:
//!
//! ```c
//! template <typename A>
//! __device__ __forceinline__ A ferry_unary(int op, A ferry_x, A ferry_scalar) {
//!     switch (op) {
//!     case 1: { const A v = ferry_x; return m_exp(v); }  // exp
//!     ...
//!     default: __trap();
//!     }
//!     __builtin_unreachable();
//! }
//! ```
//!
//! so a kernel handed a code that no row has stops with an error instead of computing some op.

/// The whole table: the unary, binary, comparison and reduction families, in that order.
macro_rules! op_table {
    (
        $(#[$u_meta:meta])*
        pub enum $Unary:ident {
            $(
                $(#[$u_doc:meta])*
                $u_op:ident $(($u_s:ident))? => $u_name:literal, $u_code:literal,
                    |$u_v:ident| $u_cpu:expr, $u_cuda:literal;
            )*
        }

        $(#[$b_meta:meta])*
        pub enum $Binary:ident {
            $(
                $(#[$b_doc:meta])*
                $b_op:ident => $b_name:literal, $b_code:literal,
                    |$b_x:ident, $b_y:ident| $b_cpu:expr, $b_cuda:literal;
            )*
        }

        $(#[$c_meta:meta])*
        pub enum $Cmp:ident {
            $(
                $(#[$c_doc:meta])*
                $c_op:ident => $c_name:literal, $c_code:literal,
                    |$c_x:ident, $c_y:ident| $c_cpu:expr, $c_cuda:literal;
            )*
        }

        $(#[$r_meta:meta])*
        pub enum $Reduce:ident {
            $(
                $(#[$r_doc:meta])*
                $r_op:ident => $r_name:literal, $r_code:literal;
            )*
        }
    ) => {
        $crate::op::table::op_enum! {
            $(#[$u_meta])* $Unary { $($(#[$u_doc])* $u_op $(($u_s))? => $u_name, $u_code;)* }
        }
        $crate::op::table::op_enum! {
            $(#[$b_meta])* $Binary { $($(#[$b_doc])* $b_op => $b_name, $b_code;)* }
        }
        $crate::op::table::op_enum! {
            $(#[$c_meta])* $Cmp { $($(#[$c_doc])* $c_op => $c_name, $c_code;)* }
        }
        $crate::op::table::op_enum! {
            $(#[$r_meta])* $Reduce { $($(#[$r_doc])* $r_op => $r_name, $r_code;)* }
        }

        impl $Unary {
            /// Runs `l` with this op's function of one element of float type `T`.
            pub(crate) fn dispatch<T, L>(self, l: L) -> L::Output
            where
                T: ferry_memory::Element + num_traits::Float,
                L: $crate::op::UnaryLoop<T>,
            {
                match self {
                    $($Unary::$u_op $(($u_s))? => {
                        $(let $u_s = <T as ferry_memory::Element>::from_f64($u_s);)?
                        l.run(move |$u_v: T| -> T { $u_cpu })
                    })*
                }
            }

            /// The scalar the CUDA kernel receives (0 for ops without one).
            pub(crate) fn scalar(self) -> f64 {
                match self {
                    $($Unary::$u_op $(($u_s))? => $crate::op::table::scalar_or_zero!($($u_s)?),)*
                }
            }
        }

        impl $Binary {
            /// Runs `l` with this op's function of two elements of float type `T`.
            pub(crate) fn dispatch<T, L>(self, l: L) -> L::Output
            where
                T: ferry_memory::Element + num_traits::Float,
                L: $crate::op::BinaryLoop<T, T>,
            {
                match self {
                    $($Binary::$b_op => l.run(|$b_x: T, $b_y: T| -> T { $b_cpu }),)*
                }
            }
        }

        impl $Cmp {
            /// Runs `l` with this comparison on two elements of any type `T`.
            pub(crate) fn dispatch<T, L>(self, l: L) -> L::Output
            where
                T: ferry_memory::Element,
                L: $crate::op::BinaryLoop<T, bool>,
            {
                match self {
                    $($Cmp::$c_op => l.run(|$c_x: T, $c_y: T| -> bool { $c_cpu }),)*
                }
            }
        }

        /// The CUDA C the table generates, as one string literal (for `concat!`).
        macro_rules! cuda_op_table {
            () => {
                concat!(
                    "// Generated from ferry-tensor's op table (src/op/mod.rs); do not edit.\n",
                    "// family: unary\n",
                    "template <typename A>\n",
                    "__device__ __forceinline__ ",
                    "A ferry_unary(int op, A ferry_x, A ferry_scalar) {\n",
                    "    switch (op) {\n",
                    $(
                        "    case ", $u_code, ": { const A ", stringify!($u_v), " = ferry_x; ",
                        $("const A ", stringify!($u_s), " = ferry_scalar; ",)?
                        "return ", $u_cuda, "; }  // ", $u_name, "\n",
                    )*
                    "    default: __trap();\n",
                    "    }\n",
                    "    __builtin_unreachable();\n",
                    "}\n",
                    "// family: binary\n",
                    "template <typename A>\n",
                    "__device__ __forceinline__ ",
                    "A ferry_binary(int op, A ferry_x, A ferry_y) {\n",
                    "    switch (op) {\n",
                    $(
                        "    case ", $b_code, ": { const A ", stringify!($b_x), " = ferry_x; ",
                        "const A ", stringify!($b_y), " = ferry_y; ",
                        "return ", $b_cuda, "; }  // ", $b_name, "\n",
                    )*
                    "    default: __trap();\n",
                    "    }\n",
                    "    __builtin_unreachable();\n",
                    "}\n",
                    "// family: compare\n",
                    "template <typename A>\n",
                    "__device__ __forceinline__ ",
                    "bool ferry_compare(int op, A ferry_x, A ferry_y) {\n",
                    "    switch (op) {\n",
                    $(
                        "    case ", $c_code, ": { const A ", stringify!($c_x), " = ferry_x; ",
                        "const A ", stringify!($c_y), " = ferry_y; ",
                        "return ", $c_cuda, "; }  // ", $c_name, "\n",
                    )*
                    "    default: __trap();\n",
                    "    }\n",
                    "    __builtin_unreachable();\n",
                    "}\n",
                    "// family: reduce\n",
                    "namespace reduce_op {\n",
                    "enum Code {\n",
                    $("    ", $r_name, " = ", $r_code, ",\n",)*
                    "};\n",
                    "// Traps on a code that no row of the table has.\n",
                    "__device__ __forceinline__ void check(int op) {\n",
                    "    switch (op) {\n",
                    $("    case ", $r_code, ":  // ", $r_name, "\n",)*
                    "        return;\n",
                    "    default: __trap();\n",
                    "    }\n",
                    "}\n",
                    "}  // namespace reduce_op\n",
                )
            };
        }
        pub(crate) use cuda_op_table;
    };
}

/// One family's enum with `name()`, `code()`, `ALL` (tests) and the check that codes are unique.
macro_rules! op_enum {
    (
        $(#[$meta:meta])*
        $Enum:ident {
            $($(#[$doc:meta])* $op:ident $(($s:ident))? => $name:literal, $code:literal;)*
        }
    ) => {
        $(#[$meta])*
        pub enum $Enum {
            $($(#[$doc])* $op $(($crate::op::table::scalar_type!($s)))?,)*
        }

        impl $Enum {
            /// Every op of the family (scalars at 0).
            #[cfg(test)]
            pub(crate) const ALL: &[$Enum] =
                &[$($Enum::$op $(($crate::op::table::scalar_or_zero!(0.0, $s)))?),*];

            /// The op's name in graphs and errors.
            pub fn name(self) -> &'static str {
                match self {
                    $($Enum::$op { .. } => $name,)*
                }
            }

            /// The op code the CUDA kernels receive.
            pub(crate) fn code(self) -> i32 {
                match self {
                    $($Enum::$op { .. } => $code,)*
                }
            }
        }

        const _: () = $crate::op::table::assert_unique(&[$($code),*]);
    };
}

/// The type of an op's scalar.
macro_rules! scalar_type {
    ($s:ident) => {
        f64
    };
}

/// `$s` when the op has a scalar, else `0.0`.
macro_rules! scalar_or_zero {
    () => {
        0.0
    };
    ($s:ident) => {
        $s
    };
    ($zero:literal, $s:ident) => {
        $zero
    };
}

pub(crate) use {op_enum, op_table, scalar_or_zero, scalar_type};

/// Stops the build when two ops of a family share a CUDA code.
pub(crate) const fn assert_unique(codes: &[i32]) {
    let mut i = 0;
    while i < codes.len() {
        let mut j = i + 1;
        while j < codes.len() {
            assert!(
                codes[i] != codes[j],
                "two ops of one family share a CUDA op code"
            );
            j += 1;
        }
        i += 1;
    }
}
