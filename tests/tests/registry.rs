//! The op registry (`ferry_tests::registry`) walked: every case records exactly the ops it
//! declares, passes gradcheck (and gradgradcheck where its backward records ops of its own) and
//! keeps alive exactly what it declares, on both devices. Every op name the library can record
//! (read from its sources) is registered, the registry's JSON copy for the parity script is up
//! to date, and the script mirrors exactly the registry's parity cases.

use std::collections::BTreeSet;

use ferry_graph::NodeHandle;
use ferry_tensor::autograd::{GradOptions, grad};
use ferry_tensor::gradcheck::{GradcheckOptions, gradgradcheck};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::registry::{self, Case, Grad, NEVER_RECORDED};
use ferry_tests::{check_grad_with, device_test, seed};

use crate::saved_state::cases::{Forward, check_forward};

mod scan;

/// The cases that run on `device`.
fn cases_on(device: Device) -> Vec<Case> {
    registry::cases()
        .into_iter()
        .filter(|c| device.is_cuda() || !c.cuda_only)
        .collect()
}

/// Op names of every node reachable from `t`'s node, leaves left out.
fn recorded(t: &Tensor, names: &mut BTreeSet<&'static str>) {
    let mut stack: Vec<NodeHandle<Tensor>> = t.node().cloned().into_iter().collect();
    let mut seen: Vec<NodeHandle<Tensor>> = Vec::new();
    while let Some(node) = stack.pop() {
        if seen.iter().any(|s| s.same_node(&node)) {
            continue;
        }
        if !node.is_leaf() {
            names.insert(node.meta().op);
        }
        stack.extend(node.inputs().flatten().cloned());
        seen.push(node);
    }
}

#[test]
fn every_op_the_code_records_is_registered() {
    let files = scan::sources();
    assert!(files.len() > 50, "read only {} source files", files.len());
    let in_code = scan::names_in(&files);
    let registered: BTreeSet<String> = registry::recorded_names()
        .into_iter()
        .chain(NEVER_RECORDED.iter().map(|&(n, _)| n))
        .map(str::to_string)
        .collect();
    let missing: Vec<&String> = in_code.difference(&registered).collect();
    assert!(
        missing.is_empty(),
        "ops the code records that no case of tests/src/registry records (add a case, or a \
         NEVER_RECORDED entry saying why it never reaches a graph): {missing:?}"
    );
    let stale: Vec<&String> = registered.difference(&in_code).collect();
    assert!(
        stale.is_empty(),
        "registered op names that no record call in the code uses: {stale:?}"
    );
}

/// The scan reads every form of naming an op and reports forms it cannot read.
#[test]
fn the_scan_reads_each_way_of_naming_an_op() {
    let file = |text: &str| {
        (
            std::path::PathBuf::from("crates/x/src/a.rs"),
            scan::code(text),
        )
    };
    let table = "pub enum UnaryOp {\n        Neg => \"neg\", 0, |v| -v, \"-v\";\n        Exp => \"exp\", 1, |v| v.exp(), \"e(v)\";\n    }\n";
    let ops = "use crate::autograd::{record, record_kind};\n\
        fn a(&self) { record(out, \"lit\", &[self], || r()) }\n\
        fn b(&self) { const OP: &str = \"konst\"; record(out, OP, &[self], r) }\n\
        fn c(&self, log: bool) { let op = if log { \"one\" } else { \"two\" }; record(out, op, &[], r) }\n\
        fn d(&self, op: UnaryOp) { record(out, op.name(), &[self], || r(op)) }\n\
        pub fn wrap(x: T, op: &'static str) { record_kind(x, op, k, &[], r) }\n\
        fn e() { wrap(x, \"wrapped\") }\n\
        // record(out, \"commented\", &[], r)\n";
    let importer = "use crate::a::wrap;\nfn f() { wrap(y, \"imported\") }\n";
    let found = scan::names_in(&[
        file(&format!("{table}{ops}")),
        (
            std::path::PathBuf::from("crates/x/src/b.rs"),
            scan::code(importer),
        ),
    ]);
    let want = [
        "exp", "imported", "konst", "lit", "neg", "one", "two", "wrapped",
    ];
    assert_eq!(found.iter().map(String::as_str).collect::<Vec<_>>(), want);

    let odd = scan::scan(&[file(
        "use crate::autograd::record;\nfn g(&self) { record(out, names[0], &[self], r) }\n",
    )]);
    assert_eq!(odd.unresolved.len(), 1, "{odd:?}");
    let by_path = "fn q() { ferry::tensor::record(o, \"path\", &[], r) }\n";
    let qualified = scan::names_in(&[file(by_path)]);
    assert_eq!(qualified.into_iter().collect::<Vec<_>>(), ["path"]);
    let other = scan::scan(&[file(
        "fn record(a: u8, b: u8) {}\nfn h() { record(1, 2) }\n",
    )]);
    assert!(
        other.names.is_empty() && other.unresolved.is_empty(),
        "a crate's own fn record: {other:?}"
    );
}

