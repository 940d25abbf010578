//! `gpu::fdshare` with real descriptors (`memfd`) in this process and
//! across processes: the test binary re-runs itself (`fdshare_child`) as an
//! owner that serves a descriptor, or as a peer that imports one under a
//! given `ODC_FD_SHARE`.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use odc_core::gpu::fdshare::{self, FdServer, ImportPath, SharePolicy};
use odc_core::Error;

const ROLE_ENV: &str = "ODC_FDSHARE_TEST_ROLE";
const ARGS_ENV: &str = "ODC_FDSHARE_TEST_ARGS";
const TIMEOUT: Duration = Duration::from_secs(5);
const LEN: usize = 8192;
/// The rank the tests pretend the owner is.
const PEER: usize = 3;

/// A socket name no other test (or test run) uses.
fn unique_name(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "odc-fd/test-{}-{}/{tag}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn memfd(contents: &[u8]) -> OwnedFd {
    // SAFETY: the name is a valid C string; memfd_create returns a new
    // descriptor or -1.
    let raw = unsafe { libc::memfd_create(c"odc-fdshare-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(
        raw >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut file = File::from(fd);
    file.write_all(contents).expect("write memfd");
    file.into()
}

/// The file behind `fd`, read through a shared mapping of it.
fn mapped(fd: &OwnedFd) -> Vec<u8> {
    let file = File::from(fd.try_clone().expect("dup"));
    // SAFETY: the memfd is only written by these tests, before or after the
    // mapping is read, never concurrently.
    let map = unsafe { memmap2::Mmap::map(&file) }.expect("mmap");
    map.to_vec()
}

fn yama_scope() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn assert_peer_died(r: Result<(OwnedFd, ImportPath), Error>, pid: u32, started: Instant) {
    let elapsed = started.elapsed();
    match r {
        Err(e @ Error::PeerDied { .. }) => {
            assert_eq!(e.blamed_peer(), Some(PEER));
            let s = e.to_string();
            assert!(s.contains(&format!("rank {PEER} (pid {pid})")), "{s}");
        }
        other => panic!("expected PeerDied, got {other:?}"),
    }
    assert!(elapsed < TIMEOUT, "took {elapsed:?}");
}

#[test]
fn fdshare_socket_imports_each_region_and_shares_the_file() {
    let (a, b) = (pattern(1, LEN), pattern(2, 3 * LEN));
    let fd_a = memfd(&a);
    let keep_a = fd_a.try_clone().expect("dup");
    let server = FdServer::start(&unique_name("two"), vec![(0, fd_a), (1, memfd(&b))]).unwrap();
    let pid = std::process::id();
    let import = |id: u32| {
        fdshare::import_with(
            SharePolicy::Socket,
            PEER,
            pid,
            server.raw_fd(id).unwrap(),
            server.name(),
            id,
            TIMEOUT,
        )
    };
    let (got_a, path) = import(0).unwrap();
    assert_eq!(path, ImportPath::Socket);
    assert_ne!(got_a.as_raw_fd(), server.raw_fd(0).unwrap());
    assert_eq!(mapped(&got_a), a);
    let (got_b, _) = import(1).unwrap();
    assert_eq!(mapped(&got_b), b);
    // The server counts a descriptor once sent, as the client receives it.
    let counted = Instant::now();
    while server.served() < 2 && counted.elapsed() < TIMEOUT {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(server.served(), 2);

    // The import is the same open file, not a copy: a write through it
    // shows through the owner's descriptor, and it outlives the server.
    drop(server);
    let file = File::from(got_a);
    file.write_all_at(b"written by the importer", 0).unwrap();
    assert!(mapped(&keep_a).starts_with(b"written by the importer"));
}

#[test]
fn fdshare_pidfd_imports_from_this_process() {
    let a = pattern(5, LEN);
    let server = FdServer::start(&unique_name("self"), vec![(4, memfd(&a))]).unwrap();
    let fd = server.raw_fd(4).unwrap();
    let pid = std::process::id();
    for policy in [SharePolicy::Pidfd, SharePolicy::Auto] {
        let (got, path) =
            fdshare::import_with(policy, PEER, pid, fd, server.name(), 4, TIMEOUT).unwrap();
        assert_eq!(path, ImportPath::Pidfd, "{policy:?}");
        assert_eq!(mapped(&got), a);
    }
    assert_eq!(server.served(), 0);

    // A number the owner has not open is named as such.
    let r = fdshare::import_with(SharePolicy::Pidfd, PEER, pid, 999_999, "x", 4, TIMEOUT);
    let s = r.unwrap_err().to_string();
    assert!(
        s.contains("pidfd_getfd") && s.contains("no open descriptor 999999"),
        "{s}"
    );
}

#[test]
fn fdshare_unknown_id_is_a_clear_error() {
    let server = FdServer::start(
        &unique_name("unknown"),
        vec![(0, memfd(b"zero")), (1, memfd(b"one"))],
    )
    .unwrap();
    let pid = std::process::id();
    let r = fdshare::import_with(SharePolicy::Socket, PEER, pid, 0, server.name(), 7, TIMEOUT);
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Transport { .. }), "{e:?}");
    let s = e.to_string();
    assert!(
        s.contains(&format!("rank {PEER}")) && s.contains("no region id 7") && s.contains("[0, 1]"),
        "{s}"
    );
    assert!(server.last_error().unwrap().contains("no region id 7"));
    assert_eq!(server.served(), 0);
}

#[test]
fn fdshare_refuses_a_socket_served_by_another_process() {
    let server = FdServer::start(&unique_name("squat"), vec![(0, memfd(b"x"))]).unwrap();
    // pid 1 is alive and is not us: whoever serves the name is not rank 3.
    let r = fdshare::import_with(SharePolicy::Socket, PEER, 1, 0, server.name(), 0, TIMEOUT);
    let s = r.unwrap_err().to_string();
    assert!(
        s.contains(&format!("served by pid {}", std::process::id())) && s.contains("owner's pid 1"),
        "{s}"
    );
}

#[test]
fn fdshare_silent_owner_times_out_and_absent_server_is_named() {
    let pid = std::process::id();
    // A listener that never accepts: the connection waits in its backlog.
    let name = unique_name("silent");
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            name.as_bytes(),
        )
        .unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let t = Duration::from_millis(300);
    let started = Instant::now();
    let r = fdshare::import_with(SharePolicy::Socket, PEER, pid, 0, &name, 0, t);
    let elapsed = started.elapsed();
    match r {
        Err(Error::PeerTimeout { peer, after, .. }) => {
            assert_eq!((peer, after), (PEER, t));
        }
        other => panic!("expected PeerTimeout, got {other:?}"),
    }
    assert!(
        elapsed >= t && elapsed < t + Duration::from_secs(2),
        "{elapsed:?}"
    );
    drop(listener);

    // Nobody listens, yet the owner is alive: not a death, a stopped server.
    let r = fdshare::import_with(SharePolicy::Socket, PEER, pid, 0, &name, 0, TIMEOUT);
    let s = r.unwrap_err().to_string();
    assert!(
        s.contains(&format!("rank {PEER}")) && s.contains("nothing listens"),
        "{s}"
    );
}

