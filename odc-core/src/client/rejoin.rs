//! Elastic rejoin: the copy of a live replica's state to a rank of a node
//! that joins a new generation ([`crate::elastic::await_admission`]).
//!
//! Under hybrid sharding rank `(m, l)` (node `m`, local rank `l`) and rank
//! `(j, l)` hold the same shard of every bucket, so the joiner `(j, l)`
//! copies `(m, l)`'s state, whatever it is (the parameter shards, the
//! optimizer's state of them, counters: the caller's bytes). The copy runs
//! once, at the start of the generation, before any publish: the source
//! stages its state in its published-shards region, one region's worth at
//! a time, and the joiner reads each chunk one-sidedly. The handshake is
//! two counters per pair in the job's store: `{prefix}/state/{source}/ready`
//! (chunks staged) and `{prefix}/state/{reader}/read` (chunks read); the
//! source stages chunk `c + 1` only once every live reader read chunk `c`.
//! No memory beyond the generation's own regions, and no wait beyond the
//! copy: a reader that dies is left behind (the generation's first round
//! drops its node), a source that dies fails its readers, naming it.

use std::time::{Duration, Instant};

use super::Host;
use crate::engine::load;
use crate::wait::PeerStatus;
use crate::{Error, Result};

/// How often a copy's wait looks at its peer's liveness.
const PROBE: Duration = Duration::from_millis(100);