#[test]
fn case_names_are_unique_and_every_case_is_complete() {
    let cases = registry::cases();
    let mut names = BTreeSet::new();
    for case in &cases {
        assert!(names.insert(case.name), "{} registered twice", case.name);
        assert!(!case.inputs.is_empty(), "{}: no inputs", case.name);
        assert_eq!(
            case.records.is_empty(),
            case.keeps.is_none(),
            "{}: a case that records declares what it keeps",
            case.name
        );
    }
    assert!(cases.iter().filter(|c| c.parity).count() >= 55);
}

/// The path of tests/torch/registry.json, rewritten first under `FERRY_WRITE_REGISTRY=1` (by
/// renaming a complete file into place: the tests that read it run in parallel).
fn registry_file() -> std::path::PathBuf {
    let path = ferry_tests::repo_root().join(registry::JSON_PATH);
    if std::env::var_os("FERRY_WRITE_REGISTRY").is_some_and(|v| v == "1") {
        let dir = path.parent().unwrap();
        let tmp = tempfile::NamedTempFile::new_in(dir).unwrap();
        std::fs::write(tmp.path(), registry::to_json()).unwrap();
        tmp.persist(&path).unwrap();
    }
    path
}

/// tests/torch/registry.json is the registry's JSON; `FERRY_WRITE_REGISTRY=1` rewrites it.
#[test]
fn the_registry_file_is_up_to_date() {
    let path = registry_file();
    let want = registry::to_json();
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not the registry's JSON; rewrite it with `FERRY_WRITE_REGISTRY=1 cargo test -p \
         ferry-tests --test suite registry`",
        path.display()
    );
}

