"""An image folder of real photographs for the 128 px run, made from the two photos that ship
with scikit-learn (nothing is downloaded): random square crops of 160-420 px, some mirrored,
resized to 128 px, one subfolder per photo (two classes).

    python -m benchmarks.photos /tmp/photos --count 600
    # then params.yaml: data.source folder, data.path /tmp/photos, data.image_size 128,
    # data.channels 3, model.arch resnet

A small and repetitive set — two scenes — chosen because it is real camera data available
offline on every machine; it shows that the 128 px path works end to end, not what a
thousand-photo dataset would reach.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image
from sklearn.datasets import load_sample_images


def write_folder(out: Path, count: int, size: int = 128, seed: int = 0) -> None:
    """``count`` crops, half from each photo, as ``out/<photo>/<i>.png``."""
    rng = random.Random(seed)
    photos = load_sample_images()
    for name, array in zip(("china", "flower"), photos.images, strict=True):
        photo = Image.fromarray(array)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count // 2):
            side = rng.randint(160, min(420, *photo.size))
            left = rng.randint(0, photo.width - side)
            top = rng.randint(0, photo.height - side)
            crop = photo.crop((left, top, left + side, top + side))
            crop = crop.resize((size, size), Image.Resampling.LANCZOS)
            if rng.random() < 0.5:
                crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            crop.save(folder / f"{i:04d}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    write_folder(args.out, args.count)


if __name__ == "__main__":
    main()
