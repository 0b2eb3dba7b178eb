"""ganpipe: a declarative, reproducible GAN training pipeline."""
