//! PyTorch's side: a bench script (bench/transfer.py, train.py, autograd.py) in `--serve` mode, a
//! long-lived child that runs one sample per request, so ferry's and PyTorch's samples interleave
//! in one run on one machine.
//!
//! Protocol, one line each way: we send a request line (a case id, for train.py followed by its
//! step count), it answers one JSON object, `{"ms": ..}` or
//! `{"error": ".."}`. Its first line says whether PyTorch and a GPU are there at all. Any
//! failure here becomes a note beside the ferry column, never the end of the benchmark.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::Value;

/// Where bench/transfer.py is; see [`locate_bench_script`].
pub fn locate_script(explicit: Option<&Path>) -> Result<PathBuf, String> {
    locate_bench_script(explicit, "transfer.py")
}

/// Where a bench script is: `--pytorch-script`, else bench/`file_name` under the current
/// directory, else the one in the source tree this binary was built from.
pub fn locate_bench_script(explicit: Option<&Path>, file_name: &str) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return match path.is_file() {
            true => Ok(path.to_path_buf()),
            false => Err(format!("--pytorch-script {} is not a file", path.display())),
        };
    }
    let here = Path::new("bench").join(file_name);
    let source_tree = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench")
        .join(file_name);
    [here, source_tree]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "bench/{file_name} not found here or in the source tree; pass --pytorch-script PATH"
            )
        })
}

/// A running bench script in `--serve` mode.
pub struct PyTorch {
    child: Child,
    /// The script's file name, to label what it prints besides answers.
    name: String,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// `torch.__version__` and the CUDA version it was built with.
    pub version: String,
    /// The GPU it sees.
    pub device: String,
}

impl PyTorch {
    /// Starts the script and waits until it has imported torch and found a GPU.
    pub fn start(python: &str, script: &Path) -> Result<Self, String> {
        let mut child = Command::new(python)
            .arg("-u")
            .arg(script)
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("could not start `{python} {}`: {e}", script.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the PyTorch script's pipes were not set up".into());
        };
        let name = script.file_name().map_or_else(
            || script.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let mut torch = Self {
            child,
            name,
            stdin,
            stdout: BufReader::new(stdout),
            version: String::new(),
            device: String::new(),
        };
        let hello = torch.read_reply()?;
        let text = |key: &str| hello.get(key).and_then(Value::as_str).unwrap_or("?");
        torch.version = format!("{} (CUDA {})", text("torch"), text("cuda"));
        torch.device = text("device").to_string();
        Ok(torch)
    }

    /// One timed sample of `case`, in milliseconds.
    pub fn sample(&mut self, case: &str) -> Result<f64, String> {
        let reply = self.request(case)?;
        reply
            .get("ms")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("the PyTorch script answered {reply} to `{case}`"))
    }

    /// Sends one request line and returns the JSON object that answers it (an `error` reply
    /// becomes `Err`).
    pub fn request(&mut self, line: &str) -> Result<Value, String> {
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("the PyTorch script stopped taking requests: {e}"))?;
        self.read_reply()
    }

    /// Whether the child is still running (a failed sample may have ended it).
    pub fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The next JSON object it prints; stray lines (library warnings) are passed to stderr.
    fn read_reply(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        loop {
            line.clear();
            match self.stdout.read_line(&mut line) {
                Ok(0) => return Err("the PyTorch script exited without answering".into()),
                Ok(_) => {}
                Err(e) => return Err(format!("reading the PyTorch script's output: {e}")),
            }
            match serde_json::from_str::<Value>(line.trim()) {
                Ok(Value::Object(map)) => {
                    if let Some(err) = map.get("error") {
                        return Err(err.as_str().unwrap_or("unknown error").to_string());
                    }
                    return Ok(Value::Object(map));
                }
                _ => eprint!("{}: {line}", self.name),
            }
        }
    }
}

impl Drop for PyTorch {
    fn drop(&mut self) {
        // `quit` ends its request loop; a child still busy after a second is killed.
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let finished = (0..50).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            !self.is_alive()
        });
        if !finished {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for transfer.py (`sh -u script --serve` runs it), speaking the same protocol.
    fn fake_server(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("serve.sh");
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn samples_come_back_and_errors_become_messages() {
        let dir = tempfile::tempdir().unwrap();
        let script = fake_server(
            dir.path(),
            r#"echo 'a library warning'
echo '{"ready": true, "torch": "2.11.0", "cuda": "13.0", "device": "Fake GPU"}'
while read case; do
  case "$case" in
    quit) exit 0 ;;
    broken) echo '{"case": "broken", "error": "CUDA out of memory"}' ;;
    *) echo "{\"case\": \"$case\", \"ms\": 7.25}" ;;
  esac
done
"#,
        );
        let mut torch = PyTorch::start("sh", &script).unwrap();
        assert_eq!(torch.version, "2.11.0 (CUDA 13.0)");
        assert_eq!(torch.device, "Fake GPU");
        assert_eq!(torch.sample("cpu_repeated"), Ok(7.25));
        assert_eq!(
            torch.sample("broken"),
            Err("CUDA out of memory".to_string())
        );
        assert!(torch.is_alive());
        assert_eq!(torch.sample("small_4k"), Ok(7.25));
    }

    #[test]
    fn a_script_that_cannot_start_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let script = fake_server(
            dir.path(),
            "echo '{\"error\": \"PyTorch is not importable\"}'\nexit 1\n",
        );
        let err = PyTorch::start("sh", &script).err().unwrap();
        assert_eq!(err, "PyTorch is not importable");
        let err = PyTorch::start("/nonexistent/python3", &script)
            .err()
            .unwrap();
        assert!(err.contains("could not start"), "{err}");
    }
}
