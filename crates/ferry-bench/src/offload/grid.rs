//! The cases of `ferry bench offload --sweep`: MLPs over layers x width x batch and
//! transformer blocks (ferry's GPT), parsed from `--grid` or taken from [`DEFAULT_GRID`].
//!
//! A case is written `LxW@B` for an MLP of `L` bias-free Linear(W, W) + tanh layers at batch
//! `B`, or `gpt:LxW@BxT` for ferry's GPT with `L` blocks of width `W` (heads of 64 channels)
//! on `B` sequences of `T` tokens.

use std::fmt;

/// The default sweep: the two MLPs measured before (6 x 2048 at 8192, 1.37x; 16 x 4096 at
/// 16384, 1.03x), sizes between them, a link-bound MLP (width 1024: less compute per byte
/// saved), and two transformers: four wide blocks, and GPT-2 small's shape (12 x 768, batch
/// 12 x 1024). About a minute on an H200 at the default samples.
pub const DEFAULT_GRID: &str = "4x1024@8192,6x2048@8192,8x2048@16384,12x4096@8192,\
                                16x4096@16384,16x1024@32768,gpt:4x1024@8x1024,gpt:12x768@12x1024";

/// Channels per attention head in the transformer cases (GPT-2's).
pub const HEAD_WIDTH: u64 = 64;

/// Tokens of the transformer cases' vocabulary: small, so the blocks, not the head, hold the
/// activations.
pub const VOCAB: u64 = 256;

/// One case of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepCase {
    /// `layers` bias-free Linear(width, width) + tanh at `batch` rows (f32).
    Mlp { layers: u64, width: u64, batch: u64 },
    /// ferry's GPT: `blocks` blocks of `width` on `batch` sequences of `seq` tokens (f32).
    Gpt {
        blocks: u64,
        width: u64,
        batch: u64,
        seq: u64,
    },
}

impl SweepCase {
    pub const fn mlp(layers: u64, width: u64, batch: u64) -> Self {
        SweepCase::Mlp {
            layers,
            width,
            batch,
        }
    }

    pub const fn gpt(blocks: u64, width: u64, batch: u64, seq: u64) -> Self {
        SweepCase::Gpt {
            blocks,
            width,
            batch,
            seq,
        }
    }

    /// The bytes the MLP's rules save that are activations: one tanh output per layer. `None`
    /// for the GPT, whose activations are measured (the graph's saved bytes less its
    /// parameters).
    pub fn mlp_activation_bytes(self) -> Option<u64> {
        match self {
            SweepCase::Mlp {
                layers,
                width,
                batch,
            } => Some(layers * batch * width * 4),
            SweepCase::Gpt { .. } => None,
        }
    }

    /// Attention heads of a transformer case.
    pub fn heads(self) -> Option<u64> {
        match self {
            SweepCase::Gpt { width, .. } => Some(width / HEAD_WIDTH),
            SweepCase::Mlp { .. } => None,
        }
    }
}

impl fmt::Display for SweepCase {
    /// The case as `--grid` spells it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SweepCase::Mlp {
                layers,
                width,
                batch,
            } => write!(f, "{layers}x{width}@{batch}"),
            SweepCase::Gpt {
                blocks,
                width,
                batch,
                seq,
            } => write!(f, "gpt:{blocks}x{width}@{batch}x{seq}"),
        }
    }
}

/// Parses a comma-separated list of cases (see the module docs); an error names the case that
/// is wrong and how to write it.
pub fn parse_grid(spec: &str) -> Result<Vec<SweepCase>, String> {
    let cases = spec
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(parse_case)
        .collect::<Result<Vec<_>, _>>()?;
    if cases.is_empty() {
        return Err("the grid has no case: give e.g. 6x2048@8192,gpt:4x1024@8x1024".into());
    }
    Ok(cases)
}

