//! The cost of Lily's frame reader alone (`crates/rabbit/src/wire.rs`): the frames of `n`
//! deliveries as the broker sends them, read through [`Sanitizing`] in 128 KiB reads as lapin's
//! I/O loop reads, or plainly (the baseline, subtracted). Every run builds the frames of `total`
//! deliveries, so the difference of two runs is the reading alone.

use futures_util::io::{AsyncRead, BufReader, Cursor, copy_buf, sink};
use lily::testing::{Rewrites, Sanitizing};

/// The frames of delivery `tag`.
fn delivery(out: &mut Vec<u8>, tag: u64) {
    let frame = |out: &mut Vec<u8>, kind: u8, payload: &[u8]| {
        out.extend([kind, 0, 1]);
        out.extend(u32::try_from(payload.len()).expect("small").to_be_bytes());
        out.extend_from_slice(payload);
        out.push(0xCE);
    };
    let short = |out: &mut Vec<u8>, text: &str| {
        out.push(u8::try_from(text.len()).expect("short"));
        out.extend_from_slice(text.as_bytes());
    };
    let mut method = vec![0, 60, 0, 60];
    short(&mut method, "amq.ctag-Xq3CqkQf1Tn8c0vG6pWd2A");
    method.extend(tag.to_be_bytes());
    method.push(0);
    short(&mut method, "");
    short(&mut method, "lily-bench-cost");
    frame(out, 1, &method);

    let body = [b'x'; 512];
    let mut header = vec![0, 60, 0, 0];
    header.extend((body.len() as u64).to_be_bytes());
    // content_type, headers, delivery_mode, message_id, type
    header.extend(0b1011_0000_1010_0000u16.to_be_bytes());
    short(&mut header, "application/json");
    let mut table = Vec::new();
    short(&mut table, "x-schema-version");
    table.push(b'I');
    table.extend(1i32.to_be_bytes());
    short(&mut table, "traceparent");
    table.push(b'S');
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    table.extend(u32::try_from(trace.len()).expect("small").to_be_bytes());
    table.extend_from_slice(trace.as_bytes());
    header.extend(u32::try_from(table.len()).expect("small").to_be_bytes());
    header.extend(table);
    header.push(2);
    short(&mut header, &format!("order-{tag:08}"));
    short(&mut header, "order.placed");
    frame(out, 2, &header);
    frame(out, 3, &body);
}

/// The `reader` child: builds the frames of `total` deliveries, reads those of the first `n`
/// (through the rewriter unless `plain`) in 128 KiB reads; the bytes read.
pub fn child(total: usize, n: usize, plain: bool) -> Result<u64, String> {
    let (mut wire, mut len) = (Vec::new(), 0);
    for tag in 1..=total {
        delivery(&mut wire, tag as u64);
        if tag == n {
            len = wire.len();
        }
    }
    wire.truncate(len);
    let read = crate::runtime(false).block_on(async {
        if plain {
            read_all(Cursor::new(wire)).await
        } else {
            read_all(Sanitizing::new(Cursor::new(wire), Rewrites::default())).await
        }
    });
    match read {
        Ok(read) if read == len as u64 => Ok(read),
        other => Err(format!("read {other:?} of {len} bytes")),
    }
}

/// Reads `stream` to its end in 128 KiB reads, as lapin's I/O loop reads; the bytes read.
async fn read_all(stream: impl AsyncRead + Unpin) -> std::io::Result<u64> {
    copy_buf(BufReader::with_capacity(128 * 1024, stream), &mut sink()).await
}
