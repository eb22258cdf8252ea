//! `ferry graph`: draws the autograd graph of a built-in example (DOT, or SVG through
//! Graphviz's `dot`) and, with `--trace`, runs its backward step by step, hooks included.
//!
//! Every drawing is a real graph recorded by ferry on this machine. The transfer examples put
//! their source on `cuda:0` when a GPU is there; without one the same code moves from the host
//! to the host, which copies nothing (the result is an alias) but records the same transfer
//! node (reading `cpu -> cpu`), and the drawing's title says so.

use std::error::Error;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::{Args, ValueEnum};
use ferry::graph::{BackwardOptions, GradSlot, Graph, NodeHandle, NodeKind, NodeMeta, TraceStep};
use ferry::optim::{Optimizer, Sgd};
use ferry::prelude::*;

#[derive(Args, Debug)]
pub struct GraphArgs {
    /// Which example to draw.
    #[arg(long, value_enum, default_value_t = Example::CpuVsDetach)]
    example: Example,
    /// `dot` (Graphviz source) or `svg` (needs Graphviz's `dot` on the PATH).
    #[arg(long, value_enum, default_value_t = Format::Dot)]
    format: Format,
    /// Write the drawing here instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run backward step by step and print each node visited, in order, with the gradient it
    /// received, the hooks that ran there and what it passed on. The drawing is then written
    /// only with --out.
    #[arg(long)]
    trace: bool,
}

/// The built-in examples.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Example {
    /// micrograd's neuron, tanh(x1*w1 + x2*w2 + b), on ferry-graph with f64 values.
    Scalar,
    /// One training step of a 3-5-2 MLP: matmul, add, relu, cross-entropy, then SGD.
    Mlp,
    /// `h.cpu()` beside `h.detach().cpu()`: a copy node, and a detach cut that records nothing.
    CpuVsDetach,
    /// A chunked move (4 pieces): one transfer node for the whole move.
    Chunked,
    /// `h = x * w; loss = h.sum()` with hooks on `h` (one checks, one doubles its gradient),
    /// `h.retain_grad()`, and a post-accumulate hook on `w`: the trace shows them fire.
    Hooks,
}

