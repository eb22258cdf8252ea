//! Size classes of the three pools (device allocator, pinned pool, host pool): the block size a
//! request of so many bytes gets, and the largest cached block that may serve it.
//!
//! Every class is checked: a request whose block would pass [`MAX_BYTES`] has no class (`None`),
//! and the pool refuses it with [`MemoryError::RequestTooLarge`] naming its largest request. An
//! unchecked rounding wraps near `usize::MAX` to a block of a few bytes (or none) that a buffer
//! claiming the full length would then overrun.

use crate::MemoryError;
use crate::size::MAX_BYTES;

/// Device requests below this are "small" and come from the small pool.
pub(crate) const SMALL_LIMIT: usize = 1 << 20;
/// Small device blocks are multiples of this.
pub(crate) const SMALL_GRANULE: usize = 512;
/// Large device blocks are multiples of this (the driver maps device memory in 2 MiB pages).
pub(crate) const LARGE_GRANULE: usize = 2 << 20;
/// The smallest pinned block: one page.
pub(crate) const PINNED_MIN: usize = 4096;
/// Host-pool blocks are whole huge pages.
pub(crate) const HOST_GRANULE: usize = 2 << 20;

/// The largest request the device allocator serves: the last multiple of 2 MiB within
/// [`MAX_BYTES`].
pub(crate) const DEVICE_MAX_REQUEST: usize = MAX_BYTES - MAX_BYTES % LARGE_GRANULE;
/// The largest request the pinned pool serves: the last class within [`MAX_BYTES`] (a multiple
/// of 1/8 of the power of two below it).
pub(crate) const PINNED_MAX_REQUEST: usize = MAX_BYTES - MAX_BYTES % (1 << (MAX_BYTES.ilog2() - 3));
/// The largest request the host pool serves: the pinned limit is already whole huge pages.
pub(crate) const HOST_MAX_REQUEST: usize = PINNED_MAX_REQUEST;

/// `bytes` rounded up to a multiple of `granule`, or `None` beyond [`MAX_BYTES`].
fn round_up(bytes: usize, granule: usize) -> Option<usize> {
    bytes
        .checked_next_multiple_of(granule)
        .filter(|&class| class <= MAX_BYTES)
}

/// The block size the device allocator uses for a request of `bytes` (> 0).
pub(crate) fn device_class(bytes: usize) -> Option<usize> {
    if bytes < SMALL_LIMIT {
        round_up(bytes, SMALL_GRANULE)
    } else {
        round_up(bytes, LARGE_GRANULE)
    }
}

/// The block size the pinned pool uses for a request of `bytes` (> 0).
///
/// Rounds up to a multiple of 2^(floor(log2 n) - 3): eight classes per power of two, so the
/// waste is below 1/8 of the request. Power-of-two doubling would waste up to half.
pub(crate) fn pinned_class(bytes: usize) -> Option<usize> {
    if bytes <= PINNED_MIN {
        return Some(PINNED_MIN);
    }
    round_up(bytes, 1 << (bytes.ilog2() - 3))
}

/// The pinned class after `class` (a class of [`pinned_class`]): the largest block the pinned
/// pool hands out for a request of `class`. A block serves requests one class smaller than
/// itself, so at most 1/4 of it goes unused (two granules of 1/8 of the request's power of two).
/// Past the last class it is `class` itself: no larger block exists to serve it.
pub(crate) fn next_pinned_class(class: usize) -> usize {
    let class = class.max(PINNED_MIN);
    class
        .checked_add(1 << (class.ilog2() - 3))
        .filter(|&next| next <= MAX_BYTES)
        .unwrap_or(class)
}

/// The block size the host pool uses for a request of `bytes`: the pinned class, rounded up to
/// whole huge pages.
pub(crate) fn host_class(bytes: usize) -> Option<usize> {
    round_up(pinned_class(bytes)?, HOST_GRANULE)
}

/// The largest cached block the device allocator hands out for a request of class `class`: at
/// most 1/8 of the block may go unused (block - class <= block / 8, i.e. block <= 8/7 class).
pub(crate) fn largest_reusable(class: usize) -> usize {
    class.saturating_mul(8) / 7
}

