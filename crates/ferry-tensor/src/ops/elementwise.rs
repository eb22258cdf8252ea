//! Elementwise arithmetic with broadcasting, scalar ops, activations and comparisons.

use ferry_memory::DType;

use crate::autograd::record;
use crate::layout::broadcast_shapes;
use crate::op::{BinaryOp, CmpOp, UnaryOp};
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// Checks that `self` and `rhs` can meet in `op`: same device and dtype.
    pub(crate) fn same_kind(&self, op: &'static str, rhs: &Tensor) -> Result<()> {
        if self.device() != rhs.device() {
            return Err(TensorError::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: rhs.device(),
            });
        }
        if self.dtype() != rhs.dtype() {
            return Err(TensorError::dtype_mismatch(op, self.dtype(), rhs.dtype()));
        }
        Ok(())
    }

    /// A binary row of the op table, broadcasting; recorded with its rule unless the op is
    /// piecewise constant (no gradient to carry).
    pub(crate) fn binary(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::widest(self, rhs)? {
            return a.binary(&b, op);
        }
        self.same_kind(op.name(), rhs)?;
        let out = if self.shape() == rhs.shape() {
            // The common case, with nothing to broadcast.
            backend::binary(self, self.layout(), rhs, rhs.layout(), op)?
        } else {
            let shape = broadcast_shapes(op.name(), self.shape(), rhs.shape())?;
            let la = self
                .layout()
                .broadcast_to(&shape)
                .expect("broadcast_shapes checked it");
            let lb = rhs
                .layout()
                .broadcast_to(&shape)
                .expect("broadcast_shapes checked it");
            backend::binary(self, &la, rhs, &lb, op)?
        };
        if op.is_piecewise_constant() {
            return Ok(out);
        }
        Ok(record(out, op.name(), &[self, rhs], || {
            rules::binary(op, self, rhs)
        }))
    }

    /// A unary row of the op table; recorded with its rule unless the op is piecewise constant.
    pub(crate) fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let out = backend::unary(self, op)?;
        if op.is_piecewise_constant() {
            return Ok(out);
        }
        Ok(record(out, op.name(), &[self], || rules::unary(op)))
    }

    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Add)
    }

    /// `self - rhs`, broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Sub)
    }

    /// `self * rhs`, elementwise, broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Mul)
    }

    /// `self / rhs`, elementwise, broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Div)
    }

    /// relu's backward from its output `y`: `self` where `y > 0`, else 0.
    pub(crate) fn relu_backward(&self, y: &Tensor) -> Result<Tensor> {
        self.binary(y, BinaryOp::ReluBackward)
    }

    /// tanh's backward from its output `y`: `self (1 - y²)`.
    pub(crate) fn tanh_backward(&self, y: &Tensor) -> Result<Tensor> {
        self.binary(y, BinaryOp::TanhBackward)
    }

    /// sigmoid's backward from its output `y`: `self y (1 - y)`.
    pub(crate) fn sigmoid_backward(&self, y: &Tensor) -> Result<Tensor> {
        self.binary(y, BinaryOp::SigmoidBackward)
    }

    /// `self + c`.
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary(UnaryOp::AddScalar(c))
    }

    /// `self - c`.
    pub fn sub_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary(UnaryOp::AddScalar(-c))
    }

    /// `self * c`.
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MulScalar(c))
    }

    /// `self / c`.
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MulScalar(1.0 / c))
    }

    /// `self ^ p`, elementwise.
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        self.unary(UnaryOp::PowScalar(p))
    }

    /// `-self`.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }

    /// `e^self`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }

    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }

    /// `max(self, 0)`.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Relu)
    }

    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }

    /// Logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sigmoid)
    }

    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }

    /// Absolute value.
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }

    /// `1` where `self > 0`, else `0`, in the same dtype (no gradient).
    pub fn step(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Step)
    }

    fn compare(&self, rhs: &Tensor, op: CmpOp) -> Result<Tensor> {
        self.same_kind(op.name(), rhs)?;
        let shape = broadcast_shapes(op.name(), self.shape(), rhs.shape())?;
        let la = self
            .layout()
            .broadcast_to(&shape)
            .expect("broadcast_shapes checked it");
        let lb = rhs
            .layout()
            .broadcast_to(&shape)
            .expect("broadcast_shapes checked it");
        backend::compare(self, &la, rhs, &lb, op)
    }

    /// `self == rhs` as `u8` (1 or 0), broadcasting.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Eq)
    }

    /// `self != rhs` as `u8`.
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ne)
    }

    /// `self < rhs` as `u8`.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Lt)
    }

    /// `self <= rhs` as `u8`.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Le)
    }

    /// `self > rhs` as `u8`.
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Gt)
    }

    /// `self >= rhs` as `u8`.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ge)
    }

    /// The same values in another dtype (a no-op returning `self` when it already matches).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if self.requires_grad() && !dtype.is_float() {
            return Err(TensorError::NotDifferentiable { dtype });
        }
        let out = backend::cast(self, dtype)?;
        Ok(record(out, "to_dtype", &[self], || {
            rules::cast(self.dtype())
        }))
    }
}
