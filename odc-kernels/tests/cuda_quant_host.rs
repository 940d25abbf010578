//! `quant.cu`'s kernels run on the host, against the host kernels, bit for
//! bit: what a machine without a GPU can check of their logic beyond NVRTC
//! accepting them (scale blocks, tails, the shuffle reduction, the fp8 and
//! int8 rounding, non-finite codes, the decode and the accumulate).
//!
//! The source is compiled as C++ by the system compiler (`$CXX`, else
//! `c++`, `g++` or `clang++`) with stand-ins for the CUDA built-ins: the
//! explicitly rounded intrinsics are plain f32 operations (IEEE, SSE on
//! x86_64, no contraction), one thread block of two warps runs as 64 host
//! threads, and `__shfl_xor_sync` trades values through a per-warp barrier.
//! Without a C++20 compiler the test skips, saying so. On a GPU,
//! `cuda_quant.rs` checks the same against the device itself.

use std::path::{Path, PathBuf};
use std::process::Command;

use half::bf16;
use odc_kernels::cpu::quant::{self, Format, Spec};

/// The CUDA built-ins `quant.cu` uses, for a host build; then the source.
const SHIM: &str = r#"
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
struct D3 { unsigned x; };
static thread_local D3 threadIdx{0};
static D3 blockIdx{0}, blockDim{64}, gridDim{1};
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
static std::barrier<>* bars[2];
static float shfl_buf[64];
static float __shfl_xor_sync(unsigned, float v, int off) {
    unsigned t = threadIdx.x;
    shfl_buf[t] = v;
    bars[t / 32]->arrive_and_wait();
    float r = shfl_buf[t ^ off];
    bars[t / 32]->arrive_and_wait();
    return r;
}
#include QUANT_CU

template <typename F> static void launch(F f) {
    std::barrier<> b0(32), b1(32);
    bars[0] = &b0;
    bars[1] = &b1;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < blockDim.x; t++) ts.emplace_back([t, &f] { threadIdx.x = t; f(); });
    for (auto& t : ts) t.join();
}

static std::vector<char> slurp(const std::string& p) {
    FILE* f = fopen(p.c_str(), "rb");
    std::vector<char> v;
    char buf[65536];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + k);
    fclose(f);
    return v;
}

static void spit(const std::string& p, const void* d, size_t n) {
    FILE* f = fopen(p.c_str(), "wb");
    fwrite(d, 1, n, f);
    fclose(f);
}

