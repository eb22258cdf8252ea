//! The skeleton every bench repeats, kept once: finding the GPU or saying why the bench cannot
//! run, PyTorch's side and the note when it is absent (`pytorch`), samples and their statistics
//! (`measure`), numbers, verdicts and tables (`report`), and the JSON file with the run's facts
//! (`run_info`). A bench module is its cases and its output; it imports from here and nothing
//! here imports a bench.

use std::error::Error;
use std::fmt::Display;
use std::path::{Path, PathBuf};

use clap::Args;
use ferry::memory::MemoryError;
use ferry::memory::cuda::CudaDevice;
use serde_json::Value;

use pytorch::PyTorchArgs;

pub mod goal;
pub mod measure;
pub mod pytorch;
pub mod report;
pub mod run_info;
pub mod table;

/// The opening of the message of a bench that has no GPU and says so briefly.
pub const NO_CUDA_DEVICE: &str = "no CUDA device";

/// The flags of a bench that samples each case on both sides in turn (`#[command(flatten)]`ed
/// into its arguments), so `--json`, `--samples` and `--warmup` mean one thing everywhere.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct SampledArgs {
    #[command(flatten)]
    pub pytorch: PyTorchArgs,
    /// Write every number, all samples included, to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Timed samples per case and side; the table shows their median (claims need 9 or more).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    pub samples: u32,
    /// Untimed rounds per case and side before the samples.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,
}

/// What a bench with one table of cases ran on, besides its cases: the header, the notes under
/// the table and the JSON file all read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSetup {
    /// The device ferry ran on, with its name.
    pub device: String,
    /// Whether ferry ran on a GPU: the targets are the H200's and are judged only there.
    pub on_gpu: bool,
    /// Timed samples (rounds) per case and side.
    pub samples: u32,
    /// Untimed ones before them.
    pub warmup: u32,
    /// PyTorch's version and GPU, when it took part.
    pub pytorch: Option<String>,
    /// Why the PyTorch column is empty or stops part way.
    pub pytorch_note: Option<String>,
}

impl RunSetup {
    /// The line on sampling for a report's title: `medians` (what they are of), then
    /// PyTorch's version and `pytorch_how` when it runs (the note saying why it does not is the
    /// report's to print).
    pub fn sampling_line(&self, medians: &str, pytorch_how: &str) -> String {
        let pytorch = self
            .pytorch
            .as_ref()
            .map_or(String::new(), |p| format!("; PyTorch {p}, {pytorch_how}"));
        format!(
            "{medians} after {} warm-up rounds per case{pytorch}",
            self.warmup
        )
    }
}

/// cuda:`ordinal`: the one place the benches ask for a GPU.
pub fn cuda_device(ordinal: usize) -> Result<CudaDevice, MemoryError> {
    CudaDevice::get(ordinal)
}

/// cuda:`ordinal`, or `None` once `why_not` has been printed: a bench on a machine without the
/// GPU it needs says so and succeeds, so a run over every bench reaches the end.
pub fn cuda_device_or_say(
    ordinal: usize,
    why_not: impl FnOnce(&dyn Display) -> String,
) -> Option<CudaDevice> {
    cuda_device(ordinal)
        .map_err(|err| println!("{}", why_not(&err)))
        .ok()
}

/// What a command without a GPU prints: "no CUDA device: <the driver's error>", then on a line
/// of its own what it does instead (shows the rows that run on the host, or measures nothing).
pub fn without_cuda(err: &dyn Display, instead: &str) -> String {
    format!("{NO_CUDA_DEVICE}: {err}\n{instead}")
}

/// `--cases` (or `--chains`): the entries of `table` whose ids are in `ids`, in table order, all
/// of them for none. An unknown id is an error listing the known ones, so a typo is not a run of
/// nothing.
pub fn select<'a, T>(
    table: &'a [T],
    ids: &[String],
    noun: &str,
    id: impl Fn(&T) -> &str,
) -> Result<Vec<&'a T>, String> {
    if let Some(unknown) = ids.iter().find(|i| !table.iter().any(|e| id(e) == *i)) {
        let known: Vec<&str> = table.iter().map(&id).collect();
        return Err(format!(
            "no {noun} `{unknown}`; the {noun}s are {}",
            known.join(", ")
        ));
    }
    Ok(table
        .iter()
        .filter(|e| ids.is_empty() || ids.iter().any(|i| i == id(e)))
        .collect())
}

