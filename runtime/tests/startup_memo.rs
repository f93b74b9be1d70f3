//! The start-up memo (`backend.json`): plugin digests and python3's site-packages remembered
//! across processes, worked out again when the file or interpreter changes, and never
//! believed from a file that is corrupt or that someone else could have written.
#![cfg(unix)]
#![allow(missing_docs)]

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::TempDir;
use nitro::backend::pjrt::{Discovery, Platform, Source, StartupMemo, STARTUP_MEMO_FILE};
use nitro::Digest;

/// A private scratch directory holding a memo path and a small file standing in for a plugin.
fn setup(tag: &str) -> (TempDir, StartupMemo, PathBuf) {
    let tmp = TempDir::new(tag);
    fs::create_dir_all(tmp.path()).unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
    let memo = StartupMemo::at(tmp.path().join(STARTUP_MEMO_FILE));
    let file = tmp.path().join("plugin.so");
    fs::write(&file, b"not really a plugin, but bytes to hash").unwrap();
    (tmp, memo, file)
}

fn blake3_of(path: &Path) -> Digest {
    Digest::from(blake3::hash(&fs::read(path).unwrap()))
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn a_digest_is_remembered_until_the_file_changes() {
    let (_tmp, memo, file) = setup("memo-digest");
    let (d, source) = memo.file_digest(&file).unwrap();
    assert_eq!((d, source), (blake3_of(&file), Source::Computed));
    assert_eq!(mode(memo.path()), 0o600, "owner-only");
    assert_eq!(
        memo.file_digest(&file).unwrap(),
        (d, Source::Memo),
        "remembered: not hashed again"
    );

    // Another size.
    fs::write(
        &file,
        b"a different plugin build, longer than the first one",
    )
    .unwrap();
    let (d2, source) = memo.file_digest(&file).unwrap();
    assert_eq!((d2, source), (blake3_of(&file), Source::Computed));
    assert_ne!(d2, d);
    assert_eq!(memo.file_digest(&file).unwrap(), (d2, Source::Memo));

    // The same size, rewritten in place, with its modification time set back (as `cp -p` or
    // an installer that keeps times would): the change time still moves.
    let before = fs::metadata(&file).unwrap().modified().unwrap();
    let mut bytes = fs::read(&file).unwrap();
    bytes[0] ^= 0xff;
    std::thread::sleep(Duration::from_millis(20));
    fs::write(&file, &bytes).unwrap();
    fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(before)
        .unwrap();
    let (d3, source) = memo.file_digest(&file).unwrap();
    assert_eq!((d3, source), (blake3_of(&file), Source::Computed));
    assert_ne!(d3, d2);

    // Only the modification time moves: hashed again.
    fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    assert_eq!(memo.file_digest(&file).unwrap().1, Source::Computed);

    // Replaced by another file (a new inode) with the same bytes: hashed again, same digest.
    let copy = file.with_extension("new");
    fs::copy(&file, &copy).unwrap();
    fs::rename(&copy, &file).unwrap();
    assert_eq!(memo.file_digest(&file).unwrap(), (d3, Source::Computed));
}

#[test]
fn a_corrupt_memo_is_ignored_and_rewritten() {
    let (_tmp, memo, file) = setup("memo-corrupt");
    memo.file_digest(&file).unwrap();
    for garbage in [
        &b"{ not json"[..],
        b"",
        b"\xff\xfe\x00",
        br#"{"version": 99}"#,
    ] {
        fs::write(memo.path(), garbage).unwrap();
        assert_eq!(
            memo.file_digest(&file).unwrap(),
            (blake3_of(&file), Source::Computed),
            "{garbage:?}: ignored, never an error"
        );
        let text = fs::read_to_string(memo.path()).unwrap();
        assert!(
            serde_json::from_str::<serde_json::Value>(&text).is_ok(),
            "rewritten: {text}"
        );
        assert_eq!(memo.file_digest(&file).unwrap().1, Source::Memo);
    }
}

#[test]
fn a_memo_others_could_have_written_is_not_believed() {
    let (tmp, memo, file) = setup("memo-untrusted");
    let truth = blake3_of(&file);
    memo.file_digest(&file).unwrap();
    // A forged digest under the right stamp: what an attacker would write.
    let forged = fs::read_to_string(memo.path())
        .unwrap()
        .replace(&truth.to_string(), &"0".repeat(64));
    assert_ne!(forged, fs::read_to_string(memo.path()).unwrap());

    // Writable by others: ignored, then rewritten owner-only.
    fs::write(memo.path(), &forged).unwrap();
    fs::set_permissions(memo.path(), fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Computed));
    assert_eq!(mode(memo.path()), 0o600);
    assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Memo));

    // A symbolic link to a forged memo: not followed, and replaced (the target is untouched).
    let elsewhere = tmp.path().join("elsewhere.json");
    fs::write(&elsewhere, &forged).unwrap();
    fs::remove_file(memo.path()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, memo.path()).unwrap();
    assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Computed));
    assert!(!fs::symlink_metadata(memo.path())
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read_to_string(&elsewhere).unwrap(), forged);

    // Owned by another user (only root can arrange that).
    if rustix::process::geteuid().is_root() {
        fs::write(memo.path(), &forged).unwrap();
        fs::set_permissions(memo.path(), fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(memo.path(), Some(12_345), Some(12_345)).unwrap();
        assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Computed));
    }

    // In a directory others can write: never read, never written.
    fs::write(memo.path(), &forged).unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Computed));
    assert_eq!(memo.file_digest(&file).unwrap(), (truth, Source::Computed));
    assert_eq!(fs::read_to_string(memo.path()).unwrap(), forged);
}

