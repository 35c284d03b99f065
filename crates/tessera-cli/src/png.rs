//! A minimal PNG encoder for 8-bit grey and RGB images (`tessera sample`'s grids): no compression
//! (the zlib stream holds stored deflate blocks), which every PNG reader accepts; the images
//! are a few tens of KiB. No image crate is vendored, and this is all the format needs.

/// The PNG file of a `width × height` grey image (row-major bytes).
pub fn encode_grey(pixels: &[u8], width: usize, height: usize) -> Vec<u8> {
    encode(pixels, width, height, 1)
}

/// The PNG file of a `width × height` RGB image (row-major, interleaved bytes).
pub fn encode_rgb(pixels: &[u8], width: usize, height: usize) -> Vec<u8> {
    encode(pixels, width, height, 3)
}

fn encode(pixels: &[u8], width: usize, height: usize, channels: usize) -> Vec<u8> {
    assert_eq!(pixels.len(), width * height * channels, "one byte per channel and pixel");
    let mut raw = Vec::with_capacity((width * channels + 1) * height);
    for row in pixels.chunks(width * channels) {
        raw.push(0); // filter type None
        raw.extend_from_slice(row);
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend((width as u32).to_be_bytes());
    ihdr.extend((height as u32).to_be_bytes());
    // 8 bits, greyscale (0) or truecolour (2), deflate, adaptive filter, no interlace.
    ihdr.extend([8, if channels == 3 { 2 } else { 0 }, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &zlib_stored(&raw));
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// A zlib stream of stored (uncompressed) deflate blocks of at most 65535 bytes.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = data.chunks(65535).collect();
    for (i, block) in blocks.iter().enumerate() {
        out.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        out.extend(len.to_le_bytes());
        out.extend((!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    if blocks.is_empty() {
        out.extend([1, 0, 0, 0xff, 0xff]);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    out.extend(((b << 16) | a).to_be_bytes());
    out
}
