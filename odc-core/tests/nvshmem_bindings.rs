//! The NVSHMEM bindings against the library and headers `make setup`
//! installs (PyPI `nvidia-nvshmem-cu12`), without a GPU: every symbol
//! resolves, and every `#[repr(C)]` type and constant matches the C
//! headers, as a C++ compiler sees them.
//!
//! The headers are C++ (they use `bool` and `static_assert` bare), so the
//! check program is built with `c++`. It includes only the headers that
//! define the types and constants (`device_host/nvshmem_types.h`,
//! `device_host_transport/nvshmem_{constants,common_transport}.h`), which
//! need nothing from CUDA; `host/nvshmemx_api.h` pulls in `cuda.h` and
//! `cuda_runtime.h`, which this machine lacks, so the one constant it
//! defines (`NVSHMEMX_INIT_WITH_UNIQUEID`) is read from its text instead.
//!
//! Without the wheel (or a C++ compiler) the tests skip, saying so;
//! `ODC_REQUIRE_NVSHMEM=1` makes that a failure.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use odc_core::gpu::nvshmem::{self, sys};
use odc_core::gpu::Missing;
use odc_core::Error;

fn skip(test: &str, why: &str) {
    assert!(
        std::env::var_os("ODC_REQUIRE_NVSHMEM").is_none(),
        "{test}: ODC_REQUIRE_NVSHMEM is set but {why}"
    );
    eprintln!("SKIPPED {test}: {why}");
}

#[test]
fn every_symbol_resolves_in_the_host_library() {
    match sys::lib() {
        Ok(lib) => {
            eprintln!("NVSHMEM host library: {:?}", lib.path);
            assert!(nvshmem::is_present());
            assert!(sys::SYMBOLS.len() >= 20);
            for required in [
                "nvshmemx_hostlib_init_attr",
                "nvshmemx_get_uniqueid",
                "nvshmemx_set_attr_uniqueid_args",
                "nvshmem_malloc",
                "nvshmem_free",
                "nvshmem_ptr",
                "nvshmemx_getmem_on_stream",
                "nvshmemx_putmem_on_stream",
                "nvshmemx_putmem_signal_on_stream",
                "nvshmemx_quiet_on_stream",
                "nvshmemx_signal_wait_until_on_stream",
                "nvshmemx_barrier_all_on_stream",
                "nvshmemx_hostlib_finalize",
            ] {
                assert!(sys::SYMBOLS.contains(&required), "{required} not bound");
            }
            // Safe before init: reads constants only.
            let version = nvshmem::version().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(version.0, 3, "NVSHMEM {version:?}");
            eprintln!("NVSHMEM {version:?}");
        }
        Err(missing @ Missing::NvshmemLibrary { .. }) => skip(
            "every_symbol_resolves_in_the_host_library",
            &missing.to_string(),
        ),
        Err(other) => panic!("{other}"),
    }
}

