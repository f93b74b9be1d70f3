//! Owner-only files: the rules nitro reads and writes its own files by — the compile store's
//! entries and records, the backend's start-up memo, checkpoints.
//!
//! - **Reads are checked before they start.** [`open_regular`] never follows a symbolic link,
//!   never blocks on a FIFO (it opens non-blocking, then refuses anything that is not a regular
//!   file), and refuses a file larger than the caller's bound before reading a byte.
//! - **Writes are atomic.** [`write_atomic`] writes a temporary file beside the target
//!   (`<name>.tmp.<pid>.<n>`, mode 0600), optionally syncs it, and renames it over the target;
//!   on an error the temporary file is removed. One killed mid-write is left behind, and
//!   [`remove_stale_temps`] removes it later: when its writer is gone, or after an hour.
//! - **Private directories.** [`private_dir`] creates a directory owner-only (mode 0700) and
//!   [`check_private_dir`] refuses one that other users can write.
//!
//! This module sits below every module that keeps files (`backend`, `cache`, `checkpoint`); it
//! returns plain `std::io` facts and leaves the wording of errors to them.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What marks a temporary file: `<name>.tmp.<pid>.<n>`.
pub(crate) const TEMP_MARK: &str = ".tmp.";

/// A temporary file older than this is removed even when its writer may be alive.
const TEMP_MAX_AGE: Duration = Duration::from_secs(3600);

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Why [`open_regular`] refused a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A directory.
    Directory,
    /// A FIFO, socket or device.
    NotRegular,
    /// Owned by another user.
    OtherOwner,
    /// Writable by other users.
    OthersWrite,
    /// Larger than the caller's bound.
    TooLarge,
}

impl Refusal {
    /// The refusal in words (completes "the file is …").
    pub(crate) const fn why(self) -> &'static str {
        match self {
            Refusal::Directory => "a directory, not a file",
            Refusal::NotRegular => "not a regular file (a FIFO, socket or device)",
            Refusal::OtherOwner => "owned by another user",
            Refusal::OthersWrite => "writable by other users",
            Refusal::TooLarge => "larger than any file of its kind",
        }
    }
}

/// What [`open_regular`] found.
#[derive(Debug)]
pub(crate) enum Opened {
    /// A regular file, and its length.
    File(File, u64),
    /// Something that must not be read.
    Refused(Refusal),
}

/// Who may have written a file [`open_regular`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Only this user: a file another user owns, or others can write, is refused (native code
    /// and its metadata).
    Me,
    /// Anyone who could put it there (a checkpoint a colleague handed over).
    Anyone,
}

/// Opens `path` for reading, refusing anything but a regular file of at most `max` bytes (and,
/// for [`Owner::Me`], one this user owns and no one else can write). A symbolic link is not
/// followed (an error), a FIFO or device is never read from, and a huge or sparse file is
/// refused before any read.
pub(crate) fn open_regular(path: &Path, max: u64, owner: Owner) -> std::io::Result<Opened> {
    let file = open_no_follow(path, owner == Owner::Me)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Ok(Opened::Refused(Refusal::Directory));
    }
    if !meta.is_file() {
        return Ok(Opened::Refused(Refusal::NotRegular));
    }
    #[cfg(unix)]
    if owner == Owner::Me {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if meta.uid() != effective_uid() {
            return Ok(Opened::Refused(Refusal::OtherOwner));
        }
        if meta.permissions().mode() & 0o022 != 0 {
            return Ok(Opened::Refused(Refusal::OthersWrite));
        }
    }
    if meta.len() > max {
        return Ok(Opened::Refused(Refusal::TooLarge));
    }
    Ok(Opened::File(file, meta.len()))
}

