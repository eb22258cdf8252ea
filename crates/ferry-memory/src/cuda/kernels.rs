//! CUDA C kernel modules: compiled by NVRTC once per device for that device's architecture,
//! loaded, and cached; looked up by a `&'static KernelModule` and a function name.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaFunction as RawFunction, CudaModule};
use cudarc::nvrtc::{self, CompileError, CompileOptions, Ptx};
use parking_lot::RwLock;

use super::device::CudaDevice;
use crate::{Device, MemoryError};

/// A CUDA C source compiled as one unit (one `.cu` file of an op family, usually embedded with
/// `include_str!`). Declare kernels `extern "C"` so they are found by their plain names.
#[derive(Debug)]
pub struct KernelModule {
    /// Short name, used in errors and as the NVRTC program name.
    pub name: &'static str,
    /// The CUDA C source.
    pub source: &'static str,
}

/// A kernel loaded on one device, ready for [`CudaDevice::launch`].
#[derive(Clone)]
pub struct CudaFunction {
    pub(crate) raw: RawFunction,
    pub(crate) device: Device,
    pub(crate) module: &'static str,
    pub(crate) name: &'static str,
}

impl CudaFunction {
    /// The kernel's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The module it came from.
    pub fn module(&self) -> &'static str {
        self.module
    }

    /// The device it is loaded on.
    pub fn device(&self) -> Device {
        self.device
    }
}

impl fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaFunction({}::{} on {})",
            self.module, self.name, self.device
        )
    }
}

