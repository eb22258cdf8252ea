//! PyTorch's side, the one way every benchmark starts and talks to it: a script of
//! crates/ferry-bench/python (transfer.py, train.py, ...) found by [`locate_script`], run by the
//! interpreter of [`PyTorchArgs`].
//!
//! Most benchmarks keep it as a long-lived child in `--serve` mode ([`PyTorch`]) that runs one
//! sample per request, so ferry's and PyTorch's samples interleave in one run on one machine.
//! Protocol, one line each way (python/harness.py speaks the other end): we send a request line
//! (a case id, for train.py followed by its step count), it answers one JSON object, `{"ms": ..}`
//! or `{"error": ".."}`. Its first line says whether PyTorch and a GPU are there at all. A script
//! that must own the process (ddp.py starts one process per GPU) runs once instead
//! ([`run_once`]) and prints its result as its last JSON line. Any failure here becomes a note
//! beside the ferry column, never the end of the benchmark.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use clap::Args;
use serde_json::Value;

use super::measure::Measured;

/// Where the scripts live, relative to the repository root.
pub const SCRIPT_DIR: &str = "crates/ferry-bench/python";

/// The flags every benchmark with a PyTorch column takes (`#[command(flatten)]`ed into its
/// arguments).
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct PyTorchArgs {
    /// Also run PyTorch's side (the benchmark's script in crates/ferry-bench/python), side by
    /// side with ferry's in the same run.
    #[arg(long)]
    pub compare_pytorch: bool,
    /// The Python interpreter for --compare-pytorch.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The PyTorch script [default: python/<benchmark>.py here, else in the
    /// source tree].
    #[arg(long, value_name = "PATH")]
    pub pytorch_script: Option<PathBuf>,
}

impl Default for PyTorchArgs {
    fn default() -> Self {
        Self {
            compare_pytorch: false,
            python: "python3".into(),
            pytorch_script: None,
        }
    }
}

impl PyTorchArgs {
    /// Starts `--pytorch-script` or the script `name` in `--serve` mode.
    pub fn start(&self, name: &str) -> Result<PyTorch, String> {
        PyTorch::start(
            &self.python,
            &locate_script(self.pytorch_script.as_deref(), name)?,
        )
    }
}

impl PyTorchArgs {
    /// PyTorch's side of a bench: the script `name`, started when --compare-pytorch asks for it.
    /// A start that fails is a note, "no PyTorch `absent`: why" (`absent` names what stays empty:
    /// "column", "rows"), and the bench runs ferry's side alone.
    pub fn side(&self, name: &str, absent: &str) -> PyTorchSide {
        self.side_with(name, absent, |_| Ok(()))
    }

    /// [`PyTorchArgs::side`] for a script that must first agree with ferry's side (`setup`);
    /// a disagreement is noted as a failed start is.
    pub fn side_with(
        &self,
        name: &str,
        absent: &str,
        setup: impl FnOnce(&mut PyTorch) -> Result<(), String>,
    ) -> PyTorchSide {
        if !self.compare_pytorch {
            return PyTorchSide::default();
        }
        let started = self
            .start(name)
            .and_then(|mut torch| setup(&mut torch).map(|()| torch));
        match started {
            Ok(torch) => PyTorchSide {
                label: Some(torch.label()),
                torch: Some(torch),
                note: None,
            },
            Err(err) => PyTorchSide::absent(format!("no PyTorch {absent}: {err}")),
        }
    }
}

/// PyTorch's side of one run: the script while it answers, its label for the header and the
/// JSON file, and why its column is empty or stops part way.
#[derive(Default)]
pub struct PyTorchSide {
    /// The running script; `None` when not asked for, not started, or ended by a failure.
    pub torch: Option<PyTorch>,
    /// [`PyTorch::label`] of the script that started, kept after it ends.
    pub label: Option<String>,
    /// Why the side is missing or incomplete.
    pub note: Option<String>,
}

impl PyTorchSide {
    /// No script, for this reason.
    pub fn absent(note: impl Into<String>) -> Self {
        Self {
            note: Some(note.into()),
            ..Self::default()
        }
    }

    /// The script, while it runs.
    pub fn torch(&mut self) -> Option<&mut PyTorch> {
        self.torch.as_mut()
    }

