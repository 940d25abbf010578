//! Passing a region's file descriptor from the rank that owns it to a peer
//! on the same node: how the `cuda-ipc` transport shares `cuMemCreate`
//! memory, which the driver exports as a POSIX file descriptor that is only
//! meaningful inside the owner's process until another process holds a copy
//! of it.
//!
//! One file because the two ways of passing a descriptor (`pidfd_getfd`,
//! `SCM_RIGHTS`) share the rendezvous, the peer's identity check and the
//! fallback between them; its tests are the last sixty lines.
//!
//! Two paths, one result (a descriptor of the same open file in this
//! process):
//!
//! - **pidfd**: `pidfd_open(pid)` + `pidfd_getfd(pidfd, fd)` (Linux 5.6)
//!   copies the owner's descriptor directly. The owner does nothing, but the
//!   kernel requires ptrace-attach permission over it, and Yama's
//!   `kernel.yama.ptrace_scope = 1` (the default on Ubuntu and many
//!   clusters) grants that only to ancestors, never to the sibling processes
//!   a launcher starts. Container runtimes may also filter the call out
//!   (seccomp) or run an older kernel.
//! - **socket**: the owner runs an [`FdServer`], a thread that listens on an
//!   abstract-namespace Unix socket and answers "region `id`" with the
//!   descriptor attached as `SCM_RIGHTS`. It needs no privilege; it needs
//!   the two processes to share a network namespace (abstract names live
//!   there), as processes of one launcher do.
//!
//! [`import`] tries pidfd first and falls back to the socket where the call
//! is refused (`EPERM`, `EACCES`) or absent (`ENOSYS`, `EINVAL`). The
//! environment variable **`ODC_FD_SHARE`** forces one path: `auto`
//! (default), `pidfd` or `socket` ([`SharePolicy::from_env`]). A pid given
//! to the pidfd path must be the owner's pid as this process sees it (same
//! pid namespace); where ranks run in separate pid namespaces, use
//! `ODC_FD_SHARE=socket`.
//!
//! # Security
//!
//! A descriptor of device memory grants read and write access to it, so
//! both ends check who is at the other end with `SO_PEERCRED`: the server
//! answers only clients running under its own uid ([`admit_client`]); the
//! client accepts a descriptor only from a server run by the expected
//! owner pid under its own uid ([`check_server`]), since any local user may
//! bind an abstract name first. The pidfd path is checked by the kernel.
//!
//! # Failures
//!
//! Nothing waits unbounded: every socket operation of an import is bounded
//! by its `timeout` ([`Error::PeerTimeout`]); an owner that has exited
//! (`ESRCH`, connection refused, end of stream, with its pid gone) is
//! [`Error::PeerDied`]; everything else is [`Error::Transport`] naming the
//! peer rank and the call.
//!
//! # Lifetimes
//!
//! An imported descriptor is an independent reference to the open file:
//! closing it does not affect the owner, and the owner closing its own copy
//! does not invalidate it. The [`FdServer`] owns the descriptors it serves
//! and keeps them open while it lives; dropping it stops its thread (even
//! while it is blocked in `accept` or reading a request), joins it, closes
//! the socket and then the descriptors. The pidfd path reads the owner's
//! descriptor table directly, so the owner must keep a descriptor open under
//! the number it published until every peer imported it; keeping the
//! `FdServer` alive until the setup barrier does both.
//!
//! This module knows nothing of CUDA, regions or the Store: it moves
//! descriptors.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::transport::shm::{pid_alive, sanitize_job_key};
use crate::{Error, Result};

mod sys;

use sys::{
    connect_abstract, peer_cred, pidfd_getfd, pidfd_open, recv_some, send_all, set_nonblocking,
    wait_ready, Wait,
};

/// The environment variable that forces an import path (see
/// [`SharePolicy`]).
pub const FD_SHARE_ENV: &str = "ODC_FD_SHARE";

