//! Node-level gradient aggregation (`cross_node = "node"`, full sharding
//! across nodes): a node's gradient for an owner on another node crosses
//! the network once, as the node's sum.
//!
//! The rules, for nodes of `G` ranks (rank `r` is local rank `r % G` of
//! node `r / G`):
//!
//! - **route** ([`server`]): a chunk for an owner on the client's node goes
//!   to that owner, as always; one for owner `(n', l)` on another node goes
//!   to the client's node-mate with local rank `l`, the owner's
//!   **aggregator** on this node, which adds it into its node buffer for
//!   that owner (the header names the owner). So every push stays inside
//!   the node, and rank `(n, l)` sums the node's gradients for the ranks of
//!   local rank `l` on the other nodes (its replicas, as hybrid sharding
//!   names them).
//! - **admission**: a node buffer takes chunks of the minibatch it is open
//!   for ([`super::admit`]); the aggregator opens it for `k + 1` once it
//!   pushed and cleared the sums of `k`.
//! - **when the sums go** ([`sums_ready`]): at the aggregator's finish of
//!   `k`, once every node-mate's done word reads `k` (each one's pushes of
//!   `k` acknowledged, so added), it pushes each buffer to its owner as
//!   chunks of minibatch `k`, and only after their acknowledgement tells
//!   that owner `done = k` ([`done_after_sums`]); to every other rank it
//!   says `done` at once, as without aggregation.
//! - **finality** ([`feeds`]): an owner's gradients of `k` are final when
//!   the done words of its node-mates and of its aggregators on the other
//!   nodes read `k`; the other remote ranks never push to it.
//! - **release** ([`releaser`]): the other remote ranks do not tell it
//!   `done` either. Their reads of its shard versions are released by
//!   their node's aggregator for it, whose done follows every done of its
//!   node, and each of those follows that rank's gathers. So a rank tells
//!   `done` to its node and its replicas alone: `G − 1 + N − 1` signals
//!   instead of `D − 1`.
//!
//! So a node sum of minibatch `k` reaches a remote owner only into an
//! accumulator open for `k`, and nothing is added twice: each chunk is
//! acknowledged once where it landed, each sum pushed once.

/// The rank a chunk from `client` for `owner` is pushed to, under node
/// aggregation with nodes of `local` ranks: `owner` itself on the client's
/// node, else the client's node-mate with the owner's local rank.
pub fn server(client: usize, owner: usize, local: usize) -> usize {
    let local = local.max(1);
    if client / local == owner / local {
        owner
    } else {
        (client / local) * local + owner % local
    }
}

/// Whether rank `me` adds a chunk that rank `client` pushed naming `owner`
/// (its header's owner field, any value a peer wrote) into its node buffer
/// for `owner`, with `nodes` nodes of `local` ranks: `owner` is a rank of
/// the job on another node with `me`'s local rank, and `client` is `me`'s
/// node-mate: exactly the chunks [`server`] routes to `me` for an owner on
/// another node. Any other is refused.
pub fn aggregates(me: usize, client: usize, owner: usize, nodes: usize, local: usize) -> bool {
    let local = local.max(1);
    owner / local < nodes
        && owner / local != me / local
        && owner % local == me % local
        && client / local == me / local
}

/// Whether `client`'s done word counts towards `owner`'s gradients being
/// final under node aggregation: a node-mate, or the owner's aggregator on
/// another node (same local rank).
pub fn feeds(owner: usize, client: usize, local: usize) -> bool {
    let local = local.max(1);
    client / local == owner / local || client % local == owner % local
}

/// Whether `client` may tell `peer` `done = k` only once its node sums of
/// `k` for `peer` are acknowledged: `peer` is on another node with the
/// client's local rank (the client aggregates its node's gradients for it).
pub fn done_after_sums(client: usize, peer: usize, local: usize) -> bool {
    let local = local.max(1);
    client / local != peer / local && client % local == peer % local
}

/// The rank whose done word releases `owner`'s shard versions from
/// `client`'s reads under node aggregation: `client`'s own on the owner's
/// node; on another node, the owner's aggregator there ([`server`]), which
/// says `done = k` only after every node-mate's done reads `k`
/// ([`sums_ready`]).
pub fn releaser(owner: usize, client: usize, local: usize) -> usize {
    let local = local.max(1);
    if client / local == owner / local {
        client
    } else {
        server(client, owner, local)
    }
}

/// The first node-mate (index within the node) whose done word, of the
/// node's `done` words in local-rank order, does not yet read `stamp`
/// (minibatch `k` + 1): the aggregator pushes its sums of `k` once there
/// is none.
pub fn sums_ready(done: impl IntoIterator<Item = u64>, stamp: u64) -> Option<usize> {
    super::lagging(done, stamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_stay_in_the_node_and_reach_the_owners_aggregator() {
        // Nodes of 4: ranks 0-3, 4-7, 8-11.
        assert_eq!(server(1, 2, 4), 2, "same node: the owner");
        assert_eq!(server(1, 6, 4), 2, "node 1's local rank 2, via rank 2");
        assert_eq!(server(9, 1, 4), 9, "the client aggregates for its replica");
        assert_eq!(server(9, 7, 4), 11);
        for client in 0..12 {
            for owner in 0..12 {
                let s = server(client, owner, 4);
                assert_eq!(s / 4, client / 4, "{client} -> {owner} leaves the node");
                assert_eq!(s % 4, owner % 4);
            }
        }
        // Nodes of one rank (never aggregated: `cross_node` resolves to
        // direct there): every owner is remote, its aggregator the client.
        assert_eq!(server(3, 5, 1), 3);
    }

    #[test]
    fn an_owner_waits_for_its_node_and_its_aggregators() {
        // Owner 6 (node 1, local 2): node-mates 4-7, aggregators 2 and 10.
        let feeding: Vec<usize> = (0..12).filter(|&c| feeds(6, c, 4)).collect();
        assert_eq!(feeding, vec![2, 4, 5, 6, 7, 10]);
        // Rank 2 tells 6 and 10 done only after its sums; everyone else at once.
        let after: Vec<usize> = (0..12).filter(|&p| done_after_sums(2, p, 4)).collect();
        assert_eq!(after, vec![6, 10]);
        // Every chunk's server is fed to its owner by the server's done.
        for client in 0..12 {
            for owner in 0..12 {
                assert!(feeds(owner, server(client, owner, 4), 4));
            }
        }
        // Owner 6's versions are released by its node-mates' own done
        // words and by its aggregators' for the ranks of their nodes.
        let released_by: Vec<usize> = (0..12).map(|c| releaser(6, c, 4)).collect();
        assert_eq!(released_by, vec![2, 2, 2, 2, 4, 5, 6, 7, 10, 10, 10, 10]);
        // The releasers are the ranks that feed it: a rank tells done to
        // its node and its replicas alone.
        for owner in 0..12 {
            for client in 0..12 {
                let r = releaser(owner, client, 4);
                assert!(feeds(owner, r, 4) && r / 4 == client / 4);
            }
        }
        assert_eq!(sums_ready([2, 2, 1, 2], 2), Some(2));
        assert_eq!(sums_ready([2, 3, 2, 2], 2), None);
    }
}
