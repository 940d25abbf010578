//! The reader-node cache: several readers on a node that is not the
//! trainer's fetch each version across once and share it through the
//! node's memory, as the node cache does for training.
//!
//! One reader of the node (the Python layer elects it through the Store)
//! starts a [`NodeCache`]: a thread that reads every new version whole
//! from the trainer ranks with its own [`WeightReader`] (libfabric for
//! remote ranks) and publishes it into copies of their slots that it
//! serves with `shm` ([`WeightServer`]s of its own, one per trainer rank,
//! same layout, the header marked as a cache's). Every reader of the node,
//! the fetching one too, reads those copies by the same sequence-word
//! rules: the cache publishes a version only after it read it whole, so a
//! read of the copies is whole exactly when it would be of the trainer's
//! slots. The copies lag the trainer by one fetch.
//!
//! A failed fetch (a trainer rank dead or cut off) is written into every
//! copy's header (the rank, [`slots::OFF_FAILED`]); a fetching process
//! that is gone is seen by its `shm` liveness. Either way the node's
//! readers fail naming the rank ([`WeightReader`]'s cache check), never
//! read a stale version as the newest.
//!
//! This module owns the fetch loop; it uses the reader and the server as
//! they are and touches nothing of the engine.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::slots::{self, OFF_CACHE, OFF_FAILED};
use super::{node_id, Outcome, Owner, ReadOptions, Serve, Want, WeightReader, WeightServer};
use crate::sync::{AtomicU64, Ordering};
use crate::Result;

/// What the fetch thread and the cache's owner share.
#[derive(Debug)]
struct Shared {
    reader: Arc<WeightReader>,
    copies: Vec<WeightServer>,
    timeout: Duration,
    stop: AtomicBool,
    fetched: AtomicU64,
    failure: Mutex<Option<String>>,
}

/// A node's copies of the trainer's slots and the thread that fills them.
/// See the module docs.
#[derive(Debug)]
pub struct NodeCache {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl NodeCache {
    /// Serves copies of `reader`'s owners' slots under `job_key` /
    /// `job_id` (a job id of the node's own) and starts fetching every new
    /// version into them; `timeout` bounds each fetch.
    pub fn start(
        reader: Arc<WeightReader>,
        job_key: &str,
        job_id: &str,
        timeout: Duration,
    ) -> Result<NodeCache> {
        let world = reader.owners.len();
        let copies = reader
            .owners
            .iter()
            .enumerate()
            .map(|(r, o)| {
                let s =
                    WeightServer::new(r, world, job_key, job_id, o.layout, Serve::Shm, timeout)?;
                s.word(OFF_CACHE).store(1, Ordering::Release);
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            reader,
            copies,
            timeout,
            stop: AtomicBool::new(false),
            fetched: AtomicU64::new(0),
            failure: Mutex::new(None),
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("odc-weights-cache".into())
            .spawn(move || fetch_loop(&worker))?;
        Ok(NodeCache {
            shared,
            thread: Some(thread),
        })
    }

    /// The copies, as readers of this node connect to them.
    pub fn owners(&self) -> Vec<Owner> {
        let node = node_id();
        self.shared
            .copies
            .iter()
            .map(|s| Owner {
                endpoint: s.endpoint(),
                region: s.desc(),
                layout: s.layout(),
                node: node.clone(),
                fabric: None,
                fabric_error: Some("a node cache's copy".into()),
            })
            .collect()
    }

    /// Versions fetched across so far.
    pub fn fetched(&self) -> u64 {
        self.shared.fetched.load(Ordering::Acquire)
    }

    /// Why the fetch thread stopped, if it did.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().ok().and_then(|f| f.clone())
    }
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                eprintln!("odc: the weight node cache's fetch thread panicked");
            }
        }
    }
}

/// Fetches every new version whole into the copies until stopped or a
/// fetch fails (then marks every copy failed, naming the trainer rank).
fn fetch_loop(sh: &Shared) {
    let mut bufs: Vec<Vec<u8>> = sh
        .reader
        .owners
        .iter()
        .map(|o| vec![0u8; o.layout.slot_bytes])
        .collect();
    let mut last: Option<u64> = None;
    let (idle_min, idle_max) = (Duration::from_micros(100), Duration::from_millis(5));
    let mut nap = idle_min;
    while !sh.stop.load(Ordering::Acquire) {
        match fetch_once(sh, &mut bufs, last) {
            Ok(Some(v)) => {
                last = Some(v);
                sh.fetched.fetch_add(1, Ordering::AcqRel);
                nap = idle_min;
            }
            Ok(None) => {
                std::thread::sleep(nap);
                nap = (nap * 2).min(idle_max);
            }
            Err(e) => {
                let owner = e.blamed_peer().unwrap_or(0) as u64;
                for c in &sh.copies {
                    c.word(OFF_FAILED).store(owner + 1, Ordering::Release);
                }
                if let Ok(mut f) = sh.failure.lock() {
                    *f = Some(e.to_string());
                }
                return;
            }
        }
    }
}

/// One fetch: the version published, or `None` when there is nothing newer
/// than `last` (or it was overwritten while fetched: the next try takes a
/// newer one).
fn fetch_once(sh: &Shared, bufs: &mut [Vec<u8>], last: Option<u64>) -> Result<Option<u64>> {
    let newest = match slots::newest_whole(&sh.reader.latest()?) {
        Ok(v) => v,
        Err(_) => return Ok(None),
    };
    if last.is_some_and(|l| newest <= l) {
        return Ok(None);
    }
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let opts = ReadOptions {
        at: 0,
        timeout: sh.timeout,
        retries: 16,
    };
    let got = match sh.reader.read(Want::Latest, &mut views, opts)? {
        Outcome::Got(g) if last.is_none_or(|l| g.version > l) => g,
        _ => return Ok(None),
    };
    for (c, b) in sh.copies.iter().zip(bufs.iter()) {
        c.publish(got.version, &[(0, b)])?;
    }
    Ok(Some(got.version))
}
