//! `ferry bench autograd`'s CPU tests: its arguments, both sides' rounds, the tables and the
//! JSON file.

use std::path::Path;

use clap::Parser;

use super::chains::CHAINS;
use super::*;
use crate::harness::pytorch::PyTorch;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: AutogradArgs,
}

fn parse(args: &[&str]) -> Result<AutogradArgs, clap::Error> {
    Cli::try_parse_from(std::iter::once("autograd").chain(args.iter().copied())).map(|c| c.args)
}

#[test]
fn arguments_default_to_everything_and_lists_parse() {
    let args = parse(&[]).unwrap();
    assert!(!args.pytorch.compare_pytorch && args.json.is_none());
    let all = [Section::Memory, Section::Threads, Section::Overhead];
    assert_eq!(args.sections, all);
    assert_eq!(args.thread_counts(), [1, 2, 4, 8, 16]);
    assert_eq!((args.rounds, args.warmup), (9, 2));
    assert_eq!(args.pytorch.python, "python3");

    let line = "--compare-pytorch --json out.json --sections threads,overhead --threads 8,2,8 \
                --chains views,tanh --rounds 3";
    let args = parse(&line.split_whitespace().collect::<Vec<_>>()).unwrap();
    assert!(args.pytorch.compare_pytorch);
    assert_eq!(args.json.as_deref(), Some(Path::new("out.json")));
    assert_eq!(args.sections, [Section::Threads, Section::Overhead]);
    // 1 is always run: efficiency is measured against it.
    assert_eq!(args.thread_counts(), [1, 2, 8]);
    assert_eq!(args.chains, ["views", "tanh"]);
    assert_eq!(args.rounds, 3);

    for bad in ["--rounds 0", "--threads 0", "--sections gpu", "--warmup -1"] {
        let bad: Vec<&str> = bad.split(' ').collect();
        assert!(parse(&bad).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn rounds_keep_timed_samples_and_end_at_the_first_failure() {
    let mut rounds = Measured::new();
    assert!(rounds.record(Ok::<_, String>(5.0), false));
    rounds.record(Ok::<_, String>(1.0), true);
    rounds.record(Ok::<_, String>(2.0), true);
    assert_eq!(rounds.samples_ms, [1.0, 2.0]);
    assert!(!rounds.record(Err("boom"), true));
    assert!(!rounds.record(Ok::<_, String>(3.0), true));
    assert_eq!(rounds.samples_ms, [1.0, 2.0]);
    assert_eq!(rounds.error.as_deref(), Some("boom"));
    assert_eq!(rounds.complete_median(), None);
}

#[test]
fn ferry_threads_run_every_round_together() {
    let mut turns = Vec::new();
    let samples = ferry_scaling(3, 20, 1, 2, |round| turns.push(round)).unwrap();
    assert_eq!(turns, [0, 1, 2], "PyTorch's turn comes after every round");
    assert_eq!(samples.len(), 2);
    assert!(samples.iter().all(|s| s.is_finite() && *s > 0.0));
    let model = SmallModel::new().unwrap();
    let us = model.round_us_per_op(50).unwrap();
    assert!(us > 0.0 && us.is_finite());
    // Gradients accumulated over every step: 50 steps of d/dx (relu(x*y + x)).
    assert_eq!(model.x.grad().unwrap().shape(), [SMALL, SMALL]);
}

/// A stand-in for autograd.py (`sh -u script --serve` runs it), speaking its protocol;
/// `threads 4` fails.
fn fake_server(dir: &Path) -> PathBuf {
    crate::harness::pytorch::fake_script(
        dir,
        r#"echo '{"ready": true, "torch": "2.11.0", "cuda": "13.0", "device": "Fake GPU"}'
while read kind a b; do
  case "$kind" in
quit) exit 0 ;;
memory) echo '{"case": "'$a'", "retained_bytes": 800, "backward_peak_bytes": 1600, "after_drop_bytes": 0}' ;;
overhead) if [ "$a" = 0 ]; then echo '{"ms": 0.02, "threads": 16}'; else echo '{"ms": 0.01, "threads": 1}'; fi ;;
threads) if [ "$a" = 4 ]; then echo '{"error": "RuntimeError: boom"}'; else echo "{\"steps_per_s\": $((a * 1000))}"; fi ;;
  esac
done
"#,
    )
}

