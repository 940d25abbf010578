//! Fuzz targets for every decoder of bytes that a peer, the store or a
//! user's file hands ODC: one module per decoder family, each a
//! `run(data: &[u8])` that decodes the input the way the engine does and
//! panics when a property fails — not only "no panic", but round trips,
//! accepted values inside the registered layout, sums that match a
//! reference, errors that name the peer (or the file) and the field.
//!
//! | target | decoders |
//! |---|---|
//! | [`slot_header`] | `control::SlotHeader::decode` and the daemon's check of a header against the layout (`control::check_header`), then the add it allows against the scalar reference kernel |
//! | [`control_words`] | the words `protocol/` reads from peers: landing-slot counts and acknowledgements (`slots`), versions, releases and done stamps (`versions`, `finish`), partials and pieces (`partials`, `pieces`), the blame a dead peer's word names (`wait::blame`) |
//! | [`claims`] | claim words, steal requests and grants (`protocol::claims`, as the daemon and the thief use them) |
//! | [`fabric_imm`] | the libfabric transport's 4-byte immediates (`transport::fabric::Imm`) and the peer address of an endpoint post |
//! | [`store_values`] | what registration reads from the store: endpoint posts and region descriptors, registration posts, counters (`store::added`), the job id |
//! | [`gpu_descriptors`] | the cuda-ipc exchange's posts (`gpu::ipc::parse_post`), the fd-share socket's request and reply headers (`gpu::fdshare`), NVSHMEM unique ids |
//! | [`pack_input`] | `odc-pack`'s readers (`parse_lengths`: JSON arrays and line lists; `fit::parse_timings`) and the command on what they accept |
//! | [`membership`] | elastic membership: rounds (`protocol::membership`, the rule and the store's bytes), their keys as `elastic::Rounds` reads them, generation records (`elastic::Generation`) and a restarted rank's walk (`elastic::await_admission`) |
//! | [`node_cache`] | the node cache's entry and slot words (`protocol::cache`): the checked decode, the reader's rule, take-overs, eviction, and node-mates filling and reading slots in any interleaving |
//! | [`node_sums`] | node aggregation (`protocol::nodesum`): where a chunk goes, the owner field an aggregator's daemon accepts, whose done words feed and release an owner, when the sums go; node-mates, aggregators and owners in any interleaving |
//!
//! [`TARGETS`] lists them for the replay test and `scripts/fuzz.sh`.

// The targets assert properties: a failed one is the finding.
#![allow(clippy::panic)]

pub mod claims;
pub mod control_words;
pub mod fabric_imm;
pub mod gpu_descriptors;
pub mod mem_store;
pub mod membership;
pub mod node_cache;
pub mod node_sums;
pub mod pack_input;
pub mod slot_header;
pub mod store_values;

/// A target's body: decodes one input, panics when a property fails.
pub type Target = fn(&[u8]);

/// Every target: its name (the binary and the corpus folder) and body.
pub const TARGETS: &[(&str, Target)] = &[
    ("slot_header", slot_header::run),
    ("control_words", control_words::run),
    ("claims", claims::run),
    ("fabric_imm", fabric_imm::run),
    ("store_values", store_values::run),
    ("gpu_descriptors", gpu_descriptors::run),
    ("pack_input", pack_input::run),
    ("membership", membership::run),
    ("node_cache", node_cache::run),
    ("node_sums", node_sums::run),
];

/// Whether an error's message names rank `peer` the way the engine's
/// errors do.
pub fn names_rank(message: &str, peer: usize) -> bool {
    let needle = format!("rank {peer}");
    message.match_indices(&needle).any(|(i, _)| {
        !message[i + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}