// args: dir fmt(0 fp8, 1 int8) block factor; reads dir/x, dir/acc; writes codes, scales, acc_out, out, out16,
// and error feedback's step on residual acc and gradient x (feedback_quantise_raw's launches, the first one,
// kernels.cu's accumulate with factor 1, as a plain add): fb_codes, fb_scales, fb_residual.
int main(int argc, char** argv) {
    if (argc != 5) return 2;
    std::string dir = argv[1];
    int fmt = atoi(argv[2]);
    unsigned block = (unsigned)atoi(argv[3]);
    float factor = (float)atof(argv[4]);
    auto xb = slurp(dir + "/x"), ab = slurp(dir + "/acc");
    u64 n = xb.size() / 4, nb = (n + block - 1) / block;
    const float* x = (const float*)xb.data();
    std::vector<u8> codes(n);
    std::vector<float> scales(nb), acc((const float*)ab.data(), (const float*)ab.data() + n), out(n);
    std::vector<bf16> out16(n);
    std::vector<u8> fb_codes(n);
    std::vector<float> fb_scales(nb), residual(acc);
    for (u64 i = 0; i < n; i++) residual[i] = __fadd_rn(residual[i], x[i]);
    if (fmt == 0) {
        launch([&] { odc_quantise_fp8(residual.data(), fb_codes.data(), fb_scales.data(), n, block); });
        launch([&] { odc_dequantise_accumulate_fp8(residual.data(), fb_codes.data(), fb_scales.data(), n, block, -1.0f); });
    } else {
        launch([&] { odc_quantise_int8(residual.data(), fb_codes.data(), fb_scales.data(), n, block); });
        launch([&] { odc_dequantise_accumulate_int8(residual.data(), fb_codes.data(), fb_scales.data(), n, block, -1.0f); });
    }
    launch([&] { odc_zero_non_finite(residual.data(), n); });
    if (fmt == 0) {
        launch([&] { odc_quantise_fp8(x, codes.data(), scales.data(), n, block); });
        launch([&] { odc_dequantise_accumulate_fp8(acc.data(), codes.data(), scales.data(), n, block, factor); });
        launch([&] { odc_dequantise_fp8_to_f32(codes.data(), scales.data(), out.data(), n, block); });
        launch([&] { odc_dequantise_fp8_to_bf16(codes.data(), scales.data(), out16.data(), n, block); });
    } else {
        launch([&] { odc_quantise_int8(x, codes.data(), scales.data(), n, block); });
        launch([&] { odc_dequantise_accumulate_int8(acc.data(), codes.data(), scales.data(), n, block, factor); });
        launch([&] { odc_dequantise_int8_to_f32(codes.data(), scales.data(), out.data(), n, block); });
        launch([&] { odc_dequantise_int8_to_bf16(codes.data(), scales.data(), out16.data(), n, block); });
    }
    spit(dir + "/codes", codes.data(), n);
    spit(dir + "/scales", scales.data(), 4 * nb);
    spit(dir + "/acc_out", acc.data(), 4 * n);
    spit(dir + "/out", out.data(), 4 * n);
    spit(dir + "/out16", out16.data(), 2 * n);
    spit(dir + "/fb_codes", fb_codes.data(), n);
    spit(dir + "/fb_scales", fb_scales.data(), 4 * nb);
    spit(dir + "/fb_residual", residual.data(), 4 * n);
    return 0;
}
"#;

/// A working directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("cuda_quant_host: could not remove {:?}: {e}", self.0);
        }
    }
}

/// Compiles the shim, or says why the test skips.
fn build(dir: &Path) -> Option<PathBuf> {
    let quant_cu = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/quant.cu");
    let source = dir.join("quant_host.cpp");
    std::fs::write(&source, SHIM).unwrap_or_else(|e| panic!("write {source:?}: {e}"));
    let exe = dir.join("quant_host");
    let compilers: Vec<String> = match std::env::var("CXX") {
        Ok(cxx) => vec![cxx],
        Err(_) => ["c++", "g++", "clang++"].map(String::from).to_vec(),
    };
    let mut tried = Vec::new();
    for cxx in compilers {
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-ffp-contract=off", "-pthread"])
            .arg(format!("-DQUANT_CU=\"{}\"", quant_cu.display()))
            .arg("-o")
            .arg(&exe)
            .arg(&source)
            .output();
        match out {
            Ok(o) if o.status.success() => return Some(exe),
            Ok(o) => tried.push(format!(
                "{cxx}: {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" | ")
            )),
            Err(e) => tried.push(format!("{cxx}: {e}")),
        }
    }
    eprintln!(
        "SKIPPED quant_cu_on_the_host_matches_the_host_kernels: no C++20 compiler built the shim: {}",
        tried.join("; ")
    );
    None
}

fn values(n: usize, seed: u32, specials: bool) -> Vec<f32> {
    let pool = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        3.3e38,
    ];
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(11);
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            if specials && i % 23 == 4 {
                pool[(state as usize) % pool.len()]
            } else {
                f32::from_bits((state & 0x807f_ffff) | ((105 + (state >> 24) % 30) << 23))
            }
        })
        .collect()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {path:?}: {e}"))
}

fn same_f32(what: &str, got: &[u8], want: &[f32]) {
    let got: Vec<f32> = got
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: quant.cu {g}, host {w}"
        );
    }
}

