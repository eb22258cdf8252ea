//! [`ProcessGroup`]: one rank's collectives on tensors, over NCCL (GPU tensors) or between
//! threads of this process (CPU tensors).

use std::sync::Arc;

use ferry_cuda::{Communicator, ReduceOp, UniqueId};
use ferry_memory::cuda::{CudaDevice, Stream};
use ferry_tensor::{Buffer, Device, Result, Tensor, TensorError};
use parking_lot::Mutex;

use super::host::Rendezvous;

/// One rank of a group of replicas: its rank, the group's size, its device, and collectives
/// over tensors of that device. Collectives change the tensor in place (its storage counts the
/// write, like any in-place update) and record nothing in the graph; every rank must call the
/// same collectives in the same order with tensors of the same shape and dtype.
///
/// On the GPU, collectives are queued on the group's own stream and return at once, ordered
/// like ferry's copies: they wait on the device for the work already queued where the tensor
/// was produced, and later work on the tensor waits for them. On the host ([`ProcessGroup::host`])
/// each collective returns once every rank has joined it.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    backend: Backend,
}

enum Backend {
    Nccl {
        comm: Mutex<Communicator>,
        stream: Stream,
    },
    Host(Arc<Rendezvous>),
}

/// Releases the host ranks waiting in a collective when one rank fails (see
/// [`super::run_replicas`]).
pub(crate) struct AbortHandle(Option<Arc<Rendezvous>>);

impl AbortHandle {
    pub(crate) fn abort(&self, rank: usize) {
        if let Some(r) = &self.0 {
            r.abort(rank);
        }
    }
}

impl ProcessGroup {
    /// One rank per GPU of this process, rank `i` on `devices[i]`, over NCCL. Drive each rank
    /// from its own thread ([`super::run_replicas`]). The devices must be distinct CUDA devices.
    pub fn nccl(devices: &[Device]) -> Result<Vec<ProcessGroup>> {
        let cuda = devices
            .iter()
            .map(|&d| cuda_device("ProcessGroup::nccl", d))
            .collect::<Result<Vec<_>>>()?;
        let comms = Communicator::for_devices(&cuda)?;
        comms
            .into_iter()
            .zip(&cuda)
            .map(|(comm, dev)| Self::from_communicator(comm, dev))
            .collect()
    }

    /// This process's rank in a group of `world_size` processes (one per GPU, on one host or
    /// several), over NCCL: rank 0 makes a [`UniqueId`] and hands its bytes to the others
    /// (a file, a socket, the launcher's store); every rank calls this with the same id.
    pub fn nccl_rank(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        device: Device,
    ) -> Result<ProcessGroup> {
        let dev = cuda_device("ProcessGroup::nccl_rank", device)?;
        let comm = Communicator::for_rank(id, rank, world_size, &dev)?;
        Self::from_communicator(comm, &dev)
    }

    fn from_communicator(comm: Communicator, dev: &CudaDevice) -> Result<ProcessGroup> {
        Ok(ProcessGroup {
            rank: comm.rank(),
            world_size: comm.world_size(),
            backend: Backend::Nccl {
                comm: Mutex::new(comm),
                stream: dev.new_stream()?,
            },
        })
    }

    /// `world_size` ranks that are threads of this process, over CPU tensors: the same
    /// data-parallel code runs without a GPU (tests, CI, learning). Each collective returns
    /// when every rank has joined it. Hand one group to each thread ([`super::run_replicas`]).
    pub fn host(world_size: usize) -> Vec<ProcessGroup> {
        let shared = Arc::new(Rendezvous::new(world_size.max(1)));
        (0..world_size.max(1))
            .map(|rank| ProcessGroup {
                rank,
                world_size: world_size.max(1),
                backend: Backend::Host(Arc::clone(&shared)),
            })
            .collect()
    }

