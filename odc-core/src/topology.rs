//! Who is where: world size D, local ranks per node G, and the mapping from
//! a rank to its node and local rank. Pure arithmetic; owns no resources.

use crate::{Error, Result};

/// Placement of one rank in a job of `world` ranks, `local_world` per node.
///
/// Ranks are numbered node-major: node `n` holds ranks
/// `[n*G, (n+1)*G)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    rank: usize,
    world: usize,
    local_world: usize,
}

impl Topology {
    /// A topology where every rank runs on one node (the `shm` case).
    pub fn single_node(rank: usize, world: usize) -> Result<Topology> {
        Topology::new(rank, world, world)
    }

    /// A topology of `world` ranks, `local_world` per node.
    pub fn new(rank: usize, world: usize, local_world: usize) -> Result<Topology> {
        if world == 0 || local_world == 0 {
            return Err(Error::Config(format!(
                "world ({world}) and ranks per node ({local_world}) must be positive"
            )));
        }
        if world % local_world != 0 {
            return Err(Error::Config(format!(
                "world ({world}) is not a multiple of ranks per node ({local_world})"
            )));
        }
        if rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} out of range for world {world}"
            )));
        }
        Ok(Topology {
            rank,
            world,
            local_world,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// D, the number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// G, the number of ranks per node.
    pub fn local_world(&self) -> usize {
        self.local_world
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.world / self.local_world
    }

    /// The node that holds `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.local_world
    }

    /// The local rank of `rank` on its node.
    pub fn local_rank_of(&self, rank: usize) -> usize {
        rank % self.local_world
    }

    /// Whether `rank` shares a node with this rank.
    pub fn is_local(&self, rank: usize) -> bool {
        self.node_of(rank) == self.node_of(self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_ranks_to_nodes() {
        let t = Topology::new(5, 8, 4).unwrap();
        assert_eq!(t.nodes(), 2);
        assert_eq!(t.node_of(5), 1);
        assert_eq!(t.local_rank_of(5), 1);
        assert!(t.is_local(7) && !t.is_local(3));
        assert!(Topology::new(8, 8, 4).is_err());
        assert!(Topology::new(0, 6, 4).is_err());
        assert!(Topology::new(0, 0, 1).is_err());
        assert_eq!(Topology::single_node(1, 3).unwrap().nodes(), 1);
    }
}