fn parse_case(case: &str) -> Result<SweepCase, String> {
    let (gpt, body) = match case.strip_prefix("gpt:") {
        Some(body) => (true, body),
        None => (false, case),
    };
    let form = if gpt {
        "gpt:BLOCKSxWIDTH@BATCHxTOKENS, e.g. gpt:4x1024@8x1024"
    } else {
        "LAYERSxWIDTH@BATCH, e.g. 6x2048@8192"
    };
    let bad = |why: &str| format!("`{case}` is not a case ({why}): write {form}");
    let (shape, rows) = body.split_once('@').ok_or_else(|| bad("no @"))?;
    let pair = |s: &str| -> Result<(u64, u64), String> {
        let (a, b) = s.split_once('x').ok_or_else(|| bad("no x"))?;
        Ok((
            number(a).map_err(|w| bad(&w))?,
            number(b).map_err(|w| bad(&w))?,
        ))
    };
    let (depth, width) = pair(shape)?;
    if !gpt {
        let batch = number(rows).map_err(|w| bad(&w))?;
        return Ok(SweepCase::mlp(depth, width, batch));
    }
    let (batch, seq) = pair(rows)?;
    if width % HEAD_WIDTH != 0 {
        return Err(bad(&format!(
            "the width must be a multiple of {HEAD_WIDTH}, the channels of a head"
        )));
    }
    Ok(SweepCase::gpt(depth, width, batch, seq))
}

/// A positive whole number.
fn number(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("sizes start at 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a positive whole number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grid_holds_the_cases_the_issue_names() {
        let grid = parse_grid(DEFAULT_GRID).unwrap();
        let mlp = SweepCase::mlp;
        for named in [
            mlp(6, 2048, 8192),
            mlp(16, 4096, 16384),
            mlp(4, 1024, 8192),
            mlp(8, 2048, 16384),
            mlp(12, 4096, 8192),
        ] {
            assert!(grid.contains(&named), "{named} is missing from the grid");
        }
        let blocks: Vec<_> = grid.iter().filter(|c| c.heads().is_some()).collect();
        assert!(!blocks.is_empty(), "no transformer case");
        // Every case is written back as it was given.
        let written: Vec<String> = grid.iter().map(ToString::to_string).collect();
        assert_eq!(written.join(","), DEFAULT_GRID.replace(' ', ""));
        // 6 x 2048 at 8192 saves 6 x 64 MiB of tanh outputs; 16 x 4096 at 16384, 4 GiB.
        assert_eq!(mlp(6, 2048, 8192).mlp_activation_bytes(), Some(384 << 20));
        assert_eq!(mlp(16, 4096, 16384).mlp_activation_bytes(), Some(4 << 30));
        assert_eq!(blocks[0].mlp_activation_bytes(), None);
    }

    #[test]
    fn cases_parse_with_spaces_and_transformers_take_heads_of_64() {
        assert_eq!(
            parse_grid(" 2x8@4 , gpt:3x128@2x16,").unwrap(),
            [
                SweepCase::mlp(2, 8, 4),
                SweepCase::gpt(3, 128, 2, 16),
            ]
        );
        assert_eq!(
            parse_grid("gpt:12x768@12x1024").unwrap()[0].heads(),
            Some(12)
        );
    }

    #[test]
    fn a_bad_case_is_named_with_the_form_to_use() {
        for (spec, says) in [
            ("", "no case"),
            ("6x2048", "no @"),
            ("6@8192", "no x"),
            ("0x2048@8192", "start at 1"),
            ("6x2048@-1", "`-1` is not"),
            ("6x2048@8192,gpt:4x1000@8x1024", "multiple of 64"),
            ("gpt:4x1024@8", "gpt:BLOCKSxWIDTH@BATCHxTOKENS"),
            ("mlp:6x2048@8192", "`mlp:6x2048@8192` is not a case"),
        ] {
            let err = parse_grid(spec).expect_err(spec);
            assert!(err.contains(says), "`{spec}`: {err}");
        }
    }
}
