//! The processing the server applies, with the `image` crate, and the test pictures.

use image::{GrayImage, ImageBuffer, Luma, Rgba, RgbaImage};

/// What the server does to the picture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    /// Gaussian blur (`image::imageops::blur`), RGBA in, RGBA out.
    Blur,
    /// Sobel edge magnitude of the grayscale picture, one byte per pixel out.
    Edges,
    /// Luma conversion (`image::imageops::grayscale`), one byte per pixel out.
    Gray,
}

impl Task {
    pub fn code(self) -> u32 {
        match self {
            Task::Blur => 1,
            Task::Edges => 2,
            Task::Gray => 3,
        }
    }

    pub fn from_code(c: u32) -> Option<Task> {
        [Task::Blur, Task::Edges, Task::Gray].into_iter().find(|t| t.code() == c)
    }

    /// Bytes per output pixel.
    pub fn out_channels(self) -> usize {
        match self {
            Task::Blur => 4,
            Task::Edges | Task::Gray => 1,
        }
    }
}

/// The result's raw bytes (RGBA8 or Luma8, row by row).
pub fn process(task: Task, sigma: f32, width: u32, height: u32, rgba: Vec<u8>) -> Option<Vec<u8>> {
    let img: RgbaImage = ImageBuffer::from_raw(width, height, rgba)?;
    Some(match task {
        Task::Blur => image::imageops::blur(&img, sigma).into_raw(),
        Task::Gray => image::imageops::grayscale(&img).into_raw(),
        Task::Edges => sobel(&image::imageops::grayscale(&img)).into_raw(),
    })
}

/// Gradient magnitude with the 3x3 Sobel kernels (borders replicate the edge pixel).
fn sobel(g: &GrayImage) -> GrayImage {
    let (w, h) = g.dimensions();
    let at = |x: i64, y: i64| -> i32 {
        let x = x.clamp(0, i64::from(w) - 1) as u32;
        let y = y.clamp(0, i64::from(h) - 1) as u32;
        i32::from(g.get_pixel(x, y)[0])
    };
    ImageBuffer::from_fn(w, h, |x, y| {
        let (x, y) = (i64::from(x), i64::from(y));
        let gx = at(x + 1, y - 1) + 2 * at(x + 1, y) + at(x + 1, y + 1)
            - at(x - 1, y - 1)
            - 2 * at(x - 1, y)
            - at(x - 1, y + 1);
        let gy = at(x - 1, y + 1) + 2 * at(x, y + 1) + at(x + 1, y + 1)
            - at(x - 1, y - 1)
            - 2 * at(x, y - 1)
            - at(x + 1, y - 1);
        let m = f64::from(gx * gx + gy * gy).sqrt() / 4.0;
        Luma([m.min(255.0) as u8])
    })
}

/// A Mandelbrot picture of any size, for runs with large images (`--size`).
pub fn mandelbrot(width: u32, height: u32) -> RgbaImage {
    ImageBuffer::from_fn(width, height, |x, y| {
        let cx = -2.2 + 3.2 * f64::from(x) / f64::from(width);
        let cy = -1.2 + 2.4 * f64::from(y) / f64::from(height);
        let (mut zx, mut zy, mut i) = (0.0f64, 0.0f64, 0u32);
        while i < 64 && zx * zx + zy * zy < 4.0 {
            (zx, zy) = (zx * zx - zy * zy + cx, 2.0 * zx * zy + cy);
            i += 1;
        }
        let t = f64::from(i) / 64.0;
        Rgba([(255.0 * t) as u8, (255.0 * t * t) as u8, (255.0 * (1.0 - t).sqrt()) as u8, 255])
    })
}

/// Writes the result bytes as a PNG.
pub fn save(
    task: Task,
    width: u32,
    height: u32,
    bytes: Vec<u8>,
    path: &std::path::Path,
) -> image::ImageResult<()> {
    if task.out_channels() == 4 {
        let img: RgbaImage = ImageBuffer::from_raw(width, height, bytes).expect("sized by the task");
        img.save(path)
    } else {
        let img: GrayImage = ImageBuffer::from_raw(width, height, bytes).expect("sized by the task");
        img.save(path)
    }
}
