//! Loading libnccl without ever panicking, its version, and NCCL errors as ours.

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys::{self, ncclResult_t};

use crate::CudaLibError;

/// Functions ferry calls, looked up once before the first call: a library without one of them
/// (NCCL older than 2.13) is reported as unusable instead of failing inside cudarc.
const REQUIRED: [&str; 14] = [
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommGetAsyncError",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclAllGather",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// Whether libnccl can be loaded and has every function ferry calls (NCCL 2.13 or later).
/// Checked once per process; every NCCL entry point returns [`CudaLibError::NoNccl`], naming
/// the cause and the fix, when it is false.
pub fn nccl_present() -> bool {
    availability().is_ok()
}

fn availability() -> &'static Result<(), String> {
    static AVAILABLE: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABLE.get_or_init(|| {
        // SAFETY: only tries to dlopen libnccl; calls nothing in it.
        if !unsafe { sys::is_culib_present() } {
            return Err(not_found_reason());
        }
        // SAFETY: the library loads (checked above), so this does not panic.
        let library = unsafe { sys::culib() };
        for name in REQUIRED {
            // SAFETY: looks the symbol up without calling it.
            if unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(format!(
                    "the libnccl found lacks {name} (NCCL older than 2.13?)"
                ));
            }
        }
        Ok(())
    })
}

/// Why cudarc's loader found nothing: names the `libnccl.so.2` that the loader does not look
/// for, where the system has one.
fn not_found_reason() -> String {
    #[cfg(target_os = "linux")]
    if let Some(path) = soname_path() {
        return format!(
            "only {path} was found, and the loader opens libnccl.so (not libnccl.so.2)"
        );
    }
    "libnccl.so was not found on the library path".to_string()
}

/// The path of a `libnccl.so.2` the dynamic loader can open, if any.
#[cfg(target_os = "linux")]
fn soname_path() -> Option<String> {
    // SAFETY: dlopen/dlsym/dladdr/dlclose on a library that is only inspected, never called;
    // every pointer is checked before use and the handle is closed.
    unsafe {
        let handle = libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let symbol = libc::dlsym(handle, c"ncclGetVersion".as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        let path = if !symbol.is_null()
            && libc::dladdr(symbol, &mut info) != 0
            && !info.dli_fname.is_null()
        {
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned()
        } else {
            "libnccl.so.2".to_string()
        };
        libc::dlclose(handle);
        Some(path)
    }
}

/// Returns [`CudaLibError::NoNccl`] unless NCCL can be called.
pub(super) fn ensure_nccl() -> Result<(), CudaLibError> {
    availability()
        .clone()
        .map_err(|reason| CudaLibError::NoNccl { reason })
}

/// The loaded NCCL's version as (major, minor, patch), e.g. (2, 28, 3).
pub fn nccl_version() -> Result<(u32, u32, u32), CudaLibError> {
    ensure_nccl()?;
    let mut code: c_int = 0;
    // SAFETY: NCCL is loaded; `code` is a valid out-pointer.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut code) })?;
    Ok(decode_version(code))
}

/// NCCL encodes 2.9 and later as major * 10000 + minor * 100 + patch, earlier releases as
/// major * 1000 + minor * 100 + patch.
fn decode_version(code: c_int) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// Turns an NCCL status into a result, naming the call.
pub(super) fn check(call: &'static str, status: ncclResult_t) -> Result<(), CudaLibError> {
    status.result().map(drop).map_err(nccl_error(call))
}

/// Turns an NCCL error into ours, with NCCL's description and its last-error detail.
fn nccl_error(call: &'static str) -> impl FnOnce(NcclError) -> CudaLibError {
    move |error| CudaLibError::Nccl {
        call,
        message: describe(error.0),
    }
}

fn describe(status: ncclResult_t) -> String {
    // SAFETY: NCCL is loaded (an NCCL call just returned this status); both functions return
    // static strings or null, read before any other NCCL call.
    let (text, last) = unsafe {
        (
            c_text(sys::ncclGetErrorString(status)),
            c_text(sys::ncclGetLastError(std::ptr::null_mut())),
        )
    };
    let text = if text.is_empty() {
        format!("{status:?}")
    } else {
        text
    };
    if last.is_empty() {
        text
    } else {
        format!("{text} ({last})")
    }
}

/// # Safety
/// `ptr` is null or a NUL-terminated string that lives through the call.
unsafe fn c_text(ptr: *const c_char) -> String {
    if ptr.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated (the caller's promise).
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .trim()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::{Communicator, UniqueId, group};

    #[test]
    fn versions_decode_in_both_encodings() {
        assert_eq!(decode_version(22_803), (2, 28, 3));
        assert_eq!(decode_version(2_708), (2, 7, 8));
        assert_eq!(decode_version(-1), (0, 0, 0));
    }

    #[test]
    fn without_nccl_every_entry_point_is_an_error_naming_libnccl() {
        if nccl_present() {
            let (major, _, _) = nccl_version().unwrap();
            assert!(major >= 2);
            return;
        }
        for err in [
            nccl_version().unwrap_err(),
            UniqueId::new().unwrap_err(),
            Communicator::for_devices(&[]).unwrap_err(),
            group(|| Ok(())).unwrap_err(),
        ] {
            assert!(matches!(err, CudaLibError::NoNccl { .. }), "{err}");
            assert!(err.to_string().contains("libnccl"), "{err}");
            assert!(err.to_string().contains("LD_LIBRARY_PATH"), "{err}");
        }
        // Nothing was left half-started on this thread.
        assert_eq!(crate::nccl::grouped::depth(), 0);
    }
}
