"""One thin entry point per dvc.yaml stage: ``python -m stages.NAME``."""
