//! The facts about a run that every JSON file records beside its numbers: when, which ferry,
//! which commit.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// When and from what a benchmark ran; [`RunInfo::stamp`] records its three fields in a JSON
/// file as `"unix_time"`, `"ferry_version"` and `"commit"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// Seconds since the Unix epoch when the run ended (0 if the clock is before it).
    pub unix_time: u64,
    /// This crate's version.
    pub ferry_version: &'static str,
    /// `git rev-parse HEAD` in the current directory; `None` outside a checkout or without git.
    pub commit: Option<String>,
}

impl RunInfo {
    /// The facts now.
    pub fn now() -> Self {
        Self {
            unix_time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            ferry_version: env!("CARGO_PKG_VERSION"),
            commit: commit(),
        }
    }

    /// `doc` (a JSON object) with the facts now added beside its numbers.
    pub fn stamp(mut doc: Value) -> Value {
        let run = Self::now();
        if let Value::Object(fields) = &mut doc {
            fields.insert("unix_time".into(), json!(run.unix_time));
            fields.insert("ferry_version".into(), json!(run.ferry_version));
            fields.insert("commit".into(), json!(run.commit));
        }
        doc
    }
}

/// The commit checked out in the current directory.
fn commit() -> Option<String> {
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_is_a_hash_or_absent() {
        let info = RunInfo::now();
        assert!(info.unix_time > 1_600_000_000, "{}", info.unix_time);
        assert_eq!(info.ferry_version, env!("CARGO_PKG_VERSION"));
        if let Some(commit) = &info.commit {
            assert_eq!(commit.len(), 40, "{commit}");
            assert!(commit.chars().all(|c| c.is_ascii_hexdigit()), "{commit}");
        }
    }

    #[test]
    fn a_stamp_adds_the_facts_and_keeps_the_numbers() {
        let doc = RunInfo::stamp(json!({ "benchmark": "test", "cases": [1] }));
        assert_eq!(doc["benchmark"], "test");
        assert_eq!(doc["cases"], json!([1]));
        assert_eq!(doc["ferry_version"], env!("CARGO_PKG_VERSION"));
        assert!(doc["unix_time"].as_u64().unwrap() > 1_600_000_000, "{doc}");
        assert!(
            doc["commit"].is_string() || doc["commit"].is_null(),
            "{doc}"
        );
    }
}