    /// After a failed request: when the failure ended the script, drops it (later cases run
    /// ferry's side alone) and returns true.
    pub fn forget_if_ended(&mut self) -> bool {
        let ended = self.torch.as_mut().is_some_and(|torch| !torch.is_alive());
        if ended {
            self.torch = None;
        }
        ended
    }

    /// After `case`, whose PyTorch side is `pytorch`: when its failure ended the script, the
    /// note that says where the column stops.
    pub fn ended_during(&mut self, case: &str, pytorch: &Measured) -> Option<String> {
        let err = pytorch.error.as_ref()?;
        self.forget_if_ended()
            .then(|| format!("the PyTorch script ended during {case}: {err}"))
    }
}

/// Where a bench script is: `explicit` (`--pytorch-script`), else python/`name`
/// under the current directory (the GPU machine runs the binary from the repository root of a
/// copy of the tree), else under `$CARGO_MANIFEST_DIR` when set at run time (tests), else the one
/// in the source tree this binary was built from.
pub fn locate_script(explicit: Option<&Path>, name: &str) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return match path.is_file() {
            true => Ok(path.to_path_buf()),
            false => Err(format!("--pytorch-script {} is not a file", path.display())),
        };
    }
    let here = Path::new(SCRIPT_DIR).join(name);
    // Test runners (cargo, the GPU machine's) run from the crate's folder and say where it is.
    let crate_dir =
        std::env::var_os("CARGO_MANIFEST_DIR").map(|dir| Path::new(&dir).join("python").join(name));
    let source_tree = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name);
    [Some(here), crate_dir, Some(source_tree)]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "{SCRIPT_DIR}/{name} not found here or in the source tree; \
                 pass --pytorch-script PATH"
            )
        })
}

/// `python -u script args...`: unbuffered, so each answer arrives when printed.
fn command(python: &str, script: &Path, args: &[impl AsRef<OsStr>]) -> Command {
    let mut command = Command::new(python);
    command.arg("-u").arg(script).args(args);
    command
}

fn start_error(python: &str, script: &Path, err: std::io::Error) -> String {
    format!("could not start `{python} {}`: {err}", script.display())
}

/// Runs `script` once with `args` (and `env` added, unless already set in ours), its stderr
/// passed through, and returns the last JSON object it printed (an `error` object becomes
/// `Err`).
pub fn run_once(
    python: &str,
    script: &Path,
    args: &[String],
    env: &[(&str, &str)],
) -> Result<Value, String> {
    let mut command = command(python, script, args);
    command.stdin(Stdio::null()).stderr(Stdio::inherit());
    for (key, value) in env {
        if std::env::var_os(key).is_none() {
            command.env(key, value);
        }
    }
    let output = command
        .output()
        .map_err(|e| start_error(python, script, e))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let doc = stdout
        .lines()
        .rev()
        .find_map(|line| match serde_json::from_str::<Value>(line.trim()) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => None,
        })
        .ok_or_else(|| {
            format!(
                "the PyTorch script printed no JSON line (exit status {})",
                output.status
            )
        })?;
    match doc.get("error") {
        Some(err) => Err(err.as_str().unwrap_or("unknown error").to_string()),
        None => Ok(doc),
    }
}