/// The error for a request of `requested` bytes that no class of a pool serving at most
/// `limit` bytes holds.
pub(crate) fn too_large(op: &'static str, requested: usize, limit: usize) -> MemoryError {
    MemoryError::RequestTooLarge {
        op,
        requested,
        limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_classes_round_small_to_512_and_large_to_2_mib() {
        assert_eq!(device_class(1), Some(512));
        assert_eq!(device_class(512), Some(512));
        assert_eq!(device_class(513), Some(1024));
        assert_eq!(device_class(SMALL_LIMIT - 1), Some(SMALL_LIMIT));
        assert_eq!(device_class(SMALL_LIMIT), Some(2 << 20));
        assert_eq!(device_class((2 << 20) + 1), Some(4 << 20));
        // 400e6 / 2 MiB = 190.7 -> 191 pages.
        assert_eq!(device_class(400_000_000), Some(191 * (2 << 20)));
    }

    #[test]
    fn pinned_classes_waste_under_an_eighth_and_never_double() {
        assert_eq!(pinned_class(1), Some(PINNED_MIN));
        assert_eq!(pinned_class(4096), Some(4096));
        // 4097: log2 = 12, granule 2^9 = 512, so 4608 (not 8192).
        assert_eq!(pinned_class(4097), Some(4608));
        // 400 MB: granule 2^25 = 32 MiB, 400e6 / 2^25 = 11.92 -> 12 * 32 MiB.
        assert_eq!(pinned_class(400_000_000), Some(12 << 25));
        let mut n = PINNED_MIN + 1;
        while n < (1 << 40) {
            for m in [n, n + 1, n * 3 / 2, 2 * n - 1] {
                let class = pinned_class(m).unwrap();
                assert!(class >= m && (class - m) * 8 < m, "{m} -> {class}");
                assert_eq!(pinned_class(class), Some(class), "a class is its own class");
            }
            n *= 2;
        }
    }

    #[test]
    fn a_pinned_block_serves_requests_one_class_smaller_wasting_under_a_quarter() {
        // Classes from 4096: 4096, 4608, ..., 7680, 8192, 9216, ...
        assert_eq!(next_pinned_class(4096), 4608);
        assert_eq!(next_pinned_class(7680), 8192);
        assert_eq!(next_pinned_class(8192), 9216);
        // 384 MiB (the class of 400 MB): granule 32 MiB.
        assert_eq!(next_pinned_class(12 << 25), 13 << 25);
        let mut n = PINNED_MIN + 1;
        while n < (1 << 40) {
            for m in [n, n + 1, n * 3 / 2, 2 * n - 1] {
                let class = pinned_class(m).unwrap();
                let next = next_pinned_class(class);
                assert!(next > class, "{m}");
                assert_eq!(pinned_class(next), Some(next), "the next class is a class");
                assert_eq!(pinned_class(class + 1), Some(next), "no class lies between");
                // Served by the next class up, a request leaves under 1/4 of the block unused.
                assert!((next - m) * 4 < next, "{m} in a block of {next}");
            }
            n *= 2;
        }
    }

    #[test]
    fn reuse_bound_allows_exact_and_up_to_an_eighth_unused() {
        assert_eq!(largest_reusable(3584), 4096); // 512 of 4096 unused = 1/8
        assert!(largest_reusable(3583) < 4096);
        for class in [512, 4096, 2 << 20, 191 * (2 << 20)] {
            let largest = largest_reusable(class);
            assert!((largest - class) * 8 <= largest && largest >= class);
        }
    }

    #[test]
    fn classes_near_usize_max_are_refused_not_wrapped() {
        // Unchecked, usize::MAX - 1 rounds up to 16 * 2^60 = 2^64, which wraps to 0.
        for bytes in [usize::MAX, usize::MAX - 1, MAX_BYTES + 1] {
            assert_eq!(pinned_class(bytes), None, "{bytes}");
            assert_eq!(device_class(bytes), None, "{bytes}");
            assert_eq!(host_class(bytes), None, "{bytes}");
        }
        // Each limit is the largest request with a class, and that class is within MAX_BYTES.
        assert_eq!(device_class(DEVICE_MAX_REQUEST), Some(DEVICE_MAX_REQUEST));
        assert_eq!(device_class(DEVICE_MAX_REQUEST + 1), None);
        assert_eq!(pinned_class(PINNED_MAX_REQUEST), Some(PINNED_MAX_REQUEST));
        assert_eq!(pinned_class(PINNED_MAX_REQUEST + 1), None);
        assert_eq!(host_class(HOST_MAX_REQUEST), Some(HOST_MAX_REQUEST));
        assert_eq!(host_class(HOST_MAX_REQUEST + 1), None);
        // 2^63 - 2^59: the last multiple of 2^59 (1/8 of 2^62) below 2^63.
        assert_eq!(PINNED_MAX_REQUEST, (1 << 63) - (1 << 59));
        assert_eq!(DEVICE_MAX_REQUEST, (1 << 63) - (2 << 20));
        // The last class has no class above it: it serves its own class only.
        assert_eq!(next_pinned_class(PINNED_MAX_REQUEST), PINNED_MAX_REQUEST);
        assert_eq!(
            next_pinned_class(PINNED_MAX_REQUEST - (1 << 59)),
            PINNED_MAX_REQUEST
        );
    }

    #[test]
    fn a_request_too_large_names_the_limit() {
        let text = too_large("HostPool::alloc", usize::MAX - 1, HOST_MAX_REQUEST).to_string();
        for needle in [
            "HostPool::alloc",
            "18446744073709551614 bytes",
            &HOST_MAX_REQUEST.to_string(),
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
    }
}
