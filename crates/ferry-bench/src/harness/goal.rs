//! Goals kept as data: a bench lists its [`Goal`]s (what, which figure, the bound) and the
//! harness judges each figure, prints the goal lines and writes them to JSON, the same way in
//! every bench.

use serde_json::{Value, json};

use super::report::Verdict;

/// Which side of the bound a figure must stay on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bound {
    /// The figure at most this.
    AtMost(f64),
    /// The figure at least this.
    AtLeast(f64),
}

impl Bound {
    /// The number the figure is held to.
    pub fn value(self) -> f64 {
        match self {
            Bound::AtMost(b) | Bound::AtLeast(b) => b,
        }
    }
}

impl std::fmt::Display for Bound {
    /// `<= 3`, `>= 0.75`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::AtMost(b) => write!(f, "<= {b}"),
            Bound::AtLeast(b) => write!(f, ">= {b}"),
        }
    }
}

/// One goal: its line's text, the figure it judges (named as the JSON names it) and the bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Goal {
    pub name: &'static str,
    pub metric: &'static str,
    pub bound: Bound,
}

impl Goal {
    /// Whether `figure` meets the bound; `Unknown` when it was not measured.
    pub fn verdict(&self, figure: Option<f64>) -> Verdict {
        let Some(x) = figure else {
            return Verdict::Unknown;
        };
        let met = match self.bound {
            Bound::AtMost(b) => x <= b,
            Bound::AtLeast(b) => x >= b,
        };
        if met { Verdict::Met } else { Verdict::Missed }
    }

    /// The goal judged on `figure`, shown as `shown`.
    pub fn judge(&self, figure: Option<f64>, shown: String) -> Judged {
        Judged {
            goal: *self,
            value: figure,
            figure: shown,
            verdict: self.verdict(figure),
        }
    }
}

/// A goal after the run: the figure, as measured and as shown, and the verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    pub goal: Goal,
    pub value: Option<f64>,
    pub figure: String,
    pub verdict: Verdict,
}

impl Judged {
    /// `goal: NAME: FIGURE VERDICT`.
    pub fn line(&self) -> String {
        let (name, figure) = (self.goal.name, &self.figure);
        format!("goal: {name}: {figure} {}", self.verdict.label())
    }

    /// `{"goal", "metric", "figure", "value", "met"}`.
    pub fn json(&self) -> Value {
        json!({
            "goal": self.goal.name,
            "metric": self.goal.metric,
            "figure": self.figure,
            "value": self.value,
            "met": self.verdict.as_bool(),
        })
    }
}

/// Prints each goal's line.
pub fn print_goals(judged: &[Judged]) {
    for goal in judged {
        println!("{}", goal.line());
    }
}

/// The goals for the JSON file.
pub fn goals_json(judged: &[Judged]) -> Value {
    Value::Array(judged.iter().map(Judged::json).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT_LEAST: Goal = Goal {
        name: "efficiency >= 0.9",
        metric: "efficiency",
        bound: Bound::AtLeast(0.9),
    };

    #[test]
    fn bounds_judge_figures_and_absent_figures_are_unknown() {
        assert_eq!(AT_LEAST.verdict(Some(0.9)), Verdict::Met);
        assert_eq!(AT_LEAST.verdict(Some(0.89)), Verdict::Missed);
        assert_eq!(AT_LEAST.verdict(None), Verdict::Unknown);
        let at_most = Goal {
            bound: Bound::AtMost(1.0),
            ..AT_LEAST
        };
        assert_eq!(at_most.verdict(Some(1.0)), Verdict::Met);
        assert_eq!(at_most.verdict(Some(1.01)), Verdict::Missed);
        assert_eq!(
            (at_most.bound.to_string(), AT_LEAST.bound.to_string()),
            ("<= 1".into(), ">= 0.9".into())
        );
    }

    #[test]
    fn a_judged_goal_has_one_line_and_one_json_object() {
        let judged = AT_LEAST.judge(Some(0.909), "0.909".into());
        assert_eq!(judged.line(), "goal: efficiency >= 0.9: 0.909 met");
        let doc = goals_json(&[judged, AT_LEAST.judge(None, "-".into())]);
        assert_eq!(doc[0]["met"], true);
        assert_eq!(doc[0]["metric"], "efficiency");
        assert_eq!(doc[1]["figure"], "-");
        assert_eq!(doc[1]["met"], Value::Null);
    }
}
