//! The 320 entries of torchvision's `resnet50().state_dict()`, in its order: names and shapes.
//!
//! Written out as data (from the architecture: a 7x7 stem, bottlenecks [3, 4, 6, 3] of widths
//! 64/128/256/512 with expansion 4, one downsample per stage, fc 1000x2048) so the benchmark
//! needs no torchvision. python/transfer.py holds the same list; a test checks they agree.
//! Parameters total 25,557,032, torchvision's count for resnet50.

/// Name and shape of each entry; `num_batches_tracked` entries are int64 scalars, the rest f32.
pub const RESNET50_STATE_DICT: &[(&str, &[usize])] = &[
    ("conv1.weight", &[64, 3, 7, 7]),
    ("bn1.weight", &[64]),
    ("bn1.bias", &[64]),
    ("bn1.running_mean", &[64]),
    ("bn1.running_var", &[64]),
    ("bn1.num_batches_tracked", &[]),
    ("layer1.0.conv1.weight", &[64, 64, 1, 1]),
    ("layer1.0.bn1.weight", &[64]),
    ("layer1.0.bn1.bias", &[64]),
    ("layer1.0.bn1.running_mean", &[64]),
    ("layer1.0.bn1.running_var", &[64]),
    ("layer1.0.bn1.num_batches_tracked", &[]),
    ("layer1.0.conv2.weight", &[64, 64, 3, 3]),
    ("layer1.0.bn2.weight", &[64]),
    ("layer1.0.bn2.bias", &[64]),
    ("layer1.0.bn2.running_mean", &[64]),
    ("layer1.0.bn2.running_var", &[64]),
    ("layer1.0.bn2.num_batches_tracked", &[]),
    ("layer1.0.conv3.weight", &[256, 64, 1, 1]),
    ("layer1.0.bn3.weight", &[256]),
    ("layer1.0.bn3.bias", &[256]),
    ("layer1.0.bn3.running_mean", &[256]),
    ("layer1.0.bn3.running_var", &[256]),
    ("layer1.0.bn3.num_batches_tracked", &[]),
    ("layer1.0.downsample.0.weight", &[256, 64, 1, 1]),
    ("layer1.0.downsample.1.weight", &[256]),
    ("layer1.0.downsample.1.bias", &[256]),
    ("layer1.0.downsample.1.running_mean", &[256]),
    ("layer1.0.downsample.1.running_var", &[256]),
    ("layer1.0.downsample.1.num_batches_tracked", &[]),
    ("layer1.1.conv1.weight", &[64, 256, 1, 1]),
    ("layer1.1.bn1.weight", &[64]),
    ("layer1.1.bn1.bias", &[64]),
    ("layer1.1.bn1.running_mean", &[64]),
    ("layer1.1.bn1.running_var", &[64]),
    ("layer1.1.bn1.num_batches_tracked", &[]),
    ("layer1.1.conv2.weight", &[64, 64, 3, 3]),
    ("layer1.1.bn2.weight", &[64]),
    ("layer1.1.bn2.bias", &[64]),
    ("layer1.1.bn2.running_mean", &[64]),
    ("layer1.1.bn2.running_var", &[64]),
    ("layer1.1.bn2.num_batches_tracked", &[]),
    ("layer1.1.conv3.weight", &[256, 64, 1, 1]),
    ("layer1.1.bn3.weight", &[256]),
    ("layer1.1.bn3.bias", &[256]),
    ("layer1.1.bn3.running_mean", &[256]),
    ("layer1.1.bn3.running_var", &[256]),
    ("layer1.1.bn3.num_batches_tracked", &[]),
    ("layer1.2.conv1.weight", &[64, 256, 1, 1]),
    ("layer1.2.bn1.weight", &[64]),
    ("layer1.2.bn1.bias", &[64]),
    ("layer1.2.bn1.running_mean", &[64]),
    ("layer1.2.bn1.running_var", &[64]),
    ("layer1.2.bn1.num_batches_tracked", &[]),
    ("layer1.2.conv2.weight", &[64, 64, 3, 3]),
    ("layer1.2.bn2.weight", &[64]),
    ("layer1.2.bn2.bias", &[64]),
    ("layer1.2.bn2.running_mean", &[64]),
    ("layer1.2.bn2.running_var", &[64]),
    ("layer1.2.bn2.num_batches_tracked", &[]),
    ("layer1.2.conv3.weight", &[256, 64, 1, 1]),
    ("layer1.2.bn3.weight", &[256]),
    ("layer1.2.bn3.bias", &[256]),
    ("layer1.2.bn3.running_mean", &[256]),
    ("layer1.2.bn3.running_var", &[256]),
    ("layer1.2.bn3.num_batches_tracked", &[]),
    ("layer2.0.conv1.weight", &[128, 256, 1, 1]),
    ("layer2.0.bn1.weight", &[128]),
    ("layer2.0.bn1.bias", &[128]),
    ("layer2.0.bn1.running_mean", &[128]),
    ("layer2.0.bn1.running_var", &[128]),
    ("layer2.0.bn1.num_batches_tracked", &[]),
    ("layer2.0.conv2.weight", &[128, 128, 3, 3]),
    ("layer2.0.bn2.weight", &[128]),
    ("layer2.0.bn2.bias", &[128]),
    ("layer2.0.bn2.running_mean", &[128]),
    ("layer2.0.bn2.running_var", &[128]),
    ("layer2.0.bn2.num_batches_tracked", &[]),
    ("layer2.0.conv3.weight", &[512, 128, 1, 1]),
    ("layer2.0.bn3.weight", &[512]),
    ("layer2.0.bn3.bias", &[512]),
    ("layer2.0.bn3.running_mean", &[512]),
    ("layer2.0.bn3.running_var", &[512]),
    ("layer2.0.bn3.num_batches_tracked", &[]),
    ("layer2.0.downsample.0.weight", &[512, 256, 1, 1]),
    ("layer2.0.downsample.1.weight", &[512]),
    ("layer2.0.downsample.1.bias", &[512]),
    ("layer2.0.downsample.1.running_mean", &[512]),
    ("layer2.0.downsample.1.running_var", &[512]),
    ("layer2.0.downsample.1.num_batches_tracked", &[]),
    ("layer2.1.conv1.weight", &[128, 512, 1, 1]),
    ("layer2.1.bn1.weight", &[128]),
    ("layer2.1.bn1.bias", &[128]),
    ("layer2.1.bn1.running_mean", &[128]),
    ("layer2.1.bn1.running_var", &[128]),
    ("layer2.1.bn1.num_batches_tracked", &[]),
    ("layer2.1.conv2.weight", &[128, 128, 3, 3]),
    ("layer2.1.bn2.weight", &[128]),
    ("layer2.1.bn2.bias", &[128]),
    ("layer2.1.bn2.running_mean", &[128]),
    ("layer2.1.bn2.running_var", &[128]),
    ("layer2.1.bn2.num_batches_tracked", &[]),
    ("layer2.1.conv3.weight", &[512, 128, 1, 1]),
    ("layer2.1.bn3.weight", &[512]),
    ("layer2.1.bn3.bias", &[512]),
    ("layer2.1.bn3.running_mean", &[512]),
    ("layer2.1.bn3.running_var", &[512]),
    ("layer2.1.bn3.num_batches_tracked", &[]),
    ("layer2.2.conv1.weight", &[128, 512, 1, 1]),
    ("layer2.2.bn1.weight", &[128]),
    ("layer2.2.bn1.bias", &[128]),
    ("layer2.2.bn1.running_mean", &[128]),
    ("layer2.2.bn1.running_var", &[128]),
    ("layer2.2.bn1.num_batches_tracked", &[]),
    ("layer2.2.conv2.weight", &[128, 128, 3, 3]),
    ("layer2.2.bn2.weight", &[128]),
    ("layer2.2.bn2.bias", &[128]),
    ("layer2.2.bn2.running_mean", &[128]),
    ("layer2.2.bn2.running_var", &[128]),
    ("layer2.2.bn2.num_batches_tracked", &[]),
    ("layer2.2.conv3.weight", &[512, 128, 1, 1]),
    ("layer2.2.bn3.weight", &[512]),
    ("layer2.2.bn3.bias", &[512]),
    ("layer2.2.bn3.running_mean", &[512]),
    ("layer2.2.bn3.running_var", &[512]),
    ("layer2.2.bn3.num_batches_tracked", &[]),
    ("layer2.3.conv1.weight", &[128, 512, 1, 1]),
    ("layer2.3.bn1.weight", &[128]),
    ("layer2.3.bn1.bias", &[128]),
    ("layer2.3.bn1.running_mean", &[128]),
    ("layer2.3.bn1.running_var", &[128]),
    ("layer2.3.bn1.num_batches_tracked", &[]),
    ("layer2.3.conv2.weight", &[128, 128, 3, 3]),
    ("layer2.3.bn2.weight", &[128]),
    ("layer2.3.bn2.bias", &[128]),
    ("layer2.3.bn2.running_mean", &[128]),
    ("layer2.3.bn2.running_var", &[128]),
    ("layer2.3.bn2.num_batches_tracked", &[]),
    ("layer2.3.conv3.weight", &[512, 128, 1, 1]),
    ("layer2.3.bn3.weight", &[512]),
    ("layer2.3.bn3.bias", &[512]),
    ("layer2.3.bn3.running_mean", &[512]),
    ("layer2.3.bn3.running_var", &[512]),
    ("layer2.3.bn3.num_batches_tracked", &[]),
    ("layer3.0.conv1.weight", &[256, 512, 1, 1]),
    ("layer3.0.bn1.weight", &[256]),
    ("layer3.0.bn1.bias", &[256]),
    ("layer3.0.bn1.running_mean", &[256]),
    ("layer3.0.bn1.running_var", &[256]),
    ("layer3.0.bn1.num_batches_tracked", &[]),
    ("layer3.0.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.0.bn2.weight", &[256]),
    ("layer3.0.bn2.bias", &[256]),
    ("layer3.0.bn2.running_mean", &[256]),
    ("layer3.0.bn2.running_var", &[256]),
    ("layer3.0.bn2.num_batches_tracked", &[]),
    ("layer3.0.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.0.bn3.weight", &[1024]),
    ("layer3.0.bn3.bias", &[1024]),
    ("layer3.0.bn3.running_mean", &[1024]),
    ("layer3.0.bn3.running_var", &[1024]),
    ("layer3.0.bn3.num_batches_tracked", &[]),
    ("layer3.0.downsample.0.weight", &[1024, 512, 1, 1]),
    ("layer3.0.downsample.1.weight", &[1024]),
    ("layer3.0.downsample.1.bias", &[1024]),
    ("layer3.0.downsample.1.running_mean", &[1024]),
    ("layer3.0.downsample.1.running_var", &[1024]),
    ("layer3.0.downsample.1.num_batches_tracked", &[]),
    ("layer3.1.conv1.weight", &[256, 1024, 1, 1]),
    ("layer3.1.bn1.weight", &[256]),
    ("layer3.1.bn1.bias", &[256]),
    ("layer3.1.bn1.running_mean", &[256]),
    ("layer3.1.bn1.running_var", &[256]),
    ("layer3.1.bn1.num_batches_tracked", &[]),
    ("layer3.1.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.1.bn2.weight", &[256]),
    ("layer3.1.bn2.bias", &[256]),
    ("layer3.1.bn2.running_mean", &[256]),
    ("layer3.1.bn2.running_var", &[256]),
    ("layer3.1.bn2.num_batches_tracked", &[]),
    ("layer3.1.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.1.bn3.weight", &[1024]),
    ("layer3.1.bn3.bias", &[1024]),
    ("layer3.1.bn3.running_mean", &[1024]),
    ("layer3.1.bn3.running_var", &[1024]),
    ("layer3.1.bn3.num_batches_tracked", &[]),
    ("layer3.2.conv1.weight", &[256, 1024, 1, 1]),
    ("layer3.2.bn1.weight", &[256]),
    ("layer3.2.bn1.bias", &[256]),
    ("layer3.2.bn1.running_mean", &[256]),
    ("layer3.2.bn1.running_var", &[256]),
    ("layer3.2.bn1.num_batches_tracked", &[]),
    ("layer3.2.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.2.bn2.weight", &[256]),
    ("layer3.2.bn2.bias", &[256]),
    ("layer3.2.bn2.running_mean", &[256]),
    ("layer3.2.bn2.running_var", &[256]),
    ("layer3.2.bn2.num_batches_tracked", &[]),
    ("layer3.2.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.2.bn3.weight", &[1024]),
    ("layer3.2.bn3.bias", &[1024]),
    ("layer3.2.bn3.running_mean", &[1024]),
    ("layer3.2.bn3.running_var", &[1024]),
    ("layer3.2.bn3.num_batches_tracked", &[]),
    ("layer3.3.conv1.weight", &[256, 1024, 1, 1]),
    ("layer3.3.bn1.weight", &[256]),
    ("layer3.3.bn1.bias", &[256]),
    ("layer3.3.bn1.running_mean", &[256]),
    ("layer3.3.bn1.running_var", &[256]),
    ("layer3.3.bn1.num_batches_tracked", &[]),
    ("layer3.3.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.3.bn2.weight", &[256]),
    ("layer3.3.bn2.bias", &[256]),
    ("layer3.3.bn2.running_mean", &[256]),
    ("layer3.3.bn2.running_var", &[256]),
    ("layer3.3.bn2.num_batches_tracked", &[]),
    ("layer3.3.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.3.bn3.weight", &[1024]),
    ("layer3.3.bn3.bias", &[1024]),
    ("layer3.3.bn3.running_mean", &[1024]),
    ("layer3.3.bn3.running_var", &[1024]),
    ("layer3.3.bn3.num_batches_tracked", &[]),
    ("layer3.4.conv1.weight", &[256, 1024, 1, 1]),
    ("layer3.4.bn1.weight", &[256]),
    ("layer3.4.bn1.bias", &[256]),
    ("layer3.4.bn1.running_mean", &[256]),
    ("layer3.4.bn1.running_var", &[256]),
    ("layer3.4.bn1.num_batches_tracked", &[]),
    ("layer3.4.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.4.bn2.weight", &[256]),
    ("layer3.4.bn2.bias", &[256]),
    ("layer3.4.bn2.running_mean", &[256]),
    ("layer3.4.bn2.running_var", &[256]),
    ("layer3.4.bn2.num_batches_tracked", &[]),
    ("layer3.4.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.4.bn3.weight", &[1024]),
    ("layer3.4.bn3.bias", &[1024]),
    ("layer3.4.bn3.running_mean", &[1024]),
    ("layer3.4.bn3.running_var", &[1024]),
    ("layer3.4.bn3.num_batches_tracked", &[]),
    ("layer3.5.conv1.weight", &[256, 1024, 1, 1]),
    ("layer3.5.bn1.weight", &[256]),
    ("layer3.5.bn1.bias", &[256]),
    ("layer3.5.bn1.running_mean", &[256]),
    ("layer3.5.bn1.running_var", &[256]),
    ("layer3.5.bn1.num_batches_tracked", &[]),
    ("layer3.5.conv2.weight", &[256, 256, 3, 3]),
    ("layer3.5.bn2.weight", &[256]),
    ("layer3.5.bn2.bias", &[256]),
    ("layer3.5.bn2.running_mean", &[256]),
    ("layer3.5.bn2.running_var", &[256]),
    ("layer3.5.bn2.num_batches_tracked", &[]),
    ("layer3.5.conv3.weight", &[1024, 256, 1, 1]),
    ("layer3.5.bn3.weight", &[1024]),
    ("layer3.5.bn3.bias", &[1024]),
    ("layer3.5.bn3.running_mean", &[1024]),
    ("layer3.5.bn3.running_var", &[1024]),
    ("layer3.5.bn3.num_batches_tracked", &[]),
    ("layer4.0.conv1.weight", &[512, 1024, 1, 1]),
    ("layer4.0.bn1.weight", &[512]),
    ("layer4.0.bn1.bias", &[512]),
    ("layer4.0.bn1.running_mean", &[512]),
    ("layer4.0.bn1.running_var", &[512]),
    ("layer4.0.bn1.num_batches_tracked", &[]),
    ("layer4.0.conv2.weight", &[512, 512, 3, 3]),
    ("layer4.0.bn2.weight", &[512]),
    ("layer4.0.bn2.bias", &[512]),
    ("layer4.0.bn2.running_mean", &[512]),
    ("layer4.0.bn2.running_var", &[512]),
    ("layer4.0.bn2.num_batches_tracked", &[]),
    ("layer4.0.conv3.weight", &[2048, 512, 1, 1]),
    ("layer4.0.bn3.weight", &[2048]),
    ("layer4.0.bn3.bias", &[2048]),
    ("layer4.0.bn3.running_mean", &[2048]),
    ("layer4.0.bn3.running_var", &[2048]),
    ("layer4.0.bn3.num_batches_tracked", &[]),
    ("layer4.0.downsample.0.weight", &[2048, 1024, 1, 1]),
    ("layer4.0.downsample.1.weight", &[2048]),
    ("layer4.0.downsample.1.bias", &[2048]),
    ("layer4.0.downsample.1.running_mean", &[2048]),
    ("layer4.0.downsample.1.running_var", &[2048]),
    ("layer4.0.downsample.1.num_batches_tracked", &[]),
    ("layer4.1.conv1.weight", &[512, 2048, 1, 1]),
    ("layer4.1.bn1.weight", &[512]),
    ("layer4.1.bn1.bias", &[512]),
    ("layer4.1.bn1.running_mean", &[512]),
    ("layer4.1.bn1.running_var", &[512]),
    ("layer4.1.bn1.num_batches_tracked", &[]),
    ("layer4.1.conv2.weight", &[512, 512, 3, 3]),
    ("layer4.1.bn2.weight", &[512]),
    ("layer4.1.bn2.bias", &[512]),
    ("layer4.1.bn2.running_mean", &[512]),
    ("layer4.1.bn2.running_var", &[512]),
    ("layer4.1.bn2.num_batches_tracked", &[]),
    ("layer4.1.conv3.weight", &[2048, 512, 1, 1]),
    ("layer4.1.bn3.weight", &[2048]),
    ("layer4.1.bn3.bias", &[2048]),
    ("layer4.1.bn3.running_mean", &[2048]),
    ("layer4.1.bn3.running_var", &[2048]),
    ("layer4.1.bn3.num_batches_tracked", &[]),
    ("layer4.2.conv1.weight", &[512, 2048, 1, 1]),
    ("layer4.2.bn1.weight", &[512]),
    ("layer4.2.bn1.bias", &[512]),
    ("layer4.2.bn1.running_mean", &[512]),
    ("layer4.2.bn1.running_var", &[512]),
    ("layer4.2.bn1.num_batches_tracked", &[]),
    ("layer4.2.conv2.weight", &[512, 512, 3, 3]),
    ("layer4.2.bn2.weight", &[512]),
    ("layer4.2.bn2.bias", &[512]),
    ("layer4.2.bn2.running_mean", &[512]),
    ("layer4.2.bn2.running_var", &[512]),
    ("layer4.2.bn2.num_batches_tracked", &[]),
    ("layer4.2.conv3.weight", &[2048, 512, 1, 1]),
    ("layer4.2.bn3.weight", &[2048]),
    ("layer4.2.bn3.bias", &[2048]),
    ("layer4.2.bn3.running_mean", &[2048]),
    ("layer4.2.bn3.running_var", &[2048]),
    ("layer4.2.bn3.num_batches_tracked", &[]),
    ("fc.weight", &[1000, 2048]),
    ("fc.bias", &[1000]),
];

