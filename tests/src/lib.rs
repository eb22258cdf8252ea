//! ferry-tests