/// Writes a stand-in for a bench script (`sh -u script --serve` runs it) speaking the protocol
/// with `body`, for the benches' tests.
#[cfg(test)]
pub(crate) fn fake_script(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("serve.sh");
    std::fs::write(&path, body).unwrap();
    path
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
        let mut child = command(python, script, &["--serve"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| start_error(python, script, e))?;
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

    /// "VERSION (CUDA X) on DEVICE", for a header.
    pub fn label(&self) -> String {
        format!("{} on {}", self.version, self.device)
    }

    /// One timed sample of `case`, in milliseconds.
    pub fn sample(&mut self, case: &str) -> Result<f64, String> {
        self.sample_with_reply(case).map(|(ms, _)| ms)
    }

    /// [`PyTorch::sample`] with the whole reply, for the figures a script sends beside the time.
    pub fn sample_with_reply(&mut self, case: &str) -> Result<(f64, Value), String> {
        let reply = self.request(case)?;
        match reply.get("ms").and_then(Value::as_f64) {
            Some(ms) => Ok((ms, reply)),
            None => Err(format!("the PyTorch script answered {reply} to `{case}`")),
        }
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

    /// The real scripts speak the protocol through harness.py: a hello line, or why not.
    #[test]
    fn the_python_scripts_say_hello_or_why_not() {
        for name in ["autograd.py", "train.py"] {
            let script = locate_script(None, name).unwrap();
            match PyTorch::start("python3", &script) {
                Ok(torch) => assert!(!torch.version.is_empty() && !torch.device.is_empty()),
                Err(err) if err.contains("could not start") => return, // no python3 here
                Err(err) => assert!(err.starts_with("PyTorch "), "{name}: {err}"),
            }
        }
    }

    #[test]
    fn scripts_are_found_by_name_or_by_flag() {
        let found = locate_script(None, "train.py").unwrap();
        assert!(found.ends_with("python/train.py"), "{}", found.display());
        assert_eq!(locate_script(Some(&found), "ignored.py").unwrap(), found);
        let err = locate_script(None, "nothing.py").unwrap_err();
        assert!(
            err.contains("crates/ferry-bench/python/nothing.py not found"),
            "{err}"
        );
        assert!(err.contains("--pytorch-script PATH"), "{err}");
        let err = locate_script(Some(Path::new("/nonexistent/x.py")), "train.py").unwrap_err();
        assert_eq!(err, "--pytorch-script /nonexistent/x.py is not a file");
        // Every script the benches start is there, with the harness they import.
        for name in [
            "transfer.py",
            "train.py",
            "autograd.py",
            "pipeline.py",
            "checkpoint.py",
            "offload.py",
            "peer.py",
            "ddp.py",
            "harness.py",
        ] {
            assert!(locate_script(None, name).is_ok(), "{name}");
        }
    }

    #[test]
    fn samples_come_back_and_errors_become_messages() {
        let dir = tempfile::tempdir().unwrap();
        let script = fake_script(
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
        assert_eq!(torch.label(), "2.11.0 (CUDA 13.0) on Fake GPU");
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
        let script = fake_script(
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

    #[test]
    fn a_side_starts_only_when_asked_and_a_failed_start_is_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let hello = r#"echo '{"ready": true, "torch": "2.11.0", "cuda": "13.0", "device": "Fake GPU"}'
while read case; do
  case "$case" in
    quit) exit 0 ;;
    die) echo '{"error": "killed"}'; exit 1 ;;
    *) echo '{"ms": 1.5}' ;;
  esac
done
"#;
        let script = fake_script(dir.path(), hello);
        let args = |compare_pytorch| PyTorchArgs {
            compare_pytorch,
            python: "sh".into(),
            pytorch_script: Some(script.clone()),
        };
        let mut off = args(false).side("transfer.py", "column");
        assert!(off.torch().is_none() && off.label.is_none() && off.note.is_none());

        let mut on = args(true).side("transfer.py", "column");
        assert_eq!(on.label.as_deref(), Some("2.11.0 (CUDA 13.0) on Fake GPU"));
        assert_eq!(on.note, None);
        assert_eq!(on.torch().unwrap().sample("small_4k"), Ok(1.5));
        assert!(!on.forget_if_ended());
        // A failure that leaves the script running says nothing.
        assert_eq!(on.ended_during("small_4k", &Measured::failed("slow")), None);
        assert!(on.torch().is_some());
        let mut failed = Measured::new();
        failed.fail(on.torch().unwrap().sample("die").unwrap_err());
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(on.ended_during("large", &Measured::new()), None);
        assert_eq!(
            on.ended_during("large", &failed).as_deref(),
            Some("the PyTorch script ended during large: killed")
        );
        assert!(on.torch().is_none());
        // The label stays for the header and the JSON file.
        assert!(on.label.is_some());

        let refused = args(true).side_with("checkpoint.py", "rows", |_| {
            Err("the two sides disagree".into())
        });
        assert!(refused.torch.is_none() && refused.label.is_none());
        assert_eq!(
            refused.note.as_deref(),
            Some("no PyTorch rows: the two sides disagree")
        );

        let missing = PyTorchArgs {
            compare_pytorch: true,
            python: "sh".into(),
            pytorch_script: Some(dir.path().join("absent.py")),
        };
        let note = missing.side("peer.py", "columns").note.unwrap();
        assert!(
            note.starts_with("no PyTorch columns: --pytorch-script"),
            "{note}"
        );
    }
}