#[test]
fn pytorch_rounds_interleave_and_each_side_keeps_its_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut torch = PyTorchSide {
        torch: Some(PyTorch::start("sh", &fake_server(dir.path())).unwrap()),
        ..PyTorchSide::default()
    };
    let row = measure_overhead(&mut torch, 1, 3);
    assert_eq!(row.ferry.samples_ms.len(), 3);
    // 0.01 ms a step of four ops: 2.5 µs an op.
    assert_eq!(row.pytorch[0].samples_ms, [2.5; 3]);
    assert_eq!(row.pytorch[1].samples_ms, [5.0; 3]);
    assert_eq!(row.default_threads, Some(16));

    let row = measure_scaling(2, &mut torch, 0, 2);
    assert_eq!(row.pytorch.samples_ms, [2000.0; 2]);
    assert_eq!(row.ferry.samples_ms.len(), 2);
    let row = measure_scaling(4, &mut torch, 0, 2);
    assert_eq!(row.pytorch.error.as_deref(), Some("RuntimeError: boom"));
    assert!(row.pytorch.samples_ms.is_empty());
    assert_eq!(row.ferry.samples_ms.len(), 2);

    // ferry's side needs a CUDA device (the CPU has no allocator statistics); PyTorch's
    // answer is read whatever ferry's did.
    let row = measure_memory(&CHAINS[0], Device::Cpu, &mut torch);
    assert!(matches!(row.ferry, Some(Err(_))));
    let bytes = row.pytorch.unwrap().unwrap();
    assert_eq!((bytes.retained, bytes.backward_peak), (800, 1600));
    assert!(torch.note.is_none() && torch.torch.as_mut().unwrap().is_alive());

    let absent = measure_overhead(&mut PyTorchSide::default(), 0, 1).pytorch;
    assert!(absent[0].samples_ms.is_empty() && !absent[0].is_failed());
}

// The tables and the JSON file, from a made-up run.

const MIB: i64 = 1 << 20;

fn bytes(retained: i64, backward_peak: i64, saved: Option<usize>) -> Bytes {
    Some(Ok(ChainBytes {
        retained,
        backward_peak,
        after_drop: 0,
        saved,
    }))
}

fn scaling(threads: usize, ferry: &[f64], pytorch: Measured) -> ScalingRow {
    let ferry = Measured::from_samples(ferry.to_vec());
    ScalingRow {
        threads,
        ferry,
        pytorch,
    }
}

/// A made-up H200 run: every section, both sides, one failure of each kind.
fn made_up() -> Run {
    let memory = vec![
        MemoryRow {
            chain: &CHAINS[0],
            ferry: bytes(800 * MIB, 2000 * MIB, Some(400 << 20)),
            pytorch: bytes(800 * MIB, 1600 * MIB, None),
        },
        MemoryRow {
            chain: &CHAINS[2],
            ferry: bytes(1300 * MIB, 3200 * MIB, Some(800 << 20)),
            pytorch: bytes(1200 * MIB, 2000 * MIB, None),
        },
        MemoryRow {
            chain: &CHAINS[4],
            ferry: Some(Err("out of memory".into())),
            pytorch: bytes(800 * MIB, 1600 * MIB, None),
        },
    ];
    let torch = |samples: &[f64]| Measured::from_samples(samples.to_vec());
    Run {
        cuda: Ok("cuda:0 (test)".into()),
        memory_asked: true,
        cores: 16,
        rounds: 3,
        warmup: 1,
        pytorch: Some("2.11.0 (CUDA 13.0) on Fake GPU".into()),
        pytorch_note: None,
        memory,
        scaling: vec![
            scaling(1, &[1e4, 1.1e4, 0.9e4], torch(&[5e3; 3])),
            scaling(4, &[3e4; 3], Measured::failed("RuntimeError: boom")),
            scaling(8, &[5e4; 3], torch(&[5e3; 3])),
            scaling(16, &[6e4; 3], Measured::new()),
        ],
        overhead: Some(OverheadRow {
            ferry: torch(&[2.5, 2.0, 3.5]),
            pytorch: [torch(&[20.0, 22.5, 25.0]), Measured::failed("killed")],
            default_threads: Some(16),
        }),
    }
}

#[test]
fn efficiency_is_throughput_over_n_times_one_thread() {
    assert_eq!(efficiency(30_000.0, 4, 10_000.0), 0.75);
    assert_eq!(efficiency(10_000.0, 1, 10_000.0), 1.0);
    // Sixteen threads doing one thread's work: 1/16.
    assert_eq!(efficiency(10_000.0, 16, 10_000.0), 0.0625);
    let rows = made_up().scaling;
    let eff = efficiencies(&rows, |r| &r.ferry);
    assert_eq!(eff, [Some(1.0), Some(0.75), Some(0.625), Some(0.375)]);
    // PyTorch failed at 4 threads and was not asked at 16.
    let eff = efficiencies(&rows, |r| &r.pytorch);
    assert_eq!(eff, [Some(1.0), None, Some(0.125), None]);
    // Without a one-thread row nothing can be said.
    let eff = efficiencies(&rows[1..], |r| &r.ferry);
    assert!(eff.iter().all(Option::is_none));
}

