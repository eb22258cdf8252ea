//! The guide (docs/guide/) names files, figures, packages and `ferry` subcommands; this checks
//! that each one exists, so a rename elsewhere fails here instead of leaving the guide wrong.
//! (The guide's Rust blocks run as doctests of the `ferry` crate; its `ferry graph` commands
//! are parsed and run by the ferry-cli unit tests.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `(path relative to the root, text)` of the README and every chapter.
fn pages() -> Vec<(PathBuf, String)> {
    let dir = root().join("docs/guide");
    let mut pages: Vec<_> = std::fs::read_dir(&dir)
        .expect("docs/guide exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p.strip_prefix(root()).unwrap().to_path_buf(), text)
        })
        .collect();
    pages.sort();
    assert!(pages.len() >= 7, "the index and six chapters: {pages:?}");
    pages
}

/// Targets of markdown links `[..](target)`, without `#anchors`, external ones left out.
fn links(text: &str) -> Vec<String> {
    text.match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or_default();
            (!target.is_empty() && !target.contains("://")).then(|| target.to_string())
        })
        .collect()
}

/// Inline code spans (`like this`) on one line.
fn code_spans(text: &str) -> Vec<&str> {
    text.lines()
        .flat_map(|line| line.split('`').skip(1).step_by(2))
        .collect()
}

/// Command lines: inline code spans, and the lines of fenced blocks that are not Rust.
fn commands(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        if let Some(lang) = line.strip_prefix("```") {
            fence = if fence.is_some() { None } else { Some(lang) };
            continue;
        }
        match fence {
            Some("text" | "sh" | "console") => lines.push(line.trim()),
            Some(_) => {}
            None => lines.extend(line.split('`').skip(1).step_by(2)),
        }
    }
    lines
}

/// Words after `-p ` in the page (packages named by cargo commands).
fn packages_named(text: &str) -> BTreeSet<String> {
    text.match_indices("-p ")
        .filter_map(|(i, _)| text[i + 3..].split_whitespace().next())
        .map(|p| p.trim_matches(|c: char| c == '`' || c == ',').to_string())
        .collect()
}

fn workspace_packages() -> BTreeSet<String> {
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("Cargo.toml"))
        .collect();
    manifests.push(root().join("tests/Cargo.toml"));
    manifests
        .iter()
        .filter_map(|m| std::fs::read_to_string(m).ok())
        .filter_map(|text| {
            let line = text.lines().find(|l| l.starts_with("name = "))?;
            Some(
                line.trim_start_matches("name = ")
                    .trim_matches('"')
                    .to_string(),
            )
        })
        .collect()
}

/// The `ferry` subcommands: variants of `enum Command` in the CLI, in kebab case.
fn subcommands() -> BTreeSet<String> {
    let main = std::fs::read_to_string(root().join("crates/ferry-cli/src/main.rs")).unwrap();
    let start = main
        .find("enum Command {")
        .expect("the CLI has `enum Command`");
    let body = &main[start..start + main[start..].find("\n}").unwrap()];
    body.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("///") && !l.starts_with("enum") && !l.is_empty())
        .filter_map(|l| l.split(['(', ',', ' ', '{']).next())
        .map(|variant| {
            let mut name = String::new();
            for (i, c) in variant.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    name.push('-');
                }
                name.push(c.to_ascii_lowercase());
            }
            name
        })
        .collect()
}

#[test]
fn the_readme_links_the_guide() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        links(&readme).iter().any(|l| l == "docs/guide/README.md"),
        "README.md should link docs/guide/README.md"
    );
}

#[test]
fn every_link_in_the_guide_resolves() {
    for (page, text) in pages() {
        let dir = root().join(page.parent().unwrap());
        for target in links(&text) {
            assert!(
                dir.join(&target).exists(),
                "{}: link `{target}` points nowhere",
                page.display()
            );
        }
    }
}

#[test]
fn every_chapter_is_in_the_index_and_every_figure_is_shown() {
    let pages = pages();
    let index = &pages
        .iter()
        .find(|(p, _)| p.ends_with("README.md"))
        .unwrap()
        .1;
    let linked: BTreeSet<String> = links(index).into_iter().collect();
    for (page, _) in &pages {
        let name = page.file_name().unwrap().to_str().unwrap();
        assert!(
            name == "README.md" || linked.contains(name),
            "docs/guide/README.md does not list {name}"
        );
    }
    let shown: BTreeSet<String> = pages.iter().flat_map(|(_, text)| links(text)).collect();
    for figure in std::fs::read_dir(root().join("docs/figures")).unwrap() {
        let name = figure.unwrap().file_name().into_string().unwrap();
        assert!(
            shown.contains(&format!("../figures/{name}")),
            "docs/figures/{name} is shown by no chapter"
        );
    }
}

#[test]
fn every_path_the_guide_names_exists() {
    const TOP: [&str; 5] = ["crates/", "docs/", "tests/", "kernels/", ".ci/"];
    let mut checked = 0;
    for (page, text) in pages() {
        let words = code_spans(&text)
            .into_iter()
            .flat_map(str::split_whitespace)
            .chain(text.lines().flat_map(str::split_whitespace));
        for word in words {
            let word = word.trim_matches(|c: char| "`(),.:;".contains(c));
            if !TOP.iter().any(|top| word.starts_with(top)) {
                continue;
            }
            checked += 1;
            assert!(
                root().join(word).exists(),
                "{}: `{word}` does not exist",
                page.display()
            );
        }
    }
    assert!(checked > 10, "the path scan found only {checked} paths");
}

#[test]
fn every_command_the_guide_names_exists() {
    let packages = workspace_packages();
    let subcommands = subcommands();
    assert!(subcommands.contains("graph"), "{subcommands:?}");
    let mut checked = 0;
    for (page, text) in pages() {
        for package in packages_named(&text) {
            assert!(
                packages.contains(&package),
                "{}: no workspace package `{package}` (have {packages:?})",
                page.display()
            );
        }
        for command in commands(&text) {
            let after = if let Some(rest) = command.strip_prefix("ferry ") {
                rest
            } else if let Some((_, rest)) = command.split_once("-p ferry-cli -- ") {
                rest
            } else {
                continue;
            };
            let word = after.split_whitespace().next().unwrap_or_default();
            checked += 1;
            assert!(
                subcommands.contains(word),
                "{}: `{command}` names no subcommand ({subcommands:?})",
                page.display()
            );
        }
    }
    assert!(
        checked >= 5,
        "the command scan found only {checked} commands"
    );
}
