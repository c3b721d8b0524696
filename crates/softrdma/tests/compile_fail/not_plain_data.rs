// Only plain data goes into a registered buffer: bytes from the network must be a valid
// value of the type, which a String's are not.
use softrdma::managed::Buffer;
use softrdma::ProtectionDomain;

fn strings(pd: &ProtectionDomain) {
    let _ = Buffer::<String>::new(pd, 4);
}

fn main() {}
