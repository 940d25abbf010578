//! Choosing the transport: `fabric` without the feature is a clear
//! configuration error, never a panic.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use odc_core::{Engine, EngineConfig, Error, FileStore, Topology, TransportKind};

#[test]
fn transport_names_parse() {
    assert_eq!(TransportKind::parse("fabric"), Some(TransportKind::Fabric));
    assert_eq!(TransportKind::parse(" SHM "), Some(TransportKind::Shm));
    assert_eq!(TransportKind::parse("ucx"), None);
    assert_eq!(TransportKind::Fabric.available(), cfg!(feature = "fabric"));
}

#[test]
fn fabric_without_the_feature_is_a_config_error() {
    if TransportKind::Fabric.available() {
        eprintln!("skipped: this build has the fabric transport");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::new(dir.path()).unwrap());
    let config = EngineConfig {
        transport: TransportKind::Fabric,
        ..Default::default()
    };
    match Engine::new(store, Topology::single_node(0, 1).unwrap(), config) {
        Err(Error::Config(msg)) => assert!(msg.contains("fabric"), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn per_peer_kinds_parse_and_auto_is_the_default() {
    assert_eq!(TransportKind::default(), TransportKind::Auto);
    assert_eq!(EngineConfig::default().transport, TransportKind::Auto);
    assert_eq!(TransportKind::parse("auto"), Some(TransportKind::Auto));
    assert_eq!(TransportKind::parse("Mixed"), Some(TransportKind::Mixed));
    assert_eq!(
        TransportKind::parse("shm+fabric"),
        Some(TransportKind::Mixed)
    );
    for kind in [
        TransportKind::Auto,
        TransportKind::Shm,
        TransportKind::Fabric,
        TransportKind::Mixed,
    ] {
        assert_eq!(TransportKind::parse(kind.name()), Some(kind));
    }
    let one = Topology::new(1, 4, 4).unwrap();
    let two = Topology::new(1, 4, 2).unwrap();
    assert_eq!(TransportKind::Auto.resolve(&one), TransportKind::Shm);
    assert_eq!(TransportKind::Auto.resolve(&two), TransportKind::Mixed);
    assert_eq!(TransportKind::Shm.resolve(&two), TransportKind::Shm);
    assert_eq!(TransportKind::Mixed.available(), cfg!(feature = "fabric"));
}

#[test]
fn auto_across_nodes_without_the_feature_is_a_config_error() {
    if TransportKind::Mixed.available() {
        eprintln!("skipped: this build has the fabric transport");
        return;
    }
    for kind in [TransportKind::Auto, TransportKind::Mixed] {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        let config = EngineConfig {
            transport: kind,
            ..Default::default()
        };
        // Rank 0 of two nodes of one rank each: it draws the job id itself.
        match Engine::new(store, Topology::new(0, 2, 1).unwrap(), config) {
            Err(Error::Config(msg)) => assert!(msg.contains("`fabric` feature"), "{msg}"),
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }
}
