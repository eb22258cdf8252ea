//! Arithmetic, scalar ops, activations, clamping, maxima and comparisons.

use ferry_tensor::Tensor;

use super::Input::Float as F;
use super::{Case, Keeps};

/// Bytes of input `i` (an intermediate of its shape that a rule keeps).
fn like_input<const I: usize>(x: &[Tensor], _: &Tensor) -> usize {
    x[I].nbytes()
}

/// Bytes of two intermediates shaped like input 0.
fn twice_input0(x: &[Tensor], _: &Tensor) -> usize {
    2 * x[0].nbytes()
}

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new(
            "add_broadcast",
            &["add"],
            &[F(&[3, 1]), F(&[1, 4])],
            |x| x[0].add(&x[1]),
            Keeps::NOTHING,
        ),
        Case::new(
            "sub_broadcast",
            &["sub"],
            &[F(&[2, 3, 4]), F(&[4])],
            |x| x[0].sub(&x[1]),
            Keeps::NOTHING,
        ),
        // mul keeps each operand for the other's gradient (x0 through its transposed view).
        Case::new(
            "mul_transposed",
            &["transpose", "mul"],
            &[F(&[4, 3]), F(&[3, 4])],
            |x| x[0].t()?.mul(&x[1]),
            Keeps::inputs(&[0, 1]),
        ),
        // abs keeps x1; div keeps its divisor (|x1| + 1) and, for the divisor's gradient, x0.
        Case::new(
            "div_abs",
            &["abs", "add_scalar", "div"],
            &[F(&[5]), F(&[5])],
            |x| x[0].div(&x[1].abs()?.add_scalar(1.0)?),
            Keeps {
                unnamed: like_input::<1>,
                ..Keeps::inputs(&[0, 1])
            },
        ),
        Case::new(
            "scalar_ops",
            &["mul_scalar", "add_scalar"],
            &[F(&[6])],
            |x| x[0].mul_scalar(2.5)?.sub_scalar(1.5)?.div_scalar(3.0),
            Keeps::NOTHING,
        ),
        Case::new(
            "neg_exp",
            &["neg", "exp"],
            &[F(&[2, 5])],
            |x| x[0].neg()?.exp(),
            Keeps::OUTPUT,
        ),
        Case::new(
            "log",
            &["abs", "add_scalar", "log"],
            &[F(&[7])],
            |x| x[0].abs()?.add_scalar(0.5)?.log(),
            Keeps {
                unnamed: like_input::<0>,
                ..Keeps::inputs(&[0])
            },
        ),
        Case::new(
            "relu",
            &["relu"],
            &[F(&[3, 4])],
            |x| x[0].relu(),
            Keeps::OUTPUT,
        )
        .backward(&["relu_backward"]),
        Case::new(
            "tanh",
            &["tanh"],
            &[F(&[3, 4])],
            |x| x[0].tanh(),
            Keeps::OUTPUT,
        )
        .backward(&["tanh_backward"]),
        Case::new(
            "sigmoid",
            &["sigmoid"],
            &[F(&[3, 4])],
            |x| x[0].sigmoid(),
            Keeps::OUTPUT,
        )
        .backward(&["sigmoid_backward"]),
        Case::new(
            "sqrt",
            &["abs", "add_scalar", "sqrt"],
            &[F(&[9])],
            |x| x[0].abs()?.add_scalar(0.1)?.sqrt(),
            Keeps {
                output: true,
                ..Keeps::inputs(&[0])
            },
        ),
        Case::new(
            "powf",
            &["abs", "add_scalar", "powf"],
            &[F(&[9])],
            |x| x[0].abs()?.add_scalar(0.5)?.powf(2.5),
            Keeps {
                unnamed: like_input::<0>,
                ..Keeps::inputs(&[0])
            },
        ),
        Case::new(
            "comparisons",
            &[],
            &[F(&[12]), F(&[12])],
            |x| {
                let gt = x[0].gt(&x[1])?.to_dtype(ferry_tensor::DType::F32)?;
                let le = x[0].le(&x[1])?.to_dtype(ferry_tensor::DType::F32)?;
                let eq = x[0].eq(&x[0])?.to_dtype(ferry_tensor::DType::F32)?;
                gt.mul_scalar(4.0)?.add(&le.mul_scalar(2.0)?)?.add(&eq)
            },
            Keeps::NOTHING,
        )
        .records_nothing(),
        // Each smooth activation keeps its input (here the intermediate 2x).
        Case::new(
            "gelu",
            &["mul_scalar", "gelu"],
            &[F(&[4, 6])],
            |x| x[0].mul_scalar(2.0)?.gelu(),
            Keeps {
                unnamed: like_input::<0>,
                ..Keeps::NOTHING
            },
        )
        .backward(&["gelu_backward"]),
        Case::new(
            "gelu_tanh",
            &["mul_scalar", "gelu_tanh"],
            &[F(&[4, 6])],
            |x| x[0].mul_scalar(2.0)?.gelu_tanh(),
            Keeps {
                unnamed: like_input::<0>,
                ..Keeps::NOTHING
            },
        )
        .backward(&["gelu_tanh_backward"]),
        Case::new(
            "silu",
            &["mul_scalar", "silu"],
            &[F(&[4, 6])],
            |x| x[0].mul_scalar(2.0)?.silu(),
            Keeps {
                unnamed: like_input::<0>,
                ..Keeps::NOTHING
            },
        )
        .backward(&["silu_backward"]),
        // sin keeps 3x, cos keeps x0, mul keeps cos x0 and x1.
        Case::new(
            "sin_cos",
            &["mul_scalar", "sin", "cos", "mul", "add"],
            &[F(&[10]), F(&[10])],
            |x| x[0].mul_scalar(3.0)?.sin()?.add(&x[0].cos()?.mul(&x[1])?),
            Keeps {
                unnamed: twice_input0,
                ..Keeps::inputs(&[0, 1])
            },
        ),
        // clamp_min keeps 2x, clamp_max keeps clamp_min's output.
        Case::new(
            "clamp",
            &["mul_scalar", "clamp_min", "clamp_max"],
            &[F(&[20])],
            |x| x[0].mul_scalar(2.0)?.clamp(-1.0, 0.5),
            Keeps {
                unnamed: twice_input0,
                ..Keeps::NOTHING
            },
        ),
        Case::new(
            "maximum_broadcast",
            &["maximum"],
            &[F(&[3, 1]), F(&[1, 4])],
            |x| x[0].maximum(&x[1]),
            Keeps::inputs(&[0, 1]),
        ),
        // Ties inside [-0.5, 0.5] split the gradient. clamp_min keeps x, clamp_max keeps
        // clamp_min's output, the comparison keeps x and clamp's output.
        Case::new(
            "minimum_ties",
            &["clamp_min", "clamp_max", "minimum"],
            &[F(&[16])],
            |x| x[0].minimum(&x[0].clamp(-0.5, 0.5)?),
            Keeps {
                unnamed: twice_input0,
                ..Keeps::inputs(&[0])
            },
        ),
        Case::new(
            "maximum_ties",
            &["clamp_min", "clamp_max", "maximum"],
            &[F(&[16])],
            |x| x[0].maximum(&x[0].clamp(-0.5, 0.5)?),
            Keeps {
                unnamed: twice_input0,
                ..Keeps::inputs(&[0])
            },
        ),
    ]
}
