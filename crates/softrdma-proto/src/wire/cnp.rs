//! The RoCEv2 congestion notification packet: a BTH with BECN set, opcode 0x81, and 16
//! reserved bytes. softrdma does not react to CNPs (neither does rxe), but decodes them.

use super::fixed_view;

fixed_view!(
    /// A view of the 16 reserved bytes that follow a CNP's BTH.
    Cnp,
    16,
    "CNP reserved bytes"
);

impl<T: AsRef<[u8]>> Cnp<T> {
    /// Whether all 16 reserved bytes are zero, as senders must make them.
    pub fn reserved_is_zero(&self) -> bool {
        self.buffer.as_ref()[..16].iter().all(|&b| b == 0)
    }
}
