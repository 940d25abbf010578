//! Every wait on a peer: spin briefly, then sleep on this rank's bell
//! (a futex in its own memory, rung by whoever writes the awaited word),
//! probe the awaited peer's liveness every [`LIVENESS_PERIOD`], and fail at
//! the deadline naming the peer — never a silent hang. Also the blame rule:
//! which rank an error names when a peer died because a third rank did.
//!
//! The decisions are pure ([`Pace`] with the clock as an input, [`blame`]);
//! [`Waiter`] carries them out through [`Bells`], which every transport
//! implements. This module sits below the transports: it knows the bells,
//! not how they ring.

use std::time::{Duration, Instant};

use crate::region::Bell;
use crate::sync::Backoff;
use crate::{Error, Result};

/// How often a sleeping waiter checks that the peer it waits for is alive.
pub const LIVENESS_PERIOD: Duration = Duration::from_millis(50);

/// What a liveness probe learned about a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerStatus {
    /// Running, as far as the backend can tell.
    Alive,
    /// Its process is gone or it closed its engine; or (a network peer,
    /// whose probe reads its blame) it runs but failed on a wait for the
    /// third rank it blames, so it will not deliver either.
    Dead {
        /// Its process id (0 when unknown).
        pid: u32,
        /// The rank it blamed for its own failure, if it failed on a peer.
        blamed: Option<usize>,
    },
    /// Not reached (its probe is pending or failed to say), but rank `by`
    /// failed because of it: `by` recorded it as the rank it blames, which
    /// a rank does only when a wait on it failed. The job cannot go on
    /// without `by` either, so the waiter fails now, naming the peer and
    /// `by`, instead of waiting out a probe's timeout.
    Reported {
        /// The rank whose failure named this peer.
        by: usize,
    },
}

/// What a waiter needs from the transport: this rank's bells, peers'
/// liveness, and where to record whom this rank blames (peers read it when
/// this rank closes).
pub trait Bells {
    /// The current epoch of `bell`; read it before checking the condition.
    fn bell_epoch(&self, bell: Bell) -> u32;
    /// Sleeps while `bell`'s epoch is `epoch`, at most `timeout`.
    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()>;
    /// Probes `peer`.
    fn peer_status(&self, peer: usize) -> PeerStatus;
    /// Records `peer` as the rank this rank's failure is blamed on.
    fn set_blame(&self, peer: usize);
}

/// The next thing a waiter does, decided from the clock alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Spin or yield, then check again.
    Spin,
    /// Probe the awaited peer's liveness (then sleep).
    Probe,
    /// Sleep on the bell for at most this long.
    Sleep(Duration),
    /// The deadline passed.
    Expired,
}

/// Spin → sleep → liveness probe → deadline, as a state machine over the
/// time the caller passes in.
#[derive(Debug)]
pub struct Pace {
    backoff: Backoff,
    deadline: Instant,
    next_probe: Instant,
}

impl Pace {
    /// A wait that started at `start` and may last `timeout`.
    pub fn new(start: Instant, timeout: Duration) -> Pace {
        Pace {
            backoff: Backoff::new(),
            deadline: start + timeout,
            next_probe: start,
        }
    }

    /// Whether spinning is over (the caller then reads the bell's epoch
    /// before its last check).
    pub fn spun(&self) -> bool {
        self.backoff.is_completed()
    }

    /// The step after a check that found the condition still pending.
    pub fn step(&mut self, now: Instant) -> Step {
        if !self.backoff.is_completed() {
            self.backoff.snooze();
            return Step::Spin;
        }
        if now >= self.next_probe {
            self.next_probe = now + LIVENESS_PERIOD;
            return Step::Probe;
        }
        if now >= self.deadline {
            return Step::Expired;
        }
        Step::Sleep(LIVENESS_PERIOD.min(self.deadline - now))
    }

    /// The step after a probe that found the peer alive.
    pub fn after_probe(&self, now: Instant) -> Step {
        if now >= self.deadline {
            return Step::Expired;
        }
        Step::Sleep(LIVENESS_PERIOD.min(self.deadline - now))
    }
}

/// Whom an error names when `peer` turned out dead: the rank it blamed for
/// its own failure, if that is a third rank of the job (it closed because
/// that one died), else itself. Returns the rank to blame and, when it is a
/// third rank, `peer` as the one that reported it.
pub fn blame(
    me: usize,
    world: usize,
    peer: usize,
    blamed: Option<usize>,
) -> (usize, Option<usize>) {
    match blamed {
        Some(b) if b != me && b != peer && b < world => (b, Some(peer)),
        _ => (peer, None),
    }
}

/// Waits on behalf of one rank: the transport's bells, the deadline, and
/// every peer's process id (for errors).
#[derive(Debug)]
pub struct Waiter<'a, B: Bells + ?Sized> {
    /// The transport.
    pub bells: &'a B,
    /// This rank, for the blame rule.
    pub me: usize,
    /// The world size, for the blame rule.
    pub world: usize,
    /// Deadline of every wait.
    pub timeout: Duration,
    /// Peers' process ids, once registered.
    pub pids: &'a [u32],
}

