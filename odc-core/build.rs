//! Compiles the libfabric shim (libfabric's static inline calls as plain
//! functions) when the `fabric` feature is on (needs the libfabric headers,
//! Debian `libfabric-dev`); otherwise does nothing. libfabric itself is
//! loaded at run time, so binaries run where it is absent.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/fabric/shim.c");
    #[cfg(feature = "fabric")]
    {
        cc::Build::new()
            .file("src/transport/fabric/shim.c")
            .warnings(true)
            .compile("odc_fabric_shim");
        // libfabric itself is not linked: it is dlopen()ed at run time.
    }
}
