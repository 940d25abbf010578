//! libFuzzer's driver around [`odc_fuzz::membership`] (scripts/fuzz.sh builds and runs it).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| odc_fuzz::membership::run(data));