/// How long the server gives one client to send its request before it
/// serves the next one (clients send it right after connecting).
const SERVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long an import keeps checking whether an owner that stopped
/// answering is exiting (its socket closes before its pid disappears).
const EXIT_GRACE: Duration = Duration::from_millis(200);

/// Request: magic, then the region id (little endian).
const REQUEST_MAGIC: [u8; 4] = *b"ODF1";
/// Reply: status (0 = the descriptor is attached, 1 = error), then the
/// length of the error message that follows.
const STATUS_OK: u32 = 0;
const STATUS_ERR: u32 = 1;

/// Which path [`import`] may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharePolicy {
    /// pidfd, then the socket where pidfd is refused or missing.
    Auto,
    /// Only `pidfd_getfd`.
    Pidfd,
    /// Only the owner's [`FdServer`].
    Socket,
}

impl SharePolicy {
    /// Parses `auto`, `pidfd` or `socket` (any case; empty means `auto`).
    pub fn parse(s: &str) -> Result<SharePolicy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(SharePolicy::Auto),
            "pidfd" => Ok(SharePolicy::Pidfd),
            "socket" => Ok(SharePolicy::Socket),
            _ => Err(Error::Config(format!(
                "{FD_SHARE_ENV} must be auto, pidfd or socket, not {s:?}"
            ))),
        }
    }

    /// The policy `ODC_FD_SHARE` asks for (`auto` when unset).
    pub fn from_env() -> Result<SharePolicy> {
        match std::env::var(FD_SHARE_ENV) {
            Ok(v) => SharePolicy::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(SharePolicy::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::Config(format!(
                "{FD_SHARE_ENV} must be auto, pidfd or socket, not {v:?}"
            ))),
        }
    }
}

/// The path an [`import`] took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportPath {
    /// `pidfd_getfd` copied the owner's descriptor.
    Pidfd,
    /// The owner's [`FdServer`] sent it over its socket.
    Socket,
}

/// The abstract socket name of `rank`'s [`FdServer`] in job `job_key`.
pub fn socket_name(job_key: &str, rank: usize) -> String {
    format!("odc-fd/{}/{rank}", sanitize_job_key(job_key))
}

/// Serves this process's descriptors to same-user peers; see the module
/// docs. Stops, joins its thread and closes the descriptors on drop.
pub struct FdServer {
    name: String,
    raw: HashMap<u32, RawFd>,
    stats: Arc<Stats>,
    /// Dropping it wakes the thread: its peer end turns readable.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Stats {
    served: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl fmt::Debug for FdServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<_> = self.raw.keys().collect();
        ids.sort();
        f.debug_struct("FdServer")
            .field("name", &self.name)
            .field("ids", &ids)
            .field("served", &self.served())
            .finish()
    }
}

