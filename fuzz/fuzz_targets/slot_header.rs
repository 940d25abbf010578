//! libFuzzer's driver around [`odc_fuzz::slot_header`] (scripts/fuzz.sh builds and runs it).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| odc_fuzz::slot_header::run(data));