/// Says why the bench cannot run here and, with `--json`, leaves `doc` (which records why) in
/// place of its numbers, so a script collecting the files sees the skip.
pub fn skip(why: &str, json: Option<&Path>, doc: &Value) -> Result<(), Box<dyn Error>> {
    println!("{why}");
    match json {
        Some(path) => write_doc(path, doc),
        None => Ok(()),
    }
}

/// Writes `doc` to `--json`'s file and says so, naming what each number is (`sample`, `round`).
pub fn write_json(path: &Path, doc: &Value, every: &str) -> Result<(), Box<dyn Error>> {
    write_doc(path, doc)?;
    println!("wrote every {every} to {}", path.display());
    Ok(())
}

fn write_doc(path: &Path, doc: &Value) -> Result<(), Box<dyn Error>> {
    std::fs::write(path, serde_json::to_string_pretty(doc)? + "\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn sampled_flags_default_to_nine_after_two_and_refuse_zero() {
        use clap::Parser;

        #[derive(Parser)]
        struct Bench {
            #[command(flatten)]
            run: SampledArgs,
        }
        let run = Bench::try_parse_from(["bench"]).unwrap().run;
        assert_eq!((run.samples, run.warmup, run.json), (9, 2, None));
        assert!(!run.pytorch.compare_pytorch);
        let run = Bench::try_parse_from(["bench", "--samples", "3", "--json", "x.json"])
            .unwrap()
            .run;
        assert_eq!((run.samples, run.json), (3, Some(PathBuf::from("x.json"))));
        assert!(Bench::try_parse_from(["bench", "--samples", "0"]).is_err());
    }

    #[test]
    fn the_sampling_line_names_pytorch_only_when_it_ran() {
        let mut setup = RunSetup {
            device: "cuda:0 (test)".into(),
            on_gpu: true,
            samples: 9,
            warmup: 2,
            pytorch: None,
            pytorch_note: Some("no PyTorch column: not importable".into()),
        };
        assert_eq!(
            setup.sampling_line("median of 9 samples", "sampled alternately with ferry"),
            "median of 9 samples after 2 warm-up rounds per case"
        );
        setup.pytorch = Some("2.11.0 (CUDA 13.0) on H200".into());
        assert_eq!(
            setup.sampling_line("median ms/step of 9 rounds", "eager"),
            "median ms/step of 9 rounds after 2 warm-up rounds per case; \
             PyTorch 2.11.0 (CUDA 13.0) on H200, eager"
        );
    }

    #[test]
    fn cases_are_picked_in_table_order_and_typos_are_refused() {
        let table = [("link", 1), ("small", 2), ("large", 3)];
        let ids = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let picked = select(&table, &ids(&["large", "link"]), "case", |e| e.0).unwrap();
        assert_eq!(picked, [&("link", 1), &("large", 3)]);
        assert_eq!(select(&table, &[], "case", |e| e.0).unwrap().len(), 3);
        let err = select(&table, &ids(&["small", "lagre"]), "chain", |e| e.0).unwrap_err();
        assert_eq!(err, "no chain `lagre`; the chains are link, small, large");
    }

    #[test]
    fn the_json_file_is_pretty_with_a_final_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.json");
        let doc = json!({ "bench": "test", "cases": [1, 2] });
        write_json(&path, &doc, "sample").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("}\n"), "{text:?}");
        assert!(text.contains("\n  \"bench\": \"test\""), "{text}");
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, doc);
    }

    #[test]
    fn a_skip_leaves_its_reason_only_where_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("skipped.json");
        let doc = json!({ "bench": "peer", "skipped": "needs two GPUs" });
        skip("needs two GPUs", None, &doc).unwrap();
        assert!(!path.exists());
        skip("needs two GPUs", Some(&path), &doc).unwrap();
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back["skipped"], "needs two GPUs");
        // A file that cannot be written is an error, not a silent skip.
        let missing = dir.path().join("no/such/dir/x.json");
        assert!(skip("why", Some(&missing), &doc).is_err());
    }

    #[test]
    fn without_a_gpu_the_reason_comes_first_then_what_runs_instead() {
        assert_eq!(
            without_cuda(&"no driver", "showing the rows that run on the host"),
            "no CUDA device: no driver\nshowing the rows that run on the host"
        );
    }

    #[test]
    fn without_the_gpu_the_reason_names_the_error() {
        let mut said = None;
        let dev = cuda_device_or_say(4096, |err| {
            said = Some(err.to_string());
            format!("{NO_CUDA_DEVICE}: {err}")
        });
        // No machine has 4097 GPUs: the reason was asked for, with the driver's error.
        assert!(dev.is_none());
        assert!(said.is_some_and(|s| !s.is_empty()));
    }
}