impl Example {
    /// The name `--example` takes.
    pub fn name(self) -> &'static str {
        match self {
            Example::Scalar => "scalar",
            Example::Mlp => "mlp",
            Example::CpuVsDetach => "cpu-vs-detach",
            Example::Chunked => "chunked",
            Example::Hooks => "hooks",
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Dot,
    Svg,
}

/// An example's drawing and the trace of its backward.
pub struct Drawing {
    /// Graphviz DOT, with a title and a legend.
    pub dot: String,
    /// What the backward started from, e.g. `loss [] f32 cpu`.
    pub root: String,
    /// The nodes backward visited, in order.
    pub trace: Vec<TraceStep>,
}

pub fn run(args: GraphArgs) -> Result<(), Box<dyn Error>> {
    let drawing = draw(args.example)?;
    let rendered = match args.format {
        Format::Dot => drawing.dot.clone().into_bytes(),
        Format::Svg => to_svg(&drawing.dot)?,
    };
    if args.trace {
        print!("{}", format_trace(&drawing.root, &drawing.trace));
    }
    match &args.out {
        Some(path) => {
            std::fs::write(path, &rendered)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            eprintln!(
                "wrote {} (the `{}` example)",
                path.display(),
                args.example.name()
            );
        }
        None if !args.trace => std::io::stdout().write_all(&rendered)?,
        None => {}
    }
    Ok(())
}

/// Builds `example`, draws its graph, then runs its backward with a trace.
pub fn draw(example: Example) -> Result<Drawing, Box<dyn Error>> {
    match example {
        Example::Scalar => scalar(),
        Example::Mlp => mlp(),
        Example::CpuVsDetach => cpu_vs_detach(),
        Example::Chunked => chunked(),
        Example::Hooks => hooks(),
    }
}

/// Pipes `dot` through Graphviz; a missing `dot` is an error that names the package.
pub fn to_svg(dot: &str) -> Result<Vec<u8>, Box<dyn Error>> {
    let mut child = match Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(
                "SVG needs Graphviz's `dot`, which is not on the PATH: install the \
                        `graphviz` package (Debian/Ubuntu: apt-get install graphviz; macOS: \
                        brew install graphviz), or use --format dot"
                    .into(),
            );
        }
        Err(e) => return Err(format!("cannot run Graphviz's `dot`: {e}").into()),
    };
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(dot.as_bytes())?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        return Err(format!(
            "Graphviz's `dot` rejected the drawing ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    Ok(output.stdout)
}

/// The trace as the CLI prints it: one block per node, in the order backward visited them.
/// Hooks are listed where they ran: gradient hooks (and a retained gradient) before the node
/// used its gradient, so `received` is the gradient after them; post-accumulate hooks after a
/// leaf stored its gradient.
pub fn format_trace(root: &str, steps: &[TraceStep]) -> String {
    let mut out = format!(
        "backward from {root}: {} nodes, in the order visited\n",
        steps.len()
    );
    for (i, step) in steps.iter().enumerate() {
        let meta = &step.meta;
        let shape: Vec<String> = meta.shape.iter().map(ToString::to_string).collect();
        let mut node = format!(
            "{} [{}] {} {}",
            meta.op,
            shape.join(", "),
            meta.dtype,
            meta.device
        );
        match &meta.kind {
            NodeKind::Leaf => node.push_str(" (leaf)"),
            NodeKind::Transfer { from, to } => {
                let _ = write!(node, " (transfer {from} -> {to})");
            }
            NodeKind::Op => {}
        }
        let (after, before): (Vec<&String>, Vec<&String>) = step
            .hooks
            .iter()
            .partition(|note| note.starts_with("post-accumulate"));
        let _ = writeln!(out, "{:>3}. {node}", i + 1);
        for note in before {
            let note = note.strip_prefix("hook ").unwrap_or(note);
            let _ = writeln!(out, "     hook      {note}");
        }
        let _ = writeln!(out, "     received  {}", step.received);
        if meta.kind == NodeKind::Leaf {
            out.push_str("     stored    into .grad\n");
            for note in after {
                let _ = writeln!(out, "     hook      {note}");
            }
        } else if step.passed.is_empty() {
            out.push_str("     passed    nothing (no input needs a gradient)\n");
        }
        for (slot, grad) in &step.passed {
            let _ = writeln!(out, "     passed    input {slot}: {grad}");
        }
    }
    out
}

/// Where the transfer examples put their source: the GPU when there is one.
fn source_device() -> Device {
    if ferry::cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// The title line saying where the graph came from.
fn provenance(src: Device) -> String {
    match src {
        Device::Cpu => "real graph recorded by ferry; no GPU here, so the source is on cpu and \
                        the move reads cpu -> cpu (on a GPU: cuda:0 -> cpu, same nodes)"
            .to_string(),
        gpu => format!("real graph recorded by ferry; source on {gpu}"),
    }
}

/// Adds a title (graph label) and a legend to DOT from ferry-graph.
fn decorate(dot: &str, title: &[&str]) -> String {
    let header = "digraph autograd {\n";
    let body = dot
        .strip_prefix(header)
        .and_then(|rest| rest.strip_suffix("}\n"))
        .expect("ferry-graph writes `digraph autograd { .. }`");
    let title: String = title
        .iter()
        .map(|line| format!("{}\\l", escape(line)))
        .collect();
    format!(
        "{header}  label=\"{title}\";\n  labelloc=t;\n  labeljust=l;\n  fontname=\"monospace\";\n  fontsize=11;\n  edge [fontname=\"monospace\", fontsize=9];\n{body}{LEGEND}}}\n"
    )
}

const LEGEND: &str = "  subgraph cluster_legend {\n    label=\"legend\";\n    style=dashed;\n    color=gray;\n    legend [shape=plaintext, fontsize=9, label=\"box: op (name, [shape] dtype device, bytes saved for backward when any)\\lblue ellipse: leaf that requires grad; its gradient lands in .grad\\lorange, bold edge: device move; its backward sends the gradient home\\lred dashed: detach cut; the detached tensor records nothing\\larrows point the way gradients flow, from an op to its inputs\\l\"];\n  }\n";

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

// ----- the examples -----

/// A scalar with its node, as in chapter 1 of the guide.
struct Value {
    data: f64,
    node: NodeHandle<f64>,
}

fn leaf(g: &Graph, name: &'static str, data: f64) -> Value {
    let node = g.leaf(NodeMeta::scalar(name), GradSlot::default());
    Value { data, node }
}

/// An op whose gradient for input `i` is the output's gradient times `local[i]`.
fn op(g: &Graph, name: &'static str, data: f64, inputs: &[&Value], local: Vec<f64>) -> Value {
    let rule = move |grad: &f64, _: &[bool]| -> Result<_, ferry::graph::BoxError> {
        Ok(local.iter().map(|d| Some(grad * d)).collect())
    };
    let nodes: Vec<_> = inputs.iter().map(|v| Some(&v.node)).collect();
    let node = g.record(NodeMeta::scalar(name), std::sync::Arc::new(rule), &nodes);
    Value { data, node }
}

fn scalar() -> Result<Drawing, Box<dyn Error>> {
    let g = Graph::new();
    let add = |a: &Value, b: &Value| op(&g, "add", a.data + b.data, &[a, b], vec![1.0, 1.0]);
    let mul = |a: &Value, b: &Value| op(&g, "mul", a.data * b.data, &[a, b], vec![b.data, a.data]);
    let (x1, x2) = (leaf(&g, "x1", 2.0), leaf(&g, "x2", 0.0));
    let (w1, w2) = (leaf(&g, "w1", -3.0), leaf(&g, "w2", 1.0));
    let b = leaf(&g, "b", 6.881_373_587_019_543);
    let n = add(&add(&mul(&x1, &w1), &mul(&x2, &w2)), &b);
    let t = n.data.tanh();
    let o = op(&g, "tanh", t, &[&n], vec![1.0 - t * t]); // d tanh(n)/dn = 1 - tanh²(n)
    let dot = decorate(
        &o.node.to_dot(),
        &[
            "ferry graph --example scalar: o = tanh(x1*w1 + x2*w2 + b), micrograd's neuron",
            "real graph: ferry-graph's Graph, the engine chapter 1 of the guide builds on",
        ],
    );
    let options = BackwardOptions {
        trace: true,
        ..BackwardOptions::default()
    };
    let report = o.node.backward(1.0, options)?;
    Ok(Drawing {
        dot,
        root: format!("o = {:.4} ([] f64 cpu), gradient 1.0", o.data),
        trace: report.trace,
    })
}

fn mlp() -> Result<Drawing, Box<dyn Error>> {
    ferry::manual_seed(7);
    let param = |shape: &[usize]| Tensor::randn(shape, DType::F32, Device::Cpu)?.with_grad();
    let (w1, b1) = (param(&[3, 5])?, param(&[5])?);
    let (w2, b2) = (param(&[5, 2])?, param(&[2])?);
    let mut sgd = Sgd::new([w1.clone(), b1.clone(), w2.clone(), b2.clone()], 0.1)?;
    let x = Tensor::rand(&[4, 3], DType::F32, Device::Cpu)?;
    let labels = Tensor::from_slice(&[0i64, 1, 1, 0], &[4])?;

    let hidden = x.matmul(&w1)?.add(&b1)?.relu()?;
    let loss = hidden.matmul(&w2)?.add(&b2)?.cross_entropy(&labels)?;
    let dot = decorate(
        &ferry::tensor::to_dot(&[&loss], &[]),
        &[
            "ferry graph --example mlp: loss = cross_entropy(relu(x @ w1 + b1) @ w2 + b2, labels)",
            "real graph recorded by ferry on cpu, before backward; sgd.step() then updates the 4 leaves",
        ],
    );
    let report = loss.backward_traced()?;
    sgd.step()?;
    Ok(Drawing {
        dot,
        root: format!("loss = {:.4} ([] f32 cpu)", loss.item()?),
        trace: report.trace,
    })
}

fn cpu_vs_detach() -> Result<Drawing, Box<dyn Error>> {
    ferry::manual_seed(0); // the same numbers, and trace, every run
    let src = source_device();
    let x = Tensor::randn(&[2, 3], DType::F32, src)?.with_grad()?;
    let h = x.tanh()?;
    let y = h.cpu()?; // records a transfer node
    let z = h.detach().cpu()?; // records nothing
    let dot = decorate(
        &ferry::tensor::to_dot(&[&y], &[("z = h.detach().cpu()\nrecords nothing", &h)]),
        &[
            "ferry graph --example cpu-vs-detach: h = x.tanh(); y = h.cpu(); z = h.detach().cpu()",
            "y has a copy node (orange): its backward moves the gradient to h's device",
            "z has no node at all: the red dashed cut marks where it left the graph",
            &provenance(src),
        ],
    );
    // Only y carries gradients: z is a constant to autograd.
    let loss = y.mul(&z)?.sum()?;
    let report = loss.backward_traced()?;
    Ok(Drawing {
        dot,
        root: format!("loss = (y * z).sum() ([] f32 cpu), h on {src}"),
        trace: report.trace,
    })
}

fn chunked() -> Result<Drawing, Box<dyn Error>> {
    ferry::manual_seed(0); // the same numbers, and trace, every run
    let src = source_device();
    let x = Tensor::randn(&[8, 3], DType::F32, src)?.with_grad()?;
    let h = x.relu()?;
    let (y, report) = h.to_chunked(Device::Cpu, ChunkSpec::Count(4))?;
    let dot = decorate(
        &ferry::tensor::to_dot(&[&y], &[]),
        &[
            "ferry graph --example chunked: h = x.relu(); y = h.to_chunked(cpu, Count(4))",
            &format!(
                "4 pieces through bounded staging, one transfer node for the whole move ({} recorded)",
                report.nodes_recorded
            ),
            &provenance(src),
        ],
    );
    let loss = y.sum()?;
    let trace = loss.backward_traced()?.trace;
    Ok(Drawing {
        dot,
        root: format!("loss = y.sum() ([] f32 cpu), h on {src}"),
        trace,
    })
}

fn hooks() -> Result<Drawing, Box<dyn Error>> {
    let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0], &[3])?.with_grad()?;
    let w = Tensor::from_slice(&[3.0f32, 1.0, -0.5], &[3])?.with_grad()?;
    let h = x.mul(&w)?;
    // Hooks run in the order they were registered, each on what the one before returned.
    let _check = h.register_hook(|g| {
        if !g.norm()?.is_finite() {
            return Err(TensorError::InvalidArgument {
                op: "gradient check",
                message: "the gradient of h is not finite".into(),
            });
        }
        Ok(None) // observed, not replaced
    })?;
    let _double = h.register_hook(|g| Ok(Some(g.mul_scalar(2.0)?)))?;
    h.retain_grad()?; // h.grad() keeps the gradient the hooks left
    let _ready = w.register_post_accumulate_grad_hook(|_grad| Ok(()))?; // where all-reduce would start
    let loss = h.sum()?;
    let dot = decorate(
        &ferry::tensor::to_dot(&[&loss], &[]),
        &[
            "ferry graph --example hooks: h = x * w; loss = h.sum()",
            "on h: a hook that checks its gradient is finite, a hook that doubles it, h.retain_grad()",
            "on w: a post-accumulate hook, run once w.grad is updated",
            "hooks add no nodes, only the (hooks) mark; --trace shows where they fire",
        ],
    );
    let report = loss.backward_traced()?;
    Ok(Drawing {
        dot,
        root: "loss = (x * w).sum() ([] f32 cpu)".to_string(),
        trace: report.trace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every example, in the order the guide shows them.
    const ALL: [Example; 5] = [
        Example::Scalar,
        Example::Mlp,
        Example::CpuVsDetach,
        Example::Chunked,
        Example::Hooks,
    ];

    fn dot_available() -> bool {
        Command::new("dot").arg("-V").output().is_ok()
    }

    #[test]
    fn graphviz_accepts_the_dot_of_every_example() {
        if !dot_available() {
            eprintln!(
                "SKIPPED graphviz_accepts_the_dot_of_every_example: Graphviz's `dot` is not \
                 installed (apt-get install graphviz)"
            );
            return;
        }
        for example in ALL {
            let drawing = draw(example).unwrap();
            let svg = to_svg(&drawing.dot)
                .unwrap_or_else(|e| panic!("{}: {e}\n{}", example.name(), drawing.dot));
            let svg = String::from_utf8(svg).unwrap();
            assert!(svg.contains("<svg"), "{}: no SVG came back", example.name());
        }
    }

    #[test]
    fn transfer_examples_draw_the_copy_node_and_the_cut() {
        let dot = draw(Example::CpuVsDetach).unwrap().dot;
        assert!(
            dot.contains("fillcolor=\"orange\""),
            "no transfer node:\n{dot}"
        );
        assert!(
            dot.contains("style=dashed, color=red"),
            "no detach cut:\n{dot}"
        );
        // One transfer node: detach().cpu() recorded nothing.
        assert_eq!(dot.matches("to_device").count(), 1, "{dot}");
        let dot = draw(Example::Chunked).unwrap().dot;
        assert_eq!(dot.matches("to_chunked\\n").count(), 1, "{dot}");
    }

    #[test]
    fn the_trace_visits_every_node_once_and_ends_in_leaves() {
        for example in ALL {
            let drawing = draw(example).unwrap();
            let leaves = drawing
                .trace
                .iter()
                .filter(|s| s.meta.kind == NodeKind::Leaf)
                .count();
            let expected = match example {
                Example::Scalar => 5,
                Example::Mlp => 4,
                Example::Hooks => 2,
                Example::CpuVsDetach | Example::Chunked => 1,
            };
            assert_eq!(leaves, expected, "{}", example.name());
            assert_ne!(drawing.trace[0].meta.kind, NodeKind::Leaf);
        }
    }

    #[test]
    fn the_scalar_trace_carries_the_hand_worked_gradients() {
        let drawing = draw(Example::Scalar).unwrap();
        let received = |op: &str| {
            let step = drawing.trace.iter().find(|s| s.meta.op == op).unwrap();
            step.received.parse::<f64>().unwrap()
        };
        // do/dn = 1 - tanh²(n) = 0.5 at n = 0.8814; dn/dw1 = x1 = 2; dn/dx2 = w2 = 1.
        for (leaf, expected) in [("b", 0.5), ("w1", 1.0), ("x2", 0.5)] {
            assert!(
                (received(leaf) - expected).abs() < 1e-6,
                "{leaf}: {}",
                received(leaf)
            );
        }
        let text = format_trace(&drawing.root, &drawing.trace);
        assert!(text.contains("  1. tanh [] f64 cpu"), "{text}");
    }

    fn workspace() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[derive(clap::Parser)]
    struct GraphCommand {
        #[command(flatten)]
        args: GraphArgs,
    }

    /// Every `ferry graph ..` / `cargo run -p ferry-cli -- graph ..` line of the guide and the
    /// README, as arguments after `graph` (synopses with `[options]` left out).
    fn documented_commands() -> Vec<(String, Vec<String>)> {
        let mut pages = vec![workspace().join("README.md")];
        for entry in std::fs::read_dir(workspace().join("docs/guide")).unwrap() {
            pages.push(entry.unwrap().path());
        }
        let mut commands = Vec::new();
        for page in pages {
            let text = std::fs::read_to_string(&page).unwrap();
            for line in text.lines() {
                for marker in ["ferry graph", "-- graph"] {
                    for (i, _) in line.match_indices(marker) {
                        let rest = &line[i + marker.len()..];
                        let rest = rest.split('`').next().unwrap();
                        if rest.contains('[') {
                            continue;
                        }
                        let args = rest.split_whitespace().map(String::from).collect();
                        commands.push((format!("{}: {line}", page.display()), args));
                    }
                }
            }
        }
        commands
    }

    #[test]
    fn every_graph_command_in_the_docs_parses_and_draws() {
        use clap::Parser;
        let commands = documented_commands();
        assert!(commands.len() >= 8, "found only {commands:?}");
        for (place, args) in commands {
            let argv = std::iter::once("graph".to_string()).chain(args);
            let parsed = GraphCommand::try_parse_from(argv)
                .unwrap_or_else(|e| panic!("{place}\n{e}"))
                .args;
            draw(parsed.example).unwrap_or_else(|e| panic!("{place}: {e}"));
        }
    }

    #[test]
    fn the_committed_figures_show_what_the_examples_record() {
        for example in ALL {
            let path = workspace().join(format!("docs/figures/{}.svg", example.name()));
            let svg = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; regenerate it with `ferry graph --example {} --format svg --out {}`",
                    path.display(),
                    example.name(),
                    path.display()
                )
            });
            let dot = draw(example).unwrap().dot;
            let drawn = dot
                .lines()
                .filter(|l| {
                    // `  n3 [label=..]` is a node; `  n3 -> n1 [..]` an edge.
                    l.trim_start().split_once(' ').is_some_and(|(id, rest)| {
                        id.starts_with('n') && rest.starts_with("[label=")
                    })
                })
                .collect::<Vec<_>>();
            // Nodes, plus detach cuts and the legend.
            let nodes = drawn.len() + dot.matches("shape=note").count() + 1;
            assert_eq!(
                svg.matches("class=\"node\"").count(),
                nodes,
                "{} has drifted from `ferry graph --example {}`",
                path.display(),
                example.name()
            );
            for line in drawn {
                let op = line
                    .split("label=\"")
                    .nth(1)
                    .unwrap()
                    .split("\\n")
                    .next()
                    .unwrap();
                assert!(
                    svg.contains(&format!(">{op}</text>")),
                    "{}: no `{op}` node",
                    path.display()
                );
            }
        }
    }

    #[test]
    fn the_hooks_trace_shows_each_hook_where_it_ran() {
        let drawing = draw(Example::Hooks).unwrap();
        let mul = drawing.trace.iter().find(|s| s.meta.op == "mul").unwrap();
        assert_eq!(mul.hooks.len(), 3, "{:?}", mul.hooks);
        assert_eq!(mul.hooks[0], "hook observed the gradient");
        assert!(mul.hooks[1].starts_with("hook replaced the gradient"));
        assert_eq!(mul.hooks[2], "gradient retained");
        // d loss/dh = 1 per element, doubled: norm √(3 · 2²) = 3.4641.
        assert!(mul.received.ends_with("norm 3.4641"), "{}", mul.received);
        let post: Vec<_> = drawing
            .trace
            .iter()
            .filter(|s| s.hooks.iter().any(|h| h.starts_with("post-accumulate")))
            .collect();
        assert_eq!(post.len(), 1, "only w has a post-accumulate hook");
        assert_eq!(post[0].meta.kind, NodeKind::Leaf);

        let text = format_trace(&drawing.root, &drawing.trace);
        let hook = text.find("hook      replaced the gradient").expect(&text);
        let received = text[hook..].find("received").expect(&text) + hook;
        let stored = text.find("stored    into .grad\n     hook      post-accumulate");
        assert!(hook < received && stored.is_some(), "{text}");
    }

    #[test]
    fn the_cpu_trace_passes_the_gradient_through_the_transfer_node() {
        let drawing = draw(Example::CpuVsDetach).unwrap();
        let transfer = drawing
            .trace
            .iter()
            .find(|s| matches!(s.meta.kind, NodeKind::Transfer { .. }))
            .expect("the copy node is visited");
        assert_eq!(transfer.passed.len(), 1);
        assert!(transfer.passed[0].1.contains(&source_device().to_string()));
    }
}
