//! Where a tensor lives.

use std::fmt;
use std::str::FromStr;

use crate::MemoryError;

/// A device: the host, or a CUDA GPU by ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The CUDA ordinal, if any.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(ordinal),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl FromStr for Device {
    type Err = MemoryError;

    /// Parses `cpu`, `cuda` (ordinal 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || MemoryError::BadDevice {
            text: s.to_string(),
        };
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for text in ["cpu", "cuda:0", "cuda:3"] {
            assert_eq!(text.parse::<Device>().unwrap().to_string(), text);
        }
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        let err = "gpu0".parse::<Device>().unwrap_err();
        assert!(err.to_string().contains("`cpu` or `cuda:N`"), "{err}");
    }
}