#[test]
fn fdshare_drop_does_not_hang_while_clients_wait() {
    let server = FdServer::start(&unique_name("drop"), vec![(0, memfd(b"x"))]).unwrap();
    let name = server.name().to_owned();
    // A client that connects and never asks holds the server in its read;
    // a real import queues behind it.
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            name.as_bytes(),
        )
        .unwrap();
    let idle = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let pid = std::process::id();
    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let r = fdshare::import_with(SharePolicy::Socket, PEER, pid, 0, &name, 0, TIMEOUT);
        (r, started.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    drop(server);
    let dropped = started.elapsed();
    assert!(dropped < Duration::from_secs(1), "drop took {dropped:?}");
    let (r, waited) = waiter.join().unwrap();
    // It was queued behind the idle client (served within SERVE_TIMEOUT,
    // 2 s): the server going away is an error naming the rank, not a hang
    // ("nothing listens" if this thread was too slow to connect first).
    let s = r.unwrap_err().to_string();
    assert!(
        s.contains(&format!("rank {PEER}"))
            && (s.contains("closed the connection") || s.contains("nothing listens")),
        "{s}"
    );
    assert!(waited < TIMEOUT, "import waited {waited:?}");
    drop(idle);
}

// ---- across processes ---------------------------------------------------

/// Kills the child if a test fails before it is done with it.
struct Owner {
    child: Child,
    stdin: Option<ChildStdin>,
    pid: u32,
    fd: RawFd,
    name: String,
}

