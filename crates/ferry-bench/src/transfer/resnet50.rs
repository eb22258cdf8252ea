//! The 320 entries of torchvision's `resnet50().state_dict()`, in its order: names and shapes.
//!
//! Built from the architecture (a 7x7 stem, bottlenecks [3, 4, 6, 3] of widths 64/128/256/512
//! with expansion 4, one downsample per stage, fc 1000x2048) so the benchmark needs no
//! torchvision. python/transfer.py holds the same list; a test checks they agree.
//! Parameters total 25,557,032, torchvision's count for resnet50.

/// Name and shape of each entry; `num_batches_tracked` entries are int64 scalars, the rest f32.
pub fn state_dict() -> Vec<(String, Vec<usize>)> {
    let mut entries = Vec::with_capacity(320);
    let mut conv_bn = |prefix: &str, conv: &str, bn: &str, shape: [usize; 4]| {
        entries.push((format!("{prefix}{conv}.weight"), shape.to_vec()));
        for field in ["weight", "bias", "running_mean", "running_var"] {
            entries.push((format!("{prefix}{bn}.{field}"), vec![shape[0]]));
        }
        entries.push((format!("{prefix}{bn}.num_batches_tracked"), Vec::new()));
    };
    conv_bn("", "conv1", "bn1", [64, 3, 7, 7]);
    let mut inputs = 64;
    for (stage, (blocks, width)) in [(3, 64), (4, 128), (6, 256), (3, 512)].iter().enumerate() {
        for block in 0..*blocks {
            let prefix = format!("layer{}.{block}.", stage + 1);
            conv_bn(&prefix, "conv1", "bn1", [*width, inputs, 1, 1]);
            conv_bn(&prefix, "conv2", "bn2", [*width, *width, 3, 3]);
            conv_bn(&prefix, "conv3", "bn3", [width * 4, *width, 1, 1]);
            if block == 0 {
                let shape = [width * 4, inputs, 1, 1];
                conv_bn(&prefix, "downsample.0", "downsample.1", shape);
            }
            inputs = width * 4;
        }
    }
    entries.push(("fc.weight".into(), vec![1000, 2048]));
    entries.push(("fc.bias".into(), vec![1000]));
    entries
}

/// Whether an entry is one of the int64 batch counters rather than an f32 tensor.
pub fn is_counter(name: &str) -> bool {
    name.ends_with("num_batches_tracked")
}

/// Bytes of the f32 entries (the counters add 8 bytes each).
pub fn float_bytes() -> usize {
    state_dict()
        .iter()
        .filter(|(name, _)| !is_counter(name))
        .map(|(_, shape)| shape.iter().product::<usize>() * 4)
        .sum()
}

/// Bytes of every entry, counters included.
pub fn total_bytes() -> usize {
    let counters = state_dict().iter().filter(|(n, _)| is_counter(n)).count();
    float_bytes() + counters * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_torchvision_counts() {
        let dict = state_dict();
        assert_eq!(dict.len(), 320);
        let counters: Vec<_> = dict.iter().filter(|(name, _)| is_counter(name)).collect();
        // One counter per batch norm: 53 of them, all scalars.
        assert_eq!(counters.len(), 53);
        assert!(counters.iter().all(|(_, shape)| shape.is_empty()));
        // Learnable parameters: torchvision's documented 25,557,032.
        let params: usize = dict
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
        let mut names: Vec<String> = state_dict().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.first().map(String::as_str), Some("conv1.weight"));
        assert_eq!(names.last().map(String::as_str), Some("fc.bias"));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 320);
    }

    /// python/transfer.py must move the very same tensors, or the ratio compares two workloads.
    #[test]
    fn agrees_with_the_pytorch_script() {
        let script = include_str!("../../python/transfer.py");
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
        assert_eq!(parsed, state_dict());
    }
}
