//! An in-memory [`Store`] for the targets that drive the store's side of a
//! protocol (membership rounds, generation records): the same semantics as
//! `FileStore` (`add` through [`odc_core::store::added`], `compare_set`
//! from absent or from an exact value), without a file system, so that an
//! execution costs microseconds and leaves nothing behind.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use odc_core::store::added;
use odc_core::{Error, Result, Store};

/// Keys and values, behind one lock.
#[derive(Debug, Default)]
pub struct MemStore {
    values: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemStore {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Vec<u8>>) -> T) -> T {
        let mut v = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut v)
    }

    /// Every key and value now (for properties over the whole store).
    pub fn snapshot(&self) -> BTreeMap<String, Vec<u8>> {
        self.with(|v| v.clone())
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.with(|v| v.insert(key.to_owned(), value.to_vec()));
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.with(|v| v.get(key).cloned()))
    }

    fn wait(&self, keys: &[&str], _deadline: Instant) -> Result<()> {
        // Nothing else writes: a key missing now stays missing.
        match keys.iter().find(|k| self.with(|v| !v.contains_key(**k))) {
            None => Ok(()),
            Some(k) => Err(Error::Store {
                op: "wait",
                key: (*k).to_owned(),
                detail: "deadline passed before the key was set".into(),
            }),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.with(|v| {
            let new = added(key, v.get(key).map(Vec::as_slice), delta)?;
            v.insert(key.to_owned(), new.to_string().into_bytes());
            Ok(new)
        })
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.with(|v| {
            let cur = v.get(key).cloned();
            if cur.as_deref() == expected {
                v.insert(key.to_owned(), desired.to_vec());
                return Ok(desired.to_vec());
            }
            Ok(cur.unwrap_or_default())
        })
    }
}

/// The value of a call that cannot fail on a [`MemStore`] (a write, or a
/// read of what the target wrote itself).
pub fn must<T>(r: Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}
