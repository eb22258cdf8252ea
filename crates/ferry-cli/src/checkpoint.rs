//! `ferry checkpoint verify PATH...`: checks checkpoint files without loading them, as a
//! training job's supervisor would before resuming from one.

use std::error::Error;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use ferry::checkpoint::{self, Verified};

#[derive(Args)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    command: CheckpointCommand,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Check each file's header and every tensor's checksum (one 4 MiB buffer, whatever the
    /// file's size); a damaged file is named with the first damaged tensor, an unreadable one
    /// with the reason, and the command fails.
    Verify {
        /// Checkpoint files (safetensors; ferry's carry a checksum of every tensor).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
}

pub fn run(args: CheckpointArgs) -> Result<(), Box<dyn Error>> {
    let CheckpointCommand::Verify { paths } = args.command;
    let damaged = paths
        .iter()
        .filter(|path| match checkpoint::verify(path) {
            Ok(verified) => {
                println!("ok       {}: {}", path.display(), summary(&verified));
                false
            }
            Err(err) => {
                let label = match err {
                    checkpoint::CheckpointError::Io { .. } => "UNREAD ",
                    _ => "DAMAGED",
                };
                println!("{label}  {}: {err}", path.display());
                true
            }
        })
        .count();
    match damaged {
        0 => Ok(()),
        n => Err(format!(
            "{n} of {} checkpoint files failed verification",
            paths.len()
        )
        .into()),
    }
}

/// One line for a sound file.
fn summary(v: &Verified) -> String {
    let what = if v.checksummed {
        "the header and every tensor match their checksums"
    } else {
        "structure sound; no checksum record (not written by ferry), so the bytes are unchecked"
    };
    format!(
        "{} tensors, {:.1} MiB; {what}",
        v.tensors,
        v.bytes as f64 / f64::from(1u32 << 20)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::Tensor;

    fn args(paths: &[&std::path::Path]) -> CheckpointArgs {
        CheckpointArgs {
            command: CheckpointCommand::Verify {
                paths: paths.iter().map(|p| p.to_path_buf()).collect(),
            },
        }
    }

    #[test]
    fn a_damaged_file_fails_the_command_and_sound_ones_pass() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = (
            dir.path().join("a.safetensors"),
            dir.path().join("b.safetensors"),
        );
        let state = vec![(
            "w".to_string(),
            Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap(),
        )];
        checkpoint::save(&good, &state).unwrap();
        checkpoint::save(&bad, &state).unwrap();
        assert!(run(args(&[&good])).is_ok());
        let mut bytes = std::fs::read(&bad).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(&bad, bytes).unwrap();
        let err = run(args(&[&good, &bad])).unwrap_err().to_string();
        assert_eq!(err, "1 of 2 checkpoint files failed verification");
        let missing = dir.path().join("missing.safetensors");
        assert!(run(args(&[&missing])).is_err());
    }
}
