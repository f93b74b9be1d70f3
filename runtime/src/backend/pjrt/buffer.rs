//! Arrays on the device: upload, download, ownership.

use std::ffi::c_void;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::tree::{Array, ArrayData, DType, LeafType};

use super::client::ClientInner;
use super::ffi::{self, buffer_type, names, RawBuffer};

/// The `PJRT_Buffer_Type` of a dtype.
pub(crate) fn pjrt_type(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => buffer_type::F32,
        DType::F64 => buffer_type::F64,
        DType::I32 => buffer_type::S32,
        DType::I64 => buffer_type::S64,
        DType::U8 => buffer_type::U8,
        DType::Bool => buffer_type::PRED,
        DType::U32 => buffer_type::U32,
        DType::BF16 => buffer_type::BF16,
        DType::F16 => buffer_type::F16,
    }
}

/// The dtype of a `PJRT_Buffer_Type`, when nitro arrays can hold it.
pub(crate) fn dtype_of(t: i32) -> Option<DType> {
    DType::ALL.into_iter().find(|d| pjrt_type(*d) == t)
}

/// An array that lives on a PJRT device, owned by Rust: dropping it destroys the PJRT buffer.
///
/// Made by [`Client::upload`](super::Client::upload) or returned by an execute. It stays on the
/// device between executes; [`to_host`](DeviceBuffer::to_host) copies it back. Its dtype and dims
/// are known on the Rust side, so an execute checks them before calling XLA (which checks only byte
/// sizes). To let a program reuse (donate) a buffer, pass it **by value** to
/// [`Executable::execute_donating`](super::Executable::execute_donating): a donated buffer is
/// consumed, so it cannot be read afterwards.
pub struct DeviceBuffer {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut RawBuffer,
    ty: LeafType,
    /// The index of its device among the client's addressable devices.
    pub(crate) device: usize,
}

// SAFETY: a PJRT buffer may be used and destroyed from any thread (PjRtBuffer is thread-safe, and
// the C API adds no thread affinity); `DeviceBuffer` owns its pointer exclusively, and `&self`
// methods only read the buffer (copy to host, query deletion).
unsafe impl Send for DeviceBuffer {}
// SAFETY: see `Send`: shared references only issue read-only, thread-safe PJRT calls.
unsafe impl Sync for DeviceBuffer {}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({})", self.ty)
    }
}

impl DeviceBuffer {
    /// Takes ownership of a buffer the plugin returned, on the client's device `device`.
    pub(crate) fn from_raw(
        client: Arc<ClientInner>,
        raw: *mut RawBuffer,
        ty: LeafType,
        device: usize,
    ) -> Self {
        DeviceBuffer {
            client,
            raw,
            ty,
            device,
        }
    }

