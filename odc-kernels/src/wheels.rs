//! Finding native libraries shipped in PyPI wheels (`nvidia-*`) or installed
//! with a system CUDA, for the lazily loaded NVRTC and NVSHMEM bindings.
//!
//! The Python `site-packages` directories searched, in order:
//! `$ODC_SITE_PACKAGES` (a `:`-separated list: the `odc` Python package sets
//! it on import to its interpreter's `site-packages`, so a library from a
//! wheel of the very interpreter running ODC is found; a script driving the
//! Rust test executables sets it to a `python3`'s), `$VIRTUAL_ENV`'s, and the
//! build checkout's `.venv`'s (where `make setup` puts the wheels).

use std::path::{Path, PathBuf};

/// Environment variable holding `site-packages` directories to search (`:`-separated).
pub const SITE_ENV: &str = "ODC_SITE_PACKAGES";

/// Where one library may live: a file name and the folders (relative to a
/// `site-packages`, or absolute system folders) that may hold it.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// The library's file name (its soname: `libnvrtc.so.13`).
    pub file: &'static str,
    /// Folders under a `site-packages` (`nvidia/cu13/lib`).
    pub wheel_dirs: &'static [&'static str],
    /// Absolute folders of a system install (`/usr/local/cuda/lib64`).
    pub system_dirs: &'static [&'static str],
}

/// Files to try, in order, before the system loader: `$env` (a file, or a
/// directory holding one of the layouts' files), then for each layout in
/// order its wheel folders in every `site-packages` ([`site_packages`]), then
/// its system folders (`$CUDA_HOME`/`$CUDA_PATH` `lib64` first).
pub fn candidates(env: &str, layouts: &[Layout]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut push = |p: PathBuf| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_dir() {
            for l in layouts {
                push(p.join(l.file));
            }
        } else {
            push(p);
        }
    }
    let sites = site_packages();
    let cuda_homes: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).filter(|p| !p.is_empty()))
        .map(|p| PathBuf::from(p).join("lib64"))
        .collect();
    for l in layouts {
        for site in &sites {
            for dir in l.wheel_dirs {
                push(site.join(dir).join(l.file));
            }
        }
    }
    for l in layouts {
        for home in &cuda_homes {
            push(home.join(l.file));
        }
        for dir in l.system_dirs {
            push(Path::new(dir).join(l.file));
        }
    }
    out
}

/// The `site-packages` directories searched, in order (see the module doc).
pub fn site_packages() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(list) = std::env::var_os(SITE_ENV) {
        out.extend(std::env::split_paths(&list).filter(|p| p.is_dir()));
    }
    let mut venvs = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV").filter(|p| !p.is_empty()) {
        venvs.push(PathBuf::from(v));
    }
    if let Some(root) = Path::new(env!("CARGO_MANIFEST_DIR")).parent() {
        venvs.push(root.join(".venv"));
    }
    for venv in venvs {
        for site in venv_site_packages(&venv) {
            if !out.contains(&site) {
                out.push(site);
            }
        }
    }
    out
}

/// `venv/lib/python3.*/site-packages`, sorted for a stable order.
fn venv_site_packages(venv: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found
}

/// The file a loaded function lives in, from `/proc/self/maps` (for a
/// library the system loader found by soname), or `None` where unknown.
pub fn file_of(addr: usize) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (lo, hi) = parts.next()?.split_once('-')?;
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).ok()?,
            usize::from_str_radix(hi, 16).ok()?,
        );
        let path = parts.nth(4)?;
        (lo <= addr && addr < hi && path.starts_with('/')).then(|| PathBuf::from(path))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUTS: &[Layout] = &[
        Layout {
            file: "libx.so.13",
            wheel_dirs: &["nvidia/cu13/lib"],
            system_dirs: &["/opt/x/lib"],
        },
        Layout {
            file: "libx.so.12",
            wheel_dirs: &["nvidia/x/lib"],
            system_dirs: &["/opt/x/lib"],
        },
    ];

    #[test]
    fn env_override_comes_first_and_directories_get_every_soname() {
        let dir = std::env::temp_dir();
        // A variable name nobody else sets, so tests do not interfere.
        let var = "ODC_WHEELS_TEST_LIB_DIR";
        std::env::set_var(var, &dir);
        let c = candidates(var, LAYOUTS);
        std::env::remove_var(var);
        assert_eq!(c[0], dir.join("libx.so.13"));
        assert_eq!(c[1], dir.join("libx.so.12"));
        // Newer major first in the wheels, then the system folders, each file once.
        let wheel13 = c
            .iter()
            .position(|p| p.ends_with("nvidia/cu13/lib/libx.so.13"));
        let wheel12 = c
            .iter()
            .position(|p| p.ends_with("nvidia/x/lib/libx.so.12"));
        let sys13 = c
            .iter()
            .position(|p| p == Path::new("/opt/x/lib/libx.so.13"));
        let sys12 = c
            .iter()
            .position(|p| p == Path::new("/opt/x/lib/libx.so.12"));
        assert!(sys13.is_some() && sys12.is_some(), "{c:?}");
        if let (Some(w13), Some(w12)) = (wheel13, wheel12) {
            assert!(w13 < w12 && w12 < sys13.unwrap_or(0), "{c:?}");
        }
        assert!(sys13 < sys12, "{c:?}");
    }

    #[test]
    fn site_packages_from_the_environment_come_first() {
        let dir = std::env::temp_dir();
        // SITE_ENV is read by every lookup: this test restores it.
        let was = std::env::var_os(SITE_ENV);
        std::env::set_var(SITE_ENV, std::env::join_paths([&dir]).expect("a path"));
        let sites = site_packages();
        match was {
            Some(v) => std::env::set_var(SITE_ENV, v),
            None => std::env::remove_var(SITE_ENV),
        }
        assert_eq!(sites.first(), Some(&dir));
    }

    #[test]
    fn a_function_of_this_process_is_found_in_a_mapped_file() {
        let f: fn(usize) -> Option<PathBuf> = file_of;
        let path = file_of(f as usize).expect("this test's own executable is mapped");
        assert!(path.is_file(), "{path:?}");
    }
}
