//! The bytes an array or a mipmapped array takes, from its descriptor:
//! what the quota reserves before the driver makes it.

use crate::sys::{
    CUDA_ARRAY3D_CUBEMAP, CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY3D_LAYERED, CUarray_format,
};

/// Bytes of one element of an array format; unknown (e.g. block-compressed
/// or packed video) formats are counted as 4, and the overhead measurement
/// picks up the difference.
fn element_bytes(format: CUarray_format) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => 4,
    }
}

/// Bytes of an array of the given shape; a zero height or depth means the
/// dimension is absent.
pub(super) fn array_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR) -> u64 {
    let faces = if descriptor.Flags & CUDA_ARRAY3D_CUBEMAP != 0 {
        6
    } else {
        1
    };
    // Layered or not, Depth multiplies: layers or the third dimension.
    element_bytes(descriptor.Format)
        .saturating_mul(u64::from(descriptor.NumChannels.max(1)))
        .saturating_mul(descriptor.Width.max(1) as u64)
        .saturating_mul(descriptor.Height.max(1) as u64)
        .saturating_mul(descriptor.Depth.max(1) as u64)
        .saturating_mul(faces)
}

/// Bytes of a mipmapped array: every level halves each present dimension
/// (layers and faces stay).
pub(super) fn mipmapped_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u64 {
    let layered = descriptor.Flags & CUDA_ARRAY3D_LAYERED != 0;
    let mut level = *descriptor;
    let mut total = 0u64;
    for _ in 0..levels.max(1) {
        total = total.saturating_add(array_bytes(&level));
        level.Width = (level.Width / 2).max(1);
        if level.Height > 0 {
            level.Height = (level.Height / 2).max(1);
        }
        if level.Depth > 0 && !layered {
            level.Depth = (level.Depth / 2).max(1);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(
        width: usize,
        height: usize,
        depth: usize,
        format: u32,
        channels: u32,
        flags: u32,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            Width: width,
            Height: height,
            Depth: depth,
            Format: format,
            NumChannels: channels,
            Flags: flags,
        }
    }

    #[test]
    fn array_sizes_follow_shape_format_and_flags() {
        let cases = [
            (shape(1024, 0, 0, 0x01, 1, 0), 1024),
            (shape(1024, 1024, 0, 0x20, 1, 0), 4 << 20),
            (shape(16, 16, 16, 0x10, 4, 0), 16 * 16 * 16 * 2 * 4),
            (
                shape(64, 64, 3, 0x03, 1, CUDA_ARRAY3D_LAYERED),
                64 * 64 * 3 * 4,
            ),
            (shape(32, 32, 0, 0x01, 1, CUDA_ARRAY3D_CUBEMAP), 32 * 32 * 6),
        ];
        for (descriptor, bytes) in cases {
            assert_eq!(array_bytes(&descriptor), bytes, "{descriptor:?}");
        }
    }

    #[test]
    fn mipmaps_sum_their_levels() {
        // 8x8 floats: 256 + 64 + 16 + 4 bytes.
        assert_eq!(mipmapped_bytes(&shape(8, 8, 0, 0x20, 1, 0), 4), 340);
        // Layers are not halved: 2 layers of 4 then 2 then 1 bytes.
        assert_eq!(
            mipmapped_bytes(&shape(4, 0, 2, 0x01, 1, CUDA_ARRAY3D_LAYERED), 3),
            14
        );
        assert_eq!(mipmapped_bytes(&shape(4, 0, 0, 0x01, 1, 0), 0), 4);
    }
}
