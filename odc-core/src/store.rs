//! Rendezvous: the [`Store`] trait (a tiny key-value store every rank can
//! reach) and [`FileStore`], a directory-backed implementation for one node
//! and for tests. torch's `TCPStore` implements the trait from Python.
//!
//! The engine uses the store only at setup (job id, registration hashes,
//! region descriptors); nothing on the data path touches it.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// A key-value store shared by every rank of a job.
///
/// Object-safe and minimal so that foreign stores (torch's `TCPStore`
/// through Python callbacks) can implement it. Every blocking call has a
/// deadline.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, or `None` when it is not set.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Blocks until every key in `keys` is set, or fails at `deadline`.
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()>;
    /// Atomically adds `delta` to the integer at `key` (0 when unset) and
    /// returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// The values of `keys`, in order; every key must be set (call it after
    /// [`wait`](Store::wait)). A store that can answer in one round trip
    /// (torch's `multi_get`) should: registration reads every rank's posts
    /// this way, so that a job of D ranks sends its store O(D) requests
    /// rather than O(D²). The default reads the keys one by one.
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        get_each(self, keys)
    }

    /// Atomically sets `key` to `desired` if it holds `expected` (`None`:
    /// unset), and returns the value it holds after the call: `desired`
    /// when this call swapped it in, else the value that stopped it (torch's
    /// `Store.compare_set`). Values compared are never empty. A caller
    /// tells its own swap from another's only by a value no other caller
    /// writes (two callers swapping in the same value both read it back).
    /// Only elastic membership rounds use it ([`crate::elastic`]); the
    /// default refuses (a store without it cannot run them).
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let _ = (expected, desired);
        Err(Error::Store {
            op: "compare_set",
            key: key.to_owned(),
            detail: "this store has no compare-and-set".into(),
        })
    }
}

/// The values of `keys` read one by one, each required to be set: what
/// [`Store::multi_get`] does on a store that cannot batch.
pub fn get_each<S: Store + ?Sized>(store: &S, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
    keys.iter()
        .map(|k| {
            store.get(k)?.ok_or_else(|| Error::Store {
                op: "get",
                key: (*k).to_owned(),
                detail: "key not set".into(),
            })
        })
        .collect()
}

/// Waits for `key` and returns its value.
pub(crate) fn wait_get(store: &dyn Store, key: &str, deadline: Instant) -> Result<Vec<u8>> {
    store.wait(&[key], deadline)?;
    store.get(key)?.ok_or_else(|| Error::Store {
        op: "get",
        key: key.to_owned(),
        detail: "key vanished after wait".into(),
    })
}

/// Waits for every key in `keys` and returns their values, in order: one
/// wait and one [`Store::multi_get`]. When the deadline passes, the error
/// names the first key that is still missing (the rank that never posted).
pub(crate) fn wait_get_all(
    store: &dyn Store,
    keys: &[&str],
    deadline: Instant,
) -> Result<Vec<Vec<u8>>> {
    if let Err(e) = store.wait(keys, deadline) {
        for k in keys {
            if matches!(store.get(k), Ok(None)) {
                return Err(Error::Store {
                    op: "wait",
                    key: (*k).to_owned(),
                    detail: "deadline passed before the key was set (is every rank running?)"
                        .into(),
                });
            }
        }
        return Err(e);
    }
    let values = store.multi_get(keys)?;
    if values.len() != keys.len() {
        return Err(Error::Store {
            op: "multi_get",
            key: keys.first().map(|k| (*k).to_owned()).unwrap_or_default(),
            detail: format!("{} values for {} keys", values.len(), keys.len()),
        });
    }
    Ok(values)
}

/// A [`Store`] backed by a directory: one file per key, written to a
/// temporary name and renamed into place so readers never see half a value.
///
/// Every process that opens the same directory shares the store. Keys may
/// contain `/`; they are escaped into flat file names.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Opens (creating if needed) a store in `dir`.
    pub fn new(dir: impl AsRef<Path>) -> Result<FileStore> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::Store {
            op: "open",
            key: String::new(),
            detail: format!("cannot create {}: {e}", dir.display()),
        })?;
        Ok(FileStore { dir })
    }

    /// The directory backing the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        let mut name = String::with_capacity(key.len() + 4);
        name.push_str("k_");
        for b in key.bytes() {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
                name.push(char::from(b));
            } else {
                name.push_str(&format!("%{b:02x}"));
            }
        }
        self.dir.join(name)
    }

    fn err(op: &'static str, key: &str, e: impl std::fmt::Display) -> Error {
        Error::Store {
            op,
            key: key.to_owned(),
            detail: e.to_string(),
        }
    }

    fn write_atomic(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key);
        let tmp =
            tempfile::NamedTempFile::new_in(&self.dir).map_err(|e| Self::err("set", key, e))?;
        tmp.as_file()
            .write_all(value)
            .map_err(|e| Self::err("set", key, e))?;
        tmp.persist(&path).map_err(|e| Self::err("set", key, e))?;
        Ok(())
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_atomic(key, value)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::File::open(self.path(key)) {
            Ok(mut f) => {
                let mut v = Vec::new();
                f.read_to_end(&mut v)
                    .map_err(|e| Self::err("get", key, e))?;
                Ok(Some(v))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Self::err("get", key, e)),
        }
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        let mut sleep = Duration::from_micros(200);
        for key in keys {
            let path = self.path(key);
            while !path.exists() {
                if Instant::now() >= deadline {
                    return Err(Self::err(
                        "wait",
                        key,
                        "deadline passed before the key was set",
                    ));
                }
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.locked("add", key, || {
            let new = added(key, self.get(key)?.as_deref(), delta)?;
            self.write_atomic(key, new.to_string().as_bytes())?;
            Ok(new)
        })
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.locked("compare_set", key, || {
            let cur = self.get(key)?;
            if cur.as_deref() == expected {
                self.write_atomic(key, desired)?;
                return Ok(desired.to_vec());
            }
            Ok(cur.unwrap_or_default())
        })
    }
}

