//! The subset of the PJRT C API that nitro calls, declared by hand.
//!
//! Layouts follow `pjrt_c_api.h` at API version **0.81** (the header shipped in the
//! `xla-cpu-pjrt==0.0.1` wheel). Every argument struct starts with `struct_size`, which the caller
//! sets to the size *up to and including the last field of that header version* (the header's
//! `PJRT_STRUCT_SIZE(T, last_field)`, which can be smaller than `sizeof(T)` because of tail
//! padding). Newer plugins accept the 0.81 sizes: fields are only ever appended, and a plugin reads
//! a field only when `struct_size` covers it. The numbers in the `const` assertions below were
//! printed by a C program (`offsetof`/`sizeof`/`*_STRUCT_SIZE`) compiled against that header.
//!
//! C enums are declared as `i32` fields, so an all-zero struct is always a valid value.
//!
//! The function table `PJRT_Api` is never read as a Rust struct: a plugin's table may be shorter
//! than ours (an older API) or longer (a newer one). Each slot is read at its 0.81 offset only after
//! checking that the plugin's `PJRT_Api.struct_size` covers it, and a null slot reads as `None`.

use std::ffi::c_void;
use std::marker::{PhantomData, PhantomPinned};
use std::mem::{offset_of, size_of};
use std::path::Path;

use crate::error::{Error, Result};

/// Declares opaque C types that are only ever handled by pointer.
macro_rules! opaque {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub(crate) struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

opaque! {
    /// `PJRT_Error`.
    RawError;
    /// `PJRT_Client`.
    RawClient;
    /// `PJRT_Device`.
    RawDevice;
    /// `PJRT_Event`.
    RawEvent;
    /// `PJRT_Buffer`.
    RawBuffer;
    /// `PJRT_Executable` (not loaded).
    RawExecutable;
    /// `PJRT_LoadedExecutable`.
    RawLoadedExecutable;
    /// `PJRT_SerializedExecutable`.
    RawSerializedExecutable;
}

/// A PJRT function: takes its argument struct, returns an error or null.
pub(crate) type PjrtFn<A> = unsafe extern "C" fn(*mut A) -> *mut RawError;
/// `PJRT_Error_Destroy` and `PJRT_Error_Message`: no return value.
pub(crate) type VoidFn<A> = unsafe extern "C" fn(*mut A);

/// Declares an argument struct: `struct_size`, `extension_start`, then the fields, with a `new()`
/// that zeroes it and sets `struct_size` to the header's `PJRT_STRUCT_SIZE(T, last)`, and
/// compile-time checks of that size and of `sizeof(T)` against the numbers from the C header.
macro_rules! args {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty,)* }
     last = $last:ident : $last_ty:ty, struct_size = $size:expr, sizeof = $sizeof:expr) => {
        $(#[$m])*
        #[repr(C)]
        pub(crate) struct $name {
            pub(crate) struct_size: usize,
            pub(crate) extension_start: *mut c_void,
            $(pub(crate) $field: $ty,)*
        }

        impl $name {
            /// `PJRT_STRUCT_SIZE(T, last_field)` of the 0.81 header.
            pub(crate) const STRUCT_SIZE: usize = $size;

            /// All fields zero (null, 0, false, `None`), `struct_size` set.
            pub(crate) fn new() -> $name {
                // SAFETY: every field of this `repr(C)` struct is a raw pointer, an integer, a
                // `u8`-encoded bool or an `Option` of a function pointer; all-zero bytes are a
                // valid value for each (null, 0, `None`).
                let mut a: $name = unsafe { std::mem::zeroed() };
                a.struct_size = Self::STRUCT_SIZE;
                a
            }
        }

        const _: () = assert!(offset_of!($name, $last) + size_of::<$last_ty>() == $size);
        const _: () = assert!(size_of::<$name>() == $sizeof);
    };
}

