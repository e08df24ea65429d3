//! The CUDA driver's own entry points, looked up in `libcuda` by name.
//!
//! An application may define `cuMemAllocAsync` and friends in its binary (routing's
//! `route_cuda_allocations!`), so a call through the linker could land in those definitions.
//! Everything here is resolved with `dlsym` on the driver library itself: forwarding an
//! allocation to the driver, the calls routing makes of its own (events for stream-ordered
//! reuse, the current context, capture status) and the CUDA backend's own device memory never
//! recurse into such hooks, whichever way cudarc links. Without a driver library (a machine
//! with no GPU) every lookup is absent.

use std::ffi::{c_uint, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUgraph, CUresult, CUstream, CUstreamCaptureMode,
    CUstreamCaptureStatus,
};

type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
type FreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
type Alloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type Free = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
type BeginCapture = unsafe extern "C" fn(CUstream, CUstreamCaptureMode) -> CUresult;
type EndCapture = unsafe extern "C" fn(CUstream, *mut CUgraph) -> CUresult;
type StreamDestroy = unsafe extern "C" fn(CUstream) -> CUresult;
type IsCapturing = unsafe extern "C" fn(CUstream, *mut CUstreamCaptureStatus) -> CUresult;
type CtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
type CtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
type CtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
type EventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
type EventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
type EventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
type EventSync = unsafe extern "C" fn(CUevent) -> CUresult;
type EventDestroy = unsafe extern "C" fn(CUevent) -> CUresult;
type StreamSync = unsafe extern "C" fn(CUstream) -> CUresult;
type CtxSync = unsafe extern "C" fn() -> CUresult;

/// The driver's own functions, resolved once.
pub(crate) struct Driver {
    pub(crate) mem_alloc_async: AllocAsync,
    pub(crate) mem_free_async: FreeAsync,
    pub(crate) mem_alloc: Alloc,
    pub(crate) mem_free: Free,
    pub(crate) stream_begin_capture: BeginCapture,
    pub(crate) stream_end_capture: EndCapture,
    pub(crate) stream_destroy: StreamDestroy,
    pub(crate) stream_is_capturing: IsCapturing,
    pub(crate) ctx_get_current: CtxGetCurrent,
    pub(crate) ctx_set_current: CtxSetCurrent,
    pub(crate) ctx_get_device: CtxGetDevice,
    pub(crate) event_create: EventCreate,
    pub(crate) event_record: EventRecord,
    pub(crate) event_query: EventQuery,
    pub(crate) event_synchronize: EventSync,
    pub(crate) event_destroy: EventDestroy,
    pub(crate) stream_synchronize: StreamSync,
    pub(crate) ctx_synchronize: CtxSync,
}

/// `CU_EVENT_DISABLE_TIMING`: fences need no timestamps, and untimed events are cheaper.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CU_STREAM_LEGACY`, as the driver's handle type.
pub(crate) const STREAM_LEGACY: usize = super::LEGACY_STREAM as usize;
/// `CU_STREAM_PER_THREAD`, as the driver's handle type.
pub(crate) const STREAM_PER_THREAD: usize = super::PER_THREAD_STREAM as usize;

/// The driver, or `None` where no CUDA driver library can be loaded.
pub(crate) fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref()
}

fn load() -> Option<Driver> {
    // SAFETY: dlopen with a constant, NUL-terminated name; RTLD_LOCAL keeps its symbols out of
    // the global namespace (it is loaded already when cudarc linked it, and then this only takes
    // another reference, which is never dropped).
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        tracing::debug!("no CUDA driver library: no driver entry points");
        return None;
    }
    let sym = |name: &CStr| -> Option<*mut c_void> {
        // SAFETY: `lib` is a live handle from dlopen; `name` is NUL-terminated.
        let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    macro_rules! get {
        ($name:literal as $ty:ty) => {{
            let p = sym($name)?;
            // SAFETY: the driver exports this symbol with exactly the signature of the type it
            // is cast to (cudarc's bindings of the same CUDA 13 header).
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
        }};
    }
    Some(Driver {
        mem_alloc_async: get!(c"cuMemAllocAsync" as AllocAsync),
        mem_free_async: get!(c"cuMemFreeAsync" as FreeAsync),
        mem_alloc: get!(c"cuMemAlloc_v2" as Alloc),
        mem_free: get!(c"cuMemFree_v2" as Free),
        stream_begin_capture: get!(c"cuStreamBeginCapture_v2" as BeginCapture),
        stream_end_capture: get!(c"cuStreamEndCapture" as EndCapture),
        stream_destroy: get!(c"cuStreamDestroy_v2" as StreamDestroy),
        stream_is_capturing: get!(c"cuStreamIsCapturing" as IsCapturing),
        ctx_get_current: get!(c"cuCtxGetCurrent" as CtxGetCurrent),
        ctx_set_current: get!(c"cuCtxSetCurrent" as CtxSetCurrent),
        ctx_get_device: get!(c"cuCtxGetDevice" as CtxGetDevice),
        event_create: get!(c"cuEventCreate" as EventCreate),
        event_record: get!(c"cuEventRecord" as EventRecord),
        event_query: get!(c"cuEventQuery" as EventQuery),
        event_synchronize: get!(c"cuEventSynchronize" as EventSync),
        event_destroy: get!(c"cuEventDestroy_v2" as EventDestroy),
        stream_synchronize: get!(c"cuStreamSynchronize" as StreamSync),
        ctx_synchronize: get!(c"cuCtxSynchronize" as CtxSync),
    })
}

/// The CUDA context current on this thread, if any.
pub(crate) fn current_context() -> Option<CUcontext> {
    let d = driver()?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the call only reads thread-local driver state.
    let r = unsafe { (d.ctx_get_current)(&mut ctx) };
    (r == CUresult::CUDA_SUCCESS && !ctx.is_null()).then_some(ctx)
}

/// The device of the context current on this thread.
pub(crate) fn current_device(d: &Driver) -> Option<i32> {
    let mut dev: CUdevice = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { (d.ctx_get_device)(&mut dev) };
    (r == CUresult::CUDA_SUCCESS).then_some(dev)
}

/// Whether work queued on `stream` now would be captured into a graph (or the capture it
/// belonged to was invalidated). The legacy stream is never captured and is not asked: asking
/// it while another thread captures in global mode would invalidate that capture.
pub(crate) fn stream_capturing(d: &Driver, stream: CUstream) -> bool {
    let h = stream as usize;
    if h == 0 || h == STREAM_LEGACY {
        return false;
    }
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is the handle the caller passed to the hooked driver call, valid for it.
    let r = unsafe { (d.stream_is_capturing)(stream, &mut status) };
    // An error here means the query itself is illegal now, which only happens during a capture.
    r != CUresult::CUDA_SUCCESS || status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}