impl FdServer {
    /// Binds the abstract socket `name` and serves `fds` (region id →
    /// descriptor) on a background thread until dropped.
    ///
    /// Errors: [`Error::Config`] for an invalid name or a repeated id;
    /// [`Error::Transport`] when the name is taken (another live job with
    /// the same key on this node) or the thread cannot start.
    pub fn start(name: &str, fds: Vec<(u32, OwnedFd)>) -> Result<FdServer> {
        check_name(name)?;
        let mut table = HashMap::with_capacity(fds.len());
        for (id, fd) in fds {
            if table.insert(id, fd).is_some() {
                return Err(Error::Config(format!(
                    "fd server {name:?}: region id {id} given twice"
                )));
            }
        }
        let raw = table.iter().map(|(&id, fd)| (id, fd.as_raw_fd())).collect();
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::transport_io("bind", format!("abstract socket @{name}"), e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            let why = if e.kind() == io::ErrorKind::AddrInUse {
                " (taken: is another job with the same key running on this node?)"
            } else {
                ""
            };
            Error::transport_io("bind", format!("abstract socket @{name}{why}"), e)
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::transport_io("fcntl", format!("socket @{name}"), e))?;
        let (wake, wake_rx) = UnixStream::pair()
            .map_err(|e| Error::transport_io("socketpair", format!("fd server @{name}"), e))?;
        let stats = Arc::new(Stats::default());
        let thread = std::thread::Builder::new()
            .name("odc-fd-server".into())
            .spawn({
                let stats = Arc::clone(&stats);
                move || serve(&listener, &wake_rx, &table, &stats)
            })
            .map_err(|e| Error::transport_io("spawn", format!("fd server @{name}"), e))?;
        Ok(FdServer {
            name: name.to_owned(),
            raw,
            stats,
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// The abstract socket name (without the leading NUL).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor number region `id` has in this process: what a peer
    /// passes to [`import`] for the pidfd path.
    pub fn raw_fd(&self, id: u32) -> Option<RawFd> {
        self.raw.get(&id).copied()
    }

    /// Descriptors sent so far.
    pub fn served(&self) -> u64 {
        self.stats.served.load(Ordering::Relaxed)
    }

    /// Why the last failed request failed (a client refused, gone, or
    /// asking for an unknown id); the client got the same news.
    pub fn last_error(&self) -> Option<String> {
        self.stats.last_error.lock().ok().and_then(|e| e.clone())
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        drop(self.wake.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                eprintln!("odc: fd server @{}: its thread panicked", self.name);
            }
        }
    }
}

/// The server thread: one connection at a time, each bounded by
/// [`SERVE_TIMEOUT`]; returns when `wake` turns readable.
fn serve(listener: &UnixListener, wake: &UnixStream, table: &HashMap<u32, OwnedFd>, stats: &Stats) {
    let wake = wake.as_fd();
    // SAFETY: getuid has no preconditions and cannot fail.
    let our_uid = unsafe { libc::getuid() };
    loop {
        match wait_ready(listener.as_fd(), libc::POLLIN, None, Some(wake)) {
            Ok(Wait::Ready) => {}
            Ok(Wait::Stop) => return,
            Ok(Wait::TimedOut) => continue,
            Err(e) => {
                eprintln!("odc: fd server: poll failed, stopping: {e}");
                return;
            }
        }
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                record(stats, format!("accept: {e}"));
                // Out of descriptors: let some close rather than spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        match serve_one(conn.as_fd(), wake, table, our_uid, stats) {
            Ok(()) => {
                stats.served.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => record(stats, e),
        }
    }
}

fn record(stats: &Stats, e: String) {
    if let Ok(mut slot) = stats.last_error.lock() {
        *slot = Some(e);
    }
}

/// Answers one request; the error is what went wrong, in words (already
/// sent to the client where it could be).
fn serve_one(
    conn: BorrowedFd<'_>,
    wake: BorrowedFd<'_>,
    table: &HashMap<u32, OwnedFd>,
    our_uid: u32,
    stats: &Stats,
) -> std::result::Result<(), String> {
    let deadline = Instant::now() + SERVE_TIMEOUT;
    // Recorded before the client hears it, so that `last_error` already
    // tells once the client's import has failed.
    let refuse = |msg: String| {
        record(stats, msg.clone());
        let mut reply = Vec::with_capacity(8 + msg.len());
        reply.extend_from_slice(&STATUS_ERR.to_le_bytes());
        reply.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        reply.extend_from_slice(msg.as_bytes());
        match send_all(conn, &reply, None, Some(deadline), Some(wake)) {
            Ok(()) => msg,
            Err(e) => format!("{msg} (the reply failed too: {e})"),
        }
    };
    set_nonblocking(conn).map_err(|e| format!("fcntl: {e}"))?;
    let cred = peer_cred(conn).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    // The request is read before any answer: closing a Unix socket with
    // unread data resets it, and the client would lose the answer.
    let mut request = [0u8; 8];
    let mut got = 0;
    while got < request.len() {
        match recv_some(conn, &mut request[got..], Some(deadline), Some(wake)) {
            Ok((0, _)) => {
                return Err(format!(
                    "pid {} closed its connection before asking",
                    cred.pid
                ))
            }
            Ok((n, _)) => got += n,
            Err(e) => return Err(format!("reading pid {}'s request: {e}", cred.pid)),
        }
    }
    admit_client(our_uid, &cred).map_err(refuse)?;
    let Some(id) = decode_request(&request) else {
        return Err(refuse(format!(
            "malformed request {request:02x?} (not an ODC fd client?)"
        )));
    };
    let Some(fd) = table.get(&id) else {
        let mut ids: Vec<_> = table.keys().collect();
        ids.sort();
        return Err(refuse(format!("no region id {id} (it serves ids {ids:?})")));
    };
    let mut reply = [0u8; 8];
    reply[..4].copy_from_slice(&STATUS_OK.to_le_bytes());
    send_all(conn, &reply, Some(fd.as_fd()), Some(deadline), Some(wake))
        .map_err(|e| format!("sending region {id} to pid {}: {e}", cred.pid))
}

/// The region id a client's 8-byte request asks for; `None` without the
/// magic.
pub fn decode_request(request: &[u8; 8]) -> Option<u32> {
    (request[..4] == REQUEST_MAGIC)
        .then(|| u32::from_le_bytes([request[4], request[5], request[6], request[7]]))
}

/// The request for region `id`.
pub fn encode_request(id: u32) -> [u8; 8] {
    let mut request = [0u8; 8];
    request[..4].copy_from_slice(&REQUEST_MAGIC);
    request[4..].copy_from_slice(&id.to_le_bytes());
    request
}

/// What the 8-byte header of a server's reply says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The descriptor is attached.
    Granted,
    /// Refused; an error message of this many bytes follows (at most
    /// [`MAX_MESSAGE`] of them are read).
    Refused(usize),
    /// A status this client does not know.
    Unknown(u32),
}

/// The most bytes of a refusal's message a client reads.
pub const MAX_MESSAGE: usize = 4096;

/// Decodes a reply header: status, then the message length (little endian).
pub fn decode_reply(header: &[u8; 8]) -> Reply {
    let status = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    match status {
        STATUS_OK => Reply::Granted,
        STATUS_ERR => Reply::Refused(usize::try_from(len).unwrap_or(usize::MAX).min(MAX_MESSAGE)),
        other => Reply::Unknown(other),
    }
}

/// The server's rule: only a client under the server's own uid may receive
/// a descriptor.
pub fn admit_client(our_uid: u32, client: &libc::ucred) -> std::result::Result<(), String> {
    if client.uid == our_uid {
        Ok(())
    } else {
        Err(format!(
            "refused: client pid {} runs as uid {}, this server as uid {our_uid}",
            client.pid, client.uid
        ))
    }
}

/// The client's rule: accept a descriptor only from the expected owner pid
/// running under our uid (anyone may bind an abstract name first). A pid of
/// 0 means the server is in a pid namespace this process cannot see.
pub fn check_server(
    our_uid: u32,
    owner_pid: u32,
    server: &libc::ucred,
) -> std::result::Result<(), String> {
    let pid = u32::try_from(server.pid).unwrap_or(0);
    if server.uid != our_uid {
        Err(format!(
            "it is served by uid {} (pid {}), not this user (uid {our_uid})",
            server.uid, server.pid
        ))
    } else if pid != owner_pid {
        Err(format!(
            "it is served by pid {}, not the owner's pid {owner_pid}{}",
            server.pid,
            if pid == 0 {
                " (the server is in another pid namespace)"
            } else {
                ""
            }
        ))
    } else {
        Ok(())
    }
}

/// A copy of descriptor `fd` of rank `peer` (process `pid`), region `id`,
/// whose [`FdServer`] listens on `name`; the path is chosen by
/// `ODC_FD_SHARE` (see [`import_with`]).
pub fn import(
    peer: usize,
    pid: u32,
    fd: RawFd,
    name: &str,
    id: u32,
    timeout: Duration,
) -> Result<(OwnedFd, ImportPath)> {
    import_with(SharePolicy::from_env()?, peer, pid, fd, name, id, timeout)
}

/// [`import`] with an explicit policy.
///
/// Errors: [`Error::PeerDied`] when `pid` has exited;
/// [`Error::PeerTimeout`] when its server did not answer within `timeout`;
/// [`Error::Transport`] for a refused or failed call, an unknown `id`, or a
/// socket served by someone else; [`Error::Config`] for invalid arguments.
pub fn import_with(
    policy: SharePolicy,
    peer: usize,
    pid: u32,
    fd: RawFd,
    name: &str,
    id: u32,
    timeout: Duration,
) -> Result<(OwnedFd, ImportPath)> {
    if pid == 0 || i32::try_from(pid).is_err() {
        return Err(Error::Config(format!("rank {peer}: invalid pid {pid}")));
    }
    let who = Peer {
        rank: peer,
        pid,
        id,
    };
    let refused = match policy {
        SharePolicy::Socket => None,
        SharePolicy::Pidfd | SharePolicy::Auto => match import_pidfd(&who, fd) {
            Ok(fd) => return Ok((fd, ImportPath::Pidfd)),
            Err(PidfdFailure::Fatal(e)) => return Err(e),
            Err(PidfdFailure::Refused(call, e)) if policy == SharePolicy::Pidfd => {
                return Err(Error::transport_io(
                    call,
                    format!(
                        "rank {peer} (pid {pid}), descriptor {fd} of region {id}: {e}{}; set \
                         {FD_SHARE_ENV}=auto or socket to use the owner's socket instead",
                        yama_note()
                    ),
                    e,
                ));
            }
            Err(PidfdFailure::Refused(call, e)) => Some(format!("{call}: {e}")),
        },
    };
    check_name(name)?;
    let result = import_socket(&who, name, Instant::now() + timeout, timeout);
    match (result, refused) {
        (Ok(fd), _) => Ok((fd, ImportPath::Socket)),
        (Err(Error::Transport { op, detail, source }), Some(why)) => Err(Error::Transport {
            op,
            detail: format!("{detail} (tried after {why}{})", yama_note()),
            source,
        }),
        (Err(e), _) => Err(e),
    }
}

/// Who an import is from, for error messages.
struct Peer {
    rank: usize,
    pid: u32,
    id: u32,
}

impl Peer {
    fn died(&self) -> Error {
        Error::PeerDied {
            peer: self.rank,
            pid: self.pid,
            bucket: None,
            waited_for: format!("the descriptor of its region {}", self.id),
            reported_by: None,
        }
    }

