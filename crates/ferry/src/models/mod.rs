//! Ready-made models: the ones `ferry train` trains and `ferry bench train` times, defined once
//! so the training demo, the benchmark and user code build exactly the same network (same
//! layers, same initialization order, hence the same weights after [`manual_seed`](crate::manual_seed)).
//!
//! - [`mlp`] and [`digits_mlp`]: linear layers with ReLU between them;
//! - [`digits_cnn`]: a small convolutional network on the 8 x 8 digits images;
//! - [`Gpt`] with [`GptConfig`]: a small character-level GPT (GPT-2's shape);
//! - [`Llama`] with [`LlamaConfig`]: transformers' Llama, loading its checkpoints as they are.
//!
//! Only the networks live here; data loading, training loops and their command-line arguments
//! belong to the programs that use them.

mod digits;
mod gpt;
mod llama;

pub use digits::{DIGITS_CLASSES, DIGITS_FEATURES, DIGITS_HIDDEN, digits_cnn, digits_mlp, mlp};
pub use gpt::{Gpt, GptConfig};
pub use llama::{Llama, LlamaConfig};
