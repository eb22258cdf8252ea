//! ferry's side of `ferry bench pipeline`: the frames, the GPU and host work, one run of each row.

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::Instant;

use ferry::memory::cuda::{CudaDevice, Stream};
use ferry::{ChunkSpec, DeviceMove, pinned_block_size};
use ferry::{Device, Result, Tensor};

/// One frame: 1080 x 1920 RGB, f32.
pub(crate) const FRAME: [usize; 3] = [1080, 1920, 3];

pub(crate) struct Fixture {
    pub(crate) dev: CudaDevice,
    /// The input every frame is computed from, and a batch of `frames` of them.
    pub(crate) base: Tensor,
    pub(crate) batch_base: Tensor,
    pub(crate) copy: Stream,
    /// `depth` device frames the slots pipeline writes each frame into, in turn.
    pub(crate) slots: Vec<Tensor>,
    pub(crate) frames: usize,
    pub(crate) passes: u32,
    pub(crate) depth: usize,
}

/// Frame `i`: a few elementwise kernels over the base frame(s).
pub(crate) fn produce(base: &Tensor, i: usize) -> Result<Tensor> {
    base.mul_scalar(1.0 + i as f64 * 1e-3)?
        .add_scalar(0.1)?
        .tanh()?
        .mul_scalar(0.5)?
        .add_scalar(0.5)
}

/// The host's work on a frame: `passes` reductions of all of it.
pub(crate) fn process(frame: &Tensor, passes: u32) -> Result<f32> {
    let mut acc = 0.0;
    for _ in 0..passes {
        acc += frame.sum()?.to_vec::<f32>()?[0];
    }
    Ok(black_box(acc))
}

impl Fixture {
    fn ms_per_frame(&self, start: Instant) -> f64 {
        start.elapsed().as_secs_f64() * 1e3 / self.frames as f64
    }

    /// One run of `id`, in ms per frame.
    pub(crate) fn run(&self, id: &str) -> Result<f64> {
        self.dev.synchronize()?;
        match id {
            "gpu" => {
                let start = Instant::now();
                for i in 0..self.frames {
                    drop(produce(&self.base, i)?);
                }
                self.dev.synchronize()?;
                Ok(self.ms_per_frame(start))
            }
            "link" => {
                let frame = produce(&self.base, 0)?;
                self.dev.synchronize()?;
                let start = Instant::now();
                for _ in 0..self.frames {
                    drop(frame.to(Device::Cpu)?); // DMA into pooled pinned memory, waited for
                }
                Ok(self.ms_per_frame(start))
            }
            "host" => {
                let frame = produce(&self.base, 0)?.to(Device::Cpu)?;
                let start = Instant::now();
                for _ in 0..self.frames {
                    process(&frame, self.passes)?;
                }
                Ok(self.ms_per_frame(start))
            }
            "serial" => {
                let start = Instant::now();
                for i in 0..self.frames {
                    let host = produce(&self.base, i)?.to(Device::Cpu)?;
                    process(&host, self.passes)?;
                }
                Ok(self.ms_per_frame(start))
            }
            "pipelined" | "pipelined_slots" => {
                let start = Instant::now();
                let mut in_flight = VecDeque::with_capacity(self.depth);
                for i in 0..self.frames {
                    // Queued on the default stream; its move on the copy stream waits for it on
                    // the device, and the host goes on to the oldest frame meanwhile.
                    let frame = produce(&self.base, i)?;
                    let moved = if id == "pipelined" {
                        frame.to_async(Device::Cpu, &self.copy)?
                    } else {
                        // A slot outlives the run, so no buffer the copy stream reads is freed
                        // mid-run; writing it waits, on the device, for the move that last read it.
                        let slot = &self.slots[i % self.depth];
                        slot.assign(&frame)?;
                        slot.to_async(Device::Cpu, &self.copy)?
                    };
                    in_flight.push_back(moved);
                    if in_flight.len() == self.depth {
                        let (host, _) = in_flight.pop_front().expect("depth >= 2").wait()?;
                        process(&host, self.passes)?;
                    }
                }
                while let Some(pending) = in_flight.pop_front() {
                    process(&pending.wait()?.0, self.passes)?;
                }
                Ok(self.ms_per_frame(start))
            }
            "streamed" => {
                let start = Instant::now();
                let batch = produce(&self.batch_base, 0)?;
                // Two frames of staging: one frame per chunk, one travelling while the host
                // works on the other.
                let frame_bytes = FRAME.iter().product::<usize>() * 4;
                let spec = ChunkSpec::MaxStagingBytes(2 * pinned_block_size(frame_bytes));
                for chunk in batch.stream_to(Device::Cpu, spec)? {
                    process(chunk?.tensor(), self.passes)?;
                }
                Ok(self.ms_per_frame(start))
            }
            other => unreachable!("no case {other}"),
        }
    }
}
