//! `odc-pack`: plan sequence packing from the command line.

fn main() {
    std::process::exit(odc_packing::cli::run(std::env::args_os()));
}