#[test]
fn quant_cu_on_the_host_matches_the_host_kernels() {
    let dir = std::env::temp_dir().join(format!("odc-quant-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {dir:?}: {e}"));
    let scratch = Scratch(dir);
    let Some(exe) = build(&scratch.0) else {
        return;
    };
    let ok = |r: odc_kernels::Result<()>| r.unwrap_or_else(|e| panic!("{e}"));
    for (format, code) in [(Format::Fp8E4m3, "0"), (Format::Int8, "1")] {
        // Blocks smaller than, equal to and larger than a warp, one not a
        // power of two; lengths with and without a tail block.
        for block in [16usize, 32, 48, 128, 1024] {
            let spec = Spec::new(format, block).unwrap_or_else(|e| panic!("{e}"));
            for n in [1usize, 31, 33, 100, 4099, 20_000] {
                let what = format!("{spec} n={n}");
                let x = values(n, (n * 7 + block) as u32, true);
                let acc0 = values(n, 5, false);
                let file = |name: &str| scratch.0.join(name);
                std::fs::write(file("x"), bytemuck::cast_slice::<f32, u8>(&x))
                    .unwrap_or_else(|e| panic!("{e}"));
                std::fs::write(file("acc"), bytemuck::cast_slice::<f32, u8>(&acc0))
                    .unwrap_or_else(|e| panic!("{e}"));
                let status = Command::new(&exe)
                    .arg(&scratch.0)
                    .args([code, &block.to_string(), "-0.75"])
                    .status()
                    .unwrap_or_else(|e| panic!("run {exe:?}: {e}"));
                assert!(status.success(), "{what}: {exe:?} exited {status}");

                let mut codes = vec![0u8; n];
                let mut scales = vec![0f32; spec.scales(n)];
                ok(quant::quantise(spec, &x, &mut codes, &mut scales));
                assert_eq!(read(&file("codes")), codes, "{what}: codes");
                same_f32(&format!("{what}: scales"), &read(&file("scales")), &scales);
                let mut acc = acc0.clone();
                ok(quant::dequantise_accumulate(
                    spec, &codes, &scales, &mut acc, -0.75,
                ));
                same_f32(
                    &format!("{what}: accumulate"),
                    &read(&file("acc_out")),
                    &acc,
                );
                let mut out = vec![0f32; n];
                ok(quant::dequantise(spec, &codes, &scales, &mut out));
                same_f32(&format!("{what}: dequantise"), &read(&file("out")), &out);
                let mut out16 = vec![bf16::ZERO; n];
                ok(quant::dequantise(spec, &codes, &scales, &mut out16));
                let got16 = read(&file("out16"));
                for (i, (g, w)) in got16.chunks_exact(2).zip(&out16).enumerate() {
                    let g = bf16::from_bits(u16::from_ne_bytes([g[0], g[1]]));
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{what}: bf16 element {i}: quant.cu {g}, host {w}"
                    );
                }
                // Error feedback's step: residual acc0, gradient x (with
                // non-finite elements: their residuals are zeroed).
                let mut residual = acc0.clone();
                let (mut fb_codes, mut fb_scales) = (vec![0u8; n], vec![0f32; spec.scales(n)]);
                ok(quant::feedback_quantise(
                    spec,
                    &mut residual,
                    &x,
                    &mut fb_codes,
                    &mut fb_scales,
                ));
                assert!(residual.iter().all(|r| r.is_finite()), "{what}");
                assert_eq!(read(&file("fb_codes")), fb_codes, "{what}: feedback codes");
                same_f32(
                    &format!("{what}: feedback scales"),
                    &read(&file("fb_scales")),
                    &fb_scales,
                );
                same_f32(
                    &format!("{what}: feedback residual"),
                    &read(&file("fb_residual")),
                    &residual,
                );
            }
        }
    }
}