    /// Whether the owner is gone, allowing it [`EXIT_GRACE`] (bounded by
    /// `deadline`) to finish exiting: a dying process closes its sockets
    /// before its pid turns into a zombie.
    fn gone(&self, deadline: Instant) -> bool {
        let until = (Instant::now() + EXIT_GRACE).min(deadline);
        loop {
            if !pid_alive(self.pid) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

enum PidfdFailure {
    /// Not permitted or not available: the socket may still work.
    Refused(&'static str, io::Error),
    Fatal(Error),
}

fn import_pidfd(who: &Peer, fd: RawFd) -> std::result::Result<OwnedFd, PidfdFailure> {
    let classify = |call: &'static str, e: io::Error| match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES | libc::ENOSYS | libc::EINVAL) => {
            PidfdFailure::Refused(call, e)
        }
        Some(libc::ESRCH) => PidfdFailure::Fatal(who.died()),
        Some(libc::EBADF) if !pid_alive(who.pid) => PidfdFailure::Fatal(who.died()),
        Some(libc::EBADF) => PidfdFailure::Fatal(Error::transport_io(
            call,
            format!(
                "rank {} (pid {}) has no open descriptor {fd} (region {}): it closed it or \
                 published a wrong number",
                who.rank, who.pid, who.id
            ),
            e,
        )),
        _ => PidfdFailure::Fatal(Error::transport_io(
            call,
            format!(
                "rank {} (pid {}), descriptor {fd} of region {}",
                who.rank, who.pid, who.id
            ),
            e,
        )),
    };
    if fd < 0 {
        return Err(PidfdFailure::Fatal(Error::Config(format!(
            "rank {}: invalid descriptor number {fd} for region {}",
            who.rank, who.id
        ))));
    }
    let pidfd = pidfd_open(who.pid).map_err(|e| classify("pidfd_open", e))?;
    pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| classify("pidfd_getfd", e))
}

fn import_socket(who: &Peer, name: &str, deadline: Instant, timeout: Duration) -> Result<OwnedFd> {
    let (rank, pid, id) = (who.rank, who.pid, who.id);
    let io_err = |op: &'static str, e: io::Error| -> Error {
        if e.kind() == io::ErrorKind::TimedOut {
            return Error::PeerTimeout {
                peer: rank,
                bucket: None,
                waited_for: format!("the descriptor of its region {id} from socket @{name}"),
                after: timeout,
            };
        }
        let closed = matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        );
        if closed && who.gone(deadline) {
            return who.died();
        }
        let why = match e.kind() {
            io::ErrorKind::ConnectionRefused => {
                " (the process is alive but nothing listens there: its FdServer stopped or \
                 never started)"
            }
            _ if closed => " (its FdServer closed the connection: stopping?)",
            _ => "",
        };
        Error::transport_io(
            op,
            format!("rank {rank} (pid {pid}), region {id}, socket @{name}{why}"),
            e,
        )
    };

