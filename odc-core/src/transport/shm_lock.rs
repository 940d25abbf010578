//! Liveness of a shared-memory segment's creator, from the kernel: the
//! creator holds a shared open-file-description lock (`F_OFD_SETLKW`,
//! `F_RDLCK`, the whole file) on the segment for as long as it lives, and
//! the kernel releases it when the last descriptor of that description
//! closes — at the latest when the process dies, by any signal. Locks live
//! on the file, so they are seen across pid namespaces (containers sharing
//! `/dev/shm`), where pid numbers name other processes or none.
//!
//! OFD locks (unlike POSIX record locks) conflict between two descriptions
//! in one process, so ranks that share a process (tests, two engines) see
//! each other, and closing some other descriptor of the file does not drop
//! them. A `fork` copies the descriptors, and with them the lock: a fork
//! handler points the child's copies at `/dev/null`, so a forked child
//! (a data-loader worker) never keeps a dead rank looking alive.
//!
//! This module owns the locks and the fork handler; it knows nothing of
//! segment names or layouts.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

use crate::{Error, Result};

/// Most lock descriptors a process tracks for the fork handler; beyond
/// that a forked child keeps the lock (and a dead rank looks alive until
/// the child exits).
const TRACKED: usize = 512;
static LOCK_FDS: [AtomicI32; TRACKED] = [const { AtomicI32::new(-1) }; TRACKED];
static FORK_HANDLER: Once = Once::new();

extern "C" fn drop_locks_in_child() {
    // Only async-signal-safe calls here: open, dup2, close.
    // SAFETY: a NUL-terminated path; flags are plain integers.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if null < 0 {
        return;
    }
    for slot in &LOCK_FDS {
        let fd = slot.load(Ordering::Relaxed);
        if fd >= 0 {
            // The child's descriptor number stays taken (its owner still
            // closes it), but no longer refers to the locked description.
            // SAFETY: both are descriptors of this (child) process.
            unsafe { libc::dup2(null, fd) };
        }
    }
    // SAFETY: opened above.
    unsafe { libc::close(null) };
}

fn track(fd: RawFd) {
    FORK_HANDLER.call_once(|| {
        // SAFETY: registers a handler that only makes async-signal-safe
        // calls; it lives for the whole process.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(drop_locks_in_child)) };
        if rc != 0 {
            eprintln!("odc: pthread_atfork failed ({rc}): forked children keep segment locks");
        }
    });
    for slot in &LOCK_FDS {
        if slot
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

fn untrack(fd: RawFd) {
    for slot in &LOCK_FDS {
        if slot
            .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

fn flock(kind: libc::c_short) -> libc::flock {
    // SAFETY: `flock` is plain data; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    // l_start = 0, l_len = 0: the whole file; l_pid must be 0 for OFD locks.
    l
}

/// Takes lock `kind` (`F_RDLCK` / `F_WRLCK`) on `file` without waiting;
/// whether it was granted. Dropping `file` releases it.
pub(crate) fn try_lock(file: &File, kind: libc::c_short) -> bool {
    let l = flock(kind);
    // SAFETY: a valid descriptor and a valid flock for the call.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) == 0 }
}

/// A segment's open description, either holding its creator's liveness
/// lock or used to probe a peer's.
#[derive(Debug)]
pub(crate) struct LockFile {
    file: File,
    holds: bool,
}

impl LockFile {
    /// Takes the creator's shared lock on `file` (waiting out a sweeper
    /// that holds it for a moment); `name` is for the error.
    pub(crate) fn hold(file: File, name: &str) -> Result<LockFile> {
        let l = flock(libc::F_RDLCK as libc::c_short);
        // Tracked before it is locked: a fork by another thread between the
        // two would otherwise give the child the lock.
        track(file.as_raw_fd());
        loop {
            // SAFETY: a valid descriptor and a valid flock for the call.
            let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLKW, &l) };
            if rc == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                untrack(file.as_raw_fd());
                return Err(Error::transport_io(
                    "fcntl(F_OFD_SETLKW)",
                    format!("lock {name}"),
                    e,
                ));
            }
        }
        Ok(LockFile { file, holds: true })
    }

    /// A peer's segment, to probe its creator's lock.
    pub(crate) fn probe(file: File) -> LockFile {
        LockFile { file, holds: false }
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Whether some other open description (a live creator) holds a lock
    /// on the file; `true` when the kernel cannot say.
    pub(crate) fn held(&self) -> bool {
        let mut l = flock(libc::F_WRLCK as libc::c_short);
        // SAFETY: a valid descriptor and a valid flock the call fills in.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
        rc != 0 || l.l_type != libc::F_UNLCK as libc::c_short
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        if self.holds {
            // Released while still tracked, then untracked, then closed: a
            // fork by another thread at any point in between gives the child
            // no lock (before the release its copy is pointed elsewhere).
            let l = flock(libc::F_UNLCK as libc::c_short);
            // SAFETY: a valid descriptor and a valid flock for the call.
            unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
            untrack(self.file.as_raw_fd());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The segment file, opened read-write (created on first use).
    fn open_rw(path: &std::path::Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap()
    }

    #[test]
    fn a_held_lock_is_seen_until_its_holder_closes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let open = || open_rw(&path);
        let owner = LockFile::hold(open(), "seg").unwrap();
        let prober = LockFile::probe(open());
        assert!(prober.held());
        // A sweeper cannot take it while it is held, even in this process.
        assert!(!try_lock(&open(), libc::F_WRLCK as libc::c_short));
        drop(owner);
        assert!(!prober.held());
        assert!(try_lock(&open(), libc::F_WRLCK as libc::c_short));
    }

    #[test]
    fn a_forked_child_does_not_keep_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let open = || open_rw(&path);
        let prober = LockFile::probe(open());
        let owner = LockFile::hold(open(), "seg").unwrap();
        // SAFETY: the child only sleeps and exits (async-signal-safe).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: plain libc calls in the child.
            unsafe {
                libc::sleep(3);
                libc::_exit(0);
            }
        }
        assert!(pid > 0);
        drop(owner);
        // The parent let go; the child (asleep for 3 s) lets go as soon as
        // its fork handler ran.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut held = prober.held();
        while held && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
            held = prober.held();
        }
        // SAFETY: reaps our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert!(!held, "a forked child kept its parent's segment lock");
    }
}
