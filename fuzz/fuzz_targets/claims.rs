//! libFuzzer's driver around [`odc_fuzz::claims`] (scripts/fuzz.sh builds and runs it).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| odc_fuzz::claims::run(data));
