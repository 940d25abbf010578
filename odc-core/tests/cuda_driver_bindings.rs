//! The CUDA driver calls of `odc_core::gpu::device` against `cuda.h`,
//! without a GPU: a C program built against the header of the CUDA wheel
//! torch installs (`nvidia/cu13/include`, or a CUDA 12 `nvidia/cuda_runtime`)
//! takes the address of every function in `DRIVER_SYMBOLS` (so each is a
//! name the header declares, after its `_v2` macros), and prints the size of
//! every struct and the value of every constant the module passes to the
//! driver; the test compares them with cudarc's bindings as this crate
//! compiles them.
//!
//! Without the header (or a C compiler) the test skips, saying so;
//! `ODC_REQUIRE_CUDA_HEADERS=1` makes that a failure.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::path::PathBuf;
use std::process::Command;

use odc_core::gpu::device::DRIVER_SYMBOLS;
use odc_kernels::cuda::cudarc::driver::sys;

fn skip(why: &str) {
    assert!(
        std::env::var_os("ODC_REQUIRE_CUDA_HEADERS").is_none(),
        "ODC_REQUIRE_CUDA_HEADERS is set but {why}"
    );
    eprintln!("SKIPPED cuda driver bindings: {why}");
}

/// The first `include/` with a `cuda.h` among the wheels of `$VIRTUAL_ENV`
/// and the workspace `.venv`.
fn include_dir() -> Option<PathBuf> {
    let mut roots = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v));
    }
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv"));
    for root in roots {
        let Ok(lib) = std::fs::read_dir(root.join("lib")) else {
            continue;
        };
        for py in lib.flatten() {
            let nvidia = py.path().join("site-packages/nvidia");
            for sub in ["cu13/include", "cuda_runtime/include"] {
                let inc = nvidia.join(sub);
                if inc.join("cuda.h").exists() {
                    return Some(inc);
                }
            }
        }
    }
    None
}

fn rust_values() -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    let mut put = |k: &str, v: i64| {
        m.insert(k.to_owned(), v);
    };
    put(
        "size CUmemAllocationProp",
        size_of::<sys::CUmemAllocationProp>() as i64,
    );
    put(
        "size CUmemAccessDesc",
        size_of::<sys::CUmemAccessDesc>() as i64,
    );
    put("size CUmemLocation", size_of::<sys::CUmemLocation>() as i64);
    put(
        "size CUipcMemHandle",
        size_of::<sys::CUipcMemHandle>() as i64,
    );
    put(
        "size CUmemGenericAllocationHandle",
        size_of::<sys::CUmemGenericAllocationHandle>() as i64,
    );
    put("size CUdeviceptr", size_of::<sys::CUdeviceptr>() as i64);
    put("size CUstream", size_of::<sys::CUstream>() as i64);
    put("size CUevent", size_of::<sys::CUevent>() as i64);
    use sys::CUdevice_attribute as A;
    put(
        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED as i64,
    );
    put(
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED as i64,
    );
    put(
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
        A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS as i64,
    );
    put(
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as i64,
    );
    put(
        "CU_MEM_ALLOCATION_TYPE_PINNED",
        sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as i64,
    );
    put(
        "CU_MEM_LOCATION_TYPE_DEVICE",
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i64,
    );
    put(
        "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as i64,
    );
    put(
        "CU_MEM_ALLOC_GRANULARITY_MINIMUM",
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM as i64,
    );
    put(
        "CU_MEMHOSTREGISTER_DEVICEMAP",
        i64::from(sys::CU_MEMHOSTREGISTER_DEVICEMAP),
    );
    put(
        "CU_MEMHOSTREGISTER_PORTABLE",
        i64::from(sys::CU_MEMHOSTREGISTER_PORTABLE),
    );
    put(
        "CU_STREAM_WRITE_VALUE_DEFAULT",
        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as i64,
    );
    put(
        "CU_EVENT_DISABLE_TIMING",
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as i64,
    );
    put(
        "CU_EVENT_WAIT_DEFAULT",
        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as i64,
    );
    put(
        "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",
        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as i64,
    );
    m
}

fn c_program(keys: &[String]) -> String {
    let mut s = String::from("#include <stdio.h>\n#include <cuda.h>\n");
    // Every driver function the module calls must be a declared name.
    // (Compiled, not linked, with ODC_SYMBOLS: there is no driver to link.)
    s.push_str("#ifdef ODC_SYMBOLS\nvoid *const odc_symbols[] = {\n");
    for sym in DRIVER_SYMBOLS {
        s.push_str(&format!("    (void *)&{sym},\n"));
    }
    s.push_str("};\nconst unsigned long odc_symbol_count = sizeof odc_symbols / sizeof odc_symbols[0];\n#else\n");
    s.push_str("int main(void) {\n");
    for k in keys {
        let expr = match k.strip_prefix("size ") {
            Some(t) => format!("(long long)sizeof({t})"),
            None => format!("(long long){k}"),
        };
        s.push_str(&format!("    printf(\"{k} %lld\\n\", {expr});\n"));
    }
    s.push_str("    return 0;\n}\n#endif\n");
    s
}

#[test]
fn driver_calls_match_cuda_h() {
    let Some(inc) = include_dir() else {
        return skip("no cuda.h in the venv's nvidia wheels (run `make setup`)");
    };
    let want = rust_values();
    let keys: Vec<String> = want.keys().cloned().collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("check.c");
    let exe = dir.path().join("check");
    std::fs::write(&src, c_program(&keys)).expect("write check.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = |extra: &[&str], what: &str| {
        let out = Command::new(&cc)
            .args(["-std=c11", "-Werror=implicit-function-declaration", "-I"])
            .arg(&inc)
            .args(extra)
            .arg(&src)
            .output();
        match out {
            Ok(o) => {
                assert!(
                    o.status.success(),
                    "{what} against {} failed to build:\n{}",
                    inc.display(),
                    String::from_utf8_lossy(&o.stderr)
                );
                true
            }
            Err(e) => {
                skip(&format!("no C compiler {cc:?}: {e}"));
                false
            }
        }
    };
    let obj = dir.path().join("symbols.o");
    let obj = obj.to_str().expect("utf-8 path");
    if !build(
        &["-c", "-DODC_SYMBOLS", "-o", obj],
        "taking the address of every function in DRIVER_SYMBOLS (one is not declared by cuda.h)",
    ) {
        return;
    }
    let exe_s = exe.to_str().expect("utf-8 path");
    if !build(&["-o", exe_s], "the layout program") {
        return;
    }
    let run = Command::new(&exe).output().expect("run check");
    assert!(run.status.success());
    let text = String::from_utf8_lossy(&run.stdout);
    let mut got = BTreeMap::new();
    for line in text.lines() {
        let (k, v) = line.rsplit_once(' ').expect("key value");
        got.insert(k.to_owned(), v.parse::<i64>().expect("number"));
    }
    let diff: Vec<String> = want
        .iter()
        .filter(|(k, v)| got.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: Rust {v}, cuda.h {:?}", got.get(k)))
        .collect();
    assert!(
        diff.is_empty(),
        "against {}:\n{}",
        inc.display(),
        diff.join("\n")
    );
    eprintln!(
        "{} values and {} symbols match {}",
        want.len(),
        DRIVER_SYMBOLS.len(),
        inc.display()
    );
}
