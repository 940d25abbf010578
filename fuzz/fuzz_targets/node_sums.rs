//! libFuzzer's driver around [`odc_fuzz::node_sums`] (scripts/fuzz.sh builds and runs it).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| odc_fuzz::node_sums::run(data));