args! {
    /// `PJRT_NamedValue` holding an `int64` (type 1): a client create option.
    NamedValue { name: *const u8, name_size: usize, kind: i32, pad: u32, int64_value: i64, value_size: usize, }
    last = value_size: usize, struct_size = 56, sizeof = 56
}
/// `PJRT_NamedValue_kInt64`.
pub(crate) const NAMED_VALUE_INT64: i32 = 1;
args! {
    /// `PJRT_Error_Destroy_Args`.
    ErrorDestroyArgs { error: *mut RawError, }
    last = error: *mut RawError, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Error_Message_Args`.
    ErrorMessageArgs { error: *const RawError, message: *const u8, message_size: usize, }
    last = message_size: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Error_GetCode_Args`.
    ErrorGetCodeArgs { error: *const RawError, code: i32, }
    last = code: i32, struct_size = 28, sizeof = 32
}
args! {
    /// `PJRT_Plugin_Initialize_Args`.
    PluginInitializeArgs {}
    last = extension_start: *mut c_void, struct_size = 16, sizeof = 16
}
args! {
    /// `PJRT_Event_Destroy_Args`.
    EventDestroyArgs { event: *mut RawEvent, }
    last = event: *mut RawEvent, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Event_Await_Args`.
    EventAwaitArgs { event: *mut RawEvent, }
    last = event: *mut RawEvent, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Client_Create_Args` (no options, no key-value callbacks).
    ClientCreateArgs {
        create_options: *const c_void,
        num_options: usize,
        kv_get_callback: *const c_void,
        kv_get_user_arg: *mut c_void,
        kv_put_callback: *const c_void,
        kv_put_user_arg: *mut c_void,
        client: *mut RawClient,
        kv_try_get_callback: *const c_void,
        kv_try_get_user_arg: *mut c_void,
    }
    last = kv_try_get_user_arg: *mut c_void, struct_size = 88, sizeof = 88
}
const _: () = assert!(offset_of!(ClientCreateArgs, client) == 64);
args! {
    /// `PJRT_Client_Destroy_Args`.
    ClientDestroyArgs { client: *mut RawClient, }
    last = client: *mut RawClient, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Client_PlatformName_Args`.
    ClientPlatformNameArgs { client: *mut RawClient, platform_name: *const u8, platform_name_size: usize, }
    last = platform_name_size: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Client_PlatformVersion_Args`.
    ClientPlatformVersionArgs { client: *mut RawClient, platform_version: *const u8, platform_version_size: usize, }
    last = platform_version_size: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Client_AddressableDevices_Args`.
    ClientAddressableDevicesArgs {
        client: *mut RawClient,
        addressable_devices: *const *mut RawDevice,
        num_addressable_devices: usize,
    }
    last = num_addressable_devices: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Program`.
    Program { code: *mut u8, code_size: usize, format: *const u8, format_size: usize, }
    last = format_size: usize, struct_size = 48, sizeof = 48
}
args! {
    /// `PJRT_Client_Compile_Args`.
    ClientCompileArgs {
        client: *mut RawClient,
        program: *const Program,
        compile_options: *const u8,
        compile_options_size: usize,
        executable: *mut RawLoadedExecutable,
    }
    last = executable: *mut RawLoadedExecutable, struct_size = 56, sizeof = 56
}
args! {
    /// `PJRT_Client_BufferFromHostBuffer_Args`.
    BufferFromHostArgs {
        client: *mut RawClient,
        data: *const c_void,
        type_: i32,
        dims: *const i64,
        num_dims: usize,
        byte_strides: *const i64,
        num_byte_strides: usize,
        host_buffer_semantics: i32,
        device: *mut RawDevice,
        memory: *mut c_void,
        device_layout: *mut c_void,
        done_with_host_buffer: *mut RawEvent,
        buffer: *mut RawBuffer,
    }
    last = buffer: *mut RawBuffer, struct_size = 120, sizeof = 120
}
const _: () = assert!(offset_of!(BufferFromHostArgs, type_) == 32);
const _: () = assert!(offset_of!(BufferFromHostArgs, dims) == 40);
const _: () = assert!(offset_of!(BufferFromHostArgs, host_buffer_semantics) == 72);
const _: () = assert!(offset_of!(BufferFromHostArgs, device) == 80);
args! {
    /// `PJRT_Executable_Destroy_Args`.
    ExecutableDestroyArgs { executable: *mut RawExecutable, }
    last = executable: *mut RawExecutable, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Executable_NumOutputs_Args`.
    ExecutableNumOutputsArgs { executable: *mut RawExecutable, num_outputs: usize, }
    last = num_outputs: usize, struct_size = 32, sizeof = 32
}
args! {
    /// `PJRT_Executable_OutputElementTypes_Args`.
    ExecutableOutputElementTypesArgs {
        executable: *mut RawExecutable,
        output_types: *const i32,
        num_output_types: usize,
    }
    last = num_output_types: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Executable_OutputDimensions_Args`.
    ExecutableOutputDimensionsArgs {
        executable: *mut RawExecutable,
        num_outputs: usize,
        dims: *const i64,
        dim_sizes: *const usize,
    }
    last = dim_sizes: *const usize, struct_size = 48, sizeof = 48
}
args! {
    /// `PJRT_Executable_Serialize_Args`.
    ExecutableSerializeArgs {
        executable: *const RawExecutable,
        serialized_bytes: *const u8,
        serialized_bytes_size: usize,
        serialized_executable: *mut RawSerializedExecutable,
        serialized_executable_deleter: Option<unsafe extern "C" fn(*mut RawSerializedExecutable)>,
    }
    last = serialized_executable_deleter: Option<unsafe extern "C" fn(*mut RawSerializedExecutable)>,
    struct_size = 56, sizeof = 56
}
args! {
    /// `PJRT_Executable_Fingerprint_Args`.
    ExecutableFingerprintArgs {
        executable: *mut RawExecutable,
        executable_fingerprint: *const u8,
        executable_fingerprint_size: usize,
    }
    last = executable_fingerprint_size: usize, struct_size = 40, sizeof = 40
}
args! {
    /// `PJRT_Executable_GetCompiledMemoryStats_Args`: what XLA's buffer assignment planned for
    /// one run of the executable, per device (a partitioned program's per-partition figures).
    ExecutableMemoryStatsArgs {
        executable: *mut RawExecutable,
        generated_code_size_in_bytes: i64,
        argument_size_in_bytes: i64,
        output_size_in_bytes: i64,
        alias_size_in_bytes: i64,
        temp_size_in_bytes: i64,
        host_generated_code_size_in_bytes: i64,
        host_argument_size_in_bytes: i64,
        host_output_size_in_bytes: i64,
        host_alias_size_in_bytes: i64,
        host_temp_size_in_bytes: i64,
        peak_memory_in_bytes: i64,
    }
    last = peak_memory_in_bytes: i64, struct_size = 112, sizeof = 112
}
args! {
    /// `PJRT_LoadedExecutable_Destroy_Args`.
    LoadedExecutableDestroyArgs { executable: *mut RawLoadedExecutable, }
    last = executable: *mut RawLoadedExecutable, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_LoadedExecutable_GetExecutable_Args`.
    LoadedExecutableGetExecutableArgs {
        loaded_executable: *mut RawLoadedExecutable,
        executable: *mut RawExecutable,
    }
    last = executable: *mut RawExecutable, struct_size = 32, sizeof = 32
}
args! {
    /// `PJRT_ExecuteOptions`.
    ExecuteOptions {
        send_callbacks: *mut c_void,
        recv_callbacks: *mut c_void,
        num_send_ops: usize,
        num_recv_ops: usize,
        launch_id: i32,
        non_donatable_input_indices: *const i64,
        num_non_donatable_input_indices: usize,
        context: *mut c_void,
        call_location: *const u8,
        num_tasks: usize,
        task_ids: *mut i32,
        incarnation_ids: *mut i64,
    }
    last = incarnation_ids: *mut i64, struct_size = 112, sizeof = 112
}
const _: () = assert!(offset_of!(ExecuteOptions, launch_id) == 48);
const _: () = assert!(offset_of!(ExecuteOptions, non_donatable_input_indices) == 56);
args! {
    /// `PJRT_LoadedExecutable_Execute_Args`.
    ExecuteArgs {
        executable: *mut RawLoadedExecutable,
        options: *mut ExecuteOptions,
        argument_lists: *const *const *mut RawBuffer,
        num_devices: usize,
        num_args: usize,
        output_lists: *const *mut *mut RawBuffer,
        device_complete_events: *mut *mut RawEvent,
        execute_device: *mut RawDevice,
    }
    last = execute_device: *mut RawDevice, struct_size = 80, sizeof = 80
}
args! {
    /// `PJRT_Executable_DeserializeAndLoad_Args`.
    DeserializeAndLoadArgs {
        client: *mut RawClient,
        serialized_executable: *const u8,
        serialized_executable_size: usize,
        loaded_executable: *mut RawLoadedExecutable,
        overridden_serialized_compile_options: *const u8,
        overridden_serialized_compile_options_size: usize,
    }
    last = overridden_serialized_compile_options_size: usize, struct_size = 64, sizeof = 64
}
args! {
    /// `PJRT_Buffer_Destroy_Args`.
    BufferDestroyArgs { buffer: *mut RawBuffer, }
    last = buffer: *mut RawBuffer, struct_size = 24, sizeof = 24
}
args! {
    /// `PJRT_Buffer_ToHostBuffer_Args`.
    BufferToHostArgs {
        src: *mut RawBuffer,
        host_layout: *mut c_void,
        dst: *mut c_void,
        dst_size: usize,
        event: *mut RawEvent,
    }
    last = event: *mut RawEvent, struct_size = 56, sizeof = 56
}
args! {
    /// `PJRT_Buffer_IsDeleted_Args` (`bool is_deleted` read as a byte).
    BufferIsDeletedArgs { buffer: *mut RawBuffer, is_deleted: u8, }
    last = is_deleted: u8, struct_size = 25, sizeof = 32
}

args! {
    /// `PJRT_Buffer_IsOnCpu_Args` (`bool is_on_cpu` read as a byte).
    BufferIsOnCpuArgs { buffer: *mut RawBuffer, is_on_cpu: u8, }
    last = is_on_cpu: u8, struct_size = 25, sizeof = 32
}
args! {
    /// `PJRT_Buffer_OnDeviceSizeInBytes_Args`.
    BufferOnDeviceSizeArgs { buffer: *mut RawBuffer, on_device_size_in_bytes: usize, }
    last = on_device_size_in_bytes: usize, struct_size = 32, sizeof = 32
}
args! {
    /// `PJRT_Buffer_ReadyEvent_Args`: an event that is ready once the buffer is defined (the
    /// computation or copy that writes it has finished).
    BufferReadyEventArgs { buffer: *mut RawBuffer, event: *mut RawEvent, }
    last = event: *mut RawEvent, struct_size = 32, sizeof = 32
}

args! {
    /// `PJRT_Buffer_UnsafePointer_Args` (not in the 0.81 header; laid out as in later ones).
    BufferUnsafePointerArgs { buffer: *mut RawBuffer, buffer_pointer: usize, }
    last = buffer_pointer: usize, struct_size = 32, sizeof = 32
}
args! {
    /// `PJRT_Client_CreateViewOfDeviceBuffer_Args` (not in the 0.81 header; the layout of the
    /// headers that added it, up to `buffer`: later ones append `memory`, which a plugin reads
    /// only when `struct_size` covers it).
    CreateViewArgs {
        client: *mut RawClient,
        device_buffer_ptr: *mut c_void,
        dims: *const i64,
        num_dims: usize,
        element_type: i32,
        layout: *mut c_void,
        device: *mut RawDevice,
        on_delete_callback: Option<unsafe extern "C" fn(*mut c_void, *mut c_void)>,
        on_delete_callback_arg: *mut c_void,
        stream: isize,
        buffer: *mut RawBuffer,
    }
    last = buffer: *mut RawBuffer, struct_size = 104, sizeof = 104
}
const _: () = assert!(offset_of!(CreateViewArgs, element_type) == 48);
const _: () = assert!(offset_of!(CreateViewArgs, device) == 64);

/// `PJRT_Buffer_Type` values of the element types nitro arrays hold.
pub(crate) mod buffer_type {
    /// `PJRT_Buffer_Type_PRED` (one byte per element).
    pub(crate) const PRED: i32 = 1;
    /// `PJRT_Buffer_Type_S32`.
    pub(crate) const S32: i32 = 4;
    /// `PJRT_Buffer_Type_S64`.
    pub(crate) const S64: i32 = 5;
    /// `PJRT_Buffer_Type_U8`.
    pub(crate) const U8: i32 = 6;
    /// `PJRT_Buffer_Type_U32`.
    pub(crate) const U32: i32 = 8;
    /// `PJRT_Buffer_Type_F16`.
    pub(crate) const F16: i32 = 10;
    /// `PJRT_Buffer_Type_BF16`.
    pub(crate) const BF16: i32 = 13;
    /// `PJRT_Buffer_Type_F32`.
    pub(crate) const F32: i32 = 11;
    /// `PJRT_Buffer_Type_F64`.
    pub(crate) const F64: i32 = 12;
}

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies the host data before
/// `BufferFromHostBuffer` returns.
pub(crate) const IMMUTABLE_ONLY_DURING_CALL: i32 = 0;

/// `PJRT_Error_Code_UNIMPLEMENTED`.
pub(crate) const CODE_UNIMPLEMENTED: i32 = 12;

/// The name of a `PJRT_Error_Code` (absl status codes).
pub(crate) fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNRECOGNIZED_CODE",
    }
}

/// Offsets inside `PJRT_Api` (0.81 header): `struct_size` at 0, `extension_start` at 8, the
/// `PJRT_Api_Version` struct at 16 (24 bytes: `struct_size`, `extension_start`, `int major`,
/// `int minor`), then one function pointer per slot from offset 40.
pub(crate) const API_VERSION_MAJOR_OFFSET: usize = 32;
/// Offset of `pjrt_api_version.minor_version`.
pub(crate) const API_VERSION_MINOR_OFFSET: usize = 36;
/// Bytes of `PJRT_Api` up to and including `pjrt_api_version`.
pub(crate) const API_HEAD_SIZE: usize = 40;

/// Declares the function table nitro reads, with each slot's offset in `PJRT_Api` (0.81 header,
/// measured with `offsetof`) and its argument type.
macro_rules! api_fns {
    ($($field:ident : $args:ty = $offset:literal, $cname:literal;)*) => {
        /// The PJRT functions nitro calls; `None` where the plugin's table does not cover the slot
        /// or the slot is null.
        #[derive(Clone, Copy)]
        pub(crate) struct Fns {
            $(pub(crate) $field: Option<PjrtFn<$args>>,)*
        }

        impl Fns {
            /// Reads every slot that `struct_size` covers.
            ///
            /// # Safety
            /// `api` must point to a readable `PJRT_Api` of at least `struct_size` bytes, aligned
            /// for pointers, whose slots hold null or functions of the 0.81 signatures.
            unsafe fn read(api: *const u8, struct_size: usize) -> Fns {
                Fns {
                    // SAFETY: forwarded from this function's contract.
                    $($field: unsafe { read_slot::<PjrtFn<$args>>(api, struct_size, $offset) },)*
                }
            }
        }

        /// The C names of the slots, for error messages and docs.
        #[allow(dead_code)]
        pub(crate) mod names {
            $(#[allow(non_upper_case_globals)] pub(crate) const $field: &str = $cname;)*
        }

        $(const _: () = assert!($offset >= API_HEAD_SIZE + 24 && $offset % 8 == 0);)*
    };
}

api_fns! {
    plugin_initialize: PluginInitializeArgs = 64, "PJRT_Plugin_Initialize";
    event_destroy: EventDestroyArgs = 80, "PJRT_Event_Destroy";
    event_await: EventAwaitArgs = 104, "PJRT_Event_Await";
    client_create: ClientCreateArgs = 120, "PJRT_Client_Create";
    client_destroy: ClientDestroyArgs = 128, "PJRT_Client_Destroy";
    client_platform_name: ClientPlatformNameArgs = 136, "PJRT_Client_PlatformName";
    client_platform_version: ClientPlatformVersionArgs = 152, "PJRT_Client_PlatformVersion";
    client_addressable_devices: ClientAddressableDevicesArgs = 168, "PJRT_Client_AddressableDevices";
    client_compile: ClientCompileArgs = 200, "PJRT_Client_Compile";
    client_buffer_from_host: BufferFromHostArgs = 216, "PJRT_Client_BufferFromHostBuffer";
    executable_destroy: ExecutableDestroyArgs = 360, "PJRT_Executable_Destroy";
    executable_num_outputs: ExecutableNumOutputsArgs = 392, "PJRT_Executable_NumOutputs";
    executable_serialize: ExecutableSerializeArgs = 432, "PJRT_Executable_Serialize";
    loaded_executable_destroy: LoadedExecutableDestroyArgs = 440, "PJRT_LoadedExecutable_Destroy";
    loaded_executable_get_executable: LoadedExecutableGetExecutableArgs = 448, "PJRT_LoadedExecutable_GetExecutable";
    loaded_executable_execute: ExecuteArgs = 480, "PJRT_LoadedExecutable_Execute";
    executable_deserialize_and_load: DeserializeAndLoadArgs = 488, "PJRT_Executable_DeserializeAndLoad";
    buffer_destroy: BufferDestroyArgs = 504, "PJRT_Buffer_Destroy";
    buffer_is_deleted: BufferIsDeletedArgs = 584, "PJRT_Buffer_IsDeleted";
    buffer_on_device_size: BufferOnDeviceSizeArgs = 552, "PJRT_Buffer_OnDeviceSizeInBytes";
    buffer_to_host: BufferToHostArgs = 600, "PJRT_Buffer_ToHostBuffer";
    buffer_is_on_cpu: BufferIsOnCpuArgs = 608, "PJRT_Buffer_IsOnCpu";
    buffer_ready_event: BufferReadyEventArgs = 616, "PJRT_Buffer_ReadyEvent";
    buffer_unsafe_pointer: BufferUnsafePointerArgs = 624, "PJRT_Buffer_UnsafePointer";
    executable_output_element_types: ExecutableOutputElementTypesArgs = 760, "PJRT_Executable_OutputElementTypes";
    executable_output_dimensions: ExecutableOutputDimensionsArgs = 768, "PJRT_Executable_OutputDimensions";
    client_create_view: CreateViewArgs = 784, "PJRT_Client_CreateViewOfDeviceBuffer";
    executable_fingerprint: ExecutableFingerprintArgs = 792, "PJRT_Executable_Fingerprint";
    executable_memory_stats: ExecutableMemoryStatsArgs = 808, "PJRT_Executable_GetCompiledMemoryStats";
}

/// Offsets of the three error functions, which have their own signatures.
const ERROR_DESTROY_OFFSET: usize = 40;
const ERROR_MESSAGE_OFFSET: usize = 48;
const ERROR_GET_CODE_OFFSET: usize = 56;

/// Reads the function pointer at `offset` of the table, or `None` when the table's
/// `struct_size` does not cover the slot or the slot is null.
///
/// # Safety
/// `api` must point to a readable, pointer-aligned table of at least `struct_size` bytes, and `F`
/// must be a function-pointer type (so `Option<F>` is a nullable pointer).
unsafe fn read_slot<F: Copy>(api: *const u8, struct_size: usize, offset: usize) -> Option<F> {
    debug_assert_eq!(size_of::<Option<F>>(), size_of::<usize>());
    if offset.checked_add(size_of::<usize>())? > struct_size {
        return None;
    }
    // SAFETY: the slot lies inside the first `struct_size` bytes (checked above), which the caller
    // guarantees readable and aligned; `Option<fn>` has the same layout as a nullable C function
    // pointer, so a null slot reads as `None`.
    unsafe { api.add(offset).cast::<Option<F>>().read() }
}

/// A plugin's function table, checked: the head read, the version known, the slots resolved.
pub(crate) struct Api {
    /// `PJRT_Api.struct_size` as the plugin reports it.
    pub(crate) struct_size: usize,
    /// `pjrt_api_version` (major, minor).
    pub(crate) version: (i32, i32),
    error_destroy: VoidFn<ErrorDestroyArgs>,
    error_message: VoidFn<ErrorMessageArgs>,
    error_get_code: PjrtFn<ErrorGetCodeArgs>,
    /// The other functions.
    pub(crate) fns: Fns,
}

// SAFETY: `Api` holds copies of function pointers read from the plugin's static, immutable
// function table; no Rust-side state is shared. PJRT requires its C API to be callable from any
// thread (JAX calls it from many), and every object passed to these functions is owned and
// synchronized by the PJRT implementation.
unsafe impl Send for Api {}
// SAFETY: as for `Send`: the table is read-only and the functions are thread-safe.
unsafe impl Sync for Api {}

/// The functions a plugin must provide for nitro to use it at all.
const REQUIRED: &[&str] = &[
    names::plugin_initialize,
    names::event_destroy,
    names::event_await,
    names::client_create,
    names::client_destroy,
    names::client_addressable_devices,
    names::client_compile,
    names::client_buffer_from_host,
    names::executable_destroy,
    names::executable_num_outputs,
    names::loaded_executable_destroy,
    names::loaded_executable_get_executable,
    names::loaded_executable_execute,
    names::buffer_destroy,
    names::buffer_to_host,
];

impl Api {
    /// Checks and reads the table that `GetPjrtApi` returned.
    ///
    /// # Safety
    /// `raw` must be null or the pointer `GetPjrtApi` returned: a `PJRT_Api` that stays valid for
    /// as long as the plugin library stays loaded (nitro never unloads plugins).
    pub(crate) unsafe fn from_raw(raw: *const c_void, path: &Path) -> Result<Api> {
        let bad = |reason: String| Error::PjrtPlugin {
            path: path.to_path_buf(),
            reason,
        };
        if raw.is_null() {
            return Err(bad("its GetPjrtApi() returned a null table".into()));
        }
        if raw.align_offset(std::mem::align_of::<usize>()) != 0 {
            return Err(bad("its GetPjrtApi() returned a misaligned table".into()));
        }
        let base = raw.cast::<u8>();
        // SAFETY: `raw` is a non-null, aligned `PJRT_Api*`; every version of the struct starts
        // with `size_t struct_size`.
        let struct_size = unsafe { base.cast::<usize>().read() };
        if struct_size < API_HEAD_SIZE + 24 {
            return Err(bad(format!(
                "its PJRT_Api table is {struct_size} bytes, too small to hold a version and the \
                 error functions"
            )));
        }
        // SAFETY: `struct_size` covers the version struct (checked above); the fields are
        // C `int`s at their 0.81 offsets, which never moved.
        let version = unsafe {
            (
                base.add(API_VERSION_MAJOR_OFFSET).cast::<i32>().read(),
                base.add(API_VERSION_MINOR_OFFSET).cast::<i32>().read(),
            )
        };
        if version.0 != 0 {
            return Err(bad(format!(
                "it implements PJRT C API {}.{}, and nitro speaks major version 0 only; install \
                 a plugin built for API 0.x",
                version.0, version.1
            )));
        }
        // SAFETY: the table is readable and aligned for `struct_size` bytes (the plugin's word),
        // and its slots hold null or functions of the declared signatures (the ABI of major 0).
        let (destroy, message, code, fns) = unsafe {
            (
                read_slot::<VoidFn<ErrorDestroyArgs>>(base, struct_size, ERROR_DESTROY_OFFSET),
                read_slot::<VoidFn<ErrorMessageArgs>>(base, struct_size, ERROR_MESSAGE_OFFSET),
                read_slot::<PjrtFn<ErrorGetCodeArgs>>(base, struct_size, ERROR_GET_CODE_OFFSET),
                Fns::read(base, struct_size),
            )
        };
        let (Some(error_destroy), Some(error_message), Some(error_get_code)) =
            (destroy, message, code)
        else {
            return Err(bad("its PJRT_Api table lacks the error functions".into()));
        };
        let api = Api {
            struct_size,
            version,
            error_destroy,
            error_message,
            error_get_code,
            fns,
        };
        let missing: Vec<&str> = REQUIRED
            .iter()
            .copied()
            .filter(|name| !api.has(name))
            .collect();
        if !missing.is_empty() {
            return Err(bad(format!(
                "its PJRT_Api table (API {}.{}, {struct_size} bytes) lacks {}",
                version.0,
                version.1,
                missing.join(", ")
            )));
        }
        Ok(api)
    }

    /// Whether the function with this C name is available.
    fn has(&self, name: &str) -> bool {
        let f = &self.fns;
        macro_rules! check {
            ($($field:ident),*) => {
                $(if name == names::$field { return f.$field.is_some(); })*
            };
        }
        check!(
            plugin_initialize,
            event_destroy,
            event_await,
            client_create,
            client_destroy,
            client_platform_name,
            client_platform_version,
            client_addressable_devices,
            client_compile,
            client_buffer_from_host,
            executable_destroy,
            executable_num_outputs,
            executable_serialize,
            loaded_executable_destroy,
            loaded_executable_get_executable,
            loaded_executable_execute,
            executable_deserialize_and_load,
            buffer_destroy,
            buffer_is_deleted,
            buffer_to_host,
            executable_output_element_types,
            executable_output_dimensions,
            executable_fingerprint
        );
        false
    }

    /// Reads and destroys a `PJRT_Error`: `(code, message)`.
    ///
    /// # Safety
    /// `err` must be a non-null error returned by this plugin and not yet destroyed; it is
    /// destroyed here.
    pub(crate) unsafe fn take_error(&self, err: *mut RawError) -> (i32, String) {
        let mut m = ErrorMessageArgs::new();
        m.error = err;
        // SAFETY: `err` is a live error of this plugin (caller's contract); `m` is a valid
        // `PJRT_Error_Message_Args`.
        unsafe { (self.error_message)(&mut m) };
        let message = if m.message.is_null() {
            String::new()
        } else {
            // SAFETY: the plugin returned `message_size` bytes at `message`, alive as long as
            // `err`, which is destroyed only below, after the copy.
            let bytes = unsafe { std::slice::from_raw_parts(m.message, m.message_size) };
            String::from_utf8_lossy(bytes).into_owned()
        };
        let mut c = ErrorGetCodeArgs::new();
        c.error = err;
        // SAFETY: as above; `c` is a valid `PJRT_Error_GetCode_Args`.
        let code_err = unsafe { (self.error_get_code)(&mut c) };
        let code = if code_err.is_null() { c.code } else { 2 };
        if !code_err.is_null() {
            self.destroy_error(code_err);
        }
        self.destroy_error(err);
        (code, message)
    }

    /// Destroys an error without reading it.
    fn destroy_error(&self, err: *mut RawError) {
        let mut d = ErrorDestroyArgs::new();
        d.error = err;
        // SAFETY: `err` is a live error returned by this plugin (all callers pass one they own),
        // destroyed exactly once here.
        unsafe { (self.error_destroy)(&mut d) };
    }

    /// Turns a returned error pointer into a `Result`, naming the call.
    ///
    /// # Safety
    /// `err` must be null or an error just returned by a function of this plugin.
    pub(crate) unsafe fn check(&self, call: &'static str, err: *mut RawError) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        // SAFETY: non-null error just returned by this plugin (caller's contract).
        let (code, message) = unsafe { self.take_error(err) };
        Err(Error::Pjrt {
            call,
            code: code_name(code),
            message,
        })
    }

    /// Awaits an event and destroys it (also when awaiting failed). A null event is ready.
    ///
    /// # Safety
    /// `event` must be null or a live event returned by this plugin, owned by the caller; it is
    /// destroyed here.
    pub(crate) unsafe fn await_event(
        &self,
        call: &'static str,
        event: *mut RawEvent,
    ) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = EventAwaitArgs::new();
        a.event = event;
        let awaited = match self.fns.event_await {
            // SAFETY: `event` is a live event of this plugin (caller's contract).
            Some(f) => unsafe { self.check(call, f(&mut a)) },
            None => Ok(()),
        };
        // SAFETY: the event is live and owned (caller's contract); destroyed once, after the
        // await returned.
        unsafe { self.destroy_event(event) };
        awaited
    }

    /// Destroys an event without awaiting it (the work it stands for goes on). A null event is
    /// ignored; a failure to destroy is logged, never returned.
    ///
    /// # Safety
    /// `event` must be null or a live event returned by this plugin, owned by the caller; it is
    /// destroyed here.
    pub(crate) unsafe fn destroy_event(&self, event: *mut RawEvent) {
        if event.is_null() {
            return;
        }
        let mut d = EventDestroyArgs::new();
        d.event = event;
        if let Some(f) = self.fns.event_destroy {
            // SAFETY: the event is live and owned (caller's contract), destroyed once.
            let destroyed = unsafe { self.check(names::event_destroy, f(&mut d)) };
            if let Err(e) = destroyed {
                tracing::debug!("ignoring a failure to destroy a PJRT event: {e}");
            }
        }
    }

    /// Whether an error code says the call is not implemented by this plugin.
    pub(crate) fn is_unimplemented(e: &Error) -> bool {
        matches!(e, Error::Pjrt { code, .. } if *code == code_name(CODE_UNIMPLEMENTED))
    }
}

/// The function, or a typed error naming it and the plugin's API version.
pub(crate) fn require<F: Copy>(
    f: Option<F>,
    name: &'static str,
    api: &Api,
    path: &Path,
) -> Result<F> {
    f.ok_or_else(|| Error::PjrtUnsupported {
        path: path.to_path_buf(),
        function: name,
        major: api.version.0,
        minor: api.version.1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `PJRT_Api` table: 0.81's size, pointer-aligned, all slots null.
    #[repr(C, align(8))]
    struct Table([u8; 984]);

    impl Table {
        fn new(struct_size: usize, major: i32, minor: i32) -> Table {
            let mut t = Table([0; 984]);
            t.0[..8].copy_from_slice(&struct_size.to_ne_bytes());
            t.0[API_VERSION_MAJOR_OFFSET..][..4].copy_from_slice(&major.to_ne_bytes());
            t.0[API_VERSION_MINOR_OFFSET..][..4].copy_from_slice(&minor.to_ne_bytes());
            t
        }

        fn set(&mut self, offset: usize, f: usize) {
            self.0[offset..][..8].copy_from_slice(&f.to_ne_bytes());
        }

        fn with_error_fns(mut self) -> Table {
            self.set(
                ERROR_DESTROY_OFFSET,
                stub_void as unsafe extern "C" fn(*mut c_void) as usize,
            );
            self.set(
                ERROR_MESSAGE_OFFSET,
                stub_void as unsafe extern "C" fn(*mut c_void) as usize,
            );
            self.set(
                ERROR_GET_CODE_OFFSET,
                stub_err as unsafe extern "C" fn(*mut c_void) -> *mut RawError as usize,
            );
            self
        }

        fn load(&self) -> Result<Api> {
            // SAFETY: the table is a readable, aligned 984-byte buffer whose non-null slots hold
            // functions of the declared signatures (never called by `from_raw`).
            unsafe { Api::from_raw(self.0.as_ptr().cast(), Path::new("fake.so")) }
        }
    }

    // Never called: `from_raw` only reads the slots.
    unsafe extern "C" fn stub_void(_: *mut c_void) {}
    unsafe extern "C" fn stub_err(_: *mut c_void) -> *mut RawError {
        std::ptr::null_mut()
    }

    fn reason(r: Result<Api>) -> String {
        match r {
            Err(e @ Error::PjrtPlugin { .. }) => e.to_string(),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a broken table was accepted"),
        }
    }

    #[test]
    fn a_null_table_is_refused() {
        // SAFETY: a null pointer is allowed by `from_raw`'s contract.
        let r = unsafe { Api::from_raw(std::ptr::null(), Path::new("fake.so")) };
        assert!(reason(r).contains("null table"));
    }

    #[test]
    fn a_table_too_small_for_its_head_is_refused() {
        let t = Table::new(32, 0, 81);
        assert!(reason(t.load()).contains("too small"));
    }

    #[test]
    fn another_major_version_is_refused() {
        let t = Table::new(984, 1, 0).with_error_fns();
        assert!(reason(t.load()).contains("major version 0"));
    }

    #[test]
    fn missing_error_functions_are_refused() {
        let t = Table::new(984, 0, 81);
        assert!(reason(t.load()).contains("error functions"));
    }

    #[test]
    fn missing_required_functions_are_named() {
        let t = Table::new(984, 0, 81).with_error_fns();
        let msg = reason(t.load());
        assert!(msg.contains("PJRT_Client_Compile"), "{msg}");
        assert!(msg.contains("PJRT_LoadedExecutable_Execute"), "{msg}");
    }

    #[test]
    fn slots_beyond_struct_size_read_as_absent() {
        let mut t = Table::new(984, 0, 81).with_error_fns();
        let f = stub_err as unsafe extern "C" fn(*mut c_void) -> *mut RawError as usize;
        // Fill every slot nitro reads, then shrink the table below the fingerprint slot (792).
        for off in (64..=792).step_by(8) {
            t.set(off, f);
        }
        let api = t.load().expect("a complete table loads");
        assert!(api.fns.executable_fingerprint.is_some());
        let mut short = Table::new(792, 0, 81).with_error_fns();
        for off in (64..=792).step_by(8) {
            short.set(off, f);
        }
        let api = short.load().expect("a table without the newer slots loads");
        assert!(
            api.fns.executable_fingerprint.is_none(),
            "slot at 792 is past struct_size"
        );
        assert!(
            api.fns.executable_output_dimensions.is_some(),
            "768 + 8 <= 792"
        );
        // A null slot reads as absent too.
        let mut holes = Table::new(984, 0, 81).with_error_fns();
        for off in (64..=792).step_by(8) {
            holes.set(off, f);
        }
        holes.set(792, 0);
        assert!(holes.load().unwrap().fns.executable_fingerprint.is_none());
    }
}
