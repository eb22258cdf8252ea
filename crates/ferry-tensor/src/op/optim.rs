//! The scalars of one fused optimizer step, as the kernels of every device read them.

/// The scalars of one Adam step (`repr(C)`: the CUDA kernel reads it as a parameter).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient, or decoupled (AdamW).
    pub weight_decay: f64,
    /// `1 - beta1^t` for step `t` (counting from 1).
    pub bias_correction1: f64,
    /// `1 - beta2^t`.
    pub bias_correction2: f64,
    /// 1 for decoupled weight decay (AdamW), 0 for L2.
    pub decoupled: u32,
    /// Keeps the layout free of implicit padding.
    pub pad: u32,
}