    /// Uploads an array to the client's device `device` (an index the caller checked).
    pub(crate) fn upload(
        client: &Arc<ClientInner>,
        array: &Array,
        device: usize,
    ) -> Result<DeviceBuffer> {
        let plugin = client.plugin;
        let f = plugin.func(
            plugin.api.fns.client_buffer_from_host,
            names::client_buffer_from_host,
        )?;
        let ty = array.leaf_type();
        let dims: Vec<i64> = ty.dims.iter().map(|&d| d as i64).collect();
        // Bools are one byte per element (0 or 1) both in Rust and in PJRT's PRED; half floats
        // go as their bit patterns.
        let bools: Vec<u8>;
        let halves: Vec<u16>;
        let bytes: &[u8] = match array.data() {
            ArrayData::F32(v) => bytemuck::cast_slice(v),
            ArrayData::F64(v) => bytemuck::cast_slice(v),
            ArrayData::I32(v) => bytemuck::cast_slice(v),
            ArrayData::I64(v) => bytemuck::cast_slice(v),
            ArrayData::U8(v) => v,
            ArrayData::U32(v) => bytemuck::cast_slice(v),
            ArrayData::BF16(v) => {
                halves = v.iter().map(|x| x.to_bits()).collect();
                bytemuck::cast_slice(&halves)
            }
            ArrayData::F16(v) => {
                halves = v.iter().map(|x| x.to_bits()).collect();
                bytemuck::cast_slice(&halves)
            }
            ArrayData::Bool(v) => {
                bools = v.iter().map(|&b| u8::from(b)).collect();
                &bools
            }
        };
        // A zero-element array still needs a non-null data pointer.
        static EMPTY: [u64; 1] = [0];
        let data: *const c_void = if bytes.is_empty() {
            EMPTY.as_ptr().cast()
        } else {
            bytes.as_ptr().cast()
        };
        let mut a = ffi::BufferFromHostArgs::new();
        a.client = client.raw;
        a.data = data;
        a.type_ = pjrt_type(ty.dtype);
        a.dims = if dims.is_empty() {
            std::ptr::null()
        } else {
            dims.as_ptr()
        };
        a.num_dims = dims.len();
        a.host_buffer_semantics = ffi::IMMUTABLE_ONLY_DURING_CALL;
        a.device = client.devices.get(device).copied().unwrap_or(client.device);
        // SAFETY: `a` is a valid `PJRT_Client_BufferFromHostBuffer_Args`: the client and device
        // are live (held by `client`), `data` points to `bytes.len()` bytes laid out densely,
        // row-major, of the declared type and dims (an `Array` guarantees the length), and `dims`
        // outlives the call. With kImmutableOnlyDuringCall the plugin copies before returning.
        let result = unsafe { plugin.api.check(names::client_buffer_from_host, f(&mut a)) };
        result?;
        let buffer = DeviceBuffer::from_raw(client.clone(), a.buffer, ty, device);
        // SAFETY: the event (possibly null) was just returned to us, and is awaited and destroyed
        // once; `bytes` and `dims` are still alive.
        unsafe {
            plugin
                .api
                .await_event(names::client_buffer_from_host, a.done_with_host_buffer)
        }?;
        Ok(buffer)
    }

    /// The index of the device it lives on, among its client's devices.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The dtype and dims.
    pub fn leaf_type(&self) -> &LeafType {
        &self.ty
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// The dims (empty for a scalar).
    pub fn dims(&self) -> &[usize] {
        &self.ty.dims
    }

    /// Copies the buffer back to the host (waits for the computation that produces it).
    pub fn to_host(&self) -> Result<Array> {
        let plugin = self.client.plugin;
        let f = plugin.func(plugin.api.fns.buffer_to_host, names::buffer_to_host)?;
        // Checked: a declared output type over the size limit is refused, never wrapped.
        let want = self
            .ty
            .size_bytes()
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| Error::ShapeTooLarge {
                ty: self.ty.clone(),
            })?;
        let mut q = ffi::BufferToHostArgs::new();
        q.src = self.raw;
        // SAFETY: `q` is a valid `PJRT_Buffer_ToHostBuffer_Args` with a null `dst`: the plugin
        // only reports the size it needs; the buffer is live (owned by `self`).
        unsafe { plugin.api.check(names::buffer_to_host, f(&mut q)) }?;
        if q.dst_size != want {
            return Err(Error::ProgramSignature {
                what: format!(
                    "returned a buffer of {} bytes where {} needs {want}",
                    q.dst_size, self.ty
                ),
            });
        }
        // The host copy is allocated fallibly (`Error::OutOfMemory`, never an abort); `bool`
        // elements arrive as bytes.
        let dims = &self.ty.dims;
        let host = match self.ty.dtype {
            DType::Bool => DType::U8,
            dtype => dtype,
        };
        let data = match Array::try_zeros(host, dims)?.into_parts().1 {
            ArrayData::F32(v) => ArrayData::F32(self.copy_into(v)?),
            ArrayData::F64(v) => ArrayData::F64(self.copy_into(v)?),
            ArrayData::I32(v) => ArrayData::I32(self.copy_into(v)?),
            ArrayData::I64(v) => ArrayData::I64(self.copy_into(v)?),
            ArrayData::U8(v) if self.ty.dtype == DType::Bool => {
                // Collected in place (same size and alignment): no second allocation.
                ArrayData::Bool(self.copy_into(v)?.into_iter().map(|b| b != 0).collect())
            }
            ArrayData::U8(v) => ArrayData::U8(self.copy_into(v)?),
            ArrayData::U32(v) => ArrayData::U32(self.copy_into(v)?),
            ArrayData::BF16(v) => {
                let bits = self.copy_into(vec![0u16; v.len()])?;
                ArrayData::BF16(bits.into_iter().map(half::bf16::from_bits).collect())
            }
            ArrayData::F16(v) => {
                let bits = self.copy_into(vec![0u16; v.len()])?;
                ArrayData::F16(bits.into_iter().map(half::f16::from_bits).collect())
            }
            ArrayData::Bool(v) => ArrayData::Bool(v),
        };
        Array::from_data(&self.ty.dims, data)
    }

