//! The one place atomics come from, plus the waiting primitives every
//! waiter uses: [`Backoff`] (spin, then yield) and futex wait/wake on 32-bit
//! words that may live in memory shared between processes.
//!
//! Under `--cfg loom` the atomics are loom's so the landing-slot protocol can
//! be model-checked; futexes do not exist there and waits degrade to yields.
//!
//! Why sleep at all: hosts are oversubscribed (2 cores for 2–8 ranks, each
//! with a daemon). A busy-polling thread costs its neighbours a whole
//! scheduler slice, so a waiter spins only briefly, then sleeps on the word
//! and whoever writes the word wakes it.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(loom))]
use std::time::Duration;

/// Spin-then-yield backoff with crossbeam-utils' limits: a waiter calls
/// [`snooze`](Backoff::snooze) until [`is_completed`](Backoff::is_completed),
/// then goes to sleep on a futex. Not crossbeam's own `Backoff`: that one
/// yields through `std::thread::yield_now`, which loom cannot see, and a
/// spin loop under loom must yield to loom's scheduler (this one does, under
/// `--cfg loom`), or the models would not terminate.
#[derive(Debug, Default)]
pub struct Backoff {
    step: u32,
}

impl Backoff {
    const SPIN_LIMIT: u32 = 6;
    const YIELD_LIMIT: u32 = 9;

    /// A fresh backoff.
    pub fn new() -> Backoff {
        Backoff { step: 0 }
    }

    /// Busy-waits (exponentially longer), then yields the CPU.
    pub fn snooze(&mut self) {
        if self.step <= Self::SPIN_LIMIT {
            for _ in 0..1u32 << self.step {
                spin_hint();
            }
        } else {
            yield_now();
        }
        if self.step <= Self::YIELD_LIMIT {
            self.step += 1;
        }
    }

    /// Whether the waiter should stop spinning and sleep.
    pub fn is_completed(&self) -> bool {
        self.step > Self::YIELD_LIMIT
    }

    /// Starts over (after progress was made).
    pub fn reset(&mut self) {
        self.step = 0;
    }
}

#[cfg(loom)]
fn spin_hint() {
    loom::thread::yield_now();
}
#[cfg(not(loom))]
fn spin_hint() {
    std::hint::spin_loop();
}

/// Yields the CPU to another thread.
#[cfg(loom)]
pub fn yield_now() {
    loom::thread::yield_now();
}
/// Yields the CPU to another thread.
#[cfg(not(loom))]
pub fn yield_now() {
    std::thread::yield_now();
}

/// Sleeps while `*word == expected`, for at most `timeout`. Returns early on
/// a wake, a spurious wake-up or when the word already differs. The word may
/// sit in a mapping shared with other processes (non-private futex).
#[cfg(not(loom))]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(i32::try_from(timeout.subsec_nanos()).unwrap_or(0)),
    };
    // SAFETY: `word` is a live, aligned 32-bit atomic for the duration of the
    // call and `ts` outlives it; FUTEX_WAIT only reads both. Errors (EAGAIN
    // when the value already differs, ETIMEDOUT, EINTR) all mean "re-check".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every thread (in any process) sleeping on `word`.
#[cfg(not(loom))]
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not
    // access memory beyond hashing its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// An event count on a pair of 32-bit words: waiters read the
