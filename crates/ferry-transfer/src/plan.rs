//! Chunk plans: which rows of axis 0 each piece of a chunked move carries, and how much pinned
//! staging that takes. Pure arithmetic (no device), so every layer above can plan.

use std::ops::Range;

use ferry_memory::DType;
use ferry_tensor::{Result, TensorError};

/// How to cut a chunked move along axis 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkSpec {
    /// Staging of at most `1/n` of the tensor (or one row, if that is more): planned like
    /// [`ChunkSpec::MaxStagingBytes`] with that bound, so the pieces are whatever keeps the
    /// pipeline full within it.
    Count(usize),
    /// Pieces as large as fit, with every staging buffer (as the pinned pool sizes its blocks)
    /// within this many bytes together: two buffers when two rows fit, else one (no overlap).
    /// (A ring of four smaller pieces measured slower on the H200: 13.3 ms against 11.0 ms for
    /// 400 MB within 100 MB of staging.)
    MaxStagingBytes(usize),
}

/// Which rows of axis 0 each piece of a chunked move carries (a 0-d tensor is one row), and
/// the staging that takes. Public so the arithmetic can be checked without a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    rows: usize,
    row_bytes: usize,
    pieces: Vec<Range<usize>>,
    staging_buffers: usize,
}

impl ChunkPlan {
    /// The plan for a tensor of `shape` and `dtype`. A zero count, or a staging bound below one
    /// row's staging block, is an error that names the smallest valid value.
    pub fn new(shape: &[usize], dtype: DType, spec: ChunkSpec) -> Result<Self> {
        let numel: usize = shape.iter().product();
        let rows = shape.first().copied().unwrap_or(1);
        let row_bytes = numel.checked_div(rows).unwrap_or(0) * dtype.size();
        let invalid = |message: String| TensorError::InvalidArgument {
            op: "to_chunked",
            message,
        };
        let minimum = pinned_block_size(row_bytes);
        let bound = match spec {
            ChunkSpec::Count(0) => {
                return Err(invalid(
                    "the chunk count must be at least 1 (ChunkSpec::Count(1) moves in one piece)"
                        .into(),
                ));
            }
            // 1/n of the tensor, but never less than one row's block.
            ChunkSpec::Count(n) => (numel * dtype.size()).div_ceil(n).max(minimum),
            ChunkSpec::MaxStagingBytes(bound) => {
                if numel > 0 && bound < minimum {
                    return Err(invalid(format!(
                        "a staging bound of {bound} bytes is smaller than one row: a row of {shape:?} {dtype} \
                         takes {row_bytes} bytes, staged in a block of {minimum} bytes; pass at least \
                         ChunkSpec::MaxStagingBytes({minimum})"
                    )));
                }
                bound
            }
        };
        let (pieces, buffers) = if numel == 0 {
            (0, 0)
        } else if rows >= 2 && 2 * minimum <= bound {
            let fit = rows_fitting(row_bytes, rows, bound / 2);
            (rows.div_ceil(fit).max(2), 2)
        } else {
            (rows.div_ceil(rows_fitting(row_bytes, rows, bound)), 1)
        };
        let pieces = if numel == 0 {
            Vec::new()
        } else {
            even_split(rows, pieces)
        };
        Ok(Self {
            rows,
            row_bytes,
            staging_buffers: buffers.min(pieces.len()),
            pieces,
        })
    }

    /// The smallest bound [`ChunkSpec::MaxStagingBytes`] accepts for a tensor of `shape` and
    /// `dtype`: the staging block of one row.
    pub fn min_staging_bytes(shape: &[usize], dtype: DType) -> usize {
        let numel: usize = shape.iter().product();
        let rows = shape.first().copied().unwrap_or(1).max(1);
        pinned_block_size(numel / rows * dtype.size())
    }

    /// Rows along axis 0 (1 for a 0-d tensor).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The pieces, as row ranges, in order; empty for a tensor without elements.
    pub fn pieces(&self) -> &[Range<usize>] {
        &self.pieces
    }

    /// Number of pieces.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether there is nothing to move.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Bytes of piece `i` within the dense, row-major tensor.
    pub fn byte_range(&self, i: usize) -> Range<usize> {
        let rows = &self.pieces[i];
        rows.start * self.row_bytes..rows.end * self.row_bytes
    }

    /// Bytes of the largest piece: the size of each staging buffer.
    pub fn piece_bytes(&self) -> usize {
        self.pieces
            .iter()
            .map(|r| r.len() * self.row_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Staging buffers used in turn: 4 or 2 (the DMA of one piece overlaps the copy-out of
    /// another), 1 when only one piece fits the bound, 0 when there is nothing to move.
    pub fn staging_buffers(&self) -> usize {
        self.staging_buffers
    }

    /// Pinned bytes the staging takes, as the pool counts them (block sizes).
    pub fn staging_bytes(&self) -> usize {
        self.staging_buffers * pinned_block_size(self.piece_bytes())
    }
}

/// The pinned pool's block size for a request of `bytes` (the size class its statistics count).
pub fn pinned_block_size(bytes: usize) -> usize {
    ferry_memory::cuda::PinnedPool::block_size(bytes)
}

/// The most rows (at least 1, at most `rows`) whose staging block fits in `budget`.
fn rows_fitting(row_bytes: usize, rows: usize, budget: usize) -> usize {
    let fits = |r: usize| pinned_block_size(r * row_bytes) <= budget;
    // Block sizes grow with the request, so the rows that fit form a prefix: binary search.
    let (mut lo, mut hi) = (1, rows.min(budget / row_bytes.max(1)).max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) { lo = mid } else { hi = mid - 1 }
    }
    lo
}

/// `rows` split into `pieces` ranges whose lengths differ by at most one, longer ones first.
fn even_split(rows: usize, pieces: usize) -> Vec<Range<usize>> {
    let (base, extra) = (rows / pieces, rows % pieces);
    let mut start = 0;
    (0..pieces)
        .map(|i| {
            let len = base + usize::from(i < extra);
            start += len;
            start - len..start
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_spread_the_remainder_over_the_first_pieces() {
        assert_eq!(even_split(10, 4), [0..3, 3..6, 6..8, 8..10]);
    }

    #[test]
    fn a_count_bounds_staging_to_that_fraction_of_the_tensor() {
        // 1000 rows of 4096 bytes: Count(4) allows 1,024,000 bytes of staging, so two blocks of
        // at most 512,000 bytes each, as the pool rounds them.
        let plan = ChunkPlan::new(&[1000, 1024], DType::F32, ChunkSpec::Count(4)).unwrap();
        assert_eq!(plan.staging_buffers(), 2);
        assert!(
            plan.staging_bytes() <= 1_024_000,
            "{}",
            plan.staging_bytes()
        );
        assert!(
            plan.staging_bytes() > 1_024_000 * 3 / 4,
            "pieces use most of the bound"
        );
        let rows_per_piece = plan.piece_bytes() / 4096;
        assert_eq!(plan.len(), 1000usize.div_ceil(rows_per_piece));
        // Tiny rows: one row's block is the floor.
        let small = ChunkPlan::new(&[10, 3], DType::F32, ChunkSpec::Count(2)).unwrap();
        assert_eq!((small.len(), small.staging_buffers()), (1, 1));
    }

    #[test]
    fn block_sizes_match_the_pool_classes() {
        assert_eq!(pinned_block_size(1), 4096);
        assert_eq!(pinned_block_size(4097), 4096 + 512);
        assert_eq!(pinned_block_size(1 << 20), 1 << 20);
        assert_eq!(pinned_block_size((1 << 20) + 1), (1 << 20) + (1 << 17));
    }
}
