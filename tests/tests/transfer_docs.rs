//! docs/transfer-methods.md shows what each method records as DOT figures; this regenerates
//! them from the real moves (on the host, where a move to the same device still records what a
//! cross-device one does) and fails when the page has drifted. `FERRY_BLESS=1` rewrites them.

use ferry::graph::DetachCut;
use ferry::{ChunkSpec, DeviceMove, MoveOptions};
use ferry_tensor::{DType, Device, Result, Tensor};

fn page_path() -> std::path::PathBuf {
    ferry_tests::repo_root().join("docs/transfer-methods.md")
}

/// `h = relu(x)` for a leaf `x` of shape [2, 3]: the history a move starts from.
fn history() -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(&[2, 3], DType::F32, Device::Cpu)?.with_grad()?;
    let h = x.relu()?;
    Ok((x, h))
}

fn dot_of(t: &Tensor) -> String {
    t.node().expect("the move recorded a node").to_dot()
}

/// The history of `h` with a detach cut drawn where `label` left the graph.
fn cut(h: &Tensor, label: &str) -> String {
    let node = h.node().expect("h has history");
    let cut = DetachCut {
        label: label.into(),
        node: node.clone(),
    };
    ferry::graph::dot(&[node], &[cut])
}

fn figures() -> Result<Vec<(&'static str, String)>> {
    let (_x, h) = history()?;
    let (into, _) = h.clone().into_device(Device::Cpu)?;
    Ok(vec![
        ("cpu", dot_of(&h.cpu()?)),
        (
            "to-f16",
            dot_of(&h.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?.0),
        ),
        ("detach", cut(&h, "y = h.detach().cpu(): records nothing")),
        ("into-device", dot_of(&into)),
        (
            "chunked",
            dot_of(&h.to_chunked(Device::Cpu, ChunkSpec::Count(2))?.0),
        ),
        (
            "state-dict",
            cut(&h, "move_state_dict(..): records nothing"),
        ),
        (
            "direct",
            dot_of(&Tensor::randn(&[2, 3], DType::F32, Device::Cpu)?.with_grad()?),
        ),
    ])
}

/// Byte range of the ```dot block following `<!-- figure: name -->`.
fn block(page: &str, name: &str) -> Option<std::ops::Range<usize>> {
    let marker = page.find(&format!("<!-- figure: {name} -->"))?;
    let start = marker + page[marker..].find("```dot\n")? + "```dot\n".len();
    let end = start + page[start..].find("```")?;
    Some(start..end)
}

#[test]
fn the_figures_in_the_guide_are_what_the_moves_record() {
    let mut page = std::fs::read_to_string(page_path()).expect("docs/transfer-methods.md exists");
    let bless = std::env::var_os("FERRY_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, dot) in figures().unwrap() {
        let range = block(&page, name).unwrap_or_else(|| panic!("figure `{name}` missing"));
        if page[range.clone()] != dot {
            if bless {
                page.replace_range(range, &dot);
            } else {
                stale.push(format!("{name}:\n{dot}"));
            }
        }
    }
    if bless {
        std::fs::write(page_path(), page).unwrap();
    }
    assert!(
        stale.is_empty(),
        "docs/transfer-methods.md has drifted (FERRY_BLESS=1 cargo test --test suite transfer_docs rewrites it):\n{}",
        stale.join("\n")
    );
}
