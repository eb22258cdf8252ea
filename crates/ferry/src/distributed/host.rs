//! The meeting point of host ranks: each collective is one exchange in which every rank hands
//! in its values and gets everyone's back.

use std::sync::Arc;

use ferry_tensor::{Result, TensorError};
use parking_lot::{Condvar, Mutex};

/// Exchanges of values between the `world` threads of a host group, one at a time.
pub(crate) struct Rendezvous {
    world: usize,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Each rank's values for the exchange being filled.
    slots: Vec<Option<Vec<f64>>>,
    arrived: usize,
    /// Every rank's values, once all arrived, until each has taken them.
    result: Option<Arc<Vec<Vec<f64>>>>,
    left_to_take: usize,
    /// The rank that failed, if any: every exchange from then on is an error.
    aborted_by: Option<usize>,
}

impl Rendezvous {
    pub(crate) fn new(world: usize) -> Self {
        Self {
            world,
            state: Mutex::new(State {
                slots: vec![None; world],
                ..State::default()
            }),
            changed: Condvar::new(),
        }
    }

    /// Hands in `values` as `rank`'s and returns every rank's, in rank order, once all have
    /// handed theirs in.
    pub(crate) fn exchange(&self, rank: usize, values: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        let mut s = self.state.lock();
        // The previous exchange is still being taken: wait for it to clear.
        while s.result.is_some() && s.aborted_by.is_none() {
            self.changed.wait(&mut s);
        }
        self.check(&s)?;
        s.slots[rank] = Some(values);
        s.arrived += 1;
        if s.arrived == self.world {
            let all = s
                .slots
                .iter_mut()
                .map(|v| v.take().unwrap_or_default())
                .collect();
            s.result = Some(Arc::new(all));
            s.left_to_take = self.world;
            s.arrived = 0;
            self.changed.notify_all();
        } else {
            while s.result.is_none() && s.aborted_by.is_none() {
                self.changed.wait(&mut s);
            }
            self.check(&s)?;
        }
        let all = s.result.clone().expect("set by the last rank to arrive");
        s.left_to_take -= 1;
        if s.left_to_take == 0 {
            s.result = None;
            self.changed.notify_all();
        }
        Ok(Arc::unwrap_or_clone(all))
    }

    /// Ends every exchange, present and future, with an error naming `rank`.
    pub(crate) fn abort(&self, rank: usize) {
        let mut s = self.state.lock();
        s.aborted_by.get_or_insert(rank);
        self.changed.notify_all();
    }

    fn check(&self, s: &State) -> Result<()> {
        match s.aborted_by {
            Some(rank) => Err(TensorError::InvalidArgument {
                op: "collective",
                message: format!(
                    "rank {rank} of this host group failed, so this collective cannot complete"
                ),
            }),
            None => Ok(()),
        }
    }
}
