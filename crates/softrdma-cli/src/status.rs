//! Status tools: placeholder, being written.

/// Arguments of `softrdma devices`.
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {}
/// Arguments of `softrdma devinfo`.
#[derive(Debug, clap::Args)]
pub struct DevinfoArgs {}
/// Arguments of `softrdma stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {}
/// Arguments of `softrdma link`.
#[derive(Debug, clap::Args)]
pub struct LinkArgs {}

pub fn devices(_: &DevicesArgs) -> i32 {
    1
}
pub fn devinfo(_: &DevinfoArgs) -> i32 {
    1
}
pub fn stat(_: &StatArgs) -> i32 {
    1
}
pub fn link(_: &LinkArgs) -> i32 {
    1
}
