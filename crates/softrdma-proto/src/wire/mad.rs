//! The common header of management datagrams (MADs), which QP1 carries, and the names of
//! the connection manager's messages (`roce-wire.md` §11.1). The CM state machine and the
//! message bodies come with the connection manager.

use super::{be, check_len, Result};

/// Management class of the communication manager.
pub const MGMT_CLASS_CM: u8 = 0x07;

/// Length of every MAD on QP1.
pub const MAD_LEN: usize = 256;

/// The 24-byte common MAD header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MadHeader {
    /// Base version (1).
    pub base_version: u8,
    /// Management class (0x07 for CM).
    pub mgmt_class: u8,
    /// Class version (2 for CM).
    pub class_version: u8,
    /// Method (0x03, Send, for every CM message).
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class specific.
    pub class_specific: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// Attribute ID: the CM message type.
    pub attribute_id: u16,
    /// Attribute modifier.
    pub attribute_modifier: u32,
}

impl MadHeader {
    /// Length of the common header.
    pub const LEN: usize = 24;

    /// Parses the common header at the start of `b`.
    pub fn parse(b: &[u8]) -> Result<MadHeader> {
        check_len("MAD header", b, Self::LEN)?;
        Ok(MadHeader {
            base_version: b[0],
            mgmt_class: b[1],
            class_version: b[2],
            method: b[3],
            status: be::u16_at(b, 4),
            class_specific: be::u16_at(b, 6),
            transaction_id: be::u64_at(b, 8),
            attribute_id: be::u16_at(b, 16),
            attribute_modifier: be::u32_at(b, 20),
        })
    }

    /// Writes the common header (the two reserved bytes as zero).
    pub fn emit(&self, b: &mut [u8; 24]) {
        b[0] = self.base_version;
        b[1] = self.mgmt_class;
        b[2] = self.class_version;
        b[3] = self.method;
        be::put_u16(b, 4, self.status);
        be::put_u16(b, 6, self.class_specific);
        be::put_u64(b, 8, self.transaction_id);
        be::put_u16(b, 16, self.attribute_id);
        be::put_u16(b, 18, 0);
        be::put_u32(b, 20, self.attribute_modifier);
    }

    /// For a CM MAD, the message name (`REQ`, `REP`, ...).
    pub fn cm_message(&self) -> Option<&'static str> {
        if self.mgmt_class == MGMT_CLASS_CM {
            cm_attribute_name(self.attribute_id)
        } else {
            None
        }
    }
}

/// The name of a CM attribute ID.
pub fn cm_attribute_name(id: u16) -> Option<&'static str> {
    Some(match id {
        0x0001 => "ClassPortInfo",
        0x0010 => "REQ",
        0x0011 => "MRA",
        0x0012 => "REJ",
        0x0013 => "REP",
        0x0014 => "RTU",
        0x0015 => "DREQ",
        0x0016 => "DREP",
        0x0017 => "SIDR_REQ",
        0x0018 => "SIDR_REP",
        0x0019 => "LAP",
        0x001A => "APR",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_cm_req_header() {
        let b: [u8; 24] = [
            0x01, 0x07, 0x02, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x9e, 0x3c, 0x4a, 0x5b,
            0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ];
        let h = MadHeader::parse(&b).unwrap();
        assert_eq!((h.mgmt_class, h.method, h.attribute_id), (MGMT_CLASS_CM, 3, 0x10));
        assert_eq!(h.transaction_id, 0x1_9e3c_4a5b);
        assert_eq!(h.cm_message(), Some("REQ"));
        let mut out = [0xFFu8; 24];
        h.emit(&mut out);
        assert_eq!(out, b);
        assert!(MadHeader::parse(&b[..23]).is_err());
    }
}