impl<B: Bells + ?Sized> Waiter<'_, B> {
    /// Waits until `check` reports nothing pending (`Ok(None)`); while it
    /// names a lagging peer, paces as [`Pace`] decides until the deadline.
    pub fn wait(
        &self,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
        check: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        self.wait_via(bucket, waited_for, &|_| None, check)
    }

    /// [`Waiter::wait`] where what a lagging peer delivers may reach this
    /// rank through a third rank, `relay(peer)` (a node-mate that hears
    /// the peer's versions for the node): each probe looks at the relay
    /// first, so a dead relay is named (it will not pass anything on)
    /// instead of the peer at the deadline.
    pub fn wait_via(
        &self,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
        relay: &dyn Fn(usize) -> Option<usize>,
        mut check: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pace = Pace::new(start, self.timeout);
        loop {
            if check()?.is_none() {
                return Ok(());
            }
            // Once spinning is over, the epoch is read before the last check,
            // so a ring after that check ends the sleep (no lost wake-up).
            let epoch = pace.spun().then(|| self.bells.bell_epoch(Bell::Client));
            let lagging = match epoch.map(|_| check()).transpose()? {
                Some(None) => return Ok(()),
                Some(Some(p)) => p,
                None => {
                    pace.step(Instant::now());
                    continue;
                }
            };
            let now = Instant::now();
            let mut step = pace.step(now);
            if step == Step::Probe {
                let via = relay(lagging).filter(|&r| r != self.me && r != lagging);
                let relayed = || {
                    format!(
                        "the versions rank {lagging} announces to this node through it ({})",
                        waited_for()
                    )
                };
                let dead = via.and_then(|r| self.probe(r, bucket, &relayed));
                if let Some((root, err)) = dead.or_else(|| self.probe(lagging, bucket, waited_for))
                {
                    // A peer may deliver what we wait for and then close its
                    // engine between the check and the probe: it signals
                    // before it closes, so look once more.
                    if check()?.is_none() {
                        return Ok(());
                    }
                    self.bells.set_blame(root);
                    return Err(err);
                }
                step = pace.after_probe(now);
            }
            match step {
                Step::Expired => {
                    self.bells.set_blame(lagging);
                    return Err(Error::PeerTimeout {
                        peer: lagging,
                        bucket: bucket.map(str::to_owned),
                        waited_for: waited_for(),
                        after: now - start,
                    });
                }
                Step::Sleep(nap) => {
                    if let Some(epoch) = epoch {
                        self.bells.bell_wait(Bell::Client, epoch, nap)?;
                    }
                }
                Step::Spin | Step::Probe => {}
            }
        }
    }

    /// Resolves an error a transport call returned: a `PeerDied` naming the
    /// peer the call went to is re-attributed to the root cause that peer
    /// reported, and recorded as this rank's blame, so that every survivor
    /// names the same rank. Every transport data call goes through here.
    pub fn attribute(&self, bucket: Option<&str>, err: Error) -> Error {
        let Error::PeerDied {
            peer,
            reported_by: None,
            waited_for,
            ..
        } = &err
        else {
            return err;
        };
        let peer = *peer;
        match self.probe(peer, bucket, &|| waited_for.clone()) {
            Some((root, resolved)) => {
                self.bells.set_blame(root);
                resolved
            }
            None => {
                self.bells.set_blame(peer);
                err
            }
        }
    }

    /// Checks `peer`'s liveness; for a dead peer returns the rank to blame
    /// and the error to raise.
    fn probe(
        &self,
        peer: usize,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
    ) -> Option<(usize, Error)> {
        let (root, reported_by, pid) = match self.bells.peer_status(peer) {
            PeerStatus::Alive => return None,
            PeerStatus::Dead { pid, blamed } => match blame(self.me, self.world, peer, blamed) {
                (root, None) => (root, None, pid),
                (root, by) => (root, by, self.pids.get(root).copied().unwrap_or(0)),
            },
            PeerStatus::Reported { by } => {
                (peer, Some(by), self.pids.get(peer).copied().unwrap_or(0))
            }
        };
        Some((
            root,
            Error::PeerDied {
                peer: root,
                pid,
                bucket: bucket.map(str::to_owned),
                waited_for: waited_for(),
                reported_by,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_probes_then_sleeps_then_expires() {
        let t0 = Instant::now();
        let mut p = Pace::new(t0, Duration::from_millis(120));
        let mut spins = 0;
        while !p.spun() {
            assert_eq!(p.step(t0), Step::Spin);
            spins += 1;
        }
        assert!(spins > 5);
        assert_eq!(p.step(t0), Step::Probe, "the first sleep probes first");
        assert_eq!(p.after_probe(t0), Step::Sleep(LIVENESS_PERIOD));
        let t1 = t0 + Duration::from_millis(10);
        assert_eq!(p.step(t1), Step::Sleep(LIVENESS_PERIOD));
        let t2 = t0 + LIVENESS_PERIOD;
        assert_eq!(p.step(t2), Step::Probe);
        // The nap never runs past the deadline.
        assert_eq!(p.after_probe(t2), Step::Sleep(LIVENESS_PERIOD));
        let t3 = t0 + Duration::from_millis(110);
        assert_eq!(p.step(t3), Step::Probe);
        assert_eq!(p.after_probe(t3), Step::Sleep(Duration::from_millis(10)));
        assert_eq!(p.step(t0 + Duration::from_millis(130)), Step::Expired);
    }

    /// Bells whose every peer answers `status` and whose bell never rings.
    struct Fixed {
        status: PeerStatus,
        blamed: std::sync::Mutex<Option<usize>>,
    }

    impl Bells for Fixed {
        fn bell_epoch(&self, _: Bell) -> u32 {
            0
        }
        fn bell_wait(&self, _: Bell, _: u32, timeout: Duration) -> Result<()> {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            Ok(())
        }
        fn peer_status(&self, _: usize) -> PeerStatus {
            self.status
        }
        fn set_blame(&self, peer: usize) {
            *self.blamed.lock().unwrap_or_else(|e| e.into_inner()) = Some(peer);
        }
    }

    #[test]
    fn a_reported_peer_is_named_with_its_pid_and_the_reporter() {
        let bells = Fixed {
            status: PeerStatus::Reported { by: 1 },
            blamed: std::sync::Mutex::new(None),
        };
        let pids = [10, 11, 12, 13];
        let w = Waiter {
            bells: &bells,
            me: 0,
            world: 4,
            timeout: Duration::from_secs(30),
            pids: &pids,
        };
        let err = w
            .wait(Some("b"), &|| "its gradients".into(), || Ok(Some(2)))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::PeerDied {
                    peer: 2,
                    pid: 12,
                    reported_by: Some(1),
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            *bells.blamed.lock().unwrap_or_else(|e| e.into_inner()),
            Some(2)
        );
        assert!(err.to_string().contains("rank 2 (pid 12)"), "{err}");
        assert!(err.to_string().contains("reported by rank 1"), "{err}");
    }

    /// Bells where only `dead` is gone.
    struct OneDead {
        dead: usize,
    }

    impl Bells for OneDead {
        fn bell_epoch(&self, _: Bell) -> u32 {
            0
        }
        fn bell_wait(&self, _: Bell, _: u32, timeout: Duration) -> Result<()> {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            Ok(())
        }
        fn peer_status(&self, peer: usize) -> PeerStatus {
            if peer == self.dead {
                PeerStatus::Dead {
                    pid: 40,
                    blamed: None,
                }
            } else {
                PeerStatus::Alive
            }
        }
        fn set_blame(&self, _: usize) {}
    }

    #[test]
    fn a_dead_relay_is_named_instead_of_the_live_peer_behind_it() {
        let pids = [10, 11, 12, 13];
        let w = Waiter {
            bells: &OneDead { dead: 3 },
            me: 1,
            world: 4,
            timeout: Duration::from_secs(30),
            pids: &pids,
        };
        // Rank 2's versions reach rank 1 through rank 3, which died.
        let t0 = Instant::now();
        let err = w
            .wait_via(
                Some("b"),
                &|| "version 4 of its shard".into(),
                &|p| (p == 2).then_some(3),
                || Ok(Some(2)),
            )
            .unwrap_err();
        assert!(matches!(err, Error::PeerDied { peer: 3, .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("the versions rank 2 announces to this node through it"),
            "{err}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the relay was not probed"
        );
        // Without a relay the same wait names the peer at the deadline.
        let w = Waiter {
            timeout: Duration::from_millis(150),
            ..w
        };
        let err = w
            .wait(Some("b"), &|| "version 4 of its shard".into(), || {
                Ok(Some(2))
            })
            .unwrap_err();
        assert!(matches!(err, Error::PeerTimeout { peer: 2, .. }), "{err:?}");
    }

    #[test]
    fn blame_goes_to_the_root_cause_a_peer_reported() {
        // Rank 2 died because rank 3 did: rank 0 names 3, reported by 2.
        assert_eq!(blame(0, 4, 2, Some(3)), (3, Some(2)));
        // A peer that blames this rank, itself, nobody or a rank outside the
        // job is the root cause itself.
        assert_eq!(blame(0, 4, 2, Some(0)), (2, None));
        assert_eq!(blame(0, 4, 2, Some(2)), (2, None));
        assert_eq!(blame(0, 4, 2, None), (2, None));
        assert_eq!(blame(0, 4, 2, Some(9)), (2, None));
    }
}
