//! ODC engine (filled by the engine work).