    /// Copies the buffer's bytes into `dst` (already of the right length) and waits: read
    /// straight from its memory when that is host memory ([`read_host_memory`]), else through
    /// `PJRT_Buffer_ToHostBuffer`.
    ///
    /// [`read_host_memory`]: DeviceBuffer::read_host_memory
    fn copy_into<T: bytemuck::Pod>(&self, mut dst: Vec<T>) -> Result<Vec<T>> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut dst);
        if bytes.is_empty() {
            return Ok(dst);
        }
        if self.read_host_memory(bytes)? {
            return Ok(dst);
        }
        let plugin = self.client.plugin;
        let f = plugin.func(plugin.api.fns.buffer_to_host, names::buffer_to_host)?;
        let mut a = ffi::BufferToHostArgs::new();
        a.src = self.raw;
        a.dst = bytes.as_mut_ptr().cast();
        a.dst_size = bytes.len();
        // SAFETY: `a` is valid: the buffer is live, `dst` points to `dst_size` writable bytes
        // (exactly the size the plugin reported), which stay alive and untouched until the event
        // below has been awaited.
        unsafe { plugin.api.check(names::buffer_to_host, f(&mut a)) }?;
        // SAFETY: the event was just returned to us; awaited and destroyed once, before `dst` is
        // read or freed.
        unsafe { plugin.api.await_event(names::buffer_to_host, a.event) }?;
        Ok(dst)
    }

    /// Copies the buffer into `dst` straight from its memory, once it is defined, when that
    /// memory is host memory (a CPU plugin's devices: `PJRT_Buffer_IsOnCpu`) holding exactly
    /// `dst.len()` bytes; `Ok(false)` (nothing copied) when it is not, or when the plugin lacks
    /// a call this needs. An error of the computation that defines the buffer is returned.
    ///
    /// Why not `PJRT_Buffer_ToHostBuffer`: the CPU plugin runs that copy as a task on the
    /// client's thread pool, the pool the devices' computations run on, so a copy asked for
    /// while steps are enqueued waits behind one — a whole step for a few bytes, every time
    /// (what stalled background saves). Here the buffer's ready event is awaited (it waits
    /// for the definition only, on this thread) and the bytes are copied on this thread.
    fn read_host_memory(&self, dst: &mut [u8]) -> Result<bool> {
        let plugin = self.client.plugin;
        let fns = &plugin.api.fns;
        let (Some(on_cpu), Some(size), Some(ready), Some(pointer)) = (
            fns.buffer_is_on_cpu,
            fns.buffer_on_device_size,
            fns.buffer_ready_event,
            fns.buffer_unsafe_pointer,
        ) else {
            return Ok(false);
        };
        let mut c = ffi::BufferIsOnCpuArgs::new();
        c.buffer = self.raw;
        // SAFETY: `c` is a valid `PJRT_Buffer_IsOnCpu_Args` for a live buffer (owned by `self`).
        if unsafe { plugin.api.check(names::buffer_is_on_cpu, on_cpu(&mut c)) }.is_err()
            || c.is_on_cpu == 0
        {
            return Ok(false);
        }
        let mut s = ffi::BufferOnDeviceSizeArgs::new();
        s.buffer = self.raw;
        // SAFETY: `s` is a valid `PJRT_Buffer_OnDeviceSizeInBytes_Args` for a live buffer.
        if unsafe { plugin.api.check(names::buffer_on_device_size, size(&mut s)) }.is_err()
            || s.on_device_size_in_bytes != dst.len()
        {
            return Ok(false);
        }
        let mut r = ffi::BufferReadyEventArgs::new();
        r.buffer = self.raw;
        // SAFETY: `r` is a valid `PJRT_Buffer_ReadyEvent_Args` for a live buffer.
        unsafe { plugin.api.check(names::buffer_ready_event, ready(&mut r)) }?;
        // SAFETY: the event was just returned to us; awaited and destroyed once. Awaiting it
        // waits for the buffer's definition; its error is the defining computation's.
        unsafe { plugin.api.await_event(names::buffer_ready_event, r.event) }?;
        let mut p = ffi::BufferUnsafePointerArgs::new();
        p.buffer = self.raw;
        // SAFETY: `p` is a valid `PJRT_Buffer_UnsafePointer_Args` for a live buffer.
        unsafe {
            plugin
                .api
                .check(names::buffer_unsafe_pointer, pointer(&mut p))
        }?;
        let src = p.buffer_pointer as *const u8;
        if src.is_null() {
            return Ok(false);
        }
        // SAFETY: the buffer is on the CPU, so `src` is host memory of this process, and it
        // holds `dst.len()` bytes (its on-device size, checked above). It is defined (its ready
        // event was awaited) and stays alive and unwritten while this copies: `self` owns the
        // buffer and is borrowed, so it can be neither destroyed nor donated (a PJRT buffer is
        // written only by the computation that defines it, or by one it is donated to);
        // computations still enqueued may read it at the same time, which is sound. The CPU
        // plugin lays every buffer out densely in the default row-major order (what
        // `ToHostBuffer` copies out byte for byte without a host layout, and what leaf views
        // rely on too). `dst` is a distinct, writable slice of that length.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(true)
    }

    /// A buffer of type `ty` over this buffer's memory from element `offset` on, owning none of
    /// it: PJRT's `CreateViewOfDeviceBuffer` on the device pointer. No data moves. An error
    /// when the plugin lacks either call or refuses the view (a pointer not aligned as it
    /// requires, say): callers fall back to a copy.
    ///
    /// # Safety
    /// The view reads memory it does not own, and PJRT orders nothing between it and this
    /// buffer. The caller must (1) have waited for the computation that defines this buffer
    /// before the view is made; (2) order every execute that reads the view after any later
    /// write of that memory and before its reuse — by passing the buffer that owns the memory
    /// as an input of that execute too, or by waiting; and (3) never let an execute read the
    /// view once its memory belongs to no live buffer (this one, or an output an execute
    /// wrote in place of it by donation). `offset` plus `ty`'s elements must lie within this
    /// buffer, of its dtype (checked).
    pub(crate) unsafe fn view(&self, offset: usize, ty: LeafType) -> Result<DeviceBuffer> {
        let plugin = self.client.plugin;
        let inside = ty.dtype == self.ty.dtype
            && match (ty.element_count(), self.ty.element_count()) {
                (Some(n), Some(len)) => offset.checked_add(n).is_some_and(|end| end <= len),
                _ => false,
            };
        if !inside {
            return Err(Error::ProgramSignature {
                what: format!(
                    "a view of {} at element {offset} does not fit in a buffer of {}",
                    ty, self.ty
                ),
            });
        }
        let pointer = plugin.func(
            plugin.api.fns.buffer_unsafe_pointer,
            names::buffer_unsafe_pointer,
        )?;
        let create = plugin.func(plugin.api.fns.client_create_view, names::client_create_view)?;
        let mut p = ffi::BufferUnsafePointerArgs::new();
        p.buffer = self.raw;
        // SAFETY: `p` is a valid `PJRT_Buffer_UnsafePointer_Args` for a live buffer.
        unsafe {
            plugin
                .api
                .check(names::buffer_unsafe_pointer, pointer(&mut p))
        }?;
        let base = p.buffer_pointer as *mut u8;
        if base.is_null() {
            return Err(Error::Pjrt {
                call: names::buffer_unsafe_pointer,
                code: "nitro",
                message: "the plugin returned a null device pointer".into(),
            });
        }
        let dims: Vec<i64> = ty.dims.iter().map(|&d| d as i64).collect();
        let mut a = ffi::CreateViewArgs::new();
        a.client = self.client.raw;
        // In bounds (checked above), so the offset pointer stays within the buffer's memory.
        a.device_buffer_ptr = base.wrapping_add(offset * ty.dtype.size_bytes()).cast();
        a.dims = if dims.is_empty() {
            std::ptr::null()
        } else {
            dims.as_ptr()
        };
        a.num_dims = dims.len();
        a.element_type = pjrt_type(ty.dtype);
        a.device = self
            .client
            .devices
            .get(self.device)
            .copied()
            .unwrap_or(self.client.device);
        // The CPU plugin calls the callback unconditionally when the view goes (a null one
        // aborts the process with `bad_function_call`): give it one that does nothing.
        a.on_delete_callback = Some(view_released);
        // SAFETY: `a` is a valid `PJRT_Client_CreateViewOfDeviceBuffer_Args`: the client and
        // device are live, the pointer lies inside this live buffer with room for `ty` (checked),
        // `dims` outlives the call, the callback ignores its arguments, and there is no stream.
        // What the view may read later is this function's contract.
        unsafe { plugin.api.check(names::client_create_view, create(&mut a)) }?;
        Ok(DeviceBuffer::from_raw(
            self.client.clone(),
            a.buffer,
            ty,
            self.device,
        ))
    }

    /// Whether PJRT has deleted the buffer (a donated input is deleted by the execute that
    /// reused it). Errors when the plugin lacks `PJRT_Buffer_IsDeleted`.
    pub fn is_deleted(&self) -> Result<bool> {
        let plugin = self.client.plugin;
        let f = plugin.func(plugin.api.fns.buffer_is_deleted, names::buffer_is_deleted)?;
        let mut a = ffi::BufferIsDeletedArgs::new();
        a.buffer = self.raw;
        // SAFETY: `a` is a valid `PJRT_Buffer_IsDeleted_Args` for a live buffer.
        unsafe { plugin.api.check(names::buffer_is_deleted, f(&mut a)) }?;
        Ok(a.is_deleted != 0)
    }
}

/// The `on_delete_callback` of a view: the memory belongs to the viewed buffer, so nothing is
/// freed.
unsafe extern "C" fn view_released(_memory: *mut c_void, _user: *mut c_void) {}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let plugin = self.client.plugin;
        if let Some(f) = plugin.api.fns.buffer_destroy {
            let mut a = ffi::BufferDestroyArgs::new();
            a.buffer = self.raw;
            // SAFETY: `self` owns the buffer, which is destroyed exactly once, here; the client
            // is kept alive by `self.client` until after this call.
            if let Err(e) = unsafe { plugin.api.check(names::buffer_destroy, f(&mut a)) } {
                tracing::debug!("ignoring a failure to destroy a PJRT buffer: {e}");
            }
        }
    }
}
