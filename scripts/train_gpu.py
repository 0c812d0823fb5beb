# SPDX-License-Identifier: Apache-2.0
"""Reference training job, GPU variant: the same ResNet-style CNN as train_cpu.py on CUDA, larger images by default.

    python scripts/train_gpu.py [--steps N] [--batch B] [--size PX] ...   (any train_cpu.py option)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_cpu  # noqa: E402

if __name__ == "__main__":
    train_cpu.main(["--device", "cuda", "--size", "128", "--batch", "64", "--width", "64", "--steps", "300",
                    *sys.argv[1:]])
