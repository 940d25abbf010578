//! Compressed chunks: which pushes carry block-scaled low-precision chunks
//! instead of the gradient's own bytes, which gathers read an owner's
//! quantised copy of its shard instead of the shard, and how both are cut.
//!
//! The setting ([`Compress`]) names a format per direction and a scope: by
//! default only what crosses nodes is compressed (a push to a landing slot
//! on another node: under node sums the node's sums, otherwise every chunk
//! for a remote owner; a gather's read of a shard owned on another node:
//! the node cache's fetches, or the direct reads without a cache);
//! [`Scope::All`] compresses every push and every read of another rank's
//! shard, for tests on one host. A rank's own shard is never read
//! compressed. Under hybrid sharding what crosses nodes is the minibatch's
//! sum of the gradient shards, compressed in the push format
//! ([`sum_spec`]), and under hybrid-zero also the parameter pieces each
//! node copies from the others at a publish, read from their owners'
//! quantised copies in the gather format. A chunk holds whole blocks of its format wherever the slot
//! takes one ([`chunk_elems`]), so a block never straddles a chunk, let
//! alone a shard; the quantised copy of a shard ([`QuantCopy`]) is cut into
//! runs of whole blocks of that shard alone, each laid out as a chunk
//! (scales, then codes), so any run of them is one contiguous read. Pure
//! rules: no I/O, no clock.

use std::ops::Range;

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
    /// The format of the owners' quantised copies that gathers read
    /// ([`gather_spec`]).
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

/// The format of hybrid sharding's end-of-minibatch sum across nodes: the
/// push format under either scope (that sum always crosses nodes; it is
/// the only gradient traffic that does there). Each rank quantises its
/// partial sums once, with error feedback when set, and every node adds
/// every node's dequantised copy, its own included, so the replicas stay
/// equal bit for bit.
pub fn sum_spec(c: Option<&Compress>) -> Option<Spec> {
    c?.push
}

/// Whether a gather's read of another rank's shard takes the owner's
/// quantised copy in `spec` rather than the shard (`owner_is_me`: the
/// reader's own shard, always read as it is; `owner_is_local`: on the
/// reader's node).
pub fn gather_spec(c: Option<&Compress>, owner_is_me: bool, owner_is_local: bool) -> Option<Spec> {
    let c = c?;
    let spec = c.gather?;
    match (owner_is_me, c.scope) {
        (true, _) => None,
        (false, Scope::All) => Some(spec),
        (false, Scope::CrossNode) => (!owner_is_local).then_some(spec),
    }
}

/// An owner's quantised copy of one shard of `shard_len` elements: runs of
/// `run` elements (whole blocks; the shard's last run may be short, its
/// last block too), each laid out as a compressed chunk (scales, then
/// codes) at a stride of `spec.chunk_bytes(run)` bytes. Blocks are those of
/// the shard alone, so the copy's values are the shard's quantised as one
/// whole, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantCopy {
    /// The format and block size.
    pub spec: Spec,
    /// Elements per run (a multiple of the block size).
    pub run: usize,
    /// Elements of the shard.
    pub shard_len: usize,
}

impl QuantCopy {
    /// The copy of a shard of `shard_len` elements whose runs are the
    /// most whole blocks that fit `slot_bytes` (the landing chunk, which is
    /// also a node cache piece's bound), at least one block.
    pub fn new(spec: Spec, slot_bytes: usize, shard_len: usize) -> QuantCopy {
        let run = chunk_elems(spec, slot_bytes).unwrap_or(spec.block());
        QuantCopy {
            spec,
            run,
            shard_len,
        }
    }

    /// Runs in the copy (at least one).
    pub fn runs(&self) -> usize {
        self.shard_len.div_ceil(self.run).max(1)
    }

    /// Shard elements of run `j`.
    pub fn elems(&self, j: usize) -> Range<usize> {
        let start = (j * self.run).min(self.shard_len);
        start..(start + self.run).min(self.shard_len)
    }

    /// Bytes from one run's start to the next one's.
    pub fn stride(&self) -> usize {
        self.spec.chunk_bytes(self.run)
    }

    /// Byte offset of run `j` in the copy.
    pub fn at(&self, j: usize) -> usize {
        j * self.stride()
    }

    /// Bytes of run `j`.
    pub fn bytes(&self, j: usize) -> usize {
        self.spec.chunk_bytes(self.elems(j).len())
    }

    /// Bytes of the whole copy.
    pub fn len(&self) -> usize {
        let last = self.runs() - 1;
        self.at(last) + self.bytes(last)
    }

    /// Bytes a gather's staging keeps per owner for this copy (its length,
    /// 64-aligned).
    pub fn staging_stride(&self) -> usize {
        self.len().next_multiple_of(64)
    }

    /// Whether the copy holds no element.
    pub fn is_empty(&self) -> bool {
        self.shard_len == 0
    }

    /// The runs that hold shard elements `[0, n)` and their bytes from the
    /// copy's start.
    pub fn covering(&self, n: usize) -> (usize, usize) {
        let n = n.min(self.shard_len);
        if n == 0 {
            return (0, 0);
        }
        let runs = n.div_ceil(self.run);
        (runs, self.at(runs - 1) + self.bytes(runs - 1))
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
    fn only_other_ranks_shards_are_gathered_compressed() {
        let fp8 = Spec::new(Format::Fp8E4m3, 32).unwrap();
        let c = Compress {
            push: None,
            gather: Some(fp8),
            feedback: true,
            scope: Scope::CrossNode,
        };
        assert_eq!(gather_spec(Some(&c), false, false), Some(fp8));
        assert_eq!(gather_spec(Some(&c), false, true), None);
        assert_eq!(gather_spec(Some(&c), true, true), None);
        let all = Compress {
            scope: Scope::All,
            ..c
        };
        assert_eq!(gather_spec(Some(&all), false, true), Some(fp8));
        assert_eq!(gather_spec(Some(&all), true, true), None);
        let push_only = Compress { gather: None, ..c };
        assert_eq!(gather_spec(Some(&push_only), false, false), None);
        assert_eq!(gather_spec(None, false, false), None);
    }

    #[test]
    fn a_quantised_copy_is_whole_blocks_of_its_shard_in_runs() {
        let fp8 = Spec::new(Format::Fp8E4m3, 32).unwrap();
        // 32 + 4 bytes a block: 7 blocks (224 elements, 252 bytes) a run.
        let q = QuantCopy::new(fp8, 256, 501);
        assert_eq!((q.run, q.stride()), (224, 252));
        assert_eq!(q.runs(), 3);
        assert_eq!(q.elems(2), 448..501);
        // The last run: 53 elements, 2 blocks (the last one short).
        assert_eq!(q.bytes(2), 2 * 4 + 53);
        assert_eq!(q.len(), 2 * 252 + 61);
        assert_eq!(q.covering(225), (2, 504));
        assert_eq!(q.covering(10_000), (3, q.len()));
        assert_eq!(q.covering(0), (0, 0));
        // No block fits the slot: one block a run.
        let tiny = QuantCopy::new(fp8, 20, 100);
        assert_eq!((tiny.run, tiny.runs()), (32, 4));
        let whole: usize = (0..tiny.runs()).map(|j| tiny.elems(j).len()).sum();
        assert_eq!(whole, 100);
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
