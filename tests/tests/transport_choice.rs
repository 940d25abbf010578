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
