//! Attention on CUDA: no fused kernel yet (cuDNN's fused attention comes here), so the op
//! composes it from matrix products and a softmax.

use super::Cuda;
use crate::kernel::Attention;

impl Attention for Cuda {}