    /// This rank, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the group has.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Where this rank's tensors live.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Nccl { comm, .. } => comm.lock().device().device(),
            Backend::Host(_) => Device::Cpu,
        }
    }

    /// The stream the group's GPU collectives run on (`None` on the host).
    pub fn stream(&self) -> Option<&Stream> {
        match &self.backend {
            Backend::Nccl { stream, .. } => Some(stream),
            Backend::Host(_) => None,
        }
    }

    pub(crate) fn abort_handle(&self) -> AbortHandle {
        match &self.backend {
            Backend::Nccl { .. } => AbortHandle(None),
            Backend::Host(r) => AbortHandle(Some(Arc::clone(r))),
        }
    }

    /// Combines `t` across the ranks with `op`, in place: afterwards every rank holds the
    /// result. `t` must be contiguous and on this rank's device.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.check("all_reduce", t)?;
        match &self.backend {
            Backend::Nccl { comm, stream } => {
                let offset = t.layout().offset() * t.dtype().size();
                let mut guard = t.storage().write();
                let buf = device_buffer("all_reduce", &mut guard, t.device())?;
                comm.lock()
                    .all_reduce_region(buf, offset, t.nbytes(), t.dtype(), op, stream)?;
                Ok(())
            }
            Backend::Host(r) => {
                let all = r.exchange(self.rank, t.to_vec_f64()?)?;
                let reduced = reduce_host(&all, op);
                write_host(t, reduced)
            }
        }
    }

    /// Rank `root`'s `t` into every rank's `t`, in place.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.check("broadcast", t)?;
        if root >= self.world_size {
            return Err(TensorError::InvalidArgument {
                op: "broadcast",
                message: format!(
                    "root {root} is not a rank of this group of {}; pass a rank below it",
                    self.world_size
                ),
            });
        }
        match &self.backend {
            Backend::Nccl { comm, stream } => {
                if t.layout().offset() != 0 || t.nbytes() != t.storage().bytes() {
                    // NCCL broadcasts whole buffers: go through a whole copy.
                    let whole = t.detach().copy()?;
                    self.broadcast(&whole, root)?;
                    return ferry_tensor::with_no_grad(|| t.detach().assign(&whole));
                }
                let mut guard = t.storage().write();
                let buf = device_buffer("broadcast", &mut guard, t.device())?;
                comm.lock().broadcast(buf, t.dtype(), root, stream)?;
                Ok(())
            }
            Backend::Host(r) => {
                let mut all = r.exchange(self.rank, t.to_vec_f64()?)?;
                write_host(t, std::mem::take(&mut all[root]))
            }
        }
    }

    /// Every rank's `t`, concatenated along a new first axis in rank order: shape
    /// `[world_size, ..t.shape()]`.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.check("all_gather", t)?;
        let mut shape = vec![self.world_size];
        shape.extend_from_slice(t.shape());
        match &self.backend {
            Backend::Nccl { comm, stream } => {
                let src = if t.layout().offset() != 0 || t.nbytes() != t.storage().bytes() {
                    t.detach().copy()?
                } else {
                    t.detach()
                };
                let out = Tensor::zeros(&shape, t.dtype(), t.device())?;
                {
                    let from = src.storage().read();
                    let Buffer::Cuda(from) = &*from else {
                        return Err(not_on_gpu("all_gather", t.device()));
                    };
                    let mut guard = out.storage().write();
                    let to = device_buffer("all_gather", &mut guard, t.device())?;
                    comm.lock().all_gather(from, to, t.dtype(), stream)?;
                }
                Ok(out)
            }
            Backend::Host(r) => {
                let all = r.exchange(self.rank, t.to_vec_f64()?)?;
                let flat: Vec<f64> = all.iter().flatten().copied().collect();
                Tensor::from_vec(flat, &shape)?.to_dtype(t.dtype())
            }
        }
    }

    /// Returns once every rank has called it (on the GPU: once this rank's queued collectives
    /// have finished, which needs every rank).
    pub fn barrier(&self) -> Result<()> {
        match &self.backend {
            Backend::Nccl { .. } => {
                let one = Tensor::zeros(&[1], ferry_tensor::DType::F32, self.device())?;
                self.all_reduce(&one, ReduceOp::Sum)?;
                self.synchronize()
            }
            Backend::Host(r) => r.exchange(self.rank, Vec::new()).map(drop),
        }
    }

    /// Waits on the host for this rank's queued collectives.
    pub fn synchronize(&self) -> Result<()> {
        if let Backend::Nccl { stream, .. } = &self.backend {
            stream.synchronize()?;
        }
        Ok(())
    }

    fn check(&self, op: &'static str, t: &Tensor) -> Result<()> {
        let device = self.device();
        if t.device() != device {
            return Err(TensorError::InvalidArgument {
                op,
                message: format!(
                    "rank {} of this group works on {device} but the tensor is on {}; move it \
                     there first (`.to({device:?})`)",
                    self.rank,
                    t.device()
                ),
            });
        }
        if !t.is_contiguous() {
            return Err(TensorError::InvalidArgument {
                op,
                message: "the tensor is not contiguous; pass `.contiguous()?` of it".into(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device())
            .finish()
    }
}

fn cuda_device(op: &'static str, device: Device) -> Result<CudaDevice> {
    match device {
        Device::Cuda(ordinal) => Ok(CudaDevice::get(ordinal)?),
        Device::Cpu => Err(TensorError::InvalidArgument {
            op,
            message: "NCCL groups run on CUDA devices; use ProcessGroup::host for CPU replicas"
                .into(),
        }),
    }
}

fn not_on_gpu(op: &'static str, device: Device) -> TensorError {
    TensorError::UnsupportedDevice { op, device }
}

fn device_buffer<'a>(
    op: &'static str,
    guard: &'a mut Buffer,
    device: Device,
) -> Result<&'a mut ferry_memory::cuda::DeviceBuffer> {
    match guard {
        Buffer::Cuda(buf) => Ok(buf),
        _ => Err(not_on_gpu(op, device)),
    }
}

fn reduce_host(all: &[Vec<f64>], op: ReduceOp) -> Vec<f64> {
    let n = all.first().map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            let values = all.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => values.sum(),
                ReduceOp::Prod => values.product(),
                ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => values.fold(f64::INFINITY, f64::min),
                ReduceOp::Avg => values.sum::<f64>() / all.len() as f64,
            }
        })
        .collect()
}

/// Writes `values` into the host tensor `t` in place (its dtype kept).
fn write_host(t: &Tensor, values: Vec<f64>) -> Result<()> {
    if values.len() != t.numel() {
        return Err(TensorError::InvalidArgument {
            op: "collective",
            message: format!(
                "the ranks passed tensors of different sizes ({} and {} elements); every rank \
                 must pass the same shape",
                values.len(),
                t.numel()
            ),
        });
    }
    let src = Tensor::from_vec(values, t.shape())?.to_dtype(t.dtype())?;
    ferry_tensor::with_no_grad(|| t.detach().assign(&src))
}
