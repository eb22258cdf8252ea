//! The op set. Forward code per family; every gradient rule sits in the crate's `rules` module
//! (one file per family there), and every device dispatch in `backend`.
//!
//! The elementwise and reduction ops are declared once, in the op table of the crate's `op`
//! module (re-exported here): a new elementwise op is a row there, its gradient rule in `rules`,
//! and its public method in `elementwise`.

pub(crate) mod activation;
pub(crate) mod attention;
pub(crate) mod conv;
pub(crate) mod create;
pub(crate) mod elementwise;
pub(crate) mod index;
pub(crate) mod linear;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod norm;
pub mod optim;
pub(crate) mod permute;
pub(crate) mod read;
pub(crate) mod reduce;
pub(crate) mod select;
pub(crate) mod shape;

pub use crate::op::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