/// Whether an entry is one of the int64 batch counters rather than an f32 tensor.
pub fn is_counter(name: &str) -> bool {
    name.ends_with("num_batches_tracked")
}

/// Bytes of the f32 entries (the counters add 8 bytes each).
pub fn float_bytes() -> usize {
    RESNET50_STATE_DICT
        .iter()
        .filter(|(name, _)| !is_counter(name))
        .map(|(_, shape)| shape.iter().product::<usize>() * 4)
        .sum()
}

/// Bytes of every entry, counters included.
pub fn total_bytes() -> usize {
    let counters = RESNET50_STATE_DICT
        .iter()
        .filter(|(name, _)| is_counter(name))
        .count();
    float_bytes() + counters * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_torchvision_counts() {
        assert_eq!(RESNET50_STATE_DICT.len(), 320);
        let counters: Vec<_> = RESNET50_STATE_DICT
            .iter()
            .filter(|(name, _)| is_counter(name))
            .collect();
        // One counter per batch norm: 53 of them, all scalars.
        assert_eq!(counters.len(), 53);
        assert!(counters.iter().all(|(_, shape)| shape.is_empty()));
        // Learnable parameters: torchvision's documented 25,557,032.
        let params: usize = RESNET50_STATE_DICT
            .iter()
            .filter(|(name, _)| !is_counter(name) && !name.contains("running_"))
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum();
        assert_eq!(params, 25_557_032);
        assert_eq!(float_bytes(), 102_440_608);
        assert_eq!(total_bytes(), 102_440_608 + 53 * 8);
    }

    #[test]
    fn names_are_unique_and_in_state_dict_order() {
        let mut names: Vec<&str> = RESNET50_STATE_DICT.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.first(), Some(&"conv1.weight"));
        assert_eq!(names.last(), Some(&"fc.bias"));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 320);
    }

    /// python/transfer.py must move the very same tensors, or the ratio compares two workloads.
    #[test]
    fn agrees_with_the_pytorch_script() {
        let script = include_str!("../python/transfer.py");
        let parsed: Vec<(String, Vec<usize>)> = script
            .lines()
            .filter_map(|line| {
                let rest = line.trim().strip_prefix("(\"")?;
                let (name, rest) = rest.split_once("\", (")?;
                let dims = rest.strip_suffix(")),")?;
                let shape = dims
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(|d| d.parse().expect("a dimension"))
                    .collect();
                Some((name.to_string(), shape))
            })
            .collect();
        let ours: Vec<(String, Vec<usize>)> = RESNET50_STATE_DICT
            .iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect();
        assert_eq!(parsed, ours);
    }
}