impl Host<'_> {
    fn state_key(&self, rank: usize, what: &str) -> String {
        format!("{}/state/{rank}/{what}", self.w.core.config.store_prefix)
    }

    fn state_counter(&self, rank: usize, what: &str) -> Result<Option<u64>> {
        let key = self.state_key(rank, what);
        let Some(raw) = self.w.core.store.get(&key)? else {
            return Ok(None);
        };
        let text = String::from_utf8_lossy(&raw);
        text.trim().parse().map(Some).map_err(|_| Error::Store {
            op: "get",
            key,
            detail: format!("state copy: unreadable value {text:?}"),
        })
    }

    /// Polls `done` until it holds, checking `peer`'s liveness every
    /// [`PROBE`]: `Ok(false)` when `peer` is gone first (`Ok(true)` when
    /// done), a [`Error::PeerTimeout`] at the engine's deadline.
    fn copy_wait(
        &self,
        peer: usize,
        waited_for: &dyn Fn() -> String,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<bool> {
        let core = self.w.core;
        let start = Instant::now();
        let deadline = start + core.config.timeout;
        let (mut nap, mut probe) = (Duration::from_micros(200), start + PROBE);
        loop {
            if done()? {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= probe {
                if core.transport.peer_status(peer) != PeerStatus::Alive {
                    return Ok(false);
                }
                probe = now + PROBE;
            }
            if now >= deadline {
                return Err(Error::PeerTimeout {
                    peer,
                    bucket: None,
                    waited_for: waited_for(),
                    after: now - start,
                });
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    /// The chunk a copy moves at a time: the published-shards region.
    fn state_chunk(&self) -> Result<usize> {
        match self.w.reg.params.len() {
            0 => Err(Error::Config(
                "the state copy stages through the published shards, which this engine keeps \
                 in device memory: rejoin runs on the host transports"
                    .into(),
            )),
            n => Ok(n),
        }
    }

    /// Serves `state` (this rank's replica state) to `readers` (the ranks
    /// of joining nodes that copy this rank's), at the start of an elastic
    /// generation, before any publish of it (else an error: the region it
    /// stages through holds published shards). Returns once every reader
    /// read it all or is gone.
    pub fn serve_state(&self, state: &[u8], readers: &[usize]) -> Result<()> {
        let (core, reg) = (self.w.core, self.w.reg);
        let _guard = core
            .publish_lock
            .lock()
            .map_err(|_| Error::protocol(None, "a publish panicked"))?;
        let me = reg.groups.me;
        if (0..reg.buckets.len()).any(|b| load(reg.word(reg.ctrl_layout.seen_version(me, b))) != 0)
        {
            return Err(Error::protocol(
                None,
                "the state copy runs at the start of a generation, before its first publish",
            ));
        }
        let rank = core.topo.rank();
        let chunk = self.state_chunk()?;
        let chunks = state.len().div_ceil(chunk) as u64;
        let len = state.len().to_string();
        core.store
            .set(&self.state_key(rank, "len"), len.as_bytes())?;
        let mut live: Vec<usize> = readers.to_vec();
        for c in 0..chunks {
            if c > 0 {
                self.wait_readers(&mut live, c)?;
            }
            let at = usize::try_from(c).unwrap_or(usize::MAX) * chunk;
            let part = &state[at..state.len().min(at + chunk)];
            // SAFETY: the region is this rank's published shards, which no
            // one reads before its first publish (checked above; the publish
            // lock keeps a publish out meanwhile), and readers read chunk c
            // only after this rank announces it below.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), reg.params.as_ptr(), part.len())
            };
            let ready = (c + 1).to_string();
            core.store
                .set(&self.state_key(rank, "ready"), ready.as_bytes())?;
        }
        self.wait_readers(&mut live, chunks)
    }

    /// Waits until every rank of `live` read `chunks` chunks, leaving out
    /// (and dropping from `live`) one that is gone.
    fn wait_readers(&self, live: &mut Vec<usize>, chunks: u64) -> Result<()> {
        let mut gone = Vec::new();
        for &r in live.iter() {
            let what = || format!("rank {r} to copy chunk {chunks} of this rank's replica state");
            let read = self.copy_wait(r, &what, || {
                Ok(self.state_counter(r, "read")?.unwrap_or(0) >= chunks)
            })?;
            if !read {
                gone.push(r);
            }
        }
        live.retain(|r| !gone.contains(r));
        Ok(())
    }

    /// Reads rank `source`'s replica state (it serves it with
    /// [`Host::serve_state`]) into `out`, which must be as long.
    pub fn read_state(&self, source: usize, out: &mut [u8]) -> Result<()> {
        let (core, reg) = (self.w.core, self.w.reg);
        let rank = core.topo.rank();
        if source >= core.topo.world() || !reg.groups.replicas.contains(&source) || source == rank {
            return Err(Error::Config(format!(
                "rank {source} holds no replica of rank {rank}'s shards (the same local rank \
                 on another node)"
            )));
        }
        let died = |waited_for: String| Error::PeerDied {
            peer: source,
            pid: 0,
            bucket: None,
            waited_for,
            reported_by: None,
        };
        let mut len = None;
        let what = || "its replica state's length".to_owned();
        if !self.copy_wait(source, &what, || {
            len = self.state_counter(source, "len")?;
            Ok(len.is_some())
        })? {
            return Err(died(what()));
        }
        let len = usize::try_from(len.unwrap_or(0)).unwrap_or(usize::MAX);
        if len != out.len() {
            return Err(Error::Config(format!(
                "rank {source} serves {len} bytes of replica state, this rank expects {}: the \
                 joiner's state must be laid out as its source's",
                out.len()
            )));
        }
        let chunk = self.state_chunk()?;
        let remote = reg.peer_params[source];
        for (c, dst) in out.chunks_mut(chunk).enumerate() {
            let c = c as u64;
            let what = || format!("chunk {c} of its replica state");
            if !self.copy_wait(source, &what, || {
                Ok(self.state_counter(source, "ready")?.unwrap_or(0) > c)
            })? {
                return Err(died(what()));
            }
            core.transport
                .get(source, &remote, 0, dst)
                .map_err(|e| core.attribute(None, e))?;
            let read = (c + 1).to_string();
            core.store
                .set(&self.state_key(rank, "read"), read.as_bytes())?;
        }
        Ok(())
    }
}
