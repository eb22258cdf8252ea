//! What every device's attention kernels read of one call: the sizes and how scores become
//! weights.

/// The sizes of one attention call: `q` is `[batch, heads, q_len, dim]`, `k` `[batch, kv_heads,
/// kv_len, dim]`, `v` `[batch, kv_heads, kv_len, v_dim]`; each key/value head serves
/// `heads / kv_heads` query heads (grouped-query attention when that is above 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub dim: usize,
    pub v_dim: usize,
}

impl Dims {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The keys query `i` sees: `0..visible(causal, i)`. A causal query sees the keys up to its
    /// own position, the queries being the last `q_len` positions of the keys' sequence.
    pub fn visible(&self, causal: bool, i: usize) -> usize {
        match causal {
            true => (i + 1 + self.kv_len)
                .saturating_sub(self.q_len)
                .min(self.kv_len),
            false => self.kv_len,
        }
    }
}

/// How scores become weights: `scale` multiplies `q · k`; `causal` masks the keys after each
/// query's position (see [`Dims::visible`]); `dropout` zeroes each weight with that
/// probability, by a mask `seed` fixes (the same in backward), and scales the rest by
/// `1 / (1 - dropout)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Attend {
    pub dims: Dims,
    pub scale: f64,
    pub causal: bool,
    pub dropout: f64,
    pub seed: u64,
}