impl FileStore {
    /// Runs `f` holding the advisory lock of `key` (a read-modify-write
    /// that no other `add` or `compare_set` of the key interleaves).
    fn locked<T>(&self, op: &'static str, key: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let lock_path = self.path(&format!("{key}.lock"));
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Self::err(op, key, e))?;
        let fd = lock.as_raw_fd();
        // SAFETY: `fd` is an open descriptor owned by `lock`, which outlives
        // the call; flock has no memory-safety preconditions.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(Self::err(op, key, std::io::Error::last_os_error()));
        }
        let result = f();
        // SAFETY: as above; unlocking a descriptor we locked.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        result
    }
}

/// What [`Store::add`] of `delta` stores over `current`, the value of
/// `key` (`None`: unset, counts as 0): a decimal integer, surrounding
/// blanks allowed. A value that is no integer, or a sum beyond `i64`, is an
/// [`Error::Store`] naming the key; the value is left as it was.
pub fn added(key: &str, current: Option<&[u8]>, delta: i64) -> Result<i64> {
    let err = |detail: &str| Error::Store {
        op: "add",
        key: key.to_owned(),
        detail: detail.to_owned(),
    };
    let current = match current {
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .ok_or_else(|| err("value is not an integer"))?,
        None => 0,
    };
    current
        .checked_add(delta)
        .ok_or_else(|| err(&format!("{current} + {delta} overflows a 64-bit integer")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn set_get_wait_add() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::new(dir.path()).unwrap();
        assert_eq!(s.get("a/b").unwrap(), None);
        s.set("a/b", b"hello").unwrap();
        assert_eq!(s.get("a/b").unwrap().as_deref(), Some(&b"hello"[..]));
        s.wait(&["a/b"], Instant::now()).unwrap();
        let err = s.wait(&["missing"], Instant::now() + Duration::from_millis(20));
        assert!(matches!(err, Err(Error::Store { op: "wait", .. })));
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.add("n", -5).unwrap(), -3);
    }

    #[test]
    fn compare_set_swaps_only_the_expected_value_and_counts_exactly_under_contention() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::new(dir.path()).unwrap());
        assert_eq!(s.compare_set("k", Some(b"x"), b"y").unwrap(), b"");
        assert_eq!(
            s.get("k").unwrap(),
            None,
            "an unset key is not swapped from a value"
        );
        assert_eq!(s.compare_set("k", None, b"1").unwrap(), b"1");
        assert_eq!(
            s.compare_set("k", None, b"2").unwrap(),
            b"1",
            "set: not swapped"
        );
        assert_eq!(s.compare_set("k", Some(b"1"), b"2").unwrap(), b"2");
        // 4 threads x 25 increments by compare-and-set, each retrying on a lost swap: exactly 100. Each value
        // names its writer: a swap is won when the value after it is this writer's (two writers swapping the
        // same count in would both read their value back, and one increment would be lost).
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        loop {
                            let cur = s.get("n").unwrap();
                            let text = cur
                                .as_deref()
                                .map(|b| std::str::from_utf8(b).unwrap().to_owned());
                            let v: u32 = text
                                .as_deref()
                                .map_or(0, |t| t.split('@').next().unwrap().parse().unwrap());
                            let want = format!("{}@{t}", v + 1);
                            if s.compare_set("n", cur.as_deref(), want.as_bytes()).unwrap()
                                == want.as_bytes()
                            {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let last = String::from_utf8(s.get("n").unwrap().unwrap()).unwrap();
        assert_eq!(last.split('@').next(), Some("100"), "{last}");
    }

    #[test]
    fn add_refuses_a_sum_beyond_64_bits_and_a_value_that_is_no_integer() {
        // `current + delta` overflowed (a panic in debug builds) on a
        // counter near i64::MAX.
        let max = i64::MAX.to_string();
        let e = added("n", Some(max.as_bytes()), 1).unwrap_err();
        assert!(
            matches!(&e, Error::Store { op: "add", key, .. } if key == "n"),
            "{e}"
        );
        assert!(added("n", Some(b"12abc"), 1).is_err());
        assert_eq!(added("n", Some(b" 41\n"), 1).unwrap(), 42);
        assert_eq!(added("n", None, -3).unwrap(), -3);
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::new(dir.path()).unwrap();
        s.set("n", max.as_bytes()).unwrap();
        assert!(s.add("n", 1).is_err());
        assert_eq!(s.get("n").unwrap().as_deref(), Some(max.as_bytes()));
    }

    #[test]
    fn wait_get_all_reads_in_order_and_names_the_first_missing_key() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::new(dir.path()).unwrap();
        for (k, v) in [("r/0", "a"), ("r/1", "bb"), ("r/3", "dddd")] {
            s.set(k, v.as_bytes()).unwrap();
        }
        let soon = || Instant::now() + Duration::from_millis(30);
        let got = wait_get_all(&s, &["r/1", "r/0"], soon()).unwrap();
        assert_eq!(got, vec![b"bb".to_vec(), b"a".to_vec()]);
        let err = wait_get_all(&s, &["r/0", "r/1", "r/2", "r/3"], soon()).unwrap_err();
        assert!(
            matches!(&err, Error::Store { op: "wait", key, .. } if key == "r/2"),
            "{err}"
        );
    }

    #[test]
    fn add_is_atomic_across_threads() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::new(dir.path()).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        s.add("ctr", 1).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(s.add("ctr", 0).unwrap(), 100);
    }
}
