//! Compiles the libfabric shim (libfabric's static inline calls as plain
//! functions) when the `fabric` feature is on (needs the libfabric headers,
//! Debian `libfabric-dev`); otherwise does nothing. libfabric itself is
//! loaded at run time, so binaries run where it is absent.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/fabric/shim.c");
    #[cfg(feature = "fabric")]
    {
        let mut shim = cc::Build::new();
        shim.file("src/transport/fabric/shim.c").warnings(true);
        // A compiler that brings its own C library headers (zig cc, which `make wheel` links with against
        // glibc 2.28's symbols) does not search the host's include folder, where libfabric-dev puts rdma/*.h.
        // That folder goes after the compiler's own (-idirafter): it supplies rdma/ and nothing the C
        // library's headers already do. For the host's gcc it is already a system folder: no change.
        if let Some(dir) = fabric_include_dir() {
            shim.flag("-idirafter").flag(dir);
        }
        shim.compile("odc_fabric_shim");
        // libfabric itself is not linked: it is dlopen()ed at run time.
    }
}

/// Where `rdma/fabric.h` lives: `ODC_FABRIC_INCLUDE_DIR`, else libfabric's pkg-config `includedir`, else
/// `/usr/include` when it holds the header; `None` leaves the compiler's own search alone.
#[cfg(feature = "fabric")]
fn fabric_include_dir() -> Option<String> {
    println!("cargo:rerun-if-env-changed=ODC_FABRIC_INCLUDE_DIR");
    if let Ok(dir) = std::env::var("ODC_FABRIC_INCLUDE_DIR") {
        return Some(dir);
    }
    let from_pkg_config = std::process::Command::new("pkg-config")
        .args(["--variable=includedir", "libfabric"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|dir| dir.trim().to_owned())
        .filter(|dir| !dir.is_empty());
    from_pkg_config.or_else(|| {
        std::path::Path::new("/usr/include/rdma/fabric.h")
            .exists()
            .then(|| "/usr/include".to_owned())
    })
}
