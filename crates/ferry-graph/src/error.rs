use thiserror::Error;

/// A boxed error raised by a backward function or by gradient accumulation.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while running backward through the graph.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum GraphError {
    /// A second backward reached a node whose saved buffers the first one freed.
    #[error(
        "backward reached `{op}`, whose saved buffers were freed by an earlier backward; \
         pass `retain_graph: true` to the first backward if you need to run it twice"
    )]
    BuffersFreed {
        /// The op whose buffers are gone.
        op: &'static str,
    },
    /// A backward function returned a gradient list of the wrong length.
    #[error("backward of `{op}` returned {got} gradients for {expected} inputs")]
    GradientArity {
        /// The op whose rule misbehaved.
        op: &'static str,
        /// Number of inputs the node was recorded with.
        expected: usize,
        /// Number of gradients it returned.
        got: usize,
    },
    /// A backward function or an accumulation failed.
    #[error("backward of `{op}` failed: {source}")]
    Backward {
        /// The op whose rule failed.
        op: &'static str,
        /// What went wrong.
        #[source]
        source: BoxError,
    },
    /// A hook registered on a node failed.
    #[error("a hook on `{op}` failed: {source}")]
    Hook {
        /// The node's op.
        op: &'static str,
        /// What the hook returned.
        #[source]
        source: BoxError,
    },
}
