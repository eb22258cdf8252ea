//! What each epoch measured, and how the history travels in a checkpoint's metadata.

/// One epoch's figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochStats {
    /// Mean training loss over the epoch's predictions.
    pub loss: f64,
    /// Training accuracy over the epoch (on the batches as they were trained).
    pub train_accuracy: f64,
    /// The task's score after the epoch ([`Task::evaluate`](super::Task::evaluate)): accuracy
    /// on held-out data.
    pub test_accuracy: f64,
}

/// `loss:train:test` per epoch, `;` between epochs: exact (Rust prints the shortest text that
/// parses back to the same `f64`).
pub(super) fn encode(history: &[EpochStats]) -> String {
    history
        .iter()
        .map(|s| format!("{}:{}:{}", s.loss, s.train_accuracy, s.test_accuracy))
        .collect::<Vec<_>>()
        .join(";")
}

/// The history [`encode`] wrote; `None` if `text` is not one.
pub(super) fn decode(text: &str) -> Option<Vec<EpochStats>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(';')
        .map(|e| {
            let mut parts = e.split(':').map(str::parse::<f64>);
            let stats = EpochStats {
                loss: parts.next()?.ok()?,
                train_accuracy: parts.next()?.ok()?,
                test_accuracy: parts.next()?.ok()?,
            };
            parts.next().is_none().then_some(stats)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_round_trips_through_metadata() {
        let h = vec![
            EpochStats {
                loss: 0.5,
                train_accuracy: 0.8,
                test_accuracy: 0.75,
            };
            3
        ];
        assert_eq!(decode(&encode(&h)).unwrap(), h);
        assert!(decode("0.5:0.1").is_none());
    }
}