/// A stand-in `python3`: a real executable that counts its runs in `counter` and prints
/// `site` as its only site-packages directory.
fn fake_python(dir: &Path, counter: &Path, site: &Path) -> PathBuf {
    let python = dir.join("python3");
    fs::write(
        &python,
        format!(
            "#!/bin/sh\necho run >> '{}'\necho '{}'\n",
            counter.display(),
            site.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
    python
}

fn runs(counter: &Path) -> usize {
    fs::read_to_string(counter).map_or(0, |t| t.lines().count())
}

#[test]
fn site_packages_are_remembered_until_the_interpreter_or_plugins_change() {
    let (tmp, memo, _) = setup("memo-site");
    let site = tmp.path().join("site-packages");
    let known = &nitro::backend::pjrt::KNOWN_PLUGINS[0];
    let plugin = site.join(known.file);
    fs::create_dir_all(plugin.parent().unwrap()).unwrap();
    fs::write(&plugin, b"a plugin").unwrap();
    let counter = tmp.path().join("runs");
    let python = fake_python(tmp.path(), &counter, &site);

    assert_eq!(
        memo.site_packages(&python),
        (vec![site.clone()], Source::Computed)
    );
    assert_eq!(runs(&counter), 1);
    assert_eq!(
        memo.site_packages(&python),
        (vec![site.clone()], Source::Memo)
    );
    assert_eq!(runs(&counter), 1, "a warm process starts no interpreter");

    // Discovery over the remembered directories still follows the platform setting.
    let over = |platform| Discovery {
        explicit: None,
        platform,
        site_dirs: vec![site.clone()],
    };
    let want = match known.platform {
        Platform::Cpu => (Some(plugin.clone()), None),
        Platform::Cuda => (None, Some(plugin.clone())),
    };
    assert_eq!(over(Some(Platform::Cpu)).find().unwrap(), want.0);
    assert_eq!(over(Some(Platform::Cuda)).find().unwrap(), want.1);

    // The plugin is gone: the interpreter is asked again.
    fs::remove_file(&plugin).unwrap();
    assert_eq!(memo.site_packages(&python).1, Source::Computed);
    assert_eq!(runs(&counter), 2);
    fs::write(&plugin, b"a plugin").unwrap();
    assert_eq!(memo.site_packages(&python).1, Source::Memo);
    assert_eq!(runs(&counter), 2);

    // Another interpreter at the same path (upgraded, or a venv recreated): asked again.
    let other_site = tmp.path().join("other-site");
    fs::create_dir_all(other_site.join(known.file).parent().unwrap()).unwrap();
    fs::write(other_site.join(known.file), b"another plugin").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    fs::remove_file(&python).unwrap();
    fake_python(tmp.path(), &counter, &other_site);
    assert_eq!(
        memo.site_packages(&python),
        (vec![other_site.clone()], Source::Computed)
    );
    assert_eq!(runs(&counter), 3);
    assert_eq!(memo.site_packages(&python).1, Source::Memo);
}