#[test]
fn scaling_is_judged_from_two_to_eight_threads_on_enough_cores() {
    assert_eq!(scaling_verdict(1, Some(1.0), 16), Verdict::NoTarget);
    assert_eq!(scaling_verdict(2, Some(0.75), 16), Verdict::Met);
    assert_eq!(scaling_verdict(8, Some(0.74), 16), Verdict::Missed);
    assert_eq!(scaling_verdict(8, None, 16), Verdict::Unknown);
    assert_eq!(scaling_verdict(16, Some(0.1), 16), Verdict::NoTarget);
    // A 2-core machine cannot show 4 threads scaling.
    assert_eq!(scaling_verdict(4, Some(0.3), 2), Verdict::NoTarget);
    assert_eq!(scaling_goal(4, 2), "not judged: 2 cores");
    assert_eq!(scaling_goal(4, 16), ">= 0.75");
}

#[test]
fn tables_show_mib_ratios_goals_and_verdicts() {
    let run = made_up();
    let memory = memory_table(&run.memory).texts();
    let row = ["elementwise", "800", "400", "800", "1.00", "800", "<= PyTorch", "met"];
    assert_eq!(memory[0], row);
    assert_eq!(memory[1][..5], ["tanh", "1300", "800", "1200", "1.08"]);
    assert_eq!(memory[1][7], "MISSED");
    let row = ["softmax", "error", "error", "800", "-", "800", "<= PyTorch", "?"];
    assert_eq!(memory[2], row);
    let backward = backward_table(&run.memory).texts();
    assert_eq!(backward[0], ["elementwise", "2000", "1600", "1.25"]);
    assert_eq!(backward[2], ["softmax", "error", "1600", "-"]);

    let threads = scaling_table(&run.scaling, run.cores).texts();
    let row = ["1", "10000", "1.00", "5000", "1.00", "reference", ""];
    assert_eq!(threads[0], row);
    let row = ["4", "30000", "0.75", "error", "-", ">= 0.75", "met"];
    assert_eq!(threads[1], row);
    let row = ["50000", "0.62", "5000", "0.12", ">= 0.75", "MISSED"];
    assert_eq!(threads[2][1..], row);
    assert_eq!(threads[3][3..], ["-", "-", "-", ""]);

    let overhead = overhead_table(run.overhead.as_ref().unwrap()).texts();
    let row = ["mul_add_relu_sum", "2.50", "22.5", "error", "0.111", "<= 3 µs", "met"];
    assert_eq!(overhead[0], row);
}

#[test]
fn json_has_every_row_with_both_sides_goals_and_verdicts() {
    let doc = report(&made_up()).json();
    assert_eq!(doc["bench"], "autograd");
    assert_eq!(doc["cuda_device"], "cuda:0 (test)");
    assert_eq!(doc["cpu_cores"], 16);
    let memory = doc["memory"].as_array().unwrap();
    assert_eq!(memory.len(), 3);
    let elementwise = &memory[0];
    assert_eq!(elementwise["unit"], "bytes");
    assert_eq!(elementwise["ferry"], 800 * MIB);
    assert_eq!(elementwise["saved"], 400 * MIB);
    assert_eq!(elementwise["ferry_after_drop"], 0);
    assert_eq!(elementwise["expected"], 2 * SIDE * SIDE * 4);
    assert_eq!(elementwise["met"], true);
    assert_eq!(doc["backward_peak"][0]["ratio"], 1.25);
    assert_eq!(doc["backward_peak"][0]["pytorch"], 1600 * MIB);
    assert_eq!(memory[1]["met"], false);
    assert_eq!(memory[2]["ferry"]["error"], "out of memory");
    assert_eq!(memory[2]["met"], Value::Null);

    let four = &doc["thread_scaling"][1];
    assert_eq!(four["threads"], 4);
    assert_eq!(four["ferry_efficiency"], 0.75);
    assert_eq!(four["ferry_steps_per_s"]["rounds"], json!([3e4, 3e4, 3e4]));
    assert_eq!(four["pytorch_steps_per_s"]["error"], "RuntimeError: boom");
    assert_eq!(four["met"], true);
    let sixteen = &doc["thread_scaling"][3];
    assert_eq!(sixteen["pytorch_steps_per_s"]["median"], Value::Null);
    assert_eq!((&sixteen["goal"], &sixteen["met"]), (&json!("-"), &Value::Null));

    let overhead = &doc["op_overhead"][0];
    assert_eq!(overhead["unit"], "us/op");
    assert_eq!(overhead["ferry"]["median"], 2.5);
    assert_eq!(overhead["pytorch_1_thread"]["median"], 22.5);
    assert_eq!(overhead["pytorch_default"]["error"], "killed");
    assert_eq!(overhead["pytorch_default_threads"], 16);
    assert_eq!(overhead["met"], true);
    let notes = doc["notes"].as_array().unwrap();
    assert!(notes.contains(&json!("error: softmax (ferry): out of memory")));
    assert!(notes.contains(&json!("error: PyTorch overhead: killed")));
}