/// parity.py mirrors exactly the registry's parity cases (its name check needs no torch).
#[test]
fn the_parity_script_mirrors_the_registry() {
    registry_file();
    let root = ferry_tests::repo_root();
    let run = std::process::Command::new("python3")
        .arg(root.join("tests/torch/parity.py"))
        .arg("--check-names")
        .output();
    let Ok(out) = run else {
        eprintln!("skipped: python3 not found");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "parity.py --check-names failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parity = registry::cases().iter().filter(|c| c.parity).count();
    assert!(text.contains(&format!("{parity} parity cases")), "{text}");
}

/// Each case's forward records exactly its ops; a backward under `create_graph` records its
/// `backward_records`; no graph holds an op named never to be recorded.
fn records(device: Device) -> Result<()> {
    for case in cases_on(device) {
        let inputs = case.make_inputs(device, DType::F32, true)?;
        let out = (case.call)(&inputs)?;
        let mut forward = BTreeSet::new();
        recorded(&out, &mut forward);
        let want: BTreeSet<&str> = case.records_on(device).iter().copied().collect();
        assert_eq!(forward, want, "{} on {device}: recorded ops", case.name);
        let mut all = forward;
        if out.requires_grad() {
            let floats: Vec<&Tensor> = inputs.iter().filter(|t| t.requires_grad()).collect();
            // On the output's device: a move's output is on the host whatever `device` is.
            let seed_grad = Tensor::rand(out.shape(), out.dtype(), out.device())?.with_grad()?;
            let options = GradOptions {
                grad_outputs: Some(vec![seed_grad]),
                create_graph: true,
                allow_unused: true,
                ..GradOptions::default()
            };
            let mut backward = BTreeSet::new();
            for g in grad(&[&out], &floats, options)?.iter().flatten() {
                recorded(g, &mut backward);
            }
            for op in case.backward_records {
                assert!(
                    backward.contains(op),
                    "{} on {device}: the backward recorded {backward:?}, not {op}",
                    case.name
                );
            }
            all.extend(backward);
        }
        for (op, why) in NEVER_RECORDED {
            assert!(
                !all.contains(op),
                "{} on {device} recorded {op} ({why})",
                case.name
            );
        }
    }
    Ok(())
}
device_test!(every_registered_case_records_what_it_declares, records);

/// Runs `case` on its float inputs alone (indices stay fixed).
fn on_floats(case: &Case, fixed: &[Tensor], floats: &[Tensor]) -> Result<Tensor> {
    let (mut f, mut i) = (floats.iter(), fixed.iter());
    let all: Vec<Tensor> = case
        .inputs
        .iter()
        .map(|input| {
            let next = if input.is_float() { f.next() } else { i.next() };
            next.expect("one tensor per input").clone()
        })
        .collect();
    (case.call)(&all)
}

fn gradients(device: Device) -> Result<()> {
    let mut checked = 0;
    for case in cases_on(device) {
        if let Grad::Skip(_) = case.grad {
            continue;
        }
        let inputs = case.make_inputs(device, DType::F64, false)?;
        let (floats, fixed): (Vec<Tensor>, Vec<Tensor>) =
            inputs.into_iter().partition(|t| t.dtype() == DType::F64);
        let f = |xs: &[Tensor]| on_floats(&case, &fixed, xs);
        let options = match case.grad {
            // f32 keeps ~7 digits: a larger step; central differences are exact on quadratics.
            Grad::Loose => GradcheckOptions {
                eps: 1e-2,
                atol: 1e-3,
                rtol: 1e-3,
            },
            _ => GradcheckOptions::default(),
        };
        check_grad_with(case.name, f, &floats, options)?;
        if case.grad == Grad::Second {
            let mismatches = gradgradcheck(f, &floats, GradcheckOptions::default())?;
            assert!(
                mismatches.is_empty(),
                "gradgradcheck of {} on {device} failed (replay with FERRY_SEED={}): {mismatches:#?}",
                case.name,
                seed()
            );
        }
        checked += 1;
    }
    assert!(checked >= 50, "gradchecked only {checked} cases");
    Ok(())
}
device_test!(every_registered_case_passes_gradcheck, gradients);

/// A case's forward in `f32` with every float input requiring grad, watched as it declares.
fn watched(case: &Case, device: Device) -> Result<Forward> {
    const NAMES: [&str; 4] = ["input 0", "input 1", "input 2", "input 3"];
    let keeps = case
        .keeps
        .expect("a case that records declares what it keeps");
    let inputs = case.make_inputs(device, DType::F32, true)?;
    let out = (case.call)(&inputs)?;
    let unnamed = (keeps.unnamed)(&inputs, &out);
    let mut forward = Forward::of([out.clone()]);
    for (i, x) in inputs.iter().enumerate() {
        forward = forward.watch(NAMES[i], x, keeps.inputs.contains(&i));
    }
    forward = forward.watch("output", &out, keeps.output);
    if unnamed > 0 {
        forward = forward.keeps_unnamed(device, unnamed);
    }
    Ok(forward)
}

fn saved_state(device: Device) -> Result<()> {
    for case in cases_on(device).iter().filter(|c| c.keeps.is_some()) {
        check_forward(case.name, device, || watched(case, device), None)?;
    }
    Ok(())
}
device_test!(every_registered_case_keeps_what_it_declares, saved_state);