impl Drop for Owner {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn helper(role: &str, args: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([
        "--exact",
        "fdshare_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_ENV, role)
    .env(ARGS_ENV, args)
    .env_remove(fdshare::FD_SHARE_ENV)
    .stderr(Stdio::inherit());
    cmd
}

/// The helper's answer: the text after `FDSHARE ` on its output (libtest
/// may print on the same line).
fn answer(out: &mut dyn BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("read helper output");
        assert!(n > 0, "helper exited without answering");
        if let Some(i) = line.find("FDSHARE ") {
            return line[i + 8..].trim().to_owned();
        }
    }
}

/// An owner process serving `pattern(seed, LEN)` as region 0; `nodump`
/// makes it non-dumpable, so that only CAP_SYS_PTRACE may pidfd_getfd
/// from it (what Yama does to siblings, without Yama).
fn spawn_owner(seed: u8, nodump: bool) -> Owner {
    let name = unique_name("child");
    let mode = if nodump { "nodump" } else { "-" };
    let mut child = helper("server", &format!("{seed} {name} {mode}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the owner");
    let stdin = child.stdin.take();
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let ready = answer(&mut out);
    let mut words = ready.split_whitespace();
    let (pid, fd) = (
        words.next().and_then(|w| w.parse().ok()).expect("pid"),
        words.next().and_then(|w| w.parse().ok()).expect("fd"),
    );
    Owner {
        child,
        stdin,
        pid,
        fd,
        name,
    }
}

/// Runs `import` in a fresh process (a sibling of the owner) under
/// `ODC_FD_SHARE=policy` (`role`: `import`, or `import-noptrace` to drop
/// CAP_SYS_PTRACE first); returns its answer line.
fn import_in_sibling(owner: &Owner, role: &str, policy: &str) -> String {
    let out = helper(role, &format!("{} {} {}", owner.pid, owner.fd, owner.name))
        .env(fdshare::FD_SHARE_ENV, policy)
        .stdout(Stdio::piped())
        .output()
        .expect("run the importer");
    answer(&mut &out.stdout[..])
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn fdshare_across_processes_both_paths_then_dead_owner() {
    let want = pattern(9, LEN);
    let mut owner = spawn_owner(9, false);
    let (pid, fd, name) = (owner.pid, owner.fd, owner.name.clone());
    let import = |policy| fdshare::import_with(policy, PEER, pid, fd, &name, 0, TIMEOUT);

    // The owner is our child: pidfd_getfd is allowed unless Yama restricts
    // it to admins (scope 2, 3).
    if yama_scope() < 2 {
        let (fd, path) = import(SharePolicy::Pidfd).unwrap();
        assert_eq!((path, mapped(&fd)), (ImportPath::Pidfd, want.clone()));
    } else {
        eprintln!(
            "pidfd from parent skipped: Yama ptrace_scope {}",
            yama_scope()
        );
    }
    let (fd, path) = import(SharePolicy::Socket).unwrap();
    assert_eq!((path, mapped(&fd)), (ImportPath::Socket, want.clone()));
    let (fd, _) = import(SharePolicy::Auto).unwrap();
    assert_eq!(mapped(&fd), want);

    // Siblings, the real case, choosing by ODC_FD_SHARE.
    let sum = checksum(&want);
    assert_eq!(
        import_in_sibling(&owner, "import", "socket"),
        format!("ok Socket {sum}")
    );
    let auto = import_in_sibling(&owner, "import", "auto");
    if yama_scope() == 0 {
        assert_eq!(
            import_in_sibling(&owner, "import", "pidfd"),
            format!("ok Pidfd {sum}")
        );
        assert_eq!(auto, format!("ok Pidfd {sum}"));
    } else {
        // Yama forbids siblings: auto falls back to the socket.
        assert_eq!(auto, format!("ok Socket {sum}"));
    }
    let bogus = import_in_sibling(&owner, "import", "bogus");
    assert!(
        bogus.starts_with("err") && bogus.contains("ODC_FD_SHARE"),
        "{bogus}"
    );

    // The owner dies: both paths name it, at once.
    owner.child.kill().unwrap();
    owner.child.wait().unwrap();
    for policy in [SharePolicy::Pidfd, SharePolicy::Socket, SharePolicy::Auto] {
        let started = Instant::now();
        assert_peer_died(import(policy), pid, started);
    }
}

#[test]
fn fdshare_zombie_owner_is_dead() {
    let mut owner = spawn_owner(4, false);
    let pid = owner.pid;
    owner.child.kill().unwrap();
    // Not reaped yet: wait until it is a zombie.
    let started = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let state = stat.rsplit(')').next().unwrap().trim_start().chars().next();
        if state == Some('Z') {
            break;
        }
        assert!(started.elapsed() < TIMEOUT, "pid {pid} did not exit");
        std::thread::sleep(Duration::from_millis(5));
    }
    for policy in [SharePolicy::Pidfd, SharePolicy::Socket] {
        let started = Instant::now();
        let r = fdshare::import_with(policy, PEER, pid, owner.fd, &owner.name, 0, TIMEOUT);
        assert_peer_died(r, pid, started);
    }
}

#[test]
fn fdshare_auto_falls_back_to_the_socket_where_pidfd_is_refused() {
    let want = checksum(&pattern(6, LEN));
    let owner = spawn_owner(6, true);
    let forced = import_in_sibling(&owner, "import-noptrace", "pidfd");
    assert!(
        forced.starts_with("err")
            && forced.contains("pidfd_getfd")
            && forced.contains(&format!("rank {PEER}"))
            && forced.contains("ODC_FD_SHARE=auto or socket"),
        "{forced}"
    );
    assert_eq!(
        import_in_sibling(&owner, "import-noptrace", "auto"),
        format!("ok Socket {want}")
    );
}

#[test]
fn fdshare_another_user_gets_nothing() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: needs root to run a client as another user");
        return;
    }
    let owner = spawn_owner(7, false);
    let out = helper(
        "as-nobody",
        &format!("{} {} {}", owner.pid, owner.fd, owner.name),
    )
    .stdout(Stdio::piped())
    .output()
    .expect("run the other user's client");
    let mut out = &out.stdout[..];
    let (client, server) = (answer(&mut out), answer(&mut out));
    // Our client will not take a descriptor from another user's server...
    assert!(
        client.contains("refusing descriptors") && client.contains("served by uid 0"),
        "{client}"
    );
    // ...and the server will not give one to another user's client.
    assert!(
        server.contains("refused: client pid") && server.contains("uid 65534"),
        "{server}"
    );
}

/// Not a test: the owner or importer process of the tests above, selected
/// by `ODC_FDSHARE_TEST_ROLE`.
#[test]
#[ignore = "helper process, run by the fdshare tests"]
fn fdshare_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let args = std::env::var(ARGS_ENV).unwrap();
    let args: Vec<&str> = args.split_whitespace().collect();
    match role.as_str() {
        "server" => {
            let seed: u8 = args[0].parse().unwrap();
            if args[2] == "nodump" {
                // SAFETY: prctl with integer arguments only.
                assert_eq!(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, 0);
            }
            let server = FdServer::start(args[1], vec![(0, memfd(&pattern(seed, LEN)))]).unwrap();
            println!(
                "FDSHARE {} {}",
                std::process::id(),
                server.raw_fd(0).unwrap()
            );
            std::io::stdout().flush().unwrap();
            // Serve until the parent closes our stdin (or kills us).
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        }
        "import" | "import-noptrace" => {
            if role == "import-noptrace" {
                drop_ptrace_capability();
            }
            let pid: u32 = args[0].parse().unwrap();
            let fd: RawFd = args[1].parse().unwrap();
            match fdshare::import(PEER, pid, fd, args[2], 0, TIMEOUT) {
                Ok((fd, path)) => println!("FDSHARE ok {path:?} {}", checksum(&mapped(&fd))),
                Err(e) => println!("FDSHARE err {e}"),
            }
        }
        "as-nobody" => {
            // SAFETY: plain system calls; no memory is passed but a null
            // group list of length 0.
            unsafe {
                assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
                assert_eq!(libc::setgid(65534), 0);
                assert_eq!(libc::setuid(65534), 0);
            }
            let pid: u32 = args[0].parse().unwrap();
            let fd: RawFd = args[1].parse().unwrap();
            let r = fdshare::import_with(SharePolicy::Socket, PEER, pid, fd, args[2], 0, TIMEOUT);
            println!(
                "FDSHARE {}",
                r.map(|_| "imported!".into())
                    .unwrap_or_else(|e| e.to_string())
            );
            // The request by hand, bypassing the client's own check: magic
            // "ODF1" and id 0; the reply is status, length, message.
            let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
                args[2].as_bytes(),
            )
            .unwrap();
            let mut sock = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            sock.write_all(b"ODF1\0\0\0\0").unwrap();
            let mut header = [0u8; 8];
            sock.read_exact(&mut header).unwrap();
            let len = u32::from_le_bytes(header[4..].try_into().unwrap());
            let mut msg = vec![0u8; len as usize];
            sock.read_exact(&mut msg).unwrap();
            println!("FDSHARE {}", String::from_utf8_lossy(&msg));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Clears CAP_SYS_PTRACE from this thread's effective set, so that
/// pidfd_getfd from a non-dumpable process is refused even for root.
fn drop_ptrace_capability() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const CAP_SYS_PTRACE: u32 = 19;
    let mut header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3: two Data
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: `header` and `data` are the layout capget expects for version 3.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
    data[0].effective &= !(1 << CAP_SYS_PTRACE);
    // SAFETY: as above; capset only reads them.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
}