/// Loaded modules and looked-up functions of one device, keyed by the module's address (each
/// `static KernelModule` is one module) and the function name.
#[derive(Default)]
struct KernelCache {
    /// Per module, the slot its first user compiles and loads it into. Compiling (NVRTC, tens
    /// to hundreds of ms) holds only that module's slot, so threads after other kernels, or
    /// after functions already found, never wait for it.
    modules: HashMap<usize, Arc<parking_lot::Mutex<Option<Arc<CudaModule>>>>>,
    functions: HashMap<(usize, &'static str), CudaFunction>,
}

/// A device's kernels: the cache, and the time spent compiling into it. Every launch looks its
/// function up, from any thread: a read lock, written only when a function is first found.
#[derive(Default)]
struct Kernels {
    cache: RwLock<KernelCache>,
    compile_nanos: AtomicU64,
}

/// Whether the NVRTC library can be loaded; never panics.
pub fn nvrtc_present() -> bool {
    // dlopen per call would rescan the library path; the answer cannot change in a process.
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libnvrtc; calls nothing in it.
    *PRESENT.get_or_init(|| unsafe { nvrtc::sys::is_culib_present() })
}

/// NVRTC's version as (major, minor), e.g. (13, 0); [`MemoryError::NoNvrtc`] without it.
pub fn nvrtc_version() -> Result<(i32, i32), MemoryError> {
    if !nvrtc_present() {
        return Err(MemoryError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both are valid out-pointers.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| MemoryError::Nvrtc {
            call: "nvrtcVersion",
            message: format!("{e:?}"),
        })?;
    Ok((major, minor))
}

/// Compiles `module` to PTX for `arch` (`compute_90`). Needs only NVRTC, no driver or GPU, so
/// CI can check every kernel source on a machine without one.
pub fn compile_ptx(module: &KernelModule, arch: &str) -> Result<String, MemoryError> {
    compile(module, arch).map(|ptx| ptx.to_src())
}

fn compile(module: &KernelModule, arch: &str) -> Result<Ptx, MemoryError> {
    if !nvrtc_present() {
        return Err(MemoryError::NoNvrtc);
    }
    let rejected = |log: &str| MemoryError::KernelCompile {
        module: module.name,
        arch: arch.to_string(),
        log: log.to_string(),
    };
    // cudarc turns these into C strings with `expect`: refuse them here instead of panicking.
    if module.source.contains('\0') || module.name.contains('\0') || arch.contains('\0') {
        return Err(rejected(
            "the source, module name or architecture contains a NUL byte",
        ));
    }
    let options = CompileOptions {
        name: Some(format!("{}.cu", module.name)),
        // Through `options`, not `arch`, which wants a `&'static str`.
        options: vec![format!("--gpu-architecture={arch}")],
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(module.source, options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => rejected(&log.to_string_lossy()),
        CompileError::CreationError(e) => MemoryError::Nvrtc {
            call: "nvrtcCreateProgram",
            message: format!("{e:?}"),
        },
        CompileError::GetLogError(e) => MemoryError::Nvrtc {
            call: "nvrtcGetProgramLog",
            message: format!("{e:?}"),
        },
        CompileError::GetPtxError(e) => MemoryError::Nvrtc {
            call: "nvrtcGetPTX",
            message: format!("{e:?}"),
        },
        CompileError::DestroyError(e) => MemoryError::Nvrtc {
            call: "nvrtcDestroyProgram",
            message: format!("{e:?}"),
        },
    })
}

/// The NVRTC virtual architecture for a compute capability: (9, 0) -> `compute_90`.
pub(crate) fn arch_for(capability: (i32, i32)) -> String {
    format!("compute_{}{}", capability.0, capability.1)
}

impl CudaDevice {
    /// The kernel `function` of `module`, compiling and loading the module on first use on this
    /// device (for its own architecture). A compile failure carries NVRTC's log.
    pub fn function(
        &self,
        module: &'static KernelModule,
        function: &'static str,
    ) -> Result<CudaFunction, MemoryError> {
        self.check()?;
        let kernels = self.local::<Kernels>();
        let key = module as *const KernelModule as usize;
        if let Some(found) = kernels.cache.read().functions.get(&(key, function)) {
            return Ok(found.clone());
        }
        // Two threads asking for a new module compile it once: the second waits on its slot.
        let slot = Arc::clone(kernels.cache.write().modules.entry(key).or_default());
        let loaded =
            {
                let mut slot = slot.lock();
                match &*slot {
                    Some(loaded) => Arc::clone(loaded),
                    None => {
                        let started = Instant::now();
                        let ptx = compile(module, &arch_for(self.info().compute_capability));
                        let nanos = started.elapsed().as_nanos().min(u64::MAX as u128) as u64;
                        kernels.compile_nanos.fetch_add(nanos, Ordering::Relaxed);
                        let loaded = self.inner.ctx.load_module(ptx?).map_err(|e| {
                            MemoryError::KernelLoad {
                                module: module.name,
                                message: e.to_string(),
                            }
                        })?;
                        *slot = Some(Arc::clone(&loaded));
                        loaded
                    }
                }
            };
        if function.contains('\0') {
            return Err(MemoryError::KernelNotFound {
                module: module.name,
                function,
            });
        }
        let raw = loaded.load_function(function).map_err(|e| match e.0 {
            CUresult::CUDA_ERROR_NOT_FOUND => MemoryError::KernelNotFound {
                module: module.name,
                function,
            },
            _ => MemoryError::KernelLoad {
                module: module.name,
                message: e.to_string(),
            },
        })?;
        let found = CudaFunction {
            raw,
            device: self.device(),
            module: module.name,
            name: function,
        };
        kernels
            .cache
            .write()
            .functions
            .insert((key, function), found.clone());
        Ok(found)
    }

    /// Total time NVRTC has spent compiling kernel modules for this device.
    pub fn compile_time(&self) -> Duration {
        Duration::from_nanos(
            self.local::<Kernels>()
                .compile_nanos
                .load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static FILL: KernelModule = KernelModule {
        name: "fill",
        source: r#"extern "C" __global__ void fill(float *out, float value, unsigned int n) {
            unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = value;
        }"#,
    };

    #[test]
    fn architecture_names_follow_compute_capability() {
        assert_eq!(arch_for((9, 0)), "compute_90");
        assert_eq!(arch_for((12, 0)), "compute_120");
    }

    #[test]
    fn compiling_needs_only_nvrtc_and_failures_carry_the_log() {
        if !nvrtc_present() {
            let err = compile_ptx(&FILL, "compute_90").unwrap_err();
            assert!(matches!(err, MemoryError::NoNvrtc), "{err}");
            assert!(err.to_string().contains("pip install"), "{err}");
            assert!(matches!(nvrtc_version(), Err(MemoryError::NoNvrtc)));
            return;
        }
        assert!(nvrtc_version().unwrap().0 >= 11);
        let ptx = compile_ptx(&FILL, "compute_80").unwrap();
        assert!(ptx.contains(".entry fill"), "{ptx}");
        assert!(
            ptx.contains(".target sm_80"),
            "compiled for the architecture asked for"
        );
        static BROKEN: KernelModule = KernelModule {
            name: "broken",
            source: "extern \"C\" __global__ void f() { undeclared = 1; }",
        };
        match compile_ptx(&BROKEN, "compute_80") {
            Err(err @ MemoryError::KernelCompile { .. }) => {
                let text = err.to_string();
                assert!(
                    text.contains("`broken`") && text.contains("undeclared"),
                    "{text}"
                );
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
        static NUL: KernelModule = KernelModule {
            name: "nul",
            source: "\0",
        };
        assert!(matches!(
            compile_ptx(&NUL, "compute_80"),
            Err(MemoryError::KernelCompile { .. })
        ));
    }
}
