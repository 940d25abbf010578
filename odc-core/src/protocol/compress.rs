//! Compressed chunks: which pushes carry block-scaled low-precision chunks
//! instead of the gradient's own bytes, and how many elements one carries.
//!
//! The setting ([`Compress`]) names a format per direction and a scope: by
//! default only what crosses nodes is compressed (a push to a landing slot
//! on another node: under node sums the node's sums, otherwise every chunk
//! for a remote owner); [`Scope::All`] compresses every push, for tests on
//! one host. A chunk holds whole blocks of its format wherever the slot
//! takes one ([`chunk_elems`]), so a block never straddles a chunk, let
//! alone a shard. Pure rules: no I/O, no clock.

use odc_kernels::cpu::quant::Spec;

/// Which pushes are compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Scope {
    /// Only chunks whose landing slot is on another node.
    #[default]
    CrossNode,
    /// Every chunk that goes through a landing slot.
    All,
}

impl Scope {
    /// Accepted names, in the order they are documented.
    pub const NAMES: [&'static str; 2] = ["cross-node", "all"];

    /// The scope named `name` (`"cross-node"` or `"all"`; `_` for `-`).
    pub fn parse(name: &str) -> Option<Scope> {
        match name.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "cross-node" => Some(Scope::CrossNode),
            "all" => Some(Scope::All),
            _ => None,
        }
    }

    /// The name [`Scope::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Scope::CrossNode => "cross-node",
            Scope::All => "all",
        }
    }
}

/// What is compressed and how (`EngineConfig::compress`; `None` there
/// keeps every byte as today).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compress {
    /// The format of pushed gradient chunks (`None`: full precision).
    pub push: Option<Spec>,
    /// The format of gathered shards (not built yet: the engine refuses it
    /// by name).
    pub gather: Option<Spec>,
    /// Whether a pusher keeps each bucket's quantisation residual and adds
    /// it into its next push of the same elements (error feedback).
    pub feedback: bool,
    /// Which pushes and gathers the formats apply to.
    pub scope: Scope,
}

/// Whether a push to a landing slot on rank `server` is compressed with
/// `spec` (`is_local`: whether that rank is on the pusher's node).
pub fn push_spec(c: Option<&Compress>, server_is_local: bool) -> Option<Spec> {
    let c = c?;
    let spec = c.push?;
    match c.scope {
        Scope::All => Some(spec),
        Scope::CrossNode => (!server_is_local).then_some(spec),
    }
}

/// Elements a compressed chunk of `spec` carries in a slot of `slot_bytes`:
/// the most whole blocks whose scales and payload fit, or `None` when not
/// one block fits (the chunk then carries the uncompressed count, in one
/// short block, which fits whenever the uncompressed chunk does).
pub fn chunk_elems(spec: Spec, slot_bytes: usize) -> Option<usize> {
    let per_block = spec.chunk_bytes(spec.block());
    let blocks = slot_bytes / per_block;
    (blocks > 0).then(|| blocks * spec.block())
}

#[cfg(test)]
mod tests {
    use super::*;
    use odc_kernels::cpu::quant::Format;

    #[test]
    fn only_cross_node_pushes_are_compressed_by_default() {
        let spec = Spec::new(Format::Int8, 32).unwrap();
        let c = Compress {
            push: Some(spec),
            gather: None,
            feedback: true,
            scope: Scope::CrossNode,
        };
        assert_eq!(push_spec(Some(&c), false), Some(spec));
        assert_eq!(push_spec(Some(&c), true), None);
        let all = Compress {
            scope: Scope::All,
            ..c
        };
        assert_eq!(push_spec(Some(&all), true), Some(spec));
        assert_eq!(push_spec(None, false), None);
        let gather_only = Compress { push: None, ..c };
        assert_eq!(push_spec(Some(&gather_only), false), None);
    }

    #[test]
    fn a_chunk_holds_whole_blocks_that_fit_the_slot() {
        let int8 = Spec::new(Format::Int8, 32).unwrap();
        // 32 + 4 bytes a block: 7 blocks in 256 bytes.
        assert_eq!(chunk_elems(int8, 256), Some(7 * 32));
        assert!(int8.chunk_bytes(7 * 32) <= 256);
        let bf16 = Spec::new(Format::Bf16, 32).unwrap();
        assert_eq!(chunk_elems(bf16, 256), Some(128));
        assert_eq!(chunk_elems(int8, 20), None);
        assert_eq!(Scope::parse("cross_node"), Some(Scope::CrossNode));
        assert_eq!(Scope::parse("ALL"), Some(Scope::All));
        assert_eq!(Scope::parse("node"), None);
    }
}