/// [`epoch`](EventCount::epoch), re-check their condition, and sleep while
/// the epoch is unchanged; a writer publishes its data (release), then calls
/// [`notify`](EventCount::notify), which bumps the epoch and issues a futex
/// wake only when someone sleeps. `#[repr(C)]` so it can live in a shared
/// mapping.
///
/// No wake-up is lost: a waiter counts itself a sleeper before it checks the
/// epoch one last time, and a notifier bumps the epoch before it looks for
/// sleepers, each with a SeqCst fence between its write and its read (the
/// store-buffering pattern), so either the waiter sees the new epoch or the
/// notifier sees the sleeper; the futex's own check of the epoch closes the
/// gap between that check and the sleep. (SeqCst accesses alone suffice in
/// the C++ model, but loom, which models them as acquire/release, can only
/// prove the fenced form; on x86 the fence after a locked RMW is nearly free.) Under loom
/// the futex is a mutex and condition variable with the same check-then-
/// sleep atomicity, and `loom_model` checks exactly this code.
#[repr(C)]
#[derive(Debug, Default)]
pub struct EventCount {
    epoch: AtomicU32,
    sleepers: AtomicU32,
    #[cfg(loom)]
    park: LoomFutex,
}

impl EventCount {
    /// The current epoch; read it before checking the awaited condition.
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Sleeps until the epoch moves past `epoch` or `timeout` passes (under
    /// loom: until it moves; a lost wake-up is then a deadlock loom reports).
    pub fn wait(&self, epoch: u32, timeout: Timeout) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.epoch.load(Ordering::SeqCst) == epoch {
            self.sleep(epoch, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Bumps the epoch and wakes sleepers, if any. Call after the store the
    /// waiters wait for.
    pub fn notify(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.wake();
        }
    }

    #[cfg(not(loom))]
    fn sleep(&self, epoch: u32, timeout: Timeout) {
        futex_wait(&self.epoch, epoch, timeout);
    }

    #[cfg(not(loom))]
    fn wake(&self) {
        futex_wake_all(&self.epoch);
    }

    #[cfg(loom)]
    fn sleep(&self, epoch: u32, _timeout: Timeout) {
        self.park.wait_while(&self.epoch, epoch);
    }

    #[cfg(loom)]
    fn wake(&self) {
        self.park.wake_all();
    }
}

/// The model's handles on the two words, to break `notify` on purpose.
#[cfg(all(loom, test))]
impl EventCount {
    pub(crate) fn words(&self) -> (&AtomicU32, &AtomicU32) {
        (&self.epoch, &self.sleepers)
    }

    pub(crate) fn wake_for_model(&self) {
        self.wake();
    }
}

/// How long a wait may sleep (loom models untimed sleeps).
#[cfg(not(loom))]
pub type Timeout = Duration;
/// How long a wait may sleep (loom models untimed sleeps).
#[cfg(loom)]
pub type Timeout = ();

/// FUTEX_WAIT / FUTEX_WAKE for loom: the check of the word and the sleep are
/// atomic with respect to a wake, as in the kernel.
#[cfg(loom)]
#[derive(Debug, Default)]
struct LoomFutex {
    lock: loom::sync::Mutex<()>,
    cv: loom::sync::Condvar,
}

#[cfg(loom)]
impl LoomFutex {
    fn wait_while(&self, word: &AtomicU32, expected: u32) {
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while word.load(Ordering::SeqCst) == expected {
            guard = self.cv.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wake_all(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.cv.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn futex_times_out_and_wakes() {
        let ec = Arc::new(EventCount::default());
        let t0 = Instant::now();
        ec.wait(ec.epoch(), Duration::from_millis(20));
        assert!(t0.elapsed() >= Duration::from_millis(15));

        let flag = Arc::new(AtomicU64::new(0));
        let (ec2, flag2) = (Arc::clone(&ec), Arc::clone(&flag));
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            loop {
                let e = ec2.epoch();
                if flag2.load(Ordering::Acquire) == 1 {
                    break;
                }
                ec2.wait(e, Duration::from_secs(10));
            }
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(30));
        flag.store(1, Ordering::Release);
        ec.notify();
        assert!(waiter.join().unwrap() < Duration::from_secs(5));
    }

    #[test]
    fn backoff_completes() {
        let mut b = Backoff::new();
        let mut n = 0;
        while !b.is_completed() {
            b.snooze();
            n += 1;
        }
        assert!(n > 5);
        b.reset();
        assert!(!b.is_completed());
    }
}