/// Reads exactly `len` bytes of an opened file, reserving memory fallibly (a huge length is an
/// error, never an abort); fewer bytes than `len` is an `UnexpectedEof` error.
pub(crate) fn read_exactly(file: &mut File, len: u64) -> std::io::Result<Vec<u8>> {
    let n =
        usize::try_from(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(n)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    file.take(len).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the file ended after {} of {len} bytes", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// The bytes of a small private file (at most `max` bytes) that only this user can have
/// written: `None` when it is absent, unreadable, a link, not a regular file, another user's,
/// writable by others or too large.
pub(crate) fn read_private(path: &Path, max: u64) -> Option<Vec<u8>> {
    let Ok(Opened::File(file, _)) = open_regular(path, max, Owner::Me) else {
        return None;
    };
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// Where [`write_atomic`] failed.
#[derive(Debug)]
pub(crate) struct WriteFailure {
    /// The temporary file it was writing (removed).
    pub tmp: PathBuf,
    /// What it was doing: `create`, `write`, `sync`, `rename`.
    pub step: &'static str,
    /// The operating system's error.
    pub source: std::io::Error,
}

/// Writes `bytes` to `path` atomically: a new temporary file beside it (mode 0600 on unix),
/// synced when `durable`, renamed over `path`, and then (when `durable`) the directory synced,
/// so a reader sees the old file or the new one, never a part. On an error the temporary file
/// is removed. A directory at `path` is an error (the rename fails), never removed.
pub(crate) fn write_atomic(
    path: &Path,
    bytes: &[u8],
    durable: bool,
) -> std::result::Result<(), WriteFailure> {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!("{name}{TEMP_MARK}{}.{n}", std::process::id()));
    let fail = |step: &'static str| {
        let tmp = tmp.clone();
        move |source| WriteFailure { tmp, step, source }
    };
    let result = (|| {
        let mut f = private_file()
            .create_new(true)
            .open(&tmp)
            .map_err(fail("create"))?;
        f.write_all(bytes).map_err(fail("write"))?;
        if durable {
            f.sync_all().map_err(fail("sync"))?;
        }
        drop(f);
        fs::rename(&tmp, path).map_err(fail("rename"))?;
        // Make the rename itself durable (directories can be opened and synced on unix).
        #[cfg(unix)]
        if durable {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes the temporary files [`write_atomic`] left in `dir` (writers killed mid-write) whose
/// target name passes `target`: those whose writer is gone, and any older than an hour.
/// Returns how many it removed. Only regular files are removed; liveness is read from
/// `/proc`, and where there is none a temporary file is removed only once it is old.
pub(crate) fn remove_stale_temps(dir: &Path, target: impl Fn(&str) -> bool) -> usize {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    let proc_fs = Path::new("/proc/self").exists();
    let mut removed = 0;
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pos) = name.rfind(TEMP_MARK) else {
            continue;
        };
        let mut tail = name[pos + TEMP_MARK.len()..].split('.');
        let (Some(Ok(pid)), Some(Ok(_)), None) = (
            tail.next().map(str::parse::<u32>),
            tail.next().map(str::parse::<u64>),
            tail.next(),
        ) else {
            continue;
        };
        if !target(&name[..pos]) {
            continue;
        }
        let Ok(meta) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        let alive =
            pid == std::process::id() || !proc_fs || Path::new(&format!("/proc/{pid}")).exists();
        let old = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > TEMP_MAX_AGE);
        if (!alive || old) && fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Writes a user's file (a checkpoint, weights, an array, a manifest) atomically with
/// [`write_atomic`], first removing what killed writes of files of its kind left beside it:
/// the stale temporary files ([`remove_stale_temps`]) whose target has the same extension as
/// `path` (or, for a name without one, the same name). Another tool's files are never touched.
pub(crate) fn save_atomic(
    path: &Path,
    bytes: &[u8],
    durable: bool,
) -> std::result::Result<(), WriteFailure> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let ext = path.extension().map(|e| e.to_owned());
    let name = path.file_name().map(|n| n.to_owned());
    remove_stale_temps(dir, |target| match &ext {
        Some(ext) => Path::new(target).extension() == Some(ext.as_os_str()),
        None => Some(std::ffi::OsStr::new(target)) == name.as_deref(),
    });
    write_atomic(path, bytes, durable)
}

/// Why [`check_private_dir`] refused a directory.
#[derive(Debug)]
pub(crate) enum Untrusted {
    /// Its permissions could not be read.
    Unreadable(std::io::Error),
    /// Other users can write it: `every user` or `its group`, and its mode.
    Writable {
        /// `every user` or `its group`.
        by: &'static str,
        /// Its permission bits.
        mode: u32,
    },
    /// Another user owns it.
    OtherOwner {
        /// Its owner.
        owner: u32,
        /// This process's effective user.
        me: u32,
    },
}

/// Refuses a directory other users can write: one that is group- or world-writable, or owned
/// by another user (unless that is root, who can write anything anyway).
pub(crate) fn check_private_dir(dir: &Path) -> std::result::Result<(), Untrusted> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let meta = fs::metadata(dir).map_err(Untrusted::Unreadable)?;
        let mode = meta.permissions().mode();
        if mode & 0o022 != 0 {
            return Err(Untrusted::Writable {
                by: if mode & 0o002 != 0 {
                    "every user"
                } else {
                    "its group"
                },
                mode: mode & 0o777,
            });
        }
        let owner = meta.uid();
        let me = effective_uid();
        if owner != 0 && owner != me {
            return Err(Untrusted::OtherOwner { owner, me });
        }
    }
    let _ = dir;
    Ok(())
}

/// Creates `dir` and its parents owner-only (mode 0700) when it is missing.
pub(crate) fn private_dir(dir: &Path) -> std::io::Result<()> {
    if dir.exists() {
        return Ok(());
    }
    private_dir_builder(true).create(dir)
}

/// The platform cache directory's `nitro` folder (`~/.cache/nitro` on Linux), where the
/// compile store and the backend's start-up memo live unless `NITRO_CACHE_DIR` moves them.
pub(crate) fn default_cache_dir() -> Option<PathBuf> {
    dirs::cache_dir().map(|d| d.join("nitro"))
}

/// Options for a file only its owner can read and write, whatever the umask.
pub(crate) fn private_file() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o
}

/// A builder of directories only their owner can enter and write, whatever the umask.
pub(crate) fn private_dir_builder(recursive: bool) -> fs::DirBuilder {
    let mut b = fs::DirBuilder::new();
    b.recursive(recursive);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b
}

/// This process's effective user id.
#[cfg(unix)]
pub(crate) fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Opens `path` read-only without blocking on a FIFO, and (when `no_follow`) without
/// following a symbolic link.
#[cfg(unix)]
fn open_no_follow(path: &Path, no_follow: bool) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let mut flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC;
    if no_follow {
        flags |= OFlags::NOFOLLOW;
    }
    let fd = rustix::fs::open(path, flags, Mode::empty())?;
    Ok(File::from(fd))
}

#[cfg(not(unix))]
fn open_no_follow(path: &Path, no_follow: bool) -> std::io::Result<File> {
    if no_follow && fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Err(std::io::Error::other("a symbolic link"));
    }
    File::open(path)
}

/// Whether an open failed because `path` is a symbolic link (refused, not followed).
pub(crate) fn is_symlink(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}
