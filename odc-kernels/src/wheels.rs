//! Finding native libraries shipped in PyPI wheels (`nvidia-*`), for the
//! lazily loaded CUDA and NVSHMEM bindings.

use std::path::{Path, PathBuf};

/// Files to try, in order, before the system loader: `$env` (a file, or a
/// directory holding `soname`), then `site-packages/<wheel_dir>/<soname>` in
/// `$VIRTUAL_ENV` and in the workspace's `.venv` (where `make setup` puts it).
pub fn candidates(env: &str, wheel_dir: &str, soname: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        out.push(if p.is_dir() { p.join(soname) } else { p });
    }
    let mut venvs = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV").filter(|p| !p.is_empty()) {
        venvs.push(PathBuf::from(v));
    }
    if let Some(root) = Path::new(env!("CARGO_MANIFEST_DIR")).parent() {
        venvs.push(root.join(".venv"));
    }
    for venv in venvs {
        for site in site_packages(&venv) {
            let p = site.join(wheel_dir).join(soname);
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// `venv/lib/python3.*/site-packages`, sorted for a stable order.
fn site_packages(venv: &Path) -> Vec<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_override_comes_first_and_directories_get_the_soname() {
        let dir = std::env::temp_dir();
        // A variable name nobody else sets, so tests do not interfere.
        let var = "ODC_WHEELS_TEST_LIB_DIR";
        std::env::set_var(var, &dir);
        let c = candidates(var, "nvidia/x/lib", "libx.so.1");
        std::env::remove_var(var);
        assert_eq!(c.first(), Some(&dir.join("libx.so.1")));
        assert!(c
            .iter()
            .skip(1)
            .all(|p| p.ends_with("nvidia/x/lib/libx.so.1")));
    }
}