/// `(kind, name) -> value` as Rust sees the bindings.
fn rust_layout() -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    macro_rules! size {
        ($t:ident) => {
            m.insert(
                format!("size {}", stringify!($t)),
                size_of::<sys::$t>() as i64,
            );
        };
    }
    macro_rules! offset {
        ($t:ident, $($f:tt)+) => {
            m.insert(
                format!("offset {}.{}", stringify!($t), stringify!($($f)+).replace(' ', "")),
                offset_of!(sys::$t, $($f)+) as i64,
            );
        };
    }
    macro_rules! constant {
        ($c:ident) => {
            m.insert(format!("const {}", stringify!($c)), i64::from(sys::$c));
        };
    }
    size!(nvshmemx_uniqueid_t);
    offset!(nvshmemx_uniqueid_t, version);
    offset!(nvshmemx_uniqueid_t, internal);
    size!(nvshmemx_uniqueid_args_t);
    offset!(nvshmemx_uniqueid_args_t, version);
    offset!(nvshmemx_uniqueid_args_t, id);
    offset!(nvshmemx_uniqueid_args_t, myrank);
    offset!(nvshmemx_uniqueid_args_t, nranks);
    size!(nvshmemx_init_args_t);
    offset!(nvshmemx_init_args_t, version);
    offset!(nvshmemx_init_args_t, uid_args);
    offset!(nvshmemx_init_args_t, content);
    size!(nvshmemx_init_attr_t);
    offset!(nvshmemx_init_attr_t, version);
    offset!(nvshmemx_init_attr_t, mpi_comm);
    offset!(nvshmemx_init_attr_t, args);
    offset!(nvshmemx_init_attr_t, args.uid_args.id);
    constant!(NVSHMEM_SIGNAL_SET);
    constant!(NVSHMEM_SIGNAL_ADD);
    constant!(NVSHMEM_CMP_EQ);
    constant!(NVSHMEM_CMP_NE);
    constant!(NVSHMEM_CMP_GT);
    constant!(NVSHMEM_CMP_LE);
    constant!(NVSHMEM_CMP_LT);
    constant!(NVSHMEM_CMP_GE);
    constant!(SCALAR_INVALID);
    // The initializer macros' version words.
    constant!(UNIQUEID_VERSION);
    constant!(UNIQUEID_ARGS_VERSION);
    constant!(INIT_ARGS_VERSION);
    constant!(INIT_ATTR_VERSION);
    m
}

const CHECK_PROGRAM: &str = r#"
#include <cstdio>
#include <cstddef>
#include "device_host/nvshmem_types.h"
#include "device_host_transport/nvshmem_constants.h"
#include "device_host_transport/nvshmem_common_transport.h"
#define SIZE(T) std::printf("size %s %zu\n", #T, sizeof(T))
#define OFFSET(T, F) std::printf("offset %s.%s %zu\n", #T, #F, offsetof(T, F))
#define CONST(N, V) std::printf("const %s %lld\n", N, (long long)(V))
int main() {
    SIZE(nvshmemx_uniqueid_t);
    OFFSET(nvshmemx_uniqueid_t, version);
    OFFSET(nvshmemx_uniqueid_t, internal);
    SIZE(nvshmemx_uniqueid_args_t);
    OFFSET(nvshmemx_uniqueid_args_t, version);
    OFFSET(nvshmemx_uniqueid_args_t, id);
    OFFSET(nvshmemx_uniqueid_args_t, myrank);
    OFFSET(nvshmemx_uniqueid_args_t, nranks);
    /* Version 1 of the init arguments, which NVSHMEM 3.4 to 3.8 all take (3.4 knows no other). */
    typedef nvshmemx_init_args_v1 nvshmemx_init_args_t_v1;
    typedef nvshmemx_init_attr_v1 nvshmemx_init_attr_t_v1;
#define nvshmemx_init_args_t nvshmemx_init_args_t_v1
#define nvshmemx_init_attr_t nvshmemx_init_attr_t_v1
    SIZE(nvshmemx_init_args_t);
    OFFSET(nvshmemx_init_args_t, version);
    OFFSET(nvshmemx_init_args_t, uid_args);
    OFFSET(nvshmemx_init_args_t, content);
    SIZE(nvshmemx_init_attr_t);
    OFFSET(nvshmemx_init_attr_t, version);
    OFFSET(nvshmemx_init_attr_t, mpi_comm);
    OFFSET(nvshmemx_init_attr_t, args);
    OFFSET(nvshmemx_init_attr_t, args.uid_args.id);
    CONST("NVSHMEM_SIGNAL_SET", NVSHMEM_SIGNAL_SET);
    CONST("NVSHMEM_SIGNAL_ADD", NVSHMEM_SIGNAL_ADD);
    CONST("NVSHMEM_CMP_EQ", NVSHMEM_CMP_EQ);
    CONST("NVSHMEM_CMP_NE", NVSHMEM_CMP_NE);
    CONST("NVSHMEM_CMP_GT", NVSHMEM_CMP_GT);
    CONST("NVSHMEM_CMP_LE", NVSHMEM_CMP_LE);
    CONST("NVSHMEM_CMP_LT", NVSHMEM_CMP_LT);
    CONST("NVSHMEM_CMP_GE", NVSHMEM_CMP_GE);
    CONST("SCALAR_INVALID", UNIQUEID_ARGS_INVALID);
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
#ifdef NVSHMEMX_INIT_ATTR_V1_INITIALIZER
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_V1_INITIALIZER;
#else
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
#endif
    CONST("UNIQUEID_VERSION", uid.version);
    CONST("UNIQUEID_ARGS_VERSION", attr.args.uid_args.version);
    CONST("INIT_ARGS_VERSION", attr.args.version);
    CONST("INIT_ATTR_VERSION", attr.version);
    if (UNIQUEID_ARGS_INVALID != attr.args.uid_args.myrank) return 2;
    return 0;
}
"#;

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned())
}

