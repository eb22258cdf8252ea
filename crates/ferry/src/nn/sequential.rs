//! A chain of modules.

use ferry_tensor::{Result, Tensor};

use super::Module;

/// Modules applied one after the other. Parameters are named by position, `"0.weight"`,
/// `"2.bias"`, as in PyTorch's `nn.Sequential`, so state dicts line up with PyTorch's.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module + Send + Sync>>,
}

impl Sequential {
    /// An empty chain (the identity).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `layer`.
    pub fn push(mut self, layer: impl Module + Send + Sync + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequential")
            .field("layers", &self.layers.len())
            .field("parameters", &self.named_parameters())
            .finish()
    }
}

impl Module for Sequential {
    /// Each layer in turn; a layer followed by a [`ReLU`](super::ReLU) runs as one
    /// [`Module::forward_relu`] (a linear layer then fuses the two on a GPU).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let mut x = input.clone();
        let mut i = 0;
        while let Some(layer) = self.layers.get(i) {
            if self.layers.get(i + 1).is_some_and(|next| next.is_relu()) {
                x = layer.forward_relu(&x)?;
                i += 2;
            } else {
                x = layer.forward(&x)?;
                i += 1;
            }
        }
        Ok(x)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, layer) in self.layers.iter().enumerate() {
            layer.visit_parameters(&format!("{prefix}{i}."), f);
        }
    }

    fn visit_parameters_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
    ) -> Result<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.visit_parameters_mut(&format!("{prefix}{i}."), f)?;
        }
        Ok(())
    }

    fn set_training(&mut self, training: bool) {
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }
}