    let sock = connect_abstract(name, deadline).map_err(|e| io_err("connect", e))?;
    let server = peer_cred(sock.as_fd()).map_err(|e| io_err("getsockopt", e))?;
    // SAFETY: getuid has no preconditions and cannot fail.
    let our_uid = unsafe { libc::getuid() };
    check_server(our_uid, pid, &server).map_err(|why| {
        Error::transport(
            "connect",
            format!("rank {rank} (pid {pid}): refusing descriptors from socket @{name}: {why}"),
        )
    })?;

    let request = encode_request(id);
    send_all(sock.as_fd(), &request, None, Some(deadline), None).map_err(|e| io_err("send", e))?;

    let mut header = [0u8; 8];
    let mut got = 0;
    let mut received: Option<OwnedFd> = None;
    while got < header.len() {
        let (n, fd) = recv_some(sock.as_fd(), &mut header[got..], Some(deadline), None)
            .map_err(|e| io_err("recvmsg", e))?;
        if n == 0 {
            return Err(io_err("recvmsg", io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
        if received.is_none() {
            received = fd;
        }
    }
    match (decode_reply(&header), received) {
        (Reply::Granted, Some(fd)) => Ok(fd),
        (Reply::Granted, None) => Err(Error::transport(
            "recvmsg",
            format!("rank {rank} (pid {pid}) answered for region {id} without a descriptor"),
        )),
        (Reply::Refused(len), _) => {
            let mut msg = vec![0u8; len];
            let mut got = 0;
            while got < msg.len() {
                match recv_some(sock.as_fd(), &mut msg[got..], Some(deadline), None) {
                    Ok((0, _)) | Err(_) => break,
                    Ok((n, _)) => got += n,
                }
            }
            msg.truncate(got);
            Err(Error::transport(
                "fd import",
                format!(
                    "rank {rank} (pid {pid}) refused region {id} on socket @{name}: {}",
                    String::from_utf8_lossy(&msg)
                ),
            ))
        }
        (Reply::Unknown(other), _) => Err(Error::transport(
            "recvmsg",
            format!("rank {rank} (pid {pid}) answered region {id} with unknown status {other}"),
        )),
    }
}

fn check_name(name: &str) -> Result<()> {
    // sun_path holds 108 bytes, the first of which is the abstract marker.
    if name.is_empty() || name.len() > 107 || name.contains('\0') {
        return Err(Error::Config(format!(
            "fd socket name {name:?} must be 1 to 107 bytes without NUL"
        )));
    }
    Ok(())
}

fn yama_note() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(s) if s.trim() != "0" => format!("; Yama ptrace_scope is {}", s.trim()),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(pid: i32, uid: u32) -> libc::ucred {
        libc::ucred { pid, uid, gid: 0 }
    }

    #[test]
    fn requests_and_replies_decode_only_what_they_say() {
        assert_eq!(decode_request(&encode_request(9)), Some(9));
        assert_eq!(decode_request(b"ODF2\x09\0\0\0"), None);
        assert_eq!(decode_reply(&[0; 8]), Reply::Granted);
        // A refusal's message length is bounded, whatever the header says.
        assert_eq!(
            decode_reply(&[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
            Reply::Refused(MAX_MESSAGE)
        );
        assert_eq!(decode_reply(&[1, 0, 0, 0, 5, 0, 0, 0]), Reply::Refused(5));
        assert_eq!(decode_reply(&[7, 0, 0, 0, 0, 0, 0, 0]), Reply::Unknown(7));
    }

    #[test]
    fn policy_parses_the_three_words_only() {
        assert_eq!(SharePolicy::parse("").unwrap(), SharePolicy::Auto);
        assert_eq!(SharePolicy::parse("auto").unwrap(), SharePolicy::Auto);
        assert_eq!(SharePolicy::parse(" PIDFD ").unwrap(), SharePolicy::Pidfd);
        assert_eq!(SharePolicy::parse("socket").unwrap(), SharePolicy::Socket);
        let e = SharePolicy::parse("scm").unwrap_err().to_string();
        assert!(e.contains(FD_SHARE_ENV) && e.contains("\"scm\""), "{e}");
    }

    #[test]
    fn server_admits_only_its_own_uid() {
        assert!(admit_client(1000, &cred(42, 1000)).is_ok());
        let e = admit_client(1000, &cred(42, 1001)).unwrap_err();
        assert!(e.contains("uid 1001") && e.contains("pid 42"), "{e}");
        // Root is another user too: it could take the descriptor by
        // pidfd_getfd anyway, but the server does not hand it over.
        assert!(admit_client(1000, &cred(42, 0)).is_err());
    }

    #[test]
    fn client_accepts_only_the_owner_under_its_uid() {
        assert!(check_server(1000, 77, &cred(77, 1000)).is_ok());
        let e = check_server(1000, 77, &cred(77, 1001)).unwrap_err();
        assert!(e.contains("uid 1001"), "{e}");
        let e = check_server(1000, 77, &cred(78, 1000)).unwrap_err();
        assert!(e.contains("pid 78") && e.contains("77"), "{e}");
        let e = check_server(1000, 77, &cred(0, 1000)).unwrap_err();
        assert!(e.contains("pid namespace"), "{e}");
    }

    #[test]
    fn names_are_checked_and_derived_from_the_job_key() {
        assert_eq!(socket_name("my job", 3), "odc-fd/my_job/3");
        assert!(check_name("").is_err());
        assert!(check_name(&"x".repeat(108)).is_err());
        assert!(check_name("a\0b").is_err());
        assert!(check_name(&"x".repeat(107)).is_ok());
        assert!(matches!(
            FdServer::start("a\0b", Vec::new()),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn invalid_pid_or_fd_is_a_config_error() {
        let t = Duration::from_millis(100);
        let r = import_with(SharePolicy::Auto, 1, 0, 3, "odc-fd/x/1", 0, t);
        assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
        let r = import_with(SharePolicy::Pidfd, 1, std::process::id(), -1, "x", 0, t);
        assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    }
}
