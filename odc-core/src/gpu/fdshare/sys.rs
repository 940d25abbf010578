//! The system calls behind [`fdshare`](super): pidfd, `SO_PEERCRED`, a
//! non-blocking abstract-socket connect, `poll` with a stop descriptor, and
//! `sendmsg` / `recvmsg` carrying one descriptor as `SCM_RIGHTS`. Each
//! returns `io::Result`; timeouts are `ErrorKind::TimedOut`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

fn cvt(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

pub(super) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // (close-on-exec) or -1; no memory is passed.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) })?;
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

pub(super) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes two descriptor numbers and flags (0) and
    // returns a new close-on-exec descriptor or -1; no memory is passed.
    let new = cvt(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) })?;
    // SAFETY: the kernel installed a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(new as RawFd) })
}

pub(super) fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL / F_SETFL on a valid descriptor; no memory is passed.
    let flags = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) }.into())?;
    // SAFETY: as above.
    cvt(unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_SETFL,
            flags as libc::c_int | libc::O_NONBLOCK,
        )
    }
    .into())?;
    Ok(())
}

pub(super) fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    }
    .into())?;
    Ok(cred)
}

/// A connected non-blocking stream socket to abstract name `name`. A full
/// backlog (`EAGAIN`) is retried until `deadline`.
pub(super) fn connect_abstract(name: &str, deadline: Instant) -> io::Result<OwnedFd> {
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    for (dst, &b) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
        *dst = b as libc::c_char;
    }
    let len =
        (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
    loop {
        // SAFETY: socket() takes no memory and returns a new descriptor or -1.
        let raw = cvt(unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        }
        .into())?;
        // SAFETY: a fresh descriptor that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
        // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
        let ret = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if ret == 0 {
            return Ok(sock);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Some(libc::EAGAIN) => return Err(io::ErrorKind::TimedOut.into()),
            Some(libc::EINPROGRESS) => {
                match wait_ready(sock.as_fd(), libc::POLLOUT, Some(deadline), None)? {
                    Wait::Ready => {}
                    _ => return Err(io::ErrorKind::TimedOut.into()),
                }
                let mut err: libc::c_int = 0;
                let mut elen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: `err` and `elen` are valid for writes of their sizes.
                cvt(unsafe {
                    libc::getsockopt(
                        sock.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&mut err as *mut libc::c_int).cast(),
                        &mut elen,
                    )
                }
                .into())?;
                return if err == 0 {
                    Ok(sock)
                } else {
                    Err(io::Error::from_raw_os_error(err))
                };
            }
            _ => return Err(e),
        }
    }
}

pub(super) enum Wait {
    Ready,
    TimedOut,
    /// `stop` turned readable (its other end was dropped).
    Stop,
}

/// Polls `fd` for `events` until `deadline` (`None`: forever), or until
/// `stop` turns readable.
pub(super) fn wait_ready(
    fd: BorrowedFd<'_>,
    events: libc::c_short,
    deadline: Option<Instant>,
    stop: Option<BorrowedFd<'_>>,
) -> io::Result<Wait> {
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Wait::TimedOut);
                }
                // Round up so a sub-millisecond rest does not spin.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
            }
        };
        let mut fds = [
            libc::pollfd {
                fd: fd.as_raw_fd(),
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.map_or(-1, |s| s.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd (a negative fd is
        // ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Wait::Stop);
        }
        if fds[0].revents != 0 {
            return Ok(Wait::Ready);
        }
    }
}

fn wait_or_fail(
    fd: BorrowedFd<'_>,
    events: libc::c_short,
    deadline: Option<Instant>,
    stop: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    match wait_ready(fd, events, deadline, stop)? {
        Wait::Ready => Ok(()),
        Wait::TimedOut => Err(io::ErrorKind::TimedOut.into()),
        Wait::Stop => Err(io::Error::other("the fd server is stopping")),
    }
}

/// Bytes of ancillary space for one `SCM_RIGHTS` message with up to four
/// descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Sends all of `bytes` on non-blocking `sock`, with `fd` attached to the
/// first byte when given.
pub(super) fn send_all(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    mut fd: Option<BorrowedFd<'_>>,
    deadline: Option<Instant>,
    stop: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        wait_or_fail(sock, libc::POLLOUT, deadline, stop)?;
        let mut iov = libc::iovec {
            iov_base: bytes[sent..].as_ptr() as *mut libc::c_void,
            iov_len: bytes.len() - sent,
        };
        let mut cmsg = CmsgBuf([0; 64]);
        // SAFETY: msghdr is plain data for which all zeroes is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            let fd_len = std::mem::size_of::<libc::c_int>() as libc::c_uint;
            msg.msg_control = cmsg.0.as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE is arithmetic.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(fd_len) } as _;
            // SAFETY: msg_control points at `cmsg`, which is aligned and
            // larger than CMSG_SPACE(4), so the first header and its data
            // lie inside it.
            unsafe {
                let hdr = libc::CMSG_FIRSTHDR(&msg);
                (*hdr).cmsg_level = libc::SOL_SOCKET;
                (*hdr).cmsg_type = libc::SCM_RIGHTS;
                (*hdr).cmsg_len = libc::CMSG_LEN(fd_len) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(hdr).cast(), fd.as_raw_fd());
            }
        }
        // SAFETY: `msg` points at `iov` (valid for its length) and, when
        // set, at `cmsg`; both outlive the call. MSG_NOSIGNAL: a closed
        // peer is an error, not SIGPIPE.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
        sent += n as usize;
        // The descriptor went with the first bytes.
        fd = None;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes from non-blocking `sock` (0: end of
/// stream), with the first descriptor attached to them if any; extra
/// descriptors are closed.
pub(super) fn recv_some(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: Option<BorrowedFd<'_>>,
) -> io::Result<(usize, Option<OwnedFd>)> {
    loop {
        wait_or_fail(sock, libc::POLLIN, deadline, stop)?;
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cmsg = CmsgBuf([0; 64]);
        // SAFETY: msghdr is plain data for which all zeroes is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.0.as_mut_ptr().cast();
        msg.msg_controllen = cmsg.0.len() as _;
        // SAFETY: `msg` points at `iov` (over `buf`, writable) and `cmsg`,
        // both of the lengths given and outliving the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `msg_control` with `msg_controllen`
        // bytes of well-formed headers inside `cmsg`; every SCM_RIGHTS
        // payload is an array of descriptors now installed in this process,
        // which we take ownership of (so none leaks).
        unsafe {
            let mut hdr = libc::CMSG_FIRSTHDR(&msg);
            while !hdr.is_null() {
                if (*hdr).cmsg_level == libc::SOL_SOCKET && (*hdr).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(hdr);
                    let bytes = (*hdr).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                        let raw: libc::c_int =
                            std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                hdr = libc::CMSG_NXTHDR(&msg, hdr);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other(
                "ancillary data truncated (more descriptors than one were sent)",
            ));
        }
        let fd = fds.into_iter().next();
        return Ok((n as usize, fd));
    }
}
