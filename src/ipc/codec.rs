//! Typed messages in frames: serde with `postcard`, bounded, trailing bytes refused.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::frame::{ipc_error, MAX_FRAME};
use crate::error::Result;

/// Encode `msg`; a message larger than [`MAX_FRAME`] bytes is an error.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let bytes = postcard::to_stdvec(msg).map_err(|e| ipc_error("encode", e.to_string()))?;
    if bytes.len() > MAX_FRAME {
        return Err(ipc_error(
            "encode",
            format!("message of {} bytes ({MAX_FRAME} allowed)", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// Decode one whole message from `bytes`. Malformed input, or bytes left over after the
/// message, is an error (never a panic; allocations are bounded by the input's length).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    if bytes.len() > MAX_FRAME {
        return Err(ipc_error(
            "decode",
            format!("message of {} bytes ({MAX_FRAME} allowed)", bytes.len()),
        ));
    }
    let (msg, rest) = postcard::take_from_bytes(bytes)
        .map_err(|e| ipc_error("decode", format!("{e} ({} bytes)", bytes.len())))?;
    if !rest.is_empty() {
        return Err(ipc_error(
            "decode",
            format!(
                "{} bytes left over after a message of {}",
                rest.len(),
                bytes.len() - rest.len()
            ),
        ));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    enum Msg {
        A { name: String, n: u64 },
        B(Vec<u32>),
    }

    #[test]
    fn round_trip_and_refusals() {
        let m = Msg::A {
            name: "x".into(),
            n: u64::MAX,
        };
        let b = encode(&m).unwrap();
        assert_eq!(decode::<Msg>(&b).unwrap(), m);
        let mut extra = b.clone();
        extra.push(0);
        assert!(decode::<Msg>(&extra)
            .unwrap_err()
            .to_string()
            .contains("1 bytes left over"));
        assert!(decode::<Msg>(&b[..b.len() - 1]).is_err());
        assert!(decode::<Msg>(&[9]).is_err());
        // A length prefix of 2^35 elements in a 6-byte message: refused, nothing allocated.
        assert!(decode::<Msg>(&[1, 0x80, 0x80, 0x80, 0x80, 0x7f]).is_err());
        let big = Msg::B(vec![u32::MAX; MAX_FRAME]);
        assert!(encode(&big).is_err());
    }
}