#[test]
fn repr_c_types_match_the_headers() {
    const TEST: &str = "repr_c_types_match_the_headers";
    let Some(include) = sys::include_dir() else {
        return skip(
            TEST,
            "no NVSHMEM headers (nvidia/nvshmem/include) next to a host library",
        );
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let src = dir.path().join("layout.cpp");
    let exe = dir.path().join("layout");
    std::fs::write(&src, CHECK_PROGRAM).unwrap_or_else(|e| panic!("{e}"));
    let cxx = compiler();
    let built = Command::new(&cxx)
        .args(["-std=c++17", "-o"])
        .arg(&exe)
        .arg("-I")
        .arg(&include)
        .arg(&src)
        .output();
    let built = match built {
        Ok(out) => out,
        Err(e) => return skip(TEST, &format!("no C++ compiler ({cxx}: {e})")),
    };
    assert!(
        built.status.success(),
        "{cxx} failed on the layout program:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        run.status.success(),
        "layout program failed: {:?}",
        run.status
    );
    let mut c_side = BTreeMap::new();
    for line in String::from_utf8_lossy(&run.stdout).lines() {
        let (key, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: i64 = value.parse().unwrap_or_else(|e| panic!("{line:?}: {e}"));
        c_side.insert(key.to_owned(), value);
    }
    let rust_side = rust_layout();
    assert_eq!(
        rust_side, c_side,
        "Rust bindings (left) differ from {include:?} (right)"
    );
    eprintln!(
        "{} sizes, offsets and constants match {include:?}",
        c_side.len()
    );
}

/// `NVSHMEMX_INIT_WITH_UNIQUEID` lives in `host/nvshmemx_api.h`, which
/// needs CUDA's headers to compile: check it from the text.
#[test]
fn init_flag_matches_the_header_text() {
    const TEST: &str = "init_flag_matches_the_header_text";
    let Some(include) = sys::include_dir() else {
        return skip(TEST, "no NVSHMEM headers");
    };
    let path: PathBuf = include.join("host/nvshmemx_api.h");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("NVSHMEMX_INIT_WITH_UNIQUEID"))
        .unwrap_or_else(|| panic!("{path:?} defines no NVSHMEMX_INIT_WITH_UNIQUEID"));
    let expr = line
        .split('=')
        .nth(1)
        .unwrap_or("")
        .trim()
        .trim_end_matches(',')
        .trim();
    let value = match expr.split_once("<<") {
        Some((a, b)) => {
            let a: u32 = a.trim().parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            let b: u32 = b.trim().parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            a << b
        }
        None => expr.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
    };
    assert_eq!(value, sys::NVSHMEMX_INIT_WITH_UNIQUEID, "{line}");
}

#[test]
fn probe_without_a_gpu_names_what_is_missing() {
    match odc_core::gpu::probe() {
        Ok(info) => eprintln!("GPU transports can run: {info:?}"),
        Err(Error::GpuUnavailable(missing)) => {
            let msg = missing.to_string();
            assert!(!msg.is_empty());
            eprintln!("GPU transports unavailable: {msg}");
        }
        Err(other) => panic!("untyped error: {other}"),
    }
}
